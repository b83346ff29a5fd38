"""Normalisation layers: BatchNorm1d/2d/3d, LayerNorm, GroupNorm, RMSNorm.

Each forward calls the very ATen op the module's own forward reaches, so the input gradient
(the one backward-p1 must deliver at once) is PyTorch's own: LayerNorm, GroupNorm and RMSNorm
with the parameters detached, BatchNorm through the op's own derivative (see below). The
native ops hand back their statistics (mean and 1/std) for free; they are saved with the
input so the weight kernel never recomputes them (RMSNorm's composite hands back none: its
kernel recomputes 1/rms at flush time, off backward-p1's critical path).

LayerNorm, GroupNorm and RMSNorm normalise each sample on its own, so their saved tensors
concatenate on the batch dimension and one kernel call serves all queued micro-batches.
BatchNorm is the exception: in training its input gradient passes through the micro-batch
statistics, and the reductions that takes (sum(dy), sum(dy * x_hat)) are its bias and weight
gradients. So its backward-p1 runs the native derivative once for all three and queues the
finished weight and bias gradients (2 x C numbers, summed per micro-batch at the flush):
deferring a kernel would only run the reductions twice and keep the input alive meanwhile.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._prims_common import suggest_memory_format
from torch.autograd import forward_ad

from ..deferral import (
    ParamDeferral,
    configured_kernel,
    defer_weight_grads,
    detached,
    guard_tangent,
    param_from_input,
    param_inputs,
    single_node_applies,
)
from ..job import WeightGradKernel
from ..registry import register
from .fallback import plain_forward, unsupported_tensors
from .precision import accumulation_dtype

__all__ = [
    "layer_norm_weight_grad",
    "group_norm_weight_grad",
    "rms_norm_weight_grad",
]

Grads = list["Tensor | None"]


# -- autocast --------------------------------------------------------------------------------

#: The public op each family's module calls, run on a tiny tensor to learn what autocast does
#: to it. The forwards below call the native op underneath, which autocast may list
#: differently (or not at all), so they apply the public op's cast themselves.
_AUTOCAST_PROBES: dict[str, Callable[[Tensor], Tensor]] = {
    "batch_norm": lambda x: F.batch_norm(x, None, None, training=True),
    "layer_norm": lambda x: F.layer_norm(x, (1,)),
    "group_norm": lambda x: F.group_norm(x, 1),
    "rms_norm": lambda x: F.rms_norm(x, (1,)),
}


@functools.cache
def _autocast_target(op: str, device_type: str, fast_dtype: torch.dtype) -> torch.dtype | None:
    """float32 if autocast runs ``op`` in float32, ``fast_dtype`` if in the fast dtype, None if
    it leaves the op alone (the case of every norm under CPU autocast)."""
    probe = _AUTOCAST_PROBES[op]

    def output_dtype(dtype: torch.dtype) -> torch.dtype:
        with torch.no_grad():
            return probe(torch.ones(2, 1, dtype=dtype, device=device_type)).dtype

    if fast_dtype != torch.float32 and output_dtype(fast_dtype) == torch.float32:
        return torch.float32
    if output_dtype(torch.float32) == fast_dtype:
        return fast_dtype
    return None


def _as_autocast_casts(op: str, input: Tensor, *params: Tensor | None) -> tuple[Tensor, list[Tensor | None]]:
    """The input and parameters as autocast would hand them to ``op``: every floating tensor but
    float64 cast to the op's autocast dtype (differentiably for the input, as autocast's cast is)."""
    device_type = input.device.type
    if not torch.is_autocast_enabled(device_type):
        return input, list(params)
    target = _autocast_target(op, device_type, torch.get_autocast_dtype(device_type))
    if target is None:
        return input, list(params)

    def cast(t: Tensor) -> Tensor:
        return t.to(target) if t.is_floating_point() and t.dtype != torch.float64 else t

    return cast(input), [None if p is None else cast(p) for p in params]


# -- BatchNorm -------------------------------------------------------------------------------


class _TrainingBatchNorm(torch.autograd.Function):
    """``native_batch_norm`` in training. In training its input gradient needs sum(dy) and
    sum(dy * x_hat), which are the bias and weight gradients: backward-p1 gets all three from
    one ``native_batch_norm_backward`` call and queues the finished weight and bias gradients
    (2 x C numbers per call), not the input."""

    @staticmethod
    def forward(
        ctx: Any,
        eps: float,
        momentum: float,
        running_stats: tuple[Tensor | None, Tensor | None],
        deferral: ParamDeferral,
        input: Tensor,
        weight_input: Tensor,
        bias_input: Tensor,
    ) -> Tensor:
        # `input` comes cast already (autocast's cast of it is differentiable); the parameters
        # are cast here, so the Function keeps its edges to them.
        weight, bias = param_from_input(weight_input), param_from_input(bias_input)
        _, (weight, bias) = _as_autocast_casts("batch_norm", input, weight, bias)
        # The op torch.batch_norm runs in training on CPU (on CUDA it may pick cuDNN: same result
        # up to rounding). It updates the running statistics in place, once per forward.
        output, save_mean, save_invstd = torch.native_batch_norm(
            input, weight, bias, *running_stats, True, momentum, eps
        )
        ctx.eps, ctx.deferral = eps, deferral
        ctx.save_for_backward(input, weight, save_mean, save_invstd)
        if forward_ad._current_level >= 0:  # a dual level is open: jvp may be called
            ctx.save_for_forward(input, weight, bias)
        return output

    @staticmethod
    def jvp(ctx: Any, _eps: None, _momentum: None, _stats: None, _deferral: None, *tangents: Tensor) -> Tensor:
        """native_batch_norm's own forward derivative in training, taken on detached copies of
        the inputs at the open dual level (this Function's forward ran without forward AD)."""
        primals = ctx.saved_tensors  # input, weight, bias as the op saw them
        with forward_ad._set_fwd_grad_enabled(True):
            duals = [
                None if p is None else forward_ad.make_dual(p.detach(), t.to(p.dtype))
                for p, t in zip(primals, tangents, strict=True)
            ]
            input, weight, bias = duals
            assert input is not None
            output = torch.native_batch_norm(input, weight, bias, None, None, True, 0.0, ctx.eps)[0]
            tangent = forward_ad.unpack_dual(output).tangent
        return guard_tangent(tangent, primals)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        deferral: ParamDeferral = ctx.deferral
        decisions = deferral.decide(ctx)  # refuses create_graph=True
        input, weight, save_mean, save_invstd = ctx.saved_tensors
        mask = [ctx.needs_input_grad[4], decisions[0] != "skip", decisions[1] != "skip"]
        grads: Grads = [None, None, None]
        if any(mask):
            # Autograd's own derivative of native_batch_norm in training, all outputs at once.
            grads = list(
                torch.ops.aten.native_batch_norm_backward(
                    grad_output, input, weight, None, None, save_mean, save_invstd, True, ctx.eps, mask
                )
            )
        grads = [g if wanted else None for g, wanted in zip(grads, mask, strict=True)]
        return (None, None, None, None, grads[0], *deferral.defer_finished(decisions, grads[1:]))


def _zero_grads(
    saved: Sequence[Tensor],
    grad_outputs: Sequence[Tensor],
    needs: Sequence[bool],
    *,
    shapes: tuple[torch.Size | None, ...],
) -> Grads:
    """The weight kernel of a call on an empty batch: what plain autograd gives, zeros."""
    zeros = grad_outputs[0].new_zeros
    return [zeros(shape) if need and shape is not None else None for shape, need in zip(shapes, needs, strict=True)]


def _check_num_features(input: Tensor, **tensors: Tensor | None) -> None:
    """torch.batch_norm's own checks, which native_batch_norm lacks: called directly with the
    wrong number of channels, it reads and writes past the end of the statistics."""
    channels = input.shape[1]
    for name, tensor in tensors.items():
        if tensor is not None and tensor.numel() != channels:
            raise RuntimeError(f"{name} should contain {channels} elements not {tensor.numel()}")


def batch_norm(module: nn.modules.batchnorm._BatchNorm, input: Tensor) -> Tensor:
    """``_BatchNorm.forward`` in training mode (the only mode that reaches a deferred forward)."""
    weight, bias = module.weight, module.bias  # once: a parametrized weight is rebuilt per read
    reason = unsupported_tensors(input, weight, bias)
    if reason is not None:
        return plain_forward(module, reason, input)
    module._check_input_dim(input)
    factor = 0.0 if module.momentum is None else module.momentum
    if module.track_running_stats and module.num_batches_tracked is not None:
        module.num_batches_tracked.add_(1)
        factor = 1.0 / float(module.num_batches_tracked) if module.momentum is None else module.momentum
    # F.batch_norm's own checks for training.
    F._verify_batch_size(input.size())  # type: ignore[attr-defined]  # private: absent from torch's stubs
    if module.eps <= 0.0:
        raise ValueError(f"batch_norm eps must be positive during training, but got {module.eps}")
    running_mean = module.running_mean if module.track_running_stats else None
    running_var = module.running_var if module.track_running_stats else None
    x, _ = _as_autocast_casts("batch_norm", input)
    params = (weight, bias)
    if x.numel() == 0:
        # native_batch_norm refuses an empty batch; torch.batch_norm returns the input scaled by
        # weight[0] plus bias[0], running statistics untouched, and zero parameter gradients.
        output = torch.batch_norm(
            x, detached(weight), detached(bias), running_mean, running_var,
            True, factor, module.eps, torch.backends.cudnn.enabled,
        )
        kernel = functools.partial(_zero_grads, shapes=tuple(None if p is None else p.shape for p in params))
        return defer_weight_grads(output, params, (), kernel)
    _check_num_features(x, running_mean=running_mean, running_var=running_var, weight=weight, bias=bias)
    deferral = ParamDeferral.at_forward(params)
    # The running statistics go in a tuple: buffers updated in place, not inputs to differentiate.
    return _TrainingBatchNorm.apply(module.eps, factor, (running_mean, running_var), deferral, x, *param_inputs(params))


for _batch_norm_type in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d):
    register(_batch_norm_type, batch_norm)


