"""The flush as FSDP2's reduction follows it, in one process: a watch (what twobp_autograd.fsdp
registers) is told of each gradient as soon as it is final, and a flush that fails after
handing part of its work over says so and does not queue that work again (a retry would add
it twice); one that fails before any hand-over keeps its work queued."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
import torch
from torch import Tensor, nn

import twobp_autograd as twobp
from twobp_autograd.deferral import defer_weight_grads
from twobp_autograd.flush import PartlyDelivered, watch_flushes


class Gain(nn.Module):
    """``x * weight``, registered below with a kernel that fails on demand."""

    fail = False

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, n))


def _gain_weight_grad(saved: Sequence[Tensor], grad_outputs: Sequence[Tensor], needs: Sequence[bool]) -> list[Tensor]:
    if Gain.fail:
        raise RuntimeError("the kernel failed")
    return [(saved[0] * grad_outputs[0]).sum(0)]


def _gain_forward(module: Gain, x: Tensor) -> Tensor:
    weight = module.weight
    return defer_weight_grads(x * weight.detach(), (weight,), (x.detach(),), _gain_weight_grad)


class _Log:
    """A watch that records the parameters handed over, one list per hand-over."""

    def __init__(self, handovers: list[list[Tensor]], finished: list[bool]) -> None:
        self.handovers, self._finished = handovers, finished

    def completes(self, params: Sequence[Tensor]) -> bool:
        return True  # every gradient as soon as it is final

    def holds_back(self, param: Tensor) -> bool:
        return False

    def delivered(self, params: Sequence[Tensor]) -> None:
        self.handovers.append(list(params))

    def finished(self) -> None:
        self._finished.append(True)

    def abandoned(self) -> None:
        pass


@pytest.fixture
def watched() -> Iterator[tuple[list[list[Tensor]], list[bool]]]:
    twobp.register(Gain, _gain_forward)
    handovers: list[list[Tensor]] = []
    finished: list[bool] = []
    stop = watch_flushes(lambda params, early: _Log(handovers, finished))
    yield handovers, finished
    stop()
    Gain.fail = False


def _queued(model: nn.Module) -> twobp.WeightGradQueue:
    queue = twobp.WeightGradQueue()
    with twobp.use_queue(queue):
        model(torch.randn(4, 3)).pow(2).sum().backward()
    return queue


def test_a_watched_flush_hands_each_layer_over_as_soon_as_it_is_final(watched) -> None:
    handovers, finished = watched
    model = twobp.patch(nn.Sequential(Gain(3), nn.Linear(3, 3), nn.Linear(3, 2)))
    _queued(model).flush()
    assert [len(params) for params in handovers] == [2, 2, 1]  # last layer first, one hand-over each
    assert handovers[-1][0] is model[0].weight and finished == [True]
    assert all(p.grad is not None for p in model.parameters())


def test_a_flush_failing_after_a_hand_over_says_so_and_drops_the_rest(watched) -> None:
    handovers, finished = watched
    model = twobp.patch(nn.Sequential(Gain(3), nn.Linear(3, 3)))
    queue = _queued(model)  # the Linear's job runs first, then Gain's fails
    Gain.fail = True
    with pytest.raises(PartlyDelivered, match="twobp: .*zero_grad"):
        queue.flush()
    assert model[1].weight.grad is not None and model[0].weight.grad is None
    assert len(queue) == 0 and not finished


def test_a_flush_failing_before_any_hand_over_keeps_its_work(watched) -> None:
    model = twobp.patch(nn.Sequential(nn.Linear(3, 3), Gain(3)))
    queue = _queued(model)  # Gain's job runs first and fails
    Gain.fail = True
    with pytest.raises(RuntimeError, match="the kernel failed"):
        queue.flush()
    assert len(queue) == 2 and all(p.grad is None for p in model.parameters())
    Gain.fail = False
    queue.flush()
    assert all(p.grad is not None for p in model.parameters())


class _FailsAtTheEnd(_Log):
    def finished(self) -> None:
        raise KeyboardInterrupt("interrupted while waiting for the reductions")


def test_a_flush_whose_watch_fails_at_the_end_does_not_queue_its_delivered_work_again(watched) -> None:
    """A watch's end (FSDP2's last reductions and their wait) ran after the flush's failure
    handling: failing there, with every gradient in .grad, the work was queued again, and the next
    flush added it twice."""
    handovers, _ = watched
    stop = watch_flushes(lambda params, early: _FailsAtTheEnd(handovers, []))
    try:
        model = twobp.patch(nn.Sequential(Gain(3), nn.Linear(3, 3)))
        queue = _queued(model)
        with pytest.raises(KeyboardInterrupt) as raised:
            queue.flush()
    finally:
        stop()
    assert twobp.flush.partly_delivered(raised.value)
    assert len(queue) == 0 and all(p.grad is not None for p in model.parameters())
