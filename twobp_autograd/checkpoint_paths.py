"""A non-reentrant activation checkpoint runs its region again in backward and hands what that
recomputation saves to the forward's graph by position, checking only shapes and dtypes. A
patched module saves other tensors on its deferred path than on its plain one, and which it
takes follows ``train()``/``eval()`` and frozen parameters: a mode switched between forward and
backward would hand one path's tensors to the other's nodes, silently where the shapes coincide
(square Linear layers). So each patched call under a checkpoint records on the checkpoint's
frame which path it took, and its recomputation takes the same one.

A checkpoint nested in another is made anew each time the outer one is recomputed: that new
frame is linked to the one made by the same call in the outer forward (the k-th checkpoint made
inside a frame's forward and the k-th made inside its recomputation), and its calls take that
frame's recorded paths. (A selective outer checkpoint checks every op of its recomputation,
the nested region's too, against its forward's.)

The frame is found through the saved-tensor hooks ``torch.utils.checkpoint`` pushes, and a new
frame's enclosing one through its hook's construction (private: ``tests/test_checkpointing.py``
fails if PyTorch changes them). Under other saved-tensor hooks pushed inside the region
(``save_on_cpu`` inside it) the frame cannot be seen, and a call takes the path its module's
mode says.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Hashable, Iterable
from typing import Any

import torch
import torch.utils.checkpoint

__all__ = [
    "CallRecord",
    "record_under_checkpoint",
    "enter_call",
    "leave_call",
    "took_plain",
    "recorded_so_far",
    "forget_since",
    "link_nested_frames",
    "deferred_in_live_checkpoints",
    "replaying_deferred",
    "saved_through_user_hooks",
    "refuse_recomputation_in_eval",
]


class CallRecord:
    """One patched call of a checkpointed forward: its module and whether it deferred, as it
    ended (a rule may fall back to plain autograd after the call chose to defer)."""

    __slots__ = ("origin", "deferred", "replaying")

    def __init__(self, origin: int, deferred: bool, replaying: bool = False) -> None:
        self.origin, self.deferred, self.replaying = origin, deferred, replaying


def _origin(module: Any) -> int:
    """What a call's module is, for its recomputation: its parameters' dict, which its shallow
    copies share (a ``copy.copy`` made inside the checkpointed function is a new object each run)."""
    return id(module.__dict__.get("_parameters", module))


#: Per checkpoint frame, a record of each patched call of its forward, in order.
_paths: weakref.WeakKeyDictionary[Any, list[CallRecord]] = weakref.WeakKeyDictionary()
#: Per checkpoint frame, per backward (graph task) recomputing it, how many of those calls ran again.
_replayed: weakref.WeakKeyDictionary[Any, dict[Hashable, int]] = weakref.WeakKeyDictionary()
#: Per checkpoint frame, the checkpoints made inside its forward (or, for a frame made again, inside
#: its run), in order; and per frame and recomputing backward, how many were made again there.
_children: weakref.WeakKeyDictionary[Any, list[weakref.ref[Any]]] = weakref.WeakKeyDictionary()
_children_made_again: weakref.WeakKeyDictionary[Any, dict[Hashable, int]] = weakref.WeakKeyDictionary()
#: A checkpoint frame made again by an enclosing checkpoint's recomputation -> the frame the same
#: call made in the forward, whose recorded paths its calls take.
_twins: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
#: The records of the patched calls in progress on each thread, innermost last.
_in_progress = threading.local()

_top_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks


def record_under_checkpoint(module: Any, deferred: bool) -> CallRecord | None:
    """For a patched call with grad enabled, ``deferred`` being what its module's mode says:
    None outside a non-reentrant checkpoint; in its forward, the call's new record; in its
    recomputation, the forward's record of the same call (marked ``replaying``), whose path the
    call takes. A recomputation whose calls are not its forward's (the model patched or
    unpatched in between) is refused: the checkpoint would hand one path's tensors to the other's."""
    found = _innermost_frame()
    if found is None:
        return None
    frame, recomputing = found
    twin = _twins.get(frame) if recomputing is None else None
    if twin is not None:  # a nested checkpoint made again: its calls follow the forward's twin
        index, recorded = len(_paths.get(frame, ())), _paths.get(twin, ())
        if index < len(recorded) and recorded[index].origin == _origin(module):
            path = recorded[index]
            _paths.setdefault(frame, []).append(CallRecord(path.origin, path.deferred))  # for its own recomputation
            return CallRecord(path.origin, path.deferred, replaying=True)
        if index >= len(recorded) and not getattr(twin, "forward_completed", True):
            return None
        # Made again with other calls than its twin's (a flag or mode its region reads changed): this
        # frame's graph is discarded (its twin's recomputation and the enclosing one's checks are
        # plain's), so it is no longer linked and records afresh, as any checkpoint's forward.
        del _twins[frame]
    if recomputing is None:
        record = CallRecord(_origin(module), deferred)
        _paths.setdefault(frame, []).append(record)
        return record
    counts = _replayed.setdefault(frame, {})
    index = counts.get(recomputing, 0)
    counts[recomputing] = index + 1
    recorded = _paths.get(frame, ())
    if index >= len(recorded) and not getattr(frame, "forward_completed", True):
        # Recomputed from inside its own forward (autograd.grad in the checkpointed function,
        # no early stop): the calls past where the forward stands are not its to check.
        return None
    if index >= len(recorded) or recorded[index].origin != _origin(module):
        raise RuntimeError(
            "twobp: an activation checkpoint's recomputation runs other patched calls than its forward "
            f"did (a {type(module).__name__} here): the model was patched or unpatched, or a module "
            "swapped, between the checkpointed forward and its backward. Do that before the forward, "
            "or after the backward."
        )
    return CallRecord(recorded[index].origin, recorded[index].deferred, replaying=True)


def _note_new_frame(frame: Any) -> None:
    """A checkpoint frame is being made: under another checkpoint, link it to its place there
    (see the module's docstring). The enclosing checkpoint's hooks are still on top."""
    found = _innermost_frame()
    if found is None:
        return
    parent, recomputing = found
    if recomputing is None:
        siblings = _children.setdefault(parent, [])
        index = len(siblings)
        siblings.append(weakref.ref(frame))
        parent_twin = _twins.get(parent)
        originals = _children.get(parent_twin, []) if parent_twin is not None else []
    else:
        counts = _children_made_again.setdefault(parent, {})
        index = counts.get(recomputing, 0)
        counts[recomputing] = index + 1
        originals = _children.get(parent, [])
    original = originals[index]() if index < len(originals) else None
    if original is not None:
        _twins[frame] = original


def link_nested_frames() -> None:
    """Have ``torch.utils.checkpoint``'s hook tell :func:`_note_new_frame` of each frame it is
    made for (once per process)."""
    hook_class = getattr(torch.utils.checkpoint, "_checkpoint_hook", None)
    make = getattr(hook_class, "__init__", None)
    if hook_class is None or make is None or getattr(make, _LINKS, False):
        return

    @functools.wraps(make)
    def linking(self: Any, frame: Any, *args: Any, **kwargs: Any) -> None:
        _note_new_frame(frame)
        make(self, frame, *args, **kwargs)

    setattr(linking, _LINKS, True)
    hook_class.__init__ = linking


_LINKS = "twobp_links_nested_frames"


def deferred_in_live_checkpoints(modules: Iterable[Any]) -> list[Any]:
    """Those of ``modules`` of which a non-reentrant checkpoint whose graph is alive recorded a
    deferred call in its forward: its recomputation would run that call on the deferred path."""
    origins = _deferred_origins_in_live_checkpoints()
    return [module for module in modules if _origin(module) in origins] if origins else []


def _deferred_origins_in_live_checkpoints() -> set[int]:
    """The origins of the deferred calls recorded by every live checkpoint frame: one whose
    forward raised too (a tensor it made may have escaped, and its recomputation stops early,
    before the error), and one whose forward runs on another thread now."""
    return {record.origin for records in list(_paths.values()) for record in records if record.deferred}


def enter_call(record: CallRecord) -> None:
    """The call of ``record`` is in progress (see :func:`took_plain`) until :func:`leave_call`."""
    _in_progress.__dict__.setdefault("records", []).append(record)


def leave_call() -> None:
    _in_progress.records.pop()


def took_plain(module: Any) -> None:
    """``module``'s patched call in progress runs on plain autograd after all: under a
    checkpoint, its forward's record says so, for its recomputation; a recomputation of a call
    that deferred cannot follow (what the rule found changed since: hooks added), and is refused."""
    stack = getattr(_in_progress, "records", None)
    if not stack or stack[-1].origin != _origin(module):
        return
    record = stack[-1]
    if not record.replaying:
        record.deferred = False
    elif record.deferred:
        raise RuntimeError(
            "twobp: an activation checkpoint's recomputation found a patched module that deferred in "
            "the checkpointed forward now on plain autograd (hooks added, or its inputs or state "
            "changed, between that forward and its backward): the checkpoint would hand plain's "
            "saved tensors to the deferred path's nodes. Add or remove such hooks before the forward "
            "or after the backward."
        )


def refuse_recomputation_in_eval(module: Any, computes: str) -> None:
    """For a rule that computes training's op whatever the mode, called in eval(): only a
    checkpoint's recomputation of a call that deferred in training gets there (the mode switched
    between the forward and its backward). Plain's recomputation would compute in eval, which
    ``computes`` otherwise, and its checkpoint refuses what it saves then; replaying training's
    op instead gave the forward's gradients and updated running statistics a second time."""
    raise torch.utils.checkpoint.CheckpointError(
        f"twobp: an activation checkpoint recomputes a {type(module).__name__} that ran in train() in "
        f"its forward and is in eval() now, where it {computes}: the recomputation is not the "
        "forward (plain PyTorch's checkpoint refuses it too). Switch modes after the backward."
    )


