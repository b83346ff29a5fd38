"""BatchNorm1d/2d/3d in training, apart from the other norms: its input gradient passes through
the micro-batch statistics, and the reductions that takes (sum(dy), sum(dy * x_hat)) are its
bias and weight gradients. So its own autograd Function runs the derivative of the backend
``torch.batch_norm`` picks (cuDNN on CUDA) once for all three in backward-p1 and queues the
finished weight and bias gradients (2 x C numbers, summed per micro-batch at the flush, through
``ParamDeferral``): deferring a kernel would only run the reductions twice and keep the input
alive meanwhile.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._prims_common import suggest_memory_format
from torch.autograd import forward_ad

from ..checkpoint_paths import refuse_recomputation_in_eval
from ..deferral import (
    INFERENCE_TENSORS_SAVED,
    ParamDeferral,
    defer_weight_grads,
    detached,
    guard_tangent,
    param_from_input,
    param_inputs,
    sees_post_hooks,
)
from ..registry import register, weight_and_bias
from .autocast import as_autocast_casts
from .fallback import plain_forward, unsupported_tensors

__all__ = ["batch_norm"]


#: ``torch._batch_norm_impl_index``'s backend numbers: ATen's own kernels, cuDNN (2 is MIOpen).
_NATIVE, _CUDNN = 0, 1


@sees_post_hooks
class _TrainingBatchNorm(torch.autograd.Function):
    """Batch norm in training. Its input gradient needs sum(dy) and sum(dy * x_hat), which are
    the bias and weight gradients: backward-p1 gets all three from one call of the backend's
    derivative and queues the finished weight and bias gradients (2 x C numbers per call), not
    the input."""

    @staticmethod
    def forward(
        ctx: Any,
        eps: float,
        momentum: float,
        running_stats: tuple[Tensor | None, Tensor | None],
        deferral: ParamDeferral,
        input: Tensor,
        weight_input: Tensor,
        bias_input: Tensor,
    ) -> Tensor:
        # `input` comes cast already (autocast's cast of it is differentiable); the parameters
        # are cast here, so the Function keeps its edges to them.
        weight, bias = param_from_input(weight_input), param_from_input(bias_input)
        _, (weight, bias) = as_autocast_casts("batch_norm", input, weight, bias)
        # The op torch.batch_norm runs, which picks the backend (cuDNN on CUDA where it can: the
        # native CUDA kernels' gradients were 2000x further from fp64 on ResNet-50, NCHW fp32).
        # It updates the running statistics in place, once per forward.
        output, save_mean, save_invstd, reserve, backend = torch._batch_norm_impl_index(
            input, weight, bias, *running_stats, True, momentum, eps, torch.backends.cudnn.enabled
        )
        if backend != _NATIVE:  # cuDNN's derivative takes the input as cuDNN's forward got it
            input = input.contiguous(memory_format=suggest_memory_format(input))
        ctx.eps, ctx.deferral, ctx.backend, ctx.running_stats = eps, deferral, backend, running_stats
        ctx.save_for_backward(input, weight, save_mean, save_invstd, reserve)
        if forward_ad._current_level >= 0:  # a dual level is open: jvp may be called
            ctx.save_for_forward(input, weight, bias)
        return output

    @staticmethod
    def jvp(ctx: Any, _eps: None, _momentum: None, _stats: None, _deferral: None, *tangents: Tensor) -> Tensor:
        """native_batch_norm's own forward derivative in training, taken on detached copies of
        the inputs at the open dual level (this Function's forward ran without forward AD)."""
        primals = ctx.saved_tensors  # input, weight, bias as the op saw them
        with forward_ad._set_fwd_grad_enabled(True):
            duals = [
                None if p is None else forward_ad.make_dual(p.detach(), t.to(p.dtype))
                for p, t in zip(primals, tangents, strict=True)
            ]
            input, weight, bias = duals
            assert input is not None
            output = torch.native_batch_norm(input, weight, bias, None, None, True, 0.0, ctx.eps)[0]
            tangent = forward_ad.unpack_dual(output).tangent
        return guard_tangent(tangent, primals)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        deferral: ParamDeferral = ctx.deferral
        weight_decision, bias_decision = deferral.decide(ctx)  # refuses create_graph=True
        input, weight, save_mean, save_invstd, reserve = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[4], weight_decision != "skip", bias_decision != "skip"
        grad_input = grad_weight = grad_bias = None
        if need_input or need_weight or need_bias:
            # Autograd's own derivative of the backend's op in training, all outputs at once.
            mask = [need_input, need_weight, need_bias]
            if ctx.backend == _NATIVE:
                # What _batch_norm_impl_index_backward runs for ATen's kernels, called directly:
                # that wrapper reads numel(), which Dynamo's fake tensors with a symbolic batch
                # refuse (compiled autograd, a compiled function calling backward).
                grad_input, grad_weight, grad_bias = torch.ops.aten.native_batch_norm_backward(
                    grad_output, input, weight, *ctx.running_stats, save_mean, save_invstd, True, ctx.eps, mask
                )
            else:  # cuDNN's derivative takes the gradient in the input's layout
                grad_output = grad_output.contiguous(memory_format=suggest_memory_format(input))
                if ctx.backend == _CUDNN:  # called directly too, for the same reason (input first)
                    grad_input, grad_weight, grad_bias = torch.ops.aten.cudnn_batch_norm_backward(
                        input, grad_output, weight, *ctx.running_stats, save_mean, save_invstd, ctx.eps, reserve
                    )
                else:
                    grad_input, grad_weight, grad_bias = torch.ops.aten._batch_norm_impl_index_backward(
                        ctx.backend, input, grad_output, weight, *ctx.running_stats, save_mean, save_invstd, True,
                        ctx.eps, mask, reserve,
                    )  # fmt: skip
        param_grads = deferral.defer_finished(
            ctx,
            [weight_decision, bias_decision],
            [grad_weight if need_weight else None, grad_bias if need_bias else None],
        )
        return (None, None, None, None, grad_input if need_input else None, *param_grads)


def _empty_batch_weight_grad(
    saved: Sequence[Tensor],
    grad_outputs: Sequence[Tensor],
    needs: Sequence[bool],
    *,
    shapes: tuple[torch.Size | None, ...],
) -> list[Tensor | None]:
    """The weight kernel of a call on an empty batch: what plain autograd gives, zeros."""
    zeros = grad_outputs[0].new_zeros
    return [zeros(shape) if need and shape is not None else None for shape, need in zip(shapes, needs, strict=True)]


_STATISTICS_AND_PARAMETERS = ("running_mean", "running_var", "weight", "bias")


def _check_num_features(input: Tensor, *tensors: Tensor | None) -> None:
    """torch.batch_norm's own checks, which native_batch_norm lacks: called directly with the
    wrong number of channels, it reads and writes past the end of the statistics. ``tensors``:
    running mean, running variance, weight, bias (positional: this runs on every call)."""
    channels = input.shape[1]
    for name, tensor in zip(_STATISTICS_AND_PARAMETERS, tensors, strict=True):
        if tensor is not None and tensor.numel() != channels:
            raise RuntimeError(f"{name} should contain {channels} elements not {tensor.numel()}")


@register((nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d))
def batch_norm(module: nn.modules.batchnorm._BatchNorm, input: Tensor) -> Tensor:
    """``_BatchNorm.forward`` in training mode (the only mode that reaches a deferred forward, but
    for a checkpoint's recomputation)."""
    if not module.training and (module.running_mean is not None or module.running_var is not None):
        refuse_recomputation_in_eval(module, "normalises by its running statistics")
    weight, bias = weight_and_bias(module)
    reason = unsupported_tensors(input, weight, bias)
    if reason is not None:
        return plain_forward(module, reason, input)
    module._check_input_dim(input)
    factor = 0.0 if module.momentum is None else module.momentum
    if module.training and module.track_running_stats and module.num_batches_tracked is not None:
        module.num_batches_tracked.add_(1)
        factor = 1.0 / float(module.num_batches_tracked) if module.momentum is None else module.momentum
    # F.batch_norm's own checks for training.
    F._verify_batch_size(input.size())  # type: ignore[attr-defined]  # private: absent from torch's stubs
    if module.eps <= 0.0:
        raise ValueError(f"batch_norm eps must be positive during training, but got {module.eps}")
    running_mean = module.running_mean if module.track_running_stats else None
    running_var = module.running_var if module.track_running_stats else None
    x, _ = as_autocast_casts("batch_norm", input)
    params = (weight, bias)
    if x.numel() == 0:
        # native_batch_norm refuses an empty batch; torch.batch_norm returns the input scaled by
        # weight[0] plus bias[0], running statistics untouched, and zero parameter gradients.
        output = torch.batch_norm(
            x, detached(weight), detached(bias), running_mean, running_var,
            True, factor, module.eps, torch.backends.cudnn.enabled,
        )
        shapes = tuple(None if p is None else p.shape for p in params)
        return defer_weight_grads(output, params, (), functools.partial(_empty_batch_weight_grad, shapes=shapes))
    _check_num_features(x, running_mean, running_var, weight, bias)
    if x.is_inference():  # refused before the kernel updates the running statistics, as plain's is
        raise RuntimeError(INFERENCE_TENSORS_SAVED)
    deferral = ParamDeferral.at_forward(params)
    # The running statistics go in a tuple: buffers updated in place, not inputs to differentiate.
    return _TrainingBatchNorm.apply(module.eps, factor, (running_mean, running_var), deferral, x, *param_inputs(params))
