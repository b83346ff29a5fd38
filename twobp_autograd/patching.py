"""Patch a model in place: each module whose exact type is registered gets an instance-level
``forward`` that defers its weight gradients. Class, parameters, buffers, ``state_dict``,
``repr`` and hooks are untouched (hooks run in ``__call__``, around ``forward``)."""

from __future__ import annotations

import fnmatch
import warnings
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import ops  # noqa: F401  (registers the built-in op families)
from .ddp_guard import check_not_inside_ddp, refuse_ddp_over_patched_models
from .grad_guard import install_grad_guards
from .registry import DeferredForward, module_class, rule_for

__all__ = ["patch", "unpatch", "PatchReport"]

Selector = type | str


@dataclass
class PatchReport:
    """What :func:`patch` did: qualified names of patched modules, and why others were not."""

    model: nn.Module
    patched: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"patched {len(self.patched)} modules, skipped {len(self.skipped)}"]
        lines += [f"  skipped {name or '<root>'}: {why}" for name, why in self.skipped.items()]
        return "\n".join(lines)


class DeferredForwardCall:
    """The instance ``forward`` of a patched module: the plain forward wherever no weight
    gradient can be wanted (no grad mode, inference mode, eval, frozen), autograd is not the
    one differentiating (inside a ``torch.func`` transform) or ``torch.export`` traces it, else
    the rule's."""

    def __init__(self, module: nn.Module, deferred: DeferredForward, original: Any) -> None:
        self.module = module
        self.deferred = deferred
        self.original = original  # an instance-level forward that was there before, or None

    def plain(self, *args: Any, **kwargs: Any) -> Any:
        if self.original is not None:
            return self.original(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        if (
            torch.is_grad_enabled()
            and module.training
            and _maybe_current_level() is None  # torch.func transforms differentiate by themselves
            and not _is_exporting()  # torch.export records the plain forward's ops
            and _wants_grad(module)
        ):
            return self.deferred(module, *args, **kwargs)
        return self.plain(*args, **kwargs)


_maybe_current_level = torch._C._functorch.maybe_current_level
_is_exporting = torch.compiler.is_exporting


def _wants_grad(module: nn.Module) -> bool:
    """Whether a parameter of the module requires grad: its own straight from the dict (this
    runs on every call), its children's too where it has some (MultiheadAttention's out_proj)."""
    for param in module.parameters() if module._modules else module._parameters.values():
        if param is not None and param.requires_grad:
            return True
    return False


def _selected(name: str, module: nn.Module, selectors: Iterable[Selector]) -> bool:
    return any(
        (isinstance(s, type) and module_class(module) is s) or (isinstance(s, str) and fnmatch.fnmatchcase(name, s))
        for s in selectors
    )


_warned: set[tuple[type, str]] = set()

#: Every module patched so far that is alive (those unpatched since are filtered by their forward).
_patched: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _is_patched(module: nn.Module) -> bool:
    return isinstance(module.__dict__.get("forward"), DeferredForwardCall)


def patch(
    model: nn.Module,
    *,
    include: Iterable[Selector] | None = None,
    exclude: Iterable[Selector] | None = None,
    report: bool = False,
) -> Any:
    """Defer the weight gradients of every registered module of ``model``, in place.

    ``include`` / ``exclude`` take module types (exact) and qualified-name patterns
    (``fnmatch``, e.g. ``"layer4.*"``). Returns ``model``, or a :class:`PatchReport` when
    ``report=True``. Patching twice changes nothing.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"patch expects an nn.Module, got {type(model).__name__}")
    include = list(include) if include is not None else None
    exclude = list(exclude or ())
    check_not_inside_ddp(model)
    install_grad_guards()
    refuse_ddp_over_patched_models(_is_patched, lambda: [m for m in list(_patched) if _is_patched(m)])
    result = PatchReport(model)
    for name, module in model.named_modules():
        if include is not None and not _selected(name, module, include):
            continue
        if _selected(name, module, exclude):
            continue
        if _is_patched(module):
            # Patched before (its class may have changed since: a parametrization's subclass).
            result.patched.append(name)
            continue
        rule = rule_for(module)
        if rule is None:
            if any(True for _ in module.parameters(recurse=False)):
                result.skipped[name] = f"{type(module).__name__} is not registered (plain autograd)"
            continue
        reason = rule.unsupported(module)
        if reason is not None:
            result.skipped[name] = reason
            if (type(module), reason) not in _warned:
                _warned.add((type(module), reason))
                warnings.warn(
                    f"twobp: {type(module).__name__} with {reason} is not deferred; it keeps plain "
                    "autograd (correct gradients, computed in backward).",
                    stacklevel=2,
                )
            continue
        current = module.__dict__.get("forward")
        if not isinstance(current, DeferredForwardCall):
            module.forward = DeferredForwardCall(module, rule.forward, current)
            _patched.add(module)
        result.patched.append(name)
    if not result.patched:
        _warn_nothing_covered(model, result)
    return result if report else model


def _warn_nothing_covered(model: nn.Module, result: PatchReport) -> None:
    """A model none of whose layers is of a registered type defers nothing: say so once per
    root type and layer types (a stage that ``torch.distributed.pipelining.pipeline()`` traced holds
    ``InterpreterModule``s calling ATen ops, no nn.Linear left to patch)."""
    reasons = result.skipped.values()
    unregistered = sorted({why.split(" is not registered")[0] for why in reasons if "is not registered" in why})
    key = (type(model), ", ".join(unregistered))
    if not unregistered or key in _warned:
        return
    _warned.add(key)
    warnings.warn(
        f"twobp: patch() found no layer it covers in this {type(model).__name__} (its parameters sit "
        f"in {', '.join(unregistered[:4])}): nothing is deferred. Register a rule for such layers "
        "(twobp.register), or patch the model built from nn.Linear, nn.Conv*, norm, attention and "
        "embedding modules (a pipeline stage traced by torch.distributed.pipelining.pipeline() "
        "calls ATen ops instead: build the stages from your own modules).",
        stacklevel=3,
    )


def unpatch(model: nn.Module) -> nn.Module:
    """Restore plain autograd on every patched module of ``model``. Returns ``model``."""
    for module in model.modules():
        current = module.__dict__.get("forward")
        if isinstance(current, DeferredForwardCall):
            if current.original is None:
                del module.forward
            else:
                module.forward = current.original
    return model