# -- LayerNorm -------------------------------------------------------------------------------


def layer_norm_weight_grad(
    saved: Sequence[Tensor],
    grad_outputs: Sequence[Tensor],
    needs: Sequence[bool],
    *,
    normalized_shape: tuple[int, ...],
    weight_dtype: torch.dtype,
    has_bias: bool,
) -> Grads:
    rows, mean, rstd = saved  # (rows, *normalized_shape), (rows, 1, ...), (rows, 1, ...)
    grad = grad_outputs[0].reshape(rows.shape)
    weight = torch.ones(normalized_shape, dtype=weight_dtype, device=rows.device)
    bias = weight if has_bias else None
    _, weight_grad, bias_grad = torch.ops.aten.native_layer_norm_backward(
        grad, rows, normalized_shape, mean, rstd, weight, bias, [False, needs[0], needs[1]]
    )
    return [weight_grad if needs[0] else None, bias_grad if needs[1] else None]


class _DeferredLayerNorm(torch.autograd.Function):
    """``native_layer_norm`` as one autograd node (the op and its tap in one): its backward
    takes the input gradient from ``native_layer_norm_backward`` with the mask plain autograd
    passes when the parameters are detached, and routes the parameters' work as the tap does."""

    @staticmethod
    def forward(
        ctx: Any,
        deferral: ParamDeferral,
        kernel: tuple[WeightGradKernel, Hashable],
        shape: tuple[int, ...],
        eps: float,
        x: Tensor,
        weight_input: Tensor,
        bias_input: Tensor,
    ) -> Tensor:
        weight, bias = param_from_input(weight_input), param_from_input(bias_input)
        output, mean, rstd = torch.native_layer_norm(x, shape, weight, bias, eps)
        ctx.deferral, ctx.kernel, ctx.shape = deferral, kernel, shape
        ctx.save_for_backward(x, mean, rstd, weight, bias)
        return output

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, mean, rstd, weight, bias = ctx.saved_tensors
        shape: tuple[int, ...] = ctx.shape
        grad_x = None
        if ctx.needs_input_grad[4]:
            grad_x = torch.ops.aten.native_layer_norm_backward(
                grad, x, shape, mean, rstd, weight, bias, [True, False, False]
            )[0]
        kernel, group = ctx.kernel
        deferral: ParamDeferral = ctx.deferral
        param_grads = deferral.route(ctx, kernel, group, None, _layer_norm_rows(x, mean, rstd, shape), (grad,))
        return (None, None, None, None, grad_x, *param_grads)


