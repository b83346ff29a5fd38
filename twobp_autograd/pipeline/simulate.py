"""Replay a schedule from per-stage costs: when each action runs, the step time, the bubble.

Measured F, I and W times of each stage, fed through the same action lists the runtime
executes, predict what 2BP and a schedule buy before a cluster is booked, and explain a
measured step (a gap in the measured timeline that the replay does not show is overhead,
not the schedule). Sends are non-blocking: a rank waits only for what it receives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from .actions import Action
from .schedules import ScheduleError, validate_schedule
from .trace import Event

__all__ = ["StageCosts", "SimulationResult", "simulate"]


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

    def duration(self, kind: str, count: int = 1) -> float:
        if kind == "F":
            return self.forward
        if kind == "I":
            return self.input_grad
        if kind == "B":
            return self.backward_time()
        return self.weight_grad_time(count)


@dataclass
class SimulationResult:
    """Per-rank timelines of a replayed step and what they add up to.

    Memory proxies, in micro-batches per rank: ``peak_pending_weight_grads`` counts those whose
    ``I`` ran and ``W`` has not; ``peak_activations`` those whose ``F`` ran and whose
    activations are still held (until ``B``, or until the ``W`` that covers them with 2BP).
    """

    timelines: list[list[Event]]
    num_micro_batches: int
    step_time: float
    busy_time: list[float]
    peak_pending_weight_grads: list[int]
    peak_activations: list[int]

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
    has arrived (the neighbour's action ended ``p2p_latency`` ago). ``costs`` is one
    :class:`StageCosts` for every stage or one per stage. The schedule is checked first
    (:func:`~twobp_autograd.pipeline.schedules.validate_schedule`); a deadlock raises
    :class:`~twobp_autograd.pipeline.schedules.ScheduleError`."""
    validate_schedule(ranks, num_micro_batches)
    num_ranks = len(ranks)
    stage_costs = [costs] * num_ranks if isinstance(costs, StageCosts) else list(costs)
    if len(stage_costs) != num_ranks:
        raise ValueError(f"{len(stage_costs)} stage costs for {num_ranks} ranks")
    if num_micro_batches is None:
        num_micro_batches = 1 + max(a.micro_batch for rank in ranks for a in rank if a.kind == "F")

    timelines: list[list[Event]] = [[] for _ in range(num_ranks)]
    ended: dict[tuple[int, str, int], float] = {}
    free_at = [0.0] * num_ranks
    pending: list[set[int]] = [set() for _ in range(num_ranks)]
    progressed = True
    while progressed:
        progressed = False
        for rank in range(num_ranks):
            while len(timelines[rank]) < len(ranks[rank]):
                action = ranks[rank][len(timelines[rank])]
                arrival = _arrival(action, rank, num_ranks, ended, p2p_latency)
                if arrival is None:
                    break
                covered = pending[rank] if action.micro_batches is None else set(action.micro_batches)
                start = max(free_at[rank], arrival)
                end = start + stage_costs[rank].duration(action.kind, len(covered))
                if action.kind == "W":
                    pending[rank] = pending[rank] - covered
                else:
                    ended[rank, "F" if action.kind == "F" else "B", action.micro_batch] = end
                    if action.kind == "I":
                        pending[rank].add(action.micro_batch)
                timelines[rank].append(Event(rank, action, start, end))
                free_at[rank] = end
                progressed = True
    if any(len(timelines[rank]) < len(ranks[rank]) for rank in range(num_ranks)):
        raise ScheduleError("deadlock: " + ", ".join(
            f"rank {rank} at {ranks[rank][len(timelines[rank])]!r}"
            for rank in range(num_ranks)
            if len(timelines[rank]) < len(ranks[rank])
        ))

    pending_peaks, activation_peaks = zip(*(_memory_peaks(actions) for actions in ranks))
    return SimulationResult(
        timelines=timelines,
        num_micro_batches=num_micro_batches,
        step_time=max((events[-1].end for events in timelines if events), default=0.0),
        busy_time=[sum(e.duration for e in events) for events in timelines],
        peak_pending_weight_grads=list(pending_peaks),
        peak_activations=list(activation_peaks),
    )


def _arrival(
    action: Action, rank: int, num_ranks: int, ended: Mapping[tuple[int, str, int], float], latency: float
) -> float | None:
    """When what ``action`` receives is there: 0 if it receives nothing, None if not sent yet."""
    if action.kind == "F" and rank > 0:
        sender = rank - 1, "F", action.micro_batch
    elif action.kind in "BI" and rank < num_ranks - 1:
        sender = rank + 1, "B", action.micro_batch
    else:
        return 0.0
    return ended[sender] + latency if sender in ended else None


def _memory_peaks(actions: Sequence[Action]) -> tuple[int, int]:
    pending: set[int] = set()
    held: set[int] = set()
    peak_pending = peak_held = 0
    for action in actions:
        if action.kind == "F":
            held.add(action.micro_batch)
        elif action.kind == "B":
            held.discard(action.micro_batch)
        elif action.kind == "I":
            pending.add(action.micro_batch)
        else:
            covered = set(pending) if action.micro_batches is None else set(action.micro_batches)
            pending -= covered
            held -= covered
        peak_pending = max(peak_pending, len(pending))
        peak_held = max(peak_held, len(held))
    return peak_pending, peak_held
