"""Schedules in which each rank holds several stages, and where those stages sit.

Cutting the model into more stages than ranks shrinks the pipeline's fill and drain: each
hop costs a fraction of a rank's work. Two placements: the *loop* (rank r holds stages r,
r + p, r + 2p, ...; interleaved 1F1B) and the *V* (rank r holds stages r and 2p − 1 − r, so
the first and the last stage share rank 0 and the turn at the V's tip is a hand-over inside
rank p − 1). Every action names its stage.

``zbv`` is ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", 2024, section 6) with 2BP's
concatenation: rank r warms up with 2(p − r) − 1 forwards of its first stage, r more in pairs
over both stages and p − r of its second stage each followed by that micro-batch's ``I`` and
``W``; then runs ``F I W`` units on each stage in turn; cools down with the ``I`` of both
stages, the last p − r of its first stage each followed by its ``W``. In the steady state each
``W`` runs right after its ``I``, so a rank holds 1F1B's memory (2p half-stage graphs) and
little more for ``W``; the ``W`` left after a rank's last ``I`` run as one ``W`` per stage over
those micro-batches, concatenated (2BP's addition to the paper's order).
Unlike a greedy replay that packs each rank's work as tightly as messages arriving at once
allow (this package's ``zbv`` before), the order keeps its pace when a hand-over takes time, and
its memory whatever p is (README: Pipeline).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from .actions import Action, ActionKind, B, F, I, W

__all__ = ["MULTI_STAGE_SCHEDULES", "placement", "interleaved_one_f_one_b", "zero_bubble_v"]

#: The schedules whose ranks hold several stages each (see :func:`placement`).
MULTI_STAGE_SCHEDULES: tuple[str, ...] = ("interleaved-1f1b", "zbv")

RankActions = list[Action]


def _loop(stage: int, num_ranks: int) -> int:
    return stage % num_ranks


def _v(stage: int, num_ranks: int) -> int:
    return stage if stage < num_ranks else 2 * num_ranks - 1 - stage


_PLACEMENTS: dict[str, Callable[[int, int], int]] = {"interleaved-1f1b": _loop, "zbv": _v}


def placement(name: str, num_ranks: int, stages_per_rank: int = 2) -> tuple[int, ...]:
    """The rank of each stage under schedule ``name``; one stage per rank (rank = stage) for
    the schedules that are not in :data:`MULTI_STAGE_SCHEDULES`. The V holds two per rank."""
    if name not in _PLACEMENTS:
        return tuple(range(num_ranks))
    count = 2 if name == "zbv" else stages_per_rank
    return tuple(_PLACEMENTS[name](stage, num_ranks) for stage in range(count * num_ranks))


def interleaved_one_f_one_b(
    num_ranks: int, num_micro_batches: int, twobp: bool, stages_per_rank: int = 2
) -> list[RankActions]:
    """Interleaved 1F1B on the loop placement, micro-batches in groups of p: each rank runs a
    group through its first stage, then its second, ...; it warms up with 2(p − r − 1) +
    (v − 1)p forwards, alternates forward and backward, and cools down with the rest. With
    2BP each cool-down ``I`` is followed by the ``W`` of the rank's oldest pending work, and
    each stage's remaining work runs as one concatenated ``W`` at the end."""
    p, v, m = num_ranks, stages_per_rank, num_micro_batches
    if m % p:
        raise ValueError(
            f"twobp: interleaved 1F1B runs micro-batches in groups of the {p} ranks; {m} is not a multiple: "
            f"use a multiple of {p}"
        )

    def slot(rank: int, index: int, backward: bool) -> tuple[int, int]:
        group, within = divmod(index, p * v)
        chunk, offset = divmod(within, p)
        return (v - 1 - chunk if backward else chunk) * p + rank, group * p + offset

    ranks = []
    for rank in range(p):
        total = m * v
        warmup = min(total, 2 * (p - rank - 1) + (v - 1) * p)
        forward = [_act(F, *slot(rank, i, False)) for i in range(total)]
        backward = [_act(I if twobp else B, *slot(rank, i, True)) for i in range(total)]
        actions = forward[:warmup]
        for i in range(total - warmup):
            actions += [forward[warmup + i], backward[i]]
        actions += backward[total - warmup :]
        ranks.append(_w_after_cooldown(actions, len(actions) - warmup) if twobp else actions)
    return ranks


def _act(kind: Callable[..., Action], stage: int, micro_batch: int) -> Action:
    return kind(micro_batch, stage=stage)


def _w_after_cooldown(actions: RankActions, cooldown_start: int) -> RankActions:
    """After each ``I`` from ``cooldown_start`` on, the ``W`` of the oldest pending work; the
    rest as one concatenated ``W`` per stage, at the end."""
    placed: RankActions = []
    pending: deque[tuple[int, int]] = deque()
    for position, action in enumerate(actions):
        placed.append(action)
        if action.kind is ActionKind.BACKWARD_P1:
            pending.append((action.stage_on(0), action.micro_batch))
            if position >= cooldown_start:
                stage, k = pending.popleft()
                placed.append(W(k, stage=stage))
    return placed + _concatenated_w(pending)


