"""Schedules in which each rank holds several stages, and where those stages sit.

Cutting the model into more stages than ranks shrinks the pipeline's fill and drain: each
hop costs a fraction of a rank's work. Two placements: the *loop* (rank r holds stages r,
r + p, r + 2p, ...; interleaved 1F1B) and the *V* (rank r holds stages r and 2p − 1 − r, so
the first and the last stage share rank 0 and the turn at the V's tip is a hand-over inside
rank p − 1). Every action names its stage.

``zbv`` is found, like ``zb``, by replaying the step with F = I = W = 1: each rank runs, when
free, a ready ``I`` (the critical path), else a ready ``F`` while fewer than ``max_in_flight``
micro-batches have entered it and not left through its first stage's ``I``, else the oldest
pending ``W``. (The bound 2p holds no more graphs than 2p − 1 on 2 ranks and runs ahead of it
once messages take time: replayed with F = I = W = 1 and 0.3 latency, m = 8, 1.081 against
1.056 over GPipe without 2BP); before an ``I`` that would leave ``max_pending`` micro-batches of that stage
waiting for their ``W``, the oldest one's ``W`` runs first. Once a rank has no ``I`` left, each
stage's pending work runs as one ``W`` over those micro-batches, concatenated.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .actions import Action, ActionKind, B, F, I, Message, Payload, W

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
        raise ValueError(f"interleaved 1F1B runs micro-batches in groups of the {p} ranks; {m} is not a multiple")

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


@dataclass
class _StageProgress:
    """Where one stage stands in the unit-time replay."""

    stage: int
    forwarded: int = 0  # micro-batches whose F ran (they run in order)
    backwarded: int = 0
    pending: deque[int] = field(default_factory=deque)  # I ran, W not yet


@dataclass
class _Replay:
    """The unit-time replay that places ``zbv``'s actions."""

    num_ranks: int
    num_micro_batches: int
    owner: tuple[int, ...]
    max_in_flight: int
    max_pending: int
    arrives: dict[Message, int] = field(default_factory=dict)
    ranks: list[RankActions] = field(init=False)
    stages: list[list[_StageProgress]] = field(init=False)  # per rank, deepest stage first

    def __post_init__(self) -> None:
        self.ranks = [[] for _ in range(self.num_ranks)]
        self.stages = [
            [_StageProgress(s) for s in sorted(range(len(self.owner)), reverse=True) if self.owner[s] == rank]
            for rank in range(self.num_ranks)
        ]

    def ready(self, message: Message | None, now: int) -> bool:
        return message is None or self.arrives.get(message, now + 1) <= now

    def next_action(self, rank: int, now: int) -> Action | None:
        stages, m, last = self.stages[rank], self.num_micro_batches, len(self.owner) - 1
        for progress in stages:
            k, s = progress.backwarded, progress.stage
            gradient = None if s == last else Message(s + 1, s, Payload.GRADIENTS, k)
            if k < progress.forwarded and self.ready(gradient, now):
                if len(progress.pending) >= self.max_pending:
                    return W(progress.pending.popleft(), stage=s)
                progress.backwarded += 1
                progress.pending.append(k)
                return I(k, stage=s)
        entry = stages[-1]
        for progress in stages:
            k, s = progress.forwarded, progress.stage
            room = progress is not entry or entry.forwarded - entry.backwarded < self.max_in_flight
            if k < m and room and self.ready(None if s == 0 else Message(s - 1, s, Payload.ACTIVATIONS, k), now):
                progress.forwarded += 1
                return F(k, stage=s)
        if all(progress.backwarded == m for progress in stages):
            left = [(p.stage, k) for p in sorted(stages, key=lambda p: p.stage) for k in p.pending]
            self.ranks[rank] += _concatenated_w(left)
            for progress in stages:
                progress.pending.clear()
            return None
        waiting = [p for p in stages if p.pending]
        if waiting:
            oldest = max(waiting, key=lambda p: p.stage)
            return W(oldest.pending.popleft(), stage=oldest.stage)
        return None

    def done(self, rank: int) -> bool:
        return all(p.backwarded == self.num_micro_batches and not p.pending for p in self.stages[rank])

    def run(self) -> list[RankActions]:
        now = 0
        while not all(self.done(rank) for rank in range(self.num_ranks)):
            for rank in range(self.num_ranks):
                action = self.next_action(rank, now)
                if action is None:
                    continue
                self.ranks[rank].append(action)
                message = action.sends(rank, len(self.owner))
                if message is not None:
                    self.arrives[message] = now + 1
            now += 1
            if now > 100 * len(self.owner) * self.num_micro_batches:
                raise AssertionError("the zbv replay made no progress")  # a bug, not a user error
        return self.ranks


def zero_bubble_v(
    num_ranks: int, num_micro_batches: int, *, max_pending: int | None = None, max_in_flight: int | None = None
) -> list[RankActions]:
    """ZB-V's shape with 2BP (see the module's docstring). ``max_pending`` (default p)
    bounds each stage's micro-batches waiting for their ``W``; ``max_in_flight`` (default
    2p) those a rank holds between its first stage's ``F`` and ``I``."""
    max_pending = num_ranks if max_pending is None else max_pending
    max_in_flight = 2 * num_ranks if max_in_flight is None else max_in_flight
    if max_pending < 1 or max_in_flight < 1:
        raise ValueError(f"max_pending and max_in_flight must be at least 1, got {max_pending} and {max_in_flight}")
    owner = placement("zbv", num_ranks)
    return _Replay(num_ranks, num_micro_batches, owner, max_in_flight, max_pending).run()
