"""A non-reentrant activation checkpoint runs its region again in backward and hands what that
recomputation saves to the forward's graph by position, checking only shapes and dtypes. A
patched module saves other tensors on its deferred path than on its plain one, and which it
takes follows ``train()``/``eval()`` and frozen parameters: a mode switched between forward and
backward would hand one path's tensors to the other's nodes, silently where the shapes coincide
(square Linear layers). So each patched call under a checkpoint records on the checkpoint's
frame which path it took, and its recomputation takes the same one.

The frame is found through the saved-tensor hooks ``torch.utils.checkpoint`` pushes (private:
``tests/test_checkpointing.py`` fails if PyTorch changes them). Under other saved-tensor hooks
pushed inside the region (``save_on_cpu`` inside it) the frame cannot be seen, and a call takes
the path its module's mode says.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable
from typing import Any

import torch

__all__ = ["path_under_checkpoint", "recorded_so_far", "forget_since"]

#: Per checkpoint frame, the path (deferred or not) of each patched call of its forward, in order.
_paths: weakref.WeakKeyDictionary[Any, list[bool]] = weakref.WeakKeyDictionary()
#: Per checkpoint frame, per backward (graph task) recomputing it, how many of those calls ran again.
_replayed: weakref.WeakKeyDictionary[Any, dict[Hashable, int]] = weakref.WeakKeyDictionary()

_top_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks


def path_under_checkpoint(deferred: bool) -> bool:
    """Whether a patched call with grad enabled defers: ``deferred`` (what its module's mode
    says) outside a non-reentrant checkpoint and in its forward, where it is recorded; in its
    recomputation, what the same call of the forward did."""
    hooks = _top_saved_tensors_hooks(True)
    if hooks is None or not getattr(hooks[0], "_checkpoint_internal", False):
        return deferred
    found = checkpoint_frame(hooks[0])
    if found is None:
        return deferred
    frame, recomputing = found
    if recomputing is None:
        _paths.setdefault(frame, []).append(deferred)
        return deferred
    counts = _replayed.setdefault(frame, {})
    index = counts.get(recomputing, 0)
    counts[recomputing] = index + 1
    recorded = _paths.get(frame, ())
    return recorded[index] if index < len(recorded) else deferred


def checkpoint_frame(pack_hook: Any) -> tuple[Any, Hashable | None] | None:
    """The checkpoint frame a pack hook of ``torch.utils.checkpoint`` belongs to, with the id of
    the backward recomputing it (None in the forward); None for another hook."""
    closure = _closure(pack_hook)
    if "frame" in closure:  # _checkpoint_hook: the forward
        return closure["frame"], None
    frame_ref, recomputing = closure.get("target_frame_ref"), closure.get("gid")
    frame = frame_ref() if isinstance(frame_ref, weakref.ref) else None  # _recomputation_hook
    return None if frame is None else (frame, recomputing)


def _closure(function: Any) -> dict[str, Any]:
    function = getattr(function, "__wrapped__", function)  # the recomputation's is wrapped by Dynamo's disable
    code, cells = getattr(function, "__code__", None), getattr(function, "__closure__", None) or ()
    return {} if code is None else dict(zip(code.co_freevars, (cell.cell_contents for cell in cells), strict=False))


def recorded_so_far() -> tuple[Any, int] | None:
    """Where the innermost checkpoint's forward record stands (None outside one, or in its
    recomputation): a call that runs its forward again after a discarded attempt (the recompute
    rule's first call turning out unreplayable) forgets the attempt's records with
    :func:`forget_since`, as its recomputation runs the forward once."""
    hooks = _top_saved_tensors_hooks(True)
    if hooks is None or not getattr(hooks[0], "_checkpoint_internal", False):
        return None
    found = checkpoint_frame(hooks[0])
    if found is None or found[1] is not None:
        return None
    return found[0], len(_paths.get(found[0], ()))


def forget_since(mark: tuple[Any, int] | None) -> None:
    if mark is not None:
        frame, length = mark
        del _paths.get(frame, [])[length:]
