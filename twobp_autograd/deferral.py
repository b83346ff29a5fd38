"""The split itself: input gradients now (backward-p1), weight gradients queued (backward-p2).

An op under ``ops/`` computes its output with its parameters *detached*, so PyTorch's own
derivative of the very same functional call produces the input gradient and nothing else
(every option, autocast, channels_last and double backward behave as in plain PyTorch).
:func:`defer_weight_grads` then re-parents that output onto a small autograd node, the tap,
which sits between the op and its consumers: in backward it passes the output gradient
through unchanged and queues ``(saved tensors, output gradient)`` for the op's weight kernel.

The tap also keeps autograd's scoping: it asks the engine whether this backward will reach
each parameter, so ``backward(inputs=...)`` / ``autograd.grad`` that do not ask for a weight
queue nothing, and ``autograd.grad`` that does ask gets the weight gradient computed at once.
``create_graph=True`` is refused: the input gradient was built from detached weights, so any
second-order term through a weight would silently be missing.

An op whose own backward already produces its weight gradients on the way to the input gradient
(BatchNorm's reductions) skips the tap: its custom Function takes the parameters as inputs and
routes the finished gradients with :class:`ParamDeferral`, under the same rules.

The tap changes no value, so it hides from autograd's other machinery: it restores the version
counters that re-parenting bumps (selective activation checkpointing caches op outputs and
refuses "mutated" ones), and in forward-mode AD it is the identity on tangents. A tangent's own
graph lacks the detached weights, so a backward through it to them is refused (:func:`guard_tangent`).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, Literal, NamedTuple, overload

import torch
from torch import Tensor
from torch.autograd import forward_ad

from . import fsdp_hooks
from .compile_frames import OWN_WRAPPED
from .flush import hooks_at_backward, may_change_in_backward
from .job import NO_GRADIENT, WeightGradJob, WeightGradKernel, finished_grads, leaves_some_grads_none
from .queue import WeightGradQueue, current_queue
from .warn_once import warn_once

__all__ = [
    "ParamDeferral",
    "configured_kernel",
    "single_node_applies",
    "defer_weight_grads",
    "detached",
    "first_call_checked",
    "first_calls_open",
    "first_call_unchecked",
    "inside_first_call_check",
    "guard_tangent",
    "kernel_group",
    "param_inputs",
    "param_from_input",
    "untappable_view",
    "sees_post_hooks",
    "NO_FULL_GRAPH",
    "INFERENCE_TENSORS_SAVED",
]


@overload
def detached(param: Tensor) -> Tensor: ...
@overload
def detached(param: None) -> None: ...
@overload
def detached(param: Tensor | None) -> Tensor | None: ...
def detached(param: Tensor | None) -> Tensor | None:
    """What an op computes with: a parameter (a leaf) detached, so its gradient is deferred;
    anything else as it is (a weight rebuilt from parametrizations or ``weight_norm`` at each
    call keeps its graph, and autograd differentiates through it at once)."""
    return param.detach() if param is not None and param.is_leaf else param


#: Why Dynamo's graph ends at a patched layer (``fullgraph=True`` fails with this).
NO_FULL_GRAPH = (
    "twobp: torch.compile cannot trace a patched layer's deferred backward into one graph: "
    "fullgraph=True is not supported over a patched model (each patched layer ends a graph). "
    "Compile without fullgraph, or compile the unpatched model (twobp.unpatch)."
)

#: What one backward does with a parameter's gradient: queue it, return it, or leave it alone.
Decision = Literal["defer", "now", "skip"]


class ParamDeferral(NamedTuple):
    """Where the parameter gradients of one call go, fixed at forward time: the leaf parameters
    (None for the others, whose gradient autograd takes at once), and the queue current then
    with its tag (on CUDA the backward runs on autograd's threads, not the caller's).

    Used in the backward of a custom Function whose *last* tensor inputs are the parameters
    (:func:`param_inputs`): :meth:`decide` asks the engine about each, and
    :meth:`defer_finished` routes gradients that are already computed."""

    params: tuple[Tensor | None, ...]
    queue: WeightGradQueue
    tag: Hashable

    @classmethod
    def at_forward(cls, params: Sequence[Tensor | None]) -> ParamDeferral:
        queue = current_queue()
        leaves = tuple([p if p is not None and p.is_leaf else None for p in params])
        return tuple.__new__(cls, (leaves, queue, queue._tag))  # NamedTuple's own __new__ is a Python frame

    def decide(self, ctx: Any) -> list[Decision]:
        """Refuse ``create_graph=True``; then per parameter 'defer' (this backward accumulates
        into it), 'now' (``autograd.grad`` asks for it, it is no leaf, or a tensor hook waits for
        each backward's gradient of it: its gradient flows on through autograd) or 'skip' (not
        wanted, frozen, even since the forward, or not reached by this backward)."""
        return self._decisions(ctx, self._param_nodes(ctx))

    def _param_nodes(self, ctx: Any) -> list[Any]:
        """The nodes the parameter inputs' edges lead to (a leaf's AccumulateGrad), after
        refusing ``create_graph=True``. (``next_functions`` builds a new tuple per read: read once.)"""
        _refuse_create_graph()
        edges = getattr(ctx, "next_functions", None)
        if edges is None:  # Dynamo speculating this backward (a Function applied outside a patched call)
            raise RuntimeError(NO_FULL_GRAPH)
        return [node for node, _ in edges[len(edges) - len(self.params) :]]

    def _decisions(self, ctx: Any, nodes: Sequence[Any]) -> list[Decision]:
        needed = ctx.needs_input_grad[len(ctx.needs_input_grad) - len(self.params) :]
        # A leaf frozen since the forward gets nothing, as autograd's accumulator skips a
        # variable that no longer requires grad when backward reaches it.
        decisions: list[Decision] = [
            "skip" if not need or (param is not None and not param.requires_grad)
            else "now" if param is None
            else _decide_param(param, node)
            for param, node, need in zip(self.params, nodes, needed, strict=True)
        ]
        if "defer" in decisions and getattr(ctx, _POST_HOOKED, False):
            _warn_post_hooked_once()
            return ["now" if d == "defer" else d for d in decisions]
        if "defer" in decisions and (_traced() or torch.is_inference_mode_enabled() or _reduces_unused(self.params)):
            # Dynamo traces this backward (compiled autograd, or a compiled function that calls
            # backward): the queue's bookkeeping (version counters, None for a parameter's
            # gradient that compiled autograd then adds) does not survive tracing. A backward run
            # under inference_mode makes inference tensors, which have no version counter to check.
            # An FSDP2 group that reduces its unused parameters does so on every rank in backward.
            return ["now" if d == "defer" else d for d in decisions]
        return decisions

    def defer_finished(
        self, ctx: Any, decisions: Sequence[Decision], grads: Sequence[Tensor | None]
    ) -> list[Tensor | None]:
        """Queue the 'defer' gradients (already computed) as one job whose kernel hands them
        back at the flush, summed there per micro-batch like any job; return what autograd
        gets now: the 'now' gradients, None for the rest."""
        deferring = [d == "defer" and g is not None for g, d in zip(grads, decisions, strict=True)]
        if any(deferring):
            self._enqueue(
                ctx,
                self._param_nodes(ctx),
                WeightGradJob(
                    kernel=finished_grads,
                    group=finished_grads,
                    concatenate=False,
                    params=tuple(p if defer else None for p, defer in zip(self.params, deferring, strict=True)),
                    # One per parameter, in place: zero_grad may drop any of them (drop_params).
                    saved=tuple(
                        g.detach() if defer else NO_GRADIENT  # type: ignore[union-attr]
                        for g, defer in zip(grads, deferring, strict=True)
                    ),
                    grad_outputs=(),
                    tag=self.tag,
                ),
            )
        return [g if d == "now" else None for g, d in zip(grads, decisions, strict=True)]

    def _returns_now(self, nodes: Sequence[Any], decisions: Sequence[Decision]) -> bool:
        """Whether a 'now' gradient goes back to a caller (``autograd.grad`` captures the leaf, or
        a weight that is no leaf passes it on), not only into ``.grad`` past a hook (a hooked
        parameter, a post-hooked node)."""
        return any(
            d == "now" and (p is None or _decide(node) == "now")
            for p, node, d in zip(self.params, nodes, decisions, strict=True)
        )

    def _enqueue(self, ctx: Any, nodes: Sequence[Any], job: WeightGradJob) -> None:
        # The parameters' accumulators, from the node's own edges to them (see WeightGradJob).
        job.accumulators = tuple([node for node, p in zip(nodes, job.params, strict=True) if p is not None])
        for param in job.params:  # inline: this runs for every patched call
            if param is not None and param._post_accumulate_grad_hooks:
                job.hooks_at_backward = hooks_at_backward(job.params)
                break
        self.queue.enqueue(job)
        if job.check_nan:  # anomaly mode's NaN check may stop the node that computes the input gradient
            ctx.twobp_nan_checked = (self.queue, job)

    def route(
        self,
        ctx: Any,
        kernel: WeightGradKernel,
        group: Hashable,
        concatenate: bool | None,
        saved: Sequence[Tensor],
        grad_outputs: Sequence[Tensor],
    ) -> list[Tensor | None]:
        """In the backward of a Function whose last inputs are the parameters: queue
        ``kernel``'s work for the 'defer' parameters (one job), run it now for the 'now' ones
        and return what autograd gets: their gradients, None for the rest."""
        nodes = self._param_nodes(ctx)
        decisions = self._decisions(ctx, nodes)
        if "now" in decisions and _carries_tangents(ctx, grad_outputs):
            if self._returns_now(nodes, decisions):
                raise RuntimeError(
                    "twobp: forward-over-reverse AD (autograd.grad of a patched module's weights on "
                    "tensors with forward-mode tangents) is not supported: the weight gradient's "
                    "tangent would miss the terms through the saved activations. Take the weight "
                    "gradients with backward() and flush (their tangents are dropped there, as autograd "
                    "drops them in .grad), ask autograd.grad for input gradients only, or "
                    "twobp.unpatch(model) for this computation."
                )
            # Bound for .grad, where autograd drops the tangent; but a hook on the way sees it.
            raise RuntimeError(
                "twobp: a backward inside a forward-mode dual level reaches a weight with a tensor "
                "hook (register_hook) or a hook on a patched output's node: the hook would be handed "
                "the weight gradient's tangent, which misses the terms through the saved activations. "
                "Use register_post_accumulate_grad_hook (it sees .grad, which holds no tangent), run "
                "the backward outside the dual level, or twobp.unpatch(model) for this computation."
            )
        param_grads: list[Tensor | None] = [None] * len(decisions)
        if "now" in decisions:
            needs = [d == "now" for d in decisions]
            grads = kernel(saved, grad_outputs, needs)
            param_grads = [g if need else None for g, need in zip(grads, needs, strict=True)]
        if "defer" in decisions:
            self._enqueue(
                ctx,
                nodes,
                WeightGradJob(  # positional: keywords cost a quarter of a microsecond per backward
                    kernel,
                    group,
                    concatenate,
                    tuple([p if d == "defer" else None for p, d in zip(self.params, decisions, strict=True)]),
                    tuple([_kept_for_the_flush(t, self.params) for t in saved]),
                    tuple([g.detach() for g in grad_outputs]),
                    self.tag,
                ),
            )
        return param_grads


def _kept_for_the_flush(saved: Tensor, params: tuple[Tensor | None, ...]) -> Tensor:
    """A saved tensor as a job keeps it: detached; copied where it is (a view of) a parameter,
    other than the job's own, that will not keep its values until the flush: one with
    post-accumulate-grad hooks that may change it (not only read ``.grad``), which gets its
    gradient later in this backward and an optimizer-in-backward hook steps in place then; or
    one in FSDP2's unsharded parameters' storage, which FSDP2 frees after backward (learned
    queries expanded to a micro-batch of one sample: the expand is a view of the parameter, which
    plain's kernels read in backward; a frozen parameter, or a ``.detach()`` of one, as an input)."""
    base = saved if saved._base is None else saved._base
    if (
        (base.is_leaf and base.requires_grad and may_change_in_backward(base))
        or (fsdp_hooks.fsdp_in_use() and fsdp_hooks.shares_unsharded_storage(base))
    ) and not any(base is p for p in params):
        return saved.detach().clone()
    return saved.detach()


class _TapSpec(NamedTuple):
    kernel: WeightGradKernel
    group: Hashable
    concatenate: bool | None
    num_outputs: int
    deferral: ParamDeferral
    saves_reached: bool  # the kernel takes which outputs the backward reached (see defer_weight_grads)


def kernel_group(kernel: WeightGradKernel) -> Hashable:
    """Jobs whose kernels are equal partials of one function can share one kernel call."""
    if isinstance(kernel, functools.partial):
        return (kernel.func, kernel.args, tuple(sorted(kernel.keywords.items())))
    return kernel


def single_node_applies(*tensors: Tensor) -> bool:
    """Whether an op may run as one custom Function that computes its input gradient itself
    (instead of the op under autograd plus a tap): only where that formula is all plain autograd
    would do, with no autocast cast around the op, no forward-mode AD (the tap's ``jvp`` and
    tangent guards stay on the tap path) and dense strided tensors."""
    if forward_ad._current_level >= 0 or _any_autocast_enabled():
        return False
    for t in tensors:
        if t.layout != _STRIDED:
            return False
    return True


_any_autocast_enabled = torch._C._is_any_autocast_enabled
_STRIDED = torch.strided


def configured_kernel(
    function: Callable[..., Sequence[Tensor | None]], **config: Hashable
) -> tuple[WeightGradKernel, Hashable]:
    """``functools.partial(function, **config)`` and its :func:`kernel_group`, built once per
    configuration instead of on every patched call. The cache keeps ``config`` alive: plain
    values only (shapes, dtypes, flags), never tensors or modules."""
    if torch.compiler.is_compiling():
        # Dynamo traces past a cache (and warns every user that it does): build it here.
        return _configured(function, **config)
    return _configured_once(function, **config)


def _configured(
    function: Callable[..., Sequence[Tensor | None]], **config: Hashable
) -> tuple[WeightGradKernel, Hashable]:
    kernel = functools.partial(function, **config)
    return kernel, kernel_group(kernel)


_configured_once = functools.cache(_configured)


def _traced() -> bool:
    """Whether Dynamo traces this code (compiled autograd, or a compiled function calling backward).
    Compiled autograd's module is only looked up: unloaded, it is not running (and importing
    Dynamo would cost the first backward a second)."""
    compiled_autograd = sys.modules.get("torch._dynamo.compiled_autograd")
    return bool(getattr(compiled_autograd, "in_compiled_autograd_region", False)) or torch.compiler.is_compiling()


_POST_HOOKED = "twobp_post_hooked"


def sees_post_hooks(function: type[torch.autograd.Function]) -> type[torch.autograd.Function]:
    """Class decorator for a Function that routes parameters' work: a post-hook registered on
    one of its nodes (``output.grad_fn.register_hook``; a deprecated non-full backward hook of a
    module whose output the node makes registers one) may change what the node returns, which
    in plain autograd includes the weight gradients: that node's parameters take theirs now."""
    node_type: Any = function._backward_cls
    register = node_type.register_hook

    def register_hook(node: Any, hook: Callable[..., Any]) -> Any:
        setattr(node, _POST_HOOKED, True)
        return register(node, hook)

    node_type.register_hook = register_hook
    _skips_unreached(function)
    return function


def _skips_unreached(function: type[torch.autograd.Function]) -> None:
    """A patched op's node reached with no output gradient at all (an upstream node with several
    inputs returned None for this one: a module's full backward hook whose other output the loss
    uses, a custom Function that gives one input no gradient) returns none: plain autograd leaves
    the parameters' .grad None there, where materialised zeros would queue zero gradients."""
    forward, backward = function.forward, function.backward

    jvp = function.__dict__.get("jvp")

    def forward_unmaterialised(ctx: Any, *args: Any) -> Any:
        ctx.set_materialize_grads(False)  # also leaves a jvp's missing tangents None: see jvp
        if jvp is not None and forward_ad._current_level >= 0:  # under forward-mode AD only
            ctx.twobp_input_meta = [
                (a.shape, a.dtype, a.device) if isinstance(a, Tensor) and a.is_floating_point() else None
                for a in args
            ]
        return forward(ctx, *args)

    if jvp is not None:
        original_jvp = jvp.__func__ if isinstance(jvp, staticmethod) else jvp

        def jvp_materialised(ctx: Any, *tangents: Any) -> Any:
            tangents = tuple(
                torch.zeros(meta[0], dtype=meta[1], device=meta[2]) if t is None and meta is not None else t
                for t, meta in zip(tangents, ctx.twobp_input_meta, strict=True)
            )
            return original_jvp(ctx, *tangents)

        function.jvp = staticmethod(jvp_materialised)  # type: ignore[method-assign]

    def backward_unless_unreached(ctx: Any, *grad_outputs: Any) -> Any:
        for grad in grad_outputs:  # a loop: all() over a generator costs a call per backward
            if grad is not None:
                grads = backward(ctx, *grad_outputs)
                return _checked_for_nan(ctx, grads) if _is_anomaly_enabled() else grads
        return (None,) * len(ctx.needs_input_grad)

    function.forward = staticmethod(forward_unmaterialised)  # type: ignore[method-assign]
    if not function.__dict__.get("handles_unreached", False):
        function.backward = staticmethod(backward_unless_unreached)  # type: ignore[method-assign]
    # The originals too are kept out of Dynamo (compile_frames), which reaches them only here.
    setattr(forward_unmaterialised, OWN_WRAPPED, forward)
    setattr(backward_unless_unreached, OWN_WRAPPED, backward)
    if jvp is not None:
        setattr(jvp_materialised, OWN_WRAPPED, original_jvp)


@sees_post_hooks
class _WeightGradTap(torch.autograd.Function):
    handles_unreached = True  # see backward

    @staticmethod
    def forward(ctx: Any, spec: _TapSpec, saved: Sequence[Tensor], *outputs_then_params: Tensor) -> Any:
        outputs = outputs_then_params[: spec.num_outputs]
        ctx.spec = spec
        ctx.mark_dirty(*outputs)  # re-parent the op's outputs onto this node: no copy, no view
        ctx.save_for_backward(*saved)  # saved-tensor hooks and version checks apply as usual
        if len(outputs) > 1 or spec.saves_reached:  # a backward may reach only some: see backward
            ctx.output_meta = [(t.shape, t.dtype, t.device) for t in outputs]
        return outputs if len(outputs) > 1 else outputs[0]

    @staticmethod
    def jvp(ctx: Any, _spec: None, _saved: None, *tangents: Tensor) -> Any:
        """Forward-mode AD: the identity on the outputs' tangents (each given its own guard, see
        :func:`guard_tangent`). Autograd wants a dirty output's tangent modified in place as
        well, and the guard's own re-parenting is that modification."""
        spec: _TapSpec = ctx.spec
        params = spec.deferral.params
        with forward_ad._set_fwd_grad_enabled(True):  # off in a jvp, where tangents read as None
            param_tangents = [p is not None and forward_ad.unpack_dual(p).tangent is not None for p in params]
        if any(param_tangents):
            raise RuntimeError(
                "twobp: a forward-mode AD tangent on a parameter of a patched module (a dual "
                "tensor as its weight or bias) is not supported: the op runs on the detached "
                "parameter, so that tangent would be dropped. Use torch.func.jvp over "
                "torch.func.functional_call (patched modules take their plain forward inside "
                "torch.func), or twobp.unpatch(model) for this computation."
            )
        ctx.saw_tangents = True
        outputs = _zeros_where_none(ctx, tangents[: spec.num_outputs])
        guarded = tuple(guard_tangent(t, params, bump_version=True) for t in outputs)
        return guarded if len(guarded) > 1 else guarded[0]

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Tensor | None) -> tuple[Tensor | None, ...]:
        spec: _TapSpec = ctx.spec
        if not spec.saves_reached and all(g is None for g in grad_outputs):
            return (None,) * len(ctx.needs_input_grad)  # nothing reached it: nothing to queue
        deferral, saved = spec.deferral, _saved_for_weight_grads(ctx)
        if _has_none(grad_outputs) and not spec.saves_reached:
            # An output this backward does not reach: its kernel takes zeros for it, so unless
            # it is told which were reached, a parameter reached only through that output would
            # get zeros where plain leaves None.
            _warn_unreached_output_once()
        given = _zeros_where_none(ctx, grad_outputs)
        if spec.saves_reached:
            rows_of = saved[0] if saved else given[0]  # a kernel that needs only the output gradients saves none
            reached = torch.tensor([g is not None for g in grad_outputs], device=rows_of.device)
            # At least one row: a micro-batch of no rows (a batch of 0, a query of length 0)
            # still reached its outputs, and plain autograd gives its parameters zeros, not None.
            rows = rows_of.shape[0] if rows_of.dim() else 1
            saved = (*saved, reached.expand(max(rows, 1), len(grad_outputs)))
        param_grads = deferral.route(ctx, spec.kernel, spec.group, spec.concatenate, saved, given)
        if getattr(ctx, "twobp_nan_checked", None) is not None:
            # The op's own node computes the input gradient after this one: anomaly mode stops
            # that node on a NaN there, where plain's (which computed the weight gradients too)
            # handed none of them on.
            edges = ctx.next_functions[2 : 2 + spec.num_outputs]
            for node in {id(node): node for node, _ in edges if node is not None}.values():
                _withdraw_when_stopped(node, ctx.twobp_nan_checked)
        return (None, None, *grad_outputs, *param_grads)


