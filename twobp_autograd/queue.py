"""Pending weight-gradient work (backward-p2), grouped per layer and flushed in one batch.

Backward-p1 leaves one :class:`WeightGradJob` per patched call: the tensors the layer's
weight-gradient kernel needs and the gradient of the layer's output. A flush groups the jobs
that share a kernel, parameters and trailing shapes, concatenates their micro-batches on
dimension 0 where that pays and runs the kernel once per group (else once per micro-batch,
summed), then hands the sums to autograd's own gradient accumulation, so ``.grad`` ends exactly as plain backward would leave it (``None``
handling, dtype, layout, tensor hooks and post-accumulate hooks included).

One default queue serves the whole process, so work queued by a forward run on any thread
(a worker pool, a serving thread) is reached by a flush from the thread that trains; it is
thread-safe. :func:`use_queue` sends the forwards run inside it (on that thread) to another
queue, for whoever wants separation (one per pipeline stage, one per concurrently training
thread). A queue is bound at forward time, because on CUDA the backward runs on autograd's
device threads, not the caller's.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor

from .offload import HostOffload, ParkedTensors
from .streams import LaunchedGroups

__all__ = [
    "WeightGradKernel",
    "WeightGradJob",
    "WeightGradQueue",
    "PendingWork",
    "use_queue",
    "current_queue",
    "flush_weight_grads",
    "discard_weight_grads",
    "pending",
]

#: ``kernel(saved, grad_outputs, needs) -> one gradient (or None) per parameter``.
#: ``saved`` and ``grad_outputs`` hold one micro-batch, or several concatenated on dim 0.
WeightGradKernel = Callable[[Sequence[Tensor], Sequence[Tensor], Sequence[bool]], Sequence["Tensor | None"]]

FlushStrategy = Literal["concat", "loop", "auto"]


class PendingWork(NamedTuple):
    """What a queue holds: number of jobs, and bytes of the distinct storages they keep alive
    (host copies of offloaded work not counted)."""

    jobs: int
    bytes: int


class WeightGradJob:
    """One patched call's deferred weight-gradient work (built once per call in backward-p1:
    a slotted class, kept cheap)."""

    __slots__ = ("kernel", "group", "concatenate", "params", "saved", "grad_outputs", "tag", "versions", "parked")

    def __init__(
        self,
        kernel: WeightGradKernel,
        group: Hashable,
        concatenate: "bool | None",
        params: tuple["torch.nn.Parameter | None", ...],
        saved: tuple[Tensor, ...],
        grad_outputs: tuple[Tensor, ...],
        tag: Hashable = None,
    ) -> None:
        self.kernel = kernel
        self.group = group  # jobs with equal group may be concatenated and run as one call
        self.concatenate = concatenate  # False: never joined; True: joining pays; None: off the CPU
        self.params = params  # None where that gradient is not wanted
        self.saved = saved
        self.grad_outputs = grad_outputs
        self.tag = tag
        self.versions = self._versions()
        self.parked: "ParkedTensors | None" = None  # set when offloaded to host memory

    def _versions(self) -> tuple[int, ...]:
        watched = (*self.saved, *self.grad_outputs, *(p for p in self.params if p is not None))
        return tuple(t._version for t in watched)

    def check_unmodified(self) -> None:
        if self._versions() != self.versions:
            raise RuntimeError(
                "twobp: a tensor that a queued weight-gradient job needs (a saved activation, an "
                "output gradient or the parameter itself) was modified in place between backward "
                "and flush_weight_grads(). Flush before modifying it; the work stays queued until "
                "twobp.discard_weight_grads() (or queue.clear() for a queue of your own) drops it."
            )

    def tensors(self) -> tuple[Tensor, ...]:
        return (*self.saved, *self.grad_outputs)

    def held_tensors(self) -> tuple[Tensor, ...]:
        """The tensors this job keeps alive on their devices (none once offloaded)."""
        return () if self.parked is not None else self.tensors()

    def park(self, offload: HostOffload) -> None:
        """Swap the job's tensors for host copies (only those on CUDA move)."""
        parked = offload.park(self.tensors())
        if parked is None:
            return
        self.parked = parked
        self.saved, self.grad_outputs = parked.tensors[: len(self.saved)], parked.tensors[len(self.saved) :]
        self.versions = self._versions()  # the copies are what is checked from now on

    def on_device(self) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
        """``(saved, grad_outputs)`` where the kernel runs (copied back if offloaded)."""
        if self.parked is None:
            return self.saved, self.grad_outputs
        tensors = self.parked.restore()
        return tensors[: len(self.saved)], tensors[len(self.saved) :]

    @property
    def device(self) -> torch.device:
        """Where the kernel runs: its parameters' device."""
        return next(p for p in self.params if p is not None).device

    @property
    def needs(self) -> tuple[bool, ...]:
        return tuple(p is not None for p in self.params)