def replaying_deferred(module: Any) -> bool:
    """Whether ``module``'s call in progress recomputes, for a checkpoint, a call that deferred in
    its forward: it must take the deferred path again (a per-module verdict made since, by a later
    call outside the region, does not apply to it)."""
    stack = getattr(_in_progress, "records", None)
    if not stack:
        return False
    record = stack[-1]
    return bool(record.origin == _origin(module) and record.replaying and record.deferred)


def _innermost_frame() -> tuple[Any, Hashable | None] | None:
    """The checkpoint whose saved-tensor hooks are on top, as :func:`checkpoint_frame` tells it."""
    hooks = _top_saved_tensors_hooks(True)
    if hooks is None or not _of_a_checkpoint(hooks[0]):
        return None
    return checkpoint_frame(hooks[0])


def saved_through_user_hooks() -> bool:
    """Whether a tensor saved now is packed by saved-tensor hooks other than an activation
    checkpoint's (``save_on_cpu``, a lossy pack to fp16 or int8), which may unpack other values:
    a rule then saves the very tensors plain saves, not others it would derive them from."""
    hooks = _top_saved_tensors_hooks(True)
    return hooks is not None and not _of_a_checkpoint(hooks[0])


def _of_a_checkpoint(pack_hook: Any) -> bool:
    return bool(getattr(pack_hook, "_checkpoint_internal", False))


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
    found = _innermost_frame()
    if found is None or found[1] is not None:
        return None
    return found[0], len(_paths.get(found[0], ()))


def forget_since(mark: tuple[Any, int] | None) -> None:
    if mark is not None:
        frame, length = mark
        del _paths.get(frame, [])[length:]
