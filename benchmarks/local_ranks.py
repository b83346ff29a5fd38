"""What the two-rank benchmarks here have in common: running a benchmark function on a few
local gloo ranks (spawned processes on 127.0.0.1), each with its share of the cores, and
writing its results with the environment they were measured in."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["add_model_arguments", "run_on_local_ranks", "write_results"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, threads: "int | None", benchmark: Callable[..., Any], args: Any) -> None:
    torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600)
    )
    try:
        benchmark(rank, args)
    finally:
        dist.destroy_process_group()


def add_model_arguments(parser: argparse.ArgumentParser, *, batch_size: int, batch_help: "str | None" = None) -> None:
    """The model options of ``bench pipeline``'s ``build_model`` (an MLP by default)."""
    from twobp_autograd.pipeline.bench import MODELS

    parser.add_argument("--model", choices=MODELS, default="mlp")
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--depth", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=batch_size, help=batch_help)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads per rank (default: cores / ranks)")


def run_on_local_ranks(benchmark: Callable[[int, Any], Any], args: Any, world: int, threads: "int | None" = None) -> None:
    """``benchmark(rank, args)`` on ``world`` spawned gloo ranks; ``threads`` each (default:
    the cores divided among the ranks)."""
    mp.spawn(_rank_main, args=(world, _free_port(), threads, benchmark, args), nprocs=world, join=True)


def write_results(path: str, world: int, document: dict[str, Any]) -> None:
    """``document`` as JSON at ``path``, with the world size, torch version and machine."""
    environment = {"world_size": world, "torch": torch.__version__, "machine": platform.platform(), "cpu_count": os.cpu_count()}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as file:
        json.dump({**environment, **document}, file, indent=2)
    print(f"wrote {path}")
