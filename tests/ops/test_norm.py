"""BatchNorm1d/2d/3d, LayerNorm, GroupNorm, InstanceNorm1d/2d/3d and RMSNorm against plain autograd, every family
through the same settings table (tests/ops/norm_settings.py): weight gradients, outputs, input
gradients and buffers, autocast, frozen and rebuilt weights, autograd.grad and unpatch.
"""

from __future__ import annotations

import contextlib
import copy
import itertools

import pytest
import torch
from torch import nn

import twobp_autograd as twobp
from tests.ops.norm_settings import (
    ALL,
    BATCH_NORM,
    DTYPES,
    GROUP_NORM,
    LAYER_NORM,
    RMS_NORM,
    Setting,
    cubic_loss,
    run_micro_batches,
    setting_ids,
)
from tests.utils import (
    assert_grads_match,
    assert_no_grads,
    check_against_autograd,
    lossy_saved_tensors_hooks,
    patched_and_reference,
)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("setting", ALL, ids=setting_ids(ALL))
def test_weight_grads_match_autograd(setting: Setting, dtype: torch.dtype) -> None:
    shapes = itertools.cycle(setting.shapes)
    check_against_autograd(
        setting.module(dtype),
        lambda: (setting.input(next(shapes), dtype),),
        micro_batches=len(setting.shapes),
        dtype=dtype,
        loss=cubic_loss,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("setting", ALL, ids=setting_ids(ALL))
def test_outputs_input_grads_and_buffers_match_autograd(setting: Setting, dtype: torch.dtype) -> None:
    run_micro_batches(setting.module(dtype), setting, dtype=dtype)


def _transposed_cubic_loss(output: torch.Tensor) -> torch.Tensor:
    """The gradient reaches the layer transposed (not contiguous), as after a ``transpose``."""
    return cubic_loss(output.transpose(0, -1).contiguous())


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))],
)
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("setting", ALL, ids=setting_ids(ALL))
def test_weight_grads_match_autograd_on_each_device_and_gradient_layout(
    setting: Setting, layout: str, device: str
) -> None:
    """fp64, so any gap is a wrong result, not rounding. On CUDA GroupNorm's weight kernel read
    a transposed output gradient as contiguous (every weight gradient off, silently)."""
    shapes = itertools.cycle(setting.shapes)
    check_against_autograd(
        setting.module(torch.float64).to(device),
        lambda: (setting.input(next(shapes), torch.float64).to(device),),
        micro_batches=len(setting.shapes),
        dtype=torch.float64,
        loss=_transposed_cubic_loss if layout == "transposed" else cubic_loss,
    )


@pytest.mark.parametrize(
    ("norm", "dims", "autocast"),
    [(nn.GroupNorm(2, 4), (0, 1), False), (nn.LayerNorm(4), (0, 2), True)],
    ids=["group-norm", "layer-norm-under-autocast"],
)
def test_input_changed_in_place_before_backward_raises_as_in_plain(
    norm: nn.Module, dims: tuple[int, int], autocast: bool
) -> None:
    """A transposed input (a view of a residual stream updated in place after the forward):
    plain saves the view and its backward raises; the deferred GroupNorm, and LayerNorm's tap
    (autocast), had saved a contiguous copy and ran on. The input needs no gradient, so only the
    weight's saved input sees the change."""
    for module in patched_and_reference(norm):
        base = torch.randn(4, 3, 5 if autocast else 4).transpose(*dims)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            output = module(base)
        with torch.no_grad():
            base.add_(1.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            output.float().pow(2).sum().backward()
    twobp.discard_weight_grads()


AUTOCAST = [BATCH_NORM[2], BATCH_NORM[3], LAYER_NORM[0], LAYER_NORM[2], GROUP_NORM[2], GROUP_NORM[3], RMS_NORM[0]]


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # plain rms_norm's own
@pytest.mark.parametrize(
    "input_dtype", [pytest.param(torch.float32, id="fp32-input"), pytest.param(torch.bfloat16, id="bf16-input")]
)
@pytest.mark.parametrize("setting", AUTOCAST, ids=setting_ids(AUTOCAST))
def test_cpu_autocast_bf16(setting: Setting, input_dtype: torch.dtype) -> None:
    # CPU autocast leaves the norms alone: a bf16 input meets fp32 parameters (mixed dtypes).
    def autocast() -> contextlib.AbstractContextManager:
        return torch.autocast("cpu", dtype=torch.bfloat16)

    run_micro_batches(
        setting.module(torch.float32), setting, dtype=torch.bfloat16, input_dtype=input_dtype, context=autocast
    )


@pytest.mark.parametrize(
    "norm", [nn.LayerNorm(8), nn.RMSNorm(8), nn.BatchNorm1d(3)], ids=["layer-norm", "rms-norm", "batch-norm"]
)
def test_cpu_autocast_after_linear(norm: nn.Module) -> None:
    model = nn.Sequential(nn.Linear(8, 8), norm)
    patched, reference = patched_and_reference(model)
    for batch in (4, 6, 3):
        x = torch.randn(batch, 3, 8)
        for m in (patched, reference):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = m(x.clone())
            assert y.dtype == torch.bfloat16
            cubic_loss(y).backward()
    assert_no_grads(patched)
    assert twobp.pending().jobs == 6
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.bfloat16)