_is_anomaly_enabled = torch.is_anomaly_enabled


def _holds_nan(grad: Any) -> bool:
    """Whether autograd's anomaly check would find a NaN in this returned gradient."""
    return isinstance(grad, Tensor) and bool(grad.isnan().any())


def _checked_for_nan(ctx: Any, grads: Any) -> Any:
    """A node's returned gradients as anomaly mode's NaN check should see them, which runs once
    the node returns: an input gradient this backward does not want (``backward(inputs=[w])``,
    ``autograd.grad`` of a weight) goes as None, as plain's node leaves it uncomputed (its NaN
    raised here, and plain's did not). A NaN left stops the node: its queued work goes, as plain's
    node, which computed the weight gradients too, hands none of them on."""
    if not torch.is_anomaly_check_nan_enabled():
        return grads
    returned = grads if isinstance(grads, tuple) else (grads,)
    nan = [_holds_nan(g) for g in returned]
    if not any(nan):
        return grads
    edges = ctx.next_functions  # one per tensor input: the Functions take those last
    offset = len(returned) - len(edges)
    kept = list(returned)
    for index, has_nan in enumerate(nan):
        node = edges[index - offset][0] if index >= offset else None
        if has_nan and (node is None or not _will_execute(node)):
            kept[index] = None
    if any(isinstance(g, Tensor) and has_nan for g, has_nan in zip(kept, nan, strict=True)):
        queued = getattr(ctx, "twobp_nan_checked", None)
        if queued is not None:
            queue, job = queued
            queue.withdraw(job)
    return tuple(kept) if isinstance(grads, tuple) else kept[0]