_live_queues: "weakref.WeakSet[WeightGradQueue]" = weakref.WeakSet()


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
        max_pending_bytes: "int | None" = None,
        delivery_bucket_bytes: "int | None" = None,
        offload_to_host: bool = False,
        weight_grad_streams: int = 1,
    ) -> None:
        if weight_grad_streams < 1:
            raise ValueError(f"weight_grad_streams must be >= 1, not {weight_grad_streams}")
        if offload_to_host and not torch.cuda.is_available():
            raise ValueError(
                "offload_to_host parks CUDA tensors in pinned host memory, but CUDA is not "
                "available; on the CPU the pending work already lives in host memory."
            )
        if strategy not in ("concat", "loop", "auto"):
            raise ValueError(f"strategy must be 'concat', 'loop' or 'auto', not {strategy!r}")
        if max_pending_bytes is not None and max_pending_bytes < 0:
            raise ValueError(f"max_pending_bytes must be >= 0 or None, not {max_pending_bytes}")
        self.strategy: FlushStrategy = strategy
        self.max_concat_bytes = max_concat_bytes
        self.max_pending_bytes = max_pending_bytes
        self.delivery_bucket_bytes = delivery_bucket_bytes
        self.weight_grad_streams = weight_grad_streams
        self._offload = HostOffload() if offload_to_host else None
        self._jobs: list[WeightGradJob] = []
        self._held: dict[tuple, list[int]] = {}  # storage -> [tensors of jobs on it, its bytes]
        self._held_bytes = 0
        self._lock = threading.Lock()
        self._running_backwards: dict[int, int] = {}  # graph task id -> thread ident
        self._tag: Hashable = None
        self._cap_deferred = 0  # depth of cap_enforced_after blocks
        _live_queues.add(self)

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
    def tagged(self, tag: Hashable) -> Iterator["WeightGradQueue"]:
        """Tag the jobs of the backward passes run inside (e.g. with a micro-batch index)."""
        previous, self._tag = self._tag, tag
        try:
            yield self
        finally:
            self._tag = previous

    def enqueue(self, job: WeightGradJob) -> None:
        """Called from backward-p1. Records the running backward so a flush elsewhere waits."""
        task = torch._C._current_graph_task_id()
        with self._lock:
            if job.tag is None:  # not tagged at forward time: take the backward's tag
                job.tag = self._tag
            if self._offload is not None:
                job.park(self._offload)
            self._jobs.append(job)
            self._count([job], +1)
            if task >= 0 and task not in self._running_backwards:
                self._running_backwards[task] = threading.get_ident()
                torch.autograd.Variable._execution_engine.queue_callback(
                    lambda: self._running_backwards.pop(task, None)
                )
        if not self._cap_deferred:
            self._enforce_cap()

    @contextlib.contextmanager
    def cap_enforced_after(self) -> Iterator["WeightGradQueue"]:
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
        """Flush the oldest jobs until the rest fits under ``max_pending_bytes``."""
        while self.max_pending_bytes is not None and self._held_bytes > self.max_pending_bytes and self._jobs:
            with self._lock:
                over = self._held_bytes - self.max_pending_bytes
                count, freed = 0, 0
                while freed < over and count < len(self._jobs):  # a guess: storages shared by jobs count twice
                    freed += sum(t.untyped_storage().nbytes() for t in self._jobs[count].held_tensors())
                    count += 1
                oldest, self._jobs = self._jobs[:count], self._jobs[count:]
                self._count(oldest, -1)
            self._run(oldest)

    def _count(self, jobs: Sequence[WeightGradJob], sign: int) -> None:
        """Keep ``_held_bytes`` equal to the bytes of the distinct storages ``_jobs`` keep
        alive (a saved view keeps its whole storage alive; two views of one count once).
        Only a queue with a cap keeps it incrementally; others count on demand."""
        if self.max_pending_bytes is None:
            return
        for job in jobs:
            for t in job.held_tensors():
                key = _storage_key(t)
                entry = self._held.setdefault(key, [0, t.untyped_storage().nbytes()])
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
            storages = {_storage_key(t): t.untyped_storage().nbytes() for job in self._jobs for t in job.held_tensors()}
        return PendingWork(len(self._jobs), sum(storages.values()))

    def tags(self) -> list[Hashable]:
        return list(dict.fromkeys(job.tag for job in self._jobs))

    def has_work_for(self, params: Sequence[Tensor]) -> bool:
        if not self._jobs:
            return False
        queued = {id(p) for job in self._jobs for p in job.params if p is not None}
        return any(id(p) in queued for p in params)

    # -- running -------------------------------------------------------------------------

    def clear(self) -> None:
        """Drop all queued work without computing it."""
        with self._lock:
            self._jobs.clear()
            self._held.clear()
            self._held_bytes = 0
            self._running_backwards.clear()

    def take(self, tags: "Sequence[Hashable] | None" = None) -> list[WeightGradJob]:
        """Remove and return the jobs with the given tags (all jobs when ``tags`` is None)."""
        self._check_no_backward_elsewhere()
        with self._lock:
            if tags is None:
                taken, self._jobs = self._jobs, []
            else:
                wanted = set(tags)
                taken = [j for j in self._jobs if j.tag in wanted]
                self._jobs = [j for j in self._jobs if j.tag not in wanted]
            self._count(taken, -1)
        return taken

    def flush(self, tags: "Sequence[Hashable] | None" = None) -> None:
        """Run the queued weight-gradient work (all of it, or that of ``tags``) into ``.grad``.

        Without ``delivery_bucket_bytes``, nothing reaches ``.grad`` unless every job ran, and a
        flush that raises leaves its work queued (so ``optimizer.step()`` stays refused) until
        a good flush or :meth:`clear`. With it, a flush that raises midway has delivered part
        of its work and drops the rest: the step's gradients are incomplete."""
        self._run(self.take(tags))

    def _run(self, jobs: list[WeightGradJob]) -> None:
        """Run jobs already taken out of the queue; on failure put them back, oldest first,
        unless bucketed delivery may already have put part of them into ``.grad``."""
        try:
            run_jobs(jobs, self.strategy, self.max_concat_bytes, self.delivery_bucket_bytes, self.weight_grad_streams)
        except BaseException:
            if self.delivery_bucket_bytes is None:
                with self._lock:
                    self._jobs[:0] = jobs
                    self._count(jobs, +1)
            raise

    def _check_no_backward_elsewhere(self) -> None:
        me = threading.get_ident()
        current = torch._C._current_graph_task_id()
        with self._lock:
            for task, thread in list(self._running_backwards.items()):
                # Another backward of this thread has ended: CPU backward runs synchronously on
                # its caller (one that raised never ran its end-of-task callback).
                if task != current and thread == me:
                    del self._running_backwards[task]
            running_elsewhere = [t for t in self._running_backwards if t != current]
        if running_elsewhere:
            raise RuntimeError(
                "twobp: flush while a backward pass that feeds this queue is still running on "
                "another thread. Wait for that backward (join the thread) before flushing, or give "
                "each thread its own queue with twobp.use_queue(). If that backward raised, "
                "twobp.discard_weight_grads() (or queue.clear()) drops its partial work."
            )


