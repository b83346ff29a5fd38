"""Run one rank's schedule over torch.distributed point-to-point messages.

Each rank holds one stage and executes its action list (see :mod:`.schedules`): ``F`` receives
activations from the rank before (the first rank takes the micro-batch), runs the stage and
sends the output on; ``I``/``B`` receives the output gradient from the rank after (the last rank
takes the loss), runs backward and sends the input gradient back; ``W`` flushes the stage's own
:class:`~twobp_autograd.WeightGradQueue`, for the named micro-batches or everything pending.
With 2BP on the stage is patched, so backward only computes input gradients and queues the
weight work under the micro-batch's tag; with 2BP off it is unpatched and ``B`` is plain
autograd.

Shapes travel once per step shape (the first rank's batch shape, broadcast at each step start),
then come from a cache. Nothing waits forever: every receive and send waits at most
``timeout`` seconds and then raises a :class:`PipelineError` naming the peer, so a rank that
died, raised or disagrees about shapes ends every rank with an error instead of a hang.
"""

from __future__ import annotations

import ctypes
import datetime
import functools
import os
import resource
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .. import WeightGradQueue, patch, unpatch, use_queue
from .actions import Action
from .schedules import validate_schedule
from .trace import Event

__all__ = ["GradientSync", "PipelineError", "PipelineRuntime", "RankMetrics", "StepReport", "init_distributed"]

_MAX_DIMS = 8
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool)
_META_TAG = 1 << 20  # gloo matches messages by tag; NCCL by order, which the schedules keep equal


class GradientSync(Protocol):
    """Plugs gradient synchronisation (e.g. data parallelism) into a step: the flushes after
    the step's last backward go through :meth:`flush`, the step ends with :meth:`finish`, a
    failed step calls :meth:`reset`. See :class:`twobp_autograd.data_parallel.GradientSynchroniser`."""

    def flush(self, queue: WeightGradQueue, tags: "Sequence[Hashable] | None") -> None: ...

    def finish(self) -> None: ...

    def reset(self) -> None: ...


class PipelineError(RuntimeError):
    """A pipeline step could not finish: a peer failed, died, timed out or sent the wrong shape."""


@dataclass
class RankMetrics:
    """One rank's view of one step. Times in seconds from this rank's step start."""

    rank: int
    step_time: float
    receive_wait: float  # time spent blocked on receives (the rank's share of the bubble)
    events: list[Event]
    samples: int
    deferred_jobs: int  # most weight-gradient jobs queued at once (0 with 2BP off)
    peak_bytes: int  # CUDA: max_memory_allocated; CPU: see PipelineRuntime._account_memory
    peak_rss: int  # bytes, the process's peak resident set so far
    loss: "float | None"  # on the last rank
    peak_pending_bytes: int = 0  # most bytes the weight-gradient queue held after an action


@dataclass
class StepReport:
    """All ranks' metrics of one step, on rank 0."""

    ranks: list[RankMetrics]
    step_time: float = field(init=False)
    idle: list[float] = field(init=False)  # per rank: receive waits plus the time it finished early
    bubble_ratio: float = field(init=False)
    throughput: float = field(init=False)  # samples per second
    loss: "float | None" = field(init=False)

    def __post_init__(self) -> None:
        self.step_time = max(m.step_time for m in self.ranks)
        self.idle = [m.receive_wait + (self.step_time - m.step_time) for m in self.ranks]
        self.bubble_ratio = sum(self.idle) / (len(self.ranks) * self.step_time)
        self.throughput = self.ranks[0].samples / self.step_time
        self.loss = self.ranks[-1].loss


