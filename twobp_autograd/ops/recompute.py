"""A generic rule for any module whose forward treats the samples of a batch independently
(norms like Hugging Face's ``LlamaRMSNorm``, scalings, small MLP blocks): the forward runs with
the parameters detached, and the flush re-runs it once on all queued micro-batches
concatenated, with the parameters as leaves, to take their vector-Jacobian product.

It costs one extra forward of the module per flush, and is wrong for modules that mix samples
(BatchNorm in training): register an exact rule for those.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.stateless import _reparametrize_module

from ..deferral import defer_weight_grads
from .fallback import plain_forward, unsupported_tensors

__all__ = ["recompute"]


def _plain_forward(module: nn.Module, inputs: Sequence[Tensor], params: dict[str, Tensor]) -> tuple[Tensor, ...]:
    with _reparametrize_module(module, params):
        # The class's forward: a patched instance forward would come back here.
        output = type(module).forward(module, *inputs)
    return (output,) if isinstance(output, Tensor) else tuple(output)


def recompute_weight_grad(
    saved: Sequence[Tensor], grad_outputs: Sequence[Tensor], needs: Sequence[bool], *, module: nn.Module
) -> list[Tensor | None]:
    names = [name for name, _ in module.named_parameters()]
    with torch.enable_grad():
        named = module.named_parameters()
        leaves = {n: p.detach().requires_grad_(need) for (n, p), need in zip(named, needs, strict=True)}
        outputs = _plain_forward(module, [t.detach() for t in saved], leaves)
        wanted = [leaves[n] for n, need in zip(names, needs, strict=True) if need]
        grads = iter(torch.autograd.grad(outputs, wanted, grad_outputs[: len(outputs)], allow_unused=True))
    return [next(grads) if need else None for need in needs]


def recompute(module: nn.Module, *inputs: Any, **kwargs: Any) -> Any:
    """Deferred forward for ``register(MyModule, recompute)``: positional tensor inputs with
    the batch on dim 0. Other calls keep plain autograd (with one warning per module type)."""
    params = dict(module.named_parameters())
    if kwargs or not inputs or not all(isinstance(t, Tensor) and t.dim() > 0 for t in inputs):
        reason: str | None = "keyword, non-tensor or 0-d arguments (recompute needs positional batched tensors)"
    else:
        reason = unsupported_tensors(*inputs, *params.values())
    if reason is not None:
        return plain_forward(module, reason, *inputs, **kwargs)
    outputs = _plain_forward(module, inputs, {n: p.detach() for n, p in params.items()})
    kernel = functools.partial(recompute_weight_grad, module=module)
    tapped = defer_weight_grads(outputs, tuple(params.values()), inputs, kernel)
    return tapped
