"""Backward-p2: run taken jobs, grouped per layer, into ``.grad``.

A flush groups the jobs that share a kernel, parameters and trailing shapes, concatenates their
micro-batches on dimension 0 where that pays and runs the kernel once per group (else once per
micro-batch, summed in each parameter's dtype), then hands the sums to autograd's own gradient
accumulation, so ``.grad`` ends exactly as plain backward would leave it (``None`` handling,
dtype, layout, tensor hooks and post-accumulate hooks included).

:class:`FlushOptions` is how a queue, a data-parallel synchroniser or a pipeline adapter says
how to run them: one entry point, :func:`run_jobs`, so a new option is added once.
"""

from __future__ import annotations

import contextlib
import numbers
import os
import sys
import threading
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Protocol

import torch
from torch import Tensor
from torch.autograd.graph import _engine_run_backward
from torch.utils.hooks import RemovableHandle

from .job import WeightGradJob
from .streams import LaunchedGroups
from .warn_once import warn_once

__all__ = [
    "accumulated_dtype",
    "FlushStrategy",
    "FlushOptions",
    "run_jobs",
    "DeliveryWatch",
    "FlushWatcher",
    "PartlyDelivered",
    "partly_delivered",
    "watch_flushes",
    "summed_over_backward_calls",
    "undelivered",
    "forget_deliveries",
    "has_user_hooks",
    "hooks_at_backward",
    "OWN_HOOK_MARK",
    "READS_ONLY_MARK",
    "may_change_in_backward",
    "reads_grad_only",
]

FlushStrategy = Literal["concat", "loop", "auto"]


@dataclass(frozen=True)
class FlushOptions:
    """How a flush runs its jobs (see :class:`twobp_autograd.WeightGradQueue` for each)."""

    strategy: FlushStrategy = "auto"
    max_concat_bytes: int = 1 << 30
    delivery_bucket_bytes: int | None = None
    weight_grad_streams: int = 1

    def __post_init__(self) -> None:
        if self.strategy not in ("concat", "loop", "auto"):
            raise ValueError(f"twobp: strategy must be 'concat', 'loop' or 'auto', not {self.strategy!r}")
        check_count("max_concat_bytes", self.max_concat_bytes, least=0, whole_floats=True)
        if self.delivery_bucket_bytes is not None:
            check_count("delivery_bucket_bytes", self.delivery_bucket_bytes, least=1, whole_floats=True)
        check_count("weight_grad_streams", self.weight_grad_streams, least=1)


def check_count(name: str, value: object, *, least: int, whole_floats: bool = False) -> None:
    """A ``twobp:`` ValueError unless ``value`` is an integer (numpy's too; with ``whole_floats``
    a whole float, as byte counts are often written: ``25e6``) of at least ``least``."""
    whole = whole_floats and isinstance(value, float) and value.is_integer()
    if not whole and (isinstance(value, bool) or not isinstance(value, numbers.Integral)) or value < least:  # type: ignore[operator]
        raise ValueError(f"twobp: {name} must be an int >= {least}, not {value!r}")


class PartlyDelivered(RuntimeError):
    """A flush failed while or after handing its gradients over: part of them may be in
    ``.grad``, the rest of its work is dropped (queued again, it would be added twice on a retry)."""


_PARTLY_DELIVERED = "_twobp_partly_delivered"


def partly_delivered(error: BaseException) -> bool:
    """Whether ``error`` ended a flush after part of its gradients reached ``.grad``."""
    return isinstance(error, PartlyDelivered) or getattr(error, _PARTLY_DELIVERED, False)


class DeliveryWatch(Protocol):
    """Told by one flush which gradients are final (in ``.grad``), and when it has ended;
    asked whether handing over the gradients now final would complete something it waits for
    (then they go at once, one hand-over for all; else they wait for the next such moment or
    the end: each hand-over is an engine run)."""

    def completes(self, params: Sequence[Tensor]) -> bool: ...

    def holds_back(self, param: Tensor) -> bool:
        """Asked at an early flush (a capped queue's) for each gradient before it is handed over:
        True keeps it from ``.grad`` and back in the queue, as finished work for the next flush
        (FSDP2: a reduction that every rank must run at once cannot follow one rank's cap)."""
        ...

    def delivered(self, params: Sequence[Tensor]) -> None: ...

    def finished(self) -> None: ...

    def abandoned(self) -> None:
        """The flush failed after handing part of its gradients over and drops the rest: drop
        what is held for it (FSDP2: gradients of groups not reduced yet)."""
        ...


#: ``watcher(params, early)``, asked as each flush starts with the parameters it will deliver and
#: whether it is an early flush (a capped queue's): a :class:`DeliveryWatch` to follow it, or None.
FlushWatcher = Callable[[Sequence[Tensor], bool], "DeliveryWatch | None"]

_watchers: list[tuple[FlushWatcher, Callable[[], bool]]] = []


def _always() -> bool:
    return True


def watch_flushes(watcher: FlushWatcher, *, active: Callable[[], bool] = _always) -> Callable[[], None]:
    """Ask ``watcher`` at the start of every flush (e.g. FSDP2's reduction, which must follow
    each parameter group's gradients as they become final) for which ``active()`` holds (a cheap
    question: every flush asks it). A flush with a watch hands the gradients over as soon as one
    of its watches says they complete something, instead of in buckets. Returns what stops it."""
    entry = (watcher, active)
    _watchers.append(entry)
    return lambda: _watchers.remove(entry)


