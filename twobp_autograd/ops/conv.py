"""nn.Conv1d/2d/3d and nn.ConvTranspose1d/2d/3d: dX by PyTorch's own convolution derivative
(the forward runs with the parameters detached); dW and db by one
``aten.convolution_backward`` call over all queued micro-batches concatenated on the batch dim.

The forwards replicate the modules' own (``F.pad`` first for non-zero padding modes, the
padding strings, ``output_size`` of the transposed convolutions). What the weight kernel needs
is the input the convolution really saw (padded, in autocast's dtype) and an explicit,
symmetric numeric padding: ``padding='same'`` with an even receptive field pads one more on
the right, which the kernel re-creates with a zero ``F.pad`` on the concatenated input rather
than keeping a padded copy alive until the flush. Unbatched inputs run as a batch of one, as
PyTorch itself does, so the saved tensors always have the batch on dim 0.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
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
from .fallback import plain_forward, unsupported_tensors
from .precision import accumulation_dtype

__all__ = ["conv", "conv_transpose", "conv_weight_grad"]

IntTuple = tuple[int, ...]


def conv_weight_grad(
    saved: Sequence[Tensor],
    grad_outputs: Sequence[Tensor],
    needs: Sequence[bool],
    *,
    weight_shape: IntTuple,
    weight_stride: IntTuple,
    stride: IntTuple,
    padding: IntTuple,
    dilation: IntTuple,
    transposed: bool,
    output_padding: IntTuple,
    groups: int,
    extra_right_padding: IntTuple | None = None,
) -> list[Tensor | None]:
    """Weight and bias gradients of a convolution with the given (hashable) configuration.

    ``extra_right_padding`` is an ``F.pad`` argument (last dim first) of zeros added after the
    symmetric ``padding``; the weight is only needed for its shape, so an uninitialised
    stand-in with its shape and strides is passed."""
    (input,) = saved
    (grad_output,) = grad_outputs
    # bf16/fp16 weight-gradient convolutions over joined micro-batches lose up to 25 times
    # autograd's precision (measured on CPU): run them in fp32 (see .precision).
    accumulate = accumulation_dtype(input.dtype)
    # Converted only where the dtype differs: even a no-op .to() costs a dispatch per flush.
    if input.dtype != accumulate:
        input = input.to(accumulate)
    if grad_output.dtype != accumulate:
        grad_output = grad_output.to(accumulate)
    if extra_right_padding is not None:
        input = F.pad(input, extra_right_padding)
    need_weight, need_bias = needs
    weight_grad = None
    if need_weight:
        # Never read (its gradient is not asked for): only its shape and layout steer the backend.
        weight = input.new_empty_strided(weight_shape, weight_stride)  # a DTensor where input is one
        weight_grad = torch.ops.aten.convolution_backward(
            grad_output, input, weight, None, stride, padding, dilation, transposed, output_padding, groups,
            _WEIGHT_ONLY,
        )[1]
    # The bias by a reduction of its own: the CPU backend's sum over a joined batch runs almost
    # serially (measured: 16 joined micro-batches of 8x4x64x64, 4.8e-3 relative error against
    # fp64 where plain's per micro-batch had 3.8e-7); torch.sum sums pairwise.
    bias_grad = grad_output.sum(_ALL_BUT_CHANNELS[grad_output.dim()]) if need_bias else None
    return [weight_grad, bias_grad]


#: convolution_backward's output mask for the weight's gradient alone.
_WEIGHT_ONLY = (False, True, False)

#: A bias gradient's reduction dims, by the output gradient's number of dims (channels on dim 1).
_ALL_BUT_CHANNELS = {dims: tuple(d for d in range(dims) if d != 1) for dims in (3, 4, 5)}


def _same_padding(module: nn.modules.conv._ConvNd, weight: Tensor) -> tuple[IntTuple, IntTuple | None]:
    """``padding='same'`` as symmetric per-dim padding plus the extra right-side zeros, worked
    out at each call as ``F.convNd`` does (the module's own pairs are only made at construction:
    a padding set to 'same' later would leave them stale), from the weight's own kernel size as
    F.convNd reads it (``module.kernel_size`` is only the constructor's: a weight of another
    size assigned since would pad otherwise)."""
    totals = [d * (k - 1) for d, k in zip(module.dilation, weight.shape[2:], strict=True)]
    symmetric = tuple(total // 2 for total in totals)
    extra: list[int] = []
    for total in reversed(totals):  # F.pad's order: the last dim first
        extra += [0, total - 2 * (total // 2)]
    return symmetric, (tuple(extra) if any(extra) else None)


#: Micro-batches joined on the CPU too: weight-gradient convolutions over a few samples run far
#: below the speed they reach on many (measured: benchmarks/overhead.py, ResNet-152 at batch 2).
_JOINED = True


@sees_post_hooks
class _DeferredConvolution(torch.autograd.Function):
    """A convolution with numeric padding as one autograd node (the op and its tap in one): its
    backward takes the input gradient from ``convolution_backward`` with the arguments and
    mask that autograd's own derivative of ``aten::convolution`` passes when the parameters are
    detached, and routes the parameters' work as the tap does."""

    @staticmethod
    def forward(
        ctx: Any,
        deferral: ParamDeferral,
        call: tuple[Callable[..., Tensor], Sequence[Any]],
        kernel: tuple[WeightGradKernel, Hashable],
        convolution_args: tuple[Any, ...],
        input: Tensor,
        weight: Tensor,
        bias_input: Tensor,
    ) -> Tensor:
        ctx.deferral, ctx.kernel, ctx.convolution_args = deferral, kernel, convolution_args
        ctx.save_for_backward(input, weight)
        functional, functional_args = call
        return functional(input, weight, param_from_input(bias_input), *functional_args)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        input, weight = ctx.saved_tensors
        grad_input = None
        if ctx.needs_input_grad[4]:
            grad_input = torch.ops.aten.convolution_backward(
                grad, input, weight, None, *ctx.convolution_args, [True, False, False]
            )[0]
        kernel, group = ctx.kernel
        deferral: ParamDeferral = ctx.deferral
        param_grads = deferral.route(ctx, kernel, group, _JOINED, (input,), (grad,))
        return (None, None, None, None, grad_input, *param_grads)


