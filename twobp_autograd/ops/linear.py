"""nn.Linear (and MultiheadAttention's ``out_proj``, an nn.Linear subclass that only changes
quantization): dX by PyTorch's own linear derivative; dW = g^T x, db = sum(g) over all rows of
all queued micro-batches in one GEMM."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

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
from ..registry import register, weight_and_bias
from .fallback import plain_forward, unsupported_tensors
from .precision import accumulation_dtype

__all__ = ["linear", "linear_forward", "linear_weight_grad", "deferred_rows_product"]


def linear_weight_grad(
    saved: Sequence[Tensor], grad_outputs: Sequence[Tensor], needs: Sequence[bool], *, transposed: bool = False
) -> list[Tensor | None]:
    """``g^T x`` (``x^T g`` for a weight stored ``(in, out)``, ``transposed``: Hugging Face's
    ``Conv1D``), summed in fp32 for bf16/fp16 operands (see :mod:`.precision`)."""
    (grad,) = grad_outputs  # rows already, as the forward computed them
    need_weight, need_bias = needs
    accumulate = accumulation_dtype(grad.dtype)
    weight_grad = None
    if need_weight:
        (rows,) = saved  # saved only for a weight that needs a gradient
        first, second = (rows, grad) if transposed else (grad, rows)
        if accumulate == grad.dtype:
            weight_grad = first.t().mm(second)
        elif grad.is_cuda:  # reduced-precision GEMM, fp32 result
            weight_grad = torch.mm(first.t(), second, out_dtype=accumulate)
        else:
            # Outside autocast (a flush re-enters the backward's): it would run the fp32 product
            # in bf16 again, rounding the whole joined sum once.
            with torch.autocast("cpu", enabled=False):
                weight_grad = first.t().to(accumulate).mm(second.to(accumulate))
    bias_grad = grad.sum(0, dtype=accumulate) if need_bias else None
    return [weight_grad, bias_grad]


@sees_post_hooks
class _DeferredLinear(torch.autograd.Function):
    """``F.linear`` on 2-D rows as one autograd node (the op and its tap in one): its backward
    computes the input gradient by autograd's own formula for ``mm``'s first operand and routes
    the parameters' work as the tap does. Taken only where that formula is all plain autograd
    does: no autocast cast to replay, no forward-mode AD, dense strided tensors. ``transposed``:
    a weight stored ``(in, out)``, computed as ``addmm(bias, rows, weight)`` (Hugging Face's
    ``Conv1D``)."""

    @staticmethod
    def forward(
        ctx: Any, deferral: ParamDeferral, transposed: bool, rows: Tensor, weight: Tensor, bias_input: Tensor
    ) -> Tensor:
        ctx.deferral, ctx.transposed = deferral, transposed
        # Each only where addmm saves it: the weight for the input's gradient, the input for the
        # weight's. A first layer's weight may change in place before backward (an EMA of the
        # weights), and so may a frozen layer's input (a residual added in place), as in plain.
        needs_input, needs_weight = ctx.needs_input_grad[2:4]
        # The weight as plain's addmm saves it (a view, weight.t()): an alias that keeps the
        # storage the forward read, so `p.data = t` / `.to(dtype)` between forward and backward
        # leaves the input gradient as plain computes it (the version counter is shared).
        ctx.save_for_backward(rows if needs_weight else None, weight.detach() if needs_input else None)
        ctx.column_major = rows.stride(0) == 1 and rows.stride(1) == rows.shape[0]
        bias = param_from_input(bias_input)
        if transposed:
            return torch.addmm(bias, rows, weight)  # type: ignore[arg-type]  # with a bias only
        return F.linear(rows, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        rows, weight = ctx.saved_tensors
        mat2_t = None if weight is None else weight.t() if ctx.transposed else weight
        grad_rows = _rows_grad(grad, mat2_t, ctx.column_major) if mat2_t is not None else None
        deferral: ParamDeferral = ctx.deferral
        saved = (rows,) if rows is not None else ()
        kernel, group = _KERNELS[ctx.transposed]
        param_grads = deferral.route(ctx, kernel, group, None, saved, (grad,))
        return (None, None, grad_rows, *param_grads)


#: The weight kernel and its group, by whether the weight is stored ``(in, out)``.
_KERNELS = {
    False: (linear_weight_grad, linear_weight_grad),
    True: configured_kernel(linear_weight_grad, transposed=True),
}


def deferred_rows_product(rows: Tensor, weight: Tensor, bias: Tensor | None, *, transposed: bool = False) -> Tensor:
    """``rows @ weight.t() + bias`` (``rows @ weight + bias`` where ``transposed``) on 2-D rows,
    with the parameters' gradients deferred: one node where :func:`single_node_applies`, else the
    op under autograd and a tap."""
    if single_node_applies(rows, weight) and (bias is not None or not transposed):
        deferral = ParamDeferral.at_forward((weight, bias))
        return _DeferredLinear.apply(deferral, transposed, rows, weight, *param_inputs((bias,)))
    if transposed:
        output = torch.addmm(detached(bias), rows, detached(weight))  # type: ignore[arg-type]  # None fails as in Conv1D
    else:
        output = F.linear(rows, detached(weight), detached(bias))
    # Saved in the dtype the product ran in (autocast's), as plain autograd would; only for a
    # weight that needs a gradient, as plain saves it.
    saved = (rows.to(output.dtype),) if weight.requires_grad else ()
    kernel, group = _KERNELS[transposed]
    return defer_weight_grads(output, (weight, bias), saved, kernel, group=group)


def _rows_grad(grad: Tensor, weight: Tensor, column_major: bool) -> Tensor:
    """ATen's ``mm_mat1_backward`` for ``rows @ weight.t()`` (aten::linear's addmm or mm), with
    its case for column-major rows, so the input gradient is bit for bit plain autograd's."""
    if column_major:
        return weight.t().mm(grad.t()).t()
    return grad.mm(weight)


def linear_forward(input: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear`` with the weight gradients deferred; usable inside other ops' forwards."""
    # On rows, as aten::linear itself computes a >2-D product with a bias (addmm, then a view):
    # tapping that view instead would make autograd rebase its history onto the base, and
    # backward would then copy every output gradient (CopySlices).
    # flatten, not reshape(-1, features): that is ambiguous for a batch of 0 with 0 features.
    if input.dim() == 0:
        return F.linear(input, weight, bias)  # plain's error (one feature would run on as a row)
    if input.dim() == 2:
        return deferred_rows_product(input, weight, bias)
    rows = input.flatten(0, -2) if input.dim() > 1 else input.unsqueeze(0)
    output = deferred_rows_product(rows, weight, bias)
    # Shaped as aten::linear returns it: with a bias a view of the 2-D product (addmm, then view),
    # without one no view (matmul's _unsafe_view). Autograd treats the two apart: an in-place op
    # on a view rebases its history, and a hook registered on the view before is never called.
    shape = (*input.shape[:-1], output.shape[-1])
    return output.view(shape) if bias is not None else torch.ops.aten._unsafe_view(output, shape)


@register((nn.Linear, NonDynamicallyQuantizableLinear))
def linear(module: nn.Linear, input: Tensor) -> Tensor:
    """``nn.Linear.forward``. MultiheadAttention's ``out_proj`` is only reached through its
    owner's rule, which never calls its forward; called directly, it is an nn.Linear."""
    weight, bias = weight_and_bias(module)
    reason = unsupported_tensors(input, weight)
    if reason is not None:
        return plain_forward(module, reason, input)
    return linear_forward(input, weight, bias)