_DEFAULT_OPTIONS = FlushOptions()  # frozen: one shared instance is safe as a default


def run_jobs(
    jobs: Sequence[WeightGradJob], options: FlushOptions = _DEFAULT_OPTIONS, *, early: bool = False
) -> list[tuple[Tensor, Tensor]]:
    """Run ``jobs`` grouped per layer and accumulate the results into ``.grad`` via autograd.

    A parameter's gradient is delivered once its last group has run: all at the end, or with
    ``options.delivery_bucket_bytes`` in buckets of about that size while later groups still
    run. ``options.weight_grad_streams`` > 1: every group's kernels are launched first, spread
    over that many CUDA side streams, then summed and delivered in order (:mod:`.streams`).
    Returns ``(param, gradient)`` for the gradients an ``early`` flush's watches held back
    (:meth:`DeliveryWatch.holds_back`): for the caller to queue again."""
    held: list[tuple[Tensor, Tensor]] = []
    if not jobs:
        return held
    if torch.is_inference_mode_enabled():
        # Made in inference mode, every new .grad would be an inference tensor, which the next
        # in-place update (accumulation, clipping, zero_grad(set_to_none=False)) refuses: the
        # gradients are made as the backward that queued them would have made them.
        with torch.inference_mode(False):
            return run_jobs(jobs, options, early=early)
    snapshots: dict[int, tuple[tuple[int, Any], ...]] = {}  # id(param) -> its hooks in its last backward
    any_snapshot = False
    for job in jobs:
        job.check_unmodified()
        any_snapshot = any_snapshot or job.hooks_at_backward is not None
    if any_snapshot:
        # Per parameter, the hooks of the last job computing for it (queue order): a later job
        # without a snapshot had no user hook in its backward (()), and a parameter that
        # zero_grad dropped from a job (job.params None there) takes nothing from that job.
        changed = False
        for job in jobs:
            for param, hooks in zip(job.params, _hooks_of(job), strict=True):
                if param is not None:
                    changed = changed or snapshots.get(id(param), hooks) != hooks
                    snapshots[id(param)] = hooks
        if changed:
            _warn_hooks_changed_once()
    groups = _grouped(jobs)
    last_group: dict[int, int] = {}  # id(param) -> the last group computing for it
    hooked = any(snapshots.values())
    for index, group in enumerate(groups):
        for param in group[0].params:
            if param is not None:
                last_group[id(param)] = index
                hooked = hooked or has_user_hooks(param)
    # Lists, not generators, for any(): a generator costs more than asking each (cheap) question.
    watches = _watches_for(groups, early) if _watchers and any([active() for _, active in _watchers]) else []
    # Per group, as plain autograd checks the nodes of backwards run under anomaly mode only (or
    # every group, where the flush itself runs under it).
    check_all = torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled()
    check_some = check_all or any([job.check_nan for job in jobs])
    delivery = _HookedDelivery(groups, snapshots) if hooked else None
    deliver = delivery.deliver if delivery is not None else _deliver
    if delivery is not None:
        _hooked_flushes.append(delivery)

    summing: dict[int, tuple[Tensor, _Sum]] = {}  # id(param) -> (param, gradient so far)
    ready: list[tuple[Tensor, Tensor]] = []
    ready_bytes = 0
    bucket_bytes = options.delivery_bucket_bytes
    # Hooks may change a parameter once its gradient is handed over (an optimizer step in them):
    # where that happens before the last group, a later group reading the parameter's memory must
    # have run first, as plain's backward ran it before the parameter's accumulation.
    read_later = _read_by_later_groups(groups, last_group) if delivery is not None and (bucket_bytes or watches) else {}
    waiting: list[tuple[Tensor, Tensor]] = []  # ready, handed over after the groups reading them
    handed_over = False
    grad_was_enabled = torch.is_grad_enabled()
    try:
        torch._C._set_grad_enabled(False)  # torch.no_grad() costs a microsecond more per flush
        try:
            launched = None
            if options.weight_grad_streams > 1:
                launched = LaunchedGroups(
                    [(group[0].device, [t for job in group for t in job.tensors()]) for group in groups],
                    lambda index: _run_group(groups[index], options),
                    options.weight_grad_streams,
                )
            for index, group in enumerate(groups):
                grads = _run_group(group, options) if launched is None else launched.take(index)
                if check_some and (check_all or any(job.check_nan for job in group)):
                    _refuse_nan(group[0], grads)
                readied = len(ready)
                _take_group_grads(group[0].params, grads, index, last_group, summing, ready)
                del grads
                if delivery is not None:
                    delivery.forget_undeliverable(group[0].params, index, last_group, ready[readied:])
                if read_later:
                    _wait_for_readers(ready, readied, waiting, read_later, index)
                if bucket_bytes is not None:
                    ready_bytes += sum(param.numel() * param.element_size() for param, _ in ready[readied:])
                if early:
                    _hold_back(ready, watches, held)
                bucket_full = bucket_bytes is not None and ready_bytes >= bucket_bytes
                if ready and (bucket_full or _completes_a_watch(ready, watches)):
                    handed_over = True
                    deliver(ready, watches)
                    ready_bytes = 0
        finally:
            torch._C._set_grad_enabled(grad_was_enabled)
        # From here a failure (a hook raising) may leave part of the gradients in .grad.
        handed_over = handed_over or bool(ready)
        deliver(ready, watches)
        # Inside: a watch's end (FSDP2's last reductions and their wait) may fail with every
        # gradient in .grad already; queued again, the work would be added twice.
        for watch in watches:
            watch.finished()
    except BaseException as error:
        if handed_over:
            for watch in watches:
                try:
                    watch.abandoned()
                except Exception as cleanup:  # the flush's own failure is the one to report
                    if hasattr(error, "add_note"):  # Python 3.11 and later
                        error.add_note(f"twobp: dropping what a flush watch held failed too: {cleanup!r}")
        if handed_over and not isinstance(error, Exception):
            # KeyboardInterrupt, SystemExit: keep the exception as it is, but say that part of
            # the work is in .grad, so that the caller drops the rest instead of queueing it again.
            setattr(error, _PARTLY_DELIVERED, True)
            if hasattr(error, "add_note"):  # Python 3.11 and later
                error.add_note(
                    "twobp: the flush was interrupted after part of its gradients reached .grad; the "
                    "rest is dropped. optimizer.zero_grad() and run the step again."
                )
            raise
        if handed_over:
            hooks_ran = (
                " The post-accumulate-grad hooks of the parameters handed over have run: an optimizer "
                "stepping in them (optimizer-in-backward) has stepped those parameters, which running the "
                "step again steps twice (restore them and the optimizer's state first, from a checkpoint)."
                if delivery is not None
                else ""
            )
            raise PartlyDelivered(
                "twobp: a flush failed while handing its gradients over (a hook raised, or after a "
                "delivery bucket or FSDP2's reduction group by group): .grad may hold part of that "
                "work and the rest is dropped. Zero the gradients (optimizer.zero_grad()) and run the "
                f"step again.{hooks_ran} The failure: {getattr(error, 'problem', error)}"
            ) from error
        raise
    finally:
        if delivery is not None:
            _hooked_flushes.remove(delivery)  # by identity: a delivery compares as itself only
    for job in jobs:
        job.delivered = True
    return held


