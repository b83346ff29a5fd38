"""Patch a model in place: each module whose exact type is registered gets an instance-level
``forward`` that defers its weight gradients. Class, parameters, buffers, ``state_dict``,
``repr`` and hooks are untouched (hooks run in ``__call__``, around ``forward``)."""

from __future__ import annotations

import copy
import fnmatch
import functools
import gc
import importlib
import inspect
import io
import pickle
import sys
import types
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.nn.utils.parametrize import is_parametrized

from . import ops  # noqa: F401  (registers the built-in op families)
from .checkpoint_paths import enter_call, leave_call, link_nested_frames, record_under_checkpoint, took_plain
from .compile_frames import end_graph_from_an_eager_frame, keep_own_frames_eager
from .ddp_guard import check_not_inside_ddp, refuse_ddp_over_patched_models
from .deferral import (
    NO_FULL_GRAPH,
    first_call_checked,
    first_call_unchecked,
    first_calls_open,
    inside_first_call_check,
)
from .grad_guard import install_grad_guards
from .registry import PATCHED_CALL, DeferredForward, module_class, rule_for, unregistered_why
from .warn_once import warn_once

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
    one differentiating (inside a ``torch.func`` transform), ``torch.export`` traces it or the
    module has a deprecated non-full backward hook; else the rule's (the class's forward once
    unpatched under a wrapper added since, such as accelerate's hooks, which keep calling it)."""

    # The weak reference to the module lives in a slot, not in __dict__: functools.wraps /
    # update_wrapper copy the wrapped callable's __dict__ into a wrapper added after patch
    # (accelerate's add_hook_to_module), and a weakref there made the model unpicklable.
    # So do the other two: the list only this call and its module's __dict__ refer to (see
    # _copies_share), and the call a shallow copy's call was adopted from.
    __slots__ = ("_module", "_copies", "_adopted_from", "__dict__", "__weakref__")

    #: Set after the first deferred call, which checks that the rule's op computed with its
    #: deferred parameters detached (a class default: calls pickled before it existed load too).
    first_call_checked = False

    #: ``lock_of(module)`` where the rule changes the module while it runs: the whole call holds
    #: that lock (a class default, as above).
    runs_alone: Callable[[nn.Module], Any] | None = None

    #: Set once a shallow copy that adopted a call of its own kept a wrapper of this one as its
    #: forward: that wrapper calls this call for the copy, so every call looks for its caller. For
    #: good: the wrapper may outlive the copy, and keeps it alive in plain.
    wrapped_by_copies = False

    #: On a shallow copy's own call: its forward is the wrapper its original had before the copy,
    #: bound to the original in plain (which computes there, kept alive by it); or a wrapper made
    #: before the copy on a module that cannot be told (see _adopt).
    takes_the_originals_wrapper = False
    wrapper_not_told_apart = False

    def __init__(self, module: nn.Module, deferred: DeferredForward) -> None:
        # Weak: the module holds this call in its __dict__; a strong reference back would make
        # every patched module a reference cycle, freed (parameters, .grad) only by the cyclic GC.
        self._module: Callable[[], nn.Module | None] = weakref.ref(module)
        # A fresh empty list: a list, as a whole patched model pickled with weights_only=True
        # takes it (see _copies_share).
        self._copies: list[Any] = []
        self._adopted_from: Callable[[], DeferredForwardCall | None] = _no_module
        self.deferred = deferred  # the class's forward once unpatched
        self.runs_alone = getattr(deferred, "runs_alone", None)
        # What the rule was chosen for: a class swapped since, or its forward replaced, computes
        # something else (a parametrization's subclass keeps the forward).
        self.class_forward: Callable[..., Any] | None = type(module).forward
        # The class the rule was chosen for, and the classes since seen to compute as it does.
        self.classes_of_the_rule = {type(module)}
        _calls.add(self)

    @property
    def __code__(self) -> types.CodeType:
        """The class forward's code, which ``torch.export`` reads off a root module's forward (to
        name its shape environment): the code this call runs where it keeps the plain forward."""
        return type(self.module).forward.__code__

    @property
    def __signature__(self) -> inspect.Signature:
        """The bound class forward's, as ``inspect.signature(module.forward)`` gives it unpatched
        (Hugging Face's Trainer keeps the dataset columns a model's forward names)."""
        return inspect.signature(_bound_class_forward(self.module))

    def owner(self) -> nn.Module | None:
        """The module, or None once it was freed (only its forward kept)."""
        return self._module()

    @property
    def module(self) -> nn.Module:
        module = self._module()
        if module is None:
            raise RuntimeError(
                "twobp: this patched forward's module was garbage collected; keep a reference to the "
                "module, not only to its forward"
            )
        return module

    def __getstate__(self) -> dict[str, Any]:
        state = self._state()
        rule = self.deferred
        if isinstance(rule, types.FunctionType):
            # By name, found leniently where it is loaded (a rule defined in the saving script's
            # __main__ is not there in another script, where plain torch.load of the model works);
            # one with no name to find (a lambda, a function defined inside another) as None. Either
            # way a rule not found is the one registered there for the module's class.
            named = _found_by_name(rule.__module__, rule.__qualname__) is rule
            # A tuple of strings: a whole patched model then loads with weights_only=True, only
            # this class allow-listed beside the model's.
            state["deferred"] = (rule.__module__, rule.__qualname__) if named else None
        elif not _pickles_apart_from_modules(rule):
            state["deferred"] = None  # a partial of a lambda, an instance of a local class: found again
        return state

    def __deepcopy__(self, memo: dict[int, Any]) -> DeferredForwardCall:
        """A deep copy keeps the rule itself, whatever pickle makes of it (deepcopy keeps a
        function as it is): the registry may hold another rule for the class by now, or none."""
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__setstate__(copy.deepcopy(self._state(), memo))
        return copied

    def _state(self) -> dict[str, Any]:
        # The class's forward is found again where the copy is made (a function defined in a
        # script's __main__, or a lambda, would not pickle).
        # runs_alone is the rule's, found again from ``deferred``: a pickle made before it existed
        # gets it too, and no pickle names the rule's private lock.
        unpicklable = ("class_forward", "classes_of_the_rule", "runs_alone")
        state = {key: value for key, value in self.__dict__.items() if key not in unpicklable}
        state["_copies"] = self._copies  # one object with its module's entry (the pickle's memo)
        owner = self.owner()
        if owner is not None and owner.__dict__.get("forward") is not self:
            # A copy's own call under a wrapper: the call it was adopted from, which the wrapper
            # holds (and pickles) anyway. Elsewhere left out: it would carry the original's module.
            state["_adopted_from"] = self._adopted_from()
        state["module"] = self.owner()  # None: only shallow copies sharing this call are left
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A patched model deep-copied, or loaded in a process that never called ``patch``
        (``torch.load``, a spawned worker): it defers there too, so the guards come with it."""
        state = dict(state)
        module = state.pop("module")
        copies = state.pop("_copies", None)
        self._copies = copies if copies is not None else []  # (pickled before it existed: always looks)
        adopted_from = state.pop("_adopted_from", None)
        self._adopted_from = weakref.ref(adopted_from) if adopted_from is not None else _no_module
        self.__dict__.update(state)
        if isinstance(self.deferred, tuple):  # a rule's name: no rule is a tuple
            found = _found_by_name(*self.deferred)
            self.deferred = found if callable(found) else None
        if self.deferred is None:
            self.deferred = _rule_found_again(module)
        self.runs_alone = getattr(self.deferred, "runs_alone", None)
        self._module = weakref.ref(module) if module is not None else _no_module
        # The forward the rule stands for, not the class's now (replaced since, it is not); for a
        # call only shallow copies share, the copy that adopts it finds it (see _adopt).
        self.class_forward, self.classes_of_the_rule = _rule_forward(module) if module is not None else (None, set())
        _calls.add(self)
        _install_guards()

    def computes_as_its_rule(self, module: nn.Module) -> bool:
        """Whether ``module``'s class, if swapped since ``patch``, still computes what the rule
        does: FSDP2's generated subclass and a parametrization's only add hooks or a property; a
        subclass overriding what the inherited forward calls (a Conv2d's ``_conv_forward``) does
        not, and a rule that computes the op itself would bypass it."""
        cls = type(module)
        if cls in self.classes_of_the_rule:
            return True
        bases = self.classes_of_the_rule
        same = module_class(module) in bases or (is_parametrized(module) and set(cls.__bases__) <= bases)
        if same:
            self.classes_of_the_rule.add(cls)
        return same

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.owner()  # None where only shallow copies sharing this call are left
        compiling = _is_compiling()
        # The module being called may be a shallow copy sharing this call through its copied
        # __dict__ (copy.copy, learn2learn's clone_module, nn.DataParallel's replicas), or one that
        # adopted a call of its own but keeps a wrapper of this one as its forward: it computes
        # with its own parameters and flags. (A module merely given this call as its forward holds
        # no _CALL of it: this call's module computes.) Looking costs a frame's locals per call,
        # so only where a copy may call (see _copies_share).
        if not compiling and (module is None or self.wrapped_by_copies or _copies_share(self, module)):
            module = _module_computing(self, *_called_module(sys._getframe(1)), module)
        if module is None:
            module = self.module  # raises: only this forward was kept
        # A rule that changes the module while it runs (the recompute rule's stand-ins for its
        # parameters) runs alone: another thread's call would see them (and ask whether they
        # require grad) before it would reach the rule's own lock. Only a call that may run the
        # rule takes it (grad mode, training): a plain call swaps nothing in, and taking it there
        # made inference threads wait for each other.
        lock = (
            self.runs_alone(module)
            if self.runs_alone is not None and not compiling and module.training and torch.is_grad_enabled()
            else None
        )
        if lock is not None:
            lock.acquire()
        replaying, record = False, None
        try:
            grad_enabled = torch.is_grad_enabled()
            deferring = (
                grad_enabled
                and module.training
                and _maybe_current_level() is None  # torch.func transforms differentiate by themselves
                and not _is_exporting()  # torch.export records the plain forward's ops
                # So does torch.jit.trace (the deferred path's nodes cannot be traced); Dynamo cannot
                # trace this question, and never runs under jit.trace.
                and (compiling or not _is_jit_tracing())
                # fx tracing into a module: its inputs are Proxies (the first one tells, where there is
                # one: cheaper than fx's thread-local flag)
                and not (isinstance(args[0], _Proxy) if args else _is_fx_symbolic_tracing())
                and _wants_grad(module)
            )
            if grad_enabled and not compiling and _top_saved_tensors_hooks(True) is not None:
                # Under a non-reentrant checkpoint: recorded, and its recomputation takes that path
                # (``replaying`` a call that deferred: its hooks see only the discarded recomputed graph).
                record = record_under_checkpoint(module, deferring)
                if record is not None:
                    deferring, replaying = record.deferred, record.replaying
                    enter_call(record)
            if deferring:
                warn_plain = None if replaying else self._plain_because(module)
                if warn_plain is not None:
                    warn_plain(module)
                    took_plain(module)
                    return _bound_class_forward(module)(*args, **kwargs)
                if compiling:
                    # Traced by Dynamo: the deferred path's Functions queue work in their backward,
                    # which no graph can hold. Ending the graph here, not inside the rule, gives
                    # every op family one reason for fullgraph=True to fail with; Dynamo runs the
                    # call eagerly (this package's frames are never compiled: compile_frames).
                    torch._dynamo.graph_break(msg=NO_FULL_GRAPH)  # a keyword: Dynamo reads only msg=
                    return self.deferred(module, *args, **kwargs)
                if _dynamo_frame_callback() is not None and _called_by_torch_compile(sys._getframe(1)):
                    end_graph_from_an_eager_frame(NO_FULL_GRAPH)
                if self.first_call_checked:
                    if not first_calls_open or not inside_first_call_check():
                        return self.deferred(module, *args, **kwargs)
                    # Not under an enclosing module's first-call check either (that check covers the
                    # enclosing module's rule, not this module's later calls).
                    with first_call_unchecked():
                        return self.deferred(module, *args, **kwargs)
                with first_call_checked(args, kwargs):  # the rule computed with its deferred parameters detached
                    output = self.deferred(module, *args, **kwargs)
                self.first_call_checked = True
                return output
            forward = type(module).forward
            if forward is self.class_forward:  # a function, as patch() checked
                return forward(module, *args, **kwargs)
            return _bound_class_forward(module)(*args, **kwargs)
        finally:
            if record is not None:
                leave_call()
            if lock is not None:
                lock.release()


    def _plain_because(self, module: nn.Module) -> Callable[[nn.Module], None] | None:
        """The warning of why a call that would defer keeps plain autograd, or None: a deprecated
        non-full backward hook, or a class or forward changed since ``patch``."""
        if module._is_full_backward_hook is False or (_GLOBAL_BACKWARD_HOOKS and _global_non_full_backward_hooks()):
            return _warn_non_full_backward_hook_once
        if type(module).forward is not self.class_forward or (
            type(module) not in self.classes_of_the_rule and not self.computes_as_its_rule(module)
        ):
            return _warn_class_changed_once
        return None


def _rule_forward(module: nn.Module) -> tuple[Any, set[type]]:
    """The forward ``module``'s rule stands for, and the class it was chosen for."""
    rule = rule_for(module)
    standing = rule.class_forward if rule is not None else None
    return (standing if standing is not None else type(module).forward), {type(module)}


def _no_module() -> None:
    return None


def _found_by_name(module_name: str, qualname: str) -> Any:
    """What ``qualname`` names in ``module_name`` (imported if it is not loaded), or None."""
    try:
        found: Any = sys.modules.get(module_name) or importlib.import_module(module_name)
    except Exception:  # no such module where a copy is loaded
        return None
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return found


class _ProbePickler(pickle.Pickler):
    """Pickles a rule with the modules and tensors it reaches left out where pickle writes them
    anyway (a module of an importable class, a tensor with no attributes of its own): a bound
    method of the model reaches the model, and probing it whole per patched module pickled the
    model once per module."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and type(obj) in _PLAIN_TENSORS and not obj.__dict__:
            return id(obj)
        if isinstance(obj, nn.Module) and _found_by_name(type(obj).__module__, type(obj).__qualname__) is type(obj):
            return id(obj)
        return None


_PLAIN_TENSORS = (torch.Tensor, nn.Parameter)


def _pickles_apart_from_modules(rule: Any) -> bool:
    """Probed at each save, not remembered: a rule changed since (an attribute pickle cannot
    write) would fail the save, and remembering it would keep it, and what it reaches, alive."""
    try:
        _ProbePickler(io.BytesIO()).dump(rule)
    except Exception:  # pickle's own errors, or AttributeError for a local object
        return False
    return True


class _RuleByName(tuple[str, str]):
    """What models saved by earlier versions pickled a rule's name as (a tuple, read as one), and
    what ``torch.load(weights_only=True)`` of such a model needs allow-listed."""


def _rule_found_again(module: nn.Module | None) -> Any:
    """For a patched module whose rule was not saved with it: the rule registered here for its
    class, else its class's forward (plain autograd), with one warning."""
    rule = rule_for(module) if module is not None else None
    if rule is not None:
        return rule.forward
    name = type(module).__name__ if module is not None else "a module"
    warn_once(
        ("rule not found again", name),
        f"twobp: {name} was saved patched with a rule pickle cannot name (a lambda, or a function "
        "defined inside another), and none is registered for its class here: it keeps plain autograd "
        "(correct gradients, computed in backward). Register the rule before loading (twobp.register), "
        "or register a function defined at a module's top level.",
        stacklevel=4,
    )
    return _class_forward


def _adopt(copy: nn.Module, shared: DeferredForwardCall, *, made_now: bool = False) -> nn.Module:
    """Give a shallow copy a call of its own (its forward called directly, not through
    ``nn.Module.__call__``, then finds it too); ``made_now``: as it is made (copy.copy, a
    replica), when a wrapper it holds as its forward was made before it, on another module."""
    own = DeferredForwardCall(copy, shared.deferred)
    own._adopted_from = weakref.ref(shared)
    if shared.class_forward is None:  # copied or loaded after its module was freed
        own.class_forward, own.classes_of_the_rule = _rule_forward(copy)
    else:
        own.class_forward, own.classes_of_the_rule = shared.class_forward, set(shared.classes_of_the_rule)
    forward = copy.__dict__.get("forward")
    original = shared.owner()
    if forward is shared:
        copy.__dict__["forward"] = own
    elif forward is not None and original is not None and forward is original.__dict__.get("forward"):
        own.takes_the_originals_wrapper = True
    elif forward is not None and made_now:
        # Made on a module since freed or rewrapped, or on a copy this one was copied from: plain's
        # computes with that one, which cannot be told.
        own.wrapper_not_told_apart = True
    elif forward is not None:
        shared.wrapped_by_copies = True  # a wrapper made on the copy, which calls the shared call for it
    copy.__dict__[_CALL] = own
    copy.__dict__[_COPIES] = own._copies
    return copy


def _warn_class_changed_once(module: nn.Module) -> None:
    warn_once(
        ("class changed", type(module)),
        f"twobp: a patched module's class or its forward changed since patch() (now "
        f"{type(module).__name__}): it runs that forward under plain autograd, not deferred. Call "
        "twobp.patch(model) again to defer it by its new class's rule, if that has one.",
        stacklevel=3,
    )


_maybe_current_level = torch._C._functorch.maybe_current_level
_is_exporting = torch.compiler.is_exporting
_is_fx_symbolic_tracing = torch.fx._symbolic_trace.is_fx_symbolic_tracing
_Proxy = torch.fx.Proxy
_is_compiling = torch.compiler.is_compiling
_dynamo_frame_callback = torch._C._dynamo.eval_frame.get_eval_frame_callback


def _called_by_torch_compile(caller: Any) -> bool:
    """Whether the patched module is what ``torch.compile`` was given (compiled itself: its call,
    never compiled, runs eagerly under Dynamo's callback), not called from a compiled caller's
    frame resumed after its graph break (ending no graph there: a frame more per call, compiled
    again per autocast state)."""
    while caller is not None and caller.f_code in _MODULE_CALL:
        caller = caller.f_back
    code = None if caller is None else caller.f_code
    return code is not None and code.co_name == "compile_wrapper" and code.co_filename == _DYNAMO_EVAL_FRAME


def _called_module(caller: Any) -> tuple[nn.Module | None, bool]:
    """The module ``nn.Module.__call__`` is calling, seen from the frame that called a patched
    forward: the frame itself where it is the call's (``_call_impl``, the ``inner`` closure it
    runs hooks in, ``_slow_forward`` under jit tracing), else the nearest such frame a few above,
    where a wrapper of the forward sits between (accelerate's hooks); None where there is none.
    And whether a wrapper sat between."""
    for looked_past in range(_WRAPPERS_LOOKED_PAST + 1):
        if caller is None:
            break
        if caller.f_code in _CALLING_FRAMES:
            return caller.f_locals.get("self"), looked_past > 0
        caller = caller.f_back
    return None, False


def _module_computing(
    call: DeferredForwardCall, called: nn.Module | None, wrapped: bool, module: nn.Module | None
) -> nn.Module | None:
    """The module ``call`` computes with, seen from the module being ``called``: a shallow copy
    of ``call``'s module computes with its own parameters (given a call of its own now where it
    shares ``call``); else ``module``, ``call``'s own (None: freed)."""
    if called is module:
        return module
    held = None if called is None else called.__dict__.get(_CALL)
    # A call of its own, adopted from ``call`` (its owner: a copy of a copy shares it, unadopted).
    own = held if isinstance(held, DeferredForwardCall) and held._adopted_from() is call else None
    adopted = own is not None and own.owner() is called
    if called is not None and (held is call or adopted):
        forward = called.__dict__.get("forward")
        if forward is None or (forward is call and not wrapped):
            return _adopt(called, call) if held is call else called
        # A wrapper as its forward (or the shared call reached past one): made on the original
        # before the copy, it is bound to the original in plain, which computes (kept alive by
        # it: a freed one cannot); made on the copy, the copy computes.
        if own is not None and adopted:
            if own.wrapper_not_told_apart:
                raise _copy_not_told_apart()
            if not own.takes_the_originals_wrapper:
                return called
            if module is None:
                raise RuntimeError(
                    "twobp: this shallow copy's forward is a wrapper its original had before the copy, "
                    "which computes with the original in plain (the wrapper keeps it alive); here the "
                    "original was freed (a patched forward holds its module weakly, and a copy saved or "
                    "deep-copied alone takes the original along only in its wrapper). Keep a reference "
                    "to the original, or remove the wrapper before copying."
                )
            return module
        if module is None:
            raise RuntimeError(
                "twobp: a shallow copy whose forward is a wrapper calls the patched forward of a module "
                "since freed: whether that wrapper was made on the original before the copy (plain "
                "computes with the original, which the wrapper keeps alive) or on the copy cannot be "
                "told. Keep a reference to the original, or call twobp.patch(copy) before wrapping "
                "the copy's forward."
            )
        if forward is module.__dict__.get("forward"):
            return module
        if forward is not call and _wrapper_of_another_copy(call, called, forward):
            raise _copy_not_told_apart()
        return _adopt(called, call)
    if call.wrapped_by_copies:
        raise _copy_not_told_apart()
    return module


def _copy_not_told_apart() -> RuntimeError:
    return RuntimeError(
        "twobp: a patched forward that a wrapper on a shallow copy of its module also calls was "
        "called with no call of that copy to tell them apart (its forward called directly, a "
        "checkpoint's recomputation, a copy of the copy, the copy unpatched): which module "
        "computes cannot be told. Call twobp.patch(copy) on a copy made by copying a patched "
        "module's __dict__ before wrapping its forward: it gets a call of its own."
    )


def _wrapper_of_another_copy(call: DeferredForwardCall, called: nn.Module, forward: Any) -> bool:
    """Whether another shallow copy sharing ``call`` holds the same wrapper as its forward: made
    on one of the two before the other was copied from it, it computes with that one in plain,
    which cannot be told. Looked up only where other copies share ``call`` (rare: their dicts
    are found among the referrers of its ``_copies``)."""
    copies = call._copies
    if sys.getrefcount(copies) <= _UNSHARED_COPIES + 1:  # as measured, and ``called``'s dict
        return False
    return any(
        isinstance(holder, dict)
        and holder is not called.__dict__
        and holder.get(_CALL) is call
        and holder.get("forward") is forward
        for holder in gc.get_referrers(copies)
    )


#: Frames of a wrapper between ``nn.Module.__call__`` and a patched forward looked past.
_WRAPPERS_LOOKED_PAST = 8  # torch.utils.checkpoint's own are 4


_is_jit_tracing = torch._C._is_tracing
_top_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_CALL_IMPL = nn.Module._call_impl.__code__
_MODULE_CALL = {_CALL_IMPL, nn.Module._wrapped_call_impl.__code__}
#: The frames whose ``self`` is the module being called: ``_call_impl``, the closure it runs
#: hooks in, and ``_slow_forward``.
_CALLING_FRAMES = {
    _CALL_IMPL,
    nn.Module._slow_forward.__code__,
    *[code for code in _CALL_IMPL.co_consts if isinstance(code, types.CodeType) and code.co_name == "inner"],
}
_DYNAMO_EVAL_FRAME = torch._dynamo.eval_frame.__file__


_GLOBAL_BACKWARD_HOOKS = module_hooks._global_backward_hooks  # one dict, filled in place


def _global_non_full_backward_hooks() -> bool:
    """``register_module_backward_hook`` (deprecated, non-full) hooks on every module."""
    return bool(_GLOBAL_BACKWARD_HOOKS) and module_hooks._global_is_full_backward_hook is False


def _warn_non_full_backward_hook_once(module: nn.Module) -> None:
    """A non-full backward hook sees (and may change) the gradients of the module's last autograd
    node, weight gradients included for a Linear; deferred, that node would be another one."""
    warn_once(
        ("non-full backward hook", type(module)),
        f"twobp: {type(module).__name__} with a non-full backward hook (register_backward_hook, "
        "deprecated) keeps plain autograd: the hook sees the gradients of the module's last "
        "autograd node, its weight gradients among them, which a deferred call would not hand "
        "it. Use register_full_backward_hook to keep the weight gradients deferred.",
        stacklevel=3,
    )


def _wants_grad(module: nn.Module) -> bool:
    """Whether a parameter of the module requires grad: its own straight from the dict (this
    runs on every call), its children's too where it has some (MultiheadAttention's out_proj)."""
    for param in module.parameters() if module._modules else module._parameters.values():
        if param is None:
            continue
        if type(param) is not _PARAMETER and type(param) is not _TENSOR:
            # A tensor subclass overriding __torch_function__ (ExpandedWeights, put in by
            # call_for_per_sample_grads / Opacus' "ew" mode) may refuse even attribute reads;
            # the op's own check sends such a call to plain autograd.
            with torch._C.DisableTorchFunctionSubclass():
                if param.requires_grad:
                    return True
        elif param.requires_grad:
            return True
    return False


_PARAMETER = nn.Parameter
_TENSOR = torch.Tensor


def _selectors(argument: str, given: Selector | Iterable[Selector]) -> list[Selector]:
    """``given`` as a list of selectors: one type or pattern alone is one selector (a string is
    not a sequence of one-letter patterns); anything but types and strings is refused."""
    if isinstance(given, (str, type)):
        selectors: list[Any] = [given]
    elif isinstance(given, Iterable):
        selectors = list(given)
    else:
        selectors = [given]  # refused below, as a selector
    for selector in selectors:
        if not isinstance(selector, (str, type)):
            raise TypeError(
                f"twobp: patch's {argument} takes module types and qualified-name patterns "
                f"(strings such as 'layer4.*'), not {selector!r}"
            )
    return selectors


def _selected(name: str, module: nn.Module, selectors: Iterable[Selector]) -> bool:
    return any(
        (isinstance(s, type) and module_class(module) is s) or (isinstance(s, str) and fnmatch.fnmatchcase(name, s))
        for s in selectors
    )


#: Every deferred forward alive: made by ``patch``, or by copying or loading a patched module
#: (those of modules unpatched since are filtered out by :func:`_patched_modules`).
_calls: weakref.WeakSet[DeferredForwardCall] = weakref.WeakSet()


def _patched_modules() -> list[nn.Module]:
    owners = [call.owner() for call in list(_calls)]
    return [module for module in owners if module is not None and _is_patched(module)]


def _install_guards() -> None:
    """What reads or reduces ``.grad`` around a step is checked once a patched module exists
    in this process (each installs once)."""
    install_grad_guards()
    keep_own_frames_eager()
    refuse_ddp_over_patched_models(_is_patched, _patched_modules)
    _adopt_shallow_copies_when_made()
    link_nested_frames()


def _adopt_shallow_copies_when_made() -> None:
    """``copy.copy`` of a patched module (``nn.Module.__setstate__`` on the copied ``__dict__``)
    gives the copy a call of its own at once: a copy's first call traced by ``torch.compile``
    cannot look for its caller's frame, and computed with the original's parameters."""
    setstate = nn.Module.__setstate__
    if getattr(setstate, _ADOPTS, False):
        return

    @functools.wraps(setstate)
    def adopting(self: nn.Module, state: dict[str, Any]) -> None:
        setstate(self, state)
        _call_of_its_own(self)

    setattr(adopting, _ADOPTS, True)
    nn.Module.__setstate__ = adopting  # type: ignore[method-assign]

    # nn.DataParallel's replicas copy the __dict__ too: a replica whose forward is called
    # directly (not through __call__, whose frame the shared call looks for) would compute with
    # the original's parameters.
    replicate = nn.Module._replicate_for_data_parallel

    @functools.wraps(replicate)
    def replicate_adopting(self: nn.Module) -> nn.Module:
        return _call_of_its_own(replicate(self))

    nn.Module._replicate_for_data_parallel = replicate_adopting  # type: ignore[method-assign]


_ADOPTS = "twobp_adopts_shallow_copies"


def _call_of_its_own(module: nn.Module) -> nn.Module:
    """``module``, given a call of its own where it shares another module's (a shallow copy).
    A call not set up yet is being unpickled with it (a deep copy of a shallow copy): skipped."""
    call = module.__dict__.get(_CALL)
    if isinstance(call, DeferredForwardCall) and hasattr(call, "_module") and call.owner() is not module:
        _adopt(module, call, made_now=True)
    return module


_INSTANCE_FORWARD = (
    "an instance-level forward of its own (a wrapper, such as accelerate's hooks), which the "
    "deferred forward would bypass (patch before adding it)"
)

_STATIC_FORWARD = (
    "a forward that is a staticmethod or classmethod, which no rule can call with the module nor "
    "run with its parameters substituted (it reaches none through the module)"
)

_REPLACED_FORWARD = (
    "a class forward replaced since its rule was registered, which the rule's computation would not "
    "follow (register a rule for it again with twobp.register if it still computes the same)"
)

_UNBOUND = (staticmethod, classmethod)

_CALL = PATCHED_CALL  # where a patched module keeps its DeferredForwardCall


_COPIES = "_twobp_copies"  # where a patched module keeps its call's _copies


def _copies_share(call: DeferredForwardCall, module: nn.Module) -> bool:
    """Whether a ``__dict__`` besides ``module``'s may hold ``call`` and its ``_copies``: a
    shallow copy made by copying the ``__dict__`` (copy.copy, clone_module, a replica; or
    something else kept a copy, ``vars(module).copy()``: then the look is only cost), or
    ``module`` no longer holds them (unpatched, its copies still do). The count is the module's
    entry, the call's slot and the argument's, where none shares it: any tracer, profiler or
    hook holds the call or the module, not this list."""
    copies = module.__dict__.get(_COPIES)
    return copies is not call._copies or sys.getrefcount(copies) != _UNSHARED_COPIES


def _references_of_unshared_copies() -> int:
    probe = DeferredForwardCall.__new__(DeferredForwardCall)
    probe._copies = []
    module_entry = {_COPIES: probe._copies}
    copies = module_entry[_COPIES]
    return sys.getrefcount(copies)  # as _copies_share counts


_UNSHARED_COPIES = _references_of_unshared_copies()


def _is_patched(module: nn.Module) -> bool:
    return isinstance(module.__dict__.get(_CALL), DeferredForwardCall)


_PATCHED_BEFORE = (  # compared by identity
    "left out by include/exclude but patched by an earlier patch(), so it still defers: "
    "twobp.unpatch(module) makes it plain"
)


def patch(
    model: nn.Module,
    *,
    include: Selector | Iterable[Selector] | None = None,
    exclude: Selector | Iterable[Selector] | None = None,
    report: bool = False,
) -> Any:
    """Defer the weight gradients of every registered module of ``model``, in place.

    ``include`` / ``exclude`` take module types (exact) and qualified-name patterns
    (``fnmatch``, e.g. ``"layer4.*"``), one alone or several in a list. Returns ``model``, or a
    :class:`PatchReport` when ``report=True``. Patching twice changes nothing.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"twobp: patch expects an nn.Module, got {type(model).__name__}")
    include = _selectors("include", include) if include is not None else None
    exclude = _selectors("exclude", exclude or ())
    check_not_inside_ddp(model)
    _install_guards()
    result = PatchReport(model)
    for name, module in model.named_modules():
        if (include is not None and not _selected(name, module, include)) or _selected(name, module, exclude):
            if _is_patched(module):
                result.skipped[name] = _PATCHED_BEFORE
            continue
        if _is_patched(module):
            rule = rule_for(module)
            call = module.__dict__[_CALL]
            unchanged = type(module).forward is call.class_forward and "forward" in module.__dict__
            if call.owner() is not module:  # a shallow copy not called yet: a call of its own
                _adopt(module, call)
            if unchanged and call.computes_as_its_rule(module) and (rule is None or rule.stands_for(module)):
                # Patched before (its class may have changed since: a parametrization's subclass).
                result.patched.append(name)
                continue
            _unpatch_module(module)  # its class or forward changed, or its forward was deleted: again
        rule = rule_for(module)
        if rule is None:
            if any(True for _ in module.parameters(recurse=False)):
                # A parametrization's generated class is one per module: no class to register.
                result.skipped[name] = unregistered_why(module_class(module), suggest=not is_parametrized(module))
            continue
        reason = rule.unsupported(module)
        if reason is None and isinstance(inspect.getattr_static(type(module), "forward", None), _UNBOUND):
            # The patched call's plain path, and the recompute rule, call the class's forward
            # with the module as its first argument, as a method.
            reason = _STATIC_FORWARD
        if reason is None and not rule.stands_for(module):
            reason = _REPLACED_FORWARD
        if reason is None and module.__dict__.get("forward") is not None:
            # Its own instance forward (a wrapper: accelerate's hooks, a user's) would be bypassed
            # by the deferred forward, which computes what the class's forward does.
            reason = _INSTANCE_FORWARD
        if reason is not None:
            result.skipped[name] = reason
            warn_once(
                ("patch", type(module), reason),
                f"twobp: {type(module).__name__} with {reason} is not deferred; it keeps plain "
                "autograd (correct gradients, computed in backward).",
                stacklevel=2,
            )
            continue
        call = DeferredForwardCall(module, rule.forward)
        module.forward = call
        module.__dict__[_CALL] = call
        module.__dict__[_COPIES] = call._copies
        result.patched.append(name)
    still = [name or "<root>" for name, why in result.skipped.items() if why is _PATCHED_BEFORE]
    if still:
        warnings.warn(f"twobp: {', '.join(still)}: {_PATCHED_BEFORE}", stacklevel=2)
    if not result.patched:
        _warn_nothing_covered(model, result)
    return result if report else model


def _warn_nothing_covered(model: nn.Module, result: PatchReport) -> None:
    """A model none of whose layers is of a registered type defers nothing: say so once per
    root type and layer types (a stage that ``torch.distributed.pipelining.pipeline()`` traced holds
    ``InterpreterModule``s calling ATen ops, no nn.Linear left to patch)."""
    reasons = result.skipped.values()
    unregistered = sorted({why.split(" is not registered")[0] for why in reasons if "is not registered" in why})
    if not unregistered:
        return
    warn_once(
        ("nothing covered", type(model), ", ".join(unregistered)),
        f"twobp: patch() found no layer it covers in this {type(model).__name__} (its parameters sit "
        f"in {', '.join(unregistered[:4])}): nothing is deferred. Register a rule for such layers "
        "(twobp.register), or patch the model built from nn.Linear, nn.Conv*, norm, attention and "
        "embedding modules (a pipeline stage traced by torch.distributed.pipelining.pipeline() "
        "calls ATen ops instead: build the stages from your own modules).",
        stacklevel=3,
    )


def _class_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return _bound_class_forward(module)(*args, **kwargs)


def _bound_class_forward(module: nn.Module) -> Any:
    """The class's forward bound as ``module.forward`` would bind it, past the instance's own:
    one made a staticmethod or classmethod since ``patch`` takes no module argument."""
    cls = type(module)
    return inspect.getattr_static(cls, "forward").__get__(module, cls)


def unpatch(model: nn.Module) -> nn.Module:
    """Restore plain autograd on every patched module of ``model``. Returns ``model``. (Under a
    wrapper added since patching, the deferred forward stays where the wrapper calls it, and runs
    the plain forward from now on.)"""
    from .checkpoint_paths import deferred_in_live_checkpoints

    if not isinstance(model, nn.Module):
        raise TypeError(f"twobp: unpatch expects an nn.Module, got {type(model).__name__}")
    pending = deferred_in_live_checkpoints(m for m in model.modules() if _is_patched(m))
    if pending:
        raise RuntimeError(
            "twobp: unpatch() between an activation checkpoint's forward and its backward "
            f"({type(pending[0]).__name__} deferred in the checkpointed forward): its recomputation "
            "would run plain autograd and hand plain's saved tensors to the deferred path's nodes. Run "
            "that backward first (or drop its graph: its output, or, for a checkpointed forward that "
            "raised, the exception and its traceback), then unpatch."
        )
    for module in model.modules():
        _unpatch_module(module)
    return model


def _unpatch_module(module: nn.Module) -> None:
    """Restore plain autograd on ``module`` alone (not its children)."""
    call = module.__dict__.pop(_CALL, None)
    module.__dict__.pop(_COPIES, None)
    if isinstance(call, DeferredForwardCall):
        if call.owner() is module:  # not a shallow copy sharing the original's call
            call.deferred = _class_forward
        else:
            # A copy unpatched under a wrapper made on it, which calls the shared call for it: it
            # computes with its own parameters in plain, which that call can no longer tell.
            forward, original = module.__dict__.get("forward"), call.owner()
            if forward is not None and forward is not call and (
                original is None or forward is not original.__dict__.get("forward")
            ):
                call.wrapped_by_copies = True
        if module.__dict__.get("forward") is call:
            del module.forward
