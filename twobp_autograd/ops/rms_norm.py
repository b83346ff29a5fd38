"""nn.RMSNorm: the forward calls the op ``F.rms_norm`` reaches, with the weight detached, so
the input gradient is PyTorch's own. For same-dtype input and weight that is
``aten._fused_rms_norm`` (a fused kernel on CUDA, elementwise ops on CPU), which hands back
1/rms: it is saved with the input, so the weight kernel only multiplies (``x_hat = x / rms``)
instead of recomputing the statistics. Otherwise (mixed dtypes, 4-D and 5-D inputs that may be
channels-last) the public op runs, and the kernel recomputes 1/rms at the flush. Each sample
is normalised on its own, so the saved rows concatenate and one kernel call serves all queued
micro-batches.

On CUDA plain autograd differentiates the fused op as one node (``_fused_rms_norm_backward``),
so the rule does too: the op and its tap in one custom Function, one node where two cost the
host's launch loop twice over (a tiny RMSNorm's patched forward took 4.4x plain's on an H100).
On the CPU plain differentiates ``rms_norm``'s composite op by op, which the tap path keeps.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..checkpoint_paths import saved_through_user_hooks
from ..deferral import (
    ParamDeferral,
    configured_kernel,
    defer_weight_grads,
    detached,
    sees_post_hooks,
    single_node_applies,
)
from ..job import WeightGradKernel
from ..registry import register
from .autocast import as_autocast_casts
from .fallback import plain_forward, unsupported_tensors
from .precision import accumulation_dtype

__all__ = ["rms_norm", "rms_norm_weight_grad"]


def rms_norm_weight_grad(
    saved: Sequence[Tensor],
    grad_outputs: Sequence[Tensor],
    needs: Sequence[bool],
    *,
    eps: float | None,
    weight_dtype: torch.dtype,
    normalized: bool = False,
) -> list[Tensor | None]:
    """F.rms_norm's composite: ``(x.to(opmath) * rsqrt(mean(x^2) + eps) * w).type_as(x)``.
    Its weight gradient is ``sum over rows of grad * x_hat``, in the product's dtype.
    ``saved``: the rows of x (and 1/rms where the fused op gave it), or x_hat itself
    (``normalized``)."""
    (need_weight,) = needs
    if not need_weight:
        return [None]
    x_hat = saved[0] if normalized else _normalized(saved, eps)
    product = torch.promote_types(x_hat.dtype, weight_dtype)
    grad = grad_outputs[0].reshape(x_hat.shape).to(product)
    return [(grad * x_hat).sum(0)]


def _normalized(saved: Sequence[Tensor], eps: float | None) -> Tensor:
    """x_hat from the rows of x, in the composite's compute dtype."""
    rows = saved[0]
    compute = accumulation_dtype(rows.dtype)
    upcast = rows.to(compute)
    if len(saved) > 1:  # 1/rms, as the forward computed it
        return upcast * saved[1]
    if eps is None:
        eps = torch.finfo(torch.float64 if compute == torch.float64 else torch.float32).eps
    dims = tuple(range(1, rows.dim()))
    return upcast * torch.rsqrt(upcast.pow(2).mean(dims, keepdim=True) + eps)