def _deferred_conv(
    module: nn.modules.conv._ConvNd,
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    functional_args: Sequence[Any],
    kernel_config: dict[str, Any],
) -> Tensor:
    """Run the module's functional ``F.conv*(input, weight, bias, *functional_args)`` with the
    leaf parameters detached and defer their gradients; ``input`` is what the convolution itself
    receives."""
    # Found by what the module is, not by its exact type: registering a parametrization swaps
    # the class of an already patched module for a generated subclass (ParametrizedConv2d).
    functional = _CONV_FUNCTIONALS[module.transposed, len(module.kernel_size)]
    kernel = configured_kernel(
        conv_weight_grad,
        weight_shape=tuple(weight.shape),
        weight_stride=weight.stride(),
        dilation=tuple(module.dilation),
        groups=module.groups,
        **kernel_config,
    )
    unbatched = input.dim() == len(module.kernel_size) + 1
    # A padding string ('same', 'valid') takes its own composite path inside F.convNd.
    if not isinstance(functional_args[1], str) and single_node_applies(input, weight):
        # As F.convNd does: an unbatched input runs as a batch of one.
        batched = input.unsqueeze(0) if unbatched else input
        convolution_args = (
            kernel_config["stride"], kernel_config["padding"], tuple(module.dilation),
            kernel_config["transposed"], kernel_config["output_padding"], module.groups,
        )  # fmt: skip
        deferral = ParamDeferral.at_forward((weight, bias))
        output = _DeferredConvolution.apply(
            deferral, (functional, functional_args), kernel, convolution_args, batched, weight, *param_inputs((bias,))
        )
        return output.squeeze(0) if unbatched else output
    output = functional(input, detached(weight), detached(bias), *functional_args)
    if unbatched:
        # The tap sits on the batch-of-one output PyTorch computes internally; the caller
        # gets the same squeezed view F.convNd returns.
        output = output.unsqueeze(0)
        input = input.unsqueeze(0)
    # Saved in the dtype the convolution really ran in (autocast's), as plain autograd saves it.
    saved_input = input if input.dtype == output.dtype else input.to(output.dtype)
    output = defer_weight_grads(output, (weight, bias), (saved_input,), kernel[0], concatenate=_JOINED, group=kernel[1])
    return output.squeeze(0) if unbatched else output


