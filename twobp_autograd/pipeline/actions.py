"""The vocabulary of a schedule: what one rank does, in order."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Action", "ActionKind", "F", "B", "I", "W"]

ActionKind = Literal["F", "B", "I", "W"]


@dataclass(frozen=True)
class Action:
    """``F``: forward of a micro-batch; ``B``: its full backward (2BP off); ``I``: backward-p1
    (input gradients only, weight work queued under the micro-batch's tag); ``W``:
    backward-p2 over the listed micro-batches, concatenated, or over everything pending when
    ``micro_batches`` is None."""

    kind: ActionKind
    micro_batches: "tuple[int, ...] | None"

    def __post_init__(self) -> None:
        if self.kind != "W" and (self.micro_batches is None or len(self.micro_batches) != 1):
            raise ValueError(f"{self.kind} acts on exactly one micro-batch, got {self.micro_batches}")

    @property
    def micro_batch(self) -> int:
        assert self.micro_batches is not None and len(self.micro_batches) == 1
        return self.micro_batches[0]

    def __repr__(self) -> str:
        if self.micro_batches is None:
            return f"{self.kind}(*)"
        return f"{self.kind}{','.join(map(str, self.micro_batches))}"


def F(mb: int) -> Action:
    return Action("F", (mb,))


def B(mb: int) -> Action:
    return Action("B", (mb,))


def I(mb: int) -> Action:  # noqa: E741, N802 (the paper's name for backward-p1)
    return Action("I", (mb,))


def W(*mbs: int) -> Action:
    """``W()`` runs everything pending; ``W(3)`` or ``W(1, 2)`` those micro-batches' work."""
    return Action("W", tuple(mbs) if mbs else None)
