"""How a weight-gradient kernel keeps plain autograd's precision when a flush joins many
micro-batches into one call.

- With bf16/fp16 operands (autocast), one rounding of the whole sum to 8 or 11 mantissa bits,
  or a kernel that accumulates in the operands' dtype, loses far more than autograd does by
  rounding each micro-batch's gradient and summing them in the fp32 ``.grad``: such kernels
  sum in :func:`accumulation_dtype`.
- Some of ATen's CPU kernels (LayerNorm's and GroupNorm's weight and bias sums) add their rows
  one after another, so their rounding error grows with the rows joined: 10-20x plain's over
  16 joined micro-batches. :func:`summed_over_row_chunks` calls them on bounded slices.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = [
    "accumulation_dtype",
    "affine_dtype",
    "norm_operands_summed_in_fp32",
    "summed_over_row_chunks",
    "unit_weight",
]

_REDUCED = (torch.bfloat16, torch.float16)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for bf16/fp16, the dtype itself otherwise (as ATen's ``opmath_type``)."""
    return torch.float32 if dtype in _REDUCED else dtype


def norm_operands_summed_in_fp32(
    tensors: Sequence[Tensor], weight_dtype: torch.dtype
) -> tuple[Sequence[Tensor], torch.dtype]:
    """A norm's native backward operands, and the dtype of the weight it is given, for its
    weight and bias sums: on a CPU, whose kernels sum bf16/fp16 rows in that dtype and round the
    joined sum once, in fp32 (the sum is then rounded as AccumulateGrad rounds: to the dtype the
    gradient accumulates in, fp32 for a bf16 parameter with an fp32 ``grad_dtype``)."""
    first = tensors[0]
    if first.is_cuda or accumulation_dtype(first.dtype) == first.dtype:
        return tensors, weight_dtype
    return [t.float() for t in tensors], torch.promote_types(weight_dtype, torch.float32)


def affine_dtype(weight: Tensor | None, bias: Tensor | None) -> torch.dtype:
    """The dtype of a norm's affine parameters (autocast's, where it cast them): the weight's, or
    the bias's where the weight was set to None (``norm.weight = None`` keeps the bias; F.layer_norm
    and F.group_norm take that)."""
    param = weight if weight is not None else bias
    if param is None:
        raise ValueError("twobp: a norm with neither weight nor bias has no gradient to defer")
    return param.dtype


def unit_weight(like: Tensor, shape: int | tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """Ones of ``shape`` in ``dtype``, made like ``like`` (a DTensor where it is one, which refuses
    a mix): the weight a norm's native backward is given for its weight and bias sums alone, which
    read only its shape. Never written to, so plain tensors share one per shape, dtype and device
    (made per flush group, it cost a microsecond and a half)."""
    if type(like) is not Tensor:
        return like.new_ones(shape, dtype=dtype)
    key = (shape, dtype, like.device)
    ones = _UNIT_WEIGHTS.get(key)
    if ones is None:
        ones = _UNIT_WEIGHTS[key] = like.new_ones(shape, dtype=dtype)
    return ones


_UNIT_WEIGHTS: dict[tuple[int | tuple[int, ...], torch.dtype, torch.device], Tensor] = {}


def summed_over_row_chunks(
    kernel: Callable[..., Sequence[Tensor | None]], tensors: Sequence[Tensor], rows: int
) -> list[Tensor | None]:
    """``kernel(*tensors)`` for a kernel that sums over dim 0 serially on a CPU: there, called
    on slices of at most ``rows`` along dim 0 of every tensor and the results added, so its
    error stays that of ``rows`` rows however many micro-batches were joined (about what
    autograd's per-micro-batch calls give). One call elsewhere, or where the rows fit."""
    first = tensors[0]
    # A tensor subclass (a DTensor under tensor parallelism) slices by rules of its own.
    if first.device.type != "cpu" or first.shape[0] <= rows or type(first) is not Tensor:
        return list(kernel(*tensors))
    total: list[Tensor | None] = []
    for chunk in zip(*(t.split(rows) for t in tensors), strict=True):
        grads = kernel(*chunk)
        # The kernel's results are fresh tensors of this call: adding into the first is safe.
        if not total:
            total = list(grads)
        else:
            total = [t if t is None or g is None else t.add_(g) for t, g in zip(total, grads, strict=True)]
    return total