def _grouped(jobs: Sequence[WeightGradJob]) -> list[list[WeightGradJob]]:
    """``jobs`` grouped by kernel group, parameters, trailing shapes and autocast dtype: each
    group can be one kernel call (a flush of one job, one layer's, needs no grouping)."""
    if len(jobs) == 1:
        return [list(jobs)]
    grouped: dict[Hashable, list[WeightGradJob]] = {}
    for job in jobs:
        shapes = tuple([(t.shape[1:], t.dtype, t.device, t.layout) for t in job.tensors()])
        grouped.setdefault((job.group, tuple(map(id, job.params)), shapes, job.autocast), []).append(job)
    return list(grouped.values())


def _hold_back(
    ready: list[tuple[Tensor, Tensor]], watches: Sequence[DeliveryWatch], held: list[tuple[Tensor, Tensor]]
) -> None:
    """Move from ``ready`` to ``held`` the gradients a watch holds back (in place)."""
    if not watches or not ready:
        return
    kept: list[tuple[Tensor, Tensor]] = []
    for pair in ready:
        (held if any(watch.holds_back(pair[0]) for watch in watches) else kept).append(pair)
    ready[:] = kept


class _HookedDelivery:
    """A flush to parameters with post-accumulate-grad hooks, which may read ``.grad`` or step
    an optimizer while the flush hands gradients over: it tracks which gradients have arrived
    (:func:`undelivered`), and remembers which backward calls each delivery came from
    (:func:`summed_over_backward_calls`)."""

    def __init__(self, groups: list[list[WeightGradJob]], snapshots: dict[int, tuple[tuple[int, Any], ...]]) -> None:
        self.snapshots = snapshots  # id(param) -> its hooks as its last backward saw them
        calls: dict[int, set[int]] = {}
        hooked: dict[int, set[int]] = {}
        for group in groups:
            for job in group:
                for param, hooks in zip(job.params, _hooks_of(job), strict=True):
                    if param is not None:
                        calls.setdefault(id(param), set()).add(job.task)
                        if hooks:
                            hooked.setdefault(id(param), set()).add(job.task)
        self.pending = set(calls)  # id(param): gradients not handed over yet
        self.thread = threading.get_ident()  # the flush's (a forked child has the forking one alone)
        self.tasks = {key: frozenset(tasks) for key, tasks in calls.items()}  # -> its work's backward calls
        self.hooked_tasks = {key: frozenset(tasks) for key, tasks in hooked.items()}  # -> those with a user's hook

    def forget_undeliverable(
        self,
        params: Sequence[Tensor | None],
        index: int,
        last_group: dict[int, int],
        readied: list[tuple[Tensor, Tensor]],
    ) -> None:
        """A parameter whose last group (group ``index``, which ``readied`` what it made ready)
        gave it no gradient (no backward reached it) gets nothing."""
        ids = {id(p) for p, _ in readied}
        for param in params:
            if param is not None and last_group[id(param)] == index and id(param) not in ids:
                self.pending.discard(id(param))

    def deliver(self, ready: list[tuple[Tensor, Tensor]], watches: Sequence[DeliveryWatch] = ()) -> None:
        """Parameters without hooks first, in one hand-over, so that every hook finds them
        delivered; then the hooked ones in another, each marked delivered by a hook of ours
        that runs before the others on it."""
        plain: list[tuple[Tensor, Tensor]] = []
        hooked: list[tuple[Tensor, Tensor]] = []
        for item in ready:
            (hooked if self.snapshots.get(id(item[0])) or has_user_hooks(item[0]) else plain).append(item)
        ready.clear()
        if plain:
            self.pending.difference_update(id(p) for p, _ in plain)
            with self._remembering(p for p, _ in plain):
                _deliver(plain, watches)
        if hooked:
            with _hooks_as_in_backward([p for p, _ in hooked], self.snapshots):
                handles = [_hook_first(p, self._arrived) for p, _ in hooked]
                try:
                    with self._remembering(p for p, _ in hooked):
                        _deliver(hooked, watches)
                finally:
                    for handle in handles:
                        handle.remove()

    def _arrived(self, param: Tensor) -> None:
        self.pending.discard(id(param))

    @contextlib.contextmanager
    def _remembering(self, params: Iterable[Tensor]) -> Iterator[None]:
        """While the hand-over runs, its hooks see this call and the earlier ones; after it, a
        gradient not consumed (by a step or zero_grad in a hook) is remembered where more work
        for it is still queued: a later flush then adds another backward call's gradient to it
        (work split by tags or queues), which a step there must not take as one call's. On a
        failure nothing is remembered (the step is to be run again)."""
        entries = []
        for param in params:
            entry = _Delivered(weakref.ref(param), None, _earlier_calls(param) | self.tasks[id(param)])
            _deliveries[id(param)] = entry
            entries.append((param, entry))
        try:
            yield
        finally:
            failed = sys.exc_info()[0] is not None
            left = [(param, entry) for param, entry in entries if _deliveries.get(id(param)) is entry]  # not consumed
            still_queued = set() if failed else queued_among([param for param, _ in left])
            for param, entry in left:
                if param.grad is None or id(param) not in still_queued:
                    del _deliveries[id(param)]
                else:
                    _deliveries[id(param)] = _Delivered(entry.param, id(param.grad), entry.calls)
            if len(_deliveries) > 4096:  # parameters freed since
                for key in [key for key, entry in _deliveries.items() if entry.param() is None]:
                    del _deliveries[key]


