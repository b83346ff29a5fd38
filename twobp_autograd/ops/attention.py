"""nn.MultiheadAttention: the training forward of ``F.multi_head_attention_forward`` re-run
with every parameter detached, so the attention core (SDPA or the explicit softmax path, masks,
dropout) differentiates natively for the inputs, while the weight work is queued:

- the in-projection: self-attention with the packed ``in_proj_weight`` is one deferred linear;
  any other in-projection (cross-attention, separate ``q/k/v_proj_weight`` for ``kdim``/``vdim``)
  is one tap over its 2 or 3 products whose kernel returns the parameters' full gradients (the
  packed weight and the packed ``in_proj_bias`` in one piece);
- ``bias_k`` / ``bias_v`` (``add_bias_kv``): one tap whose kernel sums over the batch;
- the out-projection: a deferred linear on ``out_proj``'s parameters (MHA never calls
  ``out_proj.forward``).

Projections are taken on 2-D rows of the inputs in the caller's layout (rows of different
micro-batches and sequence lengths concatenate freely), then laid out (L, N, E) exactly as
PyTorch's own forward does, so dropout draws the same random numbers as plain autograd.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.parametrize import is_parametrized

from ..checkpoint_paths import refuse_recomputation_in_eval
from ..deferral import configured_kernel, defer_weight_grads, detached
from ..registry import register
from .fallback import plain_forward, unsupported_tensors
from .linear import linear_forward, linear_weight_grad

__all__ = ["multihead_attention", "attention_in_projection_weight_grad", "attention_kv_bias_weight_grad"]


def attention_in_projection_weight_grad(
    saved: Sequence[Tensor], grad_outputs: Sequence[Tensor], needs: Sequence[bool], *, packed_weight: bool
) -> list[Tensor | None]:
    """Gradients of an in-projection made of one linear per (rows, output) pair.

    ``packed_weight``: params are ``(in_proj_weight, in_proj_bias)``, each product using a
    consecutive block of rows of both; else ``(q_w, k_w, v_w, in_proj_bias)``. The last saved
    tensor says which products each backward reached (``saves_reached``): a separate weight only
    unreached products use stays None, as in plain autograd (a loss on the attention weights
    alone never reaches v); a packed weight or the bias is None only if no product was reached
    (else the unreached blocks are zeros, as autograd fills a chunk's unused parts).
    """
    *saved, reached_rows = saved
    reached = reached_rows.any(0).tolist()
    if not any(reached):
        return [None] * len(needs)
    *need_weights, need_bias = needs  # one weight if packed, else q, k, v
    if not packed_weight:
        need_weights = [need and hit for need, hit in zip(need_weights, reached, strict=True)]
    need_product_weights = need_weights * len(saved) if packed_weight else need_weights
    per_product = [
        linear_weight_grad((rows,), (grad,), (need_weight, need_bias))
        for rows, grad, need_weight in zip(saved, grad_outputs, need_product_weights, strict=True)
    ]
    # Where a gradient is needed every product returned one.
    bias_grad = torch.cat([b for _, b in per_product if b is not None]) if need_bias else None
    if packed_weight:
        (need_packed_weight,) = need_weights
        weight_grads = [torch.cat([w for w, _ in per_product if w is not None]) if need_packed_weight else None]
    else:
        weight_grads = [w for w, _ in per_product]
    return [*weight_grads, bias_grad]


def attention_kv_bias_weight_grad(
    saved: Sequence[Tensor], grad_outputs: Sequence[Tensor], needs: Sequence[bool]
) -> list[Tensor | None]:
    """``bias_k`` / ``bias_v`` were repeated once per sample as (N, 1, E): sum over dim 0. The
    saved tensors: (N, 0) for the batch, then which of the two each backward reached (one no
    backward reached stays None, as in plain autograd)."""
    reached = saved[-1].any(0).tolist()
    return [
        grad.sum(0, keepdim=True) if need and hit else None
        for grad, need, hit in zip(grad_outputs, needs, reached, strict=True)
    ]


def _rows(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1])


def _deferred_products(
    inputs: Sequence[Tensor],
    weights: Sequence[Tensor],
    biases: Sequence[Tensor | None],
    params: Sequence[Tensor | None],
    packed_weight: bool,
) -> tuple[Tensor, ...]:
    """``F.linear(inputs[i], weights[i], biases[i])`` (detached slices) under one tap over ``params``.
    A product's input is saved only for a weight that needs a gradient, as addmm saves it (an
    input may then change in place after the forward); for a frozen one an empty (rows, 0)
    stand-in keeps the products' order and concatenates like rows."""
    products = tuple(F.linear(_rows(x), w, b) for x, w, b in zip(inputs, weights, biases, strict=True))
    weight_params = [params[0]] * len(inputs) if packed_weight else list(params[: len(inputs)])
    saved = tuple(
        _rows(x).to(p.dtype) if w is not None and w.requires_grad else x.new_empty(p.shape[0], 0)
        for x, p, w in zip(inputs, products, weight_params, strict=True)
    )
    kernel, group = configured_kernel(attention_in_projection_weight_grad, packed_weight=packed_weight)
    tapped = defer_weight_grads(products, params, saved, kernel, group=group, saves_reached=True)
    return tuple(p.view(*x.shape[:-1], p.shape[-1]) for x, p in zip(inputs, tapped, strict=True))


