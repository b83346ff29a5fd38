"""The probing of what autocast does to each norm's public op (twobp_autograd/ops/autocast.py);
the norms under autocast themselves run in tests/ops/test_norm.py."""

from __future__ import annotations

import pytest
import torch

from twobp_autograd.ops import autocast


def test_autocast_casts_follow_the_public_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """What autocast does to the public op is read off the op itself, so the native op the
    forward calls gets the same arguments on any device; CPU autocast leaves the norms alone."""
    target = autocast.autocast_target
    target.cache_clear()
    monkeypatch.setitem(autocast.AUTOCAST_PROBES, "fp32-listed", lambda x: x.float())
    monkeypatch.setitem(autocast.AUTOCAST_PROBES, "fast-listed", lambda x: x.to(torch.bfloat16))
    monkeypatch.setitem(autocast.AUTOCAST_PROBES, "unlisted", lambda x: x)
    assert target("fp32-listed", "cpu", torch.bfloat16) == torch.float32
    assert target("fast-listed", "cpu", torch.bfloat16) == torch.bfloat16
    assert target("unlisted", "cpu", torch.bfloat16) is None
    for op in ("batch_norm", "layer_norm", "group_norm", "rms_norm"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert target(op, "cpu", torch.bfloat16) is None, op
    target.cache_clear()

    x, w, i, d = torch.randn(2, 3), torch.randn(3), torch.arange(3), torch.randn(3, dtype=torch.float64)
    monkeypatch.setitem(autocast.AUTOCAST_PROBES, "layer_norm", lambda x: x.float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast_input, cast_params = autocast.as_autocast_casts("layer_norm", x.bfloat16(), w.bfloat16(), i, d, None)
    assert cast_input.dtype == torch.float32
    assert [t.dtype for t in cast_params[:3]] == [torch.float32, torch.int64, torch.float64]
    assert cast_params[3] is None
    assert autocast.as_autocast_casts("layer_norm", x.bfloat16())[0].dtype == torch.bfloat16  # autocast off
    target.cache_clear()


def test_a_reduced_precision_linear_weight_gradient_is_summed_in_fp32_under_autocast() -> None:
    """A flush re-enters the autocast its backward ran in; the kernel's fp32 product must not
    be cast back to bf16 there, which rounded a whole joined sum once (measured at 128 joined
    micro-batches: 2.7x plain autograd's error against fp64)."""
    from twobp_autograd.ops.linear import linear_weight_grad

    rows, grad = torch.randn(512, 16).bfloat16(), torch.randn(512, 8).bfloat16()
    exact = grad.float().t().mm(rows.float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        weight_grad, bias_grad = linear_weight_grad((rows,), (grad,), (True, True))
    assert weight_grad.dtype == torch.float32
    torch.testing.assert_close(weight_grad, exact, rtol=0, atol=0)
    torch.testing.assert_close(bias_grad, grad.float().sum(0), rtol=1e-6, atol=1e-6)