@sees_post_hooks
class _DeferredFusedRMSNorm(torch.autograd.Function):
    """``_fused_rms_norm`` as one autograd node, as plain autograd's on CUDA: it saves what
    plain's node saves (input, 1/rms, weight), takes the input gradient from the backward op
    plain's node calls, and routes the weight's work as the tap does."""

    @staticmethod
    def forward(
        ctx: Any,
        deferral: ParamDeferral,
        kernel: tuple[WeightGradKernel, Hashable],
        shape: tuple[int, ...],
        eps: float | None,
        x: Tensor,
        weight: Tensor,
    ) -> Tensor:
        output, inverse_rms = torch.ops.aten._fused_rms_norm(x, shape, weight, eps)
        ctx.deferral, ctx.kernel, ctx.shape = deferral, kernel, shape
        ctx.save_for_backward(x, inverse_rms, weight)
        return output

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, inverse_rms, weight = ctx.saved_tensors
        shape: tuple[int, ...] = ctx.shape
        grad_x = None
        if ctx.needs_input_grad[4]:
            grad_x = _fused_backward(grad, x, shape, inverse_rms, weight, [True, False])[0]
        rows = x.reshape(-1, *shape)
        saved = (rows, inverse_rms.reshape(rows.shape[0], *(1,) * len(shape)))
        kernel, group = ctx.kernel
        deferral: ParamDeferral = ctx.deferral
        return (None, None, None, None, grad_x, *deferral.route(ctx, kernel, group, None, saved, (grad,)))


#: Missing from releases older than the fused op's CUDA autograd node: those keep the tap.
_fused_backward: Any = getattr(torch.ops.aten, "_fused_rms_norm_backward", None)


@register(nn.RMSNorm)
def rms_norm(module: nn.RMSNorm, x: Tensor) -> Tensor:
    """Its argument is ``x``, as in ``nn.RMSNorm.forward``: callers may pass it by name."""
    param = module.weight  # once: a parametrized weight is rebuilt per read
    reason = unsupported_tensors(x, param)
    if reason is not None:
        return plain_forward(module, reason, x)
    shape = tuple(module.normalized_shape)
    if (
        x.is_cuda
        and _fused_backward is not None
        and param.dtype == x.dtype
        and _takes_fused_op(x, shape, param)
        and single_node_applies(x, param)
        and not x.is_inference()  # the tap path's refusal, as plain's node cannot save it
    ):
        deferral = ParamDeferral.at_forward((param,))
        configured = configured_kernel(rms_norm_weight_grad, eps=module.eps, weight_dtype=param.dtype)
        return _DeferredFusedRMSNorm.apply(deferral, configured, shape, module.eps, x, param)
    x, (weight,) = as_autocast_casts("rms_norm", x, detached(param))
    assert weight is not None  # an RMSNorm without weight has no parameter to defer
    # An input that needs no gradient is not kept, as plain keeps only x_hat then (the input may
    # change in place after the forward: a residual stream updated in place). Nor under the
    # user's saved-tensor hooks: plain's weight gradient reads x_hat as they hand it back, which
    # a lossy pack makes other than its unpacked input times its unpacked 1/rms.
    keeps_input = x.requires_grad and not saved_through_user_hooks()
    kernel, group = configured_kernel(
        rms_norm_weight_grad, eps=module.eps, weight_dtype=weight.dtype, normalized=not keeps_input
    )
    # Inputs and weights of the wrong shape take the public op, for its error.
    fused = weight.dtype == x.dtype and _takes_fused_op(x, shape, weight)
    if fused:
        output, inverse_rms = torch.ops.aten._fused_rms_norm(x, shape, weight, module.eps)
    else:
        output = F.rms_norm(x, shape, weight, module.eps)
    rows = x.reshape(-1, *shape)
    saved = (rows, inverse_rms.reshape(rows.shape[0], *(1,) * len(shape))) if fused else (rows,)
    if not keeps_input:
        saved = (_normalized(saved, module.eps),)
    elif rows.is_inference():  # cannot be saved; plain saves the normalised input, not x itself
        saved = (rows.clone(), *saved[1:])
    return defer_weight_grads(output, (param,), saved, kernel, group=group)


def _takes_fused_op(x: Tensor, shape: tuple[int, ...], weight: Tensor) -> bool:
    """rms_norm's own test for its fused op (for same-dtype input and weight; channels-last
    inputs are only 4-D or 5-D), and a weight of the normalized shape: the fused op does not
    check it (a (1, H) weight broadcasts there on the CPU, where plain refuses it)."""
    return x.dim() < 4 and x.shape[x.dim() - len(shape) :] == shape == weight.shape
