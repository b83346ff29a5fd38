"""Block costs: parameter counts, measured times that leave the model as it was, and measured
times every rank agrees on."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import twobp_autograd as twobp
from tests.ranks import gloo_rank_main, read_results, run_ranks
from twobp_autograd.patching import DeferredForwardCall
from twobp_autograd.pipeline.split import agreed_block_costs, measure_block_costs, parameter_costs


def small_net() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(4, 32), nn.BatchNorm1d(32), nn.ReLU(),
        nn.Linear(32, 8), nn.ReLU(), nn.Linear(8, 2),
    )  # fmt: skip


def test_parameter_costs_count_parameters() -> None:
    assert parameter_costs(small_net()) == [4 * 32 + 32 + 1, 64 + 1, 1, 32 * 8 + 8 + 1, 1, 8 * 2 + 2 + 1]


def test_measuring_leaves_grads_and_buffers_as_they_were() -> None:
    model = small_net().train()
    before = {name: b.clone() for name, b in model.named_buffers()}
    costs = measure_block_costs(list(model), torch.randn(6, 4), repeats=1)
    assert len(costs) == len(model) and all(c > 0 for c in costs)
    assert all(p.grad is None for p in model.parameters())
    for name, b in model.named_buffers():
        torch.testing.assert_close(b, before[name], rtol=0, atol=0, msg=name)


def test_measuring_with_2bp_times_the_patched_blocks_and_their_flush_then_unpatches() -> None:
    model = small_net().train()
    before = {name: b.clone() for name, b in model.named_buffers()}
    costs = measure_block_costs(list(model), torch.randn(6, 4), repeats=1, twobp=True)
    assert len(costs) == len(model) and all(c > 0 for c in costs)
    assert all(p.grad is None for p in model.parameters())  # the flushed W went nowhere it stays
    assert not any(isinstance(m.__dict__.get("forward"), DeferredForwardCall) for m in model.modules())
    assert not twobp.pending().jobs
    for name, b in model.named_buffers():
        torch.testing.assert_close(b, before[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("twobp_on", [False, True], ids=["plain", "2bp"])
def test_measuring_leaves_gradients_held_mid_accumulation_as_they_were(twobp_on: bool) -> None:
    """The gradients were put back as the tensors they were, but the measuring backwards had
    accumulated into those tensors in place (a bias gradient of 3 came back as 12)."""
    model = small_net().double().train()
    model(torch.randn(6, 4, dtype=torch.float64)).sum().backward()
    before = {name: p.grad.clone() for name, p in model.named_parameters()}
    measure_block_costs(list(model), torch.randn(6, 4, dtype=torch.float64), repeats=1, twobp=twobp_on)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, before[name], rtol=0, atol=0, msg=name)


def test_measuring_with_2bp_leaves_the_callers_patch_in_place() -> None:
    """It unpatched every module of the blocks after timing them, the caller's patch too: the
    model trained on plain autograd from then on, with no word."""
    model = twobp.patch(small_net().train(), exclude=[nn.BatchNorm1d])
    measure_block_costs(list(model), torch.randn(6, 4), repeats=1, twobp=True)
    assert isinstance(model[0].__dict__.get("forward"), DeferredForwardCall)
    assert not isinstance(model[1].__dict__.get("forward"), DeferredForwardCall)  # the caller's exclude kept
    model(torch.randn(6, 4)).sum().backward()
    assert model[0].weight.grad is None and twobp.pending().jobs > 0
    twobp.flush_weight_grads()


def _agree(rank: int) -> list[float]:
    # Rank 1 measures on a batch 64 times larger: its own times would cut elsewhere.
    return agreed_block_costs(list(small_net()), torch.randn(6 * (1 + 63 * rank), 4))


def test_ranks_agree_on_the_mean_of_their_measured_costs(tmp_path) -> None:
    store, results = os.path.join(tmp_path, "store"), os.path.join(tmp_path, "result")
    run_ranks(gloo_rank_main, 2, (2, _agree, store, results), 60.0)
    first, second = read_results(results, 2)
    assert first == second and len(first) == 6 and all(c > 0 for c in first)


class _LazyCache(nn.Module):
    """A rotary-style cache registered empty and built by the first forward."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("cache", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cache is None or self.cache.shape[0] < x.shape[0]:
            self.cache = torch.arange(x.shape[0], dtype=x.dtype).unsqueeze(1)
        return self.linear(x) + self.cache[: x.shape[0]]


@pytest.mark.parametrize("twobp_on", [False, True], ids=["plain", "2bp"])
def test_measuring_a_block_that_builds_a_buffer_in_its_forward(twobp_on: bool) -> None:
    """Buffers were put back by the identity of those found before: one the forward assigned
    anew had none, and measuring raised KeyError (leaving the rest unrestored)."""
    model = nn.Sequential(_LazyCache(), nn.ReLU(), nn.Linear(4, 2))
    costs = measure_block_costs(list(model), torch.randn(6, 4), repeats=1, twobp=twobp_on)
    assert len(costs) == 3 and all(cost > 0 for cost in costs)
    assert model[0].cache is None  # as it was
