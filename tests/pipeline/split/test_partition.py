"""The cut: block costs in, contiguous stages out, the costliest stage as cheap as it can be."""

from __future__ import annotations

import pytest

from twobp_autograd.pipeline.split import partition

PARTITIONS = [
    ([1, 1, 1, 1], 2, [(0, 2), (2, 4)]),
    ([4, 1, 1, 1, 1], 2, [(0, 1), (1, 5)]),
    ([1, 2, 3, 4, 5, 6, 7, 8, 9], 3, [(0, 5), (5, 7), (7, 9)]),
    ([5, 5, 5], 3, [(0, 1), (1, 2), (2, 3)]),
    ([3, 1, 4], 1, [(0, 3)]),
]


@pytest.mark.parametrize(
    "costs,num_stages,expected",
    PARTITIONS,
    ids=[f"{len(c)}blocks-{p}stages-{i}" for i, (c, p, _) in enumerate(PARTITIONS)],
)
def test_partition_minimises_the_costliest_stage(costs, num_stages, expected) -> None:
    assert [(r.start, r.stop) for r in partition(costs, num_stages)] == expected


@pytest.mark.parametrize("num_stages", [0, 4])
def test_partition_refuses_impossible_cuts(num_stages: int) -> None:
    with pytest.raises(ValueError, match="twobp: cannot cut .* non-empty stages"):
        partition([1.0, 2.0, 3.0], num_stages)


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), -1.0], ids=["inf", "nan", "negative"])
def test_partition_refuses_costs_that_compare_as_no_cut(bad: float) -> None:
    """An infinite cost made every cut equal, and the first stage came out empty."""
    with pytest.raises(ValueError, match="twobp: block costs must be finite and non-negative"):
        partition([1.0, bad, 1.0, 1.0, 1.0], 2)
