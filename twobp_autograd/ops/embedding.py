"""nn.Embedding: the lookup has no input gradient (indices are integers), so backward-p1 only
passes through; the weight gradient (a scatter-add of output-gradient rows into the looked-up
rows) runs at flush over all queued micro-batches' indices at once.

``scale_grad_by_freq`` divides by each index's count *within one forward call*, so those jobs
run one micro-batch at a time. ``max_norm`` renormalises the weight in place inside every
forward, which the queue's guard against in-place changes between backward and flush would
(rightly, in general) refuse: such modules keep plain autograd. ``sparse=True`` asks for sparse
gradients, which the flush's dense accumulation does not produce: plain autograd too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..deferral import configured_kernel, defer_weight_grads, detached
from ..registry import register
from .fallback import plain_forward, unsupported_tensors
from .precision import accumulation_dtype

__all__ = ["embedding", "embedding_weight_grad"]


def embedding_weight_grad(
    saved: Sequence[Tensor],
    grad_outputs: Sequence[Tensor],
    needs: Sequence[bool],
    *,
    num_weights: int,
    embedding_dim: int,
    padding_idx: int,
    scale_grad_by_freq: bool,
) -> list[Tensor | None]:
    (need_weight,) = needs
    if not need_weight:
        return [None]
    (indices,) = saved
    # One row per index (scalar lookups join into a flat gradient); the width spelled out, as
    # with no indices -1 would be ambiguous.
    grad = grad_outputs[0].reshape(indices.numel(), embedding_dim)
    if not grad.is_cuda:  # the CPU kernel sums in the operands' dtype (see .precision)
        grad = grad.to(accumulation_dtype(grad.dtype))
    return [torch.ops.aten.embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq)]


def _unsupported(module: nn.Module) -> str | None:
    assert isinstance(module, nn.Embedding)  # registered for nn.Embedding only
    if module.sparse:
        return "sparse=True (sparse gradients)"
    if module.max_norm is not None:
        return "max_norm (the weight is renormalised in place by every forward)"
    return None


@register(nn.Embedding, unsupported=_unsupported)
def embedding(module: nn.Embedding, input: Tensor) -> Tensor:
    weight = module.weight  # once: a parametrized weight is rebuilt per read
    # Asked again here: sparse or max_norm may be set after patch().
    reason = _unsupported(module) or unsupported_tensors(input, weight)
    if reason is not None:
        return plain_forward(module, reason, input)
    output = F.embedding(
        input,
        detached(weight),
        module.padding_idx,
        module.max_norm,
        module.norm_type,
        module.scale_grad_by_freq,
        module.sparse,
    )
    padding_idx = module.padding_idx
    if padding_idx is None:
        padding_idx = -1  # ATen's "no padding row"
    elif padding_idx < 0:
        padding_idx += weight.shape[0]
    kernel, group = configured_kernel(
        embedding_weight_grad,
        num_weights=weight.shape[0],
        embedding_dim=weight.shape[1],
        padding_idx=padding_idx,
        scale_grad_by_freq=module.scale_grad_by_freq,
    )
    # Indices flattened: a 0-d or 1-d (unbatched) lookup concatenates like a batched one, and
    # output-gradient rows follow the same order.
    indices = input.detach().reshape(-1)
    concatenate = False if module.scale_grad_by_freq else None
    return defer_weight_grads(output, (weight,), (indices,), kernel, concatenate=concatenate, group=group)
