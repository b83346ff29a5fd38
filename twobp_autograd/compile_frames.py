"""Keep ``torch.compile`` from compiling this package's own functions as frames of their own.

A patched layer's autograd Function ends Dynamo's graph (a custom ``jvp``, a backward that
queues work), and Dynamo compiles each function it then enters eagerly as a frame of its own:
so this package's helpers became graphs of a few ops, each guarded on the shapes of the
parameters it saw, compiled again for every layer shape until Dynamo's limit of 8 (ResNet-152's
convolutions reached it) and guard-checked on every call. None of them holds work that
compiling speeds up (their kernels are single ATen calls), so their code runs eagerly when
entered as a frame; where Dynamo traces a caller, it still inlines them as before.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch
from torch._dynamo.eval_frame import skip_code

__all__ = ["keep_own_frames_eager", "end_graph_from_an_eager_frame", "OWN_WRAPPED"]

#: The attribute a wrapper of the package's own names the function it wraps by (not
#: ``__wrapped__``, which inspect.signature would follow to the wrapped function's arguments).
OWN_WRAPPED = "twobp_wraps"

_PACKAGE = __name__.rpartition(".")[0]
_done: set[str] = set()  # the modules whose code is marked already
_OWN_FILES: set[str] = set()  # their source files


def keep_own_frames_eager() -> None:
    """Mark the code of every function of the package's loaded modules (nested ones included)."""
    for name, module in list(sys.modules.items()):
        if module is None or name in _done or not (name == _PACKAGE or name.startswith(_PACKAGE + ".")):
            continue
        _done.add(name)
        _OWN_FILES.add(getattr(module, "__file__", None) or "")
        for value in list(vars(module).values()):
            _mark(value, name)


def end_graph_from_an_eager_frame(reason: str) -> None:
    """Called eagerly with Dynamo's frame callback set (a patched module compiled directly: its
    own call, like all of this package's, runs eagerly): Dynamo compiles this one frame, which
    ends its graph at once with ``reason``, so ``fullgraph=True`` fails with that reason rather
    than on whichever frame below Dynamo would reach first. (Not marked: see :func:`_mark`.)"""
    torch._dynamo.graph_break(msg=reason)


def _mark(value: Any, module: str) -> None:
    if value is end_graph_from_an_eager_frame:
        return
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    # A wrapper of the package's own (a Function's forward, see deferral.sees_post_hooks), found
    # on a class of another module: what it runs is held in its closure, where no vars reach it.
    own_wrapped = getattr(value, OWN_WRAPPED, None) if isinstance(value, types.FunctionType) else None
    if own_wrapped is not None:
        _mark(own_wrapped, own_wrapped.__module__)
    if isinstance(value, types.FunctionType) and value.__module__ == module:
        # A decorator's wrapper (functools.wraps copies __module__: contextmanager's, a cache's)
        # is other code, shared by everything it wraps: what it wraps is the package's.
        wrapped = value.__dict__.get("__wrapped__")
        while value.__code__.co_filename not in _OWN_FILES and isinstance(wrapped, types.FunctionType):
            value, wrapped = wrapped, wrapped.__dict__.get("__wrapped__")
        if value.__code__.co_filename in _OWN_FILES:
            _mark_code(value.__code__)
    elif isinstance(value, type) and value.__module__ == module:
        for attribute in list(vars(value).values()):
            _mark(attribute, module)


def _mark_code(code: types.CodeType) -> None:
    skip_code(code)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):  # a nested function's, a comprehension's
            _mark_code(constant)
