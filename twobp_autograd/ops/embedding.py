"""nn.Embedding: the lookup has no input gradient (indices are integers), so backward-p1 only
passes through; the weight gradient (a scatter-add of output-gradient rows into the looked-up
rows) runs at flush over all queued micro-batches' indices at once.

nn.EmbeddingBag: backward-p1 computes only ``per_sample_weights``' gradient (where it requires
one); the weight gradient runs at flush by ATen's own backward, one micro-batch at a time: its
bags are numbered and offset within one call, so joined calls would need renumbering.

nn.Embedding's ``scale_grad_by_freq`` divides by each index's count *within one forward call*,
so those jobs run one micro-batch at a time (as all of nn.EmbeddingBag's do). For both modules,
``max_norm`` renormalises the weight in place inside every forward, which the queue's guard
against in-place changes between backward and flush would (rightly, in general) refuse: such
modules keep plain autograd. ``sparse=True`` asks for sparse gradients, which the flush's dense
accumulation does not produce: plain autograd too.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

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
from .fallback import plain_forward, unsupported_tensors
from .precision import accumulation_dtype, summed_over_row_chunks

__all__ = ["embedding", "embedding_bag", "embedding_bag_weight_grad", "embedding_weight_grad"]


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

    def dense(grad: Tensor, indices: Tensor) -> tuple[Tensor]:
        return (torch.ops.aten.embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq),)

    if scale_grad_by_freq:  # the counts are the whole call's (such calls are never joined)
        return list(dense(grad, indices))
    # On the CPU a token's rows are added one after another: in slices, as plain's micro-batches.
    return summed_over_row_chunks(dense, (grad, indices.reshape(-1)), _ROWS_PER_CALL)


#: Rows per CPU kernel call (see .precision): each a weight-sized gradient, as each of plain's
#: micro-batches makes.
_ROWS_PER_CALL = 1024


def embedding_bag_weight_grad(
    saved: Sequence[Tensor],
    grad_outputs: Sequence[Tensor],
    needs: Sequence[bool],
    *,
    num_weights: int,
    mode: int,
    padding_idx: int,
    scale_grad_by_freq: bool,
) -> list[Tensor | None]:
    """The weight's part of autograd's formula for ``aten::_embedding_bag``, on what one forward
    returned besides the bags (bag per index, bag sizes, max mode's winning rows)."""
    (need_weight,) = needs
    if not need_weight:
        return [None]
    indices, offsets, offset2bag, bag_size, max_indices, *per_sample_weights = saved
    return [
        torch.ops.aten._embedding_bag_backward(
            grad_outputs[0],
            indices,
            offsets,
            offset2bag,
            bag_size,
            max_indices,
            num_weights,
            scale_grad_by_freq,
            mode,
            False,
            per_sample_weights[0] if per_sample_weights else None,
            padding_idx,
        )
    ]


def _aten_padding_idx(padding_idx: int | None, num_weights: int) -> int:
    """A module's ``padding_idx`` as ATen's backward kernels take it: -1 for none, a negative one
    counted from the end (the module turns it positive, but it may be set later)."""
    if padding_idx is None:
        return -1
    return padding_idx + num_weights if padding_idx < 0 else padding_idx


def _unsupported(module: nn.Module) -> str | None:
    assert isinstance(module, (nn.Embedding, nn.EmbeddingBag))  # registered for these only
    if module.sparse:
        return "sparse=True (sparse gradients)"
    if module.max_norm is not None:
        return "max_norm (the weight is renormalised in place by every forward)"
    return None


@sees_post_hooks
class _DeferredEmbedding(torch.autograd.Function):
    """``F.embedding`` as one autograd node (the op and its tap in one): the lookup has no input
    gradient, so its backward only routes the weight's work. Taken where
    :func:`~twobp_autograd.deferral.single_node_applies` (no forward-mode AD, whose tangents
    the tap path carries)."""

    @staticmethod
    def forward(
        ctx: Any,
        deferral: ParamDeferral,
        kernel: tuple[WeightGradKernel, Hashable],
        concatenate: bool | None,
        options: tuple[Any, ...],
        input: Tensor,
        weight: Tensor,
    ) -> Tensor:
        ctx.deferral, ctx.kernel, ctx.concatenate = deferral, kernel, concatenate
        # The indices as given: a flattened copy of non-contiguous ones would not see an
        # in-place change before backward, which plain refuses.
        ctx.save_for_backward(input)
        return F.embedding(input, weight, *options)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        (input,) = ctx.saved_tensors
        kernel, group = ctx.kernel
        deferral: ParamDeferral = ctx.deferral
        param_grads = deferral.route(ctx, kernel, group, ctx.concatenate, (_flat(input),), (grad,))
        return (None, None, None, None, None, *param_grads)


def _flat(indices: Tensor) -> Tensor:
    """Indices flattened: a 0-d or 1-d (unbatched) lookup concatenates like a batched one, and
    output-gradient rows follow the same order."""
    return indices.detach().reshape(-1)


@register(nn.Embedding, unsupported=_unsupported)
def embedding(module: nn.Embedding, input: Tensor) -> Tensor:
    weight = module.weight  # once: a parametrized weight is rebuilt per read
    # Asked again here: sparse or max_norm may be set after patch().
    reason = _unsupported(module) or unsupported_tensors(input, weight)
    if reason is not None:
        return plain_forward(module, reason, input)
    options = (module.padding_idx, module.max_norm, module.norm_type, module.scale_grad_by_freq, module.sparse)
    kernel = configured_kernel(
        embedding_weight_grad,
        num_weights=weight.shape[0],
        embedding_dim=weight.shape[1],
        padding_idx=_aten_padding_idx(module.padding_idx, weight.shape[0]),
        scale_grad_by_freq=module.scale_grad_by_freq,
    )
    concatenate = False if module.scale_grad_by_freq else None
    if single_node_applies(input, weight):
        deferral = ParamDeferral.at_forward((weight,))
        return _DeferredEmbedding.apply(deferral, kernel, concatenate, options, input, weight)
    output = F.embedding(input, detached(weight), *options)
    return defer_weight_grads(output, (weight,), (_flat(input),), kernel[0], concatenate=concatenate, group=kernel[1])


#: F.embedding_bag's modes, as ATen numbers them.
_MODES = {"sum": 0, "mean": 1, "max": 2}


@register(nn.EmbeddingBag, unsupported=_unsupported)
def embedding_bag(
    module: nn.EmbeddingBag, input: Tensor, offsets: Tensor | None = None, per_sample_weights: Tensor | None = None
) -> Tensor:
    """``nn.EmbeddingBag.forward``; a call F.embedding_bag refuses runs it, for its error."""
    weight = module.weight  # once: a parametrized weight is rebuilt per read
    # Asked again here: sparse or max_norm may be set after patch().
    reason = _unsupported(module) or unsupported_tensors(input, weight, offsets, per_sample_weights)
    if reason is not None:
        return plain_forward(module, reason, input, offsets, per_sample_weights)
    bags = _bags(module, weight, input, offsets, per_sample_weights)
    if bags is None:
        return type(module).forward(module, input, offsets, per_sample_weights)
    indices, offsets, per_sample_weights, include_last_offset = bags
    # Contiguous, as the op makes them and saves them for its backward (which requires it).
    indices, offsets = indices.contiguous(), offsets.contiguous()
    mode = _MODES[module.mode]
    # The op F.embedding_bag ends in (the same output, and the same per_sample_weights gradient),
    # called directly for what else it returns: F drops max mode's winning rows, which depend on
    # the weight's values at this forward.
    output, offset2bag, bag_size, max_indices = torch.embedding_bag(
        detached(weight),
        indices,
        offsets,
        module.scale_grad_by_freq,
        mode,
        module.sparse,
        per_sample_weights,
        include_last_offset,
        module.padding_idx,
    )
    kernel, group = configured_kernel(
        embedding_bag_weight_grad,
        num_weights=weight.shape[0],
        mode=mode,
        padding_idx=_aten_padding_idx(module.padding_idx, weight.shape[0]),
        scale_grad_by_freq=module.scale_grad_by_freq,
    )
    # What plain autograd saves for the weight: per_sample_weights as values only (their own
    # gradient is the op's, above).
    saved = [indices, offsets, offset2bag, bag_size, max_indices]
    if per_sample_weights is not None:
        saved.append(per_sample_weights)  # detached by the job (which copies a hooked leaf's)
    return defer_weight_grads(output, (weight,), saved, kernel, concatenate=False, group=group)


def _bags(
    module: nn.EmbeddingBag,
    weight: Tensor,
    input: Tensor,
    offsets: Tensor | None,
    per_sample_weights: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor | None, bool] | None:
    """F.embedding_bag's reading of a call as 1-D indices, offsets, per-sample weights and
    ``include_last_offset`` (a 2-D input: one bag per row), or None for a call it refuses."""
    if (
        weight.dim() != 2
        or module.mode not in _MODES
        or (module.mode == "max" and module.scale_grad_by_freq)
        or (per_sample_weights is not None and (module.mode != "sum" or per_sample_weights.shape != input.shape))
    ):
        return None
    if input.dim() == 1 and offsets is not None and offsets.dim() == 1:
        return input, offsets, per_sample_weights, module.include_last_offset
    if input.dim() != 2 or offsets is not None:
        return None
    # As F.embedding_bag spells it (the same error for rows of no indices).
    offsets = torch.arange(0, input.numel(), input.size(1), dtype=input.dtype, device=input.device)
    if per_sample_weights is not None:
        per_sample_weights = per_sample_weights.reshape(-1)
    return input.reshape(-1), offsets, per_sample_weights, False