#: Set on a post-accumulate-grad hook of this package's own that acts on its parameter's
#: gradient alone, or on others only once they are final (the data-parallel synchroniser's):
#: it needs no tracking of what a flush has handed over (see :func:`queue.takes_partial_gradients`).
OWN_HOOK_MARK = "_twobp_takes_partial_gradients"


#: Set on a post-accumulate-grad hook of this package's own that only reads its parameter's
#: ``.grad`` (the data-parallel synchroniser's): never changes a parameter in backward.
READS_ONLY_MARK = "_twobp_reads_grad_only"


def reads_grad_only(hook: Any) -> Any:
    """Mark ``hook`` (this package's own) as one that never changes its parameter."""
    setattr(hook, READS_ONLY_MARK, True)
    return hook


def may_change_in_backward(param: Tensor) -> bool:
    """Whether ``param`` has a post-accumulate-grad hook that may change it in place when its
    gradient arrives (an optimizer stepped in backward): any not marked as only reading ``.grad``
    (a hook marked ``takes_partial_gradients`` may still step)."""
    return _has_hook_unmarked(param, READS_ONLY_MARK)


def has_user_hooks(param: Tensor) -> bool:
    """Whether ``param`` has a post-accumulate-grad hook not marked as this package's own."""
    return _has_hook_unmarked(param, OWN_HOOK_MARK)


def _has_hook_unmarked(param: Tensor, mark: str) -> bool:
    hooks = param._post_accumulate_grad_hooks
    return bool(hooks) and any(not getattr(hook, mark, False) for hook in hooks.values())


def hooks_at_backward(params: Sequence[Tensor | None]) -> tuple[tuple[tuple[int, Any], ...], ...] | None:
    """Called as a backward queues work for ``params``: each one's post-accumulate-grad hooks
    (``()`` without a user's), as plain autograd calls them with this backward's gradient; None
    where no parameter has a user's hook."""
    hooks = tuple(
        tuple(p._post_accumulate_grad_hooks.items()) if p is not None and has_user_hooks(p) else () for p in params
    )
    return hooks if any(hooks) else None


@contextlib.contextmanager
def _hooks_as_in_backward(
    params: Sequence[Tensor], snapshots: dict[int, tuple[tuple[int, Any], ...]]
) -> Iterator[None]:
    """Give each parameter, while its gradient is handed over, the user's post-accumulate-grad
    hooks its last backward saw (none, where it saw none), this package's own where they are
    now: plain calls those with the gradient, not one registered since (it never calls that for
    this backward), and also one removed since (an optimizer-in-backward hook taken down before
    the flush would lose its step). What the hooks add or remove meanwhile stays: a hook
    registered since is silenced in place, not taken out, so that removing it then sticks."""
    restore = []
    for param in params:
        hooks = param._post_accumulate_grad_hooks  # it has hooks: a user's now, or in the snapshot
        now = tuple(hooks.items())
        users = [item for item in snapshots.get(id(param), ()) if not _is_own(item[1])]
        first_user = next((i for i, (_, hook) in enumerate(now) if not _is_own(hook)), len(now))
        kept = {key for key, _ in users}
        since = [(key, _silenced) for key, hook in now if not _is_own(hook) and key not in kept]
        then = (*now[:first_user], *users, *(item for item in now[first_user:] if _is_own(item[1])), *since)
        if now != then:
            hooks.clear()
            hooks.update(then)
            restore.append((hooks, now, dict(then)))
    try:
        yield
    finally:
        for hooks, now, then_by_key in restore:
            left = dict(hooks)
            removed = then_by_key.keys() - left.keys()
            added = [(key, hook) for key, hook in left.items() if key not in then_by_key]
            hooks.clear()
            hooks.update((key, hook) for key, hook in now if key not in removed)
            hooks.update(added)