def _will_execute(node: Any) -> bool:
    """Whether this backward runs ``node``: under ``autograd.grad`` a leaf's accumulator, which
    PyTorch will not answer for, is one the call captures (it wants that gradient)."""
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:
        return True


def _withdraw_when_stopped(node: Any, queued: tuple[WeightGradQueue, WeightGradJob]) -> None:
    """As :func:`_checked_for_nan` withdraws a node's work: for a tap's, on the op's node after it (once)."""

    def check(grad_inputs: Any, grad_outputs: Any) -> None:
        handle.remove()
        if any(_holds_nan(g) for g in grad_inputs):
            queue, job = queued
            queue.withdraw(job)

    handle = node.register_hook(check)


def _saved_for_weight_grads(ctx: Any) -> tuple[Tensor, ...]:
    """The tap's saved tensors; autograd's in-place error told in terms of the split where one
    changed since the forward (plain may not have saved that tensor: a rule saves what its
    weight kernel needs, the recompute rule its module's inputs)."""
    try:
        return ctx.saved_tensors
    except RuntimeError as error:
        if "modified by an inplace operation" not in str(error):
            raise
        raise RuntimeError(
            "twobp: a tensor a patched layer saved for its deferred weight gradients was changed in place "
            "after its forward (a layer may save its input where plain autograd saves a copy or nothing: "
            "a rule registered with twobp_autograd.ops.recompute saves its module's inputs to replay the "
            "forward; `h += block(h)` around such a block changes its input). Write it out of place "
            f"(`h = h + block(h)`), or keep that module on plain autograd (patch(model, exclude=...)). ({error})"
        ) from error