def _layer_norm_rows(x: Tensor, mean: Tensor, rstd: Tensor, shape: tuple[int, ...]) -> tuple[Tensor, Tensor, Tensor]:
    """What the weight kernel takes: any leading dims flattened to rows (the statistics are per row)."""
    ones = (1,) * len(shape)
    return x.reshape(-1, *shape), mean.reshape(-1, *ones), rstd.reshape(-1, *ones)


@register(nn.LayerNorm)
def layer_norm(module: nn.LayerNorm, input: Tensor) -> Tensor:
    params = (module.weight, module.bias)  # once: a parametrized weight is rebuilt per read
    reason = unsupported_tensors(input, *params)
    if reason is not None:
        return plain_forward(module, reason, input)
    shape = tuple(module.normalized_shape)
    if single_node_applies(input):
        deferral = ParamDeferral.at_forward(params)
        configured = _layer_norm_kernel(shape, *params)
        return _DeferredLayerNorm.apply(deferral, configured, shape, module.eps, input, *param_inputs(params))
    x, (weight, bias) = _as_autocast_casts("layer_norm", input, *map(detached, params))
    # torch.layer_norm is this op and nothing else.
    output, mean, rstd = torch.native_layer_norm(x, shape, weight, bias, module.eps)
    kernel, group = _layer_norm_kernel(shape, weight, bias)
    return defer_weight_grads(output, params, _layer_norm_rows(x, mean, rstd, shape), kernel, group=group)


