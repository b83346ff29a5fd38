"""Replay a schedule from per-stage costs: when each action runs, the step time, the bubble.

Measured F, I and W times of each stage, fed through the same action lists the runtime
executes, predict what 2BP and a schedule buy before a cluster is booked, and explain a
measured step (a gap in the measured timeline that the replay does not show is overhead,
not the schedule). Sends are non-blocking: a rank waits only for what it receives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from .actions import Action, ActionKind, Held, Message, RankMemory, count_stages, peak_memory
from .schedules import execution_order, schedule, stage_owners, validate_schedule
from .trace import Event

__all__ = ["StageCosts", "SimulationResult", "simulate", "fastest_max_pending"]


@dataclass(frozen=True)
class StageCosts:
    """Per-micro-batch times of one stage.

    ``weight_grad`` is W for one micro-batch. A ``W`` that concatenates n micro-batches costs
    ``weight_grad_by_count(n)`` (a callable or a measured table {n: time}) when given, else
    ``n * weight_grad * concat_efficiency`` for n ≥ 2 (W′ = weight_grad × concat_efficiency is
    the concatenated time per micro-batch). ``full_backward`` (B, 2BP off) defaults to I + W.
    """

    forward: float
    input_grad: float
    weight_grad: float
    full_backward: float | None = None
    concat_efficiency: float = 1.0
    weight_grad_by_count: Callable[[int], float] | Mapping[int, float] | None = field(default=None, compare=False)

    def backward_time(self) -> float:
        return self.input_grad + self.weight_grad if self.full_backward is None else self.full_backward

    def weight_grad_time(self, count: int) -> float:
        by_count = self.weight_grad_by_count
        if callable(by_count):
            return by_count(count)
        if by_count is not None:
            if count not in by_count:
                raise KeyError(f"no measured W time for {count} concatenated micro-batches (have {sorted(by_count)})")
            return by_count[count]
        return self.weight_grad if count == 1 else count * self.weight_grad * self.concat_efficiency

    def duration(self, kind: ActionKind, count: int = 1) -> float:
        """How long an action of ``kind`` over ``count`` micro-batches takes."""
        if kind is ActionKind.FORWARD:
            return self.forward
        if kind is ActionKind.BACKWARD_P1:
            return self.input_grad
        if kind is ActionKind.BACKWARD:
            return self.backward_time()
        return self.weight_grad_time(count)


@dataclass
class SimulationResult:
    """Per-rank timelines of a replayed step and what they add up to.

    Memory proxies, in micro-batches per rank (see :class:`~.actions.Held`): ``peak_graphs``
    counts those whose autograd graph is held (from ``F`` until ``B`` or ``I``: backward-p1
    frees it); ``peak_pending_weight_grads`` those whose ``I`` ran and whose ``W`` has not
    (what backward-p2 needs stays until then).
    """

    timelines: list[list[Event]]
    num_micro_batches: int
    step_time: float
    busy_time: list[float]
    peak_pending_weight_grads: list[int]
    peak_graphs: list[int]

    @property
    def num_ranks(self) -> int:
        return len(self.timelines)

    @property
    def idle_time(self) -> list[float]:
        """Per rank: the part of the step it spent waiting (before, between, after its actions)."""
        return [self.step_time - busy for busy in self.busy_time]

    @property
    def bubble_ratio(self) -> float:
        """Idle time over ranks × step time."""
        return sum(self.idle_time) / (self.num_ranks * self.step_time)

    @property
    def throughput(self) -> float:
        """Micro-batches per unit of time."""
        return self.num_micro_batches / self.step_time


def simulate(
    ranks: Sequence[Sequence[Action]],
    costs: StageCosts | Sequence[StageCosts],
    *,
    p2p_latency: float = 0.0,
    num_micro_batches: int | None = None,
) -> SimulationResult:
    """Run each rank's actions in order, each as soon as the rank is free and what it receives
    has arrived (the neighbour's action ended ``p2p_latency`` ago; a hand-over between two
    stages of one rank costs nothing). ``costs`` is one :class:`StageCosts` for every stage or
    one per stage. The schedule is checked first
    (:func:`~twobp_autograd.pipeline.schedules.validate_schedule`); a deadlock raises
    :class:`~twobp_autograd.pipeline.schedules.ScheduleError`."""
    validate_schedule(ranks, num_micro_batches)
    num_ranks, num_stages = len(ranks), count_stages(ranks)
    owners = stage_owners(ranks)
    stage_costs = [costs] * num_stages if isinstance(costs, StageCosts) else list(costs)
    if len(stage_costs) != num_stages:
        what = "ranks" if num_stages == num_ranks else "stages"
        raise ValueError(f"{len(stage_costs)} stage costs for {num_stages} {what}")

    timelines: list[list[Event]] = [[] for _ in range(num_ranks)]
    arrives: dict[Message, float] = {}
    memory = {stage: RankMemory() for stage in range(num_stages)}
    order, _ = execution_order(ranks)  # validated: nothing is stuck
    for rank, action in order:
        stage = action.stage_on(rank)
        waits_for = action.receives(rank, num_stages)
        free_at = timelines[rank][-1].end if timelines[rank] else 0.0
        start = max(free_at, 0.0 if waits_for is None else arrives[waits_for])
        end = start + stage_costs[stage].duration(action.kind, len(memory[stage].run(action)))
        message = action.sends(rank, num_stages)
        if message is not None:
            arrives[message] = end + (0.0 if owners[message.receiver] == rank else p2p_latency)
        timelines[rank].append(Event(rank, action, start, end))

    return SimulationResult(
        timelines=timelines,
        num_micro_batches=sum(a.kind is ActionKind.FORWARD and a.stage_on(0) == 0 for a in ranks[0]),
        step_time=max((events[-1].end for events in timelines if events), default=0.0),
        busy_time=[sum(e.duration for e in events) for events in timelines],
        peak_pending_weight_grads=[peak_memory(actions, {Held.PENDING_WEIGHT_GRADS: 1}) for actions in ranks],
        peak_graphs=[peak_memory(actions, {Held.GRAPH: 1}) for actions in ranks],
    )


def fastest_max_pending(
    name: str,
    num_ranks: int,
    num_micro_batches: int,
    costs: StageCosts | Sequence[StageCosts],
    *,
    p2p_latency: float = 0.0,
    limit: int | None = None,
) -> int:
    """The ``max_pending`` of ``"zb"`` or ``"zbv"`` whose replay on ``costs`` ends first, from 1
    to ``limit`` (default 2p, the peak 1F1B-2 holds at its N = 2p); of equal ones the smallest,
    which holds least. The bound decides where W runs: a W forced before an ``I`` runs alone and
    forgoes the concatenation a later W would get (W(n) < n W), while a looser bound holds more
    memory; which wins depends on the stage's F, I and W(n), so measure them and ask here."""
    limit = 2 * num_ranks if limit is None else limit
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    steps = {
        bound: simulate(
            schedule(name, num_ranks, num_micro_batches, max_pending=bound), costs, p2p_latency=p2p_latency
        ).step_time
        for bound in range(1, min(limit, num_micro_batches) + 1)
    }
    return min(steps, key=lambda bound: (steps[bound], bound))
