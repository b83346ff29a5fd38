"""Fully sharded data parallel (FSDP2, ``torch.distributed.fsdp.fully_shard``) on patched models.

FSDP2 reduce-scatters each parameter group's gradients in the group's post-backward hook and
frees the unsharded parameters after backward. On a patched model the deferred weight
gradients do not exist then: the flush makes them, on the *unsharded* parameters the layers
computed with (the kernels need each layer's input and output gradient, not its weight, so
resharding after backward goes on as usual). This module, imported with the package, follows
every flush: once the flush has made the last of a group's gradients, it runs the group's own
post-backward again, which reduce-scatters them into the sharded ``.grad`` (or accumulates them
unsharded under ``set_requires_gradient_sync(False)``) in FSDP2's reduce dtype, while the flush
goes on with the next layers (on a GPU the reduction runs on FSDP2's reduce-scatter stream; gloo
on a CPU reduces synchronously, as FSDP2 itself does there). The training loop is FSDP2's, with
a flush before the step::

    twobp.patch(model)                   # before or after fully_shard
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    for x, y in micro_batches:
        loss_fn(model(x), y).backward()  # input gradients; weight work queued
    twobp.flush_weight_grads()           # weight gradients, reduce-scattered group by group
    optimizer.step()

:class:`ShardedGradientSync` plugs this into :class:`~twobp_autograd.pipeline.PipelineRuntime`
(``grad_sync=``): gradients accumulate unsharded during the step and each group is
reduce-scattered once, at the step's last flush.

Misuse is refused: ``optimizer.step()`` over sharded parameters whose work is still queued on
their unsharded stand-ins, and a flush of work queued before ``fully_shard`` replaced the
parameters it was queued for (its gradients would land on parameters no longer in the model).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd import Variable

from . import fsdp_hooks
from .flush import watch_flushes
from .grad_guard import stand_in_finders
from .queue import WeightGradQueue

__all__ = ["ShardedGradientSync"]


class _GroupReductions:
    """One flush's watch: reduces each FSDP2 parameter group once the flush has delivered all
    of that group's gradients it makes (a group inside its own backward is left to FSDP2's
    post-backward, which is still to come). Groups are reduced in one order every rank shares
    (:func:`fsdp_hooks.reduction_order`): a group finished early waits for those before it, as
    each rank's collectives must pair with the same group's on the others."""

    def __init__(self, sharded: dict[int, fsdp_hooks.ShardedParam], early: bool) -> None:
        self._group_of = {key: entry.group for key, entry in sharded.items()}
        self._awaited: dict[int, int] = {}
        groups: dict[int, Any] = {}
        for group in self._group_of.values():
            self._awaited[id(group)] = self._awaited.get(id(group), 0) + 1
            groups[id(group)] = group
        place = fsdp_hooks.reduction_order()
        self._order = sorted(groups.values(), key=lambda group: place[id(group)])
        self._next = 0  # self._order[:self._next] are reduced
        self._reduced: list[Any] = []
        self._held: set[int] = set()  # groups with gradients an early flush held back
        if not early and torch._C._current_graph_task_id() < 0:  # this flush reduces the groups:
            for group in self._order:  # refused before any gradient is made, its work kept queued
                if not fsdp_hooks.in_backward(group):
                    fsdp_hooks.refuse_split_partial_all_reduce(group, sharded.keys())

    def completes(self, params: Sequence[Tensor]) -> bool:
        """Whether ``params`` hold the last gradients that the next group to reduce awaits."""
        if self._next == len(self._order):
            return False
        front = id(self._order[self._next])
        return sum(id(self._group_of.get(id(param))) == front for param in params) == self._awaited[front]

    def holds_back(self, param: Tensor) -> bool:
        """At a capped queue's early flush every sharded parameter's gradient stays queued, for
        the flush every rank runs: ranks reach their caps at other moments, and a gradient in
        ``.grad`` on some ranks only would be reduced there alone (now, by FSDP2's own
        post-backward of a later backward, or at the end of the step), waiting forever or
        pairing with another group's reduction."""
        group = self._group_of.get(id(param))
        if group is None:
            return False
        self._held.add(id(group))
        return True

    def delivered(self, params: Sequence[Tensor]) -> None:
        for param in params:
            group = self._group_of.get(id(param))
            if group is not None:
                self._awaited[id(group)] -= 1
        while self._next < len(self._order) and self._awaited[id(self._order[self._next])] == 0:
            self._reduce(self._order[self._next])

    def finished(self) -> None:
        # A kernel may return no gradient for a parameter (never delivered): its group goes now.
        while self._next < len(self._order):
            self._reduce(self._order[self._next])
        fsdp_hooks.wait_for_reductions(self._reduced)

    def abandoned(self) -> None:
        """The groups not reduced drop the unsharded gradients the failed flush gave them (else
        FSDP2's next post-backward reduces them into the next step's ``.grad``, after the
        zero_grad PartlyDelivered asks for); one whose reduction raised too, and a reduced one
        holds none."""
        for group in self._order:
            if not fsdp_hooks.in_backward(group):
                fsdp_hooks.drop_unsharded_grads(group, self._group_of.keys())

    def _reduce(self, group: Any) -> None:
        self._next += 1
        if id(group) in self._held or fsdp_hooks.in_backward(group):
            return  # held back for the flush every rank runs, or its own post-backward is still to come
        if torch._C._current_graph_task_id() >= 0:
            _reduce_when_this_backward_ends(group)  # a flush run inside a backward (a hook's), maybe one of many
            return
        fsdp_hooks.reduce_group(group)
        self._reduced.append(group)


