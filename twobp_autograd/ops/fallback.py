"""Calls a deferred forward cannot take: the module's own forward runs instead, so autograd
computes that call's weight gradients in backward (correct, not deferred), with one warning
per module type and reason.

- complex tensors: the weight kernels and the flush's hand-over are written for real
  gradients (a complex weight gradient needs the conjugate, ``g^T conj(x)``);
- nested (jagged) tensors: the kernels take the batch as dim 0 of dense tensors;
- mkldnn tensors (``to_mkldnn()``): the weight kernels' products have no mkldnn kernel;
- tensor subclasses with ``__torch_function__``: they reroute the functional op themselves.

The check runs inside each op, on tensors it has at hand anyway: a few attribute reads per call.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import _get_current_function_mode_stack, has_torch_function_variadic
from torch.utils._device import DeviceContext

from ..checkpoint_paths import took_plain
from ..warn_once import warn_once

__all__ = ["plain_forward", "unsupported_tensors", "warn_plain_call"]


def unsupported_tensors(*tensors: Tensor | None) -> str | None:
    """Why a call with these tensors (inputs and parameters) cannot be deferred, or None."""
    if not has_torch_function_variadic(*tensors):
        return _nested_or_complex(tensors)
    # A subclass's __torch_function__ may refuse even attribute reads (ExpandedWeights, put in
    # as parameters by call_for_per_sample_grads or Opacus' "ew" mode): read them past it.
    with torch._C.DisableTorchFunctionSubclass():
        reason = _nested_or_complex(tensors)
    if reason is None and (_overriding_subclass(tensors) or not _only_device_modes()):
        return "tensor subclasses that override __torch_function__"
    return reason


def _nested_or_complex(tensors: tuple[Tensor | None, ...]) -> str | None:
    for t in tensors:  # runs on every patched call: one pass, no allocations
        if t is not None and (t.is_nested or t.is_complex() or t.is_mkldnn):
            return "nested tensors" if t.is_nested else "complex tensors" if t.is_complex() else "mkldnn tensors"
    return None


def _only_device_modes() -> bool:
    """Whether every active torch-function mode is a default device (``torch.set_default_device``,
    ``with torch.device(...)``): those only fill in factory functions' ``device``, which the
    deferred forwards never leave to them."""
    return all(isinstance(mode, DeviceContext) for mode in _get_current_function_mode_stack())


def _overriding_subclass(tensors: tuple[Tensor | None, ...]) -> bool:
    plain = (Tensor.__torch_function__, torch._C._disabled_torch_function_impl)
    return any(
        t is not None and type(t) is not Tensor and getattr(type(t), "__torch_function__", None) not in plain
        for t in tensors
    )


def plain_forward(module: nn.Module, reason: str, *args: Any, **kwargs: Any) -> Any:
    """The class's forward (an instance forward would be the patched one, coming back here)."""
    warn_plain_call(module, reason, stacklevel=4)
    took_plain(module)
    return type(module).forward(module, *args, **kwargs)


def warn_plain_call(module: nn.Module, reason: str, *, stacklevel: int = 3) -> None:
    """The one warning per module type and reason that its calls keep plain autograd."""
    warn_once(
        ("plain call", type(module), reason),
        f"twobp: {type(module).__name__} called with {reason} is not deferred; such calls keep "
        "plain autograd (correct gradients, computed in backward). To silence this, leave the "
        "module unpatched: twobp.patch(model, exclude=[...]).",
        stacklevel=stacklevel,
    )
