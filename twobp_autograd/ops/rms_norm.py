"""nn.RMSNorm: the forward calls the op ``F.rms_norm`` reaches, with the weight detached, so
the input gradient is PyTorch's own. For same-dtype input and weight that is
``aten._fused_rms_norm`` (a fused kernel on CUDA, elementwise ops on CPU), which hands back
1/rms: it is saved with the input, so the weight kernel only multiplies (``x_hat = x / rms``)
instead of recomputing the statistics. Otherwise (mixed dtypes, 4-D and 5-D inputs that may be
channels-last) the public op runs, and the kernel recomputes 1/rms at the flush. Each sample
is normalised on its own, so the saved rows concatenate and one kernel call serves all queued
micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..checkpoint_paths import saved_through_user_hooks
from ..deferral import configured_kernel, defer_weight_grads, detached
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


@register(nn.RMSNorm)
def rms_norm(module: nn.RMSNorm, x: Tensor) -> Tensor:
    """Its argument is ``x``, as in ``nn.RMSNorm.forward``: callers may pass it by name."""
    param = module.weight  # once: a parametrized weight is rebuilt per read
    reason = unsupported_tensors(x, param)
    if reason is not None:
        return plain_forward(module, reason, x)
    shape = tuple(module.normalized_shape)
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
    # rms_norm's own test for its fused op (channels-last inputs are only 4-D or 5-D); inputs
    # of the wrong shape take the public op, for its error.
    fused = weight.dtype == x.dtype and x.dim() < 4 and x.shape[x.dim() - len(shape) :] == shape
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
