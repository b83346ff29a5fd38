"""What a block costs: its parameter count, or its forward plus backward time measured on a
sample, averaged over the ranks when every rank measures its own.

With 2BP a stage runs the patched forward, backward-p1 and the flush (F + I + W), not the
plain F + B: their ratio differs from block to block, so a split balanced on plain times can
leave the stage whose layers split worst as the slowest. ``twobp=True`` measures what runs.

Measured times differ from process to process, and ranks that cut the same model from
different costs would hold stages that do not fit together: :func:`agreed_block_costs` is the
one each rank of a pipeline calls.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ... import WeightGradQueue, patch, use_queue
from ...patching import _is_patched, _unpatch_module

__all__ = ["parameter_costs", "measure_block_costs", "agreed_block_costs"]


def parameter_costs(blocks: Sequence[nn.Module]) -> list[float]:
    """Parameter count per block, plus one so that blocks without parameters still count."""
    return [float(sum(p.numel() for p in block.parameters()) + 1) for block in blocks]


def measure_block_costs(
    blocks: Sequence[nn.Module], sample: Tensor, *, repeats: int = 2, twobp: bool = False
) -> list[float]:
    """Seconds of forward plus backward of each block on ``sample`` (the model's input: one
    micro-batch of the schedule), the fastest of ``repeats`` after one warm-up; with ``twobp``
    the block patched, its queued weight work flushed inside the time, and unpatched after.
    Leaves gradients and buffers (BatchNorm running statistics) as they were."""
    # By module and name: a forward may assign a buffer anew (a rotary cache built on first use).
    buffers = [
        (module, name, buffer, None if buffer is None else buffer.detach().clone())
        for block in blocks
        for module in block.modules()
        for name, buffer in module._buffers.items()
    ]
    grads = {id(p): p.grad for block in blocks for p in block.parameters()}
    # Measure on fresh gradients: backward accumulates into an existing .grad in place, so the
    # tensors kept above would come back holding the measuring passes' gradients too.
    for block in blocks:
        for p in block.parameters():
            p.grad = None
    # Modules patched before (by the caller) stay patched; only what is patched here is undone.
    patched_before = {id(m) for block in blocks for m in block.modules() if _is_patched(m)}
    costs: list[float] = []
    x = sample
    queue = WeightGradQueue()
    try:
        for block in blocks:
            best = float("inf")
            if twobp:
                patch(block)
            for attempt in range(repeats + 1):
                inp = x.detach().requires_grad_(x.is_floating_point())
                start = time.perf_counter()
                with use_queue(queue):
                    out = block(inp)
                if out.requires_grad:
                    out.backward(torch.ones_like(out))
                queue.flush()
                if out.is_cuda:
                    torch.cuda.synchronize(out.device)
                if attempt > 0:
                    best = min(best, time.perf_counter() - start)
            costs.append(best)
            x = out.detach()
    finally:
        queue.clear()
        if twobp:
            for block in blocks:
                for module in block.modules():
                    if id(module) not in patched_before:
                        _unpatch_module(module)
        with torch.no_grad():
            for module, name, buffer, values in buffers:
                if buffer is not None and values is not None:
                    buffer.copy_(values)
                module._buffers[name] = buffer
            for block in blocks:
                for p in block.parameters():
                    p.grad = grads[id(p)]
    return costs


def agreed_block_costs(
    blocks: Sequence[nn.Module], sample: Tensor, *, group: dist.ProcessGroup | None = None, twobp: bool = False
) -> list[float]:
    """:func:`measure_block_costs` on every rank of ``group``, averaged over them: the same
    costs on every rank (a collective: every rank calls it)."""
    measured = torch.tensor(measure_block_costs(blocks, sample, twobp=twobp), dtype=torch.float64, device=sample.device)
    dist.all_reduce(measured, group=group)
    return (measured / dist.get_world_size(group)).tolist()
