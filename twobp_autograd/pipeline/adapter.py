"""The torch.distributed.pipelining adapter: a patched stage's deferred weight gradients as the
``dw_builder`` of a :class:`~torch.distributed.pipelining.PipelineStage`.

PyTorch's zero-bubble schedules split backward by cutting the autograd graph between input
and weight gradients, which breaks on custom autograd Functions (pytorch#166577). Given a
``dw_builder``, a stage instead runs a plain full backward for its I step and calls the
builder right after it; the runner the builder returns is the stage's W step. On a patched
stage that full backward computes input gradients only (weight work is queued), so the
builder only has to hand the queued work of that one micro-batch to its runner::

    twobp.patch(stage_module)
    stage = PipelineStage(stage_module, i, n, device, dw_builder=dw_builder(stage_module))

Each stage gets its own queue: two stages on one rank (interleaved and V schedules) would
otherwise mix their work. A queue is bound when the forward runs, so forward hooks on the
stage module make its forwards (and nothing else) feed that queue. PyTorch's shape inference
(stages built without ``input_args``) runs an input-only ``autograd.grad`` through the stage,
which queues nothing: the weight-gradient taps only queue for a backward that reaches the
parameters.

On stages sharded with ``fully_shard`` nothing changes: PyTorch's schedule runs every backward
without gradient sync, a runner's gradients land on the unsharded parameters the stage computed
with (accumulated there, :mod:`twobp_autograd.fsdp`), and the schedule's final reduction
reduce-scatters them with the rest.

PyTorch asks for one runner per micro-batch, so each W runs one micro-batch's work: this path
does not concatenate micro-batches (the runtime in this package does). Layers that are not
patched keep plain autograd: their weight gradients are computed in the I step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

from ..flush import run_jobs
from ..job import WeightGradJob
from ..queue import WeightGradQueue, use_queue

__all__ = ["dw_builder", "StageWeightGrads", "WeightGradRunner"]


class WeightGradRunner:
    """One micro-batch's W step of one stage: the weight-gradient work its backward queued."""

    def __init__(self, jobs: list[WeightGradJob], queue: WeightGradQueue) -> None:
        self.jobs: list[WeightGradJob] | None = jobs
        self.queue = queue

    def __call__(self) -> None:
        if self.jobs is None:
            raise RuntimeError(
                "twobp: this weight-gradient runner already ran; running it twice would add its gradients twice."
            )
        jobs, self.jobs = self.jobs, None  # release the saved activations as soon as possible
        # Delivered all at the end: PyTorch's schedule reads .grad only after the step.
        with self.queue.running(jobs):
            run_jobs(jobs, dataclasses.replace(self.queue.flush_options, delivery_bucket_bytes=None))


class StageWeightGrads:
    """The ``dw_builder`` of one stage module: routes the module's forwards to its own queue;
    each call takes the work queued since the previous call and returns its runner."""

    def __init__(self, module: nn.Module, queue: WeightGradQueue | None = None) -> None:
        # Weak: the module holds this builder through its hooks, and the registry of builders
        # must not keep the module alive.
        self._module = weakref.ref(module)
        self.queue = queue if queue is not None else WeightGradQueue()
        self.runners_built = 0
        self.jobs_built = 0
        # Per thread: two threads may run this stage's forward at once.
        self._active_per_thread = threading.local()
        self._handles = [
            # First in, last out, so that the module's other hooks run under the queue too.
            module.register_forward_pre_hook(_StageHook(self._enter_queue), prepend=True),
            module.register_forward_hook(_StageHook(self._leave_queue), always_call=True),
        ]

    @property
    def module(self) -> nn.Module | None:
        return self._module()

    def _enter_queue(self, module: nn.Module, args: Any) -> None:
        context = use_queue(self.queue)
        context.__enter__()
        self._active.append(context)

    @property
    def _active(self) -> list[contextlib.AbstractContextManager[Any]]:
        return self._active_per_thread.__dict__.setdefault("stack", [])

    def _leave_queue(self, module: nn.Module, args: Any, output: Any) -> None:
        # Also called when forward raised; empty when a hook before ours raised.
        if self._active:
            self._active.pop().__exit__(None, None, None)

    def __call__(self) -> WeightGradRunner:
        jobs = self.queue.take()
        self.runners_built += 1
        self.jobs_built += len(jobs)
        return WeightGradRunner(jobs, self.queue)

    def remove(self) -> None:
        """Detach from the module: its forwards feed the thread's queue again."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        module = self.module
        if module is not None and _builders.get(module) is self:
            del _builders[module]


class _StageHook:
    """A forward hook of one stage. A copy of the module (``copy.deepcopy``, pickling) is not
    that stage and must not feed its queue: the copy gets an inert hook instead."""

    def __init__(self, hook: Callable[..., None]) -> None:
        self.hook = hook

    def __call__(self, *args: Any) -> None:
        self.hook(*args)

    def __reduce__(self) -> tuple[Callable[[], Callable[..., None]], tuple[()]]:
        return _inert_hook, ()


def _ignore(*args: Any) -> None:
    return None


def _inert_hook() -> Callable[..., None]:
    return _ignore


_builders: weakref.WeakKeyDictionary[nn.Module, StageWeightGrads] = weakref.WeakKeyDictionary()


def dw_builder(stage_module: nn.Module, queue: WeightGradQueue | None = None) -> StageWeightGrads:
    """The ``dw_builder`` for ``PipelineStage(stage_module, ..., dw_builder=...)``; call after
    :func:`twobp_autograd.patch`. One builder per module: asking again returns the same one."""
    if not isinstance(stage_module, nn.Module):
        raise TypeError(f"twobp: dw_builder expects the stage's nn.Module, got {type(stage_module).__name__}")
    existing = _builders.get(stage_module)
    if existing is not None:
        if queue is not None and queue is not existing.queue:
            raise ValueError(
                "twobp: this stage module already has a dw_builder with another queue; call .remove() on it first."
            )
        return existing
    builder = _builders[stage_module] = StageWeightGrads(stage_module, queue)
    return builder

