"""What reads ``.grad`` for a step must run after the flush: ``optimizer.step()``, gradient
clipping and ``GradScaler.unscale_``, a hand-written gradient average (``torch.distributed.all_reduce``
of a ``.grad``). Run before it, they would see the partial gradients of the parameters whose
work is still queued, and the flush would then add unscaled, unclipped, unaveraged sums on top:
a wrong step that nothing reports. So each is refused while work for its parameters is queued.

``zero_grad`` (the optimizer's or a module's) between backward and flush drops the queued work
of the parameters it zeroes, as plain ``zero_grad`` drops the gradients that backward computed:
else a micro-batch skipped that way (a non-finite loss) would reach the next step's ``.grad``
at its flush. (FSDP2's sharded parameters are refused instead, see ``stand_in_finders``.)

PyTorch has a hook for the step only (a global step pre-hook; with a closure the check goes
after each call of the closure, where the backward ran). ``zero_grad`` (on ``Optimizer`` and
``nn.Module``), clipping and ``unscale_`` are wrapped once, when the first model is patched:
``GradScaler.unscale_`` on its class; ``clip_grad_norm_`` where ``torch.nn.utils`` exposes it
and through the helper it calls to scale the gradients
(``torch.nn.utils.clip_grad._clip_grads_with_norm_``, public as ``clip_grads_with_norm_``),
which catches ``clip_grad_norm_`` however the caller imported it; ``clip_grad_value_`` where
``torch.nn.utils`` exposes it. A ``clip_grads_with_norm_`` or ``clip_grad_value_`` imported by
name before the first patch keeps the unchecked function.

Work that another thread's flush has taken out of a queue (:mod:`.queue`) is waited for, as
it reaches ``.grad`` soon; by the clipping helper, which runs after the norm was read, it is
refused instead.

PyTorch's pipeline schedules (``torch.distributed.pipelining``) end a step by dividing each
stage's ``.grad`` by the number of micro-batches (``scale_grads``, inside
``perform_reduce_grad``). A patched stage built without this package's ``dw_builder`` still has
work queued then (its schedule never flushes it), so the division would miss it and the flush
after the step would add it unscaled: n times too large. There the queued work of the stage's
parameters is flushed first (with one warning naming ``dw_builder``, which runs it inside the
schedule).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.optim import optimizer as optimizer_module

from .flush import accumulated_dtype, forget_deliveries, has_user_hooks, summed_over_backward_calls, undelivered
from .queue import WeightGradQueue, current_queue, dropped_without_grad, queues_with_work
from .warn_once import warn_once

__all__ = [
    "install_grad_guards",
    "stand_in_finders",
    "step_checks",
    "read_checks",
    "refuse_if_queued",
    "has_queued_work",
]

#: ``finder(params) -> tensors`` that queued work names in place of some of ``params``
#: (twobp_autograd.fsdp: the unsharded stand-ins of FSDP2-sharded parameters).
stand_in_finders: list[Callable[[list[torch.Tensor]], list[torch.Tensor]]] = []

#: ``check(optimizer)``, run wherever an optimizer step is checked for queued work (before the
#: step, or after each call of its closure), raising to refuse it
#: (twobp_autograd.data_parallel: a synchroniser's gradients not yet averaged).
step_checks: list[Callable[[torch.optim.Optimizer], None]] = []

#: ``check(parameters, what)``, run before gradient clipping and a scaler's ``unscale_`` or
#: ``step`` read the parameters' gradients, raising to refuse it (twobp_autograd.data_parallel:
#: a rank's own gradients, not yet averaged, clipped by its own norm).
read_checks: list[Callable[[list[Any], str], None]] = []

_installed = False


def install_grad_guards() -> None:
    """Install the step hook and the clipping and ``unscale_`` wrappers (once per process)."""
    global _installed
    if _installed:
        return
    handle = optimizer_module.register_optimizer_step_pre_hook(_refuse_step_with_queued_work)
    # First of the global step pre-hooks: one registered before the first patch (a library's
    # scaling of .grad) would change the gradients of a step this one then refuses.
    hooks = optimizer_module._global_optimizer_pre_hooks
    others = {key: hook for key, hook in hooks.items() if key != handle.id}
    ours = hooks[handle.id]
    hooks.clear()  # reordered in place: the handles of the others hold this dict
    hooks[handle.id] = ours
    hooks.update(others)
    _guard_zero_grad()
    _guard_clipping()
    _guard_unscale()
    _guard_gradient_reductions()
    _flush_before_pipeline_grad_scaling()
    _checkpoint_optimizer_state_as_plain()
    _installed = True


def refuse_if_queued(params: Iterable[Any], what: str, advice: str = "", *, wait: bool = True) -> None:
    """Raise if any queue holds work for one of ``params`` (tensors; anything else is ignored),
    or, from a hook inside a flush, that flush has yet to hand one of them its gradient. Work
    another thread's flush is running counts once it has landed (``wait``), or at once
    (``wait=False``, for a caller that has read the gradients already)."""
    params = list(params)
    _refuse_mid_flush(params, what)
    holding = _holding_work_for(params, wait=wait)
    if holding:
        raise RuntimeError(
            f"twobp: {what} over parameters whose weight gradients are still queued (their .grad "
            "is partial until the flush); call twobp.flush_weight_grads() (or queue.flush()) after "
            f"backward and before it{advice}{_other_queues_hint(holding)}. Under a GradientSynchroniser, its "
            "synchronise(queue) flushes (pass the queue the forwards used, if not the default)."
        )


def _other_queues_hint(holding: list[WeightGradQueue]) -> str:
    others = sum(q is not current_queue() for q in holding)
    if not others:
        return ""
    return (
        f" ({others} queue(s) other than the current one, which forwards ran under with "
        "twobp.use_queue, hold some of it: flush each, queue.flush(), or drop it, queue.clear(); "
        "twobp.flush_weight_grads() and twobp.discard_weight_grads() act on the current one only)"
    )


def _refuse_mid_flush(params: list[Any], what: str) -> None:
    """From a hook a flush's hand-over runs (a post-accumulate-grad hook), refuse to read or
    change gradients the flush has yet to hand over."""
    if torch._C._current_graph_task_id() < 0:
        return
    waiting = undelivered([p for p in params if isinstance(p, torch.Tensor)])
    if waiting:
        raise RuntimeError(
            f"twobp: {what} in a post-accumulate-grad hook while the flush has yet to hand {len(waiting)} "
            f"of its parameters their gradients (shapes {[tuple(p.shape) for p in waiting][:4]}): a flush "
            "delivers in its own order, not plain backward's, so a hook that acts on many parameters "
            "cannot count on being called last. Act on each parameter in its own hook (an optimizer "
            "per parameter), or after twobp.flush_weight_grads() returns."
        )


def has_queued_work(param: torch.Tensor | Iterable[torch.Tensor]) -> bool:
    """Whether a queue holds weight-gradient work for ``param`` (its gradient is yet to come):
    what a post-accumulate-grad hook asks to tell its call during backward, before the deferred
    gradient exists, from its call at the flush. Several tensors (``model.parameters()``): for
    any of them."""
    several = isinstance(param, Iterable) and not isinstance(param, torch.Tensor)
    params = list(param) if several else [param]
    strays = [type(p).__name__ for p in params if not isinstance(p, torch.Tensor)]
    if strays:
        raise TypeError(f"twobp: has_queued_work takes a tensor or tensors (parameters), got {strays[:3]}")
    return bool(_holding_work_for(params))


def _holding_work_for(params: Iterable[Any], *, wait: bool = True) -> list[WeightGradQueue]:
    """The queues holding work for one of ``params`` or for their stand-ins (see
    :meth:`WeightGradQueue.has_work_for` for ``wait``)."""
    queues, tensors = _queued(params)
    if not queues:
        return []
    wanted = tensors + _stand_ins(tensors)
    return [q for q in queues if q.has_work_for(wanted, wait=wait)]


def _queued(params: Iterable[Any]) -> tuple[list[WeightGradQueue], list[torch.Tensor]]:
    """The queues holding work, and the tensors of ``params``, which are read only where some
    queue holds work (a guard runs on every step and every ``zero_grad``)."""
    queues = queues_with_work()
    return (queues, [p for p in params if isinstance(p, torch.Tensor)]) if queues else ([], [])


def _stand_ins(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t for finds in stand_in_finders for t in finds(params)]


def _discard_queued_work(params: Iterable[Any], what: str, set_to_none: bool) -> None:
    """Drop the work queued for ``params``; refused where it is queued for their stand-ins.
    With ``set_to_none=False`` a parameter whose work is dropped while its ``.grad`` is None
    gets a zero ``.grad``, as plain ``zero_grad`` zeroes the gradient backward gave it (an
    optimizer steps a zero gradient, momentum and weight decay included, but skips a None)."""
    params = list(params)
    _refuse_mid_flush(params, what)
    queues, tensors = _queued(params)
    if _ran_the_hooks_plain_ran(queues, tensors):
        queues, tensors = _queued(params)
    forget_deliveries(params)
    if dropped_without_grad:
        for param in params:
            if isinstance(param, torch.Tensor) and dropped_without_grad.pop(id(param), None) is param:
                _zeros_as_plain_zero_grad_leaves(param, set_to_none)
    if not queues:
        return
    stand_ins = _stand_ins(tensors)
    holding = [q for q in queues if q.has_work_for(stand_ins)]
    if holding:
        raise RuntimeError(
            f"twobp: {what} over FSDP2-sharded parameters whose weight gradients are still queued: "
            "call twobp.flush_weight_grads() before it, or twobp.discard_weight_grads() to drop "
            f"that work{_other_queues_hint(holding)}."
        )
    for queue in queues:
        for param in queue.discard_work_for(tensors, given_grads=not set_to_none):
            _zeros_as_plain_zero_grad_leaves(param, set_to_none)


def _ran_the_hooks_plain_ran(queues: list[WeightGradQueue], tensors: list[torch.Tensor]) -> bool:
    """Parameters with a post-accumulate-grad hook of the user's (optimizer-in-backward) and
    queued work: plain autograd ran the hook in backward (the optimizer stepped), which dropping
    the work would skip. The queues holding it are flushed first (every gradient in ``.grad``,
    every hook run, as after plain's backward); the zero_grad then drops what plain's drops.
    Whether any was flushed."""
    hooked = [p for p in tensors if has_user_hooks(p)] if queues else []
    flushing = [queue for queue in queues if hooked and queue.has_work_for(hooked)]
    for queue in flushing:
        queue.flush()
    return bool(flushing)


def _zeros_as_plain_zero_grad_leaves(param: torch.Tensor, set_to_none: bool) -> None:
    """A parameter whose dropped work plain backward would have made a ``.grad``: zeros there
    after ``zero_grad(set_to_none=False)``, laid out as AccumulateGrad would (its strides), in
    the dtype it would have made (``grad_dtype``: an fp32 gradient for a bf16 parameter)."""
    if not set_to_none and param.grad is None:
        param.grad = torch.zeros_like(param, dtype=accumulated_dtype(param), memory_format=torch.preserve_format)


def _guard_zero_grad() -> None:
    for owner, params_of in ((torch.optim.Optimizer, _optimizer_params), (torch.nn.Module, _module_params)):
        owner.zero_grad = _discarding_queued_work(owner.zero_grad, params_of)  # type: ignore[method-assign]


def _module_params(module: torch.nn.Module) -> Iterator[Any]:
    return module.parameters()


def _discarding_queued_work(
    zero_grad: Callable[..., Any], params_of: Callable[[Any], Iterable[Any]]
) -> Callable[..., Any]:
    @functools.wraps(zero_grad)
    def discarding(self: Any, *args: Any, **kwargs: Any) -> Any:
        set_to_none = kwargs.get("set_to_none", args[0] if args else True)  # both owners' only argument
        _discard_queued_work(params_of(self), f"{type(self).__name__}.zero_grad()", bool(set_to_none))
        return zero_grad(self, *args, **kwargs)

    return discarding


def _optimizer_params(optimizer: torch.optim.Optimizer) -> Iterator[Any]:
    return (p for group in optimizer.param_groups for p in group["params"])


def _refuse_step_with_queued_work(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
    """Optimizer step pre-hook. With a closure (LBFGS, or any ``step(closure)``) the backward
    runs inside the step, so the check goes after each call of the closure instead. (Work
    queued before such a step is no misuse: PyTorch Lightning runs the accumulated micro-batches'
    backward outside the step, and the last one's, and the flush, in the closure.)"""
    # ``args`` are step's own: (optimizer, closure?, ...).
    if callable(kwargs.get("closure")):
        return args, {**kwargs, "closure": _checked_closure(optimizer, kwargs["closure"])}
    if len(args) > 1 and callable(args[1]):  # not a step(lr_scale) / step(loss_value) argument
        return (args[0], _checked_closure(optimizer, args[1]), *args[2:]), kwargs
    _refuse_step(optimizer)
    forget_deliveries(_optimizer_params(optimizer))
    return None


def _refuse_step(optimizer: torch.optim.Optimizer) -> None:
    in_backward = torch._C._current_graph_task_id() >= 0  # from a hook: of a backward, or of a flush
    if in_backward and summed_over_backward_calls(_optimizer_params(optimizer)):
        raise RuntimeError(
            "twobp: optimizer.step() in a post-accumulate-grad hook (optimizer-in-backward) at a "
            "flush that sums the weight gradients of several backward calls: plain autograd steps "
            "after each backward, and runs the next forward on the stepped weights, which deferred "
            "weight gradients cannot reproduce. With optimizer-in-backward, flush after every "
            "backward (twobp.flush_weight_grads() right after loss.backward()). (A reentrant "
            "activation checkpoint runs a backward call of its own: one that reaches a parameter "
            "also used outside it, or in another checkpoint, counts as a second call; use "
            "checkpoint(..., use_reentrant=False).)"
        )
    if in_backward:
        advice = (
            " (a step in a post-accumulate-grad hook, the optimizer-in-backward idiom: return from "
            "the hook while twobp.has_queued_work(p): during backward it runs before the deferred "
            "gradient exists, with .grad as it was; it runs again at the flush, with the gradient)"
        )
    else:
        advice = " (with step(closure): inside the closure, after its backward)"
    refuse_if_queued(_optimizer_params(optimizer), "optimizer.step()", advice)
    for check in step_checks:
        check(optimizer)


def _checked_closure(optimizer: torch.optim.Optimizer, closure: Any) -> Any:
    @functools.wraps(closure)
    def checked() -> Any:
        loss = closure()
        _refuse_step(optimizer)
        forget_deliveries(_optimizer_params(optimizer))
        return loss

    return checked


def _as_list(parameters: Any) -> list[Any]:
    """Clipping's ``parameters`` argument (a tensor or an iterable), as a list. A generator is
    read here, so the wrapped function is handed the list instead."""
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _like(original: Any, parameters: list[Any]) -> Any:
    """The list handed on as the caller gave it: a generator stays one (``clip_grad_norm_``
    warns about an empty generator)."""
    return (p for p in parameters) if isinstance(original, types.GeneratorType) else parameters


def _guard_clipping() -> None:
    from torch.nn import utils
    from torch.nn.utils import clip_grad

    # The norm is taken before the helper runs: there another thread's flush that has not
    # landed yet is refused, not waited for. The public function waits before reading.
    scale = _refusing_while_queued(clip_grad._clip_grads_with_norm_, "clip_grad_norm_ / clip_grads_with_norm_", False)
    clip_norm = _refusing_while_queued(clip_grad.clip_grad_norm_, "clip_grad_norm_")
    clamp = _refusing_while_queued(clip_grad.clip_grad_value_, "clip_grad_value_")
    clip_grad._clip_grads_with_norm_ = utils.clip_grads_with_norm_ = scale
    clip_grad.clip_grad_norm_ = utils.clip_grad_norm_ = clip_norm
    clip_grad.clip_grad_value_ = utils.clip_grad_value_ = clamp


def _refusing_while_queued(clip: Callable[..., Any], name: str, wait: bool = True) -> Callable[..., Any]:
    """``clip(parameters, ...)``, first refused while work for those parameters is queued."""

    @functools.wraps(clip)
    def checked(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        listed = _as_list(parameters)
        what = f"gradient clipping ({name})"
        refuse_if_queued(listed, what, wait=wait)
        for check in read_checks:
            check(listed, what)
        return clip(_like(parameters, listed), *args, **kwargs)

    return checked


#: The guarded reductions, and where each finds the tensors it reduces among its arguments
#: (position, keyword). ``reduce_scatter_tensor`` and ``_reduce_scatter_base`` call
#: ``reduce_scatter_single`` (as a global of their module, which the guard replaces).
_REDUCTIONS: dict[str, tuple[int, str]] = {
    "all_reduce": (0, "tensor"),
    "reduce": (0, "tensor"),
    "all_reduce_coalesced": (0, "tensors"),
    "reduce_scatter_single": (1, "input"),
    "reduce_scatter": (1, "input_list"),
    # Not a reduction, but as wrong: a rank's partial gradient sent (or overwritten) before the
    # flush, which then adds each rank's own weight gradients on top.
    "broadcast": (0, "tensor"),
}


def _guard_gradient_reductions() -> None:
    """``torch.distributed``'s reductions of a ``.grad`` (a data-parallel average written by hand,
    as in PyTorch's "Writing Distributed Applications", or a ZeRO-style reduce-scatter of a flat
    gradient buffer), refused while work for that parameter is queued: run before the flush, they
    reduce partial gradients, and the flush then adds each rank's own weight gradients, unreduced.
    Dynamo keeps tracing a guarded reduction as the original (a functional collective; no queue is
    seen from a graph)."""
    if not torch.distributed.is_available():
        return
    from torch.distributed import distributed_c10d

    try:
        from torch.distributed._functional_collectives import traceable_collective_remaps
    except ImportError:  # pragma: no cover - a build without it: nothing to keep traceable
        traceable_collective_remaps = {}
    for name, where in _REDUCTIONS.items():
        original = getattr(distributed_c10d, name, None)
        if original is None:  # pragma: no cover - a release without it
            continue
        guarded = _refusing_reductions_of_queued_grads(original, name, where)
        setattr(distributed_c10d, name, guarded)
        if getattr(torch.distributed, name, None) is original:
            setattr(torch.distributed, name, guarded)
        if original in traceable_collective_remaps:
            traceable_collective_remaps[guarded] = traceable_collective_remaps[original]


def _refusing_reductions_of_queued_grads(
    reduction: Callable[..., Any], name: str, where: tuple[int, str]
) -> Callable[..., Any]:
    position, keyword = where

    @functools.wraps(reduction)
    def checked(*args: Any, **kwargs: Any) -> Any:
        if queues_with_work():
            reduced = args[position] if len(args) > position else kwargs.get(keyword)
            # Gradients are floating point: the pipeline's own integer headers pass at once.
            reducing = [
                param
                for tensor in (reduced if isinstance(reduced, (list, tuple)) else (reduced,))
                if isinstance(tensor, torch.Tensor) and tensor.is_floating_point()
                for param in _queued_params_whose_grad_overlaps(tensor)
            ]
            if reducing:
                refuse_if_queued(
                    reducing,
                    f"torch.distributed.{name} of a .grad",
                    " (or average the gradients with twobp_autograd.data_parallel.GradientSynchroniser, "
                    "which flushes first)",
                )
        return reduction(*args, **kwargs)

    return checked


def _queued_params_whose_grad_overlaps(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The parameters with queued work whose ``.grad`` shares bytes with ``tensor`` (is it, a
    view of it, or lies in the part of a flat buffer it covers; another slice of that buffer,
    a gradient already final, is no partial one)."""
    if tensor.layout != torch.strided or tensor.numel() == 0 or not _has_memory(tensor):
        return []
    start = tensor.data_ptr()
    end = _end(tensor, start)
    found = []
    for queue in queues_with_work():
        for param in queue.params_with_work():
            grad = param.grad
            if type(grad) is torch.Tensor and grad.layout == torch.strided:
                first = grad.data_ptr()
                # Most gradients are contiguous: nbytes from the first (no frame per gradient).
                last = first + grad.nbytes if grad.is_contiguous() else _end(grad, first)
                if first < end and start < last:
                    found.append(param)
    return found


def _has_memory(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` has memory of its own to compare: a plain tensor or an ``nn.Parameter``
    (a flat gradient buffer kept as one), not a DTensor or a fake tensor."""
    if type(tensor) is torch.Tensor:
        return True
    try:
        return bool(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return False


def _end(tensor: torch.Tensor, start: int) -> int:
    """The address past the last byte ``tensor`` reaches from ``start``, gaps its strides leave
    included (a strided slice of a buffer spans more than its nbytes)."""
    reach = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    return start + tensor.element_size() * (1 + reach)


def _guard_unscale() -> None:
    """``GradScaler.unscale_`` and ``step``, and every subclass's own (FSDP's ``ShardedGradScaler``
    overrides ``unscale_`` without calling it, and its ``step`` calls its own): those defined
    already, and those defined later (through ``__init_subclass__``, so that guarding imports
    nothing)."""
    from torch.amp import GradScaler

    def guard(owner: type) -> None:
        # ``step`` too: for an optimizer that unscales in its own step (fused Adam, AdamW, SGD:
        # ``_step_supports_amp_scaling``) it calls no ``unscale_``, and it sets the optimizer's
        # ``grad_scale`` before the step, which the step guard's refusal would leave set: the
        # retried step would unscale twice.
        for name in ("unscale_", "step"):
            if name in owner.__dict__:
                setattr(owner, name, _refusing_queued_work(owner.__dict__[name], f"{owner.__name__}.{name}"))

    pending = [GradScaler]
    while pending:
        owner = pending.pop()
        guard(owner)
        pending.extend(owner.__subclasses__())

    def guard_subclass(cls: type[GradScaler], **kwargs: Any) -> None:
        super(GradScaler, cls).__init_subclass__(**kwargs)
        guard(cls)

    GradScaler.__init_subclass__ = classmethod(guard_subclass)  # type: ignore[assignment]


def _refusing_queued_work(original: Callable[..., Any], what: str) -> Callable[..., Any]:
    """A scaler's ``unscale_`` or ``step``, refused while the optimizer's work is queued, before
    it reads or changes anything."""

    @functools.wraps(original)
    def refusing(self: Any, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if self.is_enabled():
            params = list(_optimizer_params(optimizer))
            refuse_if_queued(params, what)
            for check in read_checks:
                check(params, what)
        return original(self, optimizer, *args, **kwargs)

    return refusing


def _flush_before_pipeline_grad_scaling() -> None:
    if not torch.distributed.is_available():
        return
    from torch.distributed.pipelining import PipelineStage

    # On the class that defines each (a private base today), found through the public class, so
    # that a rename in PyTorch leaves patch() working and fails tests/pipeline/test_adapter.py's
    # schedules without dw_builder instead. The first calls the second, after FSDP2's reduction.
    # (FSDP2-sharded stages without dw_builder are not covered: PyTorch's zero-bubble schedules
    # give them other gradients than one process even unpatched, measured with
    # tests/test_fsdp_pipeline.py's model.)
    for name in ("perform_reduce_grad", "scale_grads"):
        owner = next((c for c in PipelineStage.__mro__ if name in c.__dict__), None)
        if owner is not None:
            setattr(owner, name, _flushing_first(owner.__dict__[name]))


def _checkpoint_optimizer_state_as_plain() -> None:
    """``torch.distributed.checkpoint.state_dict`` builds a fresh optimizer's state (to save or
    load it) by a step on zero gradients at lr 0, unless some parameter's ``.grad`` exists, as
    it does between a plain backward and its step. Between a backward and its flush that step
    would set zeros as ``.grad``, be refused, and leave lr at 0: the queues holding work for the
    optimizer's parameters are flushed first, so its check sees the gradients plain autograd
    would have made (None where a kernel makes none). Its check is a private helper today,
    wrapped where that module looks it up; ``tests/test_grad_guard.py`` fails if it goes."""
    if not torch.distributed.is_available():
        return
    from torch.distributed.checkpoint import state_dict

    name = "_init_optim_state"
    init = getattr(state_dict, name, None)
    if init is None:
        return

    def init_after_the_flush(optimizer: torch.optim.Optimizer) -> None:
        if not optimizer.state:
            for queue in _holding_work_for(_optimizer_params(optimizer)):
                queue.flush()
        init(optimizer)

    functools.update_wrapper(init_after_the_flush, init)
    setattr(state_dict, name, init_after_the_flush)


def _flushing_first(scale: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(scale)
    def flushed_first(stage: Any, *args: Any, **kwargs: Any) -> Any:
        pending = _holding_work_for(stage.submod.parameters())
        if pending:
            has_builder = getattr(stage, "dw_builder", None) is not None
            advice = (
                "They were queued outside the stage module's forward (a reentrant checkpoint re-running "
                "its forward in backward, or a patched module called from loss_fn): use "
                "torch.utils.checkpoint with use_reentrant=False to run them in the schedule's W steps."
                if has_builder
                else "Build the stage with PipelineStage(..., dw_builder=twobp_autograd.pipeline.dw_builder("
                "module)) to run them inside the schedule, in its W steps."
            )
            warn_once(
                ("pipeline stage work left queued", has_builder),
                "twobp: a pipeline schedule ended its step with this stage's weight gradients still "
                f"queued; they are flushed before it scales the gradients. {advice}",
                stacklevel=3,
            )
            for queue in pending:
                queue.flush()
        return scale(stage, *args, **kwargs)

    return flushed_first
