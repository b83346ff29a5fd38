"""Patch a model in place: each module whose exact type is registered gets an instance-level
``forward`` that defers its weight gradients. Class, parameters, buffers, ``state_dict``,
``repr`` and hooks are untouched (hooks run in ``__call__``, around ``forward``)."""

from __future__ import annotations

import fnmatch
import functools
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import ops  # noqa: F401  (registers the built-in op families)
from .ddp_guard import check_not_inside_ddp, refuse_ddp_over_patched_models
from .queue import WeightGradQueue, queues_with_work
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
    gradient can be wanted (no grad mode, inference mode, eval, frozen) or autograd is not the
one differentiating (inside a ``torch.func`` transform), else the rule's."""

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
            and _wants_grad(module)
        ):
            return self.deferred(module, *args, **kwargs)
        return self.plain(*args, **kwargs)


_maybe_current_level = torch._C._functorch.maybe_current_level


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
    _install_optimizer_guard()
    result = PatchReport(model)
    for name, module in model.named_modules():
        if include is not None and not _selected(name, module, include):
            continue
        if _selected(name, module, exclude):
            continue
        if isinstance(module.__dict__.get("forward"), DeferredForwardCall):
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
        result.patched.append(name)
    return result if report else model


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


_guard_installed = False

#: Further ways the step guard finds work queued for an optimizer's parameters,
#: ``finder(params, queues_with_work) -> bool`` (twobp_autograd.fsdp: work queued on the
#: unsharded stand-ins of FSDP2-sharded parameters).
queued_work_finders: list[Callable[[list[torch.Tensor], list[WeightGradQueue]], bool]] = []


def _install_optimizer_guard() -> None:
    global _guard_installed
    if not _guard_installed:
        register_optimizer_step_pre_hook(_refuse_step_with_queued_work)
        refuse_ddp_over_patched_models(lambda m: isinstance(m.__dict__.get("forward"), DeferredForwardCall))
        _guard_installed = True


def _refuse_step_with_queued_work(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
    """Optimizer step pre-hook. With a closure (LBFGS, or any ``step(closure)``) the backward
    runs inside the step, so the check goes after each call of the closure instead."""
    # ``args`` are step's own: (optimizer, closure?, ...).
    if kwargs.get("closure") is not None:
        return args, {**kwargs, "closure": _checked_closure(optimizer, kwargs["closure"])}
    if len(args) > 1 and args[1] is not None:
        return (args[0], _checked_closure(optimizer, args[1]), *args[2:]), kwargs
    _refuse_if_queued(optimizer)
    return None


def _checked_closure(optimizer: torch.optim.Optimizer, closure: Any) -> Any:
    @functools.wraps(closure)
    def checked() -> Any:
        loss = closure()
        _refuse_if_queued(optimizer)
        return loss

    return checked


def _refuse_if_queued(optimizer: torch.optim.Optimizer) -> None:
    queues = queues_with_work()
    if not queues:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(q.has_work_for(params) for q in queues) or any(finds(params, queues) for finds in queued_work_finders):
        raise RuntimeError(
            "twobp: optimizer.step() over parameters whose weight gradients are still queued; "
            "call twobp.flush_weight_grads() (or queue.flush()) after backward and before step() "
            "(with step(closure): inside the closure, after its backward)."
        )
