"""Run one rank's schedule over torch.distributed point-to-point messages.

Each rank holds one stage, or several (interleaved and V schedules, placed by
:func:`.schedules.placement`), and executes its action list (see :mod:`.schedules`), each
action receiving and sending what its kind says (:mod:`.actions`): ``F`` receives activations
from the stage before (the first stage takes the micro-batch), runs the stage and sends the
output on; ``I``/``B`` receives the output gradient from the stage after (the last stage takes
the loss), runs backward and sends the input gradient back; ``W`` flushes the stage's own
:class:`~twobp_autograd.WeightGradQueue`, for the named micro-batches or everything pending.
Between two stages of one rank the tensor is handed over in memory, never sent.
With 2BP on the stage is patched, so backward only computes input gradients and queues the
weight work under the micro-batch's tag; with 2BP off it is unpatched and ``B`` is plain
autograd.

Every rank posts its sends and receives in one order, that of one replay of the whole
schedule (:mod:`.posting`): NCCL pairs messages by the order two ranks post them. Shapes travel
once per step shape (the first rank's batch shape, broadcast at each step start), then come from
a cache. Nothing waits forever: every receive and send waits at most
``timeout`` seconds and then raises a :class:`PipelineError` naming the peer, so a rank that
died, raised or disagrees about shapes ends every rank with an error instead of a hang.

What a step reports is measured by :mod:`.metrics` (times) and :mod:`.memory_probe` (peaks).
"""

from __future__ import annotations

import datetime
import inspect
import os
import pickle
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .. import WeightGradQueue, patch, unpatch, use_queue
from ..data_parallel import ReductionFailed
from ..queue import PendingWork
from ..warn_once import warn_once
from .actions import Action, ActionKind, Message, Payload
from .memory_probe import MemoryProbe
from .metrics import RankMetrics, StepReport, StepTimer
from .posting import posting_order
from .schedules import ScheduleError, stage_owners, validate_rank, validate_schedule

__all__ = ["GradientSync", "PipelineError", "PipelineRuntime", "init_distributed"]

_MAX_DIMS = 8
_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool,
    torch.uint8, torch.int8, torch.int16,
)  # fmt: skip
# gloo matches messages by tag; NCCL by the order two ranks post them (see .posting).
_SHAPE_TAG = 1 << 20
#: What a gradient's receive expects for an integer output: nothing (none is sent back).
_NOTHING_COMES = object()
#: What a receive will get: its shape and dtype, _NOTHING_COMES, or None while not known.
_Incoming = tuple[torch.Size, torch.dtype] | object | None
#: The tag of the step's metrics, sent to rank 0 after every action's messages (tagged from 0 up).
_METRICS_TAG = 1 << 30


class GradientSync(Protocol):
    """Plugs gradient synchronisation (e.g. data parallelism) into a step: the flushes after
    the step's last backward go through :meth:`flush`, the step ends with :meth:`finish`. A step
    that fails before its ``flush`` raised or its ``finish`` was called calls ``abort()`` where
    the object has one (else :meth:`reset`). See
    :class:`twobp_autograd.data_parallel.GradientSynchroniser`."""

    def flush(
        self, queue: WeightGradQueue, tags: Sequence[Hashable] | None, params: Iterable[Tensor] | None = None
    ) -> None:
        """``params``: those whose gradients this flush may make final (the flushed stage's, whose
        last backward has run; a rank's other stages may still have backwards to come)."""
        ...

    def finish(self) -> None: ...

    def reset(self) -> None: ...


def _check_takes_params(grad_sync: GradientSync) -> None:
    try:
        inspect.signature(grad_sync.flush).bind(None, None, None)
    except TypeError:
        raise TypeError(
            f"twobp: {type(grad_sync).__name__}.flush takes (queue, tags); the runtime calls "
            "flush(queue, tags, params) with the parameters the flush may make final (the flushed "
            "stage's): add the third argument (GradientSync)."
        ) from None


class PipelineError(RuntimeError):
    """A pipeline step could not finish: a peer failed, died, timed out or sent the wrong shape."""


def init_distributed(*, timeout: float = 120.0, backend: str | None = None) -> torch.device:
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


@dataclass
class _Stage:
    """One of the rank's stages: its module, its queue, and where its gradients become final."""

    index: int
    module: nn.Module
    queue: WeightGradQueue
    last_backward_position: int = -1


class _Queues:
    """The rank's queues as one, for the memory probe: what they hold together."""

    def __init__(self, queues: Iterable[WeightGradQueue]) -> None:
        self.queues = list(queues)

    def pending(self) -> PendingWork:
        work = [queue.pending() for queue in self.queues]
        return PendingWork(sum(w.jobs for w in work), sum(w.bytes for w in work))


