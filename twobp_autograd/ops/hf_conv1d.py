"""Hugging Face's ``Conv1D`` (GPT-2's, GPT's: every projection of their attention and MLP): a
linear layer whose weight is stored ``(in, out)``, computed as ``addmm(bias, rows, weight)``.
This rule runs that very op as a Linear's rule runs its own (one autograd node whose backward
takes the input gradient by addmm's formula, or the op under autograd and a tap under autocast)
and queues ``x^T g`` and ``sum(g)``, joined over all queued micro-batches like a Linear's.

A class qualifies by its forward (see :mod:`.verdicts`): the installed ``Conv1D.forward``'s code,
which must compute exactly this rule's output (checked once). Register it:
``twobp.register(Conv1D, twobp_autograd.ops.hf_conv1d)``.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor, nn

from .fallback import plain_forward, unsupported_tensors
from .linear import deferred_rows_product
from .verdicts import Verdicts, judged_once, same_forward_code

__all__ = ["hf_conv1d", "computes_like_hf_conv1d"]


def hf_conv1d(module: nn.Module, x: Tensor) -> Tensor:
    """Deferred forward for a class that :func:`computes_like_hf_conv1d` (any other keeps its
    plain forward, with one warning)."""
    if not computes_like_hf_conv1d(type(module)):
        return plain_forward(module, "a forward other than Hugging Face's Conv1D's", x)
    weight, bias = cast(Tensor, module.weight), cast("Tensor | None", module.bias)
    reason = unsupported_tensors(x, weight, bias)
    if reason is not None:
        return plain_forward(module, reason, x)
    rows = x.view(-1, x.size(-1))  # as Conv1D.forward: a non-contiguous input fails as there
    output = deferred_rows_product(rows, weight, bias, transposed=True)
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
        ours = torch.addmm(bias, x.view(-1, 4), weight).view(2, 5, 3)  # what deferred_rows_product computes
        return expected.dtype == ours.dtype and torch.equal(expected, ours)