def _hooks_of(job: WeightGradJob) -> tuple[tuple[tuple[int, Any], ...], ...]:
    """Each of the job's parameters' hooks in its backward (``()`` for all, where none had one)."""
    return job.hooks_at_backward or ((),) * len(job.params)


def _silenced(param: Tensor) -> None:
    """Stands in for a hook registered after the backward whose gradient a flush delivers."""


setattr(_silenced, OWN_HOOK_MARK, True)


def _warn_hooks_changed_once() -> None:
    warn_once(
        "hooks changed between backwards",
        "twobp: a parameter's post-accumulate-grad hooks changed between backward calls whose work one flush "
        "delivers: the flush calls those of the last backward, once, with the sum (plain called each "
        "backward's hooks after it; a step one of them took there is not taken). Flush before changing hooks.",
    )


def _is_own(hook: Callable[..., Any]) -> bool:
    return getattr(hook, OWN_HOOK_MARK, False)


def _hook_first(param: Tensor, hook: Callable[[Tensor], None]) -> RemovableHandle:
    """``param.register_post_accumulate_grad_hook(hook)``, moved before the hooks already there."""
    # Into the dict directly: register_post_accumulate_grad_hook refuses a parameter frozen
    # since the backward, which the hand-over unfreezes only around its delivery.
    # Rebuilt, not reordered with move_to_end: autograd calls them in the underlying dict's
    # insertion order. (Another thread registering a hook meanwhile makes the rebuild raise.)
    hooks = param._post_accumulate_grad_hooks  # it has hooks
    handle = RemovableHandle(hooks)
    others = [(key, value) for key, value in hooks.items() if key != handle.id]
    hooks.clear()
    hooks[handle.id] = hook
    hooks.update(others)
    return handle


#: The flushes to hooked parameters running now (in any thread; a flush inside a backward runs
#: its hooks on that backward's thread, autograd's device thread on CUDA).
_hooked_flushes: list[_HookedDelivery] = []


def _forget_other_threads_flushes() -> None:
    """In a forked child: other threads' flushes never end there (the queue refuses what they
    may have left half delivered, see ``WeightGradQueue._after_fork``)."""
    me = threading.get_ident()
    _hooked_flushes[:] = [delivery for delivery in _hooked_flushes if delivery.thread == me]


os.register_at_fork(after_in_child=_forget_other_threads_flushes)


class _Delivered(NamedTuple):
    param: weakref.ref[Tensor]
    grad: int | None  # id of the .grad the calls went into; None while a delivery runs
    calls: frozenset[int]  # the backward calls (graph tasks) whose gradients it holds


#: id(param) -> what flushes put into its ``.grad``: kept for the parameters of flushes with
#: post-accumulate-grad hooks, until an optimizer step or ``zero_grad`` consumes the gradient.
_deliveries: dict[int, _Delivered] = {}


def _none_queued(params: Sequence[Tensor]) -> set[int]:
    return set()


#: ``queued_among(params)``: the ids of those of ``params`` a queue still holds work for (set
#: to :func:`.queue.queued_among` by that module, which knows the queues).
queued_among: Callable[[Sequence[Tensor]], set[int]] = _none_queued


def _earlier_calls(param: Tensor) -> frozenset[int]:
    """The backward calls whose gradients flushes put into ``param.grad``, as it is now (or
    are putting: during a delivery, with the one running)."""
    entry = _deliveries.get(id(param))
    if entry is None or entry.param() is not param:
        return frozenset()
    grad = param.grad
    if entry.grad is not None and (grad is None or id(grad) != entry.grad):  # replaced since
        return frozenset()
    return entry.calls  # (entry.grad None: its delivery is running)


def forget_deliveries(params: Iterable[Tensor]) -> None:
    """An optimizer step or ``zero_grad`` consumed these parameters' gradients."""
    if _deliveries:
        for param in params:
            _deliveries.pop(id(param), None)


def undelivered(params: Iterable[Tensor]) -> list[Tensor]:
    """Those of ``params`` whose gradient a running flush with post-accumulate-grad hooks has
    yet to hand over (asked by the guards, from such a hook)."""
    pending = [delivery.pending for delivery in list(_hooked_flushes)]
    if not pending:
        return []
    return [param for param in params if any(id(param) in ids for ids in pending)]


