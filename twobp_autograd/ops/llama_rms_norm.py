"""Hugging Face's ``LlamaRMSNorm`` and the classes that copy its forward (Mistral's, Qwen2's,
Mamba's, ...): ``weight * (x in fp32 scaled by 1/rms, cast back to x's dtype)``.

The generic :func:`~twobp_autograd.ops.recompute` rule defers such a norm by re-running its
forward under a reparametrization at every call and once more under autograd at the flush: a
few hundred microseconds of Python per call. This rule runs the same ops with the weight
detached and keeps ``x_hat``, the tensor plain autograd saves for the weight's product (so
memory until backward is plain's); the flush takes ``sum(grad * x_hat)`` over all queued rows,
the very ops of plain autograd's weight gradient, with nothing recomputed.

Which classes qualify is decided on what their forward *is*, never on their name (Gemma's
RMSNorm scales by ``1 + weight``): the same code as the installed ``LlamaRMSNorm.forward``,
which itself must compute exactly what this rule computes, checked once per process bit for
bit. A class that fails either check keeps its plain forward (one warning), so a change on
either side costs speed, never a gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import Tensor, nn

from ..deferral import defer_weight_grads, detached
from .fallback import plain_forward, unsupported_tensors
from .precision import accumulation_dtype
from .verdicts import Verdicts, judged_once, same_forward_code

__all__ = ["llama_rms_norm", "computes_like_llama_rms_norm", "llama_rms_norm_weight_grad"]


def _normalized(x: Tensor, eps: float) -> Tensor:
    """``x_hat``: x in fp32 over its root mean square along the last dim, back in x's dtype."""
    upcast = x.to(torch.float32)
    return (upcast * torch.rsqrt(upcast.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def llama_rms_norm_weight_grad(
    saved: Sequence[Tensor], grad_outputs: Sequence[Tensor], needs: Sequence[bool]
) -> list[Tensor | None]:
    """``weight * x_hat``'s weight gradient: ``grad * x_hat`` summed over all rows (bf16/fp16
    products summed in fp32, see :mod:`.precision`). ``saved`` holds ``x_hat``'s rows."""
    if not needs[0]:
        return [None]
    (normalized_rows,) = saved
    product = grad_outputs[0].reshape(normalized_rows.shape) * normalized_rows
    return [product.sum(0, dtype=accumulation_dtype(product.dtype))]


def llama_rms_norm(module: nn.Module, hidden_states: Tensor) -> Tensor:
    """Deferred forward for a class that :func:`computes_like_llama_rms_norm` (any other keeps
    its plain forward, with one warning): ``twobp.register(LlamaRMSNorm, llama_rms_norm)``.
    Its argument keeps Hugging Face's name: callers may pass it by keyword."""
    weight = cast(Tensor, module.weight)
    if not computes_like_llama_rms_norm(type(module)):
        return plain_forward(module, "a forward other than LlamaRMSNorm's", hidden_states)
    reason = unsupported_tensors(hidden_states, weight)
    if reason is None and weight.shape != hidden_states.shape[-1:]:
        # A weight that broadcasts ((1, H), or one value for all features) gets a gradient of
        # its own shape from plain autograd; the kernel sums rows to one value per feature.
        reason = "a weight other than one value per feature of the input's last dim"
    if reason is not None:
        return plain_forward(module, reason, hidden_states)
    eps = float(cast(float, module.variance_epsilon))
    normalized = _normalized(hidden_states, eps)
    output = detached(weight) * normalized
    # As rows: concatenated on dim 0 they stay rows, whatever each call's leading dims were.
    normalized_rows = normalized.reshape(-1, normalized.shape[-1])
    return defer_weight_grads(output, (weight,), (normalized_rows,), llama_rms_norm_weight_grad)


def computes_like_llama_rms_norm(module_type: type) -> bool:
    """Whether ``module_type.forward`` is the installed ``LlamaRMSNorm.forward`` (same code) and
    that forward computes exactly :func:`llama_rms_norm`'s output (checked once)."""
    return judged_once(module_type, _verdicts, _computes_like_llama)


#: A class whose forward (or its code) is replaced since, by a Gemma-style ``1 + weight``, is judged again.
_verdicts: Verdicts = {}


def _computes_like_llama(module_type: type) -> bool:
    reference = _llama_rms_norm_class()
    return reference is not None and same_forward_code(module_type, reference) and _llama_matches_this_rule(reference)


def _llama_rms_norm_class() -> type[nn.Module] | None:
    try:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
    except ImportError:
        return None
    return LlamaRMSNorm


def _llama_matches_this_rule(reference: type[nn.Module]) -> bool:
    """Bit for bit, on random weights and inputs, fp32 and bf16 inputs with an fp32 weight."""
    generator = torch.Generator().manual_seed(0)
    with torch.device("cpu"):  # on the CPU whatever default device the first call runs under (meta)
        return _llama_matches_on_cpu(reference, generator)


def _llama_matches_on_cpu(reference: type[nn.Module], generator: torch.Generator) -> bool:
    try:
        norm = reference(16, eps=1e-5)
    except TypeError:
        return False
    weight = cast(Tensor, norm.weight)
    with torch.no_grad():
        weight.copy_(torch.randn(16, generator=generator))
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(3, 5, 16, generator=generator) * 3).to(dtype)
            expected, ours = norm(x), weight * _normalized(x, 1e-5)
            if expected.dtype != ours.dtype or not torch.equal(expected, ours):
                return False
    return True
