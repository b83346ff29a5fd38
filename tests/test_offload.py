"""Host offload of pending weight-gradient work: CUDA tensors parked in pinned host memory
between backward-p1 and the flush, gradients still equal to plain autograd's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import twobp_autograd as twobp
from tests.utils import assert_grads_match, patched_and_reference

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        # ReLU first: a bias right before a batch norm has a gradient of exactly zero, which
        # leaves only rounding to compare (1e-6 apart on a GPU, measured).
        nn.ReLU(),
        nn.BatchNorm2d(8),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 16),
        nn.LayerNorm(16),
        nn.Linear(16, 4),
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for machines without CUDA")
def test_offload_without_cuda_is_refused_with_a_reason():
    with pytest.raises(ValueError, match="CUDA is not available"):
        twobp.WeightGradQueue(offload_to_host=True)


@needs_cuda
@pytest.mark.parametrize("streams", [1, 2], ids=["one-stream", "two-streams"])
@pytest.mark.parametrize("strategy", ["concat", "loop"])
def test_offloaded_work_gives_autograd_gradients_and_leaves_the_device(strategy, streams):
    patched, reference = patched_and_reference(_model().cuda())
    queue = twobp.WeightGradQueue(strategy, offload_to_host=True, weight_grad_streams=streams)
    for _ in range(3):
        x = torch.randn(4, 3, 8, 8, device="cuda")
        with twobp.use_queue(queue):
            patched(x).pow(2).sum().backward()
        reference(x).pow(2).sum().backward()
    assert queue.pending().jobs == 3 * 5 and queue.pending().bytes == 0  # nothing held on the GPU
    assert all(t.device.type == "cpu" and t.is_pinned() for job in queue._jobs for t in job.tensors())
    queue.flush()
    assert_grads_match(patched, reference)


@needs_cuda
def test_offload_frees_device_memory_held_by_pending_work():
    layer = twobp.patch(nn.Linear(1024, 1024).cuda())
    held = {}
    for offload in (False, True):
        queue = twobp.WeightGradQueue(offload_to_host=offload)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with twobp.use_queue(queue):
            for _ in range(4):
                layer(torch.randn(256, 1024, device="cuda")).pow(2).sum().backward()
        torch.cuda.synchronize()
        torch.empty(1, device="cuda")  # lets the allocator retire blocks whose copies are done
        held[offload] = torch.cuda.memory_allocated() - before
        queue.flush()
        layer.weight.grad = layer.bias.grad = None
    activations = 4 * 2 * 256 * 1024 * 4  # inputs and output gradients, fp32
    assert held[False] >= activations
    assert held[True] < activations / 4  # gradients of the last backward's loss at most


@needs_cuda
def test_a_tensor_several_layers_saved_is_parked_once():
    q, k, v = (twobp.patch(nn.Linear(64, 64).cuda()) for _ in range(3))
    queue = twobp.WeightGradQueue(offload_to_host=True)
    x = torch.randn(32, 64, device="cuda", requires_grad=True)
    with twobp.use_queue(queue):
        (q(x) * k(x) + v(x)).sum().backward()
    inputs = {job.saved[0].untyped_storage().data_ptr() for job in queue._jobs}
    assert len(queue._jobs) == 3 and len(inputs) == 1
    queue.flush()
    assert q.weight.grad is not None


@needs_cuda
def test_writing_the_input_after_backward_does_not_change_offloaded_work():
    """The parked values are backward-p1's: plain autograd computed dW from those too."""
    patched, reference = patched_and_reference(nn.Linear(32, 8).cuda())
    queue = twobp.WeightGradQueue(offload_to_host=True)
    buffer = torch.randn(16, 32, device="cuda")
    with twobp.use_queue(queue):
        patched(buffer).pow(2).sum().backward()
    reference(buffer).pow(2).sum().backward()
    buffer.normal_()  # an input buffer refilled for the next micro-batch
    queue.flush()
    assert_grads_match(patched, reference)


class _SharedGradient(nn.Module):
    """``s = layer(x) + z`` with ``z`` used again, made first: autograd hands the layer's output
    gradient, uncopied, to ``z``'s input buffer too, and ``z``'s other gradient comes later."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.layer = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, z0: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        z = z0 * 1.0
        other = z * scale
        return (self.layer(x) + z).sum() + other.sum()


@needs_cuda
def test_an_output_gradient_autograd_could_accumulate_into_stays_held_while_its_copy_runs():
    """With its device tensor let go as its copy started, autograd found no other holder of the
    output gradient and accumulated ``z``'s other gradient into it, in place, while the copy to
    host memory could still be reading it. Held until the copy is done, it is not written."""
    width, rows = 2048, 4096  # a copy long enough to race
    patched, reference = patched_and_reference(_SharedGradient(width).cuda())
    x = torch.randn(rows, width, device="cuda")
    z0 = torch.randn(rows, width, device="cuda", requires_grad=True)
    scale = torch.randn(rows, width, device="cuda") * 100
    queue = twobp.WeightGradQueue(offload_to_host=True)
    with twobp.use_queue(queue):
        patched(x, z0, scale).backward()
    reference(x, z0, scale).backward()
    queue.flush()
    torch.cuda.synchronize()
    assert_grads_match(patched, reference)