def _split_packed(proj: Tensor, parts: int, embed_dim: int) -> tuple[Tensor, ...]:
    # PyTorch's layout for a packed product: (parts, ..., E), contiguous, in q, k, v order.
    proj = proj.unflatten(-1, (parts, embed_dim)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
    return tuple(proj[i] for i in range(parts))


def _in_projection(
    module: nn.MultiheadAttention, query: Tensor, key: Tensor, value: Tensor, to_seq_first: Callable[[Tensor], Tensor]
) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v in (L, N, E) layout, computed as ``F._in_projection_packed`` / ``F._in_projection``."""
    E = module.embed_dim
    bias = module.in_proj_bias
    b = detached(bias)
    biases = b.chunk(3) if b is not None else (None,) * 3
    if module._qkv_same_embed_dim:
        weight = module.in_proj_weight
        w = detached(weight)
        if key is value and query is key:  # self-attention: one linear over the packed weight
            proj = linear_forward(_rows(query), weight, bias).view(*query.shape[:-1], 3 * E)
            return _split_packed(to_seq_first(proj), 3, E)  # type: ignore[return-value]
        if key is value:  # encoder-decoder attention: q, and k/v packed
            w_q, w_kv = w.split([E, 2 * E])
            b_q, b_kv = b.split([E, 2 * E]) if b is not None else (None, None)
            q, kv = _deferred_products((query, key), (w_q, w_kv), (b_q, b_kv), (weight, bias), True)
            k, v = _split_packed(to_seq_first(kv), 2, E)
            return to_seq_first(q), k, v
        q, k, v = _deferred_products((query, key, value), w.chunk(3), biases, (weight, bias), True)
    else:
        weights = (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight)
        q, k, v = _deferred_products(
            (query, key, value), [detached(p) for p in weights], biases, (*weights, bias), False
        )
    return to_seq_first(q), to_seq_first(k), to_seq_first(v)


def _deferred_kv_bias(module: nn.MultiheadAttention, bsz: int) -> tuple[Tensor, Tensor]:
    """``bias_k.repeat(1, bsz, 1)`` and the same for ``bias_v``, with their gradients deferred."""
    bias_k, bias_v = module.bias_k, module.bias_v
    assert bias_k is not None and bias_v is not None
    # Repeated with the batch on dim 0, as (N, 1, E), so micro-batches concatenate.
    repeated = (detached(bias_k).repeat(bsz, 1, 1), detached(bias_v).repeat(bsz, 1, 1))
    batch = repeated[0].new_empty(bsz, 0)  # gives the reached flags their batch dimension
    k_rows, v_rows = defer_weight_grads(
        repeated, (bias_k, bias_v), (batch,), attention_kv_bias_weight_grad, saves_reached=True
    )
    return k_rows.transpose(0, 1), v_rows.transpose(0, 1)


@register(nn.MultiheadAttention)
def multihead_attention(
    module: nn.MultiheadAttention,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_padding_mask: Tensor | None = None,
    need_weights: bool = True,
    attn_mask: Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
) -> tuple[Tensor, Tensor | None]:
    if not module.training and module.dropout > 0.0:
        refuse_recomputation_in_eval(module, "drops no attention weights")
    # (Outside its inference fast path PyTorch refuses nested tensors, and softmax complex ones:
    # the plain forward says so.) The parameters need no look: they meet the inputs in a GEMM,
    # which refuses mixed dtypes.
    reason = unsupported_tensors(query, key, value)
    if reason is None and (is_parametrized(module) or is_parametrized(module.out_proj)):
        # Plain's forward reads in_proj_weight and in_proj_bias more than once (its fast-path
        # checks), and a parametrization runs at each read: a stateful (spectral_norm's power
        # iteration) or random one then computes other values. Its weight is no leaf, so it would
        # not be deferred anyway.
        reason = "a parametrized weight (a parametrization runs at every read, as many as plain's)"
    if reason is not None:
        return plain_forward(
            module, reason, query, key, value,
            key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal,
        )
    # MultiheadAttention.forward
    key_padding_mask = _canonical_key_padding_mask(key_padding_mask, attn_mask, query)
    attn_mask = F._canonical_mask(
        mask=attn_mask,
        mask_name="attn_mask",
        other_type=None,
        other_name="",
        target_type=query.dtype,
        check_other=False,
    )
    # F.multi_head_attention_forward, training=True
    is_batched = _checked_is_batched(module, query, key, value, key_padding_mask, attn_mask)
    to_seq_first = _seq_first(is_batched, module.batch_first)
    if not is_batched and key_padding_mask is not None:
        key_padding_mask = key_padding_mask.unsqueeze(0)
    tgt_len, bsz = to_seq_first(query).shape[:2]
    src_len = to_seq_first(key).shape[0]
    key_padding_mask = _canonical_key_padding_mask(key_padding_mask, attn_mask, query)
    if is_causal and attn_mask is None:
        raise RuntimeError(
            "Need attn_mask if specifying the is_causal hint. You may use the Transformer module method "
            "`generate_square_subsequent_mask` to create this mask."
        )
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None  # SDPA applies the causal mask itself
    elif key_padding_mask is not None:
        is_causal = False  # the merged mask is no longer causal

    q, k, v = _in_projection(module, query, key, value, to_seq_first)
    attn_mask = _checked_attn_mask(attn_mask, tgt_len, src_len, bsz * module.num_heads)
    q, k, v, attn_mask = _per_head(module, q, k, v, attn_mask, key_padding_mask)
    if need_weights:
        attn_output, weights = _explicit_attention(module, q, k, v, attn_mask, average_attn_weights)
        if not is_batched:
            weights = weights.squeeze(0)
    else:
        attn_output, weights = _sdpa_attention(module, q, k, v, attn_mask, is_causal), None
    attn_output = attn_output.view(tgt_len, bsz, attn_output.size(1))
    if not is_batched:
        attn_output = attn_output.squeeze(1)
    # back to MultiheadAttention.forward
    if module.batch_first and is_batched:
        attn_output = attn_output.transpose(1, 0)
    return attn_output, weights


def _canonical_key_padding_mask(
    key_padding_mask: Tensor | None, attn_mask: Tensor | None, query: Tensor
) -> Tensor | None:
    return F._canonical_mask(
        mask=key_padding_mask,
        mask_name="key_padding_mask",
        other_type=F._none_or_dtype(attn_mask),
        other_name="attn_mask",
        target_type=query.dtype,
    )


def _checked_is_batched(
    module: nn.MultiheadAttention,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_padding_mask: Tensor | None,
    attn_mask: Tensor | None,
) -> bool:
    """F.multi_head_attention_forward's shape checks, with its messages; whether the call is batched."""
    is_batched: bool = F._mha_shape_check(  # type: ignore[attr-defined]  # private: absent from torch's stubs
        query, key, value, key_padding_mask, attn_mask, module.num_heads
    )
    embed_dim = module.embed_dim
    if query.shape[-1] != embed_dim:
        raise AssertionError(f"was expecting embedding dimension of {embed_dim}, but got {query.shape[-1]}")
    if module._qkv_same_embed_dim and key.shape != value.shape:
        raise AssertionError(f"key shape {key.shape} does not match value shape {value.shape}")
    if not module._qkv_same_embed_dim and key.shape[:-1] != value.shape[:-1]:
        raise AssertionError(f"key's sequence and batch dims {key.shape[:-1]} do not match value's {value.shape[:-1]}")
    return is_batched


def _seq_first(is_batched: bool, batch_first: bool) -> Callable[[Tensor], Tensor]:
    """A tensor in the caller's layout as (L, N, E), the layout PyTorch's forward computes in."""
    if not is_batched:
        return lambda t: t.unsqueeze(1)
    if batch_first:
        return lambda t: t.transpose(0, 1)
    return lambda t: t


def _checked_attn_mask(attn_mask: Tensor | None, tgt_len: int, src_len: int, batch_heads: int) -> Tensor | None:
    """A 2-D mask as (1, L, S); a 3-D one checked as (N * heads, L, S)."""
    if attn_mask is None:
        return None
    if attn_mask.dim() == 2:
        if attn_mask.shape != (tgt_len, src_len):
            raise RuntimeError(
                f"The shape of the 2D attn_mask is {attn_mask.shape}, but should be {(tgt_len, src_len)}."
            )
        return attn_mask.unsqueeze(0)
    if attn_mask.shape != (batch_heads, tgt_len, src_len):
        raise RuntimeError(
            f"The shape of the 3D attn_mask is {attn_mask.shape}, but should be {(batch_heads, tgt_len, src_len)}."
        )
    return attn_mask


def _per_head(
    module: nn.MultiheadAttention,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None,
    key_padding_mask: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """q, k, v as (N * heads, L or S, head_dim), with ``bias_k``/``bias_v`` and the zero
    attention appended to k and v, and the key padding merged into the attention mask."""
    tgt_len, bsz = q.shape[:2]
    batch_heads, head_dim = bsz * module.num_heads, module.embed_dim // module.num_heads
    if module.bias_k is not None and module.bias_v is not None:
        bias_k, bias_v = _deferred_kv_bias(module, bsz)
        k, v = torch.cat([k, bias_k]), torch.cat([v, bias_v])
        attn_mask, key_padding_mask = _pad_masks(attn_mask, key_padding_mask)
    # reshape, not view: with batch_first the projections are transposed views
    q = q.reshape(tgt_len, batch_heads, head_dim).transpose(0, 1)
    k = k.reshape(k.shape[0], batch_heads, head_dim).transpose(0, 1)
    v = v.reshape(v.shape[0], batch_heads, head_dim).transpose(0, 1)
    if module.add_zero_attn:
        zero_attn_shape = (batch_heads, 1, head_dim)
        k = torch.cat([k, torch.zeros(zero_attn_shape, dtype=k.dtype, device=k.device)], dim=1)
        v = torch.cat([v, torch.zeros(zero_attn_shape, dtype=v.dtype, device=v.device)], dim=1)
        attn_mask, key_padding_mask = _pad_masks(attn_mask, key_padding_mask)
    src_len = k.size(1)
    if key_padding_mask is not None:
        if key_padding_mask.shape != (bsz, src_len):
            raise AssertionError(
                f"Expected key_padding_mask of shape {(bsz, src_len)}, but got {tuple(key_padding_mask.shape)}"
            )
        expanded = key_padding_mask.view(bsz, 1, 1, src_len).expand(-1, module.num_heads, -1, -1)
        key_padding_mask = expanded.reshape(batch_heads, 1, src_len)
        attn_mask = key_padding_mask if attn_mask is None else attn_mask + key_padding_mask
    return q, k, v, attn_mask


def _pad_masks(attn_mask: Tensor | None, key_padding_mask: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    """Both masks with one more (unmasked) key position."""
    return (
        None if attn_mask is None else F.pad(attn_mask, (0, 1)),
        None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1)),
    )


def _explicit_attention(
    module: nn.MultiheadAttention, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, average_weights: bool
) -> tuple[Tensor, Tensor]:
    """The ``need_weights`` path: softmax(q k^T / sqrt(d) + mask), dropout, times v, then
    ``out_proj`` on rows; and the attention weights per head or averaged."""
    batch_heads, tgt_len, head_dim = q.shape
    bsz, src_len = batch_heads // module.num_heads, k.size(1)
    q_scaled = q * math.sqrt(1.0 / float(head_dim))
    if attn_mask is not None:
        weights = torch.baddbmm(attn_mask, q_scaled, k.transpose(-2, -1))
    else:
        weights = torch.bmm(q_scaled, k.transpose(-2, -1))
    weights = F.softmax(weights, dim=-1)
    if module.dropout > 0.0:
        weights = F.dropout(weights, p=module.dropout)
    attn_output = torch.bmm(weights, v)
    attn_output = attn_output.transpose(0, 1).reshape(tgt_len * bsz, module.embed_dim)
    attn_output = linear_forward(attn_output, module.out_proj.weight, module.out_proj.bias)
    weights = weights.view(bsz, module.num_heads, tgt_len, src_len)
    return attn_output, weights.mean(dim=1) if average_weights else weights


def _sdpa_attention(
    module: nn.MultiheadAttention, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool
) -> Tensor:
    """The path without weights: scaled_dot_product_attention, then ``out_proj`` on rows."""
    batch_heads, tgt_len, head_dim = q.shape
    num_heads = module.num_heads
    bsz, src_len = batch_heads // num_heads, k.size(1)
    if attn_mask is not None:
        if attn_mask.size(0) == 1 and attn_mask.dim() == 3:
            attn_mask = attn_mask.unsqueeze(0)
        else:
            attn_mask = attn_mask.view(bsz, num_heads, -1, src_len)
    q = q.view(bsz, num_heads, tgt_len, head_dim)
    k = k.view(bsz, num_heads, src_len, head_dim)
    v = v.view(bsz, num_heads, src_len, head_dim)
    attn_output = F.scaled_dot_product_attention(q, k, v, attn_mask, module.dropout, is_causal)
    attn_output = attn_output.permute(2, 0, 1, 3).reshape(bsz * tgt_len, module.embed_dim)
    return linear_forward(attn_output, module.out_proj.weight, module.out_proj.bias)