@dataclass
class _Step:
    """What one step keeps between its actions."""

    inputs: list[Tensor]  # the micro-batches, on the first rank
    targets: list[Any]  # on the last rank: tensors, or dicts / tuples / lists of tensors
    shape_key: Hashable  # the step's input shape: activation shapes are exchanged once per key
    loss_divisors: list[float]  # on the last rank: what each micro-batch's loss is divided by
    memory: MemoryProbe
    timer: StepTimer
    # (stage, micro-batch): its input, and its output (or loss on the last stage)
    held: dict[tuple[int, int], tuple[Tensor, Tensor]] = field(default_factory=dict)
    handed_over: dict[Message, Tensor] = field(default_factory=dict)  # between two stages of this rank
    sends: list[tuple[Any, Tensor, str]] = field(default_factory=list)  # posted, each tensor alive until sent
    posted: dict[Message, tuple[Any, Tensor]] = field(default_factory=dict)  # receives posted ahead: work, buffer
    next_posting: int = 0  # the first of the rank's postings (PipelineRuntime._postings) not yet posted
    sync_ended: bool = False  # the gradient sync's flush raised or its finish was called: it ended the step
    losses: list[Tensor] = field(default_factory=list)


class PipelineRuntime:
    """Executes ``actions`` (this rank's list of a schedule) on ``stage`` at every :meth:`step`.

    ``stage`` is this rank's module, or, when the rank holds several stages, a mapping from
    each stage's index to its module; ``placement`` then gives every stage's rank (see
    :func:`.schedules.placement`). Each stage has its own queue: ``queue`` is the one stage's,
    or a mapping like ``stage`` (by default new queues).

    ``loss_fn(output, target)`` is used on the last stage. With ``loss_reduction="mean"`` it
    returns the mean over its micro-batch's samples (the default reduction of PyTorch's losses),
    and each micro-batch's loss is weighted by its share of the batch (1/m where the batch divides
    into m equal micro-batches), so the step's loss and gradients are those of one process's mean
    over the whole batch; with ``"sum"`` (a ``reduction="sum"`` loss) the losses are summed.
    ``loss_items(target)``, for a mean over other items than samples (the tokens whose label is
    not -100 in a Hugging Face model's loss: ``split_model(...).loss_items``), counts them in a
    micro-batch's target; micro-batches are then weighted by their share of the step's items.
    ``grad_sync`` (e.g. a data-parallel :class:`GradientSync` over this stage's replicas) gets
    the flushes that follow the step's last backward and finishes the step.
    """

    #: Whether each step resets the process's resident-set high-water mark at its start, so that
    #: its metrics' ``peak_rss`` is the step's (Linux; ``bench pipeline`` sets it). Off by default:
    #: the reset is process-wide, and ``getrusage``'s ``ru_maxrss`` reads the same mark.
    step_peak_rss = False

    def __init__(
        self,
        stage: nn.Module | Mapping[int, nn.Module],
        actions: Sequence[Action],
        *,
        num_micro_batches: int,
        loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
        twobp: bool = True,
        group: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
        timeout: float = 60.0,
        queue: WeightGradQueue | Mapping[int, WeightGradQueue] | None = None,
        grad_sync: GradientSync | None = None,
        placement: Sequence[int] | None = None,
        loss_reduction: Literal["mean", "sum"] = "mean",
        loss_items: Callable[[Any], int] | None = None,
    ) -> None:
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"twobp: loss_reduction must be 'mean' or 'sum', not {loss_reduction!r}")
        self.loss_reduction = loss_reduction
        self.loss_items = loss_items
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.placement = tuple(range(self.world_size) if placement is None else placement)
        self.stages = _stages_of(stage, queue, self.rank)
        validate_rank(actions, num_micro_batches, self.rank)
        self._check_placement(actions)
        self.first = 0 in self.stages  # takes the inputs
        self.last = len(self.placement) - 1 in self.stages  # takes the targets, computes the loss
        if self.last and loss_fn is None:
            raise ValueError("twobp: the last stage needs a loss_fn")
        self.stage = next(iter(self.stages.values())).module  # the first of this rank's stages
        self.queue = next(iter(self.stages.values())).queue
        self.actions = list(actions)
        self.num_micro_batches = num_micro_batches
        self.loss_fn = loss_fn
        self.twobp = twobp
        parameters = (p for s in self.stages.values() for p in s.module.parameters())
        self.device = device or next((p.device for p in parameters), torch.device("cpu"))
        self.timeout = timeout
        self.grad_sync = grad_sync
        if grad_sync is not None:
            _check_takes_params(grad_sync)
            if getattr(grad_sync, "timeout", 0) is None:
                # Else a replica that failed or hung holds this step's reduction past the runtime's
                # timeout (up to the process group's, 30 minutes by default).
                grad_sync.timeout = timeout  # type: ignore[attr-defined]
        self.apply_mode()
        for position, action in enumerate(self.actions):
            if action.kind.is_backward:
                self.stages[action.stage_on(self.rank)].last_backward_position = position
        # The messages the actions receive from another rank, in schedule order; and per position,
        # how many of them are received at or before it (the index of the next one after it).
        self._remote_receives: list[Message] = []
        self._next_remote_receive: list[int] = []
        for action in self.actions:
            message = action.receives(self.rank, self._num_stages)
            if message is not None and not self._is_local(message):
                self._remote_receives.append(message)
            self._next_remote_receive.append(len(self._remote_receives))
        self._sent_shapes: dict[tuple[Hashable, int, int], tuple[torch.Size, torch.dtype]] = {}
        self._received_shapes: dict[tuple[Hashable, int, int], tuple[torch.Size, torch.dtype]] = {}
        everyone = self._schedule_of_every_rank() if self.world_size > 1 else [self.actions]
        owners = stage_owners(everyone)
        if tuple([owners[stage] for stage in range(len(owners))]) != self.placement:
            # Else no rank holds the last stage, or hands its output over to one no rank runs.
            raise ValueError(
                f"twobp: rank {self.rank}: placement={self.placement} names which rank holds each stage, "
                f"but the schedule runs its {len(owners)} stages on ranks "
                f"{tuple([owners[stage] for stage in range(len(owners))])}: pass that placement"
            )
        # On a backend that pairs messages by the order two ranks post them (NCCL; gloo pairs them
        # by tag, and each receive is posted when its action or the one before needs it): what
        # this rank sends and receives, in the one order all ranks post (see .posting).
        self._in_order = not self._matched_by_tag()
        self._postings = posting_order(everyone, self.rank) if self._in_order else []
        self._posting_index = {posting.message: index for index, posting in enumerate(self._postings)}

    def _matched_by_tag(self) -> bool:
        """Whether the backend carrying this rank's messages is gloo: the group's, or in a
        group of several (``"cpu:gloo,cuda:nccl"``, what ``init_process_group()`` makes on a
        CUDA machine) the one for the device the messages travel on."""
        device = self._comm_device.type
        for entry in str(dist.get_backend(self.group)).split(","):
            kind, _, name = entry.rpartition(":")
            if kind in ("", device):
                return name == "gloo"
        return False

    def _schedule_of_every_rank(self) -> list[list[Action]]:
        """Every rank's action list (one all-gather), checked to be one schedule on every rank
        alike: ranks given lists that do not fit together would otherwise wait on each other."""
        payload = torch.frombuffer(bytearray(pickle.dumps(self.actions)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], device=self._comm_device)
        sizes = [torch.empty_like(size) for _ in range(self.world_size)]
        what = "every rank's action list (a rank probably failed building its PipelineRuntime)"
        self._wait(dist.all_gather(sizes, size, group=self.group, async_op=True), what, timer=None)
        lengths = [int(n) for n in sizes]
        padded = torch.zeros(max(lengths), dtype=torch.uint8, device=self._comm_device)
        padded[: payload.numel()] = payload.to(self._comm_device)
        gathered = [torch.empty_like(padded) for _ in range(self.world_size)]
        self._wait(dist.all_gather(gathered, padded, group=self.group, async_op=True), what, timer=None)
        ranks = [pickle.loads(t[:n].cpu().numpy().tobytes()) for t, n in zip(gathered, lengths, strict=True)]
        try:
            validate_schedule(ranks, self.num_micro_batches)
        except ScheduleError as error:
            raise ScheduleError(
                f"twobp: rank {self.rank}: the ranks' action lists do not make one schedule ({error.reason}); give "
                "every rank its own list of one schedule(name, ranks, micro_batches), or hand-written lists that "
                "validate_schedule accepts",
                ranks,
                error.faulty,
            ) from error
        return ranks

    def _check_placement(self, actions: Sequence[Action]) -> None:
        for action in actions:
            stage = action.stage_on(self.rank)
            if stage >= len(self.placement) or self.placement[stage] != self.rank or stage not in self.stages:
                raise ValueError(
                    f"twobp: rank {self.rank}: {action!r} runs stage {stage}, which this rank does not hold"
                )

    def apply_mode(self) -> None:
        """Patch the stages (2BP on) or unpatch them (off). Each step does this first, so
        runtimes with different modes may share one stage and take turns."""
        for stage in self.stages.values():
            if self.twobp:
                patch(stage.module)
            else:
                unpatch(stage.module)

    # -- one step -----------------------------------------------------------------------

    def step(
        self, inputs: Tensor | None = None, targets: Tensor | None = None, *, gather: bool = True
    ) -> StepReport | RankMetrics:
        """Run the schedule once over the batch: ``inputs`` on the first rank, ``targets`` on
        the last (split on dim 0 into the micro-batches). Returns the gathered
        :class:`StepReport` on rank 0 (with ``gather``), else this rank's metrics."""
        try:
            step = self._start_step(inputs, targets)
        except BaseException:
            self._give_up_sync(None)  # a refusal on this replica alone: its peers go on
            raise
        try:
            self._run_schedule(step)
        except BaseException:
            for stage in self.stages.values():
                stage.queue.clear()
            self._give_up_sync(step)
            raise
        finally:
            step.sends.clear()
            step.held.clear()
            step.handed_over.clear()
            step.posted.clear()
        rss, rss_scope = step.memory.peak_rss()
        metrics = RankMetrics(
            rank=self.rank,
            step_time=step.timer.elapsed(),
            receive_wait=step.timer.receive_wait,
            events=step.timer.events,
            samples=len(inputs) if self.first and inputs is not None else 0,
            deferred_jobs=step.memory.deferred_jobs,
            peak_bytes=step.memory.peak_bytes(),
            peak_rss=rss,
            loss=float(torch.stack(step.losses).sum()) if self.last else None,
            peak_pending_bytes=step.memory.peak_pending_bytes,
            peak_rss_scope=rss_scope,
        )
        return self.gather_report(metrics) if gather else metrics

    def _start_step(self, inputs: Tensor | None, targets: Any) -> _Step:
        m = self.num_micro_batches
        if not torch.is_grad_enabled():
            raise RuntimeError(
                "twobp: PipelineRuntime.step() trains (forward and backward); under torch.no_grad() or "
                "inference_mode there is no backward to run. Evaluate by running the stages' forwards "
                "yourself."
            )
        self.apply_mode()
        shape_key = self._agree_on_step_shape(inputs, targets)
        step = _Step(
            inputs=list(inputs.tensor_split(m)) if inputs is not None and self.first else [],
            targets=_micro_batches_of(targets, m) if targets is not None and self.last else [],
            shape_key=shape_key,
            loss_divisors=[],
            memory=MemoryProbe(
                self.device, _Queues(s.queue for s in self.stages.values()), reset_rss=self.step_peak_rss
            ),
            timer=StepTimer(self.rank, self.device),
        )
        if self.last:
            step.loss_divisors = self._loss_divisors(step)
        return step

    def _give_up_sync(self, step: _Step | None) -> None:
        """After a failed step: a replica must not pair this step's reductions with its next
        step's. Where the gradient sync can, the step is given up (its peers then raise), unless
        the sync's own failed flush or its finish already ended it."""
        abort = getattr(self.grad_sync, "abort", None)
        if abort is None:  # a GradientSync of the user's own
            if self.grad_sync is not None:
                self.grad_sync.reset()
        elif step is None or not step.sync_ended:
            abort()

    def gather_report(self, metrics: RankMetrics) -> StepReport | RankMetrics:
        """Every rank's metrics on rank 0 (a report: what ``step`` returns with ``gather``), each
        wait bounded by ``timeout``: a rank that failed after its last message would hold
        ``gather_object`` up to the process group's own timeout (30 minutes by default)."""
        if self.rank != 0:
            payload = torch.frombuffer(bytearray(pickle.dumps(metrics)), dtype=torch.uint8)
            for tensor in (torch.tensor([payload.numel()]), payload):
                work = dist.isend(tensor.to(self._comm_device), group_dst=0, group=self.group, tag=_METRICS_TAG)
                self._wait(work, "sending this step's metrics to rank 0", timer=None)
            return metrics
        gathered = [metrics]
        for peer in range(1, self.world_size):
            what = f"receiving rank {peer}'s metrics of this step"
            size = torch.empty(1, dtype=torch.int64, device=self._comm_device)
            self._wait(dist.irecv(size, group_src=peer, group=self.group, tag=_METRICS_TAG), what, timer=None)
            payload = torch.empty(int(size.item()), dtype=torch.uint8, device=self._comm_device)
            self._wait(dist.irecv(payload, group_src=peer, group=self.group, tag=_METRICS_TAG), what, timer=None)
            gathered.append(pickle.loads(payload.cpu().numpy().tobytes()))
        return StepReport(gathered)

    def _run_schedule(self, step: _Step) -> None:
        for position, action in enumerate(self.actions):
            self._post_next_receive(step, position)
            step.timer.action_starts()
            stage = self.stages[action.stage_on(self.rank)]
            self._run(step, stage, action, position=position)
            step.timer.action_ends(action)
            held = (tensor for pair in step.held.values() for tensor in pair)
            step.memory.sample(held, queued_more=action.kind.is_backward)
        for stage in self.stages.values():
            if len(stage.queue):
                raise PipelineError(
                    f"twobp: rank {self.rank}: weight-gradient work of micro-batches {stage.queue.tags()} of stage "
                    f"{stage.index} is still queued after the schedule's last W"
                )
        for work, _, what in step.sends:
            self._wait(work, what, step.timer)
        if self.grad_sync is not None:
            step.sync_ended = True
            try:
                self.grad_sync.finish()
            except ReductionFailed as error:
                raise PipelineError(
                    f"twobp: rank {self.rank}: the data-parallel reduction of this step's gradients failed (a "
                    f"replica of this stage probably failed, died or hung): {error}"
                ) from error

    def _run(self, step: _Step, stage: _Stage, action: Action, *, position: int) -> None:
        kind = action.kind
        if kind is ActionKind.FORWARD:
            self._forward(step, stage, action)
        elif kind.is_backward:
            self._backward(step, stage, action)
            if kind is ActionKind.BACKWARD and self.twobp:  # a patched stage queued B's weight work: run it now
                self._flush(step, stage, action.micro_batches, position)
        else:
            self._flush(step, stage, action.micro_batches, position)

    def _flush(self, step: _Step, stage: _Stage, tags: Sequence[Hashable] | None, position: int) -> None:
        if self.grad_sync is None or position < stage.last_backward_position:
            stage.queue.flush(tags=tags)
            return
        # The stage's gradients can become final, but for parameters it shares with a stage of
        # this rank whose backwards are still to come (a tied weight).
        later = [s for s in self.stages.values() if position < s.last_backward_position]
        to_come = {id(p) for s in later for p in s.module.parameters()}
        final = [p for p in stage.module.parameters() if id(p) not in to_come]
        try:
            self.grad_sync.flush(stage.queue, tags, final)
        except BaseException:
            step.sync_ended = True  # a failed flush ends the step (GradientSynchroniser aborts it)
            raise

    @property
    def _num_stages(self) -> int:
        return len(self.placement)

    def _is_local(self, message: Message) -> bool:
        return self.placement[message.sender] == self.placement[message.receiver]

    def _forward(self, step: _Step, stage: _Stage, action: Action) -> None:
        k = action.micro_batch
        source = action.receives(self.rank, self._num_stages)
        if source is None:
            x = step.inputs[k].to(self.device)
        else:
            x = step.handed_over.pop(source) if self._is_local(source) else self._receive(step, source)
            x.requires_grad_(x.is_floating_point())
        with use_queue(stage.queue), stage.queue.tagged(k):
            try:
                out = stage.module(x)
            except RuntimeError as error:
                if source is not None and "leaf Variable that requires grad" in str(error):
                    raise PipelineError(
                        f"twobp: rank {self.rank}: stage {stage.index} changes its input in place (an "
                        "in-place first op, such as ReLU(inplace=True)); the activation a stage "
                        "receives is a leaf that requires grad, which autograd does not let change in "
                        "place. Make that op out of place or cut the stages elsewhere."
                    ) from error
                raise
        if not isinstance(out, Tensor):
            raise TypeError(
                f"twobp: rank {self.rank}: a pipeline stage must return one tensor (what it hands on, or "
                f"the last stage's output for loss_fn), got {type(out).__name__}: wrap the stage to return "
                "one (the logits of a model output), or pack several into one and split them in the next stage"
            )
        destination = action.sends(self.rank, self._num_stages)
        if destination is None:  # the last stage: its output goes into the loss
            target = tree_map(lambda t: t.to(self.device), step.targets[k])
            if step.loss_divisors[k] == float("inf"):
                # No item to average over: the loss function's mean is 0 / 0, NaN in value and in
                # backward, whatever it is divided by. It weighs nothing: zero, and a zero gradient
                # back through the stages (finite even where the output is not).
                loss = out.sum() * 0.0
                step.losses.append(loss.new_zeros(()))  # in the loss's dtype, as the others
            else:
                loss = self.loss_fn(out, target) / step.loss_divisors[k]  # type: ignore[misc]
                if loss.numel() == 1:  # backward() takes any one-number loss, (1,) included
                    loss = loss.reshape(())
                else:
                    raise ValueError(
                        f"twobp: rank {self.rank}: loss_fn returned a tensor of shape {tuple(loss.shape)}; it must "
                        "return one number per micro-batch (reduce it, by mean or sum, and pass that "
                        "as loss_reduction)"
                    )
                step.losses.append(loss.detach())
            step.held[stage.index, k] = (x, loss)
        else:
            if self._is_local(destination):
                step.handed_over[destination] = out.detach()
            else:
                self._send_activation(step, out.detach(), destination)
            step.held[stage.index, k] = (x, out)

    def _backward(self, step: _Step, stage: _Stage, action: Action) -> None:
        # With a capped queue, work over the cap is flushed after the input gradient is posted.
        # Inside the stage's queue and tag, as the forward: a reentrant checkpoint re-runs its
        # region's forward here, and that work must land where the forward's would.
        with stage.queue.cap_enforced_after(), use_queue(stage.queue), stage.queue.tagged(action.micro_batch):
            source = action.receives(self.rank, self._num_stages)
            remote = source if source is not None and not self._is_local(source) else None
            if remote is not None:  # while the output is held: it gives the gradient's shape
                self._post_receives_through(step, remote)
            x, out = step.held.pop((stage.index, action.micro_batch))
            if source is None:  # the last stage: ``out`` is the loss
                out.backward()
            elif out.is_floating_point():  # an integer output (token ids) gets no gradient back
                grad = self._take_posted(step, remote) if remote is not None else step.handed_over.pop(source)
                # A stage with every parameter frozen, fed data that needs no gradient (the first
                # stage, when fine-tuning leaves it frozen), has nothing to differentiate.
                if out.requires_grad:
                    out.backward(grad)
                del grad
            destination = action.sends(self.rank, self._num_stages)
            if destination is None:
                return
            if not x.is_floating_point():  # nothing goes back for an integer input
                if not self._is_local(destination):
                    self._pass_posting(step, destination)
                return
            grad_input = x.grad
            if grad_input is None:
                _warn_output_without_input(stage.index)
                grad_input = torch.zeros_like(x)
            if self._is_local(destination):
                step.handed_over[destination] = grad_input
            else:
                self._post_send(step, grad_input, destination)

    def _loss_divisors(self, step: _Step) -> list[float]:
        """What each micro-batch's loss is divided by: for a mean, the step's items over the
        micro-batch's (samples: m where the micro-batches are even; ``loss_items``' count)."""
        if self.loss_reduction == "sum":
            return [1.0] * len(step.targets)
        if self.loss_items is None:
            items = [int(tree_flatten(t)[0][0].shape[0]) for t in step.targets]
        else:
            items = [self.loss_items(t) for t in step.targets]
        total = sum(items)
        # A micro-batch with no item has a loss of nothing (NaN for a mean): it weighs nothing.
        return [total / n if n else float("inf") for n in items]

    def _rank_of(self, stage: int) -> int:
        return self.placement[stage]

    def _tag(self, message: Message) -> int:
        """Distinct for every message between two ranks of one step: gloo matches by tag."""
        return 2 * (message.micro_batch * self._num_stages + message.sender) + (message.payload is Payload.GRADIENTS)

    # -- shapes -------------------------------------------------------------------------

    def _agree_on_step_shape(self, inputs: Tensor | None, targets: Any) -> Hashable:
        # One header summed over the group (each rank writes its own parts, zeros elsewhere):
        # the inputs' dtype and shape from the first stage's rank, every rank's autocast (it
        # changes the activations' dtypes for the same input shape: a step under autocast and one
        # without must not share cached shapes), every rank's refusal of what it was given, and
        # the targets' batch from the last stage's rank. Every rank sees all of it, so all refuse
        # together; one refusing alone left the others waiting for it until the timeout.
        size = self.world_size
        header = torch.zeros(3 + _MAX_DIMS + 2 * size, dtype=torch.int64, device=self._comm_device)
        autocast_at, refusal_at, targets_batch = 2 + _MAX_DIMS, 2 + _MAX_DIMS + size, 2 + _MAX_DIMS + 2 * size
        refusal: Exception | None = None
        rows_of_targets: set[int] = set()  # the last rank's: each target tensor's rows on dim 0
        try:
            if self.first:
                header[: 2 + _MAX_DIMS].copy_(_meta(_one_tensor(inputs)))
            if self.last:
                rows_of_targets = _batches_of_targets(targets)
                header[targets_batch] = next(iter(rows_of_targets)) if len(rows_of_targets) == 1 else _SEVERAL
        except (TypeError, ValueError) as error:
            refusal = error
            header[refusal_at + self.rank] = 1
        header[autocast_at + self.rank] = _autocast_code(self.device)
        work = dist.all_reduce(header, group=self.group, async_op=True)
        self._wait(work, "agreeing with every rank on this step's inputs and targets", timer=None)
        if refusal is not None:
            raise refusal
        refused = [rank for rank, flag in enumerate(header[refusal_at:targets_batch].tolist()) if flag]
        if refused:
            raise PipelineError(
                f"twobp: rank {self.rank}: rank {refused[0]} refused this step's inputs or targets (see its error)"
            )
        key = tuple(header[: 3 + _MAX_DIMS].tolist())  # the inputs, and rank 0's autocast
        autocasts = header[autocast_at:refusal_at].tolist()
        if len(set(autocasts)) > 1:
            under = [rank for rank, code in enumerate(autocasts) if code]
            raise PipelineError(
                f"twobp: rank {self.rank}: the ranks' steps run under different autocasts (under autocast: "
                f"ranks {under}, of {self.world_size}); run every rank's step() under the same torch.autocast "
                "(or none)"
            )
        batch = _batch_of(key)
        if batch < self.num_micro_batches:  # on every rank alike: empty micro-batches would give NaN losses
            raise ValueError(
                f"twobp: a step's inputs must hold at least num_micro_batches={self.num_micro_batches} samples "
                f"on dim 0 (one per micro-batch); got {batch}"
            )
        # Targets split apart from the inputs pair a micro-batch's outputs with other samples'
        # targets (or a loss broadcasts them), where one process's loss refuses them. Targets
        # whose tensors hold different numbers of rows are checked on their rank alone.
        given = int(header[targets_batch])
        for rows in rows_of_targets if given == _SEVERAL else {given}:
            if rows != _SEVERAL and not _split_alike(rows, batch, self.num_micro_batches):
                raise ValueError(
                    f"twobp: rank {self.rank}: this step's targets hold {rows} samples on dim 0 and its inputs "
                    f"{batch}: both are split on dim 0 into the {self.num_micro_batches} micro-batches, so the "
                    "targets must hold as many rows as the inputs, or k rows per sample (tokens flattened sample "
                    "by sample) with the micro-batches dividing the batch evenly"
                )
        return key

    def _send_activation(self, step: _Step, out: Tensor, message: Message) -> None:
        k = message.micro_batch
        known = self._sent_shapes.get((step.shape_key, message.sender, k))
        if known is not None and known != (out.shape, out.dtype):
            raise PipelineError(
                f"twobp: rank {self.rank}: the stage output of micro-batch {k} is {tuple(out.shape)} {out.dtype}, but "
                f"{tuple(known[0])} {known[1]} was exchanged for this input shape; a stage's output shape must "
                "depend only on the batch shape"
            )
        self._post_send(step, out.contiguous(), message, with_shape=known is None)
        self._sent_shapes[(step.shape_key, message.sender, k)] = (out.shape, out.dtype)

    # -- posting, in the order every rank posts (see .posting) ----------------------------

    def _post_send(self, step: _Step, tensor: Tensor, message: Message, *, with_shape: bool = False) -> None:
        """Send ``message`` (its shape first, ``with_shape``), after posting the receives that
        come before it in the posting order."""
        self._pass_posting(step, message)
        peer, tag = self._rank_of(message.receiver), self._tag(message)
        if with_shape:
            self._send(step, _meta(tensor), peer, _SHAPE_TAG + tag, f"the shape of micro-batch {message.micro_batch}")
        self._send(step, tensor, peer, tag, _what(message))

    def _pass_posting(self, step: _Step, message: Message) -> None:
        """Move past this rank's send of ``message`` in the posting order (posted by the caller,
        or not at all: no gradient goes back for an integer input), after the receives before it."""
        if not self._in_order:
            return
        index = self._posting_index[message]
        self._post_receives(step, until=index, block=True)
        if step.next_posting != index:  # the schedule's replay put a send of a later action first
            raise PipelineError(
                f"twobp: rank {self.rank}: {_what(message)} is not next in this rank's posting order "
                f"({self._postings[step.next_posting]} is); please report this with the schedule"
            )
        step.next_posting += 1

    def _receive(self, step: _Step, message: Message) -> Tensor:
        self._post_receives_through(step, message)
        return self._take_posted(step, message)

    def _post_receives_through(self, step: _Step, message: Message, *, block: bool = True) -> None:
        """Post the receive of ``message`` (in order: and those before it), unless posted already
        or, not ``block``ing, its shape is yet to come."""
        if self._in_order:
            self._post_receives(step, until=self._posting_index[message] + 1, block=block)
        elif message not in step.posted:
            self._post_receive(step, message, self._incoming_meta(step, message, block=block))

    def _take_posted(self, step: _Step, message: Message) -> Tensor:
        work, buffer = step.posted.pop(message)
        self._wait(work, f"receiving {_what(message)} from rank {self._rank_of(message.sender)}", step.timer)
        return buffer

    def _post_receives(self, step: _Step, *, until: int, block: bool) -> None:
        """Post this rank's receives in the posting order, from the first not yet posted to
        ``until`` (exclusive): up to a send (its action posts it) or, unless ``block``, an
        activation whose shape is yet to come (else received first)."""
        while step.next_posting < until:
            message, sends = self._postings[step.next_posting]
            if sends:
                return
            meta = self._incoming_meta(step, message, block=block)
            if meta is None:
                return
            self._post_receive(step, message, meta)
            step.next_posting += 1

    def _post_receive(self, step: _Step, message: Message, meta: _Incoming) -> None:
        if isinstance(meta, tuple):  # else nothing comes, or its shape is yet to come
            buffer = torch.empty(meta[0], dtype=meta[1], device=self.device)
            peer, tag = self._rank_of(message.sender), self._tag(message)
            step.posted[message] = (dist.irecv(buffer, group_src=peer, group=self.group, tag=tag), buffer)

    def _post_next_receive(self, step: _Step, position: int) -> None:
        """Post the receives up to the next action's that gets a message from another rank,
        those whose shapes are known, before running the one at ``position``: the transfers
        then overlap this action instead of starting when that action waits for them."""
        index = self._next_remote_receive[position]
        if index < len(self._remote_receives):
            self._post_receives_through(step, self._remote_receives[index], block=False)

    def _incoming_meta(self, step: _Step, message: Message, *, block: bool) -> _Incoming:
        """The shape and dtype ``message`` will have: a gradient's from the output it is the
        gradient of (:data:`_NOTHING_COMES` for an integer output), an activation's from this
        input shape's first step, or from the sender (``block``); None if not known yet."""
        k = message.micro_batch
        if message.payload is Payload.GRADIENTS:
            held = step.held.get((message.receiver, k))
            if held is None:  # its forward is yet to run (only looking ahead)
                return None
            output = held[1]
            return (output.shape, output.dtype) if output.is_floating_point() else _NOTHING_COMES
        key = (step.shape_key, message.sender, k)
        if key not in self._received_shapes and block:
            buffer = torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=self._comm_device)
            peer, tag = self._rank_of(message.sender), _SHAPE_TAG + self._tag(message)
            meta = self._receive_now(step, buffer, peer, tag, f"the shape of micro-batch {k}")
            code, ndim, *dims = meta.tolist()
            self._received_shapes[key] = (torch.Size(dims[:ndim]), _DTYPES[code])
        return self._received_shapes.get(key)

    # -- messages -----------------------------------------------------------------------

    @property
    def _comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def _send(self, step: _Step, tensor: Tensor, peer: int, tag: int, what: str) -> None:
        work = dist.isend(tensor, group_dst=peer, group=self.group, tag=tag)
        step.sends.append((work, tensor, f"sending {what} to rank {peer}"))  # the tensor lives until sent

    def _receive_now(self, step: _Step, buffer: Tensor, peer: int, tag: int, what: str) -> Tensor:
        work = dist.irecv(buffer, group_src=peer, group=self.group, tag=tag)
        self._wait(work, f"receiving {what} from rank {peer}", step.timer)
        return buffer

    def _wait(self, work: Any, what: str, timer: StepTimer | None) -> None:
        """Wait for ``work``; a step's waits count as its idle time on ``timer``."""
        start = time.perf_counter()
        try:
            work.wait(datetime.timedelta(seconds=self.timeout))
        except Exception as error:
            raise PipelineError(
                f"twobp: rank {self.rank}: {what} failed after {time.perf_counter() - start:.1f} s (timeout "
                f"{self.timeout:g} s); that rank probably failed or died, or runs a different "
                f"schedule or model: {error}"
            ) from error
        if timer is not None:
            timer.waited(start)


