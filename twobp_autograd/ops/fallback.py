"""Calls a deferred forward cannot take: the module's own forward runs instead, so autograd
computes that call's weight gradients in backward (correct, not deferred), with one warning
per module type and reason.

- complex tensors: the weight kernels and the flush's hand-over are written for real
  gradients (a complex weight gradient needs the conjugate, ``g^T conj(x)``);
- nested (jagged) tensors: the kernels take the batch as dim 0 of dense tensors;
- tensor subclasses with ``__torch_function__``: they reroute the functional op themselves.

The check runs inside each op, on tensors it has at hand anyway: a few attribute reads per call.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.overrides import has_torch_function_variadic

from ..warn_once import warn_once

__all__ = ["plain_forward", "unsupported_tensors"]


def unsupported_tensors(*tensors: Tensor | None) -> str | None:
    """Why a call with these tensors (inputs and parameters) cannot be deferred, or None."""
    for t in tensors:  # runs on every patched call: one pass, no allocations
        if t is not None and (t.is_nested or t.is_complex()):
            return "nested tensors" if t.is_nested else "complex tensors"
    if has_torch_function_variadic(*tensors):
        return "tensor subclasses that override __torch_function__"
    return None


def plain_forward(module: nn.Module, reason: str, *args: Any, **kwargs: Any) -> Any:
    """The class's forward (an instance forward would be the patched one, coming back here)."""
    warn_once(
        ("plain call", type(module), reason),
        f"twobp: {type(module).__name__} called with {reason} is not deferred; such calls keep "
        "plain autograd (correct gradients, computed in backward). To silence this, leave the "
        "module unpatched: twobp.patch(model, exclude=[...]).",
        stacklevel=3,
    )
    return type(module).forward(module, *args, **kwargs)
