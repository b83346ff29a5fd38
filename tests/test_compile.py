"""torch.compile over a patched model: the deferred ops trace (or break the graph) and still
defer, and the flush gives plain autograd's gradients and buffers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import twobp_autograd as twobp
from tests.utils import assert_grads_match, assert_no_grads, patched_and_reference


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_patched_model_defers_and_matches_autograd(backend):
    torch._dynamo.reset()
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
        nn.Linear(8 * 6 * 6, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4),
    )  # fmt: skip
    patched, reference = patched_and_reference(model)
    compiled = torch.compile(patched, backend=backend)
    for _ in range(2):
        x = torch.randn(5, 3, 8, 8)
        compiled(x).pow(2).sum().backward()
        reference(x).pow(2).sum().backward()
    assert_no_grads(patched)
    assert twobp.pending().jobs == 2 * 5
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)
    for (name, b), c in zip(patched.named_buffers(), reference.buffers(), strict=True):
        torch.testing.assert_close(b, c, msg=name)
