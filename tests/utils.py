"""Shared checks: a patched model against plain autograd on a deep copy, parameter by parameter."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

import twobp_autograd as twobp

#: (rtol, atol) per dtype: fp64 is exact up to summation order; fp32 micro-batch concatenation
#: reorders sums; bf16 keeps 8 mantissa bits.
TOLERANCES = {torch.float64: (1e-10, 1e-12), torch.float32: (1e-5, 1e-6), torch.bfloat16: (2e-2, 2e-2)}


class Scale(nn.Module):
    """A module no rule covers (a stand-in for any unregistered layer):
    not registered, its weight gets its gradient from plain autograd
    in backward."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight


class TokenStack(nn.Module):
    """A language model's shape: an embedding, blocks, a final norm and a head. (The blocks are
    a built sequence: a generator would build them after the norm and head, with other weights.)"""

    def __init__(self, embed: nn.Module, blocks: Sequence[nn.Module], norm: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.embed, self.blocks, self.norm, self.head = embed, nn.ModuleList(blocks), norm, head

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def _scaled_atol(reference: Tensor, dtype: torch.dtype, atol_scale: float = 1.0) -> float:
    """The dtype's absolute tolerance (times ``atol_scale``), raised to rtol times the
    reference's largest entry: a gradient summed in another order (micro-batches concatenated
    into one convolution) differs by a rounding of its *largest* terms, even at entries near 0."""
    rtol, atol = TOLERANCES[dtype]
    largest = reference.abs().max().item() if reference.numel() else 0.0
    return max(atol * atol_scale, rtol * largest)


def close_to_reference(value: Tensor, reference: Tensor, dtype: torch.dtype = torch.float32) -> bool:
    """``value`` within the dtype's tolerance of ``reference`` (absolute part: :func:`_scaled_atol`)."""
    return torch.allclose(value, reference, rtol=TOLERANCES[dtype][0], atol=_scaled_atol(reference, dtype))


def assert_close_to_reference(value: Tensor, reference: Tensor, dtype: torch.dtype, msg: Any = None) -> None:
    """:func:`close_to_reference` with ``torch.testing``'s report: for parameters and buffers
    after optimizer steps, whose rounding noise scales with the largest update."""
    atol = _scaled_atol(reference, dtype)
    torch.testing.assert_close(value, reference, rtol=TOLERANCES[dtype][0], atol=atol, msg=msg)


def patched_and_reference(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """A deep copy kept on plain autograd, and the model itself patched in place."""
    reference = copy.deepcopy(model)
    return twobp.patch(model), reference


def assert_grads_match(
    patched: nn.Module, reference: nn.Module, dtype: torch.dtype = torch.float32, scale: float = 1.0
) -> None:
    """Every parameter's .grad equal (both None, or close within the dtype's tolerance)."""
    rtol = TOLERANCES[dtype][0]
    for (name, p), (_, q) in zip(patched.named_parameters(), reference.named_parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None, f"{name}: .grad should be None, got a tensor"
            continue
        assert p.grad is not None, f"{name}: .grad is None, plain autograd has one"
        assert p.grad.dtype == q.grad.dtype and p.grad.shape == q.grad.shape, name
        tolerance = _scaled_atol(q.grad, dtype, scale)
        torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=tolerance, msg=lambda m, name=name: f"{name}: {m}")


def assert_no_grads(model: nn.Module) -> None:
    for name, p in model.named_parameters():
        assert p.grad is None, f"{name}: .grad was written during backward-p1"


def check_against_autograd(
    model: nn.Module,
    make_inputs: Callable[[], Sequence[Tensor | None]],
    *,
    micro_batches: int = 3,
    dtype: torch.dtype = torch.float32,
    loss: Callable[[object], Tensor] | None = None,
) -> None:
    """Patch ``model``; run ``micro_batches`` backward calls on it and on a plain deep copy
    (inputs cloned; a None passed as it is, for an optional argument before others);
    check .grad is untouched before the flush and equal after it (concatenated kernels); check
    the queue is empty."""
    loss = loss or _default_loss
    patched, reference = patched_and_reference(model)
    # "concat": every kernel that can take joined micro-batches gets them, as on a GPU (the
    # default "auto" joins only where it pays, which on a CPU is convolutions alone).
    queue = twobp.WeightGradQueue("concat")
    for _ in range(micro_batches):
        inputs = make_inputs()
        with twobp.use_queue(queue):
            loss(patched(*inputs)).backward()
        loss(reference(*[None if t is None else t.clone() for t in inputs])).backward()
    assert_no_grads_on_deferred(patched)
    assert queue.pending().jobs > 0, "nothing was queued: the patched ops did not defer"
    queue.flush()
    assert queue.pending() == (0, 0)
    assert_grads_match(patched, reference, dtype)


def assert_no_grads_on_deferred(model: nn.Module) -> None:
    assert_no_grads(model)


def _default_loss(output: object) -> Tensor:
    if isinstance(output, Tensor):
        return (output.float() ** 2).sum() / output.numel()
    tensors = [t for t in output if isinstance(t, Tensor) and t.is_floating_point()]  # type: ignore[union-attr]
    return sum((t.float() ** 2).sum() / t.numel() for t in tensors)  # type: ignore[return-value]


def lossy_saved_tensors_hooks() -> contextlib.AbstractContextManager:
    """Saved-tensor hooks that keep floating tensors in fp16, as activation compression does:
    they hand back other values than they were given."""

    def pack(t: Tensor) -> tuple[Tensor, torch.dtype]:
        return (t.to(torch.float16), t.dtype) if t.is_floating_point() else (t, t.dtype)

    def unpack(packed: tuple[Tensor, torch.dtype]) -> Tensor:
        return packed[0].to(packed[1])

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
