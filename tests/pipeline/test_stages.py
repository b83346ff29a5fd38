"""Stage splitting: blocks that compose to the model, balanced contiguous cuts, shared parameters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from twobp_autograd.pipeline.stages import (
    blocks_of,
    measure_block_costs,
    parameter_costs,
    partition,
    split,
    stage_for_rank,
)

torchvision = pytest.importorskip("torchvision")


def small_net() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(4, 32), nn.BatchNorm1d(32), nn.ReLU(),
        nn.Linear(32, 8), nn.ReLU(), nn.Linear(8, 2),
    )  # fmt: skip


def run_through(stages, x: torch.Tensor) -> torch.Tensor:
    for stage in stages:
        x = stage(x)
    return x


PARTITIONS = [
    ([1, 1, 1, 1], 2, [(0, 2), (2, 4)]),
    ([4, 1, 1, 1, 1], 2, [(0, 1), (1, 5)]),
    ([1, 2, 3, 4, 5, 6, 7, 8, 9], 3, [(0, 5), (5, 7), (7, 9)]),
    ([5, 5, 5], 3, [(0, 1), (1, 2), (2, 3)]),
    ([3, 1, 4], 1, [(0, 3)]),
]


@pytest.mark.parametrize("costs,num_stages,expected", PARTITIONS, ids=[f"{len(c)}blocks-{p}stages-{i}" for i, (c, p, _) in enumerate(PARTITIONS)])
def test_partition_minimises_the_costliest_stage(costs, num_stages, expected) -> None:
    assert [(r.start, r.stop) for r in partition(costs, num_stages)] == expected


@pytest.mark.parametrize("num_stages", [0, 4])
def test_partition_refuses_impossible_cuts(num_stages: int) -> None:
    with pytest.raises(ValueError, match="non-empty stages"):
        partition([1.0, 2.0, 3.0], num_stages)


def test_sequential_blocks_are_its_children() -> None:
    model = small_net()
    assert all(a is b for a, b in zip(blocks_of(model), model, strict=True))


def test_resnet_blocks_compose_to_its_forward() -> None:
    model = torchvision.models.resnet18(num_classes=5).eval()
    blocks = blocks_of(model)
    assert len(blocks) == 1 + 8 + 1  # stem, the residual blocks, pooled head
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(run_through(blocks, x), model(x), rtol=0, atol=0)


def test_other_models_are_refused_with_advice() -> None:
    class Custom(nn.Module):
        def forward(self, x):
            return x

    with pytest.raises(TypeError, match="one module per rank"):
        blocks_of(Custom())


@pytest.mark.parametrize("by", ["parameters", "measured", "given"])
def test_split_shares_parameters_and_composes(by: str) -> None:
    model = small_net().eval()
    x = torch.randn(6, 4)
    kwargs = {"parameters": {}, "measured": {"sample": x}, "given": {"costs": [1, 1, 1, 1, 1, 1]}}[by]
    stages = split(model, 3, **kwargs)
    assert len(stages) == 3 and all(len(stage) > 0 for stage in stages)
    assert [id(p) for s in stages for p in s.parameters()] == [id(p) for p in model.parameters()]
    with torch.no_grad():
        torch.testing.assert_close(run_through(stages, x), model(x), rtol=0, atol=0)


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


def test_a_user_may_hand_in_per_rank_modules() -> None:
    mine = [nn.Linear(2, 2), nn.Linear(2, 2)]
    assert stage_for_rank(mine, 1, 2) is mine[1]
    with pytest.raises(ValueError, match="per-rank modules"):
        stage_for_rank(mine, 0, 3)


def test_stage_for_rank_cuts_the_model() -> None:
    model = small_net()
    assert list(stage_for_rank(model, 1, 2, costs=[1, 1, 1, 1, 1, 1])) == list(model)[3:]
    with pytest.raises(ValueError, match="6 blocks"):
        split(model, 2, costs=[1, 1])
