"""Module type -> deferred forward. Keyed by the *exact* type: a subclass may change what its
forward computes, so it keeps plain autograd until it is registered itself. The one exception is
the class ``fully_shard`` generates from a registered one: it only adds FSDP2's hooks."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin

from .fsdp_hooks import class_before_fully_shard

__all__ = [
    "DeferredForward",
    "Rule",
    "register",
    "unregister",
    "rules_restored_after",
    "rule_for",
    "module_class",
    "unregistered_why",
    "suggest_rule",
    "weight_and_bias",
    "PATCHED_CALL",
]

#: ``forward(module, *args, **kwargs)``: the module's forward, computing the output with the
#: parameters detached and handing them to :func:`twobp_autograd.deferral.defer_weight_grads`.
DeferredForward = Callable[..., Any]


@dataclass(frozen=True)
class Rule:
    forward: DeferredForward
    #: Returns why a module's configuration cannot be deferred (it then keeps plain
    #: autograd, with one warning), or None.
    unsupported: Callable[[nn.Module], str | None]
    #: The class's forward when the rule was registered: the computation the rule stands for.
    #: A class whose forward was replaced since keeps plain autograd.
    class_forward: Callable[..., Any] | None = None

    def stands_for(self, module: nn.Module) -> bool:
        return self.class_forward is None or type(module).forward is self.class_forward


_rules: dict[type, Rule] = {}


def _always_supported(module: nn.Module) -> None:
    return None


ModuleTypes = type | tuple[type, ...]


def register(
    module_type: ModuleTypes,
    forward: DeferredForward | None = None,
    *,
    unsupported: Callable[[nn.Module], str | None] | None = None,
) -> Any:
    """Register how ``module_type`` (one type, or a tuple of types sharing one forward) defers
    its weight gradients.

    As a decorator, ``@register(MyNorm)`` on ``def forward(module, *args, **kwargs)``; or
    directly, ``register(MyGate, twobp_autograd.ops.recompute)`` to replay a module's forward at
    the flush (``recompute_rowwise`` for one whose forward treats the samples of a batch
    independently; see :mod:`twobp_autograd.ops.recompute`).
    A type registered again takes the new rule for modules patched from then on (modules
    already patched keep theirs until :func:`twobp_autograd.unpatch`).
    """
    types = module_type if isinstance(module_type, tuple) else (module_type,)
    if not types:
        raise TypeError("twobp: register expects an nn.Module subclass (or a tuple of them), got an empty tuple")
    for t in types:
        if not (isinstance(t, type) and issubclass(t, nn.Module)):
            raise TypeError(f"twobp: register expects an nn.Module subclass (or a tuple of them), got {t!r}")
    if unsupported is not None and not callable(unsupported):
        raise TypeError(
            f"twobp: register's unsupported takes a callable, unsupported(module) -> a reason or None, "
            f"got {unsupported!r}"
        )

    def decorator(fn: DeferredForward) -> DeferredForward:
        if not callable(fn):
            raise TypeError(
                f"twobp: register({', '.join(t.__name__ for t in types)}) needs a callable forward, got {fn!r}"
            )
        for t in types:
            _rules[t] = Rule(fn, unsupported or _always_supported, getattr(t, "forward", None))
        return fn

    return decorator if forward is None else decorator(forward)


def unregister(module_type: ModuleTypes) -> None:
    """Forget the rules of ``module_type`` (already patched modules keep theirs until
    :func:`twobp_autograd.unpatch`)."""
    for t in module_type if isinstance(module_type, tuple) else (module_type,):
        _rules.pop(t, None)


@contextlib.contextmanager
def rules_restored_after() -> Iterator[None]:
    """Registrations made inside last until the block ends; the rules before it come back."""
    saved = dict(_rules)
    try:
        yield
    finally:
        _rules.clear()
        _rules.update(saved)


#: Where a patched module keeps its deferred forward (see patching): its ``forward`` may be a
#: wrapper around it by now (accelerate's hooks, added after patching, call the forward they found).
PATCHED_CALL = "_twobp_deferred_forward"


def module_class(module: nn.Module) -> type:
    """The type a module is registered under: its own, or for a module ``fully_shard`` has
    wrapped, the class it was (FSDP2 swaps in a generated subclass that only adds hooks)."""
    return class_before_fully_shard(type(module))


def rule_for(module: nn.Module) -> Rule | None:
    return _rules.get(type(module)) or _rules.get(module_class(module))


def weight_and_bias(module: nn.Module) -> tuple[Any, Any]:
    """``(module.weight, module.bias)``, read once per call (a parametrized weight is rebuilt per
    read). Straight from ``_parameters`` where ``nn.Module.__getattr__`` would find both there:
    its Python costs about 0.4 us a read, on every patched call. Under ``torch.compile`` the
    attributes, as Dynamo traces them."""
    params = module._parameters
    if "weight" in params and "bias" in params and not _is_compiling():
        cls = type(module)
        plain = _reads_from_parameters.get(cls)
        if plain is None:
            plain = _reads_from_parameters[cls] = _attribute_reads_reach_parameters(cls)
        instance = module.__dict__
        if plain and "weight" not in instance and "bias" not in instance:
            return params["weight"], params["bias"]
    return module.weight, module.bias


def _attribute_reads_reach_parameters(cls: type) -> bool:
    """Whether reading ``weight`` and ``bias`` of an instance (neither in its ``__dict__``)
    ends in ``nn.Module.__getattr__``: no class attribute of either name (a parametrization's
    property) and no attribute lookup of the class's own."""
    return (
        getattr(cls, "__getattr__", None) is nn.Module.__getattr__
        and getattr(cls, "__getattribute__", None) is object.__getattribute__
        and not hasattr(cls, "weight")
        and not hasattr(cls, "bias")
    )


