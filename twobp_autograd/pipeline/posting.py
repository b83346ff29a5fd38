"""The one order in which every rank posts its sends and receives.

NCCL matches the messages between two ranks in the order both post them (gloo by tag), and
runs a rank's point-to-point operations on one stream per peer (or one for every peer, when
the process group was created with a ``device_id``), where each operation waits for the one
before it and a large send waits until its receive runs. So posting each message when an
action needs it can pair the wrong tensors or hang: a rank holding two stages of a V posts the
messages to one peer in another order than the peer takes them, and two ranks that each post
a receive before the send the other one waits for (1F1B's one-ahead receives, from its second
step) wait forever once the tensors are too large for NCCL's buffers.

So, on any backend but gloo, every rank posts in one global order: one replay of the whole
schedule by the simulator (unit costs), each message timed when the action that sends it ends,
ties broken by rank and position. A rank sends when its action does, and posts each receive no
later than its next send that comes after it in that order (earlier where it can, for overlap).
Nothing can wait forever: the earliest message not yet delivered was sent by an action all of
whose inputs came earlier, and the receiving rank has posted everything before it, so both
sides have posted it, and it is at the head of every stream it is on. (On gloo the runtime posts
each receive for its action, or the one before: the one order delayed receives there.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from .actions import Action, Message, count_stages
from .schedules import stage_owners
from .simulator import StageCosts, simulate

__all__ = ["Posting", "posting_order"]

#: Any positive costs give an order in which every message comes after what its sender waited
#: for; these (a backward twice a forward) are close to where the time goes in most models.
_UNIT_COSTS = StageCosts(forward=1.0, input_grad=1.0, weight_grad=1.0)


class Posting(NamedTuple):
    """One message ``rank`` exchanges with another rank, and whether ``rank`` sends it."""

    message: Message
    sends: bool


def posting_order(ranks: Sequence[Sequence[Action]], rank: int) -> list[Posting]:
    """The messages between ``rank`` and the other ranks, sends and receives, in the order
    every rank posts its own (see the module's docstring). Messages between two stages of one
    rank are handed over, not posted, and stay out. ``ranks`` must be a valid schedule."""
    num_stages = count_stages(ranks)
    owners = stage_owners(ranks)
    timed: list[tuple[float, int, int, Message]] = []
    for events in simulate(ranks, _UNIT_COSTS).timelines:
        for position, event in enumerate(events):
            message = event.action.sends(event.rank, num_stages)
            if message is not None and owners[message.receiver] != event.rank:
                timed.append((event.end, event.rank, position, message))
    timed.sort()
    return [
        Posting(message, sends=sender == rank)
        for _, sender, _, message in timed
        if rank in (sender, owners[message.receiver])
    ]