FROZEN_WEIGHT = [BATCH_NORM[2], LAYER_NORM[0], GROUP_NORM[2]]


@pytest.mark.parametrize("setting", FROZEN_WEIGHT, ids=setting_ids(FROZEN_WEIGHT))
def test_frozen_weight_trainable_bias(setting: Setting) -> None:
    module = setting.module(torch.float32)
    module.weight.requires_grad_(False)
    run_micro_batches(module, setting, dtype=torch.float32)
    assert module.weight.grad is None and module.bias.grad is not None


AUTOGRAD_GRAD = [BATCH_NORM[2], LAYER_NORM[2], GROUP_NORM[2], RMS_NORM[2]]


@pytest.mark.parametrize("setting", AUTOGRAD_GRAD, ids=setting_ids(AUTOGRAD_GRAD))
def test_autograd_grad_gets_weight_grads_at_once(setting: Setting) -> None:
    """autograd.grad asking for one parameter runs the kernel at once for it alone."""
    patched, reference = patched_and_reference(setting.module(torch.float64))
    x = setting.input(setting.shapes[0], torch.float64)
    for name, param in patched.named_parameters():
        (got,) = torch.autograd.grad(cubic_loss(patched(x)), [param])
        (want,) = torch.autograd.grad(cubic_loss(reference(x)), [reference.get_parameter(name)])
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert twobp.pending().jobs == 0
    assert_no_grads(patched)


@pytest.mark.parametrize("setting", AUTOGRAD_GRAD, ids=setting_ids(AUTOGRAD_GRAD))
def test_create_graph_is_refused(setting: Setting) -> None:
    patched = twobp.patch(setting.module(torch.float64))
    x = setting.input(setting.shapes[0], torch.float64)
    with pytest.raises(RuntimeError, match="create_graph"):
        torch.autograd.grad(cubic_loss(patched(x)), list(patched.parameters()), create_graph=True)


UNPATCH = [BATCH_NORM[2], LAYER_NORM[0], GROUP_NORM[2], RMS_NORM[0]]


@pytest.mark.parametrize("setting", UNPATCH, ids=setting_ids(UNPATCH))
def test_unpatch_restores_plain_autograd(setting: Setting) -> None:
    module = setting.module(torch.float32)
    reference = copy.deepcopy(module)
    twobp.unpatch(twobp.patch(module))
    x = setting.input(setting.shapes[0], torch.float32)
    cubic_loss(module(x)).backward()
    cubic_loss(reference(x)).backward()
    assert twobp.pending().jobs == 0
    assert module.weight.grad is not None
    assert_grads_match(module, reference)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "fast_dtype", [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]
)
@pytest.mark.parametrize("setting", AUTOCAST, ids=setting_ids(AUTOCAST))
def test_cuda_autocast(setting: Setting, fast_dtype: torch.dtype) -> None:
    # CUDA autocast runs layer_norm and group_norm in float32: the deferred forward must too.
    def autocast() -> contextlib.AbstractContextManager:
        return torch.autocast("cuda", dtype=fast_dtype)

    run_micro_batches(
        setting.module(torch.float32),
        setting,
        dtype=torch.bfloat16,
        input_dtype=fast_dtype,
        context=autocast,
        device="cuda",
    )


WEIGHT_NORM = [BATCH_NORM[2], LAYER_NORM[0], GROUP_NORM[2]]


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("setting", WEIGHT_NORM, ids=setting_ids(WEIGHT_NORM))
def test_weight_rebuilt_each_call_differentiates_at_once(setting: Setting) -> None:
    """Under weight_norm the weight is no leaf: its gradient flows into weight_g/weight_v at
    once, and only the bias (a leaf) is deferred."""
    module = setting.module(torch.float64)
    reference = nn.utils.weight_norm(copy.deepcopy(module), dim=None)  # no deepcopy after it
    patched = twobp.patch(nn.utils.weight_norm(module, dim=None))
    for shape in setting.shapes:
        x = setting.input(shape, torch.float64)
        cubic_loss(patched(x)).backward()
        cubic_loss(reference(x)).backward()
    assert patched.weight_g.grad is not None and patched.weight_v.grad is not None
    assert patched.bias.grad is None
    assert twobp.pending().jobs == len(setting.shapes)
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)


