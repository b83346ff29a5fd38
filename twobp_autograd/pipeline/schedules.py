"""Pipeline schedules as pure functions: each rank's ordered list of actions.

A schedule is data, not code that talks to other ranks, so it can be asserted exactly, checked
for coverage and deadlock before anything runs, replayed by the simulator and executed by the
runtime from the same list.

The paper's three schedules (GPipe with N = p micro-batches, 1F1B-1 with N = p, 1F1B-2 with
N = 2p) place backward-p2 as the paper's code does: with 2BP on, GPipe runs one concatenated
``W`` after its last ``I``; 1F1B runs a single-micro-batch ``W`` (the oldest pending one) after
each cool-down ``I`` and then one concatenated ``W`` over the rest. ``"zb"`` is this project's
own placement: the 1F1B order of ``F`` and ``I``, with a single-micro-batch ``W`` wherever the
rank would otherwise wait for a neighbour (else its next ``F`` early, as ZB-H2 warms up), or
before an ``I`` once ``max_pending`` micro-batches wait for their ``W`` (so the memory held for
``W`` does not grow with N; which bound runs fastest depends on the stage's costs:
:func:`~.simulator.fastest_max_pending`).

Every ``W`` names its micro-batches explicitly (never ``W()``), so a schedule says exactly
which work each ``W`` concatenates.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable, Sequence

from .actions import Action, ActionKind, B, F, Held, I, Message, Payload, W, count_stages
from .multi_stage import MULTI_STAGE_SCHEDULES, interleaved_one_f_one_b, placement, zero_bubble_v

__all__ = [
    "SCHEDULES",
    "MULTI_STAGE_SCHEDULES",
    "placement",
    "ScheduleError",
    "schedule",
    "default_num_micro_batches",
    "validate_schedule",
    "execution_order",
    "stage_owners",
    "validate_rank",
]

#: The schedules with one stage per rank; :data:`MULTI_STAGE_SCHEDULES` hold several.
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b-1", "1f1b-2", "zb")

RankActions = list[Action]


class ScheduleError(ValueError):
    """A schedule that misses or repeats work, or whose ranks would wait on each other forever.

    The message gives the reason, then the schedule as a grid (one row per step, one column
    per rank) with the faulty actions between ``>`` and ``<``."""

    def __init__(
        self, reason: str, ranks: Sequence[Sequence[Action]] = (), faulty: Iterable[tuple[int, int]] = ()
    ) -> None:
        self.reason = reason
        self.faulty = frozenset(faulty)  # (rank, step)
        super().__init__(f"{reason}\n\n{_grid(ranks, self.faulty)}" if ranks else reason)


def _grid(ranks: Sequence[Sequence[Action]], faulty: frozenset[tuple[int, int]]) -> str:
    columns = [
        [f">{action!r}<" if (rank, step) in faulty else repr(action) for step, action in enumerate(actions)]
        for rank, actions in enumerate(ranks)
    ]
    header = ["step", *(f"rank {rank}" for rank in range(len(ranks)))]
    rows = [
        [str(step), *(column[step] if step < len(column) else "" for column in columns)]
        for step in range(max(map(len, columns)))
    ]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = ("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in (header, *rows))
    return "\n".join(line.rstrip() for line in lines)


def default_num_micro_batches(name: str, num_ranks: int) -> int:
    """The paper's micro-batch counts: p for GPipe and 1F1B-1, 2p for 1F1B-2 (and for ``zb``,
    ``zbv`` and interleaved 1F1B, so that they compare with 1F1B-2)."""
    _check_name(name)
    return num_ranks if name in ("gpipe", "1f1b-1") else 2 * num_ranks


def schedule(
    name: str,
    num_ranks: int,
    num_micro_batches: int | None = None,
    twobp: bool = True,
    *,
    max_pending: int | None = None,
) -> list[RankActions]:
    """One action list per rank for schedule ``name`` (one of :data:`SCHEDULES`, one stage
    per rank, or :data:`MULTI_STAGE_SCHEDULES`, whose ranks hold the stages
    :func:`placement` gives them).

    ``num_micro_batches`` defaults to :func:`default_num_micro_batches`. With ``twobp`` False
    every backward is a full ``B``; ``"zb"`` then degenerates to 1F1B and ``"zbv"`` to its
    ``F``/``B`` order, since without a separate ``W`` there is nothing to move.
    ``max_pending`` applies to ``"zb"`` and ``"zbv"`` only.
    """
    _check_name(name)
    if num_micro_batches is None:
        num_micro_batches = default_num_micro_batches(name, num_ranks)
    if max_pending is not None and name not in ("zb", "zbv"):
        raise ValueError(f"max_pending applies to 'zb' and 'zbv' only, not {name!r}")
    _check_sizes(num_ranks, num_micro_batches)
    if name == "gpipe":
        ranks = _gpipe(num_ranks, num_micro_batches, twobp)
    elif name in ("1f1b-1", "1f1b-2"):
        ranks = _one_f_one_b(num_ranks, num_micro_batches, twobp)
    elif name == "zb":
        ranks = _zero_bubble(num_ranks, num_micro_batches, twobp, max_pending=max_pending)
    elif name == "interleaved-1f1b":
        ranks = interleaved_one_f_one_b(num_ranks, num_micro_batches, twobp)
    else:
        ranks = zero_bubble_v(num_ranks, num_micro_batches, max_pending=max_pending)
        ranks = ranks if twobp else [_without_split(actions) for actions in ranks]
    validate_schedule(ranks, num_micro_batches)
    return ranks


def _without_split(actions: RankActions) -> RankActions:
    """2BP off: each ``I`` becomes a full ``B``, and no ``W`` is left to run."""
    return [
        B(a.micro_batch, a.stage) if a.kind is ActionKind.BACKWARD_P1 else a
        for a in actions
        if a.kind is not ActionKind.BACKWARD_P2
    ]


def _gpipe(num_stages: int, num_micro_batches: int, twobp: bool) -> list[RankActions]:
    """All forwards, then all backwards in micro-batch order; with 2BP one concatenated ``W``."""
    _check_sizes(num_stages, num_micro_batches)
    micro_batches = range(num_micro_batches)
    ranks = []
    for _ in range(num_stages):
        actions = [F(k) for k in micro_batches]
        if twobp:
            actions += [I(k) for k in micro_batches] + [W(*micro_batches)]
        else:
            actions += [B(k) for k in micro_batches]
        ranks.append(actions)
    return ranks


def _one_f_one_b(num_stages: int, num_micro_batches: int, twobp: bool) -> list[RankActions]:
    """Rank r warms up with p − r forwards, alternates backward/forward until every forward is
    issued, then cools down with the remaining backwards. With 2BP each cool-down ``I`` is
    followed by the ``W`` of the oldest pending micro-batch, and one concatenated ``W`` runs
    whatever is still pending at the end."""
    _check_sizes(num_stages, num_micro_batches)
    ranks = []
    for rank in range(num_stages):
        warmup = min(num_micro_batches, num_stages - rank)
        actions = [F(k) for k in range(warmup)]
        backward = I if twobp else B
        for k in range(warmup, num_micro_batches):
            actions += [backward(k - warmup), F(k)]
        pending: deque[int] = deque(range(num_micro_batches - warmup) if twobp else ())
        for k in range(num_micro_batches - warmup, num_micro_batches):
            actions.append(backward(k))
            if twobp:
                pending.append(k)
                actions.append(W(pending.popleft()))
        if pending:
            actions.append(W(*pending))
        ranks.append(actions)
    return ranks


def _zero_bubble(
    num_stages: int,
    num_micro_batches: int,
    twobp: bool,
    *,
    max_pending: int | None = None,
    max_in_flight: int | None = None,
) -> list[RankActions]:
    """1F1B's ``F``/``I`` order, replayed with F = I = W = 1, each rank filling what would be
    a wait first with the ``W`` of its oldest pending micro-batch (a ``W`` of one unit then
    never delays the ``F``/``I`` it precedes), else with its next ``F``, run early, while
    fewer than ``max_in_flight`` (default 2(p − r) − 1 on rank r, as ZB-H2) micro-batches hold
    their graph: 1F1B's warm-up of p − r forwards leaves rank r idle until its first gradient
    comes back, which the early forwards fill. Before an ``I`` that would leave more than
    ``max_pending`` (default p) micro-batches waiting for their ``W``, the oldest one's ``W``
    runs first. The rest runs as one concatenated ``W`` at the end."""
    max_pending = num_stages if max_pending is None else max_pending
    if max_pending < 1 or (max_in_flight is not None and max_in_flight < 1):  # with 2BP off too, as zbv
        raise ValueError(f"max_pending and max_in_flight must be at least 1, got {max_pending} and {max_in_flight}")
    if not twobp:
        return _one_f_one_b(num_stages, num_micro_batches, twobp=False)
    in_flight_cap = [max_in_flight or 2 * (num_stages - rank) - 1 for rank in range(num_stages)]

    # The F/I order of 1F1B without its W; W is placed below.
    base = [
        [a for a in actions if a.kind is not ActionKind.BACKWARD_P2]
        for actions in _one_f_one_b(num_stages, num_micro_batches, True)
    ]
    arrives: dict[Message, int] = {}
    clock = [0] * num_stages
    pending: list[deque[int]] = [deque() for _ in range(num_stages)]
    in_flight = [0] * num_stages
    ranks: list[RankActions] = [[] for _ in range(num_stages)]

    def ready_at(rank: int, action: Action) -> int | None:
        waits_for = action.receives(rank, num_stages)
        return 0 if waits_for is None else arrives.get(waits_for)

    def run(rank: int, action: Action) -> None:
        clock[rank] += 1
        message = action.sends(rank, num_stages)
        if message is not None:
            arrives[message] = clock[rank]
        ranks[rank].append(action)
        if action.kind is not ActionKind.BACKWARD_P2:
            base[rank].remove(action)
            in_flight[rank] += 1 if action.kind is ActionKind.FORWARD else -1
        if action.kind is ActionKind.BACKWARD_P1:
            pending[rank].append(action.micro_batch)

    while any(base):
        rank = min((r for r in range(num_stages) if base[r]), key=lambda r: (clock[r], r))
        action = base[rank][0]
        if action.kind is ActionKind.BACKWARD_P1 and len(pending[rank]) >= max_pending:
            run(rank, W(pending[rank].popleft()))
            continue
        when = ready_at(rank, action)
        early = next((a for a in base[rank] if a.kind is ActionKind.FORWARD), None)
        if when is not None and when <= clock[rank]:
            run(rank, action)
        elif pending[rank]:
            # Idle until the neighbour delivers: do one micro-batch's weight work meanwhile.
            run(rank, W(pending[rank].popleft()))
        elif (
            early is not None
            and in_flight[rank] < in_flight_cap[rank]
            and (ready_at(rank, early) or 0) <= clock[rank]
            and (early.receives(rank, num_stages) is None or ready_at(rank, early) is not None)
        ):
            run(rank, early)
        elif when is not None:
            clock[rank] = when
        else:
            # The neighbour has not sent it yet; it cannot do so sooner than this.
            waits_for = action.receives(rank, num_stages)
            assert waits_for is not None
            clock[rank] = max(clock[rank], clock[waits_for.sender] + 1)
    for rank in range(num_stages):
        if pending[rank]:
            ranks[rank].append(W(*pending[rank]))
    return ranks


def validate_schedule(ranks: Sequence[Sequence[Action]], num_micro_batches: int | None = None) -> None:
    """Raise :class:`ScheduleError` unless ``ranks`` is a complete, runnable schedule.

    Per rank: every micro-batch has exactly one ``F``, and after it either one ``B`` or one
    ``I`` followed by exactly one ``W`` that covers it (``W()`` covers all that is pending).
    Across ranks (with non-blocking sends): an action that receives (see
    :meth:`Action.receives`) waits for the neighbour's action that sends it; each pair of
    neighbours exchanges messages in the same order on both sides, so plain in-order
    send/recv matches them. Replaying the lists must finish: a rank whose next action waits
    on a neighbour that waits on it is a deadlock.
    """
    if not ranks:
        raise ScheduleError("a schedule needs at least one rank")
    if num_micro_batches is None:
        forwards = (a.micro_batch for rank in ranks for a in rank if a.kind is ActionKind.FORWARD)
        num_micro_batches = 1 + max(forwards, default=-1)
    owners = stage_owners(ranks)
    for stage, rank in sorted(owners.items()):
        _check_stage(ranks, rank, stage, num_micro_batches)
    _check_message_order(ranks, owners)
    _, stuck = execution_order(ranks)
    if stuck:
        waits = ", ".join(f"rank {rank} at {ranks[rank][step]!r}" for rank, step in stuck.items())
        raise ScheduleError(f"deadlock: {waits} wait on each other", ranks, stuck.items())


def execution_order(ranks: Sequence[Sequence[Action]]) -> tuple[list[tuple[int, Action]], dict[int, int]]:
    """Replay the ranks' lists with non-blocking sends: each rank runs its next action once
    the message it receives has been sent (by another rank, or by one of its own stages
    earlier). Returns every action that ran, as (rank, action), each after the action it
    waited for, and for each rank that could not finish the step it is stuck at."""
    num_stages = count_stages(ranks)
    sent: set[Message] = set()
    order: list[tuple[int, Action]] = []
    cursor = [0] * len(ranks)
    progressed = True
    while progressed:
        progressed = False
        for rank, actions in enumerate(ranks):
            while cursor[rank] < len(actions):
                action = actions[cursor[rank]]
                waits_for = action.receives(rank, num_stages)
                if waits_for is not None and waits_for not in sent:
                    break
                message = action.sends(rank, num_stages)
                if message is not None:
                    sent.add(message)
                order.append((rank, action))
                cursor[rank] += 1
                progressed = True
    stuck = {rank: cursor[rank] for rank in range(len(ranks)) if cursor[rank] < len(ranks[rank])}
    return order, stuck


def stage_owners(ranks: Sequence[Sequence[Action]]) -> dict[int, int]:
    """Which rank runs each stage; a :class:`ScheduleError` if a stage is on two ranks or on none."""
    owners: dict[int, int] = {}
    for rank, actions in enumerate(ranks):
        for step, action in enumerate(actions):
            stage = action.stage_on(rank)
            if owners.setdefault(stage, rank) != rank:
                raise ScheduleError(f"stage {stage} runs on ranks {owners[stage]} and {rank}", ranks, [(rank, step)])
    missing = sorted(set(range(count_stages(ranks))) - owners.keys())
    if missing:
        raise ScheduleError(f"no rank runs stages {missing}", ranks)
    return owners


def validate_rank(actions: Sequence[Action], num_micro_batches: int, rank: int = 0) -> None:
    """The checks one rank can make alone: each of its stages does every micro-batch's work
    once and in order (see :func:`validate_schedule`)."""
    ranks: list[list[Action]] = [[] for _ in range(rank)] + [list(actions)]
    for stage in dict.fromkeys(action.stage_on(rank) for action in actions):
        _check_stage(ranks, rank, stage, num_micro_batches)
    if not actions:
        _check_stage(ranks, rank, rank, num_micro_batches)


def _check_stage(ranks: Sequence[Sequence[Action]], rank: int, stage: int, num_micro_batches: int) -> None:
    forwarded: set[int] = set()
    backwarded: set[int] = set()
    pending: set[int] = set()
    weight_done: set[int] = set()
    where = f"rank {rank}" if all(a.stage is None for a in ranks[rank]) else f"rank {rank}, stage {stage}"

    def fault(step: int, action: Action, reason: str) -> ScheduleError:
        return ScheduleError(f"{where}, action {step} ({action!r}): {reason}", ranks, [(rank, step)])

    for step, action in enumerate(ranks[rank]):
        if action.stage_on(rank) != stage:
            continue
        if action.kind is ActionKind.BACKWARD_P2:
            covered = action.covers(pending)
            if not covered:
                raise fault(step, action, "W with no pending weight work")
            if action.micro_batches is not None and len(covered) != len(action.micro_batches):
                raise fault(step, action, "W names a micro-batch twice")
            if not covered <= pending:
                late = sorted(covered - pending - weight_done)
                again = sorted(covered & weight_done)
                which = f"before its I: {late}" if late else f"a second time: {again}"
                raise fault(step, action, f"W of micro-batches {which}")
            pending -= covered
            weight_done |= covered
            continue
        k = action.micro_batch
        if not 0 <= k < num_micro_batches:
            raise fault(step, action, f"micro-batch {k} outside 0..{num_micro_batches - 1}")
        if action.kind is ActionKind.FORWARD:
            if k in forwarded:
                raise fault(step, action, f"second forward of micro-batch {k}")
            forwarded.add(k)
            continue
        if k not in forwarded:
            raise fault(step, action, f"backward before the forward of micro-batch {k}")
        if k in backwarded:
            raise fault(step, action, f"second backward of micro-batch {k}")
        backwarded.add(k)
        if action.kind.holds is Held.PENDING_WEIGHT_GRADS:
            pending.add(k)
        else:
            weight_done.add(k)
    everything = set(range(num_micro_batches))
    for what, done in (("forward", forwarded), ("backward", backwarded), ("weight gradient", weight_done)):
        if done != everything:
            raise ScheduleError(f"{where}: no {what} for micro-batches {sorted(everything - done)}", ranks)


def _check_message_order(ranks: Sequence[Sequence[Action]], owners: dict[int, int]) -> None:
    """Neighbouring stages must agree on the order of what one sends and the other receives."""
    num_stages = count_stages(ranks)
    # (sender, receiver, payload) -> [(micro-batch, step)], as each side sees it
    sent: defaultdict[tuple[int, int, Payload], list[tuple[int, int]]] = defaultdict(list)
    received: defaultdict[tuple[int, int, Payload], list[tuple[int, int]]] = defaultdict(list)
    for rank, actions in enumerate(ranks):
        for step, action in enumerate(actions):
            sides = ((sent, action.sends(rank, num_stages)), (received, action.receives(rank, num_stages)))
            for seen, message in sides:
                if message is not None:
                    seen[message.sender, message.receiver, message.payload].append((message.micro_batch, step))
    payloads = list(Payload)
    one_stage_each = all(a.stage is None for actions in ranks for a in actions)
    for link in sorted(sent.keys() | received.keys(), key=lambda link: (min(link[:2]), payloads.index(link[2]))):
        sender, receiver, payload = link
        here, there = [k for k, _ in sent[link]], [k for k, _ in received[link]]
        if here == there:
            continue
        # the two sides may disagree on the count too: the first mismatch, or where the shorter ends
        mismatches = (i for i, (a, b) in enumerate(zip(here, there, strict=False)) if a != b)
        first = next(mismatches, min(len(here), len(there)))
        faulty = [
            (owners[stage], seen[link][first][1])
            for stage, seen in ((sender, sent), (receiver, received))
            if first < len(seen[link])
        ]
        (low, low_order), (high, high_order) = sorted([(sender, here), (receiver, there)])
        raise ScheduleError(
            f"{'ranks' if one_stage_each else 'stages'} {low} and {high} exchange {payload.value} in different "
            f"orders: {low_order} vs {high_order}",
            ranks,
            faulty,
        )


def _check_name(name: str) -> None:
    if name not in SCHEDULES + MULTI_STAGE_SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES + MULTI_STAGE_SCHEDULES)}")


def _check_sizes(num_stages: int, num_micro_batches: int) -> None:
    if num_stages < 1 or num_micro_batches < 1:
        raise ValueError(f"need at least one stage and one micro-batch, got {num_stages} and {num_micro_batches}")