def summed_over_backward_calls(params: Iterable[Tensor]) -> bool:
    """Whether a running flush delivers, to one of ``params``, work queued by more than one
    backward call, counting those earlier flushes put into its ``.grad`` (asked by the
    optimizer step guard: a step in a post-accumulate-grad hook, which only a flush with such
    hooks runs), unless only the last of those calls saw a user's hook on it: plain's hook
    stepped once then, on the sum (a hook registered between two backward calls)."""
    deliveries = list(_hooked_flushes)
    if not deliveries:  # every step asks
        return False
    for param in params:
        calls: set[int] = set()
        hooked: set[int] = set()
        for delivery in deliveries:
            calls |= delivery.tasks.get(id(param), frozenset())
            hooked |= delivery.hooked_tasks.get(id(param), frozenset())
        earlier = _earlier_calls(param)
        if not calls or len(calls | earlier) == 1:
            continue
        if not earlier - calls and hooked == {max(calls)}:  # (earlier: this delivery's calls too)
            continue  # hooked in the last backward alone (graph task ids grow): plain stepped once, on the sum
        return True
    return False


class _KernelRefused(RuntimeError):
    """A flush's refusal of what a group's kernels would compute: ``problem`` says what is wrong,
    and the message adds that the work stays queued, which holds only where nothing was handed over
    yet (after a delivery bucket, PartlyDelivered quotes the problem alone)."""

    def __init__(self, problem: str) -> None:
        super().__init__(
            f"{problem} Nothing reached .grad and the work stays queued: drop the step with "
            "optimizer.zero_grad() (or twobp.discard_weight_grads())."
        )
        self.problem = problem


def _refuse_nan(job: WeightGradJob, grads: Sequence[Tensor | None]) -> None:
    """Anomaly mode's NaN check, on a deferred weight gradient (plain autograd checks each
    node's outputs in backward; these are computed at the flush)."""
    for index, grad in enumerate(grads):
        if grad is not None and torch.isnan(grad).any():
            raise _KernelRefused(
                f"twobp: the deferred weight-gradient kernel '{_kernel_name(job)}' returned nan values in its "
                f"{index}th output (anomaly mode's check_nan was on when its backward ran; the flush "
                "checks for it)."
            )


def _read_by_later_groups(groups: Sequence[Sequence[WeightGradJob]], last_group: dict[int, int]) -> dict[int, int]:
    """id(param) -> the last group whose tensors lie in the parameter's memory, where that group
    runs after the parameter's own last one (an embedding's table fed to a patched layer)."""
    storages: dict[int, int] = {}
    for group in groups:
        for param in group[0].params:
            if param is not None and type(param) in (Tensor, torch.nn.Parameter) and param.layout == torch.strided:
                storages.setdefault(param.untyped_storage().data_ptr(), id(param))
    storages.pop(0, None)  # no memory (meta)
    read: dict[int, int] = {}
    for index, group in enumerate(groups):
        for job in group:
            for t in job.tensors():
                if type(t) is Tensor and t.layout == torch.strided:
                    key = storages.get(t.untyped_storage().data_ptr())
                    if key is not None and index > last_group[key]:
                        read[key] = index
    return read


def _wait_for_readers(
    ready: list[tuple[Tensor, Tensor]],
    readied: int,
    waiting: list[tuple[Tensor, Tensor]],
    read_later: dict[int, int],
    index: int,
) -> None:
    """Group ``index`` has run: what it readied (``ready[readied:]``) that a later group reads
    waits; what waited for this group goes."""
    held = [*waiting, *ready[readied:]]
    del ready[readied:]
    waiting[:] = [item for item in held if read_later.get(id(item[0]), -1) > index]
    ready.extend(item for item in held if read_later.get(id(item[0]), -1) <= index)


def _kernel_name(job: WeightGradJob) -> str:
    kernel = getattr(job.kernel, "func", job.kernel)
    return getattr(kernel, "__qualname__", repr(kernel))


def _completes_a_watch(ready: list[tuple[Tensor, Tensor]], watches: Sequence[DeliveryWatch]) -> bool:
    if not watches:
        return False
    params = [param for param, _ in ready]
    return any(watch.completes(params) for watch in watches)


def _watches_for(groups: list[list[WeightGradJob]], early: bool) -> list[DeliveryWatch]:
    delivering = list({id(p): p for group in groups for p in group[0].params if p is not None}.values())
    asked = [watcher(delivering, early) for watcher, active in _watchers if active()]
    return [watch for watch in asked if watch is not None]


def _take_group_grads(
    params: Sequence[Tensor | None],
    grads: Sequence[Tensor | None],
    index: int,
    last_group: dict[int, int],
    summing: dict[int, tuple[Tensor, _Sum]],
    ready: list[tuple[Tensor, Tensor]],
) -> None:
    """Add group ``index``'s gradients, each cast to its parameter's dtype first as autograd
    casts each path before summing; a parameter whose last group this is goes to ``ready``
    (most have one group: their gradient goes as the kernel made it). (A frame of its own: no
    local outlives it to hold a gradient, so AccumulateGrad can take each without a copy.)"""
    for param, grad in zip(params, grads, strict=True):  # a kernel returns one per parameter
        if param is None:
            continue
        key = id(param)
        if grad is not None:
            dtype = accumulated_dtype(param)
            if grad.dtype != dtype:
                grad = grad.to(dtype)
        last = last_group[key] == index
        entry = summing.pop(key, None) if last else summing.get(key)
        if entry is None:
            if grad is None:
                continue
            made = grad
        else:
            made = (entry[1] if grad is None else entry[1].add(grad)).tensor  # summed in place in `summing`
        if last:
            ready.append((param, made))
        elif entry is None:
            summing[key] = (param, _Sum(made))


