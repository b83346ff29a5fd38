"""Spawned local ranks for the distributed tests (the package's own spawner): wait with a
deadline and fail (never hang) if a rank is still running; then read what each rank wrote."""

from __future__ import annotations

import datetime
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from twobp_autograd.pipeline.launch import spawn_ranks


def gloo_rank_main(rank: int, world: int, scenario: Callable[[int], Any], store_path: str, result_path: str) -> None:
    """A spawned rank: join a gloo group through a file store, run ``scenario(rank)`` and save
    its result (or the traceback) at ``result_path.<rank>`` for :func:`read_results`."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1")
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store_path, world),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        result = scenario(rank)
    except BaseException:  # noqa: BLE001 - reported to the test process
        result = {"crash": traceback.format_exc()}
    torch.save(result, f"{result_path}.{rank}")
    os._exit(0)  # no destroy_process_group: after a failure it could wait on a dead peer


def run_ranks(target: Callable[..., None], world: int, args: tuple, deadline: float, what: str = "") -> None:
    """``target(rank, *args)`` in ``world`` spawned processes, all waited for (a rank that
    dies is for the test to notice); kills them and fails on a hang."""
    try:
        spawn_ranks(target, world, args, deadline=deadline, stop_on_failure=False)
    except TimeoutError as error:
        raise AssertionError(f"{error}{what}") from None


def run_scenario(scenario: Callable[[int], Any], world: int, directory: str, deadline: float = 120.0) -> list[Any]:
    """``scenario(rank)`` (a module-level function or a partial of one) on ``world`` spawned gloo
    ranks, files in ``directory``; each rank's result, none of them a crash."""
    store, results = os.path.join(directory, "store"), os.path.join(directory, "result")
    run_ranks(gloo_rank_main, world, (world, scenario, store, results), deadline)
    return read_results(results, world)


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