@pytest.mark.parametrize("setting", ALL, ids=setting_ids(ALL))
def test_lossy_saved_tensor_hooks_change_the_weight_grads_as_they_change_plain(setting: Setting) -> None:
    """Under hooks that hand back other values than they were given, each rule must save the
    very tensors plain saves, not others it derives the same values from (RMSNorm kept its input
    and 1/rms where plain keeps x_hat; InstanceNorm would recompute the statistics at the flush
    where plain keeps its own): fp64, so the fp16 rounding (~1e-3) is far above the tolerance."""
    patched, reference = patched_and_reference(setting.module(torch.float64))
    for shape in setting.shapes:
        x = setting.input(shape, torch.float64)
        for model in (patched, reference):
            with lossy_saved_tensors_hooks():
                output = model(x.clone().requires_grad_())
            cubic_loss(output).backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)


@pytest.mark.parametrize("in_place", [False, True], ids=["hook", "hook-then-relu_"])
@pytest.mark.parametrize("setting", ALL, ids=setting_ids(ALL))
def test_hook_on_the_output_sees_what_plain_sees(setting: Setting, in_place: bool) -> None:
    """A tensor hook on the output (FSDP2 registers one on every module output), then perhaps an
    in-place op on it: InstanceNorm's output is a view, and with its version counter put back
    after the tap the hook's registration crashed the process; on plain's view an in-place op
    after the hook leaves the hook uncalled, and so it must stay here."""
    patched, reference = patched_and_reference(setting.module(torch.float64))
    calls = []
    inputs = [setting.input(shape, torch.float64) for shape in setting.shapes]
    for model in (patched, reference):
        for x in inputs:
            output = model(x.clone().requires_grad_())
            output.register_hook(lambda grad, model=model: calls.append(model) or grad * 2)
            if in_place:
                torch.relu_(output)
            cubic_loss(output).backward()
    assert calls.count(patched) == calls.count(reference)
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)


def test_rms_norm_weight_of_another_shape_is_refused_in_the_forward_as_in_plain() -> None:
    """The fused op the rule calls does not check the weight's shape: a (1, H) weight broadcast
    there, and the flush failed on the kernel's (H,) gradient where plain refuses the forward."""
    module = nn.RMSNorm(8)
    module.weight = nn.Parameter(torch.ones(1, 8))
    patched, reference = patched_and_reference(module)
    x = torch.randn(3, 5, 8)
    with pytest.raises(RuntimeError, match="same shape as normalized_shape"):
        reference(x)
    with pytest.raises(RuntimeError, match="same shape as normalized_shape"):
        patched(x)
    assert twobp.pending().jobs == 0


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("setting", RMS_NORM, ids=setting_ids(RMS_NORM))
def test_rms_norm_on_cuda(setting: Setting, dtype: torch.dtype) -> None:
    """On CUDA the rule runs RMSNorm's fused op as one node where rms_norm takes that op (inputs
    of three dims or fewer), the tap elsewhere: outputs, input gradients and weight gradients
    as plain's either way."""
    run_micro_batches(setting.module(dtype), setting, dtype=dtype, device="cuda")


@needs_cuda
@pytest.mark.parametrize("lossy", [False, True], ids=["plain-saving", "lossy-saved-tensor-hooks"])
@pytest.mark.parametrize("input_needs_grad", [True, False], ids=["input-needs-grad", "first-layer"])
def test_rms_norm_on_cuda_is_one_node_with_plains_input_gradient(lossy: bool, input_needs_grad: bool) -> None:
    """One node, as plain's: the input gradient bit for bit plain's (the same backward op), the
    weight's deferred and equal to plain's, also from what saved-tensor hooks hand back (fp64:
    their fp16 rounding is far above the tolerance)."""
    patched, reference = patched_and_reference(RMS_NORM[0].module(torch.float64).cuda())
    for shape in RMS_NORM[0].shapes:
        x = RMS_NORM[0].input(shape, torch.float64, "cuda")
        xp, xr = x.clone().requires_grad_(input_needs_grad), x.clone().requires_grad_(input_needs_grad)
        with lossy_saved_tensors_hooks() if lossy else contextlib.nullcontext():
            yp, yr = patched(xp), reference(xr)
        assert type(yp.grad_fn).__name__ == "_DeferredFusedRMSNormBackward"
        assert torch.equal(yp, yr)
        cubic_loss(yp).backward()
        cubic_loss(yr).backward()
        if input_needs_grad:
            assert torch.equal(xp.grad, xr.grad)
    assert_no_grads(patched)
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)


