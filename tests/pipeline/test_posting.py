"""The posting order, replayed under NCCL's rules: matched in order, one stream, rendezvous."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import pytest

from twobp_autograd.pipeline.actions import Action, Message, count_stages
from twobp_autograd.pipeline.posting import Posting, posting_order
from twobp_autograd.pipeline.schedules import MULTI_STAGE_SCHEDULES, SCHEDULES, schedule, stage_owners

#: What a rank's host does: post an operation on its stream, or wait until one has completed.
Post = tuple[str, Posting]


def _program(ranks: Sequence[Sequence[Action]], rank: int, plan: Sequence[Posting] | None) -> list[Post]:
    """The runtime's posts and waits on ``rank`` as it runs its actions. With a ``plan``, as the
    runtime posts: in the plan's order, each send by its action with the receives before it,
    and before each action the receives up to the next one an action needs. Without, each
    receive when its action needs it or the action before (the runtime before the plan)."""
    num_stages, owners = count_stages(ranks), stage_owners(ranks)
    program: list[Post] = []
    posted: set[Posting] = set()

    def post_through(target: Posting) -> None:
        for posting in plan if plan is not None else [target]:
            if posting in posted:
                continue
            if posting.sends and posting != target:
                return  # its action has not run yet
            program.append(("post", posting))
            posted.add(posting)
            if posting == target:
                return

    def remote(message: Message | None) -> Message | None:
        return None if message is None or owners[message.sender] == owners[message.receiver] else message

    actions = [(remote(a.receives(rank, num_stages)), remote(a.sends(rank, num_stages))) for a in ranks[rank]]
    for position, (receives, sends) in enumerate(actions):
        upcoming = next((r for r, _ in actions[position:] if r is not None), None)
        if upcoming is not None:
            post_through(Posting(upcoming, False))
        if receives is not None:
            post_through(Posting(receives, False))
            program.append(("wait", Posting(receives, False)))
        if sends is not None:
            post_through(Posting(sends, True))
    return program


def _replay(ranks: Sequence[Sequence[Action]], programs: Sequence[Sequence[Post]], one_stream: bool) -> str | None:
    """Run the programs: an operation completes only at the head of its stream, together with
    the peer's operation at the head of the peer's (a send waits for its receive). Returns why
    it stopped short (a hang, or two operations paired with different messages), else None."""
    owners = stage_owners(ranks)

    def peer_of(rank: int, posting: Posting) -> int:
        m = posting.message
        return owners[m.receiver] if posting.sends else owners[m.sender]

    def stream(rank: int, peer: int) -> tuple[int, int]:
        return (rank, -1) if one_stream else (rank, peer)

    streams: dict[tuple[int, int], deque[Posting]] = {}
    done: set[tuple[int, Posting]] = set()
    cursor = [0] * len(programs)
    progressed = True
    while progressed:
        progressed = False
        for rank, program in enumerate(programs):
            while cursor[rank] < len(program):
                kind, posting = program[cursor[rank]]
                if kind == "wait" and (rank, posting) not in done:
                    break
                if kind == "post":
                    streams.setdefault(stream(rank, peer_of(rank, posting)), deque()).append(posting)
                cursor[rank] += 1
                progressed = True
        for (rank, _), queue in list(streams.items()):
            if not queue:
                continue
            head = queue[0]
            peer = peer_of(rank, head)
            other = streams.get(stream(peer, rank))
            if not other or peer_of(peer, other[0]) != rank or other[0].sends == head.sends:
                continue
            if other[0].message != head.message:
                return f"ranks {rank} and {peer} pair {head} with {other[0]}"
            done.update({(rank, queue.popleft()), (peer, other.popleft())})
            progressed = True
    stuck = {rank: program[cursor[rank]] for rank, program in enumerate(programs) if cursor[rank] < len(program)}
    left = {key: list(queue) for key, queue in streams.items() if queue}
    return f"hangs: hosts at {stuck}, streams hold {left}" if stuck or left else None


CASES = [
    (name, p, m, twobp)
    for name in SCHEDULES + MULTI_STAGE_SCHEDULES
    for p in (2, 3, 4)
    for m in (p, 2 * p, 3 * p) + (() if name == "interleaved-1f1b" else (2 * p + 1,))
    for twobp in (True, False)
]


@pytest.mark.parametrize("one_stream", [False, True], ids=["stream-per-peer", "one-stream"])
@pytest.mark.parametrize(("name", "p", "m", "twobp"), CASES, ids=[f"{n}-p{p}-m{m}-{t}" for n, p, m, t in CASES])
def test_every_schedule_posted_in_the_plan_completes_under_nccl_rules(name, p, m, twobp, one_stream) -> None:
    ranks = schedule(name, p, m, twobp)
    programs = [_program(ranks, rank, posting_order(ranks, rank)) for rank in range(p)]
    assert _replay(ranks, programs, one_stream) is None


def _short(postings: Sequence[Posting]) -> list[str]:
    """``"send 0>1 a0"``: the direction, the stages, the payload's letter and the micro-batch."""
    return [
        f"{'send' if p.sends else 'receive'} {p.message.sender}>{p.message.receiver} "
        f"{p.message.payload.value[0]}{p.message.micro_batch}"
        for p in postings
    ]


def test_1f1b_takes_each_gradient_before_the_next_activation_it_sends() -> None:
    ranks = schedule("1f1b-1", 2, 3)
    assert _short(posting_order(ranks, 0)) == [
        "send 0>1 a0", "send 0>1 a1", "receive 1>0 g0", "send 0>1 a2", "receive 1>0 g1", "receive 1>0 g2",
    ]  # fmt: skip
    assert _short(posting_order(ranks, 1)) == [
        "receive 0>1 a0", "receive 0>1 a1", "send 1>0 g0", "receive 0>1 a2", "send 1>0 g1", "send 1>0 g2",
    ]  # fmt: skip


def test_the_v_posts_both_stages_messages_to_a_peer_in_the_peers_order() -> None:
    """Rank 0 holds stages 0 and 3, rank 1 stages 1 and 2: two stages' messages share the pair,
    and the hand-over between stages 1 and 2 on rank 1 is no message."""
    ranks = schedule("zbv", 2, 2)
    assert _short(posting_order(ranks, 0)) == [
        "send 0>1 a0", "send 0>1 a1", "receive 2>3 a0", "send 3>2 g0", "receive 2>3 a1", "send 3>2 g1",
        "receive 1>0 g0", "receive 1>0 g1",
    ]  # fmt: skip
    assert _short(posting_order(ranks, 1)) == [
        "receive 0>1 a0", "receive 0>1 a1", "send 2>3 a0", "receive 3>2 g0", "send 2>3 a1", "receive 3>2 g1",
        "send 1>0 g0", "send 1>0 g1",
    ]  # fmt: skip


@pytest.mark.parametrize("name", ["1f1b-1", "zbv"])
def test_posting_each_message_for_its_action_fails_under_nccl_rules(name: str) -> None:
    """The replay can fail: the runtime's earlier posting, each receive for its action (or the
    one before), hangs or pairs the wrong messages."""
    ranks = schedule(name, 2, 4)
    assert _replay(ranks, [_program(ranks, rank, None) for rank in range(2)], one_stream=False) is not None
