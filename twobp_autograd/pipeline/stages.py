"""Cut a model into pipeline stages.

A pipeline stage is a contiguous run of the model's top-level blocks. :func:`blocks_of` lists
those blocks (any ``nn.Sequential``; a torchvision ResNet as stem, residual blocks, head), and
:func:`partition` balances them over the stages by a per-block cost: the measured forward plus
backward time (:func:`measure_block_costs`), or the parameter count when nothing can be run. A
user with a model of another shape builds one module per rank and hands that in instead.

The stages share their blocks (and so their parameters) with the model: no copy is made.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import Tensor, nn

__all__ = ["blocks_of", "partition", "measure_block_costs", "parameter_costs", "split", "stage_for_rank"]


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The model as a sequence of blocks whose composition is its forward."""
    if isinstance(model, nn.Sequential):
        return list(model)
    if _is_torchvision_resnet(model):
        stem = nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool)
        body = [block for layer in (model.layer1, model.layer2, model.layer3, model.layer4) for block in layer]
        head = nn.Sequential(model.avgpool, nn.Flatten(1), model.fc)
        return [stem, *body, head]
    raise TypeError(
        f"cannot split a {type(model).__name__} into stages: pass an nn.Sequential, a torchvision "
        "ResNet, or build one module per rank yourself and hand it to the runtime"
    )


def _is_torchvision_resnet(model: nn.Module) -> bool:
    try:
        from torchvision.models import ResNet
    except ImportError:  # torchvision is optional
        return False
    # Exact type: a subclass may have changed forward, and the blocks would then not compose to it.
    return type(model) is ResNet


def partition(costs: Sequence[float], num_stages: int) -> list[range]:
    """Contiguous ranges of block indices, one per stage, minimising the costliest stage."""
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot cut {n} blocks into {num_stages} non-empty stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[s][i]: the lowest maximum stage cost of the first i blocks cut into s stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    bounds = [n]
    for s in range(num_stages, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    bounds.reverse()
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def parameter_costs(blocks: Sequence[nn.Module]) -> list[float]:
    """Parameter count per block, plus one so that blocks without parameters still count."""
    return [float(sum(p.numel() for p in block.parameters()) + 1) for block in blocks]


def measure_block_costs(blocks: Sequence[nn.Module], sample: Tensor, *, repeats: int = 2) -> list[float]:
    """Seconds of forward plus backward of each block on ``sample`` (the model's input), the
    fastest of ``repeats`` after one warm-up. Leaves gradients and buffers (BatchNorm running
    statistics) as they were."""
    buffers = {id(b): b.detach().clone() for block in blocks for b in block.buffers()}
    grads = {id(p): p.grad for block in blocks for p in block.parameters()}
    costs: list[float] = []
    x = sample
    try:
        for block in blocks:
            best = float("inf")
            for attempt in range(repeats + 1):
                inp = x.detach().requires_grad_(x.is_floating_point())
                start = time.perf_counter()
                out = block(inp)
                if out.requires_grad:
                    out.backward(torch.ones_like(out))
                if out.is_cuda:
                    torch.cuda.synchronize(out.device)
                if attempt > 0:
                    best = min(best, time.perf_counter() - start)
            costs.append(best)
            x = out.detach()
    finally:
        with torch.no_grad():
            for block in blocks:
                for b in block.buffers():
                    b.copy_(buffers[id(b)])
                for p in block.parameters():
                    p.grad = grads[id(p)]
    return costs


def split(
    model: nn.Module,
    num_stages: int,
    *,
    costs: "Sequence[float] | None" = None,
    sample: "Tensor | None" = None,
) -> list[nn.Sequential]:
    """``num_stages`` sequential stages of ``model``, balanced by ``costs`` (one per block), else
    by the time measured on ``sample``, else by parameter count."""
    blocks = blocks_of(model)
    if costs is None:
        costs = measure_block_costs(blocks, sample) if sample is not None else parameter_costs(blocks)
    if len(costs) != len(blocks):
        raise ValueError(f"{len(costs)} costs for {len(blocks)} blocks")
    return [nn.Sequential(*(blocks[i] for i in part)) for part in partition(costs, num_stages)]


def stage_for_rank(
    model: "nn.Module | Sequence[nn.Module]",
    rank: int,
    num_stages: int,
    *,
    costs: "Sequence[float] | None" = None,
    sample: "Tensor | None" = None,
) -> nn.Module:
    """This rank's stage: ``model[rank]`` when a list of per-rank modules is handed in, else a
    cut of ``model``. Every rank must pass the same ``costs`` (measured times differ between
    processes; agree on them first, e.g. by averaging with an all-reduce)."""
    if isinstance(model, (list, tuple)):
        if len(model) != num_stages:
            raise ValueError(f"{len(model)} per-rank modules for {num_stages} stages")
        return model[rank]
    return split(model, num_stages, costs=costs, sample=sample)[rank]
