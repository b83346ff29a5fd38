"""The vocabulary of a schedule, and what each word means.

An action may name the stage it runs: a rank that holds several stages (interleaved and V
schedules) must say which; in a schedule with one stage per rank the stage is left out and is
the rank's own, so such schedules read (and compare) as they always did. Messages go from
stage to stage; whether a stage's neighbour sits on another rank is the placement's business.

An action's kind says, once for the whole package, which message it receives and sends (and
so which neighbour it waits on) and which memory it keeps alive or releases. The schedule
checker, the simulator, the runtime, the trace and the benchmarks' memory model all read that
here, so they cannot disagree about it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass
from enum import Enum, EnumMeta
from typing import NamedTuple

__all__ = [
    "Payload",
    "Held",
    "ActionKind",
    "Message",
    "Action",
    "F",
    "B",
    "I",
    "W",
    "RankMemory",
    "peak_memory",
    "count_stages",
]


class Payload(Enum):
    """What crosses between neighbouring ranks: activations flow to the next rank, gradients
    back to the one before."""

    ACTIVATIONS = "activations"
    GRADIENTS = "gradients"

    @property
    def direction(self) -> int:
        """+1: from rank r to r + 1; −1: from rank r to r − 1."""
        return 1 if self is Payload.ACTIVATIONS else -1


class Held(Enum):
    """What a micro-batch keeps alive on a rank between two of its actions.

    In 2BP, backward-p1 (``I``) releases the graph: autograd frees the activations it saved
    for input gradients. What backward-p2 needs (each layer's input and output gradient) stays
    queued as pending weight-gradient work until the ``W`` that covers the micro-batch.
    """

    GRAPH = "autograd graph"
    PENDING_WEIGHT_GRADS = "pending weight-gradient work"


class ActionKind(str, Enum):
    """One kind of action: its letter (the paper's), what it receives and sends, and what it
    holds and releases. Compares equal to its letter."""

    description: str
    payload: Payload | None
    releases: Held | None
    holds: Held | None

    def __new__(
        cls, letter: str, description: str, payload: Payload | None, releases: Held | None, holds: Held | None
    ) -> ActionKind:
        kind = str.__new__(cls, letter)
        kind._value_ = letter
        kind.description, kind.payload, kind.releases, kind.holds = description, payload, releases, holds
        return kind

    FORWARD = ("F", "forward", Payload.ACTIVATIONS, None, Held.GRAPH)
    BACKWARD = ("B", "full backward", Payload.GRADIENTS, Held.GRAPH, None)
    BACKWARD_P1 = ("I", "backward-p1 (input grads)", Payload.GRADIENTS, Held.GRAPH, Held.PENDING_WEIGHT_GRADS)
    BACKWARD_P2 = ("W", "backward-p2 (weight grads)", None, Held.PENDING_WEIGHT_GRADS, None)

    def __str__(self) -> str:
        return self.value

    def __format__(self, format_spec: str) -> str:
        return str.__format__(self, format_spec)

    @property
    def is_backward(self) -> bool:
        """B or I: runs autograd's backward through the micro-batch's graph."""
        return self.releases is Held.GRAPH


class Message(NamedTuple):
    """One message of a step: the sending action's and the receiving action's view agree.
    ``sender`` and ``receiver`` are stages (the ranks themselves when each rank holds one)."""

    sender: int
    receiver: int
    payload: Payload
    micro_batch: int


@dataclass(frozen=True)
class Action:
    """``F``: forward of a micro-batch; ``B``: its full backward (2BP off); ``I``: backward-p1
    (input gradients only, weight work queued under the micro-batch's tag); ``W``:
    backward-p2 over the listed micro-batches, concatenated, or over everything pending when
    ``micro_batches`` is None. ``stage``: which of its rank's stages it runs; None in a
    schedule with one stage per rank, where it is the rank's own."""

    kind: ActionKind
    micro_batches: tuple[int, ...] | None
    stage: int | None = None

    def __post_init__(self) -> None:
        # ActionKind(letter), the by-value lookup, spelled through the metaclass: mypy reads a plain
        # ActionKind(...) as a call to the five-argument __new__ that builds the members.
        object.__setattr__(self, "kind", EnumMeta.__call__(ActionKind, self.kind))
        if self.kind is not ActionKind.BACKWARD_P2 and (self.micro_batches is None or len(self.micro_batches) != 1):
            raise ValueError(f"{self.kind} acts on exactly one micro-batch, got {self.micro_batches}")

    @property
    def micro_batch(self) -> int:
        assert self.micro_batches is not None and len(self.micro_batches) == 1
        return self.micro_batches[0]

    def covers(self, pending: Set[int]) -> frozenset[int]:
        """The micro-batches this action acts on; ``W()`` acts on all ``pending`` ones."""
        return frozenset(pending if self.micro_batches is None else self.micro_batches)

    def stage_on(self, rank: int) -> int:
        """The stage this action runs when ``rank`` runs it."""
        return rank if self.stage is None else self.stage

    def receives(self, rank: int, num_stages: int) -> Message | None:
        """What this action, run on ``rank``, waits for; None on the stage its payload starts at."""
        here = self.stage_on(rank)
        return self._message(here - self._direction, here, num_stages)

    def sends(self, rank: int, num_stages: int) -> Message | None:
        """What this action, run on ``rank``, sends on; None on the stage its payload ends at."""
        here = self.stage_on(rank)
        return self._message(here, here + self._direction, num_stages)

    @property
    def _direction(self) -> int:
        return 0 if self.kind.payload is None else self.kind.payload.direction

    def _message(self, sender: int, receiver: int, num_ranks: int) -> Message | None:
        if self.kind.payload is None or not (0 <= sender < num_ranks and 0 <= receiver < num_ranks):
            return None
        return Message(sender, receiver, self.kind.payload, self.micro_batch)

    def __repr__(self) -> str:
        work = "(*)" if self.micro_batches is None else ",".join(map(str, self.micro_batches))
        return f"{self.kind}{work}" + ("" if self.stage is None else f"@s{self.stage}")


def F(mb: int, stage: int | None = None) -> Action:
    return Action(ActionKind.FORWARD, (mb,), stage)


def B(mb: int, stage: int | None = None) -> Action:
    return Action(ActionKind.BACKWARD, (mb,), stage)


def I(mb: int, stage: int | None = None) -> Action:  # noqa: E743 (the paper's name for backward-p1)
    return Action(ActionKind.BACKWARD_P1, (mb,), stage)


def W(*mbs: int, stage: int | None = None) -> Action:
    """``W()`` runs everything pending; ``W(3)`` or ``W(1, 2)`` those micro-batches' work."""
    return Action(ActionKind.BACKWARD_P2, tuple(mbs) if mbs else None, stage)


def count_stages(ranks: Sequence[Sequence[Action]]) -> int:
    """How many stages the schedule ``ranks`` runs (its ranks' count when each holds one)."""
    stages = [action.stage_on(rank) for rank, actions in enumerate(ranks) for action in actions]
    return max(len(ranks), 1 + max(stages, default=-1))


class RankMemory:
    """Which micro-batches hold which memory on one stage, as its actions run in order."""

    def __init__(self) -> None:
        self.held: dict[Held, set[int]] = {held: set() for held in Held}

    def run(self, action: Action) -> frozenset[int]:
        """Apply ``action``'s effect on memory; returns the micro-batches it acted on."""
        covered = action.covers(self.held[Held.PENDING_WEIGHT_GRADS])
        if action.kind.releases is not None:
            self.held[action.kind.releases] -= covered
        if action.kind.holds is not None:
            self.held[action.kind.holds] |= covered
        return covered

    def size(self, per_micro_batch: Mapping[Held, int]) -> int:
        return sum(len(self.held[held]) * amount for held, amount in per_micro_batch.items())


def peak_memory(actions: Iterable[Action], per_micro_batch: Mapping[Held, int]) -> int:
    """The most one rank holds at once running ``actions``, each micro-batch of each of its
    stages weighing ``per_micro_batch[held]`` while it holds ``held`` (bytes, or 1 to count)."""
    memory: dict[int | None, RankMemory] = {}
    peak = 0
    for action in actions:
        memory.setdefault(action.stage, RankMemory()).run(action)
        peak = max(peak, sum(stage.size(per_micro_batch) for stage in memory.values()))
    return peak
