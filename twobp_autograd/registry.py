"""Module type -> deferred forward. Keyed by the *exact* type: a subclass may change what its
forward computes, so it keeps plain autograd until it is registered itself."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["DeferredForward", "Rule", "register", "rule_for"]

#: ``forward(module, *args, **kwargs)``: the module's forward, computing the output with the
#: parameters detached and handing them to :func:`twobp_autograd.deferral.defer_weight_grads`.
DeferredForward = Callable[..., Any]


@dataclass(frozen=True)
class Rule:
    forward: DeferredForward
    #: Returns why a module's configuration cannot be deferred (it then keeps plain
    #: autograd, with one warning), or None.
    unsupported: Callable[[nn.Module], "str | None"]


_rules: dict[type, Rule] = {}


def _always_supported(module: nn.Module) -> None:
    return None


def register(
    module_type: type,
    forward: "DeferredForward | None" = None,
    *,
    unsupported: "Callable[[nn.Module], str | None] | None" = None,
) -> Any:
    """Register how ``module_type`` defers its weight gradients.

    As a decorator, ``@register(MyNorm)`` on ``def forward(module, *args, **kwargs)``; or
    directly, ``register(MyNorm, twobp_autograd.ops.recompute)`` for a module whose forward
    treats the samples of a batch independently (see :func:`twobp_autograd.ops.recompute`).
    """
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"register expects an nn.Module subclass, got {module_type!r}")

    def decorator(fn: DeferredForward) -> DeferredForward:
        if not callable(fn):
            raise TypeError(f"register({module_type.__name__}) needs a callable forward, got {fn!r}")
        _rules[module_type] = Rule(fn, unsupported or _always_supported)
        return fn

    return decorator if forward is None else decorator(forward)


def rule_for(module: nn.Module) -> "Rule | None":
    return _rules.get(type(module))
