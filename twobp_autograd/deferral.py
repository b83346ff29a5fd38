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
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .queue import WeightGradJob, WeightGradKernel, WeightGradQueue, current_queue

__all__ = ["defer_weight_grads", "detached", "kernel_group"]


def detached(param: "Tensor | None") -> "Tensor | None":
    """What an op computes with: a parameter (a leaf) detached, so its gradient is deferred;
    anything else as it is (a weight rebuilt from parametrizations or ``weight_norm`` at each
    call keeps its graph, and autograd differentiates through it at once)."""
    return param.detach() if param is not None and param.is_leaf else param


class _TapSpec(NamedTuple):
    kernel: WeightGradKernel
    group: Hashable
    concatenate: bool
    queue: WeightGradQueue
    tag: Hashable
    num_outputs: int
    params: tuple["torch.nn.Parameter | None", ...]


def kernel_group(kernel: WeightGradKernel) -> Hashable:
    """Jobs whose kernels are equal partials of one function can share one kernel call."""
    if isinstance(kernel, functools.partial):
        return (kernel.func, kernel.args, tuple(sorted(kernel.keywords.items())))
    return kernel


class _WeightGradTap(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, spec: _TapSpec, saved: Sequence[Tensor], *outputs_then_params: Tensor) -> Any:
        outputs = outputs_then_params[: spec.num_outputs]
        ctx.spec = spec
        ctx.mark_dirty(*outputs)  # re-parent the op's outputs onto this node: no copy, no view
        ctx.save_for_backward(*saved)  # saved-tensor hooks and version checks apply as usual
        return outputs if len(outputs) > 1 else outputs[0]

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Tensor) -> tuple["Tensor | None", ...]:
        spec: _TapSpec = ctx.spec
        if torch.is_grad_enabled():  # only true in backward under create_graph=True
            raise RuntimeError(
                "twobp: create_graph=True (higher-order gradients) through a patched module is not "
                "supported: its input gradient is computed with detached weights, so second-order "
                "terms through the weights would be missing. Run this step on the unpatched model "
                "(twobp.unpatch(model), or patch(model, exclude=[...]) for the modules involved)."
            )
        n = spec.num_outputs
        saved = ctx.saved_tensors
        edges = ctx.next_functions[n:]  # one edge per tensor input: outputs, then parameters
        decisions = [
            _decide(node) if needed else "skip"
            for (node, _), needed in zip(edges, ctx.needs_input_grad[2 + n :])
        ]
        param_grads: list["Tensor | None"] = [None] * len(decisions)
        if "now" in decisions:
            needs = [d == "now" for d in decisions]
            param_grads = list(spec.kernel(saved, grad_outputs, needs))
            param_grads = [g if need else None for g, need in zip(param_grads, needs)]
        if "defer" in decisions:
            spec.queue.enqueue(
                WeightGradJob(
                    kernel=spec.kernel,
                    group=spec.group,
                    concatenate=spec.concatenate,
                    params=tuple(p if d == "defer" else None for p, d in zip(spec.params, decisions)),
                    saved=tuple([t.detach() for t in saved]),
                    grad_outputs=tuple([g.detach() for g in grad_outputs]),
                    tag=spec.tag,
                )
            )
        return (None, None, *grad_outputs, *param_grads)


def _decide(param_node: Any) -> str:
    """'defer' when this backward accumulates into the parameter, 'skip' when it does not
    reach it, 'now' when its gradient must be returned at once (autograd.grad asks for it)."""
    try:
        reached = torch._C._will_engine_execute_node(param_node)
    except RuntimeError:
        # The engine refuses the question for a leaf that autograd.grad captures: the caller
        # wants the value returned now.
        return "now"
    return "defer" if reached else "skip"


def defer_weight_grads(
    outputs: "Tensor | tuple[Tensor, ...]",
    params: Sequence["torch.nn.Parameter | None"],
    saved: Sequence[Tensor],
    kernel: WeightGradKernel,
    *,
    concatenate: "bool | None" = None,
    group: Hashable = None,
) -> Any:
    """Defer the gradients of ``params`` for an op whose ``outputs`` were computed with the
    parameters detached. ``kernel(saved, grad_outputs, needs)`` later returns one gradient per
    parameter. Returns ``outputs`` (the same tensors).

    ``concatenate``: False if the kernel must see one micro-batch at a time; otherwise it must
    accept several joined on dim 0 of every saved tensor and output gradient. True says joining
    always pays; None (default) that it pays off the CPU only (see ``WeightGradQueue``)."""
    outs = (outputs,) if isinstance(outputs, Tensor) else tuple(outputs)
    params = tuple(p if p is not None and p.is_leaf else None for p in params)  # as `detached`
    queue = current_queue()
    spec = _TapSpec(
        kernel=kernel,
        group=kernel_group(kernel) if group is None else group,
        concatenate=concatenate,
        queue=queue,
        tag=queue._tag,
        num_outputs=len(outs),
        params=params,
    )
    # The parameters are inputs of the tap so that its node has an edge to each parameter's
    # gradient accumulator: that is what the engine is asked about in backward.
    param_inputs = [p if p is not None else _NO_PARAM for p in params]
    return _WeightGradTap.apply(spec, tuple(saved), *outs, *param_inputs)


_NO_PARAM = torch.empty(0)