def _layer_norm_kernel(
    shape: tuple[int, ...], weight: Tensor | None, bias: Tensor | None
) -> tuple[WeightGradKernel, Hashable]:
    """The weight kernel (and its group) for parameters of these dtypes (autocast's, if it cast them)."""
    assert weight is not None  # a LayerNorm without weight has no parameter to defer
    return configured_kernel(
        layer_norm_weight_grad, normalized_shape=shape, weight_dtype=weight.dtype, has_bias=bias is not None
    )


# -- GroupNorm -------------------------------------------------------------------------------


def group_norm_weight_grad(
    saved: Sequence[Tensor],
    grad_outputs: Sequence[Tensor],
    needs: Sequence[bool],
    *,
    num_groups: int,
    weight_dtype: torch.dtype,
) -> Grads:
    input, mean, rstd = saved  # (N, C, *), (N, groups), (N, groups)
    batch, channels = input.shape[:2]
    weight = torch.ones(channels, dtype=weight_dtype, device=input.device)
    _, weight_grad, bias_grad = torch.ops.aten.native_group_norm_backward(
        grad_outputs[0], input, mean, rstd, weight, batch, channels, math.prod(input.shape[2:]), num_groups,
        [False, needs[0], needs[1]],
    )
    return [weight_grad if needs[0] else None, bias_grad if needs[1] else None]