def _stages_of(
    stage: nn.Module | Mapping[int, nn.Module], queue: WeightGradQueue | Mapping[int, WeightGradQueue] | None, rank: int
) -> dict[int, _Stage]:
    modules = {rank: stage} if isinstance(stage, nn.Module) else dict(stage)
    if not modules:
        raise ValueError(f"twobp: rank {rank} holds no stage: pass its stage module, or a mapping from stage to module")
    if isinstance(queue, Mapping):
        queues = dict(queue)
        if set(queues) != set(modules):
            raise ValueError(
                f"twobp: rank {rank} holds stages {sorted(modules)} and was given queues for stages "
                f"{sorted(queues)}: pass one queue per stage it holds"
            )
    else:
        if queue is not None and len(modules) > 1:
            raise ValueError("twobp: several stages need one queue each: pass a mapping from stage to queue")
        queues = {index: queue if queue is not None else WeightGradQueue() for index in modules}
    return {index: _Stage(index, modules[index], queues[index]) for index in sorted(modules)}


def _what(message: Message) -> str:
    return f"the {message.payload.value} of micro-batch {message.micro_batch}"


def _one_tensor(inputs: Any) -> Tensor:
    if inputs is None:
        raise ValueError("twobp: the first rank needs the inputs")
    if not isinstance(inputs, Tensor):
        raise TypeError(
            f"twobp: a pipeline step's inputs must be one tensor (split on dim 0 into the micro-batches), not "
            f"{type(inputs).__name__}: pack several (input ids and an attention mask) into one and split them "
            "in the first stage"
        )
    return inputs


