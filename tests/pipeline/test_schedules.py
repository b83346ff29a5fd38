"""Every schedule's exact action lists for 2 and 3 stages (2 ranks for those with two stages per
rank), and the checker that guards them."""

from __future__ import annotations

import pytest

from twobp_autograd.pipeline.actions import Action, B, F, I, W
from twobp_autograd.pipeline.schedules import (
    MULTI_STAGE_SCHEDULES,
    SCHEDULES,
    ScheduleError,
    default_num_micro_batches,
    execution_order,
    placement,
    schedule,
    stage_owners,
    validate_schedule,
)

# (name, stages, 2BP) -> one action list per rank, micro-batch count left to the default.
EXPECTED: dict[tuple[str, int, bool], list[list[Action]]] = {
    ("gpipe", 2, False): [
        [F(0), F(1), B(0), B(1)],
        [F(0), F(1), B(0), B(1)],
    ],
    ("gpipe", 2, True): [
        [F(0), F(1), I(0), I(1), W(0, 1)],
        [F(0), F(1), I(0), I(1), W(0, 1)],
    ],
    ("gpipe", 3, False): [
        [F(0), F(1), F(2), B(0), B(1), B(2)],
        [F(0), F(1), F(2), B(0), B(1), B(2)],
        [F(0), F(1), F(2), B(0), B(1), B(2)],
    ],
    ("gpipe", 3, True): [
        [F(0), F(1), F(2), I(0), I(1), I(2), W(0, 1, 2)],
        [F(0), F(1), F(2), I(0), I(1), I(2), W(0, 1, 2)],
        [F(0), F(1), F(2), I(0), I(1), I(2), W(0, 1, 2)],
    ],
    ("1f1b-1", 2, False): [
        [F(0), F(1), B(0), B(1)],
        [F(0), B(0), F(1), B(1)],
    ],
    ("1f1b-1", 2, True): [
        [F(0), F(1), I(0), W(0), I(1), W(1)],
        [F(0), I(0), F(1), I(1), W(0), W(1)],
    ],
    ("1f1b-1", 3, False): [
        [F(0), F(1), F(2), B(0), B(1), B(2)],
        [F(0), F(1), B(0), F(2), B(1), B(2)],
        [F(0), B(0), F(1), B(1), F(2), B(2)],
    ],
    ("1f1b-1", 3, True): [
        [F(0), F(1), F(2), I(0), W(0), I(1), W(1), I(2), W(2)],
        [F(0), F(1), I(0), F(2), I(1), W(0), I(2), W(1), W(2)],
        [F(0), I(0), F(1), I(1), F(2), I(2), W(0), W(1, 2)],
    ],
    ("1f1b-2", 2, False): [
        [F(0), F(1), B(0), F(2), B(1), F(3), B(2), B(3)],
        [F(0), B(0), F(1), B(1), F(2), B(2), F(3), B(3)],
    ],
    ("1f1b-2", 2, True): [
        [F(0), F(1), I(0), F(2), I(1), F(3), I(2), W(0), I(3), W(1), W(2, 3)],
        [F(0), I(0), F(1), I(1), F(2), I(2), F(3), I(3), W(0), W(1, 2, 3)],
    ],
    ("1f1b-2", 3, False): [
        [F(0), F(1), F(2), B(0), F(3), B(1), F(4), B(2), F(5), B(3), B(4), B(5)],
        [F(0), F(1), B(0), F(2), B(1), F(3), B(2), F(4), B(3), F(5), B(4), B(5)],
        [F(0), B(0), F(1), B(1), F(2), B(2), F(3), B(3), F(4), B(4), F(5), B(5)],
    ],
    ("1f1b-2", 3, True): [
        [F(0), F(1), F(2), I(0), F(3), I(1), F(4), I(2), F(5), I(3), W(0), I(4), W(1), I(5), W(2), W(3, 4, 5)],
        [F(0), F(1), I(0), F(2), I(1), F(3), I(2), F(4), I(3), F(5), I(4), W(0), I(5), W(1), W(2, 3, 4, 5)],
        [F(0), I(0), F(1), I(1), F(2), I(2), F(3), I(3), F(4), I(4), F(5), I(5), W(0), W(1, 2, 3, 4, 5)],
    ],
    # Without a separate W there is nothing to move: zb is 1F1B.
    ("zb", 2, False): [
        [F(0), F(1), B(0), F(2), B(1), F(3), B(2), B(3)],
        [F(0), B(0), F(1), B(1), F(2), B(2), F(3), B(3)],
    ],
    # Rank 0 fills its wait for the first gradient with an early F2 (1F1B-2 waits there).
    ("zb", 2, True): [
        [F(0), F(1), F(2), I(0), W(0), I(1), F(3), W(1), I(2), W(2), I(3), W(3)],
        [F(0), I(0), F(1), I(1), F(2), W(0), I(2), F(3), W(1), I(3), W(2, 3)],
    ],
    ("zb", 3, False): [
        [F(0), F(1), F(2), B(0), F(3), B(1), F(4), B(2), F(5), B(3), B(4), B(5)],
        [F(0), F(1), B(0), F(2), B(1), F(3), B(2), F(4), B(3), F(5), B(4), B(5)],
        [F(0), B(0), F(1), B(1), F(2), B(2), F(3), B(3), F(4), B(4), F(5), B(5)],
    ],
    ("zb", 3, True): [
        [F(0), F(1), F(2), F(3), F(4), I(0), W(0), I(1), W(1), I(2), F(5), W(2), I(3), W(3), I(4), W(4), I(5), W(5)],
        [F(0), F(1), F(2), I(0), W(0), I(1), F(3), I(2), F(4), W(1), I(3), F(5), W(2), I(4), W(3), W(4), I(5), W(5)],
        [F(0), I(0), F(1), I(1), F(2), I(2), F(3), W(0), I(3), F(4), W(1), I(4), F(5), W(2), I(5), W(3, 4, 5)],
    ],
}