def accumulated_dtype(param: Tensor) -> torch.dtype:
    """The dtype AccumulateGrad sums ``param``'s gradients in: its ``grad_dtype`` where one is set
    (a bf16 parameter whose gradients accumulate in fp32), else, with ``grad_dtype = None`` (any
    dtype), that of the ``.grad`` it adds into, else the parameter's own."""
    dtype = getattr(param, "grad_dtype", param.dtype)
    if dtype is None:
        grad = param.grad
        return param.dtype if grad is None else grad.dtype
    return dtype


def _deliver(ready: list[tuple[Tensor, Tensor]], watches: Sequence[DeliveryWatch] = ()) -> None:
    """Hand ``ready``'s gradients to their parameters, tell ``watches``, and empty ``ready``."""
    if not ready:
        return
    params: list[Tensor] = []
    grads: list[Tensor] = []
    # A parameter frozen (requires_grad_(False)) between backward and flush still gets the
    # gradient plain autograd gave it during backward: it is unfrozen for the hand-over.
    frozen: list[Tensor] = []
    copies_are_cheap = True
    for param, grad in ready:
        params.append(param)
        grads.append(grad)
        if not param.requires_grad:
            frozen.append(param)
        if copies_are_cheap and param.grad is None and grad.numel() * grad.element_size() > _COPY_BYTES:
            copies_are_cheap = False
    ready.clear()
    del grad
    threaded = torch._C._is_multithreading_enabled()
    try:
        for param in frozen:
            param.requires_grad_(True)
        # The engine itself, as Tensor.backward() calls it, without backward()'s argument
        # checks and its ones_like: a flush of a few small layers pays for little else.
        if copies_are_cheap:
            # The parameters as the roots: AccumulateGrad adds into an existing .grad, and copies
            # a gradient into an empty one (this call still refers to it), which for a small one
            # costs less than the hand-over node's Python.
            roots, root_grads = tuple(params), tuple(grads)
            del grads
        else:
            handover = [grads]
            del grads
            with torch.enable_grad():
                root = _HandOver.apply(handover, *params)
            roots, root_grads = (root,), (_ones_on(root.device),)
        # On this thread: on CUDA the engine would hand the accumulators to autograd's device
        # thread and sleep until it is done (two thread wake-ups per hand-over).
        torch._C._set_multithreading_enabled(False)
        _engine_run_backward(roots, root_grads, False, False, (), allow_unreachable=True, accumulate_grad=True)
    finally:
        torch._C._set_multithreading_enabled(threaded)
        for param in frozen:
            param.requires_grad_(False)
    for watch in watches:
        watch.delivered(params)


#: Up to this size a gradient reaching an empty ``.grad`` is copied there (see :func:`_deliver`).
_COPY_BYTES = 1 << 16


class _HandOver(torch.autograd.Function):
    """Delivers the summed gradients to the parameters through autograd's own AccumulateGrad
    (same None, dtype, layout and hook rules as a plain backward). They leave from this node's
    backward with no other reference alive, so an empty ``.grad`` takes the tensor as it is
    instead of a copy (``torch.autograd.backward(params, grads)`` would copy every one)."""

    @staticmethod
    def forward(ctx: Any, handover: list[list[Tensor]], *params: Tensor) -> Tensor:
        ctx.handover = handover
        return torch.zeros((), device=params[0].device)

    @staticmethod
    def backward(ctx: Any, _: Tensor) -> tuple[Tensor | None, ...]:
        return (None, *ctx.handover.pop())


_ones: dict[torch.device, Tensor] = {}


def _ones_on(device: torch.device) -> Tensor:
    """The hand-over root's gradient, one fp32 scalar per device (never written to)."""
    ones = _ones.get(device)
    if ones is None:
        ones = _ones[device] = torch.ones((), device=device)
    return ones


def _run_group(group: list[WeightGradJob], options: FlushOptions) -> Sequence[Tensor | None]:
    """The group's kernels under the autocast its backward ran in (plain autograd's weight
    gradients are computed there), whatever the flush's caller runs in."""
    first = group[0]
    if first.autocast is not None:
        with torch.autocast(first.device.type, dtype=first.autocast):
            return _run_kernels(group, options)
    if _any_autocast_enabled() and torch.is_autocast_enabled(first.device.type):
        with torch.autocast(first.device.type, enabled=False):
            return _run_kernels(group, options)
    return _run_kernels(group, options)


_any_autocast_enabled = torch._C._is_any_autocast_enabled


