"""What autocast does to the norms. Each norm's deferred forward calls the native op underneath
the public one its module calls, and autocast may list the native op differently (or not at
all): so the forwards apply the public op's cast themselves, learnt once per device and dtype
by running the public op on a tiny tensor."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["AUTOCAST_PROBES", "autocast_target", "as_autocast_casts"]

_any_autocast_enabled = torch._C._is_any_autocast_enabled

#: The public op each norm family's module calls, by the name its forward asks for.
AUTOCAST_PROBES: dict[str, Callable[[Tensor], Tensor]] = {
    "batch_norm": lambda x: F.batch_norm(x, None, None, training=True),
    "layer_norm": lambda x: F.layer_norm(x, (1,)),
    "group_norm": lambda x: F.group_norm(x, 1),
    "rms_norm": lambda x: F.rms_norm(x, (1,)),
    "instance_norm": lambda x: F.instance_norm(x.view(1, 1, 2)),
}


@functools.cache
def autocast_target(op: str, device_type: str, fast_dtype: torch.dtype) -> torch.dtype | None:
    """float32 if autocast runs ``op`` in float32, ``fast_dtype`` if in the fast dtype, None if
    it leaves the op alone (the case of every norm under CPU autocast)."""
    probe = AUTOCAST_PROBES[op]

    def output_dtype(dtype: torch.dtype) -> torch.dtype:
        with torch.no_grad():
            return probe(torch.ones(2, 1, dtype=dtype, device=device_type)).dtype

    if fast_dtype != torch.float32 and output_dtype(fast_dtype) == torch.float32:
        return torch.float32
    if output_dtype(torch.float32) == fast_dtype:
        return fast_dtype
    return None


def as_autocast_casts(op: str, input: Tensor, *params: Tensor | None) -> tuple[Tensor, list[Tensor | None]]:
    """The input and parameters as autocast would hand them to ``op``: every floating tensor but
    float64 cast to the op's autocast dtype (differentiably for the input, as autocast's cast is)."""
    if not _any_autocast_enabled():  # one call, where the check per device type costs a few µs per norm
        return input, list(params)
    device_type = input.device.type
    if not torch.is_autocast_enabled(device_type):
        return input, list(params)
    # Dynamo traces past a cache and warns every user that it does: call the function itself there.
    find = autocast_target.__wrapped__ if torch.compiler.is_compiling() else autocast_target
    target = find(op, device_type, torch.get_autocast_dtype(device_type))
    if target is None:
        return input, list(params)

    def cast(t: Tensor) -> Tensor:
        return t.to(target) if t.is_floating_point() and t.dtype != torch.float64 else t

    return cast(input), [None if p is None else cast(p) for p in params]
