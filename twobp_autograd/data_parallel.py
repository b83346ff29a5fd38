"""Data parallelism for patched models: DDP's averaged gradients, reduced while backward-p2 runs.

DDP starts a bucket's all-reduce from autograd hooks as soon as backward has accumulated every
gradient in it. On a patched model most weight gradients do not exist after backward: the
flush makes them. :class:`GradientSynchroniser` therefore runs the flush itself, with bucketed
delivery, and launches each bucket's asynchronous all-reduce from the parameters'
post-accumulate hooks the moment its last gradient is final, so communication overlaps the
rest of the flush. Gradients that backward already finished (unpatched modules, layers that
fell back to plain autograd) are ready before the flush and go first.

Collectives must be issued in one order on every rank, so buckets launch strictly in their
index order: at first DDP's (parameters in reverse), from the second step on the order in
which gradients became final on the group's first rank (broadcast once). A parameter without
a gradient on some rank counts as zero there; one without a gradient on every rank keeps
``.grad`` None, as DDP with ``find_unused_parameters=True`` does.

Usage, alone (in place of ``DistributedDataParallel``)::

    twobp.patch(model)
    sync = GradientSynchroniser(model)   # broadcasts rank 0's parameters and buffers
    loss_fn(model(x), y).backward()      # input gradients only; weight work queued
    sync.synchronise()                   # flush + overlapped all-reduce; .grad = mean over ranks
    optimizer.step()

For a model sharded with ``fully_shard`` (FSDP2) there is nothing to add: the flush itself
reduce-scatters the sharded gradients (:mod:`twobp_autograd.fsdp`).

With the pipeline runtime, pass it as ``PipelineRuntime(..., grad_sync=sync)`` with ``group`` the
data-parallel group of the rank's stage: the W actions after the step's last backward flush
through :meth:`GradientSynchroniser.flush`, and the step ends with
:meth:`GradientSynchroniser.finish`.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import time
import warnings
import weakref
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from . import fsdp_hooks
from .flush import OWN_HOOK_MARK, READS_ONLY_MARK, accumulated_dtype, check_count, reads_grad_only, run_jobs
from .grad_guard import install_grad_guards, read_checks, step_checks
from .queue import WeightGradQueue, current_queue, queued_among, queues_with_work, takes_partial_gradients

__all__ = ["GradientSynchroniser", "ReductionFailed", "broadcast_tensors"]


class ReductionFailed(RuntimeError):
    """A collective of the synchroniser failed or timed out: a peer failed, died or hung."""


_FIRST_BUCKET_BYTES = 1 << 20  # small, so communication starts early (DDP does the same)


@dataclass
class _Bucket:
    """Parameters reduced together: one dtype and device, contiguous in the launch order."""

    params: list[int]  # indices into GradientSynchroniser.params
    numel: int
    dtype: torch.dtype
    device: torch.device


class GradientSynchroniser:
    """Averages the gradients of ``module``'s parameters over the ranks of ``group`` (default:
    the whole world), overlapping the all-reduce with the flush of the weight-gradient queue.

    ``bucket_bytes``: size of one all-reduce (DDP's ``bucket_cap_mb``). ``queue``: the queue the
    module's forwards feed (default: the current queue when flushing). ``broadcast_buffers``:
    like DDP (with ``no_sync`` for all but a step's last micro-batch), the first training
    forward of each step takes the buffers (e.g. BatchNorm running statistics) of the
    group's first rank. ``sync_initial_state``: like DDP's constructor,
    start from the first rank's parameters and buffers. ``timeout``: seconds any reduction
    may take before :meth:`finish` raises.
    """

    # One step's progress, set by reset().
    _ready: list[bool]
    _missing: list[int]
    _next_bucket: int
    _works: list[tuple[object, _Bucket, Tensor]]
    _observed: list[int]
    _armed: bool
    _final: set[int]

    def __init__(
        self,
        module: nn.Module,
        *,
        group: dist.ProcessGroup | None = None,
        bucket_bytes: int = 25 << 20,
        queue: WeightGradQueue | None = None,
        broadcast_buffers: bool = True,
        sync_initial_state: bool = True,
        timeout: float | None = None,
    ) -> None:
        check_count("bucket_bytes", bucket_bytes, least=1, whole_floats=True)
        if fsdp_hooks.fsdp_in_use():
            from torch.distributed.fsdp import FSDPModule

            if any(isinstance(m, FSDPModule) for m in module.modules()):
                raise TypeError(
                    "twobp: GradientSynchroniser averages replicated gradients, but this module is "
                    "sharded with fully_shard, which reduces its own: call twobp.flush_weight_grads() "
                    "after backward (it reduce-scatters each group as its gradients become final)."
                )
        if any(isinstance(p, DTensor) for p in module.parameters()):
            raise TypeError(
                "twobp: GradientSynchroniser averages plain tensors, but this module has DTensor "
                "parameters (tensor parallel): their gradients may be laid out otherwise than the "
                "parameters (a row-wise Embedding's is replicated, a sequence-parallel norm's a partial "
                "sum). For data parallel over a tensor-parallel model, shard it with fully_shard over "
                "the data-parallel mesh dimension and call twobp.flush_weight_grads() (tested)."
            )
        # Refused here, not at a flush: that one had taken the step's queued work already.
        sparse = [
            m
            for m in module.modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad
        ]
        if sparse:
            raise TypeError(
                f"twobp: GradientSynchroniser reduces dense gradients only, but {type(sparse[0]).__name__} "
                f"{sparse[0]} has sparse=True (its gradient is a sparse tensor): build it with sparse=False."
            )
        self.module = module
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.bucket_bytes = int(bucket_bytes)  # 25e6 as often as 25 << 20
        self.queue = queue
        self.timeout = timeout
        # Deduplicated: a tied weight is one parameter, reduced once.
        self.params: list[nn.Parameter] = [p for p in module.parameters() if p.requires_grad]
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._build_buckets(list(reversed(range(len(self.params)))))
        self._order_agreed = False
        self._warned_of_unknown = False
        # A backward (or a flush outside this synchroniser) has touched the parameters since the
        # last finish(): an optimizer step now would use each rank's own gradients.
        self._unsynchronised = False
        install_grad_guards()  # whose step check asks this synchroniser too
        _live.add(self)
        # Weak: PyTorch's garbage collector does not look into a parameter's post-accumulate-grad
        # hooks, so a hook holding this synchroniser (which holds the parameters) would be a cycle
        # never collected, keeping the whole model alive after the caller dropped it.
        on_accumulated = _weak_hook(self._on_accumulated)
        self._hooks = [p.register_post_accumulate_grad_hook(on_accumulated) for p in self.params]
        # The step is marked unsynchronised by a hook run before every other (the one above is moved
        # after the user's, see _hook_last): a user's hook stepping an optimizer (optimizer-in-
        # backward) must find it marked, registered before this synchroniser or after.
        mark = _weak_hook(self._mark_unsynchronised)
        for p in self.params:
            handle = p.register_post_accumulate_grad_hook(mark)
            # First by re-inserting the others after it: autograd calls them in the dict's own
            # order, which OrderedDict.move_to_end does not change.
            hooks = p._post_accumulate_grad_hooks
            hooks.update([(key, hooks.pop(key)) for key in list(hooks) if key != handle.id])
            self._hooks.append(handle)
        self._check_same_parameters(broadcast_buffers and sync_initial_state)
        if sync_initial_state:
            with torch.no_grad():
                # As DDP: broadcast_buffers=False leaves rank-local buffers as they are.
                broadcast_tensors([*module.parameters(), *(module.buffers() if broadcast_buffers else ())], group=group)
        self._broadcasts_buffers = broadcast_buffers and any(True for _ in module.buffers())
        if self._broadcasts_buffers:
            training_forward = _weak_hook(self._training_forward)
            self._hooks.extend(m.register_forward_pre_hook(training_forward) for m in _called_modules(module))
        weakref.finalize(self, _remove_handles, list(self._hooks))
        self.reset()

    def _check_same_parameters(self, buffers: bool) -> None:
        """Every rank of the group must reduce the same parameters (as DDP checks at
        construction): different shapes make gloo abort the process, or NCCL hang."""
        shapes = [tuple(p.shape) for p in self.params]
        everything = [tuple(t.shape) for t in (*self.module.parameters(), *(self.module.buffers() if buffers else ()))]
        digest = int.from_bytes(hashlib.sha256(repr((shapes, everything)).encode()).digest()[:7], "little")
        mine = torch.tensor([len(self.params), digest], dtype=torch.int64)
        both = torch.cat([mine, -mine]).to(self._collective_device())
        self._wait(dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group, async_op=True))
        if not torch.equal(both[:2], -both[2:]):
            raise RuntimeError(
                f"twobp: GradientSynchroniser: the ranks of the group do not train the same parameters "
                f"(this rank: {len(self.params)} trainable, shapes {shapes[:4]}{'...' if len(shapes) > 4 else ''}). "
                "Pass the data-parallel group (the replicas of this rank's pipeline stage, e.g. "
                "mesh.get_group('dp')), and freeze the same parameters on every replica."
            )

    # -- the step -------------------------------------------------------------------------

    def synchronise(self, queue: WeightGradQueue | None = None) -> None:
        """Flush all queued weight work with the all-reduce overlapped, and wait until every
        gradient is the mean over ranks. Call it where a DDP user's backward would end."""
        self.flush(queue)
        self.finish()

    def flush(
        self,
        queue: WeightGradQueue | None = None,
        tags: Sequence[Hashable] | None = None,
        params: Iterable[Tensor] | None = None,
    ) -> None:
        """Run the queued work of ``tags`` (all when None), launching each bucket's all-reduce
        once its gradients are final. Call only when no more backward passes will add to the
        gradients of ``params`` (default: all of the module's) this step; later work queued for
        a parameter keeps it waiting. A rank holding several pipeline stages passes the flushed
        stage's: another stage's backwards may be still to come with nothing queued (a capped
        queue flushed it early). A flush that raises before any gradient reached ``.grad``
        leaves its work queued (a refusal's fix, then this flush again, runs the step as
        before); one that raises after (:class:`~twobp_autograd.flush.PartlyDelivered`) has
        dropped its work and may have launched part of the reductions: discard the step
        (``zero_grad``). Either way this step's launched reductions are forgotten."""
        if queue is None:  # not `or`: an empty queue is falsy
            queue = self.queue if self.queue is not None else current_queue()
        try:
            # A refusal here (a backward still running) gives the step up too (see below).
            jobs = queue.take(tags)
            delivered = {id(p) for job in jobs for p in job.params if p is not None}
            # Work left for a later flush of this step keeps its parameters waiting: in this queue
            # (schedules whose last backward is followed by several W actions), or in another (a rank
            # holding several pipeline stages, each with its queue, flushed one after the other).
            waiting = queues_with_work()
            later = {id(p) for p in self.params if any(q.has_work_for([p]) for q in waiting)} if waiting else set()
            may_be_final = None if params is None else {id(p) for p in params}
            # Inside running(): a refusal here (a sparse gradient) puts the taken work back.
            with queue.running(jobs):
                for i, p in enumerate(self.params):  # finished by backward or an earlier flush, or unused
                    if may_be_final is not None and id(p) not in may_be_final:
                        continue
                    if not self._ready[i] and id(p) not in delivered and id(p) not in later:
                        self._mark_ready(i)
                self._final = delivered - later if may_be_final is None else (delivered - later) & may_be_final
                self._armed = True
                self._hook_last()
                bucket = max(1, self.bucket_bytes // 4)
                run_jobs(jobs, dataclasses.replace(queue.flush_options, delivery_bucket_bytes=bucket))
        except BaseException:
            # Forget this flush's readiness and launched buckets, so that neither a retry nor the
            # next step writes a reduction of these gradients back (a retry launches its own).
            # The buckets not launched yet are launched marked aborted: every rank then issues
            # each bucket of the step once (ranks launch different prefixes before a failure
            # where their unused parameters differ), and a peer whose step went on raises.
            self.abort()
            raise
        finally:
            self._armed = False
            self._final = set()

    def _hook_last(self) -> None:
        """Move this synchroniser's hook after the others on each parameter: a hook registered
        later (per-parameter clipping, noise) edits .grad in place, and DDP reduces what it left;
        launched from a hook that ran first, the bucket took the unedited gradient and its mean
        was written over the edit."""
        for p, handle in zip(self.params, self._hooks, strict=False):
            hooks = p._post_accumulate_grad_hooks
            if hooks and handle.id in hooks and next(reversed(hooks)) != handle.id:
                hooks[handle.id] = hooks.pop(handle.id)

    def finish(self) -> None:
        """Launch what is left (parameters without a gradient take part as zeros), wait for
        every reduction and write the means into ``.grad``. Refused while work for one of the
        parameters is queued (its gradient would arrive after the reduction, unreduced)."""
        self._refuse_queued_work()
        try:
            for b in range(self._next_bucket, len(self._buckets)):
                self._launch(b)
            self._next_bucket = len(self._buckets)
            for work, _, flat in self._works:
                self._wait(work)
                if flat[-1].item():
                    raise ReductionFailed(
                        "twobp: GradientSynchroniser: the step's synchronise failed on another rank of "
                        "the group (see its error); this rank's gradients are left as they were: "
                        "zero_grad() and run the step again on every rank, or fix and retry."
                    )
            for _, bucket, flat in self._works:
                self._write_back(bucket, flat)
            if not self._order_agreed:
                self._agree_on_order()
            self._warn_of_unknown_gradients()
            self._unsynchronised = False
        finally:
            self.reset()

    def _refuse_queued_work(self) -> None:
        queued = len(queued_among(self.params, wait=True))
        if queued:
            self.abort()
            raise RuntimeError(
                f"twobp: GradientSynchroniser: {queued} parameter(s) still have weight work queued when "
                "their reduction would start, so their gradients would arrive later, unreduced. The "
                "forwards ran under twobp.use_queue(queue) and the synchroniser flushed another queue: "
                "pass that one, sync.synchronise(queue) or GradientSynchroniser(model, queue=queue) "
                "(or sync.flush(queue) for each queue before sync.finish())."
            )

    def _warn_of_unknown_gradients(self) -> None:
        """A parameter that trains now but did not when this synchroniser was built (unfrozen,
        added, or in a replaced module) is not averaged: the ranks' copies drift apart."""
        unknown = [p for p in self.module.parameters() if p.grad is not None and id(p) not in self._index]
        if unknown and not self._warned_of_unknown:
            # Once per synchroniser (not keyed by id(self) in warn_once's process-wide set: a new
            # synchroniser at a recycled address would stay silent).
            self._warned_of_unknown = True
            warnings.warn(
                f"twobp: {len(unknown)} parameter(s) of the module got gradients but were not trainable "
                "parameters of it when this GradientSynchroniser was built (unfrozen, added or replaced "
                "since): they are not averaged, so the ranks' copies drift apart. Build a new "
                "GradientSynchroniser after changing what trains (close() the old one).",
                stacklevel=3,
            )

    def abort(self) -> None:
        """Give up this rank's step: send the step's buckets not sent yet, marked given up, and
        forget the step. Its peers' :meth:`finish` then raises :class:`ReductionFailed` instead of
        pairing their reductions with this rank's next step (silently wrong means on every rank).
        For a step that failed on this rank before its :meth:`finish` (or :meth:`synchronise`);
        a failed ``flush`` or ``finish`` has already ended the step, and an abort after it would
        give up the next one; :class:`~twobp_autograd.pipeline.PipelineRuntime` gives its failed
        steps up itself. Buckets already sent stay sent: after a flush that sent them all, the
        peers' step completes."""
        try:
            if self._buffers_due and any(m.training for m in _called_modules(self.module)):
                # The step failed before its first training forward, whose buffer broadcast its
                # peers made: make it here, else their broadcast pairs with a bucket's all-reduce.
                self._broadcast_buffers()
            all_sent = self._next_bucket == len(self._buckets) and bool(self._works)
            for b in range(self._next_bucket, len(self._buckets)):
                self._launch(b, aborted=True)
            if all_sent and not self._order_agreed:
                # Every bucket had gone out unmarked: a peer whose step went on finishes it and
                # then broadcasts the bucket order, unless another rank gave the step up too.
                for work, _, _ in self._works:
                    self._wait(work)
                if not any(flat[-1].item() for _, _, flat in self._works):
                    self._agree_on_order()
        finally:
            self.reset()

    def reset(self) -> None:
        """Forget this step's progress (after a failed step). Launched reductions are not
        waited for: the group must be torn down or resynchronised after a failure."""
        self._ready = [False] * len(self.params)
        self._missing = [len(b.params) for b in self._buckets]
        self._next_bucket = 0
        self._works = []
        self._observed = []
        self._armed = False
        self._final = set()
        # The next step's first training forward broadcasts the buffers on every rank: a rank
        # whose step failed before finish() would otherwise skip the broadcast its peers make.
        self._buffers_due = True

    def close(self) -> None:
        """Remove the hooks this synchroniser put on the parameters and the module."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._unsynchronised = False
        _live.discard(self)

    def join_hook(self, **kwargs: object) -> NoReturn:
        """``torch.distributed.algorithms.Join`` (uneven inputs) asks its joinables for this:
        a rank that ran out of batches would have to shadow the others' reductions, which this
        synchroniser does not do. Without it, uneven inputs wait on the reduction, as DDP's do."""
        raise RuntimeError(
            "twobp: GradientSynchroniser does not take part in Join (uneven inputs across ranks). "
            "Give every rank the same number of batches, e.g. DistributedSampler(..., drop_last=True) "
            "or by cutting each rank's batches to the smallest count."
        )

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    @property
    def launched(self) -> int:
        """Buckets whose all-reduce this step has started."""
        return len(self._works)

    # -- readiness ------------------------------------------------------------------------

    @reads_grad_only
    @takes_partial_gradients
    def _mark_unsynchronised(self, param: Tensor) -> None:
        self._unsynchronised = True

    @reads_grad_only
    @takes_partial_gradients
    def _on_accumulated(self, param: Tensor) -> None:
        # Backward-p1 also calls this (with no gradient) for a deferred parameter, and an
        # unarmed flush calls it before the gradient is final: only armed deliveries count.
        self._unsynchronised = True
        if self._armed and id(param) in self._final:
            i = self._index[id(param)]
            if not self._ready[i]:
                self._mark_ready(i)

    def _mark_ready(self, i: int) -> None:
        self._ready[i] = True
        self._observed.append(i)
        self._missing[self._bucket_of[i]] -= 1
        while self._next_bucket < len(self._buckets) and self._missing[self._next_bucket] == 0:
            self._launch(self._next_bucket)
            self._next_bucket += 1

    # -- buckets --------------------------------------------------------------------------

    def _build_buckets(self, order: Sequence[int]) -> None:
        buckets: list[_Bucket] = []
        open_buckets: dict[tuple[torch.dtype, torch.device], _Bucket] = {}
        for i in order:
            p = self.params[i]
            dtype = accumulated_dtype(p)  # of its gradient (grad_dtype: fp32 for a bf16 parameter)
            key = (dtype, p.device)
            bucket = open_buckets.get(key)
            if bucket is None:
                bucket = open_buckets[key] = _Bucket([], 0, dtype, p.device)
                buckets.append(bucket)
            bucket.params.append(i)
            bucket.numel += p.numel()
            limit = min(_FIRST_BUCKET_BYTES, self.bucket_bytes) if len(buckets) == 1 else self.bucket_bytes
            if bucket.numel * dtype.itemsize >= limit:
                del open_buckets[key]
        self._buckets = buckets
        self._bucket_of = {i: b for b, bucket in enumerate(buckets) for i in bucket.params}

    def _launch(self, b: int, aborted: bool = False) -> None:
        """Flatten the bucket's gradients divided by the world size (as DDP does before its
        sum), followed by one flag per parameter: 1 where this rank has a gradient."""
        bucket = self._buckets[b]
        pieces, flags = [], []
        for i in bucket.params:
            p = self.params[i]
            grad = p.grad
            if grad is not None and grad.layout != torch.strided:
                raise RuntimeError(
                    f"twobp: GradientSynchroniser reduces dense gradients only; parameter {i} (shape "
                    f"{tuple(p.shape)}) has a {grad.layout} one: build its embedding with sparse=False"
                )
            if aborted:
                grad = None
            pieces.append(grad.reshape(-1) if grad is not None else p.new_zeros(p.numel(), dtype=bucket.dtype))
            flags.append(grad is not None)
        flags.append(aborted)  # how many ranks gave this step up
        flat = torch.cat([*pieces, torch.tensor(flags, dtype=bucket.dtype, device=bucket.device)])
        flat[: bucket.numel].div_(self.world_size)
        self._works.append((dist.all_reduce(flat, group=self.group, async_op=True), bucket, flat))

    def _write_back(self, bucket: _Bucket, flat: Tensor) -> None:
        offset = 0
        used = flat[bucket.numel : -1].tolist()
        # Outside inference_mode (a synchronise() called under it): a .grad made there would be an
        # inference tensor, which the next zero_grad(set_to_none=False) or accumulation refuses.
        with torch.inference_mode(False), torch.no_grad():
            for i, anyone in zip(bucket.params, used, strict=True):
                p = self.params[i]
                mean = flat[offset : offset + p.numel()].view(p.shape)
                offset += p.numel()
                if not anyone:
                    continue  # no rank has a gradient for it: stays None, as in DDP
                if p.grad is None:  # in the dtype AccumulateGrad makes it (grad_dtype)
                    p.grad = torch.empty_like(p, dtype=accumulated_dtype(p)).copy_(mean)
                else:
                    p.grad.copy_(mean)

    def _wait(self, work: object) -> None:
        start = time.perf_counter()
        try:
            if self.timeout is None:
                work.wait()  # type: ignore[attr-defined]
            else:
                work.wait(datetime.timedelta(seconds=self.timeout))  # type: ignore[attr-defined]
        except Exception as error:
            limit = "no timeout" if self.timeout is None else f"timeout {self.timeout:g} s"
            raise ReductionFailed(
                f"twobp: GradientSynchroniser: a collective over the data-parallel group failed after "
                f"{time.perf_counter() - start:.1f} s ({limit}): a rank of the group failed, died, "
                f"skipped the step or trains other parameters: {error}"
            ) from error

    def _collective_device(self) -> torch.device:
        """Where this group's small collectives run: the host for gloo, the GPU for NCCL (a rank
        with no trainable parameter, a frozen pipeline stage, has none to take it from)."""
        backend = dist.get_backend(self.group)
        if backend == "gloo":
            return torch.device("cpu")
        if self.params:
            return self.params[0].device
        return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def _agree_on_order(self) -> None:
        """From now on, launch buckets in the order gradients became final on the first rank."""
        seen = set(self._observed)
        order = [*self._observed, *(i for i in reversed(range(len(self.params))) if i not in seen)]
        device = self._collective_device()
        shared = torch.tensor(order, dtype=torch.int64, device=device)
        self._wait(dist.broadcast(shared, group_src=0, group=self.group, async_op=True))
        self._build_buckets(shared.tolist())
        self._order_agreed = True

    # -- buffers --------------------------------------------------------------------------

    def _training_forward(self, module: nn.Module, args: object) -> None:
        if module.training and torch.is_grad_enabled() and self._buffers_due:
            self._broadcast_buffers()

    def _broadcast_buffers(self) -> None:
        self._buffers_due = False
        if self._broadcasts_buffers:
            with torch.no_grad():
                broadcast_tensors(list(self.module.buffers()), group=self.group, wait=self._wait)


#: The synchronisers alive (the step check asks them).
_live: weakref.WeakSet[GradientSynchroniser] = weakref.WeakSet()


def _refuse_unsynchronised_step(optimizer: torch.optim.Optimizer) -> None:
    """Under DDP the gradients are averaged when backward ends; here only at synchronise(). A
    step between a backward and synchronise() stepped each rank on its own gradients wherever no
    weight work was left queued (a capped queue flushed it early, a parameter with a tensor hook,
    a flush_weight_grads() of the caller's): the replicas drifted apart silently. Run by the
    optimizer step guard (:data:`.grad_guard.step_checks`), after a closure's call where the
    step has one."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if _stale_synchronisers(params) and torch._C._current_graph_task_id() >= 0:  # optimizer-in-backward
        raise RuntimeError(
            "twobp: optimizer.step() in a post-accumulate-grad hook (optimizer-in-backward) over "
            "parameters of a GradientSynchroniser: the hook runs before the synchroniser has written "
            "the mean over ranks. The two do not combine: step after sync.synchronise() instead."
        )
    _refuse_unsynchronised(params, "optimizer.step()")


def _refuse_unsynchronised(params: list[Any], what: str) -> None:
    """Refuse ``what`` (a step, clipping, a scaler's unscale_) over gradients a backward changed
    since the synchroniser's last synchronise(): each rank's own (clipped by its own norm, a
    scaler's inf found on one rank only, which then stepped on the other's inf mean). Gradients
    all None (set to None since the backward) are alike on every rank, as in DDP; zeros are not
    told from a rank's own gradient that happens to be zero (a head only another rank's batch
    used): asked of values, one rank stepped alone where the other was refused."""
    stale = _stale_synchronisers(params)
    if not stale:
        return
    covering = [sync for sync in list(_live) if any(id(p) in sync._index for p in params)]
    # Synchronisers sharing a parameter: one replaced but still held (disjoint ones are legitimate).
    shared = [a for a in covering if any(b is not a and not a._index.keys().isdisjoint(b._index) for b in covering)]
    replaced = (
        f" ({len(shared)} synchronisers cover them, sharing parameters: one you replaced but still hold "
        "counts too; close() it)"
        if shared
        else ""
    )
    # A closure's backward runs inside the step: only there does synchronise() go into it.
    closure = " (with step(closure): inside the closure, after its backward)" if what == "optimizer.step()" else ""
    raise RuntimeError(
        f"twobp: {what} over parameters of a GradientSynchroniser whose gradients a "
        "backward changed since its last synchronise(): they are this rank's own, not the "
        "mean over ranks. Call sync.synchronise() (or sync.flush() and sync.finish()) after the "
        f"step's last backward and before {what}{closure}{replaced}."
    )


def _stale_synchronisers(params: list[Any]) -> list[GradientSynchroniser]:
    """The synchronisers a backward changed since their last synchronise() that hold a gradient
    for one of ``params``."""
    if not any(sync._unsynchronised for sync in list(_live)):
        return []
    by_id = {id(p): p for p in params}
    return [
        sync for sync in list(_live)
        if sync._unsynchronised and any(by_id[i].grad is not None for i in sync._index if i in by_id)
    ]  # fmt: skip


step_checks.append(_refuse_unsynchronised_step)
read_checks.append(_refuse_unsynchronised)


def _called_modules(module: nn.Module) -> list[nn.Module]:
    """The modules whose forward starts a step's computation: ``module`` itself, or, for a container
    that is never called (``nn.ModuleList`` / ``nn.ModuleDict`` of a rank's pipeline stages), its
    children (recursively through nested containers); the first of them called in a step broadcasts."""
    if type(module).forward is not nn.Module.forward:
        return [module]
    return [m for child in module.children() for m in _called_modules(child)]


def _weak_hook(method: Callable[..., None]) -> Callable[..., None]:
    """A hook calling ``method`` while its object lives (marked as ``method`` is)."""
    ref = weakref.WeakMethod(method)

    def hook(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)

    for mark in (OWN_HOOK_MARK, READS_ONLY_MARK):
        if getattr(method, mark, False):
            setattr(hook, mark, True)
    return hook


def _remove_handles(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()


def broadcast_tensors(
    tensors: Iterable[Tensor],
    *,
    group: dist.ProcessGroup | None = None,
    wait: Callable[[Any], None] = lambda work: work.wait(),
) -> None:
    """Overwrite ``tensors`` in place with those of the group's first rank, one broadcast per
    dtype and device (not one per tensor); ``wait(work)`` waits for each (with a timeout)."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for same in by_kind.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        wait(dist.broadcast(flat, group_src=0, group=group, async_op=True))
        offset = 0
        for t in same:
            t.copy_(flat[offset : offset + t.numel()].view(t.shape))
            offset += t.numel()
