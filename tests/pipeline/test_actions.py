"""What each kind of action means: whom it receives from and sends to, and the memory it holds
and releases; the memory model the simulator and the sweep share."""

from __future__ import annotations

import pytest

from twobp_autograd.pipeline.actions import (
    Action,
    ActionKind,
    B,
    F,
    Held,
    I,
    Message,
    Payload,
    RankMemory,
    W,
    peak_memory,
)
from twobp_autograd.pipeline.schedules import schedule


@pytest.mark.parametrize(
    "action,rank,receives,sends",
    [
        (F(3), 0, None, Message(0, 1, Payload.ACTIVATIONS, 3)),
        (F(3), 1, Message(0, 1, Payload.ACTIVATIONS, 3), Message(1, 2, Payload.ACTIVATIONS, 3)),
        (F(3), 2, Message(1, 2, Payload.ACTIVATIONS, 3), None),
        (I(3), 0, Message(1, 0, Payload.GRADIENTS, 3), None),
        (B(3), 1, Message(2, 1, Payload.GRADIENTS, 3), Message(1, 0, Payload.GRADIENTS, 3)),
        (I(3), 2, None, Message(2, 1, Payload.GRADIENTS, 3)),
        (W(3), 1, None, None),
        (W(), 1, None, None),
    ],
    ids=str,
)
def test_whom_an_action_waits_for_and_sends_to(action: Action, rank: int, receives, sends) -> None:
    assert action.receives(rank, 3) == receives
    assert action.sends(rank, 3) == sends


def test_a_single_rank_exchanges_nothing() -> None:
    assert all(a.receives(0, 1) is None and a.sends(0, 1) is None for a in (F(0), B(0), I(0), W(0)))


def test_memory_effects() -> None:
    # 2BP: backward-p1 releases the autograd graph; what backward-p2 needs stays until W.
    assert (ActionKind.FORWARD.releases, ActionKind.FORWARD.holds) == (None, Held.GRAPH)
    assert (ActionKind.BACKWARD.releases, ActionKind.BACKWARD.holds) == (Held.GRAPH, None)
    assert (ActionKind.BACKWARD_P1.releases, ActionKind.BACKWARD_P1.holds) == (Held.GRAPH, Held.PENDING_WEIGHT_GRADS)
    assert (ActionKind.BACKWARD_P2.releases, ActionKind.BACKWARD_P2.holds) == (Held.PENDING_WEIGHT_GRADS, None)
    memory = RankMemory()
    for action in (F(0), F(1), I(0)):
        memory.run(action)
    assert memory.held == {Held.GRAPH: {1}, Held.PENDING_WEIGHT_GRADS: {0}}
    assert memory.run(W()) == {0}  # W() covers everything pending
    assert memory.held == {Held.GRAPH: {1}, Held.PENDING_WEIGHT_GRADS: set()}


def test_peak_memory_weighs_what_each_micro_batch_holds() -> None:
    gpipe = schedule("gpipe", 2, 2)[0]  # F0 F1 I0 I1 W0,1
    assert peak_memory(gpipe, {Held.GRAPH: 10, Held.PENDING_WEIGHT_GRADS: 7}) == 20  # after F1
    assert peak_memory(gpipe, {Held.GRAPH: 10, Held.PENDING_WEIGHT_GRADS: 15}) == 30  # after I1
    assert peak_memory(gpipe, {Held.PENDING_WEIGHT_GRADS: 1}) == 2
    assert peak_memory([], {Held.GRAPH: 1}) == 0


def test_kinds_compare_equal_to_the_papers_letters() -> None:
    assert [str(kind) for kind in ActionKind] == ["F", "B", "I", "W"]
    assert ActionKind.BACKWARD_P1 == "I" and f"{ActionKind.BACKWARD_P2}" == "W"
    assert Action("I", (2,)) == I(2) and Action("I", (2,)).kind is ActionKind.BACKWARD_P1
    assert [repr(a) for a in (F(0), I(1), W(0, 2), W())] == ["F0", "I1", "W0,2", "W(*)"]
    with pytest.raises(ValueError, match="exactly one micro-batch"):
        Action(ActionKind.FORWARD, (0, 1))
