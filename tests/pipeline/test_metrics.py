"""A step's figures from its ranks' metrics, and the clock that times each action."""

from __future__ import annotations

import time

import pytest
import torch

from twobp_autograd.pipeline.actions import F, I
from twobp_autograd.pipeline.metrics import RankMetrics, StepReport, StepTimer


def _rank(
    rank: int, step_time: float, receive_wait: float, loss: float | None = None, first: int = 0
) -> RankMetrics:
    return RankMetrics(
        rank=rank, step_time=step_time, receive_wait=receive_wait, events=[], samples=8 if rank == first else 0,
        deferred_jobs=0, peak_bytes=0, peak_rss=0, loss=loss,
    )  # fmt: skip


def test_step_report_idle_is_waits_plus_finishing_early() -> None:
    report = StepReport([_rank(0, 2.0, 0.5), _rank(1, 1.5, 0.25, loss=0.75)])
    assert report.step_time == 2.0
    assert report.idle == [0.5, 0.75]
    assert report.bubble_ratio == pytest.approx(1.25 / 4.0)
    assert report.throughput == 4.0  # 8 samples in 2 s
    assert report.loss == 0.75


def test_step_report_counts_the_samples_of_the_rank_holding_stage_0_wherever_it_is() -> None:
    """A placement with stage 0 on rank 1: the throughput read rank 0's samples, none."""
    report = StepReport([_rank(0, 2.0, 0.5, loss=0.75, first=1), _rank(1, 1.5, 0.25, first=1)])
    assert report.throughput == 4.0


def test_step_timer_starts_an_event_when_its_message_arrived() -> None:
    timer = StepTimer(rank=1, device=torch.device("cpu"))
    timer.action_starts()
    timer.action_ends(F(0))
    timer.action_starts()
    waiting_since = time.perf_counter()
    time.sleep(0.02)
    timer.waited(waiting_since)
    timer.action_ends(I(0))
    forward, backward = timer.events
    assert (forward.rank, forward.action, backward.action) == (1, F(0), I(0))
    assert backward.start - forward.end >= 0.02 and timer.receive_wait >= 0.02
    assert timer.elapsed() >= backward.end


def test_bench_table_says_which_peak_rss_it_shows() -> None:
    """Where a rank could not reset its high-water mark, the figure is the process's peak since
    it started (the same for every row): the table and the JSON say so."""
    import argparse

    from twobp_autograd.pipeline.bench_report import _summarise, _table

    args = argparse.Namespace(model="mlp", steps=1, warmup=0)
    for scope, label in (("step", "step peak RSS MiB"), ("process", "process peak RSS MiB")):
        ranks = [_rank(0, 2.0, 0.5), _rank(1, 1.5, 0.25, loss=0.75)]
        ranks[1].peak_rss_scope = scope
        rows = _summarise({("gpipe", False): [StepReport(ranks)]}, {"gpipe": 2}, 8)
        assert rows[0]["peak_rss_scope"] == scope
        table = _table(rows, args, 2, torch.device("cpu"), 1)
        assert label in table
        assert ("since its process started" in table) == (scope == "process")