_after_backward: dict[int, dict[int, Any]] = {}  # graph task -> groups to reduce when it ends


def _reduce_when_this_backward_ends(group: Any) -> None:
    """Flushes run inside one backward (from a hook; a capped queue's early flush holds its
    sharded gradients back instead) reduce each group they touched once, at its end (after
    FSDP2's own end-of-backward callback), instead of once per flush."""
    task = torch._C._current_graph_task_id()
    groups = _after_backward.get(task)
    if groups is None:
        groups = _after_backward[task] = {}
        Variable._execution_engine.queue_callback(_ReduceAtEnd(task))
    groups[id(group)] = group


class _ReduceAtEnd:
    """Queued on autograd's engine: reduces the groups at the end of the backward ``task``; a
    backward that raised never calls it, and the entry goes when the engine frees the task."""

    __slots__ = ("task",)

    def __init__(self, task: int) -> None:
        self.task = task

    def __call__(self) -> None:
        _reduce_now(_after_backward.pop(self.task))

    def __del__(self) -> None:
        _after_backward.pop(self.task, None)


def _reduce_now(groups: dict[int, Any]) -> None:
    place = fsdp_hooks.reduction_order()
    in_order = sorted(groups.values(), key=lambda group: place[id(group)])
    reduced = [group for group in in_order if not fsdp_hooks.in_backward(group)]
    for group in reduced:
        fsdp_hooks.reduce_group(group)
    fsdp_hooks.wait_for_reductions(reduced)


def _watch(params: Sequence[Tensor], early: bool) -> _GroupReductions | None:
    if not fsdp_hooks.fsdp_in_use():
        return None
    sharded = fsdp_hooks.sharded_params_of(list(params))
    orphans = [p for p in params if id(p) not in sharded and fsdp_hooks.replaced_by_fully_shard(p)]
    if orphans:
        raise RuntimeError(
            f"twobp: this flush holds weight-gradient work for {len(orphans)} parameters that "
            "fully_shard has since replaced by sharded ones: their gradients would land on "
            "parameters no longer in the model. Flush (twobp.flush_weight_grads()) before calling "
            "fully_shard, or drop that work with twobp.discard_weight_grads()."
        )
    return _GroupReductions(sharded, early) if sharded else None


watch_flushes(_watch, active=fsdp_hooks.fsdp_in_use)
stand_in_finders.append(fsdp_hooks.unsharded_params_of)


class ShardedGradientSync:
    """The ``grad_sync`` of a :class:`~twobp_autograd.pipeline.PipelineRuntime` whose stage is
    sharded with ``fully_shard`` over its data-parallel group: during a step the gradients
    accumulate unsharded (``set_requires_gradient_sync(False)``); the flushes after the step's
    last backward reduce-scatter each group as its gradients become final, and :meth:`finish`
    reduces the groups no flush touched (gradients that backward computed itself)."""

    def __init__(self, module: nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(module, FSDPModule):
            raise TypeError(
                "twobp: ShardedGradientSync needs the stage after fully_shard(stage, mesh=...); "
                f"got a {type(module).__name__}. For unsharded replicas use "
                "twobp_autograd.data_parallel.GradientSynchroniser."
            )
        self.module = module
        self._set_sync(False)

    def flush(
        self, queue: WeightGradQueue, tags: Sequence[Hashable] | None, params: Iterable[Tensor] | None = None
    ) -> None:
        """One stage per rank: every flush that may make gradients final is that stage's (``params``)."""
        self._set_sync(True)
        queue.flush(tags)

    def finish(self) -> None:
        self._set_sync(True)
        try:
            place = fsdp_hooks.reduction_order()
            groups = sorted(fsdp_hooks.groups_of(self.module), key=lambda group: place[id(group)])
            for group in groups:
                fsdp_hooks.reduce_group(group)
            fsdp_hooks.wait_for_reductions(groups)
        finally:
            self._set_sync(False)

    def reset(self) -> None:
        self._set_sync(False)

    def _set_sync(self, sync: bool) -> None:
        self.module.set_requires_gradient_sync(sync)
