"""One patched call's deferred weight-gradient work, as backward-p1 leaves it: the kernel that
computes the layer's weight gradients, the tensors it needs, and the parameters they go to.

A kernel is ``kernel(saved, grad_outputs, needs) -> one gradient (or None) per parameter``:

- ``saved`` and ``grad_outputs`` hold one micro-batch, or several concatenated on dim 0 (the
  batch dimension of every tensor, output gradients in the same row order);
- ``needs[i]`` says whether parameter ``i``'s gradient is wanted (return None where not);
- a kernel given as a ``functools.partial`` of one function with hashable arguments lets jobs
  of different calls with equal configuration share one kernel call at the flush.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from torch import Tensor

from .offload import HostOffload, ParkedTensors

__all__ = ["WeightGradKernel", "WeightGradJob", "finished_grads", "leaves_some_grads_none", "NO_GRADIENT"]

#: ``kernel(saved, grad_outputs, needs) -> one gradient (or None) per parameter``.
#: ``saved`` and ``grad_outputs`` hold one micro-batch, or several concatenated on dim 0.
WeightGradKernel = Callable[[Sequence[Tensor], Sequence[Tensor], Sequence[bool]], Sequence[Tensor | None]]


class WeightGradJob:
    """One patched call's deferred weight-gradient work (built once per call in backward-p1:
    a slotted class, kept cheap)."""

    __slots__ = (
        "kernel", "group", "concatenate", "params", "saved", "grad_outputs", "tag", "task", "check_nan", "autocast",
        "versions", "parked", "accumulators", "home", "hooks_at_backward", "delivered", "counted",
        "forked_into_shared_grad",
    )

    def __init__(
        self,
        kernel: WeightGradKernel,
        group: Hashable,
        concatenate: bool | None,
        params: tuple[Tensor | None, ...],
        saved: tuple[Tensor, ...],
        grad_outputs: tuple[Tensor, ...],
        tag: Hashable = None,
    ) -> None:
        self.kernel = kernel
        self.group = group  # jobs with equal group may be concatenated and run as one call
        self.concatenate = concatenate  # False: never joined; True: joining pays; None: off the CPU
        self.params = params  # None where that gradient is not wanted
        self.saved = saved
        for grad in grad_outputs:  # a loop: a generator costs a microsecond per backward
            if grad.is_inference():
                # Made under inference_mode (an expanded one autograd hands on uncopied): no version
                # counter would see it changed in place before the flush.
                grad_outputs = tuple([g.clone() if g.is_inference() else g for g in grad_outputs])
                break
        self.grad_outputs = grad_outputs
        self.tag = tag
        self.task = -1  # the backward call (autograd graph task) that queued it, set on enqueue
        self.check_nan = False  # anomaly mode's NaN check was on in that backward, set on enqueue
        self.autocast: torch.dtype | None = None  # that backward's autocast dtype on the job's device, set on enqueue
        self.versions = self._versions()
        self.parked: ParkedTensors | None = None  # set when offloaded to host memory
        # The parameters' AccumulateGrad nodes, set in backward: a parameter refers to its node
        # weakly; the backward's graph kept it, and the hooks registered on it, alive in plain
        # autograd, and is freed before the flush hands the gradients over through it.
        self.accumulators: tuple[Any, ...] = ()
        # The parameters' device in the backward that made the job (None without a parameter):
        # a flush refuses the work once they are elsewhere (the model moved before the flush).
        self.home = _params_device(params)
        # Per parameter, its post-accumulate-grad hooks in that backward (see
        # flush.hooks_at_backward); None where none of the parameters had a user's hook.
        self.hooks_at_backward: tuple[tuple[tuple[int, Any], ...], ...] | None = None
        self.delivered = False  # set once a flush has handed its gradients over
        self.forked_into_shared_grad = False  # see WeightGradQueue._mark_work_into_shared_grads
        # (storage key, bytes) of each tensor it holds, as a capped queue counted them when it
        # entered: taken off as counted (a storage resized since has another key).
        self.counted: tuple[tuple[tuple[int, torch.device], int], ...] = ()

    def _versions(self) -> tuple[int, ...]:
        watched = (*self.saved, *self.grad_outputs, *self.params)
        return tuple([t._version for t in watched if t is not None])  # a list first: a generator costs more

    def drop_params(self, dropped: set[int]) -> bool:
        """Stop computing the gradients of the parameters whose ``id`` is in ``dropped``;
        whether the job still has a parameter to compute for."""
        params = self.params
        if not any(p is not None and id(p) in dropped for p in params):
            return True
        tensors = len(self.saved) + len(self.grad_outputs)  # the versions' order: see _versions
        present = [p for p in params if p is not None]
        kept_versions = [v for p, v in zip(present, self.versions[tensors:], strict=True) if id(p) not in dropped]
        self.params = tuple(None if p is None or id(p) in dropped else p for p in params)
        saved_versions = self.versions[: len(self.saved)]
        if self.kernel is finished_grads:  # one gradient per parameter: free the dropped ones'
            gone = [p is not None and id(p) in dropped for p in params]
            self.saved = tuple(NO_GRADIENT if drop else t for t, drop in zip(self.saved, gone, strict=True))
            saved_versions = tuple(
                NO_GRADIENT._version if drop else v for v, drop in zip(saved_versions, gone, strict=True)
            )
        self.versions = (*saved_versions, *self.versions[len(self.saved) : tensors], *kept_versions)
        return any(p is not None for p in self.params)

    def check_unmodified(self) -> None:
        if self._versions() != self.versions or (self.parked is not None and self.parked.changed()):
            raise RuntimeError(
                "twobp: a tensor that a queued weight-gradient job needs (a saved activation, an "
                "output gradient or the parameter itself) was modified in place after the forward or "
                "backward that saved it, before flush_weight_grads() (a module under the recompute "
                "rule keeps its parameters from its forward, where plain autograd may not have saved "
                "them; a parameter is modified by load_state_dict, reset_parameters(), "
                "registering a parametrization, a conversion under swap_module_params_on_conversion, or "
                "the forward of an nn.Embedding with max_norm whose weight a patched layer shares; an "
                "output gradient autograd also gave, uncopied, to a parameter's .grad is changed there: "
                "an expanded one (a reduction's) by the next backward's accumulation (flush after each "
                "backward there), or one of a micro-batch of one sample by a post-accumulate-grad hook "
                "in the same backward (a table added to the layer's output: write the output first, "
                "layer(x) + table). Flush before modifying it. This flush leaves the "
                "work queued (work got from queue.take() stays the caller's): to drop the step, "
                "optimizer.zero_grad() drops its parameters' queued work with their .grad "
                "(twobp.discard_weight_grads() drops only the queued work)."
            )

    def own_grad_outputs(self, held_elsewhere: set[int]) -> None:
        """Copy the output gradients whose storage (:func:`storage_id`) is in ``held_elsewhere``
        and unchanged since the backward that queued them: what holds it besides the queue may
        change it in place before the flush. (Autograd may hand a gradient uncopied to a
        parameter's ``.grad``, a position table added to a micro-batch of one sample, and the
        next backward accumulates into that ``.grad`` in place.) One changed already is left to
        the flush's refusal."""
        offset = len(self.saved)
        grad_outputs, versions = list(self.grad_outputs), list(self.versions)
        for index, grad in enumerate(grad_outputs):
            if storage_id(grad) in held_elsewhere and grad._version == versions[offset + index]:
                grad_outputs[index] = copy = grad.clone()
                versions[offset + index] = copy._version
        self.grad_outputs, self.versions = tuple(grad_outputs), tuple(versions)

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

    def params_given_grads(self) -> list[Tensor]:
        """The parameters this job gives a gradient (plain backward gave each a ``.grad``): all
        it computes for, but where its kernel may leave some None (:func:`leaves_some_grads_none`)
        only running it tells (and if that fails, all)."""
        present = [p for p in self.params if p is not None]
        if not getattr(self.kernel, _LEAVES_SOME_NONE, False):
            return present
        try:
            grads = self.kernel(*self.on_device(), self.needs)
        except Exception:
            return present
        return [p for p, g in zip(self.params, grads, strict=True) if p is not None and g is not None]

    @property
    def device(self) -> torch.device:
        """Where the kernel runs: its parameters' device."""
        device = _params_device(self.params)
        if device is None:
            raise ValueError("twobp: a weight-gradient job without a parameter has no device")
        return device

    @property
    def needs(self) -> tuple[bool, ...]:
        return tuple([p is not None for p in self.params])


