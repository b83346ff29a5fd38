"""Pending weight-gradient work: where backward-p1 leaves one :class:`WeightGradJob` per
patched call, until a flush (:mod:`.flush`) runs it. The queue keeps the jobs in order, their
tags (micro-batch indices), the bytes they hold (and an optional cap on them), and refuses a
flush while a backward that feeds it still runs elsewhere.

One default queue serves the whole process, so work queued by a forward run on any thread
(a worker pool, a serving thread) is reached by a flush from the thread that trains; it is
thread-safe. :func:`use_queue` sends the forwards run inside it (on that thread) to another
queue, for whoever wants separation (one per pipeline stage, one per concurrently training
thread). A queue is bound at forward time, because on CUDA the backward runs on autograd's
device threads, not the caller's.

A flush takes its jobs out of the queue before it runs them. Until they reach ``.grad`` they
still count as the queue's work for other threads: a flush, the step and clipping guards,
``zero_grad``'s discard and ``clear`` on another thread wait for them (else a thread whose work
another thread's flush had taken would find the queue empty and step on partial gradients).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple, TypeVar

import torch
from torch import Tensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from . import flush as flush_module
from .flush import (
    OWN_HOOK_MARK,
    FlushOptions,
    FlushStrategy,
    check_count,
    has_user_hooks,
    partly_delivered,
    run_jobs,
)
from .job import WeightGradJob, finished_grads, storage_id, storage_of
from .offload import HostOffload
from .warn_once import warn_once

__all__ = [
    "WeightGradQueue",
    "PendingWork",
    "use_queue",
    "current_queue",
    "flush_weight_grads",
    "discard_weight_grads",
    "pending",
    "takes_partial_gradients",
    "queued_among",
]

_any_autocast_enabled = torch._C._is_any_autocast_enabled
_queue_callback = torch.autograd.Variable._execution_engine.queue_callback
_storage_use_count = torch._C._storage_Use_Count


class PendingWork(NamedTuple):
    """What a queue holds: number of jobs, and bytes of the distinct storages they keep alive
    (host copies of offloaded work not counted)."""

    jobs: int
    bytes: int


_Hook = TypeVar("_Hook", bound=Callable[..., Any])

_live_queues: weakref.WeakSet[WeightGradQueue] = weakref.WeakSet()


class _Flight(NamedTuple):
    """Jobs taken out of a queue and running on ``thread``. (The jobs' tensors stay alive
    meanwhile anyway: the runner keeps the list, to put it back if the run fails.)"""

    thread: int
    jobs: Sequence[WeightGradJob]

    def has_params(self, ids: set[int]) -> bool:
        return _have_params(self.jobs, ids)

    def has_tags(self, tags: set[Hashable]) -> bool:
        return any(job.tag in tags for job in self.jobs)


def _grad_in_shared_memory(param: Tensor | None) -> bool:
    grad = None if param is None else param.grad
    # (A CUDA tensor calls itself shared: no fork shares it.)
    return grad is not None and grad.device.type == "cpu" and grad.is_shared()


def _have_params(jobs: Sequence[WeightGradJob], ids: set[int]) -> bool:
    """Whether one of ``jobs`` computes for a parameter whose id is in ``ids``."""
    return any(id(p) in ids for job in jobs for p in job.params if p is not None)


#: How long a flush waits for a backward that raised on another thread to be forgotten before
#: it calls that backward still running (the engine frees the graph task microseconds later).
_RAISED_BACKWARD_GRACE_S = 0.05


class _BackwardEnd:
    """Queued on autograd's engine by the first job of a backward: it tells the queue that the
    backward has ended, when the engine calls it at the end, or when the graph task is freed
    without calling it (a backward that raised: on the caller's thread on a CPU, on the
    device's thread on CUDA, whichever drops the task last)."""

    __slots__ = ("queue", "task", "told")

    def __init__(self, queue: WeightGradQueue, task: int) -> None:
        self.queue, self.task = queue, task
        self.told = False

    def __call__(self) -> None:
        self.queue._backward_finished(self.task)
        self.told = True  # the graph task's release then has nothing left to tell

    def __del__(self) -> None:
        if not self.told:  # the backward raised
            self.queue._backward_finished(self.task, raised=True)


class WeightGradQueue:
    """Weight-gradient work queued by backward-p1, run by :meth:`flush`.

    ``strategy`` chooses how a group of jobs of one layer runs: ``"concat"`` concatenates the
    micro-batches and calls the kernel once, ``"loop"`` calls it per micro-batch and sums in
    place, ``"auto"`` (default) concatenates where it pays and the copies stay under
    ``max_concat_bytes``: always for convolutions, off the CPU for the rest. On a CPU a GEMM or
    a reduction over joined micro-batches costs what the separate calls cost, plus the copies
    (measured: ``benchmarks/overhead.py``); small weight-gradient convolutions gain from it.

    ``max_pending_bytes`` (fixed at construction) bounds the memory pending work holds: when
    an enqueue passes it, the oldest jobs are flushed at once (inside that backward) until the
    rest fits, so memory no longer grows with the number of micro-batches. A caller with a
    better moment than the backward itself defers that flush with :meth:`cap_enforced_after`.

    ``delivery_bucket_bytes``: during a flush, gradients reach ``.grad`` (and fire their
    post-accumulate hooks) in buckets of about this many bytes as soon as their last kernel
    has run, so that e.g. a data-parallel all-reduce overlaps the rest of the flush. None:
    all at the end of the flush.

    CUDA options (ignored for work on other devices): ``offload_to_host`` parks each queued
    job's tensors in pinned host memory, copied on a side stream, until the flush copies them
    back (:mod:`twobp_autograd.offload`); ``weight_grad_streams`` > 1 runs the layers' kernels
    of a flush on that many side streams (:mod:`twobp_autograd.streams`).
    """

    def __init__(
        self,
        strategy: FlushStrategy = "auto",
        *,
        max_concat_bytes: int = 1 << 30,
        max_pending_bytes: int | None = None,
        delivery_bucket_bytes: int | None = None,
        offload_to_host: bool = False,
        weight_grad_streams: int = 1,
    ) -> None:
        if offload_to_host and not torch.cuda.is_available():
            raise ValueError(
                "twobp: offload_to_host parks CUDA tensors in pinned host memory, but CUDA is not "
                "available; on the CPU the pending work already lives in host memory."
            )
        if max_pending_bytes is not None:
            check_count("max_pending_bytes", max_pending_bytes, least=0, whole_floats=True)
        self.flush_options = FlushOptions(strategy, max_concat_bytes, delivery_bucket_bytes, weight_grad_streams)
        self.max_pending_bytes = max_pending_bytes
        self._offload = HostOffload() if offload_to_host else None
        self._jobs: list[WeightGradJob] = []
        # The parameters of the queued jobs, each once, kept until the jobs change (asked by the
        # guard on gradient reductions on every all_reduce while work is queued).
        self._params_with_work: list[Tensor] | None = None
        self._held: dict[tuple[int, torch.device], list[int]] = {}  # storage -> [tensors of jobs on it, its bytes]
        self._held_bytes = 0
        self._flights: list[_Flight] = []  # work taken out by a flush, not yet in .grad
        # graph task id -> the thread it runs on where that is its caller's (CPU work), else None
        self._running_backwards: dict[int, int | None] = {}
        self._new_lock()
        # In a forked child: the jobs of other threads' flushes a fork cut off, until zero_grad
        # or clear drops them (see _after_fork).
        self._cut_by_fork: list[WeightGradJob] = []
        self._forked_into_shared_grads = False  # a fork marked jobs (see _mark_work_into_shared_grads)
        self._tag: Hashable = None  # the innermost open tagged block's (read at each patched call)
        self._tag_blocks: list[tuple[Hashable]] = []  # the open tagged blocks, outermost first
        self._cap_deferred = 0  # depth of cap_enforced_after blocks
        _live_queues.add(self)

    def _new_lock(self) -> None:
        # Reentrant, as a safeguard: a backward's end is noted when autograd frees its graph task
        # (_BackwardEnd), on whichever thread drops it last.
        self._lock = threading.RLock()
        self._flight_landed = threading.Condition(self._lock)
        self._flight_waiters = 0  # threads waiting on _flight_landed (changed with the lock held)
        self._backward_ended = threading.Condition(self._lock)
        self._backward_waiters = 0  # threads waiting on _backward_ended (changed with the lock held)

    def _after_fork(self) -> None:
        """In a forked child, which has the forking thread alone: the lock another thread held at
        the fork would stay held, and its flushes and backwards would never end. A flush another
        thread was running may have put part of its gradients into ``.grad`` (the child's copy):
        rather than add them twice or not at all, its parameters count as having work (the
        optimizer step and clipping refuse) and flushes refuse, until ``zero_grad`` zeroes them or
        :meth:`clear` drops that flush."""
        me = threading.get_ident()
        self._new_lock()
        cut = [flight for flight in self._flights if flight.thread != me]
        # Added to what an earlier fork cut off (a child forking again): nothing zeroed that yet.
        self._cut_by_fork += [job for flight in cut for job in flight.jobs]
        self._flights = [flight for flight in self._flights if flight.thread == me]
        self._running_backwards = {task: t for task, t in self._running_backwards.items() if t == me}
        self._mark_work_into_shared_grads()

    def _mark_work_into_shared_grads(self) -> None:
        """On both sides of a fork: work for a parameter whose ``.grad`` lives in memory the two
        processes share (``share_memory()`` after a first backward, Hogwild-style) would reach
        that ``.grad`` from each process's flush, where plain's backward had put it there once,
        before the fork. Such jobs stay queued (the step refuses) and flushes refuse them until
        ``zero_grad`` or :meth:`clear` drops them. Marked without the lock: in the parent another
        thread may hold it (marking is one attribute store)."""
        marked = False
        for job in list(self._jobs):
            if any(_grad_in_shared_memory(p) for p in job.params):
                job.forked_into_shared_grad = marked = True
        if marked:
            self._forked_into_shared_grads = True

    def __del__(self) -> None:
        # Jobs do not keep their queue alive: a queue dropped with work would lose it silently.
        if getattr(self, "_jobs", None) and not sys.is_finalizing():
            warnings.warn(
                f"twobp: a WeightGradQueue holding {len(self._jobs)} weight-gradient jobs was garbage "
                "collected before a flush; those weight gradients are lost. Keep a reference to the "
                "queue and flush it (queue.flush()) before optimizer.step().",
                RuntimeWarning,
                stacklevel=2,
            )

    # -- filling -------------------------------------------------------------------------

    @contextlib.contextmanager
    def tagged(self, tag: Hashable) -> Iterator[WeightGradQueue]:
        """Tag the jobs of the forward passes run inside, or failing that of the backward passes
        (e.g. with a micro-batch index): a tag given at the forward wins."""
        try:
            hash(tag)
        except TypeError:
            raise TypeError(
                f"twobp: a queue's tag must be hashable (an int, a str, a tuple), not {type(tag).__name__} "
                f"({tag!r}): pass tuple({tag!r})"
            ) from None
        block = (tag,)  # its identity tells this block from another with an equal tag
        self._tag_blocks.append(block)
        self._tag = tag
        try:
            yield self
        finally:
            in_order = self._tag_blocks[-1] is block
            self._tag_blocks = [open_block for open_block in self._tag_blocks if open_block is not block]
            self._tag = self._tag_blocks[-1][0] if self._tag_blocks else None
            if not in_order:
                raise RuntimeError(
                    "twobp: queue.tagged blocks were left out of order (generators that yield inside their "
                    "tagged blocks share the queue's tag, so the forwards of one were tagged with another's "
                    "tag), or from several threads (the tag belongs to the queue, not to a thread). Keep "
                    "each block between yields, and give each thread its own queue (use_queue)."
                )

    def enqueue(self, job: WeightGradJob) -> None:
        """Called from backward-p1. Records the running backward so a flush elsewhere waits."""
        task = torch._C._current_graph_task_id()
        with self._lock:
            if job.tag is None:  # not tagged at forward time: take the backward's tag
                job.tag = self._tag
            job.task = task
            job.check_nan = torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled()
            if _any_autocast_enabled():  # the flush runs the kernel as this backward would have
                device_type = job.device.type
                job.autocast = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
            if self._offload is not None:
                job.park(self._offload)
            self._jobs.append(job)
            self._params_with_work = None
            if self.max_pending_bytes is not None:
                self._count([job], +1)
            if task >= 0 and task not in self._running_backwards:
                # A backward nested in one running on this thread (a reentrant checkpoint's) may
                # accumulate into a .grad the outer one handed a queued output gradient: the
                # outer's jobs own theirs now, before the nested backward's AccumulateGrad runs
                # (a backward on a device's thread has no thread recorded: copied as if nested).
                me = threading.get_ident()
                for outer, thread in list(self._running_backwards.items()):
                    if outer < task and thread in (me, None):
                        self._own_grad_outputs_held_elsewhere(outer)
                home = job.home  # the parameters' device, as the job read it just now (job.device reads it again)
                if home is None:
                    home = job.device
                self._running_backwards[task] = threading.get_ident() if home.type == "cpu" else None
                _queue_callback(_BackwardEnd(self, task))
        # Not under anomaly mode's NaN check: it may stop this job's node once it returns, which
        # drops the job (plain's node hands none of its gradients on); an early flush now would
        # have handed them over. Those jobs wait for the next cap check or flush.
        if self.max_pending_bytes is not None and not self._cap_deferred and not job.check_nan:
            self._enforce_cap()

    def _backward_finished(self, task: int, *, raised: bool = False) -> None:
        """The backward ``task`` has ended (see :class:`_BackwardEnd`), or ``raised``."""
        with self._lock:
            self._running_backwards.pop(task, None)
            if not raised:
                self._own_grad_outputs_held_elsewhere(task)
            if self._backward_waiters:
                self._backward_ended.notify_all()
            left_work = raised and any(job.task == task for job in self._jobs)
        if left_work:
            _warn_raised_backward_once()

    def _own_grad_outputs_held_elsewhere(self, task: int) -> None:
        """At the end of backward ``task``: its jobs copy the output gradients that something
        besides the queue still holds (see :meth:`WeightGradJob.own_grad_outputs`), found by the
        storage's use count over the jobs' own references (the graph is gone by then). Jobs
        parked in host memory hold copies already."""
        jobs = [job for job in self._jobs if job.task == task and job.grad_outputs and job.parked is None]
        if not jobs:
            return
        # Per storage: its Python object, kept alive while counting, and the jobs' references.
        storages: dict[int, tuple[torch.UntypedStorage, int]] = {}
        for job in jobs:
            for grad in job.grad_outputs:
                storage = storage_of(grad)
                if storage is not None:
                    key = storage._cdata
                    storages[key] = (storage, storages[key][1] + 1 if key in storages else 1)
        # Its use count: the jobs' tensors, its Python object (which recent releases keep with the
        # storage for good, older ones only while it lives: one either way here), and the rest.
        held_elsewhere = {key for key, (_, ours) in storages.items() if _storage_use_count(key) > ours + 1}
        if not held_elsewhere:
            return
        for job in jobs:
            if not any(storage_id(grad) in held_elsewhere for grad in job.grad_outputs):
                continue
            self._count([job], -1)  # the bytes held change (only a capped queue counts)
            job.own_grad_outputs(held_elsewhere)
            self._count([job], +1)

    @contextlib.contextmanager
    def cap_enforced_after(self) -> Iterator[WeightGradQueue]:
        """Inside, queued work may pass ``max_pending_bytes``; when the block ends (without an
        error) the oldest work is flushed until the rest fits. A pipeline stage runs its
        backward-p1 and posts the input-gradient send inside, so the early flush no longer
        delays the rank upstream; memory may pass the cap by one backward's work meanwhile."""
        self._cap_deferred += 1
        try:
            yield self
        finally:
            self._cap_deferred -= 1
        if not self._cap_deferred:
            self._enforce_cap()

    def _enforce_cap(self) -> None:
        """Flush the oldest jobs until the rest fits under ``max_pending_bytes``. Jobs of a
        parameter whose post-accumulate-grad hook wants its whole gradient (optimizer-in-backward)
        stay for the flush the caller runs: delivered in parts, the hook would step on each."""
        while self.max_pending_bytes is not None and self._held_bytes > self.max_pending_bytes and self._jobs:
            with self._lock:
                over = self._held_bytes - self.max_pending_bytes
                if over <= 0 or not self._jobs:  # another thread's early flush got here first
                    return
                early: list[WeightGradJob] = []
                kept: list[WeightGradJob] = []
                freed = 0
                for job in self._jobs:  # oldest first; a guess: storages shared by jobs count twice
                    if freed < over and not _waits_for_the_flush(job) and not job.forked_into_shared_grad:
                        early.append(job)
                        freed += sum(nbytes for _, nbytes in job.counted)
                    else:
                        kept.append(job)
                if not early:
                    _warn_cap_kept_for_hooks_once()
                    return
                # One run per tag: what a run holds back comes back as one job, under that tag.
                by_tag = _by_tag(early)  # before the jobs leave the queue: nothing is lost if it raises
                self._jobs = kept
                self._params_with_work = None
                self._count(early, -1)
                runs = [(jobs, self._take_off(jobs)) for jobs in by_tag]
            for index, (jobs, flight) in enumerate(runs):
                try:
                    self._run(jobs, flight, early=True)
                except BaseException as error:
                    # The runs not made go back after the failed one's jobs (which _run put back
                    # first, unless partly delivered): oldest first, as they were.
                    later = runs[index + 1 :]
                    not_run = [job for later_jobs, _ in later for job in later_jobs]
                    with self._lock:
                        at = 0 if partly_delivered(error) else len(jobs)
                        self._jobs[at:at] = not_run
                        self._params_with_work = None
                        self._count(not_run, +1)
                    for _, not_run_flight in later:
                        self._land(not_run_flight)
                    raise

    def _count(self, jobs: Sequence[WeightGradJob], sign: int) -> None:
        """Keep ``_held_bytes`` equal to the bytes of the distinct storages ``_jobs`` keep
        alive (a saved view keeps its whole storage alive; two views of one count once).
        Only a queue with a cap keeps it incrementally; others count on demand."""
        if self.max_pending_bytes is None:
            return
        for job in jobs:
            if sign > 0:
                held = _memory_of(job.held_tensors())
                job.counted = tuple([(_storage_key(t), t.untyped_storage().nbytes()) for t in held])
            for key, nbytes in job.counted:
                entry = self._held.setdefault(key, [0, nbytes])
                entry[0] += sign
                if entry[0] == 0:
                    self._held_bytes -= self._held.pop(key)[1]
                elif entry[0] == 1 and sign > 0:
                    self._held_bytes += entry[1]

    # -- reading -------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._jobs)

    def pending(self) -> PendingWork:
        if self.max_pending_bytes is not None:  # kept up to date on every enqueue
            return PendingWork(len(self._jobs), self._held_bytes)
        with self._lock:
            storages = {
                _storage_key(t): t.untyped_storage().nbytes()
                for job in self._jobs
                for t in _memory_of(job.held_tensors())
            }
        return PendingWork(len(self._jobs), sum(storages.values()))

    def tags(self) -> list[Hashable]:
        return list(dict.fromkeys(job.tag for job in self._jobs))

    def has_work_for(self, params: Sequence[Tensor], *, wait: bool = True) -> bool:
        """Whether work for one of ``params`` is queued, once another thread's flush that runs
        some has put it in ``.grad`` (``wait=False``: such a flush counts as work, for a caller
        that has already read the gradients)."""
        if not self._jobs and not self._flights and not self._cut_by_fork:
            return False
        wanted = {id(p) for p in params}
        if _have_params(self._cut_by_fork, wanted):
            return True

        def concerns(flight: _Flight) -> bool:
            return flight.has_params(wanted)

        with self._lock:
            if wait:
                self._wait_for_flights_elsewhere(concerns)
            elif self._flights_elsewhere(concerns):
                return True
            return any(id(p) in wanted for job in self._jobs for p in job.params if p is not None)

    def params_with_work(self) -> list[Tensor]:
        """The parameters queued jobs compute for, and those of jobs another thread's flush runs
        or a fork cut off (a superset where a job has dropped some since: :meth:`has_work_for`
        tells, waiting for those flushes; this names candidates)."""
        with self._lock:
            if self._params_with_work is None:
                found = {id(p): p for job in self._jobs for p in job.params if p is not None}
                self._params_with_work = list(found.values())
            if not self._flights and not self._cut_by_fork:
                return self._params_with_work
            me = threading.get_ident()
            elsewhere = [job for flight in self._flights if flight.thread != me for job in flight.jobs]
            others = [p for job in (*elsewhere, *self._cut_by_fork) for p in job.params if p is not None]
            return self._params_with_work + others

    def busy(self) -> bool:
        """Whether work is queued, or running in another thread's flush (seen from outside
        autograd, see :meth:`_wait_for_flights_elsewhere`)."""
        return bool(self._jobs) or bool(self._cut_by_fork) or self._flights_elsewhere(_ANY_WORK)

    # -- running -------------------------------------------------------------------------

    def clear(self) -> None:
        """Drop all queued work without computing it (a flush running on another thread
        finishes first)."""
        with self._lock:
            self._wait_for_flights_elsewhere(_ANY_WORK)
            # Plain backward would have given these a .grad: a zero_grad(set_to_none=False)
            # after the discard must leave zeros there, as plain's does (grad_guard).
            dropped_without_grad.update(_given_grads_but_none_yet([*self._jobs, *self._cut_by_fork]))
            self._jobs.clear()
            self._params_with_work = None
            self._held.clear()
            self._held_bytes = 0
            self._cut_by_fork = []
            # Running backwards stay recorded: one still running elsewhere keeps queuing work, and
            # one that raised is forgotten when autograd frees its graph task (_BackwardEnd).

    def discard_work_for(self, params: Sequence[Tensor], *, given_grads: bool = True) -> list[Tensor]:
        """Drop the queued work of ``params`` (what ``zero_grad`` does to a gradient plain
        backward has computed); jobs left without a parameter go whole. Returns the parameters
        that had work and whose ``.grad`` is None (plain backward would have given each one),
        where ``given_grads`` asks for them (it may run a kernel: see ``params_given_grads``)."""
        dropped = {id(p) for p in params}
        with self._lock:
            # Gradients another thread's flush is computing for them must land first, so that
            # the zero_grad after this drops them too.
            self._wait_for_flights_elsewhere(lambda flight: flight.has_params(dropped))
            had_work = _given_grads_but_none_yet(self._jobs, among=dropped) if given_grads else {}
            kept: list[WeightGradJob] = []
            for job in self._jobs:
                if not any(p is not None and id(p) in dropped for p in job.params):
                    kept.append(job)
                    continue
                self._count([job], -1)  # counted again as it is left: it may have freed some tensors
                if job.drop_params(dropped):
                    kept.append(job)
                    self._count([job], +1)
            self._jobs = kept
            self._params_with_work = None
            if self._cut_by_fork:  # plain's .grad held their gradients: zero_grad zeroes them
                if given_grads:
                    had_work.update(_given_grads_but_none_yet(self._cut_by_fork, among=dropped))
                self._cut_by_fork = [job for job in self._cut_by_fork if job.drop_params(dropped)]
        return list(had_work.values())

    def withdraw(self, job: WeightGradJob) -> None:
        """Drop ``job``, queued by a backward node that autograd then stopped (anomaly mode's NaN
        check raises after the node returned): plain's node, which computed the weight gradients
        too, handed none of them on."""
        with self._lock:
            kept = [queued for queued in self._jobs if queued is not job]
            if len(kept) != len(self._jobs):
                self._count([job], -1)
                self._jobs = kept
                self._params_with_work = None

    def take(self, tags: Sequence[Hashable] | None = None) -> list[WeightGradJob]:
        """Remove and return the jobs with the given tags (all jobs when ``tags`` is None),
        after another thread's flush of such jobs has finished. The caller runs them inside
        :meth:`running`."""
        self._check_no_backward_elsewhere()
        with self._lock:
            return self._take_locked(tags)

    def _take_locked(self, tags: Sequence[Hashable] | None) -> list[WeightGradJob]:
        if self._cut_by_fork:
            raise RuntimeError(
                "twobp: this process was forked while another thread of its parent flushed this queue: "
                "which of that flush's gradients reached .grad here is unknown. Zero the gradients "
                "(optimizer.zero_grad()) and run the step again."
            )
        if self._forked_into_shared_grads and any(job.forked_into_shared_grad for job in self._jobs):
            raise RuntimeError(
                "twobp: this queue holds weight-gradient work for parameters whose .grad lives in memory "
                "shared with another process (share_memory()) since a fork (os.fork, a fork-started "
                "multiprocessing child or DataLoader worker): each process's flush would add it there, "
                "where plain's backward put it there once. Zero the gradients (optimizer.zero_grad()) "
                "and run the step again; flush before forking."
            )
        tags = _tag_list(tags)
        if tags is None:
            self._wait_for_flights_elsewhere(_ANY_WORK)
            taken, self._jobs = self._jobs, []
            self._params_with_work = None
            if self.max_pending_bytes is None:  # nothing counted (see _count): the usual case, no call
                return taken
        else:
            wanted = set(tags)
            self._wait_for_flights_elsewhere(lambda flight: flight.has_tags(wanted))
            taken = [j for j in self._jobs if j.tag in wanted]
            self._jobs = [j for j in self._jobs if j.tag not in wanted]
            self._params_with_work = None
        self._count(taken, -1)
        return taken

    def flush(self, tags: Sequence[Hashable] | None = None) -> None:
        """Run the queued weight-gradient work (all of it, or that of ``tags``) into ``.grad``.

        A flush that raises before any gradient reached ``.grad`` leaves its work queued (so
        ``optimizer.step()`` stays refused) until a good flush or :meth:`clear`. With delivery
        buckets (or FSDP2's reduction, which takes each group as it completes), one that raises
        midway has delivered part of its work, drops the rest and raises
        :class:`~twobp_autograd.flush.PartlyDelivered`: the step's gradients are incomplete."""
        self._check_no_backward_elsewhere()
        with self._lock:
            jobs = self._take_locked(tags)
            flight = self._take_off(jobs)
        self._run(jobs, flight)

    def _run(self, jobs: list[WeightGradJob], flight: _Flight, *, early: bool = False) -> None:
        """Run jobs taken out of the queue (``flight``); on failure put them back, oldest first,
        unless part of them already reached ``.grad`` (:class:`PartlyDelivered`). What an
        ``early`` flush (the cap's) holds back comes back as one job of finished gradients."""
        try:
            held = run_jobs(jobs, self.flush_options, early=early)
            if held:
                self._queue_held(held, jobs)
        except BaseException as error:
            self._put_back_unless_delivered(jobs, error)
            raise
        finally:
            self._land(flight)

    def _put_back_unless_delivered(self, jobs: list[WeightGradJob], error: BaseException) -> None:
        """After a failed run of ``jobs``: back in front of the queue, oldest first, where none of
        their gradients reached ``.grad`` (the refusals say the work stays queued), but for those
        a run delivered before the failure."""
        if partly_delivered(error):
            return
        # Jobs a run handed over whole before the block raised (run_jobs returned, then a
        # collective timed out) are done: queued again, they would be added twice.
        jobs = [job for job in jobs if not job.delivered]
        with self._lock:
            self._jobs[:0] = jobs
            self._params_with_work = None
            self._count(jobs, +1)

    def _queue_held(self, held: list[tuple[Tensor, Tensor]], jobs: Sequence[WeightGradJob]) -> None:
        """Queue gradients an early flush held back as one job (never flushed early again), with
        the tag of its jobs (an early flush runs one tag at a time)."""
        job = WeightGradJob(
            kernel=finished_grads,
            group=_HELD_BACK,
            concatenate=False,
            params=tuple(param for param, _ in held),
            saved=tuple(grad for _, grad in held),
            grad_outputs=(),
            tag=jobs[0].tag,
        )
        job.task = torch._C._current_graph_task_id()
        job.accumulators = tuple([node for held_from in jobs for node in held_from.accumulators])
        with self._lock:
            self._jobs.append(job)
            self._params_with_work = None
            self._count([job], +1)

    @contextlib.contextmanager
    def running(self, jobs: list[WeightGradJob]) -> Iterator[None]:
        """Run jobs got from :meth:`take` inside: until the block ends they count as this
        queue's work for other threads (see the module's docstring). A block that raises before
        any of their gradients reached ``.grad`` puts them back, as a failed :meth:`flush` does."""
        with self._lock:
            flight = self._take_off(jobs)
        try:
            yield
        except BaseException as error:
            self._put_back_unless_delivered(jobs, error)
            raise
        finally:
            self._land(flight)

    def _take_off(self, jobs: Sequence[WeightGradJob]) -> _Flight:
        """With the lock held: ``jobs`` start running on this thread."""
        flight = tuple.__new__(_Flight, (threading.get_ident(), jobs))  # NamedTuple's __new__ is a Python frame
        self._flights.append(flight)
        return flight

    def _land(self, flight: _Flight) -> None:
        with self._lock:
            flights = self._flights
            if len(flights) == 1 and flights[0] is flight:  # usually the only one: no list to rebuild
                self._flights = []
            else:
                self._flights = [f for f in flights if f is not flight]
            if self._flight_waiters:  # a notify_all with none waiting still costs two Python frames
                self._flight_landed.notify_all()

    def _wait_for_flights_elsewhere(self, concerns: Callable[[_Flight], bool]) -> None:
        """With the lock held: until no other thread runs a flush that ``concerns``. Not from
        inside autograd (a hook, a backward's capped flush): a flush made there runs its hooks
        on that backward's thread (autograd's device thread on CUDA), and cannot land until
        they return."""
        while self._flights_elsewhere(concerns):
            self._flight_waiters += 1  # the lock is held: counted with the wait it stands for
            try:
                self._flight_landed.wait()
            finally:
                self._flight_waiters -= 1

    def _flights_elsewhere(self, concerns: Callable[[_Flight], bool]) -> bool:
        if not self._flights or torch._C._current_graph_task_id() >= 0:
            return False
        me = threading.get_ident()
        return any(flight.thread != me and concerns(flight) for flight in self._flights)

    def _check_no_backward_elsewhere(self) -> None:
        if not self._running_backwards:  # unlocked: a backward starting just after is the same race either way
            return
        current = torch._C._current_graph_task_id()
        me = threading.get_ident()

        def elsewhere() -> list[int]:
            # A CPU backward runs on its caller: one of this thread's still running while this
            # thread is inside a backward encloses it (a hook's backward, a reentrant checkpoint).
            return [
                task for task, thread in self._running_backwards.items()
                if task != current and not (current >= 0 and thread == me and task < current)
            ]

        with self._lock:
            # A backward that raised on autograd's device thread (CUDA) is forgotten when that
            # thread drops its graph task, a moment after the caller has seen the exception.
            self._backward_waiters += 1  # the lock is held: counted with the wait it stands for
            try:
                self._backward_ended.wait_for(lambda: not elsewhere(), timeout=_RAISED_BACKWARD_GRACE_S)
            finally:
                self._backward_waiters -= 1
            running_elsewhere = elsewhere()
            on_device_threads = all(self._running_backwards[task] is None for task in running_elsewhere)
        if running_elsewhere and current >= 0 and on_device_threads:
            raise RuntimeError(
                "twobp: flush from inside a backward (a hook, a reentrant checkpoint's nested backward) "
                "while another backward that feeds this queue runs on autograd's device thread (CUDA), "
                "maybe the one enclosing it: flush after the backward instead."
            )
        if running_elsewhere:
            raise RuntimeError(
                "twobp: flush while a backward pass that feeds this queue is still running on "
                "another thread. Wait for that backward (join the thread) before flushing, or give "
                "each thread its own queue with twobp.use_queue()."
            )


#: id -> parameter whose queued work clear() dropped while its .grad was None.
dropped_without_grad: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()


def _given_grads_but_none_yet(jobs: Sequence[WeightGradJob], among: set[int] | None = None) -> dict[int, Tensor]:
    """The parameters (of ``among``, by id, where given) with a ``.grad`` of None that plain
    backward would have given one through ``jobs`` (asked only of jobs holding such a parameter:
    :meth:`WeightGradJob.params_given_grads` may run a kernel)."""

    def wanted(p: Tensor | None) -> bool:
        return p is not None and p.grad is None and (among is None or id(p) in among)

    return {id(p): p for job in jobs if any(map(wanted, job.params)) for p in job.params_given_grads() if wanted(p)}


def _tag_list(tags: Sequence[Hashable] | None) -> Sequence[Hashable] | None:
    """``tags`` as flush and take read them: an iterable of tags. A string (or bytes) is refused
    rather than read as one-letter tags, and so is a single tag that is not iterable."""
    if tags is None:
        return tags
    if not isinstance(tags, (str, bytes, Tensor)):  # a tensor's elements hash by identity: none is a tag
        try:
            listed = list(tags)
        except TypeError:
            pass
        else:
            for tag in listed:
                try:
                    hash(tag)
                except TypeError:
                    raise TypeError(
                        f"twobp: flush(tags=...) and take(tags=...) take a list of hashable tags; {tag!r} is "
                        f"a {type(tag).__name__}: pass a tuple for a tag made of several values"
                    ) from None
            return listed
    kind = "a string" if isinstance(tags, (str, bytes)) else f"an object of type {type(tags).__name__}"
    raise TypeError(
        f"twobp: flush(tags=...) and take(tags=...) take a list of tags, not {kind} ({tags!r}): "
        f"pass [{tags!r}] to flush that one tag"
    )


def takes_partial_gradients(hook: _Hook) -> _Hook:
    """Mark a post-accumulate-grad hook that ignores the deliveries of a capped queue's early
    flushes (a data-parallel synchroniser that counts only its own flush's): the parameter's
    work may then be flushed early like any other. Such a hook is also trusted to act on other
    parameters' gradients only once they are final, so a flush does not track for it which
    gradients it has handed over (the guards' check of a step or clipping inside a hook)."""
    setattr(hook, OWN_HOOK_MARK, True)
    return hook


def _by_tag(jobs: list[WeightGradJob]) -> list[list[WeightGradJob]]:
    """``jobs`` split per tag, in the order each tag first appears."""
    runs: dict[Hashable, list[WeightGradJob]] = {}
    for job in jobs:
        runs.setdefault(job.tag, []).append(job)
    return list(runs.values())


#: The group of a job of gradients an early flush held back (see :meth:`WeightGradQueue._run`).
_HELD_BACK = "held back by an early flush"


def _waits_for_the_flush(job: WeightGradJob) -> bool:
    """Whether the job holds gradients an early flush held back, or a parameter of it has a
    post-accumulate-grad hook that must see its whole gradient once per flush (see
    :meth:`WeightGradQueue._enforce_cap`)."""
    return job.group is _HELD_BACK or any(param is not None and has_user_hooks(param) for param in job.params)


def _warn_raised_backward_once() -> None:
    """A backward that raised leaves the work it queued, as plain autograd leaves what its
    accumulators had summed; but a parameter used more than once (a tied embedding and head, a
    block called twice) gets its gradient from plain's accumulator only once every use has
    reached it, while the split queued each use as the backward reached it."""
    warn_once(
        "raised backward left work",
        "twobp: a backward raised after it had queued weight-gradient work. A flush runs that work, "
        "as plain autograd keeps what its gradient accumulators had summed before the error, except "
        "for a parameter used more than once (a tied embedding and head, a block called twice): plain "
        "keeps none of that backward's gradient for it unless the error came after its last use, while "
        "each use reached before the error is queued here; and for the layer that raised, of which plain "
        "may have kept a part (a bias), or none (anomaly mode's NaN check stopped a node below its "
        "first), while its work is queued here. Drop the failed step's gradients before "
        "running it again: optimizer.zero_grad(), or twobp.discard_weight_grads() for the queued work "
        "alone.",
        RuntimeWarning,
        stacklevel=2,
    )


def _warn_cap_kept_for_hooks_once() -> None:
    warn_once(
        "cap kept for post-accumulate-grad hooks",
        "twobp: a capped WeightGradQueue holds more than max_pending_bytes because its work is for "
        "parameters with post-accumulate-grad hooks (optimizer-in-backward), or is FSDP2 gradients "
        "an early flush computed but could not reduce: that work is not flushed early, so that each "
        "hook sees the parameter's gradient once, and every rank reduces at the flush you call. "
        "Flush more often to bound the memory.",
        RuntimeWarning,
        stacklevel=3,
    )


def _ANY_WORK(flight: _Flight) -> bool:
    return True


def _memory_of(tensors: Iterable[Tensor]) -> Iterator[Tensor]:
    """The plain tensors whose storages ``tensors`` keep alive: a wrapper subclass (a DTensor, whose
    data_ptr() is 0 and whose storage is sized as the global tensor) by the tensors inside it, a
    sparse one (no storage of its own: a sparse input a Linear saved) by its indices and values."""
    for t in tensors:
        if t.layout != torch.strided:
            yield from _memory_of(getattr(t, part)() for part in _SPARSE_PARTS[t.layout])
        elif type(t) is Tensor or type(t) is torch.nn.Parameter or not is_traceable_wrapper_subclass(t):
            yield t
        else:
            inner = (getattr(t, name) for name in t.__tensor_flatten__()[0])
            yield from _memory_of(i for i in inner if isinstance(i, Tensor))  # DTensor's names its mesh too


#: A sparse layout's tensors, by their accessors.
_SPARSE_PARTS = {
    torch.sparse_coo: ("_indices", "_values"),
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}


def _storage_key(t: Tensor) -> tuple[int, torch.device]:
    return (t.data_ptr() - int(t.storage_offset()) * t.element_size(), t.device)


class _Block:
    """One entered :func:`use_queue` block: compared by identity, so that the exit of one block
    never takes another block of the same queue (on another thread, or interleaved here) for its own."""

    __slots__ = ("queue",)

    def __init__(self, queue: WeightGradQueue) -> None:
        self.queue = queue


#: The :func:`use_queue` blocks entered, innermost last, per context: a thread's own, and an
#: asyncio task's (two tasks awaiting inside their blocks on one thread each keep theirs; a
#: thread-local stack handed one task's work to the other's queue).
_queue_stack: contextvars.ContextVar[tuple[_Block, ...]] = contextvars.ContextVar("twobp_queue_stack", default=())
_default_queue = WeightGradQueue()


def _after_fork_in_child() -> None:
    for queue in list(_live_queues):
        queue._after_fork()


def _after_fork_in_parent() -> None:
    for queue in list(_live_queues):
        queue._mark_work_into_shared_grads()


os.register_at_fork(after_in_child=_after_fork_in_child, after_in_parent=_after_fork_in_parent)


def current_queue() -> WeightGradQueue:
    """The queue that forwards run now feed: the innermost :func:`use_queue` of this thread (or
    asyncio task), else the process-wide default queue."""
    stack = _queue_stack.get()
    return stack[-1].queue if stack else _default_queue


@contextlib.contextmanager
def use_queue(queue: WeightGradQueue) -> Iterator[WeightGradQueue]:
    """Send the weight-gradient work of the forwards run inside this block to ``queue``."""
    if not isinstance(queue, WeightGradQueue):
        raise TypeError(f"twobp: use_queue(queue) takes a WeightGradQueue, not {type(queue).__name__}")
    block = _Block(queue)
    mine = (*_queue_stack.get(), block)
    token = _queue_stack.set(mine)
    try:
        yield queue
    finally:
        now = _queue_stack.get()
        # Innermost: in order (or the last block out after another's out-of-order exit).
        in_order = bool(now) and now[-1] is block
        if now is mine:
            try:
                _queue_stack.reset(token)
            except ValueError:  # left in a copy of the context it was entered in (asyncio.to_thread)
                _queue_stack.set(now[:-1])
                in_order = False
        elif any(entry is block for entry in now):
            # Drop this block only; another context's stack (a generator closed by the garbage
            # collector on another thread) does not hold it and is left as it is.
            _queue_stack.set(tuple(entry for entry in now if entry is not block))
        if not in_order:
            raise RuntimeError(
                "twobp: use_queue blocks were left out of order (generators that yield inside their "
                "use_queue blocks share their thread's queues, so the forwards of one ran under another's "
                "queue), or in another thread or context than they were entered in. Keep each block "
                "between yields, or run each training loop on its own thread or asyncio task."
            )


def _given_queue(queue: object, what: str) -> WeightGradQueue:
    if queue is None:
        return current_queue()
    if not isinstance(queue, WeightGradQueue):
        raise TypeError(f"twobp: {what}(queue) takes a WeightGradQueue (or None), not {type(queue).__name__}")
    return queue


def flush_weight_grads(queue: WeightGradQueue | None = None) -> None:
    """Backward-p2: run all queued weight-gradient work into the parameters' ``.grad``. Where the
    current queue holds nothing but others do (forwards under ``use_queue``, the flush outside
    the block), it flushes nothing and says so once: the step and clipping refuse the queued
    work, but a read of ``.grad`` in between sees none of it."""
    if queue is None:
        queue = current_queue()
        others = _others_holding_work(queue)
        if others:
            warn_once(
                "flush of an empty current queue",
                f"twobp: flush_weight_grads() with the current queue empty while {len(others)} other "
                "queue(s) hold work (forwards ran under twobp.use_queue(queue)): nothing was flushed. "
                "Pass the queue, twobp.flush_weight_grads(queue), or flush inside the use_queue block.",
                stacklevel=2,
            )
    _given_queue(queue, "flush_weight_grads").flush()


def discard_weight_grads(queue: WeightGradQueue | None = None) -> None:
    """Drop all queued weight-gradient work (default: the current queue's) without computing
    it. The dropped work never reaches ``.grad``; what the step put there already (plain
    layers' gradients, a capped queue's early flushes) stays, so a failed step is dropped by
    ``optimizer.zero_grad()`` (which also drops its parameters' queued work). Refused where the
    current queue holds nothing but others do (forwards under ``use_queue``): the work meant to
    be dropped would reach ``.grad`` at their flush."""
    if queue is None:
        queue = current_queue()
        others = _others_holding_work(queue)
        if others:
            raise RuntimeError(
                f"twobp: discard_weight_grads() with the current queue empty while {len(others)} other "
                "queue(s) hold work (forwards ran under twobp.use_queue(queue)): pass the queue, "
                "twobp.discard_weight_grads(queue), or queue.clear()."
            )
    _given_queue(queue, "discard_weight_grads").clear()


def _others_holding_work(current: WeightGradQueue) -> list[WeightGradQueue]:
    """The queues holding work where the current one, which no use_queue block chose, holds none
    (a block that did chose the queue meant; other threads, each training under its own queue,
    may hold work at any moment)."""
    if _queue_stack.get() or current.busy():
        return []
    return [q for q in queues_with_work() if q is not current]


def pending(queue: WeightGradQueue | None = None) -> PendingWork:
    """Jobs and bytes held by ``queue`` (default: the current one)."""
    return _given_queue(queue, "pending").pending()


def queues_with_work() -> list[WeightGradQueue]:
    return [q for q in list(_live_queues) if q.busy()]


def queued_among(params: Sequence[Tensor], *, wait: bool = False) -> set[int]:
    """The ids of those of ``params`` a queue holds work for (see :meth:`WeightGradQueue.has_work_for`
    for ``wait``)."""
    queues = queues_with_work()
    if not queues or not params:
        return set()
    return {id(p) for p in params if any(q.has_work_for([p], wait=wait) for q in queues)}


flush_module.queued_among = queued_among