def _has_none(values: Sequence[Tensor | None]) -> bool:
    """``None in values`` without comparing: ``tensor == None`` goes through Tensor.__eq__'s
    failing dispatch, about 10 us per tensor."""
    return any(value is None for value in values)


def _zeros_where_none(ctx: Any, values: Sequence[Tensor | None]) -> Sequence[Tensor]:
    """The tap's output gradients (or tangents), zeros for those not given: a tap with several
    outputs does not have autograd materialise them (see its forward)."""
    if not _has_none(values):
        return values  # type: ignore[return-value]
    return [
        torch.zeros(shape, dtype=dtype, device=device) if value is None else value
        for value, (shape, dtype, device) in zip(values, ctx.output_meta, strict=True)
    ]


def _refuse_create_graph() -> None:
    if torch.is_grad_enabled():  # only true in backward under create_graph=True
        raise RuntimeError(
            "twobp: create_graph=True (higher-order gradients) through a patched module is not "
            "supported: its weight gradients are taken out of autograd's graph (deferred or "
            "computed outside it), so second-order terms through the weights would be missing "
            "(torch.autograd.functional's jvp, hvp, vhp and hessian use it inside; for a "
            "Jacobian-vector product use torch.func.jvp or torch.autograd.forward_ad). Run this "
            "step on the unpatched modules: twobp.unpatch(model), or twobp.unpatch(module) for "
            "those involved (patch(model, exclude=[...]) leaves them out when patching)."
            f"{_REACHED_BEFORE}"
        )