def init_distributed(*, timeout: float = 120.0, backend: "str | None" = None) -> torch.device:
    """Join the process group torchrun describes (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...):
    NCCL on CUDA, gloo on CPU, with ``timeout`` seconds for every collective. Returns the
    rank's device."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() and backend in (None, "nccl")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if cuda else "gloo"), timeout=datetime.timedelta(seconds=timeout))
    return device


class PipelineRuntime:
    """Executes ``actions`` (this rank's list of a schedule) on ``stage`` at every :meth:`step`.

    ``loss_fn(output, target)`` is used on the last rank; each micro-batch's loss is divided by
    ``num_micro_batches``, so the step's gradients are those of the mean over micro-batches.
    ``grad_sync`` (e.g. a data-parallel :class:`GradientSync` over this stage's replicas) gets
    the flushes that follow the step's last backward and finishes the step.
    """

    def __init__(
        self,
        stage: nn.Module,
        actions: Sequence[Action],
        *,
        num_micro_batches: int,
        loss_fn: "Callable[[Tensor, Tensor], Tensor] | None" = None,
        twobp: bool = True,
        group: "dist.ProcessGroup | None" = None,
        device: "torch.device | None" = None,
        timeout: float = 60.0,
        queue: "WeightGradQueue | None" = None,
        grad_sync: "GradientSync | None" = None,
    ) -> None:
        validate_schedule([list(actions)], num_micro_batches)
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.first = self.rank == 0
        self.last = self.rank == self.world_size - 1
        if self.last and loss_fn is None:
            raise ValueError("the last rank needs a loss_fn")
        self.stage = stage
        self.actions = list(actions)
        self.num_micro_batches = num_micro_batches
        self.loss_fn = loss_fn
        self.twobp = twobp
        self.device = device or next((p.device for p in stage.parameters()), torch.device("cpu"))
        self.timeout = timeout
        self.queue = queue if queue is not None else WeightGradQueue()  # an empty queue is falsy
        self.grad_sync = grad_sync
        self.apply_mode()
        self._sent_shapes: dict[tuple[Hashable, int], tuple[torch.Size, torch.dtype]] = {}
        self._received_shapes: dict[tuple[Hashable, int], tuple[torch.Size, torch.dtype]] = {}

    def apply_mode(self) -> None:
        """Patch the stage (2BP on) or unpatch it (off). Each step does this first, so runtimes
        with different modes may share one stage and take turns."""
        if self.twobp:
            patch(self.stage)
        else:
            unpatch(self.stage)

    # -- one step -----------------------------------------------------------------------

    def step(
        self, inputs: "Tensor | None" = None, targets: "Tensor | None" = None, *, gather: bool = True
    ) -> "StepReport | RankMetrics":
        """Run the schedule once over the batch: ``inputs`` on the first rank, ``targets`` on
        the last (split on dim 0 into the micro-batches). Returns the gathered
        :class:`StepReport` on rank 0 (with ``gather``), else this rank's metrics."""
        m = self.num_micro_batches
        if self.first and inputs is None:
            raise ValueError("the first rank needs the inputs")
        if self.last and targets is None:
            raise ValueError("the last rank needs the targets")
        self._micro_inputs = list(inputs.tensor_split(m)) if self.first else []
        self._micro_targets = list(targets.tensor_split(m)) if self.last else []
        self.apply_mode()
        self._key = self._agree_on_step_shape(inputs)
        self._held: dict[int, tuple[Tensor, Tensor]] = {}
        self._sends: list[tuple[Any, Tensor, str]] = []
        self._losses: list[Tensor] = []
        self._receive_wait = 0.0
        self._peak_bytes = 0
        self._heap_at_start = _heap_in_use() if self.device.type == "cpu" else None
        self._peak_pending_bytes = 0
        self._deferred_jobs = 0
        self._backwards_left = sum(a.kind in ("I", "B") for a in self.actions)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        events: list[Event] = []
        start = time.perf_counter()
        try:
            for action in self.actions:
                self._received_at = time.perf_counter()
                self._run(action)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)  # so the event's end is the work's end
                # The event starts when the action's data arrived: waiting shows as a gap.
                events.append(Event(rank=self.rank, action=action, start=self._received_at - start, end=time.perf_counter() - start))
                self._account_memory()
            if self._held:
                raise PipelineError(f"rank {self.rank}: the schedule left micro-batches {sorted(self._held)} without a backward")
            if len(self.queue):
                raise PipelineError(
                    f"rank {self.rank}: weight-gradient work of micro-batches {self.queue.tags()} is still "
                    "queued after the schedule's last W"
                )
            for work, _, what in self._sends:
                self._wait(work, what)
            if self.grad_sync is not None:
                self.grad_sync.finish()
        except BaseException:
            self.queue.clear()
            if self.grad_sync is not None:
                self.grad_sync.reset()
            raise
        finally:
            self._sends = []
            self._held = {}
        step_time = time.perf_counter() - start
        loss = float(torch.stack(self._losses).sum()) if self.last else None
        if self.device.type == "cuda":
            self._peak_bytes = torch.cuda.max_memory_allocated(self.device)
        metrics = RankMetrics(
            rank=self.rank,
            step_time=step_time,
            receive_wait=self._receive_wait,
            events=events,
            samples=0 if inputs is None else len(inputs),
            deferred_jobs=self._deferred_jobs,
            peak_bytes=self._peak_bytes,
            peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            loss=loss,
            peak_pending_bytes=self._peak_pending_bytes,
        )
        if not gather:
            return metrics
        gathered: "list[RankMetrics] | None" = [None] * self.world_size if self.first else None  # type: ignore[list-item]
        dist.gather_object(metrics, gathered, group_dst=0, group=self.group)
        return StepReport(gathered) if gathered is not None else metrics

    def _run(self, action: Action) -> None:
        if action.kind == "F":
            self._forward(action.micro_batch)
        elif action.kind in ("I", "B"):
            self._backward(action.micro_batch)
            self._backwards_left -= 1
            if action.kind == "B" and self.twobp:
                self._flush([action.micro_batch])
        else:
            self._flush(action.micro_batches)

    def _flush(self, tags: "Sequence[Hashable] | None") -> None:
        if self.grad_sync is not None and self._backwards_left == 0:  # gradients can become final
            self.grad_sync.flush(self.queue, tags)
        else:
            self.queue.flush(tags=tags)

    def _forward(self, k: int) -> None:
        if self.first:
            x = self._micro_inputs[k].to(self.device)
        else:
            x = self._receive_activation(k)
            x.requires_grad_(x.is_floating_point())
        with use_queue(self.queue), self.queue.tagged(k):
            out = self.stage(x)
        if not isinstance(out, Tensor):
            raise TypeError(f"rank {self.rank}: a pipeline stage must return one tensor, got {type(out).__name__}")
        if self.last:
            loss = self.loss_fn(out, self._micro_targets[k].to(self.device)) / self.num_micro_batches  # type: ignore[misc]
            self._losses.append(loss.detach())
            self._held[k] = (x, loss)
        else:
            self._send_activation(out.detach(), k)
            self._held[k] = (x, out)

    def _backward(self, k: int) -> None:
        # With a capped queue, work over the cap is flushed after the input gradient is posted.
        with self.queue.cap_enforced_after():
            self._backward_and_send(k)

    def _backward_and_send(self, k: int) -> None:
        x, out = self._held.pop(k)
        if self.last:
            out.backward()
        else:
            buffer = torch.empty(out.shape, dtype=out.dtype, device=self.device)
            grad = self._receive(buffer, self.rank + 1, 2 * k + 1, f"the output gradient of micro-batch {k}")
            out.backward(grad)
        if not self.first and x.is_floating_point():
            grad_input = x.grad if x.grad is not None else torch.zeros_like(x)
            self._send(grad_input, self.rank - 1, 2 * k + 1, f"the input gradient of micro-batch {k}")

    # -- shapes -------------------------------------------------------------------------

    def _agree_on_step_shape(self, inputs: "Tensor | None") -> Hashable:
        header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=self._comm_device)
        if self.first:
            header.copy_(_meta(inputs))  # type: ignore[arg-type]
        work = dist.broadcast(header, group_src=0, group=self.group, async_op=True)
        self._wait(work, "the step's input shape from rank 0", idle=False)
        return tuple(header.tolist())

    def _send_activation(self, out: Tensor, k: int) -> None:
        known = self._sent_shapes.get((self._key, k))
        if known is None:
            self._sent_shapes[(self._key, k)] = (out.shape, out.dtype)
            self._send(_meta(out), self.rank + 1, _META_TAG + k, f"the shape of micro-batch {k}")
        elif known != (out.shape, out.dtype):
            raise PipelineError(
                f"rank {self.rank}: the stage output of micro-batch {k} is {tuple(out.shape)} {out.dtype}, but "
                f"{tuple(known[0])} {known[1]} was exchanged for this input shape; a stage's output shape must "
                "depend only on the batch shape"
            )
        self._send(out.contiguous(), self.rank + 1, 2 * k, f"the activations of micro-batch {k}")

    def _receive_activation(self, k: int) -> Tensor:
        known = self._received_shapes.get((self._key, k))
        if known is None:
            buffer = torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=self._comm_device)
            meta = self._receive(buffer, self.rank - 1, _META_TAG + k, f"the shape of micro-batch {k}")
            code, ndim, *dims = meta.tolist()
            known = (torch.Size(dims[:ndim]), _DTYPES[code])
            self._received_shapes[(self._key, k)] = known
        shape, dtype = known
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        return self._receive(buffer, self.rank - 1, 2 * k, f"the activations of micro-batch {k}")

    # -- messages -----------------------------------------------------------------------

    @property
    def _comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def _send(self, tensor: Tensor, peer: int, tag: int, what: str) -> None:
        work = dist.isend(tensor, group_dst=peer, group=self.group, tag=tag)
        self._sends.append((work, tensor, f"sending {what} to rank {peer}"))  # the tensor lives until sent

    def _receive(self, buffer: Tensor, peer: int, tag: int, what: str) -> Tensor:
        work = dist.irecv(buffer, group_src=peer, group=self.group, tag=tag)
        self._wait(work, f"receiving {what} from rank {peer}")
        return buffer

    def _wait(self, work: Any, what: str, *, idle: bool = True) -> None:
        start = time.perf_counter()
        try:
            work.wait(datetime.timedelta(seconds=self.timeout))
        except Exception as error:
            raise PipelineError(
                f"rank {self.rank}: {what} failed after {time.perf_counter() - start:.1f} s (timeout "
                f"{self.timeout:g} s); that rank probably failed or died, or runs a different "
                f"schedule or model: {error}"
            ) from error
        if idle:
            self._received_at = time.perf_counter()
            self._receive_wait += self._received_at - start

    def _account_memory(self) -> None:
        """After each action. On a CPU the peak is the heap in use (glibc's ``mallinfo2``:
        tensors, autograd's saved activations and queued work alike) over the step's start, so
        2BP off and on compare; transients inside an action are not seen. Without ``mallinfo2``
        it falls back to queued work plus the held stage inputs and outputs."""
        pending = self.queue.pending()
        self._deferred_jobs = max(self._deferred_jobs, pending.jobs)
        self._peak_pending_bytes = max(self._peak_pending_bytes, pending.bytes)
        if self.device.type == "cuda":
            return
        heap = _heap_in_use()
        if heap is not None and self._heap_at_start is not None:
            self._peak_bytes = max(self._peak_bytes, heap - self._heap_at_start)
        else:
            held = sum(t.numel() * t.element_size() for pair in self._held.values() for t in pair)
            self._peak_bytes = max(self._peak_bytes, pending.bytes + held)


def _meta(tensor: Tensor) -> Tensor:
    if tensor.dim() > _MAX_DIMS:
        raise ValueError(f"activations of more than {_MAX_DIMS} dimensions cannot cross stages")
    meta = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64)
    meta[: 2 + tensor.dim()] = torch.tensor([_dtype_code(tensor.dtype), tensor.dim(), *tensor.shape])
    return meta.to(tensor.device)


def _dtype_code(dtype: torch.dtype) -> int:
    if dtype not in _DTYPES:
        raise TypeError(f"cannot send {dtype} between stages")
    return _DTYPES.index(dtype)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    ]


@functools.lru_cache(maxsize=None)
def _mallinfo2() -> "Callable[[], _MallInfo2] | None":
    try:
        function = ctypes.CDLL("libc.so.6").mallinfo2  # glibc 2.33 and later
    except (OSError, AttributeError):
        return None
    function.restype = _MallInfo2
    return function


def _heap_in_use() -> "int | None":
    """Bytes the process has malloc'ed and not freed (every arena and mmap), or None without
    glibc's ``mallinfo2``. About 10 µs a call."""
    mallinfo2 = _mallinfo2()
    if mallinfo2 is None:
        return None
    info = mallinfo2()
    return info.uordblks + info.hblkhd
