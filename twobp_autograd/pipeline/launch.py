"""Starting ranks, one way for the commands, the benchmarks and the tests.

A per-rank entry point runs as ``torchrun`` would run it: in this process when launched by
it, else on local ranks spawned with the same environment (rendezvous on 127.0.0.1), so that
one command works both ways. Spawned ranks are waited for with an optional deadline, past
which they are killed: a hung rank never hangs its caller.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import os
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .runtime import init_distributed

__all__ = ["free_port", "spawn_ranks", "run_as_ranks", "RanksFailed", "threads_per_rank", "process_group"]


class RanksFailed(RuntimeError):
    """Local ranks that :func:`run_as_ranks` spawned exited with an error (each printed its own)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(
    target: Callable[..., None],
    nprocs: int,
    args: tuple[Any, ...] = (),
    *,
    deadline: float | None = None,
    stop_on_failure: bool = True,
) -> list[int | None]:
    """``target(rank, *args)`` in ``nprocs`` spawned processes; returns their exit codes.

    With ``stop_on_failure``, the first rank that fails ends the others (its peers would wait
    for it until their timeout). Past ``deadline`` seconds, the ranks still running are
    killed and :class:`TimeoutError` names them."""
    context = mp.get_context("spawn")
    ranks = [context.Process(target=target, args=(rank, *args)) for rank in range(nprocs)]
    for process in ranks:
        process.start()
    end = None if deadline is None else time.monotonic() + deadline
    try:
        running = list(ranks)
        while running:
            timeout = None if end is None else max(0.0, end - time.monotonic())
            if not multiprocessing.connection.wait([p.sentinel for p in running], timeout):
                hung = [rank for rank, process in enumerate(ranks) if process in running]
                raise TimeoutError(f"ranks {hung} still running after {deadline} s")
            running = [process for process in running if process.exitcode is None]
            if stop_on_failure and any(process.exitcode for process in ranks):
                break
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
            process.join()
    return [process.exitcode for process in ranks]


def run_as_ranks(rank_main: Callable[[Any], None], args: Any, nprocs: int) -> None:
    """``rank_main(args)`` on every rank: here under torchrun (``RANK`` set), else on
    ``nprocs`` spawned local ranks. The caller's environment is left as it was."""
    if "RANK" in os.environ:
        rank_main(args)
        return
    if nprocs < 1:
        raise ValueError(f"twobp: run_as_ranks needs at least one rank, got nprocs={nprocs}")
    rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(nprocs)}
    saved = {name: os.environ.get(name) for name in rendezvous}
    os.environ.update(rendezvous)  # the spawned ranks inherit it
    try:
        codes = spawn_ranks(_spawned_rank, nprocs, (rank_main, args))
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    failed = {rank: code for rank, code in enumerate(codes) if code}
    if failed:
        raise RanksFailed(f"local ranks failed (rank: exit code) {failed}; their errors are printed above")


def threads_per_rank(world: int, requested: int | None = None) -> int:
    """``requested``, else torchrun's ``OMP_NUM_THREADS``, else the cores shared among the
    local ranks (more would make the ranks' thread pools thrash each other)."""
    return requested or int(os.environ.get("OMP_NUM_THREADS", "0")) or max(1, (os.cpu_count() or 1) // world)


@contextlib.contextmanager
def process_group(*, timeout: float, backend: str | None = None, threads: int | None = None) -> Iterator[torch.device]:
    """Inside a rank: its share of the cores (:func:`threads_per_rank`), the process group
    torchrun's environment describes (gloo on CPU, NCCL on CUDA, ``timeout`` seconds for every
    collective) for the block, and the rank's device."""
    torch.set_num_threads(threads_per_rank(int(os.environ["WORLD_SIZE"]), threads))
    device = init_distributed(timeout=timeout, backend=backend)
    try:
        yield device
    finally:
        dist.destroy_process_group()


def _spawned_rank(rank: int, rank_main: Callable[[Any], None], args: Any) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    rank_main(args)
