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


@pytest.mark.parametrize(
    ("make", "shapes"),
    [
        (lambda: nn.GroupNorm(2, 4), [(2, 4, 4, 5), (3, 4, 7, 5)]),
        (lambda: nn.LayerNorm([4, 5]), [(2, 3, 4, 5), (3, 6, 4, 5)]),
        (lambda: nn.RMSNorm([4, 5]), [(2, 3, 4, 5), (3, 6, 4, 5)]),
    ],
    ids=["group-norm", "layer-norm", "rms-norm"],
)
def test_compiled_norms_recompiled_for_new_shapes_match_autograd(make, shapes):
    """A second input shape makes dynamo recompile with symbolic sizes. The norms save their
    op's statistics for the weight kernel: handed to the tap still differentiable, GroupNorm's
    made inductor's backward fail to compile ("Cannot convert expression to float")."""
    torch._dynamo.reset()
    patched, reference = patched_and_reference(make().double())
    compiled = torch.compile(patched, backend="inductor")
    for shape in shapes:
        x = torch.randn(shape, dtype=torch.float64)
        compiled(x.clone().requires_grad_()).pow(2).sum().backward()
        reference(x.clone().requires_grad_()).pow(2).sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)
