"""Spawned local ranks for the distributed tests: start, wait with a deadline, and fail (never
hang) if a rank is still running; then read what each rank wrote."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp


def run_ranks(target: Callable[..., None], world: int, args: tuple, deadline: float, what: str = "") -> None:
    """``target(rank, *args)`` in ``world`` spawned processes; kills and fails on a hang."""
    context = mp.get_context("spawn")
    ranks = [context.Process(target=target, args=(rank, *args)) for rank in range(world)]
    for process in ranks:
        process.start()
    end = time.monotonic() + deadline
    for process in ranks:
        process.join(max(0.0, end - time.monotonic()))
    hung = [rank for rank, process in enumerate(ranks) if process.is_alive()]
    for process in ranks:
        if process.is_alive():
            process.kill()
            process.join()
    assert not hung, f"ranks {hung} still running after {deadline} s{what}"


def read_results(prefix: str, world: int, *, required: bool = True) -> list[Any]:
    """Each rank's ``torch.save``d result at ``prefix.<rank>`` (None if absent and not required);
    a required result must exist and must not report a crash."""
    found = []
    for rank in range(world):
        path = f"{prefix}.{rank}"
        if not os.path.exists(path):
            assert not required, f"rank {rank} wrote no result"
            found.append(None)
            continue
        result = torch.load(path, weights_only=False)
        if required:
            assert "crash" not in result, f"rank {rank} crashed:\n{result['crash']}"
        found.append(result)
    return found
