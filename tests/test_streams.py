"""Backward-p2 over several streams: launch every layer's kernels first, then sum and deliver
in order. On a CPU the launch runs the kernels in order (no streams), which still exercises the
bookkeeping; the CUDA cases run the kernels on side streams."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import twobp_autograd as twobp
from tests.utils import assert_grads_match, patched_and_reference

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]


class SharedLayers(nn.Module):
    """A layer used at two shapes (two groups for one parameter) and a conv stack."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3))
        self.shared = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x).mean((2, 3))  # (N, 4)
        h = self.shared(h) + self.shared(h.unsqueeze(1).expand(-1, 3, -1)).mean(1)
        return self.head(torch.tanh(h))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bucket_bytes", [None, 1], ids=["deliver-at-end", "deliver-per-layer"])
@pytest.mark.parametrize("strategy", ["concat", "loop"])
@pytest.mark.parametrize("streams", [2, 3])
def test_flush_over_several_streams_equals_autograd(device, bucket_bytes, strategy, streams):
    patched, reference = patched_and_reference(SharedLayers().to(device))
    queue = twobp.WeightGradQueue(strategy, delivery_bucket_bytes=bucket_bytes, weight_grad_streams=streams)
    for _ in range(3):
        x = torch.randn(2, 3, 8, 8, device=device)
        with twobp.use_queue(queue):
            patched(x).pow(2).sum().backward()
        reference(x).pow(2).sum().backward()
    assert patched.shared.weight.grad is None and queue.pending().jobs > 0
    queue.flush()
    assert queue.pending() == (0, 0)
    assert_grads_match(patched, reference)


def test_stream_count_must_be_positive():
    with pytest.raises(ValueError, match="weight_grad_streams"):
        twobp.WeightGradQueue(weight_grad_streams=0)