#: Said by a refusal raised inside a backward: the engine ran nodes before the refusing one.
_REACHED_BEFORE = (
    " Parameters this backward reached before the refusal (used after this module in the "
    "forward) may hold this backward's gradient in .grad already: optimizer.zero_grad() before "
    "running the step again."
)


def _carries_tangents(ctx: Any, grad_outputs: Sequence[Tensor]) -> bool:
    """Whether this backward differentiates tensors that carry forward-mode AD tangents
    (forward-over-reverse): the call saw tangents in its forward (its ``jvp`` ran), or its
    output gradients have some. One lookup when no ``forward_ad.dual_level`` is open."""
    if forward_ad._current_level < 0:
        return False
    if getattr(ctx, "saw_tangents", False):
        return True
    return any(forward_ad.unpack_dual(g).tangent is not None for g in grad_outputs)


class _TangentGuard(torch.autograd.Function):
    """The identity on a forward-mode tangent whose autograd graph lacks its dependence on
    ``primals`` (it was computed from detached tensors): a backward through the tangent
    (reverse-over-forward) that would reach one of them is refused, not left without that term."""

    @staticmethod
    def forward(ctx: Any, tangent: Tensor, *primals: Tensor) -> Tensor:
        ctx.mark_dirty(tangent)  # in place, as autograd wants a dirty output's tangent changed
        return tangent

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        primal_edges = zip(ctx.next_functions[1:], ctx.needs_input_grad[1:], strict=True)
        if any(need and _decide(node) != "skip" for (node, _), need in primal_edges):
            raise RuntimeError(
                "twobp: backward through a forward-mode AD tangent of a patched module "
                "(reverse-over-forward, e.g. a loss on a Jacobian-vector product) is not "
                "supported: the tangent was computed from detached weights (BatchNorm's from a "
                "detached input too), so their gradients through it would be missing. Compute such "
                "a loss on the unpatched model (twobp.unpatch(model), or patch(model, exclude=[...]))."
                f"{_REACHED_BEFORE}"
            )
        return (grad, *(None for _ in ctx.needs_input_grad[1:]))