def _concatenated_w(pending: deque[tuple[int, int]] | list[tuple[int, int]]) -> RankActions:
    by_stage: dict[int, list[int]] = {}
    for stage, k in pending:
        by_stage.setdefault(stage, []).append(k)
    return [W(*micro_batches, stage=stage) for stage, micro_batches in by_stage.items()]


def zero_bubble_v(num_ranks: int, num_micro_batches: int, *, max_pending: int | None = None) -> list[RankActions]:
    """ZB-V with 2BP (see the module's docstring). ``max_pending`` (default p) bounds each
    stage's micro-batches waiting for their ``W``: before an ``I`` that would leave more
    waiting, the oldest one's ``W`` runs first."""
    max_pending = num_ranks if max_pending is None else max_pending
    if max_pending < 1:
        raise ValueError(f"max_pending must be at least 1, got {max_pending}")
    # The shape fills the V with 2p - 1 micro-batches; with fewer, the missing ones' actions drop out.
    shaped = max(num_micro_batches, 2 * num_ranks - 1)
    ranks = []
    for rank in range(num_ranks):
        stages = (rank, 2 * num_ranks - 1 - rank)
        numbered = _numbered(_v_order(rank, num_ranks, shaped), stages)
        actions = [a for a in numbered if a.micro_batch < num_micro_batches]
        ranks.append(_bounded_pending(_tail_w_concatenated(actions), max_pending))
    return ranks


def _v_order(rank: int, num_ranks: int, num_micro_batches: int) -> list[tuple[ActionKind, int]]:
    """Rank ``rank``'s ZB-V order as (kind, chunk) pairs, chunk 0 its first stage, 1 its second."""
    p, n = num_ranks, num_micro_batches
    f, i, w = ActionKind.FORWARD, ActionKind.BACKWARD_P1, ActionKind.BACKWARD_P2
    steady = n - p  # F I W units on both chunks; the last p - r - 1 have no chunk-0 F left to run
    steady_with_forward = n - (2 * p - rank - 1)
    return (
        [(f, 0)] * (2 * (p - rank) - 1)
        + [(f, 1), (f, 0)] * rank
        + [(f, 1), (i, 1), (w, 1)] * (p - rank)
        + [(f, 0), (i, 0), (w, 0), (f, 1), (i, 1), (w, 1)] * steady_with_forward
        + [(i, 0), (w, 0), (f, 1), (i, 1), (w, 1)] * (steady - steady_with_forward)
        + [(i, 0), (i, 1)] * rank
        + [(i, 0), (w, 0)] * (p - rank)
        + [(w, 1)] * rank
        + [(w, 0)] * rank
    )


def _numbered(order: list[tuple[ActionKind, int]], stages: tuple[int, int]) -> RankActions:
    """Actions from (kind, chunk) pairs: each kind takes a chunk's micro-batches in order."""
    taken: dict[tuple[ActionKind, int], int] = {}
    actions = []
    for kind, chunk in order:
        k = taken.get((kind, chunk), 0)
        taken[kind, chunk] = k + 1
        actions.append(Action(kind, (k,), stages[chunk]))
    return actions


def _tail_w_concatenated(actions: RankActions) -> RankActions:
    """The ``W`` after the rank's last ``I`` as one concatenated ``W`` per stage."""
    last = max(index for index, a in enumerate(actions) if a.kind is ActionKind.BACKWARD_P1)
    tail = [(a.stage_on(0), k) for a in actions[last + 1 :] for k in a.micro_batches or ()]
    return actions[: last + 1] + _concatenated_w(tail)


def _bounded_pending(actions: RankActions, max_pending: int) -> RankActions:
    """``actions`` with the oldest pending ``W`` of a stage run before any ``I`` that would
    leave more than ``max_pending`` of its micro-batches waiting (and dropped where it was)."""
    pending: dict[int, deque[int]] = {}
    early: set[tuple[int, int]] = set()
    bounded: RankActions = []
    for action in actions:
        stage = action.stage_on(0)
        waiting = pending.setdefault(stage, deque())
        if action.kind is ActionKind.BACKWARD_P1:
            if len(waiting) >= max_pending:
                oldest = waiting.popleft()
                early.add((stage, oldest))
                bounded.append(W(oldest, stage=stage))
            waiting.append(action.micro_batch)
        elif action.kind is ActionKind.BACKWARD_P2:
            left = [k for k in action.micro_batches or () if (stage, k) not in early]
            for k in left:
                waiting.remove(k)
            if left:
                bounded.append(W(*left, stage=stage))
            continue
        bounded.append(action)
    return bounded
