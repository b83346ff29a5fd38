"""The dtype a weight-gradient kernel sums in. A flush joins many micro-batches into one kernel
call; with bf16/fp16 operands (autocast) one rounding of the whole sum to 8 or 11 mantissa bits,
or a kernel that accumulates in the operands' dtype, loses far more than autograd does by
rounding each micro-batch's gradient and summing them in the fp32 ``.grad``."""

from __future__ import annotations

import torch

__all__ = ["accumulation_dtype"]

_REDUCED = (torch.bfloat16, torch.float16)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for bf16/fp16, the dtype itself otherwise (as ATen's ``opmath_type``)."""
    return torch.float32 if dtype in _REDUCED else dtype