def _storage_key(t: Tensor) -> tuple[int, torch.device]:
    return (t.data_ptr() - t.storage_offset() * t.element_size(), t.device)


def run_jobs(
    jobs: Sequence[WeightGradJob],
    strategy: FlushStrategy,
    max_concat_bytes: int,
    delivery_bucket_bytes: "int | None" = None,
    weight_grad_streams: int = 1,
) -> None:
    """Run ``jobs`` grouped per layer and accumulate the results into ``.grad`` via autograd.

    A parameter's gradient is delivered once its last group has run: all at the end, or with
    ``delivery_bucket_bytes`` in buckets of about that size while later groups still run.
    ``weight_grad_streams`` > 1: every group's kernels are launched first, spread over that
    many CUDA side streams, then summed and delivered in order (:mod:`.streams`)."""
    if not jobs:
        return
    for job in jobs:
        job.check_unmodified()
    grouped: dict[tuple, list[WeightGradJob]] = {}
    for job in jobs:
        shapes = tuple((t.shape[1:], t.dtype, t.device) for t in job.tensors())
        grouped.setdefault((job.group, tuple(map(id, job.params)), shapes), []).append(job)
    groups = list(grouped.values())
    last_group = {id(p): index for index, group in enumerate(groups) for p in group[0].params if p is not None}

    summing: dict[int, tuple[Tensor, _Sum]] = {}  # id(param) -> (param, gradient so far)
    ready: list[tuple[Tensor, Tensor]] = []
    ready_bytes = 0
    with torch.no_grad():
        launched = None
        if weight_grad_streams > 1:
            launched = LaunchedGroups(
                [(group[0].device, [t for job in group for t in job.tensors()]) for group in groups],
                lambda index: _run_group(groups[index], strategy, max_concat_bytes),
                weight_grad_streams,
            )
        for index, group in enumerate(groups):
            if launched is None:
                _add_group_grads(summing, group[0].params, _run_group(group, strategy, max_concat_bytes))
            else:
                _add_group_grads(summing, group[0].params, launched.take(index))
            for param in group[0].params:
                if param is not None and last_group[id(param)] == index and id(param) in summing:
                    done, total = summing.pop(id(param))
                    ready.append((done, total.tensor))
                    del total
                    ready_bytes += param.numel() * param.element_size()
            if delivery_bucket_bytes is not None and ready_bytes >= delivery_bucket_bytes:
                _deliver(ready)
                ready_bytes = 0
    _deliver(ready)


