"""Run a benchmark function on a few local gloo ranks (spawned processes on 127.0.0.1), each
with its share of the cores: what the two-rank benchmarks here have in common."""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_on_local_ranks"]


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


def run_on_local_ranks(benchmark: Callable[[int, Any], Any], args: Any, world: int, threads: "int | None" = None) -> None:
    """``benchmark(rank, args)`` on ``world`` spawned gloo ranks; ``threads`` each (default:
    the cores divided among the ranks)."""
    mp.spawn(_rank_main, args=(world, _free_port(), threads, benchmark, args), nprocs=world, join=True)
