"""The demo as a pipeline: the ResNet cut into one stage per rank, trained with 2BP on the
digits, step for step against the same pipeline without 2BP.

Every rank builds the model from the same seed and keeps its own stage of two copies: one
runs the schedule with 2BP (backward-p1 in ``I``, the weight work in ``W``), the other the
same schedule with full backwards, each with its own runtime, process group and optimizer;
they share only the data. Their steps alternate (A B A B, and which goes first), so a slow
patch of a shared machine lands on both; samples/s compares their median step times.

Without torchrun the demo starts its own ranks on this machine (gloo on 127.0.0.1, one
thread each); under torchrun it uses the ranks it is given.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from .pipeline.launch import run_as_ranks, threads_per_rank
from .demo import MODELS, IMAGE_SIZE, build_resnet, load_digits_32, steps_per_epoch

__all__ = ["main"]


def main(args: argparse.Namespace) -> None:
    # Under torchrun the ranks it started are the stages; else --stages local ranks.
    run_as_ranks(_rank_main, args, args.stages)


def _rank_main(args: argparse.Namespace) -> None:
    from .pipeline.runtime import init_distributed

    torch.set_num_threads(threads_per_rank(int(os.environ["WORLD_SIZE"])))
    device = init_distributed(timeout=600.0, backend="gloo" if args.device == "cpu" else None)
    try:
        _train(args, device)
    finally:
        dist.destroy_process_group()


@dataclass
class Side:
    """One pipeline of the comparison on this rank: its stage, runtime, optimizer and steps."""

    name: str
    stage: nn.Module
    runtime: object  # PipelineRuntime (imported lazily with torch.distributed)
    optimizer: torch.optim.Optimizer
    step_seconds: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    accuracies: list[float] = field(default_factory=list)


def _train(args: argparse.Namespace, device: torch.device) -> None:
    from tqdm import tqdm

    from .pipeline.models import blocks_of, split_model
    from .pipeline.runtime import PipelineRuntime, StepReport
    from .pipeline.schedules import schedule
    from .pipeline.stages import measure_block_costs
    from .pipeline.trace import plot_timeline

    rank, world = dist.get_rank(), dist.get_world_size()
    first, last = rank == 0, rank == world - 1
    data = load_digits_32(args.seed)
    model = build_resnet(args.model, args.seed).to(device)
    reference = copy.deepcopy(model)  # same initial weights, stays on plain autograd
    num_parameters = sum(p.numel() for p in model.parameters())

    # Cut both copies at the same blocks, by forward+backward time averaged over the ranks
    # (each measures its own; they must agree).
    sample = data.train_x[: max(1, args.batch_size // args.micro_batches)].to(device)
    costs = torch.tensor(measure_block_costs(blocks_of(model), sample), dtype=torch.float64, device=device)
    dist.all_reduce(costs)
    costs = (costs / world).tolist()
    sides = []
    for name, twobp, whole in (("2BP", True, model), ("plain", False, reference)):
        stage = split_model(whole, world, costs=costs).stages[rank].to(device)
        runtime = PipelineRuntime(
            stage,
            schedule(args.schedule, world, args.micro_batches, twobp)[rank],
            num_micro_batches=args.micro_batches,
            loss_fn=F.cross_entropy,
            twobp=twobp,
            group=dist.new_group(list(range(world))),  # its own messages, nothing shared
            device=device,
            timeout=600.0,
        )
        sides.append(Side(name, stage, runtime, torch.optim.Adam(stage.parameters(), lr=args.lr)))
    if args.no_compare:
        sides = sides[:1]
    del model, reference  # the other ranks' blocks

    train_x, train_y = data.train_x.to(device), data.train_y.to(device)
    steps = steps_per_epoch(args, len(train_y))
    if first:
        print(
            f"{MODELS[args.model]} ({num_parameters / 1e6:.1f} M parameters) as a {world}-stage pipeline, "
            f"schedule {args.schedule}, 2BP against the same pipeline without it; digits {IMAGE_SIZE}x{IMAGE_SIZE}: "
            f"{len(train_y)} train / {len(data.test_y)} test; {steps} steps/epoch of {args.batch_size} in "
            f"{args.micro_batches} micro-batches; device {device}, {torch.get_num_threads()} thread(s) per rank",
            flush=True,
        )
    shuffle = torch.Generator().manual_seed(args.seed)  # the same order on every rank
    step_index = 0
    timeline = None
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(len(train_y), generator=shuffle).to(device)
        bar = tqdm(range(steps), desc=f"epoch {epoch}/{args.epochs}", leave=False, dynamic_ncols=True, disable=not first)
        for i in bar:
            batch = order[i * args.batch_size : (i + 1) * args.batch_size]
            inputs, targets = (train_x[batch] if first else None), (train_y[batch] if last else None)
            for side in sides if step_index % 2 == 0 else sides[::-1]:
                side.optimizer.zero_grad(set_to_none=True)
                report = side.runtime.step(inputs, targets)  # type: ignore[attr-defined]
                side.optimizer.step()
                if first:
                    assert isinstance(report, StepReport)
                    side.step_seconds.append(report.step_time)
                    side.losses.append(float(report.loss))  # type: ignore[arg-type]
                    if side.name == "2BP":
                        timeline = [m.events for m in report.ranks]
            step_index += 1
            if first:
                bar.set_postfix(loss=f"{sides[0].losses[-1]:.3f}", s_per_step=f"{sides[0].step_seconds[-1]:.2f}")
        bar.close()
        line = f"epoch {epoch}:"
        for side in sides:
            side.accuracies.append(_pipelined_accuracy(side.stage, data.test_x.to(device), data.test_y.to(device), device))
            if first:
                line += (
                    f"  {side.name} loss {statistics.fmean(side.losses[-steps:]):.4f} test acc "
                    f"{side.accuracies[-1]:.1%} {args.batch_size / statistics.median(side.step_seconds[-steps:]):.1f} samples/s"
                )
        if first:
            print(line, flush=True)
    if first:
        _summary(sides, args.batch_size)
        if args.timeline and timeline is not None:
            title = f"{MODELS[args.model]}, {world} stages, {args.schedule}, 2BP (last step)"
            plot_timeline(timeline, args.timeline, title=title)
            print(f"  timeline of the last 2BP step written to {args.timeline}")


def _summary(sides: list[Side], batch_size: int) -> None:
    # The first step of each side pays one-off allocations; leave it out when there are more.
    def settled(seconds: list[float]) -> list[float]:
        return seconds[1:] if len(seconds) > 1 else seconds

    print("\nsummary")
    for side in sides:
        rate = batch_size / statistics.median(settled(side.step_seconds))
        print(f"  {side.name:5} final test accuracy {side.accuracies[-1]:.1%} (chance 10%), {rate:.2f} samples/s")
    if len(sides) == 2:
        first = abs(sides[0].losses[0] - sides[1].losses[0]) / abs(sides[1].losses[0])
        print(f"  first-step losses agree to {first:.1e} (relative; later steps drift at the rounding level)")
        ratios = [b / a for a, b in zip(settled(sides[0].step_seconds), settled(sides[1].step_seconds))]
        print(f"  median per-step throughput ratio 2BP/plain {statistics.median(ratios):.3f}")


@torch.no_grad()
def _pipelined_accuracy(stage: nn.Module, x: Tensor, y: Tensor, device: torch.device, batch: int = 128) -> float:
    """Test accuracy with the stages in eval mode: each chunk's activations go rank to rank
    (shape first), the last rank counts the correct predictions and tells everyone."""
    rank, world = dist.get_rank(), dist.get_world_size()
    stage.eval()
    correct = torch.zeros((), dtype=torch.int64, device=device)
    try:
        for start in range(0, len(y), batch):
            if rank == 0:
                inputs = x[start : start + batch]
            else:
                shape = torch.zeros(8, dtype=torch.int64, device=device)
                dist.recv(shape, src=rank - 1)
                inputs = torch.empty([int(d) for d in shape if d > 0], device=device)
                dist.recv(inputs, src=rank - 1)
            out = stage(inputs)
            if rank < world - 1:
                shape = torch.zeros(8, dtype=torch.int64, device=device)
                shape[: out.dim()] = torch.tensor(out.shape)
                dist.send(shape, dst=rank + 1)
                dist.send(out.contiguous(), dst=rank + 1)
            else:
                correct += (out.argmax(1) == y[start : start + batch]).sum()
    finally:
        stage.train()
    dist.broadcast(correct, src=world - 1)
    return int(correct) / len(y)