def _add_group_grads(
    summing: dict[int, tuple[Tensor, "_Sum"]], params: Sequence["Tensor | None"], grads: Sequence["Tensor | None"]
) -> None:
    """Add one group's gradients, each cast to its parameter's dtype first as autograd casts
    each path before summing. (A frame of its own: no local outlives it to hold a gradient.)"""
    for param, grad in zip(params, grads):
        if param is None or grad is None:
            continue
        entry = summing.get(id(param))
        summing[id(param)] = (param, _sum(entry[1] if entry else None, grad.to(param.dtype)))  # type: ignore[arg-type]


def _deliver(ready: list[tuple[Tensor, Tensor]]) -> None:
    """Hand ``ready``'s gradients to their parameters and empty it."""
    if not ready:
        return
    params = [param for param, _ in ready]
    handover = [[grad for _, grad in ready]]
    ready.clear()
    # A parameter frozen (requires_grad_(False)) between backward and flush still gets the
    # gradient plain autograd gave it during backward: it is unfrozen for the hand-over.
    frozen = [p for p in params if not p.requires_grad]
    try:
        for param in frozen:
            param.requires_grad_(True)
        with torch.enable_grad():
            _HandOver.apply(handover, *params).backward()
    finally:
        for param in frozen:
            param.requires_grad_(False)


class _HandOver(torch.autograd.Function):
    """Delivers the summed gradients to the parameters through autograd's own AccumulateGrad
    (same None, dtype, layout and hook rules as a plain backward). They leave from this node's
    backward with no other reference alive, so an empty ``.grad`` takes the tensor as it is
    instead of a copy (``torch.autograd.backward(params, grads)`` would copy every one)."""

    @staticmethod
    def forward(ctx: Any, handover: list, *params: Tensor) -> Tensor:
        ctx.handover = handover
        return params[0].new_zeros(())

    @staticmethod
    def backward(ctx: Any, _: Tensor) -> tuple["Tensor | None", ...]:
        return (None, *ctx.handover.pop())