@register((nn.Conv1d, nn.Conv2d, nn.Conv3d))
def conv(module: nn.modules.conv._ConvNd, input: Tensor) -> Tensor:
    """The forward of ``nn.Conv1d/2d/3d`` (``_conv_forward``) with deferred weight gradients."""
    weight, bias = weight_and_bias(module)
    reason = unsupported_tensors(input, weight)
    if reason is not None:
        return plain_forward(module, reason, input)
    zeros = (0,) * len(module.kernel_size)
    conv_padding: str | IntTuple = module.padding  # what the module passes to F.convNd
    kernel_padding: IntTuple = zeros  # the same, as symmetric numbers for the weight kernel
    extra: IntTuple | None = None
    if module.padding_mode != "zeros":
        input = F.pad(input, module._reversed_padding_repeated_twice, mode=module.padding_mode)
        conv_padding = zeros
    elif module.padding == "same":
        kernel_padding, extra = _same_padding(module, weight)
    elif not isinstance(module.padding, str):  # 'valid' pads nothing
        kernel_padding = tuple(module.padding)
    config = dict(
        stride=tuple(module.stride),
        padding=kernel_padding,
        transposed=False,
        output_padding=zeros,
        extra_right_padding=extra,
    )
    args = (module.stride, conv_padding, module.dilation, module.groups)
    return _deferred_conv(module, input, weight, bias, args, config)


@register((nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d))
def conv_transpose(
    module: nn.modules.conv._ConvTransposeNd, input: Tensor, output_size: list[int] | None = None
) -> Tensor:
    """The forward of ``nn.ConvTranspose1d/2d/3d`` with deferred weight gradients."""
    if module.padding_mode != "zeros":
        raise ValueError(f"Only `zeros` padding mode is supported for {type(module).__name__}")
    if not isinstance(module.padding, tuple):
        raise AssertionError("self.padding must be a tuple")
    weight, bias = weight_and_bias(module)
    reason = unsupported_tensors(input, weight)
    if reason is not None:
        return plain_forward(module, reason, input, output_size)
    num_spatial_dims = len(module.kernel_size)
    output_padding = module._output_padding(
        input,
        output_size,
        module.stride,  # type: ignore[arg-type]
        module.padding,  # type: ignore[arg-type]
        module.kernel_size,  # type: ignore[arg-type]
        num_spatial_dims,
        module.dilation,  # type: ignore[arg-type]
    )
    config = dict(
        stride=tuple(module.stride),
        padding=tuple(module.padding),
        transposed=True,
        output_padding=tuple(output_padding),
    )
    args = (module.stride, module.padding, output_padding, module.groups, module.dilation)
    return _deferred_conv(module, input, weight, bias, args, config)


#: (transposed, spatial dims) -> the functional the module's forward calls.
_CONV_FUNCTIONALS: dict[tuple[bool, int], Callable[..., Tensor]] = {
    (False, 1): F.conv1d,
    (False, 2): F.conv2d,
    (False, 3): F.conv3d,
    (True, 1): F.conv_transpose1d,
    (True, 2): F.conv_transpose2d,
    (True, 3): F.conv_transpose3d,
}