def storage_of(tensor: Tensor) -> torch.UntypedStorage | None:
    """Its storage, for a plain strided tensor with no expanded dim; None for others (a wrapper
    subclass's storage is not its data; an expanded one, such as a loss's ``sum()`` hands on, is
    what the backward's caller holds, and a copy would be as large as the output)."""
    if type(tensor) is not Tensor or tensor.layout != torch.strided or 0 in tensor.stride():
        return None
    return tensor.untyped_storage()


def storage_id(tensor: Tensor) -> int | None:
    """:func:`storage_of`'s identity, as ``torch._C._storage_Use_Count`` takes it."""
    storage = storage_of(tensor)
    return None if storage is None else storage._cdata


def _params_device(params: tuple[Tensor | None, ...]) -> torch.device | None:
    """The first present parameter's device (None if there is none)."""
    for param in params:  # a loop: a generator costs a microsecond per backward
        if param is not None:
            return param.device
    return None


def finished_grads(
    saved: Sequence[Tensor], grad_outputs: Sequence[Tensor], needs: Sequence[bool]
) -> list[Tensor | None]:
    """The kernel of a job of gradients already computed (BatchNorm's, made in backward; those an
    early flush holds back): ``saved`` holds one per parameter (a placeholder where none). (The
    flush never adds in place into a tensor a kernel returns, so handing them out is safe.)"""
    return [grad if need else None for grad, need in zip(saved, needs, strict=True)]


_LEAVES_SOME_NONE = "twobp_leaves_some_grads_none"


def leaves_some_grads_none(kernel: functools.partial[Any]) -> None:
    """Mark ``kernel`` as one that may give None for a parameter it is asked for (a replayed
    forward that a reached output does not use): dropping its job without running it cannot tell
    which parameters plain backward gave a ``.grad``."""
    setattr(kernel, _LEAVES_SOME_NONE, True)


#: What a job of finished gradients holds for a parameter without one (none deferred, or dropped).
NO_GRADIENT = torch.empty(0)