def _run_group(group: list[WeightGradJob], strategy: FlushStrategy, max_concat_bytes: int) -> Sequence["Tensor | None"]:
    first = group[0]
    needs = first.needs
    if len(group) == 1:
        return first.kernel(*first.on_device(), needs)
    if first.concatenate is False or strategy == "loop":
        concat = False
    elif strategy == "concat":
        concat = True
    else:
        pays = first.concatenate or first.device.type != "cpu"
        concat = pays and sum(t.numel() * t.element_size() for j in group for t in j.tensors()) <= max_concat_bytes
    if concat:
        on_device = [job.on_device() for job in group]
        saved = [torch.cat(ts) for ts in zip(*(s for s, _ in on_device))]
        grad_outputs = [torch.cat(ts) for ts in zip(*(g for _, g in on_device))]
        del on_device
        return first.kernel(saved, grad_outputs, needs)
    # Summed in each parameter's dtype, as AccumulateGrad sums micro-batches: bf16 partial
    # sums into an fp32 parameter would lose precision with every micro-batch.
    dtypes = [p.dtype if p is not None else None for p in first.params]
    total: list["_Sum | None"] = [None] * len(needs)
    for job in group:
        for i, grad in enumerate(job.kernel(*job.on_device(), needs)):
            total[i] = _sum(total[i], None if grad is None else grad.to(dtypes[i]))
    return [t.tensor if t is not None else None for t in total]


class _Sum:
    """A running sum that owns its tensor before adding into it in place: a kernel may return
    a tensor it did not make (a recomputed ``x + bias`` returns the output gradient itself),
    and autograd hands one gradient tensor to several branches, so another job may still
    need it."""

    __slots__ = ("tensor", "owned")

    def __init__(self, tensor: Tensor) -> None:
        self.tensor, self.owned = tensor, False

    def add(self, other: Tensor) -> "_Sum":
        if self.owned:
            self.tensor.add_(other)
        else:
            self.tensor, self.owned = self.tensor + other, True
        return self


def _sum(total: "_Sum | None", grad: "Tensor | None") -> "_Sum | None":
    if grad is None:
        return total
    return _Sum(grad) if total is None else total.add(grad)


# -- the queue in use -----------------------------------------------------------------------


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.stack: list[WeightGradQueue] = []


_state = _ThreadState()
_default_queue = WeightGradQueue()


def current_queue() -> WeightGradQueue:
    """The queue that forwards run now feed: this thread's innermost :func:`use_queue`, else
    the process-wide default queue."""
    return _state.stack[-1] if _state.stack else _default_queue


@contextlib.contextmanager
def use_queue(queue: WeightGradQueue) -> Iterator[WeightGradQueue]:
    """Send the weight-gradient work of the forwards run inside this block to ``queue``."""
    if not isinstance(queue, WeightGradQueue):
        raise TypeError(f"use_queue expects a WeightGradQueue, got {type(queue).__name__}")
    _state.stack.append(queue)
    try:
        yield queue
    finally:
        _state.stack.pop()


def flush_weight_grads(queue: "WeightGradQueue | None" = None) -> None:
    """Backward-p2: run all queued weight-gradient work into the parameters' ``.grad``."""
    (queue if queue is not None else current_queue()).flush()


def discard_weight_grads(queue: "WeightGradQueue | None" = None) -> None:
    """Drop all queued weight-gradient work (default: the current queue's) without computing
    it: after a failed step, to start the next one clean. The dropped micro-batches contribute
    nothing to ``.grad``."""
    (queue if queue is not None else current_queue()).clear()


def pending(queue: "WeightGradQueue | None" = None) -> PendingWork:
    """Jobs and bytes held by ``queue`` (default: the current one)."""
    return (queue if queue is not None else current_queue()).pending()


def queues_with_work() -> list[WeightGradQueue]:
    return [q for q in list(_live_queues) if len(q)]

