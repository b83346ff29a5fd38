"""The one way ranks are started: exit codes back, a failing rank ends its peers, a hung one
is killed at the deadline, and run_as_ranks reports failures and restores the environment."""

from __future__ import annotations

import os
import sys
import time

import pytest

from twobp_autograd.pipeline.launch import run_as_ranks, spawn_ranks


def _fail_first_or_wait(rank: int, seconds: float) -> None:
    if rank == 0:
        sys.exit(3)
    time.sleep(seconds)


def _sleep(rank: int, seconds: float) -> None:
    time.sleep(seconds)


def _fail_on_rank_one(args: None) -> None:
    if os.environ["RANK"] == "1":
        raise SystemExit(5)


def test_a_failing_rank_ends_its_peers_and_a_hung_one_is_killed_at_the_deadline() -> None:
    start = time.monotonic()
    codes = spawn_ranks(_fail_first_or_wait, 2, (60.0,))
    assert codes[0] == 3 and codes[1] != 0 and time.monotonic() - start < 30
    assert spawn_ranks(_fail_first_or_wait, 2, (0.1,), stop_on_failure=False) == [3, 0]
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] still running after 1.0 s"):
        spawn_ranks(_sleep, 2, (60.0,), deadline=1.0)
    assert time.monotonic() - start < 30


def test_run_as_ranks_reports_failed_ranks_and_restores_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    # Rank 0 may have been ended (-9) or have exited cleanly by the time rank 1's failure is seen.
    with pytest.raises(RuntimeError, match=r"[{ ]1: 5[,}]"):
        run_as_ranks(_fail_on_rank_one, None, 2)
    assert not {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"} & set(os.environ)