@register(nn.GroupNorm)
def group_norm(module: nn.GroupNorm, input: Tensor) -> Tensor:
    params = (module.weight, module.bias)  # once: a parametrized weight is rebuilt per read
    reason = unsupported_tensors(input, *params)
    if reason is not None:
        return plain_forward(module, reason, input)
    groups = module.num_groups
    # F.group_norm's own checks.
    if input.dim() < 2:
        raise RuntimeError(f"Expected at least 2 dimensions for input tensor but received {input.dim()}")
    F._verify_batch_size(  # type: ignore[attr-defined]  # private: absent from torch's stubs
        [input.size(0) * input.size(1) // groups, groups] + list(input.size()[2:])
    )
    x, (weight, bias) = _as_autocast_casts("group_norm", input, *map(detached, params))
    batch, channels = x.shape[:2]
    # What torch.group_norm hands the native op: CPU keeps channels_last, other devices do not.
    x = x.contiguous(memory_format=suggest_memory_format(x)) if x.device.type == "cpu" else x.contiguous()
    output, mean, rstd = torch.native_group_norm(
        x,
        None if weight is None else weight.contiguous(),
        None if bias is None else bias.contiguous(),
        batch,
        channels,
        math.prod(x.shape[2:]),
        groups,
        module.eps,
    )
    kernel, group = configured_kernel(group_norm_weight_grad, num_groups=groups, weight_dtype=weight.dtype)  # type: ignore[union-attr]
    return defer_weight_grads(output, params, (x, mean, rstd), kernel, group=group)


# -- RMSNorm ---------------------------------------------------------------------------------


def rms_norm_weight_grad(
    saved: Sequence[Tensor],
    grad_outputs: Sequence[Tensor],
    needs: Sequence[bool],
    *,
    eps: float | None,
    weight_dtype: torch.dtype,
) -> Grads:
    """F.rms_norm's composite: ``(x.to(opmath) * rsqrt(mean(x^2) + eps) * w).type_as(x)``.
    Its weight gradient is ``sum over rows of grad * x_hat``, in the product's dtype."""
    if not needs[0]:
        return [None]
    (rows,) = saved
    compute = accumulation_dtype(rows.dtype)
    upcast = rows.to(compute)
    if eps is None:
        eps = torch.finfo(torch.float64 if compute == torch.float64 else torch.float32).eps
    dims = tuple(range(1, rows.dim()))
    normalized = upcast * torch.rsqrt(upcast.pow(2).mean(dims, keepdim=True) + eps)
    product = torch.promote_types(compute, weight_dtype)
    grad = grad_outputs[0].reshape(rows.shape).to(product)
    return [(grad * normalized).sum(0)]


@register(nn.RMSNorm)
def rms_norm(module: nn.RMSNorm, x: Tensor) -> Tensor:
    """Its argument is ``x``, as in ``nn.RMSNorm.forward``: callers may pass it by name."""
    param = module.weight  # once: a parametrized weight is rebuilt per read
    reason = unsupported_tensors(x, param)
    if reason is not None:
        return plain_forward(module, reason, x)
    shape = tuple(module.normalized_shape)
    x, (weight,) = _as_autocast_casts("rms_norm", x, detached(param))
    # The public op itself: on CPU a composite of elementwise ops, with no 1/rms to keep.
    output = F.rms_norm(x, shape, weight, module.eps)
    kernel, group = configured_kernel(rms_norm_weight_grad, eps=module.eps, weight_dtype=weight.dtype)  # type: ignore[union-attr]
    rows = x.reshape(-1, *shape)
    if rows.is_inference():  # cannot be saved; plain saves the normalised input, not x itself
        rows = rows.clone()
    return defer_weight_grads(output, (param,), (rows,), kernel, group=group)
