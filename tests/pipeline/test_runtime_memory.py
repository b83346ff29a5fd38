"""The runtime under a bounded queue (``max_pending_bytes``): the pending bytes it reports stay
under the cap, work still stays pending (the cap is not met by deferring nothing), and the
gradients still equal one process. Two gloo ranks, 1F1B-2, spawned once."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.ranks import run_scenario
from tests.test_data_parallel import _assert_same, _grads
from twobp_autograd import WeightGradQueue
from twobp_autograd.pipeline import PipelineRuntime, RankMetrics, StepReport, split_model
from twobp_autograd.pipeline.schedules import schedule

WORLD, MICRO_BATCHES = 2, 4
CAP = 1024  # bytes: a few jobs of the model below, half of what a step queues


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 4))


def _capped_and_uncapped(rank: int) -> dict:
    result = {}
    for name, cap in (("capped", CAP), ("uncapped", None)):
        torch.manual_seed(0)
        model = _mlp()
        reference = copy.deepcopy(model)
        stage = split_model(model, WORLD)[rank]
        runtime = PipelineRuntime(
            stage, schedule("1f1b-2", WORLD, MICRO_BATCHES, True)[rank], num_micro_batches=MICRO_BATCHES,
            loss_fn=F.mse_loss, queue=WeightGradQueue(max_pending_bytes=cap), timeout=30.0,
        )  # fmt: skip
        g = torch.Generator().manual_seed(1)
        inputs, targets = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        report = runtime.step(inputs if rank == 0 else None, targets if rank == WORLD - 1 else None)
        own = report.ranks[rank] if isinstance(report, StepReport) else report
        assert isinstance(own, RankMetrics)
        for x, y in zip(inputs.tensor_split(MICRO_BATCHES), targets.tensor_split(MICRO_BATCHES), strict=True):
            (F.mse_loss(reference(x), y) / MICRO_BATCHES).backward()
        result[name] = {
            "peak_pending_bytes": own.peak_pending_bytes,
            "deferred_jobs": own.deferred_jobs,
            "grads": (_grads(stage), _grads(split_model(reference, WORLD)[rank])),
        }
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_scenario(_capped_and_uncapped, WORLD, str(tmp_path_factory.mktemp("cap")))


@pytest.mark.parametrize("rank", range(WORLD))
def test_reported_pending_bytes_stay_under_the_cap(runs: list[dict], rank: int) -> None:
    capped, uncapped = runs[rank]["capped"], runs[rank]["uncapped"]
    assert uncapped["peak_pending_bytes"] > CAP, "the cap binds nothing here: make it smaller"
    assert 0 < capped["peak_pending_bytes"] <= CAP
    assert capped["deferred_jobs"] > 0


@pytest.mark.parametrize("rank", range(WORLD))
@pytest.mark.parametrize("run", ["capped", "uncapped"])
def test_bounded_queue_keeps_the_gradients(runs: list[dict], rank: int, run: str) -> None:
    _assert_same(*runs[rank][run]["grads"], f"rank {rank} {run}")
