"""nn.Linear: dX by PyTorch's own linear derivative; dW = g^T x, db = sum(g) over all rows of
all queued micro-batches in one GEMM."""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn.functional as F
from torch import Tensor, nn

from ..deferral import defer_weight_grads, detached
from ..registry import register

__all__ = ["linear_forward", "linear_weight_grad"]


def linear_weight_grad(saved: Sequence[Tensor], grad_outputs: Sequence[Tensor], needs: Sequence[bool]) -> list["Tensor | None"]:
    (rows,) = saved
    grad = grad_outputs[0].reshape(-1, grad_outputs[0].shape[-1])
    weight_grad = grad.t().mm(rows) if needs[0] else None
    bias_grad = grad.sum(0) if len(needs) > 1 and needs[1] else None
    return [weight_grad, bias_grad]


def linear_forward(input: Tensor, weight: Tensor, bias: "Tensor | None") -> Tensor:
    """``F.linear`` with the weight gradients deferred; usable inside other ops' forwards."""
    output = F.linear(input, detached(weight), detached(bias))
    # Saved as 2-D rows in the dtype the product ran in (autocast's), as plain autograd would.
    rows = input.detach().reshape(-1, input.shape[-1]).to(output.dtype)
    return defer_weight_grads(output, (weight, bias), (rows,), linear_weight_grad)


@register(nn.Linear)
def linear(module: nn.Linear, input: Tensor) -> Tensor:
    return linear_forward(input, module.weight, module.bias)