_reads_from_parameters: dict[type, bool] = {}
_is_compiling = torch.compiler.is_compiling


#: Rules to name for a class that is not registered: (whether the class computes what the rule
#: does, how the rule is spelled for ``register``).
_suggested: list[tuple[Callable[[type], bool], str]] = []


def suggest_rule(fits: Callable[[type], bool], spelled: str) -> None:
    """Have ``patch``'s report name the rule ``spelled`` for an unregistered class that ``fits``
    (Hugging Face's classes, judged by their forward: see :mod:`.ops.verdicts`)."""
    _suggested.append((fits, spelled))


def _fits(fits: Callable[[type], bool], module_type: type) -> bool:
    """A suggestion's judge, which builds a reference class: any failure of it is no suggestion
    (patch runs this for every unregistered class)."""
    try:
        return fits(module_type)
    except Exception:
        return False


def unregistered_why(module_type: type, *, suggest: bool = True) -> str:
    """What ``patch`` reports for a module with parameters and no rule: a subclass of a covered
    type, or a class a suggested rule fits, says (where ``suggest``) which rule would fit it."""
    name = f"{module_type.__module__}.{module_type.__qualname__}"
    why = f"{name} is not registered (plain autograd)"
    if not suggest:
        return why
    for fits, spelled in _suggested:
        if _fits(fits, module_type):
            registration = f"twobp.register({module_type.__name__}, {spelled})"
            return f"{why}; it computes what a rule of this package does: {registration}"
    base = next((b for b in module_type.__mro__[1:] if b in _rules), None)
    if issubclass(module_type, LazyModuleMixin):  # its first forward makes it the class it becomes
        becomes = getattr(module_type, "cls_to_become", None)  # not a base for the lazy norms
        covered = becomes if becomes in _rules else base
        if covered is not None:
            return f"{why}; a lazy module: run one forward to make it a {covered.__name__}, then patch again"
    if base is None:
        return why
    if getattr(module_type, "forward", None) is not getattr(base, "forward", None):
        return (
            f"{why}; it derives from {base.__name__} with a forward of its own: register a rule for it "
            f"(twobp.register({module_type.__name__}, twobp_autograd.ops.recompute) re-runs its forward at the "
            "flush, for a module called with positional tensors only: calls with keyword arguments keep plain "
            "autograd; twobp_autograd.ops.recompute_rowwise joins the replays of one that treats each sample of "
            "a batch on its own)"
        )
    rule = _rules[base].forward
    return (
        f"{why}; it derives from {base.__name__} and keeps its forward: if it computes what "
        f"{base.__name__} does, twobp.register({module_type.__name__}, {rule.__module__}.{rule.__qualname__})"
    )
