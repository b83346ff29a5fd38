"""The vocabulary of a schedule, and what each word means.

An action's kind says, once for the whole package, which message it receives and sends (and
so which neighbour it waits on) and which memory it keeps alive or releases. The schedule
checker, the simulator, the runtime, the trace and the benchmarks' memory model all read that
here, so they cannot disagree about it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass
from enum import Enum
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
    payload: "Payload | None"
    releases: "Held | None"
    holds: "Held | None"

    def __new__(
        cls, letter: str, description: str, payload: "Payload | None", releases: "Held | None", holds: "Held | None"
    ) -> "ActionKind":
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

    __format__ = str.__format__

    @property
    def is_backward(self) -> bool:
        """B or I: runs autograd's backward through the micro-batch's graph."""
        return self.releases is Held.GRAPH


class Message(NamedTuple):
    """One message of a step: the sending action's and the receiving action's view agree."""

    sender: int
    receiver: int
    payload: Payload
    micro_batch: int


@dataclass(frozen=True)
class Action:
    """``F``: forward of a micro-batch; ``B``: its full backward (2BP off); ``I``: backward-p1
    (input gradients only, weight work queued under the micro-batch's tag); ``W``:
    backward-p2 over the listed micro-batches, concatenated, or over everything pending when
    ``micro_batches`` is None."""

    kind: ActionKind
    micro_batches: "tuple[int, ...] | None"

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", ActionKind(self.kind))
        if self.kind is not ActionKind.BACKWARD_P2 and (self.micro_batches is None or len(self.micro_batches) != 1):
            raise ValueError(f"{self.kind} acts on exactly one micro-batch, got {self.micro_batches}")

    @property
    def micro_batch(self) -> int:
        assert self.micro_batches is not None and len(self.micro_batches) == 1
        return self.micro_batches[0]

    def covers(self, pending: Set[int]) -> frozenset[int]:
        """The micro-batches this action acts on; ``W()`` acts on all ``pending`` ones."""
        return frozenset(pending if self.micro_batches is None else self.micro_batches)

    def receives(self, rank: int, num_ranks: int) -> "Message | None":
        """What this action, run on ``rank``, waits for; None on the rank its payload starts at."""
        return self._message(rank - self._direction, rank, num_ranks)

    def sends(self, rank: int, num_ranks: int) -> "Message | None":
        """What this action, run on ``rank``, sends on; None on the rank its payload ends at."""
        return self._message(rank, rank + self._direction, num_ranks)

    @property
    def _direction(self) -> int:
        return 0 if self.kind.payload is None else self.kind.payload.direction

    def _message(self, sender: int, receiver: int, num_ranks: int) -> "Message | None":
        if self.kind.payload is None or not (0 <= sender < num_ranks and 0 <= receiver < num_ranks):
            return None
        return Message(sender, receiver, self.kind.payload, self.micro_batch)

    def __repr__(self) -> str:
        if self.micro_batches is None:
            return f"{self.kind}(*)"
        return f"{self.kind}{','.join(map(str, self.micro_batches))}"


def F(mb: int) -> Action:
    return Action(ActionKind.FORWARD, (mb,))


def B(mb: int) -> Action:
    return Action(ActionKind.BACKWARD, (mb,))


def I(mb: int) -> Action:  # noqa: E741, N802 (the paper's name for backward-p1)
    return Action(ActionKind.BACKWARD_P1, (mb,))


def W(*mbs: int) -> Action:
    """``W()`` runs everything pending; ``W(3)`` or ``W(1, 2)`` those micro-batches' work."""
    return Action(ActionKind.BACKWARD_P2, tuple(mbs) if mbs else None)


class RankMemory:
    """Which micro-batches hold which memory on one rank, as its actions run in order."""

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
    """The most one rank holds at once running ``actions``, each micro-batch weighing
    ``per_micro_batch[held]`` while it holds ``held`` (bytes, or 1 to count micro-batches)."""
    memory = RankMemory()
    peak = 0
    for action in actions:
        memory.run(action)
        peak = max(peak, memory.size(per_micro_batch))
    return peak