def guard_tangent(tangent: Tensor, primals: Sequence[Tensor | None], *, bump_version: bool = False) -> Tensor:
    """``tangent``, re-parented in place onto a :class:`_TangentGuard` when autograd records
    and one of ``primals`` requires grad; else as it is, its version bumped if asked (what
    the guard's re-parenting does)."""
    inputs = [p for p in primals if p is not None and p.requires_grad]
    if inputs and torch.is_grad_enabled():
        return _TangentGuard.apply(tangent, *inputs)
    if bump_version:
        torch.autograd.graph.increment_version(tangent)
    return tangent


def _decide_param(param: Tensor, node: Any) -> Decision:
    """:func:`_decide` for a leaf parameter; one with a tensor hook takes its gradient now."""
    decision = _decide(node)
    if decision == "defer" and param._backward_hooks:
        _warn_hooked_param_once()
        return "now"
    return decision


def _warn_unreached_output_once() -> None:
    warn_once(
        "unreached output of a patched module",
        "twobp: a backward reached only some outputs of a module with several (a recompute rule's, "
        "or a rule of your own); its weight kernel takes zeros for the others, so a parameter that "
        "only those reach gets a zero .grad where plain autograd leaves it None (weight decay then "
        "moves it). Exclude such a module from patch() if that matters.",
        stacklevel=2,
    )


def _reduces_unused(params: Sequence[Tensor | None]) -> bool:
    """:func:`fsdp_hooks.reduces_unused_params`, said once."""
    if not fsdp_hooks.reduces_unused_params(params):
        return False
    warn_once(
        "FSDP2 reduce_scatter_unused_params",
        "twobp: FSDP2 groups under set_reduce_scatter_unused_params(True) reduce every parameter on "
        "every rank in backward (ranks may route to other layers): their layers' weight gradients are "
        "computed in backward, not deferred. Set it only on the groups whose layers some ranks skip "
        "(recurse=False) to keep 2BP for the others.",
        stacklevel=3,
    )
    return True


def _warn_post_hooked_once() -> None:
    warn_once(
        "post-hook on a patched node",
        "twobp: a hook registered on the autograd node of a patched module's output "
        "(grad_fn.register_hook, or a deprecated register_backward_hook on a module around it) "
        "sees that node's weight gradients in plain autograd, so they are computed during "
        "backward, not deferred.",
        stacklevel=2,
    )


def _warn_hooked_param_once() -> None:
    warn_once(
        "parameter with a tensor hook",
        "twobp: a parameter with a tensor hook (Tensor.register_hook) gets its weight gradient "
        "during backward, as plain autograd computes it, so that the hook sees each backward's "
        "gradient (a hook such as a clamp would give another result on a sum over micro-batches); "
        "such parameters are not deferred. Hooks registered with "
        "register_post_accumulate_grad_hook do not stop deferral.",
        stacklevel=2,
    )


def _decide(param_node: Any) -> Decision:
    """'defer' when this backward accumulates into the parameter, 'skip' when it does not
    reach it, 'now' when its gradient must be returned at once (autograd.grad asks for it)."""
    try:
        reached = torch._C._will_engine_execute_node(param_node)
    except RuntimeError:
        # The engine refuses the question for a leaf that autograd.grad captures: the caller
        # wants the value returned now.
        return "now"
    return "defer" if reached else "skip"


#: Plain's refusal of a tensor made under inference_mode that its op would save for backward.
INFERENCE_TENSORS_SAVED = (
    "twobp: Inference tensors cannot be saved for backward. To work around you can make "
    "a clone to get a normal tensor and use it in autograd (as plain PyTorch says)."
)