@pytest.mark.parametrize(
    "name,num_stages,twobp", list(EXPECTED), ids=[f"{n}-p{p}-{'2bp' if t else 'plain'}" for n, p, t in EXPECTED]
)
def test_exact_actions(name: str, num_stages: int, twobp: bool) -> None:
    assert schedule(name, num_stages, twobp=twobp) == EXPECTED[name, num_stages, twobp]


def test_expected_covers_every_schedule() -> None:
    assert {name for name, _, _ in EXPECTED} == set(SCHEDULES)


@pytest.mark.parametrize(
    "name,expected", [("gpipe", 3), ("1f1b-1", 3), ("1f1b-2", 6), ("zb", 6)], ids=lambda v: str(v)
)
def test_default_micro_batch_counts_follow_the_paper(name: str, expected: int) -> None:
    assert default_num_micro_batches(name, 3) == expected
    assert [a.micro_batch for a in schedule(name, 3)[0] if a.kind == "F"] == list(range(expected))


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("num_stages,num_micro_batches", [(1, 1), (1, 4), (3, 1), (3, 2), (3, 5), (4, 9)], ids=str)
@pytest.mark.parametrize("twobp", [False, True], ids=["plain", "2bp"])
def test_any_micro_batch_count_gives_a_valid_schedule(
    name: str, num_stages: int, num_micro_batches: int, twobp: bool
) -> None:
    ranks = schedule(name, num_stages, num_micro_batches, twobp)
    assert len(ranks) == num_stages
    validate_schedule(ranks, num_micro_batches)
    kinds = {a.kind for rank in ranks for a in rank}
    assert kinds == ({"F", "I", "W"} if twobp else {"F", "B"})
    for actions in ranks:
        assert sum(a.kind == "F" for a in actions) == num_micro_batches
        assert all(a.micro_batches is not None for a in actions)  # every W names its work


def test_1f1b_with_fewer_micro_batches_than_stages() -> None:
    assert schedule("1f1b-1", 3, 2, True) == [
        [F(0), F(1), I(0), W(0), I(1), W(1)],
        [F(0), F(1), I(0), W(0), I(1), W(1)],
        [F(0), I(0), F(1), I(1), W(0), W(1)],
    ]


def test_zb_max_pending_one_runs_each_w_before_the_next_i() -> None:
    assert schedule("zb", 2, 4, max_pending=1) == [
        [F(0), F(1), F(2), I(0), W(0), F(3), I(1), W(1), I(2), W(2), I(3), W(3)],
        [F(0), I(0), F(1), W(0), I(1), F(2), W(1), I(2), F(3), W(2), I(3), W(3)],
    ]


