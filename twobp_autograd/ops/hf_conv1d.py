"""Hugging Face's ``Conv1D`` (GPT-2's, GPT's: every projection of their attention and MLP): a
linear layer whose weight is stored ``(in, out)``, computed as ``addmm(bias, rows, weight)``.
This rule runs that very op with the parameters detached (autograd takes the input gradient
through it, as in plain) and queues ``x^T g`` and ``sum(g)``, joined over all queued micro-batches
like a Linear's.

A class qualifies by its forward (see :mod:`.verdicts`): the installed ``Conv1D.forward``'s code,
which must compute exactly this rule's output (checked once). Register it:
``twobp.register(Conv1D, twobp_autograd.ops.hf_conv1d)``.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor, nn

from ..deferral import configured_kernel, defer_weight_grads, detached
from .fallback import plain_forward, unsupported_tensors
from .linear import linear_weight_grad
from .verdicts import Verdicts, judged_once, same_forward_code

__all__ = ["hf_conv1d", "computes_like_hf_conv1d"]


def _product(x: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """The rows and the 2-D product, as ``Conv1D.forward`` computes them (``view``: a
    non-contiguous input fails as it does there)."""
    rows = x.view(-1, x.size(-1))
    return rows, torch.addmm(bias, rows, weight)  # type: ignore[arg-type]  # bias None fails as in Conv1D


def hf_conv1d(module: nn.Module, x: Tensor) -> Tensor:
    """Deferred forward for a class that :func:`computes_like_hf_conv1d` (any other keeps its
    plain forward, with one warning)."""
    if not computes_like_hf_conv1d(type(module)):
        return plain_forward(module, "a forward other than Hugging Face's Conv1D's", x)
    weight, bias = cast(Tensor, module.weight), cast("Tensor | None", module.bias)
    reason = unsupported_tensors(x, weight, bias)
    if reason is not None:
        return plain_forward(module, reason, x)
    rows, output = _product(x, detached(weight), detached(bias))
    # Saved in the dtype the product ran in (autocast's), only for a weight that needs a gradient.
    saved = (rows.detach().to(output.dtype),) if weight.requires_grad else ()
    kernel, group = configured_kernel(linear_weight_grad, transposed=True)
    output = defer_weight_grads(output, (weight, bias), saved, kernel, group=group)
    return output.view(*x.size()[:-1], cast(int, module.nf))  # as Conv1D.forward shapes it (a stale nf fails there)


def computes_like_hf_conv1d(module_type: type) -> bool:
    """Whether ``module_type.forward`` is the installed ``Conv1D.forward`` (same code) and that
    forward computes exactly :func:`hf_conv1d`'s output (checked once)."""
    return judged_once(module_type, _verdicts, _computes_like_conv1d)


_verdicts: Verdicts = {}


def _computes_like_conv1d(module_type: type) -> bool:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return False
    return same_forward_code(module_type, Conv1D) and _conv1d_matches_this_rule(Conv1D)


def _conv1d_matches_this_rule(reference: type[nn.Module]) -> bool:
    """Bit for bit on random weights and a 3-D input, on the CPU whatever the default device."""
    generator = torch.Generator().manual_seed(0)
    with torch.device("cpu"), torch.no_grad():
        try:
            layer = reference(3, 4)  # nf (out), nx (in)
        except TypeError:
            return False
        weight, bias = cast(Tensor, layer.weight), cast(Tensor, layer.bias)
        if weight.shape != (4, 3):
            return False
        weight.copy_(torch.randn(4, 3, generator=generator))
        bias.copy_(torch.randn(3, generator=generator))
        x = torch.randn(2, 5, 4, generator=generator)
        expected = layer(x)
        ours = _product(x, weight, bias)[1].view(2, 5, 3)
        return expected.dtype == ours.dtype and torch.equal(expected, ours)
