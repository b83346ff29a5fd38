"""The norm families' test settings and the checks they share (tests/ops/test_norm.py runs
every family through them, tests/ops/test_batch_norm.py what BatchNorm alone does).

Besides the weight gradients, every setting checks what backward-p1 delivers at once (the
input gradient, which for BatchNorm passes through the micro-batch statistics), the output
bit for bit, and BatchNorm's running statistics after several micro-batches of different sizes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor, nn

import twobp_autograd as twobp
from tests.utils import TOLERANCES, assert_grads_match, assert_no_grads, patched_and_reference


@dataclass(frozen=True)
class Setting:
    id: str
    make_module: Callable[[], nn.Module]
    #: One input shape per micro-batch (BatchNorm: different sizes, different statistics).
    shapes: tuple[tuple[int, ...], ...]
    channels_last: bool = False

    def module(self, dtype: torch.dtype) -> nn.Module:
        module = self.make_module().to(dtype)
        with torch.no_grad():  # away from ones/zeros, so the input gradient depends on them
            for name, p in module.named_parameters():
                p.normal_(1.0 if name == "weight" else 0.0, 0.5)
        return module

    def input(self, shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu") -> Tensor:
        x = torch.randn(shape, dtype=dtype, device=device) * 2 + 0.5
        if self.channels_last:
            x = x.to(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
        return x


def _without_weight(module: nn.Module) -> nn.Module:
    """A norm whose weight was set to None, its bias kept: F.layer_norm, F.group_norm and
    F.batch_norm take that, and the rules crashed on it (they found the dtype on the weight)."""
    module.weight = None
    return module


def _sizes(*rest: int, batches: Sequence[int] = (4, 6, 3)) -> tuple[tuple[int, ...], ...]:
    return tuple((b, *rest) for b in batches)


BATCH_NORM = [
    Setting("bn1d-2d-input", lambda: nn.BatchNorm1d(4), _sizes(4)),
    Setting("bn1d-3d-input", lambda: nn.BatchNorm1d(4), _sizes(4, 5)),
    Setting("bn2d", lambda: nn.BatchNorm2d(3), _sizes(3, 4, 5)),
    Setting("bn2d-channels-last", lambda: nn.BatchNorm2d(3), _sizes(3, 4, 5), channels_last=True),
    Setting("bn3d", lambda: nn.BatchNorm3d(2), _sizes(2, 3, 2, 2)),
    Setting("bn3d-channels-last", lambda: nn.BatchNorm3d(2), _sizes(2, 3, 2, 2), channels_last=True),
    Setting("bn2d-momentum-none", lambda: nn.BatchNorm2d(3, momentum=None), _sizes(3, 4, 5)),
    Setting("bn2d-momentum-eps", lambda: nn.BatchNorm2d(3, eps=1e-2, momentum=0.3), _sizes(3, 4, 5)),
    Setting("bn2d-no-running-stats", lambda: nn.BatchNorm2d(3, track_running_stats=False), _sizes(3, 4, 5)),
    Setting("bn1d-no-bias", lambda: nn.BatchNorm1d(4, bias=False), _sizes(4, 5)),
    Setting("bn2d-no-weight", lambda: _without_weight(nn.BatchNorm2d(3)), _sizes(3, 4, 5)),
]

LAYER_NORM = [
    Setting("ln", lambda: nn.LayerNorm(8), _sizes(3, 8)),
    Setting("ln-2d-input", lambda: nn.LayerNorm(8), _sizes(8)),
    Setting("ln-multi-dim-shape", lambda: nn.LayerNorm((3, 4)), _sizes(2, 3, 4)),
    Setting("ln-unbatched", lambda: nn.LayerNorm((3, 4)), ((3, 4),) * 3),
    Setting("ln-no-bias", lambda: nn.LayerNorm(8, bias=False), _sizes(3, 8)),
    Setting("ln-eps", lambda: nn.LayerNorm(8, eps=1e-2), _sizes(3, 8)),
    Setting("ln-no-weight", lambda: _without_weight(nn.LayerNorm(8)), _sizes(3, 8)),
    Setting("ln-2d-input-no-weight", lambda: _without_weight(nn.LayerNorm(8)), _sizes(8)),
]

GROUP_NORM = [
    Setting("gn-1-group", lambda: nn.GroupNorm(1, 6), _sizes(6, 3, 3)),
    Setting("gn-group-per-channel", lambda: nn.GroupNorm(6, 6), _sizes(6, 3, 3)),
    Setting("gn-3-groups", lambda: nn.GroupNorm(3, 6), _sizes(6, 3, 3)),
    Setting("gn-channels-last", lambda: nn.GroupNorm(3, 6), _sizes(6, 3, 3), channels_last=True),
    Setting("gn-2d-input", lambda: nn.GroupNorm(2, 6), _sizes(6)),
    Setting("gn-3d-input", lambda: nn.GroupNorm(2, 6), _sizes(6, 5)),
    Setting("gn-no-bias", lambda: nn.GroupNorm(3, 6, bias=False), _sizes(6, 3, 3)),
    Setting("gn-no-weight", lambda: _without_weight(nn.GroupNorm(3, 6)), _sizes(6, 3, 3)),
]

INSTANCE_NORM = [
    Setting("in1d", lambda: nn.InstanceNorm1d(4, affine=True), _sizes(4, 5)),
    Setting("in1d-unbatched", lambda: nn.InstanceNorm1d(4, affine=True), ((4, 5),) * 3),
    Setting("in2d", lambda: nn.InstanceNorm2d(3, affine=True), _sizes(3, 4, 5)),
    Setting("in2d-channels-last", lambda: nn.InstanceNorm2d(3, affine=True), _sizes(3, 4, 5), channels_last=True),
    Setting("in3d", lambda: nn.InstanceNorm3d(2, affine=True), _sizes(2, 3, 2, 2)),
    Setting(
        "in2d-running-stats",
        lambda: nn.InstanceNorm2d(3, affine=True, track_running_stats=True, momentum=0.3),
        _sizes(3, 4, 5),
    ),
    Setting(
        "in2d-momentum-none",
        lambda: nn.InstanceNorm2d(3, affine=True, track_running_stats=True, momentum=None),
        _sizes(3, 4, 5),
    ),
    Setting("in2d-eps", lambda: nn.InstanceNorm2d(3, affine=True, eps=1e-2), _sizes(3, 4, 5)),
    Setting("in2d-no-bias", lambda: nn.InstanceNorm2d(3, affine=True, bias=False), _sizes(3, 4, 5)),
    Setting("in2d-no-weight", lambda: _without_weight(nn.InstanceNorm2d(3, affine=True)), _sizes(3, 4, 5)),
]

RMS_NORM = [
    Setting("rms-eps-none", lambda: nn.RMSNorm(8), _sizes(3, 8)),
    Setting("rms-eps", lambda: nn.RMSNorm(8, eps=1e-2), _sizes(3, 8)),
    Setting("rms-multi-dim-shape", lambda: nn.RMSNorm((3, 4)), _sizes(2, 3, 4)),
    Setting("rms-unbatched", lambda: nn.RMSNorm(8), ((8,),) * 3),
    # 4-D inputs take the public op and recompute 1/rms at the flush (the others keep it).
    Setting("rms-4d-input", lambda: nn.RMSNorm(8), _sizes(2, 3, 8)),
    Setting("rms-channels-last", lambda: nn.RMSNorm((4, 5)), _sizes(3, 4, 5), channels_last=True),
]



def _hugging_face_rms_norms() -> list[Setting]:
    """Hugging Face's LlamaRMSNorm and Mamba's copy of it under ``twobp.ops.llama_rms_norm``,
    registered as each module is made (tests/conftest.py forgets it after the test)."""
    try:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
        from transformers.models.mamba.modeling_mamba import MambaRMSNorm
    except ImportError:
        return []

    def registered(module: nn.Module) -> nn.Module:
        twobp.register((LlamaRMSNorm, MambaRMSNorm), twobp.ops.llama_rms_norm)
        return module

    return [
        Setting("llama-rms-3d-input", lambda: registered(LlamaRMSNorm(8)), _sizes(5, 8)),
        Setting("llama-rms-2d-input", lambda: registered(LlamaRMSNorm(8)), _sizes(8)),
        Setting("llama-rms-eps", lambda: registered(LlamaRMSNorm(8, eps=1e-2)), _sizes(5, 8)),
        Setting("llama-rms-unbatched", lambda: registered(LlamaRMSNorm(8)), ((8,),) * 3),
        Setting("mamba-rms", lambda: registered(MambaRMSNorm(8)), _sizes(5, 8)),
    ]


HUGGING_FACE_RMS_NORM = _hugging_face_rms_norms()

ALL = BATCH_NORM + LAYER_NORM + GROUP_NORM + INSTANCE_NORM + RMS_NORM + HUGGING_FACE_RMS_NORM
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float64, id="fp64")]


def setting_ids(settings: Sequence[Setting]) -> list[str]:
    return [s.id for s in settings]


def cubic_loss(output: Tensor) -> Tensor:
    # Not sum(y^2): over a normalised output that is nearly constant, and so is its gradient.
    return (output.float() ** 3).sum() / output.numel()


def run_micro_batches(
    module: nn.Module,
    setting: Setting,
    *,
    dtype: torch.dtype,
    input_dtype: torch.dtype | None = None,
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    device: str = "cpu",
) -> None:
    """Patched ``module`` and a plain copy through the setting's micro-batches: equal outputs
    (values, dtype, strides), equal input gradients during backward-p1, one job per call and no
    ``.grad`` before the flush, equal ``.grad`` and buffers after it."""
    rtol, atol = TOLERANCES[dtype]
    patched, reference = patched_and_reference(module.to(device))
    for shape in setting.shapes:
        x = setting.input(shape, input_dtype or dtype, device)
        xp, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        with context():
            yp, yr = patched(xp), reference(xr)
        assert yp.dtype == yr.dtype and yp.stride() == yr.stride()
        if device == "cpu":
            assert torch.equal(yp, yr), "the deferred forward must compute exactly the module's output"
        else:  # plain BatchNorm may run cuDNN there, the deferred one the native kernel
            torch.testing.assert_close(yp, yr, rtol=rtol, atol=atol)
        cubic_loss(yp).backward()
        cubic_loss(yr).backward()
        assert xr.grad.abs().max() > 1e-3, "degenerate check: the input gradient is ~0"
        torch.testing.assert_close(xp.grad, xr.grad, rtol=rtol, atol=atol)
    assert_no_grads(patched)
    assert twobp.pending().jobs == len(setting.shapes), "each call must queue one weight-grad job"
    twobp.flush_weight_grads()
    assert twobp.pending() == (0, 0)
    assert_grads_match(patched, reference, dtype)
    for (name, b), (_, c) in zip(patched.named_buffers(), reference.named_buffers(), strict=True):
        torch.testing.assert_close(b, c, rtol=rtol, atol=atol, msg=lambda m, name=name: f"buffer {name}: {m}")

