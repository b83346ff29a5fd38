"""What BatchNorm alone does: in training its weight and bias gradients are finished in
backward-p1 (on the way to the input gradient) and queued as 2 x C numbers, not the input; in
eval or without affine parameters it takes the plain path; it keeps torch.batch_norm's errors.
The settings it shares with the other norms run in tests/ops/test_norm.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

import twobp_autograd as twobp
from tests.ops.norm_settings import BATCH_NORM, cubic_loss
from tests.utils import assert_grads_match, assert_no_grads, patched_and_reference


def test_batch_norm_eval_takes_the_plain_path() -> None:
    module = BATCH_NORM[2].module(torch.float32)
    patched, reference = patched_and_reference(module)
    patched.eval(), reference.eval()
    x = torch.randn(2, 3, 4, 5)
    cubic_loss(patched(x)).backward()
    cubic_loss(reference(x)).backward()
    assert twobp.pending().jobs == 0
    assert patched.weight.grad is not None
    assert_grads_match(patched, reference)


def test_batch_norm_without_affine_is_never_deferred() -> None:
    patched, reference = patched_and_reference(nn.BatchNorm2d(3, affine=False, momentum=None))
    for batch in (4, 2):
        x = torch.randn(batch, 3, 4, 5)
        xp, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        cubic_loss(patched(xp)).backward()
        cubic_loss(reference(xr)).backward()
        torch.testing.assert_close(xp.grad, xr.grad)
    assert twobp.pending().jobs == 0
    for b, c in zip(patched.buffers(), reference.buffers(), strict=True):
        torch.testing.assert_close(b, c)


def test_batch_norm_keeps_its_errors() -> None:
    patched = twobp.patch(nn.BatchNorm1d(4))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        patched(torch.randn(1, 4))
    with pytest.raises(ValueError, match="expected 2D or 3D input"):
        patched(torch.randn(2, 4, 3, 3))
    assert twobp.pending().jobs == 0


@pytest.mark.parametrize(
    "track_running_stats, refused", [(True, "running_mean"), (False, "weight")], ids=["running-stats", "batch-stats"]
)
def test_batch_norm_refuses_the_wrong_number_of_channels(track_running_stats: bool, refused: str) -> None:
    """As plain does: the native op the patched forward calls checks nothing, and read (and
    wrote) past the end of the statistics, or returned a silently wrong output."""
    plain = nn.BatchNorm1d(3, track_running_stats=track_running_stats)
    patched = twobp.patch(copy.deepcopy(plain))
    x = torch.randn(4, 5, requires_grad=True)
    message = f"{refused} should contain 5 elements not 3"
    for module in (plain, patched):
        with pytest.raises(RuntimeError, match=message):
            module(x)
    assert twobp.pending().jobs == 0


# -- dgamma and dbeta finished in backward-p1 ---------------------------------------------------


def _batch_norm_twins(dtype: torch.dtype = torch.float64) -> tuple[nn.Module, nn.Module]:
    return patched_and_reference(BATCH_NORM[2].module(dtype))


def _batch_norm_input(batch: int = 4, dtype: torch.dtype = torch.float64) -> Tensor:
    return BATCH_NORM[2].input((batch, *BATCH_NORM[2].shapes[0][1:]), dtype).requires_grad_()


def test_batch_norm_queues_its_finished_grads_not_its_input() -> None:
    """A BatchNorm job holds dgamma and dbeta (2 x C numbers), not the input activation: the
    input may even change in place before the flush."""
    patched, reference = _batch_norm_twins(torch.float32)
    channels = patched.num_features
    inputs = [_batch_norm_input(batch, torch.float32) for batch in (4, 6, 3)]
    for x in inputs:
        cubic_loss(patched(x)).backward()
        cubic_loss(reference(x.detach().clone())).backward()
    per_job = 2 * channels * 4
    assert per_job < inputs[0].numel() * 4
    assert twobp.pending() == (3, 3 * per_job)
    assert_no_grads(patched)
    with torch.no_grad():
        for x in inputs:
            x.zero_()  # the queue holds no reference to it: no version error at the flush
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


def test_batch_norm_input_only_backward_queues_nothing() -> None:
    patched, reference = _batch_norm_twins()
    x = _batch_norm_input()
    x_ref = x.detach().clone().requires_grad_()
    (got,) = torch.autograd.grad(cubic_loss(patched(x)), [x])
    (want,) = torch.autograd.grad(cubic_loss(reference(x_ref)), [x_ref])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert twobp.pending().jobs == 0
    cubic_loss(patched(x)).backward(inputs=[x])
    cubic_loss(reference(x_ref)).backward(inputs=[x_ref])
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-10, atol=1e-12)
    assert twobp.pending().jobs == 0
    assert_no_grads(patched)
    twobp.flush_weight_grads()
    assert_no_grads(patched)


@pytest.mark.parametrize(
    "wanted", [["weight", "bias"], ["weight"], ["input", "bias"]], ids=["weight-and-bias", "weight", "input-and-bias"]
)
def test_batch_norm_autograd_grad_returns_what_it_asks_at_once(wanted: list[str]) -> None:
    patched, reference = _batch_norm_twins()
    x = _batch_norm_input()
    x_ref = x.detach().clone().requires_grad_()
    pick_p = {"input": x, "weight": patched.weight, "bias": patched.bias}
    pick_r = {"input": x_ref, "weight": reference.weight, "bias": reference.bias}
    got = torch.autograd.grad(cubic_loss(patched(x)), [pick_p[w] for w in wanted])
    want = torch.autograd.grad(cubic_loss(reference(x_ref)), [pick_r[w] for w in wanted])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    assert twobp.pending().jobs == 0
    assert_no_grads(patched)


def test_batch_norm_backward_with_weight_inputs_defers_that_weight_only() -> None:
    patched, reference = _batch_norm_twins()
    x = _batch_norm_input()
    cubic_loss(patched(x)).backward(inputs=[patched.weight])
    cubic_loss(reference(x.detach().clone())).backward(inputs=[reference.weight])
    assert x.grad is None and twobp.pending().jobs == 1
    assert twobp.pending().bytes == patched.num_features * 8  # dgamma alone
    assert_no_grads(patched)
    twobp.flush_weight_grads()
    assert patched.bias.grad is None
    assert_grads_match(patched, reference, torch.float64)


def test_batch_norm_retain_graph_backward_twice() -> None:
    patched, reference = _batch_norm_twins()
    x = _batch_norm_input()
    for model in (patched, reference):
        loss = cubic_loss(model(x.detach().clone()))
        loss.backward(retain_graph=True)
        loss.backward()
    assert twobp.pending().jobs == 2
    assert_no_grads(patched)
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)


def test_batch_norm_called_twice_in_one_forward() -> None:
    """Two calls, two sets of statistics, two jobs; the running statistics move twice."""
    patched, reference = _batch_norm_twins()
    x = _batch_norm_input()
    x_ref = x.detach().clone().requires_grad_()
    cubic_loss(patched(torch.tanh(patched(x)))).backward()
    cubic_loss(reference(torch.tanh(reference(x_ref)))).backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-10, atol=1e-12)
    assert twobp.pending().jobs == 2
    assert_no_grads(patched)
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)
    for b, c in zip(patched.buffers(), reference.buffers(), strict=True):
        torch.testing.assert_close(b, c, rtol=1e-10, atol=1e-12)
    assert int(patched.num_batches_tracked) == 2


def test_batch_norm_jobs_go_to_the_queue_and_tag_of_their_forward() -> None:
    patched, reference = _batch_norm_twins()
    queue = twobp.WeightGradQueue()
    xs = [_batch_norm_input(batch) for batch in (4, 5)]
    outputs = []
    with twobp.use_queue(queue):
        for mb, x in enumerate(xs):
            with queue.tagged(mb):
                outputs.append(patched(x))
    for out in outputs:  # backward outside any use_queue / tagged block
        cubic_loss(out).backward()
    assert (queue.tags(), twobp.pending().jobs) == ([0, 1], 0)
    queue.flush(tags=[1])
    cubic_loss(reference(xs[1].detach().clone())).backward()
    assert_grads_match(patched, reference, torch.float64)
    queue.flush(tags=[0])
    cubic_loss(reference(xs[0].detach().clone())).backward()
    assert_grads_match(patched, reference, torch.float64)
    assert queue.pending() == (0, 0)


@pytest.mark.parametrize("strategy", ["loop", "concat"])
def test_batch_norm_flush_leaves_the_finished_grads_untouched(strategy: str) -> None:
    """The kernel hands back tensors the job holds: summing them must not write into them."""
    from twobp_autograd.flush import FlushOptions, run_jobs
    from twobp_autograd.queue import current_queue

    patched, reference = _batch_norm_twins()
    for batch in (4, 6, 3):
        x = _batch_norm_input(batch)
        cubic_loss(patched(x)).backward()
        cubic_loss(reference(x.detach().clone())).backward()
    patched.weight.grad = torch.ones_like(patched.weight)  # .grad already there: accumulated into
    reference.weight.grad = reference.weight.grad + 1
    jobs = current_queue().take()
    before = [[t.clone() for t in job.saved] for job in jobs]
    run_jobs(jobs, FlushOptions(strategy))
    for job, kept in zip(jobs, before, strict=True):
        for t, k in zip(job.saved, kept, strict=True):
            assert torch.equal(t, k)
    assert_grads_match(patched, reference, torch.float64)


def test_batch_norm_create_graph_on_the_input_alone_is_refused() -> None:
    patched = twobp.patch(BATCH_NORM[2].module(torch.float64))
    x = _batch_norm_input()
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(cubic_loss(patched(x)), [x], create_graph=True)
    assert twobp.pending().jobs == 0



def test_an_input_made_in_inference_mode_is_refused_before_the_running_statistics_move() -> None:
    """Plain refuses to save an inference tensor for backward before its kernel runs: the running
    statistics stay where they were. The rule ran the kernel first, then failed to save."""
    patched, reference = patched_and_reference(nn.BatchNorm2d(3))
    with torch.inference_mode():
        x = torch.randn(4, 3, 2, 2) * 3 + 1
    for model in (patched, reference):
        with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
            model(x)
    for name, buffer in reference.named_buffers():
        assert torch.equal(patched.get_buffer(name), buffer), name
