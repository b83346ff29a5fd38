"""nn.LayerNorm: the forward calls ``native_layer_norm``, the very op the module's own forward
reaches, with the parameters detached, so the input gradient is PyTorch's own. The op hands
back its statistics (mean and 1/std) for free; they are saved with the input so the weight
kernel never recomputes them. Each sample is normalised on its own, so the saved tensors
concatenate on the batch dimension and one kernel call serves all queued micro-batches.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..deferral import (
    ParamDeferral,
    configured_kernel,
    defer_weight_grads,
    detached,
    param_from_input,
    param_inputs,
    sees_post_hooks,
    single_node_applies,
)
from ..job import WeightGradKernel
from ..registry import register, weight_and_bias
from .autocast import as_autocast_casts
from .fallback import plain_forward, unsupported_tensors
from .precision import affine_dtype, norm_operands_summed_in_fp32, summed_over_row_chunks, unit_weight

__all__ = ["layer_norm", "layer_norm_weight_grad"]


def layer_norm_weight_grad(
    saved: Sequence[Tensor],
    grad_outputs: Sequence[Tensor],
    needs: Sequence[bool],
    *,
    normalized_shape: tuple[int, ...],
    weight_dtype: torch.dtype,
    has_bias: bool,
) -> list[Tensor | None]:
    x, mean, rstd = saved
    rows, mean, rstd = _layer_norm_rows(x, mean, rstd, normalized_shape)  # (rows, *normalized_shape), (rows, 1, ...)
    need_weight, need_bias = needs
    grad = grad_outputs[0]
    if grad.shape != rows.shape:
        grad = grad.reshape(rows.shape)
    (grad, rows, mean, rstd), weight_dtype = norm_operands_summed_in_fp32((grad, rows, mean, rstd), weight_dtype)
    weight = unit_weight(rows, normalized_shape, weight_dtype)
    bias = weight if has_bias else None
    mask = (False, need_weight, need_bias)

    def native(grad: Tensor, rows: Tensor, mean: Tensor, rstd: Tensor) -> tuple[Tensor | None, ...]:
        return _native_backward(grad, rows, normalized_shape, mean, rstd, weight, bias, mask)[1:]

    weight_grad, bias_grad = summed_over_row_chunks(native, (grad, rows, mean, rstd), _ROWS_PER_CALL)
    return [weight_grad if need_weight else None, bias_grad if need_bias else None]


_native_backward = torch.ops.aten.native_layer_norm_backward.default

#: Rows per CPU kernel call (see .precision): the error of a 1024-row sum, at about the speed
#: of one call (measured 0.9-1.4x of one call over 4096-65536 joined rows of 64-1024 features).
_ROWS_PER_CALL = 1024


@sees_post_hooks
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
    """What the weight kernel computes on: any leading dims flattened to rows (the statistics are per row)."""
    if x.dim() == len(shape) + 1:  # rows already, the statistics (rows, 1, ...) with them
        return x, mean, rstd
    ones = (1,) * len(shape)
    return x.reshape(-1, *shape), mean.reshape(-1, *ones), rstd.reshape(-1, *ones)


@register(nn.LayerNorm)
def layer_norm(module: nn.LayerNorm, input: Tensor) -> Tensor:
    params = weight_and_bias(module)
    reason = unsupported_tensors(input, *params)
    if reason is not None:
        return plain_forward(module, reason, input)
    shape = tuple(module.normalized_shape)
    if single_node_applies(input):
        deferral = ParamDeferral.at_forward(params)
        configured = _layer_norm_kernel(shape, *params)
        return _DeferredLayerNorm.apply(deferral, configured, shape, module.eps, input, *param_inputs(params))
    x, (weight, bias) = as_autocast_casts("layer_norm", input, *map(detached, params))
    # torch.layer_norm is this op and nothing else.
    output, mean, rstd = torch.native_layer_norm(x, shape, weight, bias, module.eps)
    kernel, group = _layer_norm_kernel(shape, weight, bias)
    # The input as given, not as rows: a reshaped copy of a non-contiguous input would not see an
    # in-place change of the input before backward, which plain refuses. The kernel takes rows.
    return defer_weight_grads(output, params, (x, mean, rstd), kernel, group=group)


def _layer_norm_kernel(
    shape: tuple[int, ...], weight: Tensor | None, bias: Tensor | None
) -> tuple[WeightGradKernel, Hashable]:
    """The weight kernel (and its group) for parameters of these dtypes (autocast's, if it cast them)."""
    return configured_kernel(
        layer_norm_weight_grad,
        normalized_shape=shape,
        weight_dtype=affine_dtype(weight, bias),
        has_bias=bias is not None,
    )