def _meta(tensor: Tensor) -> Tensor:
    if tensor.dim() > _MAX_DIMS:
        raise ValueError(f"activations of more than {_MAX_DIMS} dimensions cannot cross stages")
    meta = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64)
    meta[: 2 + tensor.dim()] = torch.tensor([_dtype_code(tensor.dtype), tensor.dim(), *tensor.shape])
    return meta.to(tensor.device)


def _autocast_code(device: torch.device) -> int:
    """0 without autocast on ``device``'s type, else 1 + its dtype's code."""
    kind = device.type if device.type in ("cuda", "cpu") else "cpu"
    if not torch.is_autocast_enabled(kind):
        return 0
    return 1 + _dtype_code(torch.get_autocast_dtype(kind))


def _dtype_code(dtype: torch.dtype) -> int:
    if dtype not in _DTYPES:
        raise TypeError(f"cannot send {dtype} between stages")
    return _DTYPES.index(dtype)


def _batch_of(shape_key: Hashable) -> int:
    """The samples of a step, from its shape header (dims, then the shape)."""
    assert isinstance(shape_key, tuple)
    return int(shape_key[2]) if shape_key[1] > 0 else 0


def _split_alike(targets_batch: int, batch: int, m: int) -> bool:
    """Whether ``tensor_split(m)`` cuts ``targets_batch`` rows where it cuts ``batch`` samples,
    with the same number of rows per sample (one, or k flattened ones) in every micro-batch."""
    if targets_batch % batch:
        return False
    rows = targets_batch // batch

    def sizes(n: int) -> list[int]:
        return [n // m + (1 if part < n % m else 0) for part in range(m)]

    return sizes(targets_batch) == [rows * size for size in sizes(batch)]


def _batches_of_targets(targets: Any) -> set[int]:
    """The rows on dim 0 of a step's targets' tensors (a tensor, or a dict / tuple / list of
    them), or a clear error."""
    if targets is None:
        raise ValueError("twobp: the last rank needs the targets")
    leaves, _ = tree_flatten(targets)
    if not leaves or not all(isinstance(t, Tensor) for t in leaves):
        raise TypeError(
            "twobp: a pipeline step's targets must be a tensor, or a dict, tuple or list of tensors "
            f"(each split on dim 0 into the micro-batches), not {type(targets).__name__}"
        )
    if any(t.dim() == 0 for t in leaves):
        raise ValueError(
            "twobp: a pipeline step's targets hold a 0-d tensor, which cannot be split on dim 0 into the "
            "micro-batches (a count of items in the batch, say): give the loss_fn such a value another way "
            "(the runtime's loss_items counts each micro-batch's items)"
        )
    return {t.shape[0] for t in leaves}


#: A step header's targets batch saying the targets' tensors hold different numbers of rows.
_SEVERAL = -1


def _micro_batches_of(targets: Any, m: int) -> list[Any]:
    """Targets (checked by :func:`_batches_of_targets`) split on dim 0 into ``m`` like the inputs."""
    leaves, spec = tree_flatten(targets)
    parts = [t.tensor_split(m) for t in leaves]
    return [tree_unflatten([p[k] for p in parts], spec) for k in range(m)]


def _warn_output_without_input(stage: int) -> None:
    warn_once(
        ("pipeline stage output without its input", stage),
        f"twobp: stage {stage}'s output does not depend on its input, so no gradient reaches it; the "
        "stage before gets zeros, where one process leaves its parameters' .grad None (an optimizer "
        "with weight decay or momentum then moves them).",
        stacklevel=3,
    )
