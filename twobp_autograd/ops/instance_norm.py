"""nn.InstanceNorm1d/2d/3d with ``affine=True``: the forward runs the ops ``torch.instance_norm``
runs (``batch_norm`` over the samples' channels as one sample's), with the parameters detached,
so the output, the input gradient and the running statistics (``track_running_stats=True``) are
PyTorch's own. The weight kernel is batch norm's own derivative on that view too, summed over
the samples as the repeated weight's gradient is: it sums dy * (x - mean), where group norm's
sums dy * x and dy apart and loses a channel of small spread around a large mean to
cancellation (a constant channel's weight gradient, 0 in plain, came out as noise times
1/sqrt(eps)). The per-(sample, channel) statistics are recomputed at the flush from the saved
input by the forward's own kernel (batch_norm keeps them to itself), off the backward's critical
path (under the user's saved-tensor hooks they are saved, as plain saves its own). Each sample
is normalised on its own: queued micro-batches concatenate on the batch dimension.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..checkpoint_paths import saved_through_user_hooks
from ..deferral import configured_kernel, defer_weight_grads, detached
from ..registry import register, weight_and_bias
from .autocast import as_autocast_casts
from .fallback import plain_forward, unsupported_tensors
from .precision import accumulation_dtype, affine_dtype, unit_weight

__all__ = ["instance_norm", "instance_norm_weight_grad"]


def instance_norm_weight_grad(
    saved: Sequence[Tensor],
    grad_outputs: Sequence[Tensor],
    needs: Sequence[bool],
    *,
    eps: float,
    weight_dtype: torch.dtype,
) -> list[Tensor | None]:
    input, *statistics = saved  # (N, C, *), as the forward normalised it; (N, C) mean and 1/std
    batch, channels = input.shape[:2]
    accumulate = accumulation_dtype(weight_dtype)
    if input.numel() == 0:  # no element to sum (an empty length): batch norm's kernels refuse it
        return [input.new_zeros(channels, dtype=accumulate) if need else None for need in needs]
    as_one_sample = _as_one_sample(input)
    # Its values are not read; its dtype is the forward's weight's (fp32 beside a bf16 input makes
    # the kernels' mixed-dtype statistics, as plain's).
    weight = unit_weight(as_one_sample, batch * channels, weight_dtype)
    mean, invstd = [t.reshape(-1) for t in statistics] if statistics else _statistics(as_one_sample, weight_dtype, eps)
    # batch_norm's output gradient, (1, N * C, *) per micro-batch (joined: (k, N * C, *)).
    grad = grad_outputs[0].reshape(as_one_sample.shape)
    _, *per_sample = torch.ops.aten.native_batch_norm_backward(
        grad, as_one_sample, weight, None, None, mean, invstd, True, eps, [False, *needs]
    )
    return [None if g is None else g.view(batch, channels).sum(0, dtype=accumulate) for g in per_sample]


def _as_one_sample(input: Tensor) -> Tensor:
    """(N, C, *) as the (1, N * C, *) batch_norm normalises."""
    batch, channels, *spatial = input.shape
    return input.contiguous().view(1, batch * channels, *spatial)


def _statistics(as_one_sample: Tensor, weight_dtype: torch.dtype, eps: float) -> list[Tensor]:
    """Each (sample, channel)'s mean and 1/std as batch_norm's forward saves them: by its own
    kernel (whose output is not needed), given a weight of the forward's dtype, so the weight
    gradient sums what plain's does."""
    weight = unit_weight(as_one_sample, as_one_sample.shape[1], weight_dtype)
    with torch.no_grad():
        _, mean, invstd = torch.native_batch_norm(as_one_sample, weight, None, None, None, True, 0.0, eps)
    return [mean, invstd]


def _repeated(tensor: Tensor | None, times: int) -> Tensor | None:
    return None if tensor is None else tensor.repeat(times)


@register((nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d))
def instance_norm(module: nn.modules.instancenorm._InstanceNorm, input: Tensor) -> Tensor:
    """``_InstanceNorm.forward`` (an ``affine=False`` module has no parameters and is never
    called here: it runs its own forward)."""
    params = weight_and_bias(module)
    reason = unsupported_tensors(input, *params)
    if reason is not None:
        return plain_forward(module, reason, input)
    # The module's own checks, in its order: the input's rank, then its channels.
    module._check_input_dim(input)
    unbatched = input.dim() == module._get_no_batch_dim()
    x = input.unsqueeze(0) if unbatched else input
    if x.size(1) != module.num_features:
        raise ValueError(
            f"expected input's size at dim={input.dim() - module._get_no_batch_dim()} to match num_features"
            f" ({module.num_features}), but got: {x.size(1)}."
        )
    use_input_stats = module.training or not module.track_running_stats
    if use_input_stats:
        F._verify_spatial_size(x.size())  # type: ignore[attr-defined]  # private: absent from torch's stubs
    x, (weight, bias) = as_autocast_casts("instance_norm", x, *map(detached, params))
    # torch.instance_norm's composite, spelled out: batch_norm over the samples' channels as one
    # sample's (the parameters and running statistics repeated), its statistics averaged back into
    # the buffers, its output viewed in the input's shape. So the tap takes batch_norm's output,
    # not the view instance_norm returns (a view's re-parenting makes autograd copy every output
    # gradient and rebuild the view's grad_fn), and the buffers are written after the tap saved
    # its tensors, as instance_norm writes them after batch_norm saved its own: a non-reentrant
    # checkpoint's recomputation stops at the region's last saved tensor, so where that is this
    # layer's it does not update them a second time (plain's does not).
    batch, channels = x.shape[:2]
    running_mean, running_var = (_repeated(t, batch) for t in (module.running_mean, module.running_var))
    contiguous = x.contiguous()  # one copy, normalised and saved, where x is not contiguous
    output = torch.batch_norm(
        contiguous.view(1, batch * channels, *x.shape[2:]),
        _repeated(weight, batch),
        _repeated(bias, batch),
        running_mean,
        running_var,
        use_input_stats,
        module.momentum if module.momentum is not None else 0.0,
        module.eps,
        torch.backends.cudnn.enabled,
    )
    weight_dtype = affine_dtype(weight, bias)  # as batch_norm got them (autocast's cast)
    kernel, group = configured_kernel(instance_norm_weight_grad, eps=module.eps, weight_dtype=weight_dtype)
    # The input saved as plain's batch_norm saves it: a view of it, or of the contiguous copy
    # instance_norm made of it. Changed in place before backward, it makes backward raise as
    # plain's does; a copy is not the input (an input changed after the forward trains, as plain).
    # Under the user's saved-tensor hooks the statistics too, as plain saves them: a lossy pack
    # hands back other values than the flush would recompute from the unpacked input.
    # Shaped (N, C): every saved tensor holds the samples on dim 0, where micro-batches join.
    if saved_through_user_hooks():
        statistics = _statistics(_as_one_sample(contiguous), weight_dtype, module.eps)
        saved: tuple[Tensor, ...] = (contiguous, *(t.view(batch, channels) for t in statistics))
    else:
        saved = (contiguous,)
    output = defer_weight_grads(output, params, saved, kernel, group=group).view(x.shape)
    with torch.no_grad():
        for buffer, repeated in ((module.running_mean, running_mean), (module.running_var, running_var)):
            if buffer is not None and repeated is not None:
                buffer.copy_(repeated.view(batch, channels).mean(0))
    return output.squeeze(0) if unbatched else output