def defer_weight_grads(
    outputs: Tensor | tuple[Tensor, ...],
    params: Sequence[Tensor | None],
    saved: Sequence[Tensor],
    kernel: WeightGradKernel,
    *,
    concatenate: bool | None = None,
    group: Hashable = None,
    saves_reached: bool = False,
) -> Any:
    """Defer the gradients of ``params`` for an op whose ``outputs`` were computed with the
    parameters detached. ``kernel(saved, grad_outputs, needs)`` later returns one gradient per
    parameter. Returns ``outputs`` (the same tensors).

    ``concatenate``: False if the kernel must see one micro-batch at a time (then saved tensors
    need not hold the batch on dim 0); otherwise it must accept several joined on dim 0 of every
    saved tensor and output gradient. True says joining always pays; None (default) that it pays
    off the CPU only (see ``WeightGradQueue``).

    ``group``: jobs with equal groups (and parameters and trailing shapes) may share one call of
    the *first* job's kernel; by default the kernel itself, or its function and arguments when it
    is a ``functools.partial`` (see :func:`configured_kernel`). Give calls one group only where
    their kernels compute the same. A tensor the kernel needs goes in ``saved`` (its in-place
    changes before the flush are refused there), not in a partial, which nothing checks.

    ``saves_reached``: the kernel's last saved tensor is then a bool ``(rows, outputs)`` (rows:
    ``saved[0]``'s dim 0, or the first output's where nothing is saved; at least one) saying which
    outputs each micro-batch's backward reached (the others' output gradients are zeros), so that
    a parameter no backward reached through them can stay None, as in plain autograd. A backward
    that gives none of the outputs a gradient (None: an upstream node's) then still queues the work,
    with none reached: a kernel that replays the op can hand that None on as plain does."""
    if isinstance(params, Tensor) or isinstance(saved, Tensor):
        raise TypeError(
            "twobp: defer_weight_grads takes params and saved as sequences of tensors, e.g. "
            "(module.weight, module.bias) and (rows,), not a tensor alone (iterated, it would be its rows)"
        )
    outs = (outputs,) if isinstance(outputs, Tensor) else tuple(outputs)
    if len(outs) == 1 and outs[0]._is_view():
        why = untappable_view(outs[0])
        if why is not None:
            raise RuntimeError(
                f"twobp: defer_weight_grads cannot take an output that is {why}: pass the tensor it "
                "views and take the view of what it returns, or pass a copy"
            )
    deferral = ParamDeferral.at_forward(params)
    group = kernel_group(kernel) if group is None else group
    if saves_reached:
        # Such a kernel may leave a parameter None (only unreached outputs use it): dropping its
        # job (zero_grad(set_to_none=False)) must run it to tell which ones plain gave a .grad.
        leaves_some_grads_none(kernel)  # type: ignore[arg-type]
    try:
        hash(group)  # the flush groups jobs by it
    except TypeError:
        raise TypeError(
            f"twobp: defer_weight_grads needs a hashable group, got {group!r}: a functools.partial kernel "
            "takes hashable arguments only (a tuple, not a list or dict), or pass group="
        ) from None
    # tuple.__new__: a NamedTuple's own __new__ is a Python frame (see ParamDeferral.at_forward)
    spec = tuple.__new__(_TapSpec, (kernel, group, concatenate, len(outs), deferral, saves_reached))
    _refuse_undetached_params(outs, deferral.params)
    # The leaf parameters are inputs of the tap so that its node has an edge to each one's
    # gradient accumulator: that is what the engine is asked about in backward. (The others,
    # as `detached` leaves them, keep their graph through the op itself.)
    saved_tensors = tuple(saved)
    try:
        output_versions = [t._version for t in outs]
        saved_versions = [t._version for t in saved_tensors]
    except AttributeError:
        raise TypeError(
            "twobp: defer_weight_grads takes the op's output tensors and the tensors its kernel "
            f"needs, got outputs {[type(t).__name__ for t in outs]} and saved "
            f"{[type(t).__name__ for t in saved_tensors]} (pass values that are not tensors to the kernel "
            "with functools.partial; tensors go in saved, where in-place changes are checked)"
        ) from None
    except RuntimeError:
        if any(t.is_inference() for t in (*outs, *saved_tensors)):  # no version counter to read
            # Made in inference mode (token ids): plain's op refuses to save it for backward.
            raise RuntimeError(INFERENCE_TENSORS_SAVED) from None
        raise
    aliases = [_shares_memory(t, outs) for t in saved_tensors]
    if any(aliases):
        # An output saved for the kernel as it is (exp's result, for its weight's gradient)
        # shares the output's version counter, which the tap's re-parenting bumps: either the
        # op's own record of its result or the tap's record of the alias would read "modified".
        saved_tensors = tuple(t.clone() if alias else t for t, alias in zip(saved_tensors, aliases, strict=True))
        saved_versions = [t._version for t in saved_tensors]
    # mark_dirty bumps the outputs' version counters, yet no value changes: they are put back,
    # so that whatever recorded them before stays valid (the op's own saved output, as sigmoid or
    # relu keep theirs; selective activation checkpointing's cache, which refuses a "mutated"
    # entry). Unless a saved tensor shares a counter with an output (its version moved too):
    # the tap's own record of it would then no longer see a later in-place change. Also when
    # apply raises after the re-parenting: a non-reentrant checkpoint's recomputation stops
    # early from the pack hook of the tap's last saved tensor, and under selective
    # checkpointing the output may be an alias of the forward's cached tensor, whose counter
    # would otherwise stay bumped (a spurious "modified in place" for what saved it).
    try:
        tapped = _WeightGradTap.apply(spec, saved_tensors, *outs, *param_inputs(deferral.params))
    except RuntimeError as error:
        _restore_versions(outs, output_versions, saved_tensors, saved_versions)
        if len(outs) > 1 and any(t._is_view() for t in outs):
            raise RuntimeError(
                "twobp: defer_weight_grads cannot take several outputs that are views (q, k, v = "
                "qkv.chunk(3)): pass the tensor they are views of as one output and split what it "
                f"returns, or pass copies. ({error})"
            ) from error
        raise
    except BaseException:
        _restore_versions(outs, output_versions, saved_tensors, saved_versions)
        raise
    _restore_versions(outs, output_versions, saved_tensors, saved_versions)
    return tapped


@contextlib.contextmanager
def first_call_checked(args: Any = (), kwargs: Any = None) -> Iterator[None]:
    """Around a patched module's first deferred call: its rule's :func:`defer_weight_grads`
    check that the op computed with its deferred parameters detached. The autograd nodes made
    since this block began are the rule's (sequence numbers grow per thread)."""
    # The next node's number (no op run for it: an op would enter selective checkpointing's cache).
    previous, _first_call.floor = getattr(_first_call, "floor", None), torch._C._autograd._get_sequence_nr() - 1
    # Sequence numbers are per thread: an input made on another thread may carry higher ones.
    # Its node (and, read here, a view's node regenerated on access) is where the walk stops.
    tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
    stops = {t.grad_fn for t in tensors if t.grad_fn is not None}
    # A leaf given as an input (a parameter passed to its own module: lin(lin.weight)) is used
    # through the input's edge, as plain autograd uses it.
    input_leaves = {id(t) for t in tensors if t.grad_fn is None}
    previous_stops, _first_call.stops = getattr(_first_call, "stops", None), (stops, input_leaves)
    # Autocast's cache would hand the rule a cast of a parameter made upstream (an older node):
    # off for this call, so a cast of a parameter not detached is the rule's own node.
    cache_enabled = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    thread = threading.get_ident()
    first_calls_open[thread] = first_calls_open.get(thread, 0) + 1  # only this thread writes its entry
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(cache_enabled)
        _first_call.floor, _first_call.stops = previous, previous_stops
        if first_calls_open[thread] == 1:
            del first_calls_open[thread]
        else:
            first_calls_open[thread] -= 1


