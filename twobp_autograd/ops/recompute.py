"""A generic rule for any module whose forward treats the samples of a batch independently
(norms like Hugging Face's ``LlamaRMSNorm``, scalings, small MLP blocks): the forward runs with
the parameters detached, and the flush re-runs it once on all queued micro-batches
concatenated, with the parameters as leaves, to take their vector-Jacobian product.

It costs one extra forward of the module per flush, and is wrong for modules that mix samples
(BatchNorm in training): register an exact rule for those. A forward that draws random numbers
(dropout) cannot be replayed at the flush, which runs later and on joined micro-batches: such a
call is run again on plain autograd from the same random state (so its output is plain's), and
the module keeps plain autograd from then on, with one warning.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils.checkpoint import get_device_states, set_device_states

from ..deferral import defer_weight_grads, detached
from .fallback import plain_forward, unsupported_tensors

__all__ = ["recompute"]


def _plain_forward(module: nn.Module, inputs: Sequence[Tensor], params: dict[str, Tensor]) -> tuple[Tensor, ...]:
    with _reparametrize_module(module, params):
        # The class's forward: a patched instance forward would come back here.
        output = type(module).forward(module, *inputs)
    return (output,) if isinstance(output, Tensor) else tuple(output)


def recompute_weight_grad(
    saved: Sequence[Tensor],
    grad_outputs: Sequence[Tensor],
    needs: Sequence[bool],
    *,
    module: nn.Module,
    params: tuple[tuple[str, Tensor], ...],
) -> list[Tensor | None]:
    """``params`` are those the forward computed with (under ``torch.func.functional_call``
    other tensors than the module's own, which it holds again by the flush)."""
    with torch.enable_grad():
        leaves = {n: p.detach().requires_grad_(need) for (n, p), need in zip(params, needs, strict=True)}
        outputs = _plain_forward(module, [t.detach() for t in saved], leaves)
        wanted = [leaves[n] for (n, _), need in zip(params, needs, strict=True) if need]
        grads = iter(torch.autograd.grad(outputs, wanted, grad_outputs[: len(outputs)], allow_unused=True))
    return [next(grads) if need else None for need in needs]


_RANDOM = "dropout or other random draws in its forward (the flush's recomputation cannot replay them)"

#: Modules whose forward was seen drawing random numbers: they keep plain autograd.
_random_modules: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def recompute(module: nn.Module, *inputs: Any, **kwargs: Any) -> Any:
    """Deferred forward for ``register(MyModule, recompute)``: positional tensor inputs with
    the batch on dim 0. Other calls keep plain autograd (with one warning per module type)."""
    params = dict(module.named_parameters())
    if kwargs or not inputs or not all(isinstance(t, Tensor) and t.dim() > 0 for t in inputs):
        reason: str | None = "keyword, non-tensor or 0-d arguments (recompute needs positional batched tensors)"
    elif module in _random_modules:
        reason = _RANDOM
    else:
        reason = unsupported_tensors(*inputs, *params.values())
    if reason is not None:
        return plain_forward(module, reason, *inputs, **kwargs)
    tensors = (*inputs, *params.values())
    cpu_state, (devices, device_states) = torch.get_rng_state(), get_device_states(*tensors)
    # Leaves detached, so their gradients wait for the flush; others (functional_call's computed
    # substitutes) keep their graph and are differentiated at once, as plain autograd does.
    outputs = _plain_forward(module, inputs, {n: detached(p) for n, p in params.items()})
    if _random_numbers_drawn(cpu_state, device_states, tensors):
        _random_modules.add(module)
        # The same draws again, so the output is the one plain autograd computes (and the
        # generators end where one plain forward leaves them).
        torch.set_rng_state(cpu_state)
        set_device_states(devices, device_states)
        return plain_forward(module, _RANDOM, *inputs)
    kernel = functools.partial(recompute_weight_grad, module=module, params=tuple(params.items()))
    # Grouped per module (the flush groups per parameter tensors too): the partial holds tensors,
    # which must not be compared as a group key.
    return defer_weight_grads(outputs, tuple(params.values()), inputs, kernel, group=(recompute_weight_grad, module))


def _random_numbers_drawn(cpu_state: Tensor, device_states: list[Tensor], tensors: Sequence[Tensor]) -> bool:
    """Whether the CPU generator, or that of a device ``tensors`` live on, moved since those states."""
    if not torch.equal(torch.get_rng_state(), cpu_state):
        return True
    _, now = get_device_states(*tensors)
    return any(not torch.equal(a, b) for a, b in zip(now, device_states, strict=True))