def _instance_norm_grads(patched: bool, x: torch.Tensor, output_grad: torch.Tensor) -> list[torch.Tensor]:
    torch.manual_seed(0)
    module = nn.InstanceNorm2d(x.shape[1], affine=True).to(x.dtype)
    with torch.no_grad():
        module.weight.normal_()
        module.bias.normal_()
    if patched:
        twobp.patch(module)
    module(x).backward(output_grad)
    twobp.flush_weight_grads()
    return [module.weight.grad, module.bias.grad]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spread", [0.0, 1e-3], ids=["constant", "small-spread"])
def test_instance_norm_weight_grad_is_plains_on_channels_of_small_spread(dtype: torch.dtype, spread: float) -> None:
    """A channel of small spread around a large mean (a blank frame): the weight kernel was group
    norm's, which sums dy * x and dy apart and subtracts: a constant channel's weight gradient,
    exactly 0 in plain, came out as 2.5e-2 of noise in fp32 (4e-9 in fp64); 110x the fp32
    tolerance with a spread of 1e-3. Batch norm's own derivative sums as plain does: equal."""
    x = (2.1 + spread * torch.randn(3, 4, 32, 32)).to(dtype)
    output_grad = torch.randn(3, 4, 32, 32, dtype=dtype)
    ours, plain = _instance_norm_grads(True, x, output_grad), _instance_norm_grads(False, x, output_grad)
    for got, expected in zip(ours, plain, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("grad_layout", ["channels-last", "contiguous"])
def test_instance_norm_of_one_sample_under_a_channels_last_gradient_is_plains(grad_layout: str) -> None:
    """One sample whose output gradient comes channels_last: instance_norm's view hands batch norm's
    backward a gradient whose size-1 batch dim has an odd stride. The flush ran group norm's kernel
    on that gradient laid out afresh and was 11.6 off plain (and fp64) where the gradient came
    channels_last from the loss; it now runs the derivative plain runs, on the same tensors."""
    x = torch.randn(1, 3, 5, 6, dtype=torch.float64)
    output_grad = torch.randn(1, 3, 5, 6, dtype=torch.float64)
    if grad_layout == "channels-last":
        output_grad = output_grad.to(memory_format=torch.channels_last)
    ours, plain = _instance_norm_grads(True, x, output_grad), _instance_norm_grads(False, x, output_grad)
    for got, expected in zip(ours, plain, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("input_dtype", [torch.bfloat16, torch.float16])
def test_instance_norm_with_fp32_parameters_and_a_reduced_precision_input(input_dtype: torch.dtype) -> None:
    """fp32 parameters beside a bf16/fp16 input, no autocast: batch norm's kernels take that mix
    (fp32 statistics), and the flush's derivative refused a bf16 mean beside its fp32 weight."""
    patched, reference = patched_and_reference(nn.InstanceNorm2d(4, affine=True))
    x = torch.randn(3, 4, 5, 5).to(input_dtype)
    output_grad = torch.randn(3, 4, 5, 5).to(input_dtype)
    for model in (patched, reference):
        model(x).backward(output_grad)
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.bfloat16)  # the looser of the two tolerances


def test_instance_norm_of_an_empty_length_beside_a_full_one() -> None:
    """(N, C, 0): nothing to sum, so plain's weight gradient takes nothing from it; the flush's
    batch norm derivative refused an empty input (before it: NaN gradients)."""
    patched, reference = patched_and_reference(nn.InstanceNorm1d(4, affine=True).double())
    for length in (0, 5):
        x = torch.randn(2, 4, length, dtype=torch.float64)
        for model in (patched, reference):
            model(x).pow(2).sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


def test_instance_norm_of_a_transposed_input_changed_after_the_forward_trains_as_plain() -> None:
    """instance_norm normalises a contiguous copy of a transposed input, and plain saves that copy:
    an input changed in place after the forward (a reused buffer) is no matter there. The flush
    saved the input itself and refused it as changed."""
    patched, reference = patched_and_reference(nn.InstanceNorm1d(4, affine=True).double())
    data = torch.randn(2, 6, 4, dtype=torch.float64)
    for model in (patched, reference):
        buffer = data.clone()
        output = model(buffer.transpose(1, 2))
        buffer.add_(1.0)
        output.pow(3).sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)