#: Thread id -> first-call checks open on it: empty, the usual case, says no call needs
#: :func:`first_call_unchecked` without a thread-local lookup.
first_calls_open: dict[int, int] = {}


def inside_first_call_check() -> bool:
    return getattr(_first_call, "floor", None) is not None


@contextlib.contextmanager
def first_call_unchecked() -> Iterator[None]:
    """Around a patched module's later calls: no check, even inside another's first call."""
    floor = getattr(_first_call, "floor", None)
    if floor is None:
        yield
        return
    stops = getattr(_first_call, "stops", None)
    _first_call.floor = None
    try:
        yield
    finally:
        _first_call.floor, _first_call.stops = floor, stops


_first_call = threading.local()
_CUSTOM_FUNCTION_NODE = torch.autograd.function.BackwardCFunction


def _refuse_undetached_params(outputs: Sequence[Tensor], params: Sequence[Tensor | None]) -> None:
    """A rule that computed its output with a deferred parameter itself, not ``detached``: its
    gradient would come from autograd in backward *and* from the kernel at the flush (twice,
    silently). Checked in a module's first deferred call (:func:`first_call_checked`): the
    rule's ATen nodes must not reach the parameter's accumulator (an upstream use of a tied
    weight is older than the rule)."""
    floor = getattr(_first_call, "floor", None)
    deferred = {id(p) for p in params if p is not None}
    if floor is None or not deferred:
        return
    stops, input_leaves = _first_call.stops
    deferred -= input_leaves
    nodes = [t.grad_fn for t in outputs if t.grad_fn is not None]
    stack = [node for node in nodes if node._sequence_nr() > floor and node not in stops]
    seen: set[Any] = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        # A custom Function's node (a deferring node of this package, a compiled region's) has
        # edges to parameters whatever it returns for them: only ATen's nodes tell a use.
        custom = isinstance(node, _CUSTOM_FUNCTION_NODE)
        for child, _ in node.next_functions:
            if child is None:
                continue
            variable = getattr(child, "variable", None)  # an AccumulateGrad's parameter
            if variable is not None and not custom and id(variable) in deferred:
                raise RuntimeError(
                    f"twobp: a deferred op computed its output with a parameter of shape {tuple(variable.shape)} "
                    "itself, not detached: its gradient would be added twice (by autograd in backward and "
                    "by the kernel at the flush). Compute with twobp_autograd.deferral.detached(param) "
                    "for every parameter passed to defer_weight_grads."
                )
            if variable is None and child._sequence_nr() > floor and child not in stops:
                stack.append(child)


@torch.compiler.disable  # creation metadata and strides of the real tensor, not of a traced stand-in
def untappable_view(view: Tensor) -> str | None:
    """Why the tap, which re-parents its output in place, cannot take this view, or None.
    Autograd refuses it for a view made by an op with several outputs (and the like); for one whose
    elements overlap (``unfold``, ``expand``) it takes it, and each overlapping element's
    weight gradient then arrives twice (silently: 2x plain's on an unfolded window)."""
    if torch._C._autograd._get_creation_meta(view) != torch._C._autograd.CreationMeta.DEFAULT:
        return (
            "a view autograd lets no one change in place (made by an op with several outputs: chunk, "
            "split, unbind; or in no_grad mode, or inside a custom Function)"
        )
    if _overlaps_itself(view):
        return "a view whose elements overlap (unfold, expand)"
    return None


def _overlaps_itself(view: Tensor) -> bool:
    """Whether two elements of ``view`` may share memory: its dims, by stride, each step past
    all that the smaller ones span (a layout that interleaves without overlap counts too)."""
    spanned = 0
    for stride, size in sorted((st, sz) for st, sz in zip(view.stride(), view.shape, strict=True) if sz > 1):
        if stride <= spanned:
            return True
        spanned += stride * (size - 1)
    return False


@torch.compiler.disable  # traced, Dynamo's functionalization drops the reset: run it on the real tensors
def _restore_versions(
    outs: Sequence[Tensor], output_versions: list[int], saved: Sequence[Tensor], saved_versions: list[int]
) -> None:
    if [t._version for t in saved] != saved_versions or [t._version for t in outs] == output_versions:
        return
    torch._C._autograd._unsafe_set_version_counter(tuple(outs), tuple(output_versions))
    for t in outs:
        if t._is_view():
            # Its cached grad_fn no longer matches the counter: read once, autograd makes it anew
            # for the version put back (left for register_hook to find, it crashed the process;
            # FSDP2 hooks every module output). Leaving the counter moved instead fails a base
            # the op saved (exp's, sigmoid's result). The built-in rules tap no views.
            t.grad_fn  # noqa: B018


def _shares_memory(tensor: Tensor, outputs: Sequence[Tensor]) -> bool:
    if tensor.layout != torch.strided or tensor.numel() == 0:
        return False
    try:
        memory = tensor.untyped_storage().data_ptr()
        return any(o.layout == torch.strided and o.untyped_storage().data_ptr() == memory for o in outputs)
    except RuntimeError:  # no memory of its own to compare (a DTensor, a FakeTensor while compiling)
        return False


def param_inputs(params: Sequence[Tensor | None]) -> tuple[Tensor, ...]:
    """The parameters as a custom Function's tensor inputs: one per parameter, a placeholder
    for None (a None argument gets no edge, which would shift every later one)."""
    return tuple([_NO_PARAM if p is None else p for p in params])


def param_from_input(input: Tensor) -> Tensor | None:
    """Inverse of :func:`param_inputs` for one input, inside the Function's forward."""
    return None if input is _NO_PARAM else input


_NO_PARAM = torch.empty(0)