def _autocast_off(device_type: str) -> contextlib.AbstractContextManager[object]:
    """Autocast off on ``device_type`` where it is on, else nothing."""
    if _any_autocast_enabled() and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _run_kernels(group: list[WeightGradJob], options: FlushOptions) -> Sequence[Tensor | None]:
    first = group[0]
    _check_not_moved(first)  # a group's jobs share their parameters
    needs = first.needs
    if len(group) == 1:
        return _checked(first, first.kernel(*first.on_device(), needs))
    if first.concatenate is False or options.strategy == "loop" or _subclassed(first):
        concat = False
    elif options.strategy == "concat":
        concat = True
    else:
        pays = first.concatenate or first.device.type != "cpu"
        concat = (
            pays and sum(t.numel() * t.element_size() for j in group for t in j.tensors()) <= options.max_concat_bytes
        )
    if concat:
        on_device = [job.on_device() for job in group]
        try:
            # Joined outside the autocast the kernel runs in: autocast's cat promotes between
            # its own dtypes only, and refuses a bf16 tensor under fp16 autocast (a region of
            # the forward in another autocast dtype than the backward's), which plain never joins.
            with _autocast_off(first.device.type):
                saved = [torch.cat(ts) for ts in zip(*(s for s, _ in on_device), strict=True)]
                grad_outputs = [torch.cat(ts) for ts in zip(*(g for _, g in on_device), strict=True)]
        except RuntimeError as error:
            if isinstance(error, torch.OutOfMemoryError):
                raise
            raise RuntimeError(
                f"twobp: the tensors the weight-gradient kernel '{_kernel_name(first)}' takes could not be "
                "joined on dim 0 across micro-batches: every saved tensor and output gradient of a kernel "
                "that may be joined holds the batch on dim 0. Pass concatenate=False to defer_weight_grads "
                f"for one kernel call per micro-batch. ({error})"
            ) from error
        del on_device
        return _checked(first, first.kernel(saved, grad_outputs, needs))
    # Summed in each parameter's dtype, as AccumulateGrad sums micro-batches: bf16 partial
    # sums into an fp32 parameter would lose precision with every micro-batch.
    dtypes = [accumulated_dtype(p) if p is not None else None for p in first.params]
    total: list[_Sum | None] = [None] * len(needs)
    for job in group:
        for i, grad in enumerate(_checked(job, job.kernel(*job.on_device(), needs))):
            total[i] = _sum(total[i], grad if grad is None or grad.dtype == dtypes[i] else grad.to(dtypes[i]))
    return [t.tensor if t is not None else None for t in total]


def _check_not_moved(job: WeightGradJob) -> None:
    """Refuse work whose parameters are on another device than in the backward that queued it:
    the model was moved between backward and flush (plain moves each ``.grad`` along; the
    kernels here would run on the old device, or fail inside on mixed devices). The job's own
    tensors may lie elsewhere (a rule of the user's for a parameter kept on the host)."""
    home = job.home
    if home is None or job.device == home:
        return
    raise _KernelRefused(
        f"twobp: queued weight-gradient work was made with its parameters on {home}, but they are now on "
        f"{job.device}: the model was moved (.to(device), .cpu(), .cuda()) between backward and "
        "flush_weight_grads(). Flush before moving the model, or move it back before the flush."
    )


def _checked(job: WeightGradJob, grads: Sequence[Tensor | None]) -> Sequence[Tensor | None]:
    """``grads`` if they are one tensor (or None) per parameter, shaped like it; else a clear
    error, raised before anything reaches ``.grad`` (the work stays queued)."""
    params = job.params
    wrong = not isinstance(grads, (list, tuple)) or len(grads) != len(params)
    for param, grad in zip(params, () if wrong else grads, strict=False):  # a loop: no generator per call
        if grad is not None and (
            not isinstance(grad, Tensor)
            # On another device, as the engine's own check (inline: a frame per gradient costs):
            # a 0-d gradient is moved to its parameter's device, any other refused.
            or (param is not None and (grad.shape != param.shape or (grad.device != param.device and grad.dim() != 0)))
        ):
            wrong = True
            break
    if wrong:
        raise _KernelRefused(
            f"twobp: the weight-gradient kernel '{_kernel_name(job)}' returned {_described(grads)} for "
            f"{len(params)} parameters of shapes {[None if p is None else tuple(p.shape) for p in params]}: a "
            "kernel returns a list or tuple of one gradient per parameter, shaped like it and on its device "
            "(None where it is not needed); or a parameter's shape changed since the backward (a .data assignment: "
            "flush before it)."
        )
    return grads


def _described(grads: object) -> str:
    """What a kernel returned, for an error: how many gradients and their shapes."""
    if not isinstance(grads, (list, tuple)):
        return f"a {type(grads).__name__}"
    shapes = [
        None if g is None else f"{tuple(g.shape)} on {g.device}" if isinstance(g, Tensor) else type(g).__name__
        for g in grads
    ]
    return f"{len(grads)} gradients {shapes}"


def _subclassed(job: WeightGradJob) -> bool:
    """Whether the job holds tensor subclasses (DTensors under tensor parallelism): those run one
    micro-batch at a time, as backward would have run them. Joined, a sequence-sharded DTensor
    is gathered, and the gradient comes out replicated where backward leaves it a partial sum.
    So do sparse tensors (a Linear's sparse COO/CSR input): torch.cat refuses CSR ones.
    (Jobs of one group share their tensors' layouts: the first job's stand for all.)"""
    return any(type(t) is not Tensor or t.layout != torch.strided for t in job.tensors())


class _Sum:
    """A running sum that owns its tensor before adding into it in place: a kernel may return
    a tensor it did not make (a recomputed ``x + bias`` returns the output gradient itself),
    and autograd hands one gradient tensor to several branches, so another job may still
    need it."""

    __slots__ = ("tensor", "owned")

    def __init__(self, tensor: Tensor) -> None:
        self.tensor, self.owned = tensor, False

    def add(self, other: Tensor) -> _Sum:
        if self.owned:
            self.tensor.add_(other)
        else:
            self.tensor, self.owned = self.tensor + other, True
        return self


def _sum(total: _Sum | None, grad: Tensor | None) -> _Sum | None:
    if grad is None:
        return total
    return _Sum(grad) if total is None else total.add(grad)


# -- the queue in use -----------------------------------------------------------------------
