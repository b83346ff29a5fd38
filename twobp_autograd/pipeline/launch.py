"""Run a per-rank entry point as ``torchrun`` would: in this process when launched by it, else
on local ranks spawned with the same environment (rendezvous on 127.0.0.1), so that one
command works both ways."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

__all__ = ["run_as_ranks", "threads_per_rank"]


def run_as_ranks(rank_main: Callable[[Any], None], args: Any, nprocs: int) -> None:
    """``rank_main(args)`` on every rank: here under torchrun (``RANK`` set), else on
    ``nprocs`` spawned local ranks. The caller's environment is left as it was."""
    if "RANK" in os.environ:
        rank_main(args)
        return
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(nprocs)}
    saved = {name: os.environ.get(name) for name in rendezvous}
    os.environ.update(rendezvous)  # the spawned ranks inherit it
    try:
        mp.spawn(_spawned_rank, args=(rank_main, args), nprocs=nprocs, join=True)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def threads_per_rank(world: int, requested: "int | None" = None) -> int:
    """``requested``, else torchrun's ``OMP_NUM_THREADS``, else the cores shared among the
    local ranks (more would make the ranks' thread pools thrash each other)."""
    return requested or int(os.environ.get("OMP_NUM_THREADS", "0")) or max(1, (os.cpu_count() or 1) // world)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned_rank(rank: int, rank_main: Callable[[Any], None], args: Any) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    rank_main(args)
