"""nn.GroupNorm: the forward calls ``native_group_norm``, the very op the module's own forward
reaches, with the parameters detached, so the input gradient is PyTorch's own. The op hands
back its per-group statistics for free; they are saved with the input so the weight kernel
never recomputes them. Each sample is normalised on its own, so the saved tensors concatenate
on the batch dimension and one kernel call serves all queued micro-batches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._prims_common import suggest_memory_format

from ..deferral import configured_kernel, defer_weight_grads, detached
from ..registry import register, weight_and_bias
from .autocast import as_autocast_casts
from .fallback import plain_forward, unsupported_tensors
from .precision import affine_dtype, norm_operands_summed_in_fp32, summed_over_row_chunks, unit_weight

__all__ = ["group_norm", "group_norm_weight_grad"]


def group_norm_weight_grad(
    saved: Sequence[Tensor],
    grad_outputs: Sequence[Tensor],
    needs: Sequence[bool],
    *,
    num_groups: int,
    weight_dtype: torch.dtype,
) -> list[Tensor | None]:
    input, mean, rstd = saved  # (N, C, *), (N, groups), (N, groups)
    need_weight, need_bias = needs
    # The native kernel reads both in the layout the forward gave the input (autograd makes the
    # output gradient so too): on CUDA a transposed gradient was read as contiguous, garbage.
    input = _as_native_op_takes(input)
    grad = _as_native_op_takes(grad_outputs[0], like=input)
    channels, features = input.shape[1], math.prod(input.shape[2:])
    (grad, input, mean, rstd), weight_dtype = norm_operands_summed_in_fp32((grad, input, mean, rstd), weight_dtype)
    weight = unit_weight(input, channels, weight_dtype)

    def native(grad: Tensor, input: Tensor, mean: Tensor, rstd: Tensor) -> tuple[Tensor | None, ...]:
        mask = [False, need_weight, need_bias]
        batch = input.shape[0]
        return torch.ops.aten.native_group_norm_backward(
            grad, input, mean, rstd, weight, batch, channels, features, num_groups, mask
        )[1:]

    weight_grad, bias_grad = summed_over_row_chunks(native, (grad, input, mean, rstd), _SAMPLES_PER_CALL)
    return [weight_grad if need_weight else None, bias_grad if need_bias else None]


def _as_native_op_takes(tensor: Tensor, like: Tensor | None = None) -> Tensor:
    """What torch.group_norm and its derivative hand the native ops: on CPU in the input's
    (``like``'s) layout, channels_last kept; contiguous on other devices."""
    if tensor.device.type == "cpu":
        return tensor.contiguous(memory_format=suggest_memory_format(tensor if like is None else like))
    return tensor.contiguous()


#: Samples per CPU kernel call (see .precision; each sample's own sums are not serial).
_SAMPLES_PER_CALL = 64


@register(nn.GroupNorm)
def group_norm(module: nn.GroupNorm, input: Tensor) -> Tensor:
    params = weight_and_bias(module)
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
    x, (weight, bias) = as_autocast_casts("group_norm", input, *map(detached, params))
    batch, channels = x.shape[:2]
    output, mean, rstd = torch.native_group_norm(
        _as_native_op_takes(x),
        None if weight is None else weight.contiguous(),
        None if bias is None else bias.contiguous(),
        batch,
        channels,
        math.prod(x.shape[2:]),
        groups,
        module.eps,
    )
    kernel, group = configured_kernel(
        group_norm_weight_grad, num_groups=groups, weight_dtype=affine_dtype(weight, bias)
    )
    # The input saved as given (the kernel lays it out), as plain saves it: changed in place
    # before backward, it makes backward raise as plain's does. The statistics detached:
    # differentiable graph outputs under torch.compile with dynamic shapes, they made inductor's
    # backward fail to compile.
    return defer_weight_grads(output, params, (x, mean.detach(), rstd.detach()), kernel, group=group)
