"""What a pipeline step reports: each rank's timeline and waits, and over all ranks the step
time, idle time, bubble ratio and throughput.

Kept apart from the runtime so that it reads as actions and messages; the runtime tells a
:class:`StepTimer` when an action starts, ends and what it waited for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .actions import Action
from .trace import Event

__all__ = ["RankMetrics", "StepReport", "StepTimer"]


@dataclass
class RankMetrics:
    """One rank's view of one step. Times in seconds from this rank's step start."""

    rank: int
    step_time: float
    receive_wait: float  # time spent blocked on messages (the rank's share of the bubble)
    events: list[Event]
    samples: int
    deferred_jobs: int  # most weight-gradient jobs queued at once (0 with 2BP off)
    peak_bytes: int  # see memory_probe.MemoryProbe
    peak_rss: int  # bytes, the peak resident set over peak_rss_scope
    loss: float | None  # on the rank of the last stage
    peak_pending_bytes: int = 0  # most bytes the weight-gradient queue held after an action
    # "step": since the step began (Linux, /proc/self/clear_refs); "process": since the process
    # began (getrusage's ru_maxrss), where the high-water mark could not be reset
    peak_rss_scope: str = "step"


@dataclass
class StepReport:
    """All ranks' metrics of one step, on rank 0."""

    ranks: list[RankMetrics]
    step_time: float = field(init=False)
    idle: list[float] = field(init=False)  # per rank: receive waits plus the time it finished early
    bubble_ratio: float = field(init=False)  # idle / (ranks x step time)
    throughput: float = field(init=False)  # samples per second
    loss: float | None = field(init=False)

    def __post_init__(self) -> None:
        self.step_time = max(m.step_time for m in self.ranks)
        self.idle = [m.receive_wait + (self.step_time - m.step_time) for m in self.ranks]
        self.bubble_ratio = sum(self.idle) / (len(self.ranks) * self.step_time)
        self.throughput = sum(r.samples for r in self.ranks) / self.step_time  # the rank holding stage 0
        self.loss = next((m.loss for m in reversed(self.ranks) if m.loss is not None), None)  # the last stage's rank


class StepTimer:
    """One rank's clock over one step. Each action's event starts when the last message it
    waited for arrived, so waiting shows as a gap in the timeline; on CUDA each action ends
    when its kernels have finished."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank = rank
        self.device = device
        self.events: list[Event] = []
        self.receive_wait = 0.0
        self._origin = time.perf_counter()
        self._ready = self._origin

    def action_starts(self) -> None:
        self._ready = time.perf_counter()

    def waited(self, since: float) -> None:
        """A wait that began at ``since`` (a ``time.perf_counter()``) has just ended."""
        self._ready = time.perf_counter()
        self.receive_wait += self._ready - since

    def action_ends(self, action: Action) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.events.append(Event(self.rank, action, self._ready - self._origin, time.perf_counter() - self._origin))

    def elapsed(self) -> float:
        return time.perf_counter() - self._origin
