"""What the benchmarks here have in common: the models of ``bench pipeline`` and their
options, a benchmark function run on a few local gloo ranks (the package's own launcher),
each with its share of the cores, and its results written with the environment they were
measured in."""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from twobp_autograd.pipeline import zoo
from twobp_autograd.pipeline.launch import process_group, run_as_ranks

__all__ = ["add_model_arguments", "run_on_local_ranks", "write_results"]


def add_model_arguments(parser: argparse.ArgumentParser, *, batch_size: int, batch_help: str | None = None) -> None:
    """The model options of ``bench pipeline``'s zoo (an MLP by default), and threads per rank."""
    zoo.add_model_arguments(parser, batch_size=batch_size, batch_help=batch_help)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads per rank (default: cores / ranks)")


def run_on_local_ranks(benchmark: Callable[[int, Any], Any], args: Any, world: int) -> None:
    """``benchmark(rank, args)`` on ``world`` spawned gloo ranks, ``args.threads`` each
    (default: the cores divided among the ranks)."""
    run_as_ranks(functools.partial(_rank_main, benchmark), args, world)


def _rank_main(benchmark: Callable[[int, Any], Any], args: Any) -> None:
    with process_group(timeout=600.0, backend="gloo", threads=args.threads):
        benchmark(dist.get_rank(), args)


def write_results(path: str, world: int, document: dict[str, Any]) -> None:
    """``document`` as JSON at ``path``, with the world size, torch version and machine."""
    environment = {
        "world_size": world,
        "torch": torch.__version__,
        "machine": platform.platform(),
        "cpu_count": os.cpu_count(),
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as file:
        json.dump({**environment, **document}, file, indent=2)
    print(f"wrote {path}")