@pytest.mark.parametrize("max_pending", [1, 2, 4])
def test_zb_never_holds_more_than_max_pending_weight_grads(max_pending: int) -> None:
    for actions in schedule("zb", 4, 16, max_pending=max_pending):
        pending: set[int] = set()
        for action in actions:
            if action.kind == "I":
                pending.add(action.micro_batch)
            elif action.kind == "W":
                pending -= set(action.micro_batches or ())
            assert len(pending) <= max_pending


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: schedule("interleaved", 2), "unknown schedule"),
        (lambda: schedule("gpipe", 2, max_pending=2), "zb"),
        (lambda: schedule("zb", 2, max_pending=0), "at least 1"),
        (lambda: schedule("zb", 2, 4, twobp=False, max_pending=0), "at least 1"),  # as zbv refuses it
        (lambda: schedule("gpipe", 2, 0), "at least one"),
        (lambda: schedule("1f1b-1", 0), "at least one"),
    ],
    ids=["unknown-name", "max-pending-not-zb", "max-pending-zero", "max-pending-zero-2bp-off", "no-micro-batch",
         "no-stage"],  # fmt: skip
)
def test_bad_arguments_are_refused(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


# Each broken schedule and the reason the checker must give.
BROKEN: list[tuple[str, list[list[Action]], str]] = [
    ("no-ranks", [], "at least one rank"),
    ("missing-forward", [[F(0), B(0)], [F(0), F(1), B(0), B(1)]], "forward"),
    ("forward-twice", [[F(0), F(0), B(0)]], "second forward"),
    ("backward-before-forward", [[B(0), F(0)]], "backward before the forward"),
    ("backward-twice", [[F(0), I(0), B(0), W(0)]], "second backward"),
    ("i-without-w", [[F(0), F(1), I(0), I(1), W(0)]], r"no weight gradient for micro-batches \[1\]"),
    ("w-before-i", [[F(0), W(0), I(0)]], r"before its I: \[0\]"),
    ("w-twice", [[F(0), F(1), I(0), W(0), I(1), W(0, 1)]], r"a second time: \[0\]"),
    ("w-all-with-nothing-pending", [[F(0), B(0), W()]], "no pending"),
    ("w-names-twice", [[F(0), F(1), I(0), I(1), W(0, 0, 1)]], "twice"),
    ("w-after-b", [[F(0), B(0), W(0)]], "a second time"),
    ("micro-batch-out-of-range", [[F(0), B(0), F(7), B(7)]], "outside 0..1"),
    (
        "message-order",
        [[F(0), F(1), B(0), B(1)], [F(1), F(0), B(0), B(1)]],
        r"exchange activations in different orders",
    ),
    (
        "gradient-order",
        [[F(0), F(1), I(1), I(0), W(0, 1)], [F(0), F(1), I(0), I(1), W(0, 1)]],
        r"exchange gradients in different orders",
    ),
    # Rank 0 waits for B0 before sending F1; rank 1 waits for F1 before running B0.
    ("deadlock", [[F(0), B(0), F(1), B(1)], [F(0), F(1), B(0), B(1)]], "deadlock: rank 0 at B0, rank 1 at F1"),
]


@pytest.mark.parametrize("ranks,match", [(r, m) for _, r, m in BROKEN], ids=[i for i, _, _ in BROKEN])
def test_checker_rejects_broken_schedules(ranks: list[list[Action]], match: str) -> None:
    with pytest.raises(ScheduleError, match=match):
        validate_schedule(ranks, num_micro_batches=2)


def test_checker_accepts_w_of_everything_pending() -> None:
    validate_schedule([[F(0), F(1), I(0), I(1), W()], [F(0), F(1), I(0), I(1), W(1), W()]])


def test_neighbours_exchange_the_same_gradient_whether_their_backward_is_b_or_i() -> None:
    validate_schedule([[F(0), I(0), W(0)], [F(0), B(0)]])


def test_schedule_error_shows_the_schedule_with_the_faulty_actions_marked() -> None:
    with pytest.raises(ScheduleError) as deadlock:
        validate_schedule([[F(0), B(0), F(1), B(1)], [F(0), F(1), B(0), B(1)]])
    assert str(deadlock.value) == (
        "deadlock: rank 0 at B0, rank 1 at F1 wait on each other\n"
        "\n"
        "step  rank 0  rank 1\n"
        "0     F0      F0\n"
        "1     >B0<    >F1<\n"
        "2     F1      B0\n"
        "3     B1      B1"
    )
    assert deadlock.value.reason.startswith("deadlock") and deadlock.value.faulty == {(0, 1), (1, 1)}

    with pytest.raises(ScheduleError) as late_w:
        validate_schedule([[F(0), F(1), I(0), W(1), I(1), W(0)]])
    assert str(late_w.value).splitlines()[0] == "rank 0, action 3 (W1): W of micro-batches before its I: [1]"
    assert str(late_w.value).splitlines()[2:] == [
        "step  rank 0", "0     F0", "1     F1", "2     I0", "3     >W1<", "4     I1", "5     W0"
    ]  # fmt: skip

    with pytest.raises(ScheduleError) as order:
        validate_schedule([[F(0), F(1), I(1), I(0), W(0, 1)], [F(0), F(1), I(0), I(1), W(0, 1)]])
    assert order.value.faulty == {(0, 2), (1, 2)}  # where the two orders first differ, on each side


@pytest.mark.parametrize("name", SCHEDULES)
def test_checker_notices_any_single_dropped_action(name: str) -> None:
    ranks = schedule(name, 2, 3)
    for rank, actions in enumerate(ranks):
        for position in range(len(actions)):
            broken = [list(a) for a in ranks]
            del broken[rank][position]
            with pytest.raises(ScheduleError):
                validate_schedule(broken, 3)


# -- several stages per rank -------------------------------------------------------------------

# (name, 2BP) -> one action list per rank, on 2 ranks and 4 micro-batches.
EXPECTED_MULTI_STAGE: dict[tuple[str, bool], list[list[Action]]] = {
    ("interleaved-1f1b", False): [
        [F(0, 0), F(1, 0), F(0, 2), F(1, 2), F(2, 0), B(0, 2), F(3, 0), B(1, 2), F(2, 2), B(0, 0), F(3, 2), B(1, 0),
         B(2, 2), B(3, 2), B(2, 0), B(3, 0)],
        [F(0, 1), F(1, 1), F(0, 3), B(0, 3), F(1, 3), B(1, 3), F(2, 1), B(0, 1), F(3, 1), B(1, 1), F(2, 3), B(2, 3),
         F(3, 3), B(3, 3), B(2, 1), B(3, 1)],
    ],
    ("interleaved-1f1b", True): [
        [F(0, 0), F(1, 0), F(0, 2), F(1, 2), F(2, 0), I(0, 2), F(3, 0), I(1, 2), F(2, 2), I(0, 0), F(3, 2), I(1, 0),
         I(2, 2), W(0, stage=2), I(3, 2), W(1, stage=2), I(2, 0), W(0, stage=0), I(3, 0), W(1, stage=0),
         W(2, 3, stage=2), W(2, 3, stage=0)],
        [F(0, 1), F(1, 1), F(0, 3), I(0, 3), F(1, 3), I(1, 3), F(2, 1), I(0, 1), F(3, 1), I(1, 1), F(2, 3), I(2, 3),
         F(3, 3), I(3, 3), I(2, 1), W(0, stage=3), I(3, 1), W(1, stage=3), W(0, 1, 2, 3, stage=1), W(2, 3, stage=3)],
    ],
    # ZB-V: the paper's order; with 2BP each W right after its I, the cool-down's I first and the
    # W left after the last one concatenated per stage.
    ("zbv", False): [
        [F(0, 0), F(1, 0), F(2, 0), F(0, 3), B(0, 3), F(1, 3), B(1, 3), F(3, 0), B(0, 0), F(2, 3), B(2, 3), B(1, 0),
         F(3, 3), B(3, 3), B(2, 0), B(3, 0)],
        [F(0, 1), F(0, 2), F(1, 1), F(1, 2), B(0, 2), F(2, 1), B(0, 1), F(2, 2), B(1, 2), F(3, 1), B(1, 1), F(3, 2),
         B(2, 2), B(2, 1), B(3, 2), B(3, 1)],
    ],
    ("zbv", True): [
        [F(0, 0), F(1, 0), F(2, 0), F(0, 3), I(0, 3), W(0, stage=3), F(1, 3), I(1, 3), W(1, stage=3), F(3, 0),
         I(0, 0), W(0, stage=0), F(2, 3), I(2, 3), W(2, stage=3), I(1, 0), W(1, stage=0), F(3, 3), I(3, 3),
         W(3, stage=3), I(2, 0), W(2, stage=0), I(3, 0), W(3, stage=0)],
        [F(0, 1), F(0, 2), F(1, 1), F(1, 2), I(0, 2), W(0, stage=2), F(2, 1), I(0, 1), W(0, stage=1), F(2, 2),
         I(1, 2), W(1, stage=2), F(3, 1), I(1, 1), W(1, stage=1), F(3, 2), I(2, 2), W(2, stage=2), I(2, 1), I(3, 2),
         I(3, 1), W(2, 3, stage=1), W(3, stage=2)],
    ],
}  # fmt: skip


@pytest.mark.parametrize(
    "name,twobp", list(EXPECTED_MULTI_STAGE), ids=[f"{n}-{'2bp' if t else 'plain'}" for n, t in EXPECTED_MULTI_STAGE]
)
def test_exact_actions_with_two_stages_per_rank(name: str, twobp: bool) -> None:
    assert schedule(name, 2, 4, twobp) == EXPECTED_MULTI_STAGE[name, twobp]


def test_placements() -> None:
    assert placement("interleaved-1f1b", 3) == (0, 1, 2, 0, 1, 2)  # the loop
    assert placement("zbv", 3) == (0, 1, 2, 2, 1, 0)  # the V: first and last stage on rank 0
    assert placement("zb", 3) == (0, 1, 2)
    assert stage_owners(schedule("zbv", 3)) == dict(enumerate(placement("zbv", 3)))


@pytest.mark.parametrize("name", MULTI_STAGE_SCHEDULES)
@pytest.mark.parametrize("num_ranks,num_micro_batches", [(1, 2), (2, 2), (2, 6), (3, 3), (3, 9), (4, 8)], ids=str)
@pytest.mark.parametrize("twobp", [False, True], ids=["plain", "2bp"])
def test_multi_stage_schedules_are_valid(name: str, num_ranks: int, num_micro_batches: int, twobp: bool) -> None:
    ranks = schedule(name, num_ranks, num_micro_batches, twobp)
    validate_schedule(ranks, num_micro_batches)
    assert {a.stage for actions in ranks for a in actions} == set(range(2 * num_ranks))
    assert {a.kind for actions in ranks for a in actions} == ({"F", "I", "W"} if twobp else {"F", "B"})


def test_the_v_hands_over_at_its_tip_without_a_message() -> None:
    """Stage p − 1 and stage p are on the last rank: nothing crosses ranks between them."""
    order, _ = execution_order(schedule("zbv", 2, 2))
    owners = placement("zbv", 2)
    sent = [(rank, a.sends(rank, 4)) for rank, a in order]
    crossing = {message for rank, message in sent if message is not None and owners[message.receiver] != rank}
    assert all({m.sender, m.receiver} != {1, 2} for m in crossing) and crossing


@pytest.mark.parametrize("max_pending", [1, 2])
def test_zbv_never_holds_more_than_max_pending_weight_grads_per_stage(max_pending: int) -> None:
    for actions in schedule("zbv", 3, 12, max_pending=max_pending):
        pending: dict[int, set[int]] = {}
        for action in actions:
            held = pending.setdefault(action.stage, set())
            if action.kind == "I":
                held.add(action.micro_batch)
            elif action.kind == "W":
                held -= set(action.micro_batches or ())
            assert len(held) <= max_pending


def test_zbv_concatenates_what_is_left_once_a_rank_has_no_backward_left() -> None:
    first_rank, last_rank = schedule("zbv", 2, 8)
    assert first_rank[-3:] == [W(6, stage=0), I(7, 0), W(7, stage=0)]  # nothing left to join on rank 0
    assert last_rank[-4:] == [I(7, 2), I(7, 1), W(6, 7, stage=1), W(7, stage=2)]


@pytest.mark.parametrize("num_ranks", [2, 3, 4, 8])
def test_zbv_with_fewer_micro_batches_than_the_v_holds_drops_them_from_its_shape(num_ranks: int) -> None:
    """The V fills with 2p - 1 micro-batches; with fewer, the missing ones' actions drop out of
    that shape: a valid schedule with the same order of F and I."""
    filled = 2 * num_ranks - 1
    shape = schedule("zbv", num_ranks, filled)
    for m in range(1, filled):
        ranks = schedule("zbv", num_ranks, m)
        validate_schedule(ranks, m)
        for actions, full in zip(ranks, shape, strict=True):
            assert [a for a in actions if a.kind != "W"] == [a for a in full if a.kind != "W" and a.micro_batch < m]


def test_interleaved_needs_whole_groups_of_micro_batches() -> None:
    with pytest.raises(ValueError, match="multiple"):
        schedule("interleaved-1f1b", 2, 3)


def test_a_stage_on_two_ranks_is_refused() -> None:
    with pytest.raises(ScheduleError, match="stage 0 runs on ranks 0 and 1"):
        validate_schedule([[F(0, 0), B(0, 0)], [F(0, 0), B(0, 0)]])
    assert repr(W(1, 2, stage=3)) == "W1,2@s3" and F(0, 1) != F(0)
