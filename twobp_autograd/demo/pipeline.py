"""The demo as a pipeline: the ResNet cut into one stage per rank, trained with 2BP, against
the same pipeline without 2BP.

Every rank builds the model from the same seed and keeps its own stage of two copies: one
runs the schedule with 2BP (backward-p1 in ``I``, the weight work in ``W``), the other the
same schedule with full backwards, each with its own runtime, process group and optimizer;
they share only the data. Rank 0 measures the steps and prints.

Without torchrun the demo starts its own ranks on this machine (gloo on 127.0.0.1); under
torchrun it uses the ranks it is given.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from ..pipeline import PipelineRuntime, StepReport, plot_timeline, schedule, split_model
from ..pipeline.launch import process_group
from ..pipeline.split import agreed_block_costs, blocks_of
from ..pipeline.trace import Event
from .data import MODELS, build_resnet, load_digits_32
from .summary import setting, summary
from .training import Side, steps_per_epoch, train

__all__ = ["rank_main"]

TIMEOUT = 600.0


def rank_main(args: argparse.Namespace) -> None:
    with process_group(timeout=TIMEOUT, backend="gloo" if args.device == "cpu" else None) as device:
        _train(args, device)


class StageSide(Side):
    """This rank's stage of one of the two pipelines."""

    def __init__(self, name: str, stage: nn.Module, runtime: PipelineRuntime, lr: float) -> None:
        super().__init__(name)
        self.stage, self.runtime = stage, runtime
        self.optimizer = torch.optim.Adam(stage.parameters(), lr=lr)
        self.timeline: list[list[Event]] | None = None  # every rank's events in the last step

    def parameters(self) -> list[tuple[str, Tensor]]:
        return list(self.stage.named_parameters())

    def most_over_ranks(self, value: float) -> float:
        device = next((p.device for p in self.stage.parameters()), torch.device("cpu"))
        most = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.runtime.group)
        return float(most)

    def step(self, x: Tensor, y: Tensor) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        self.optimizer.zero_grad(set_to_none=True)
        report = self.runtime.step(x if rank == 0 else None, y if rank == world - 1 else None)
        self.optimizer.step()
        if isinstance(report, StepReport):
            self.step_seconds.append(report.step_time)
            assert report.loss is not None  # the last stage's loss, which rank 0 reports
            self.losses.append(report.loss)
            self.timeline = [m.events for m in report.ranks]

    @torch.no_grad()
    def test_accuracy(self, x: Tensor, y: Tensor, batch: int = 128) -> float:
        """The stages in eval mode: each chunk's activations go rank to rank (shape first),
        the last rank counts the correct predictions and tells everyone."""
        rank, world = dist.get_rank(), dist.get_world_size()
        self.stage.eval()
        correct = torch.zeros((), dtype=torch.int64, device=x.device)
        try:
            for start in range(0, len(y), batch):
                inputs = x[start : start + batch] if rank == 0 else _receive(rank - 1, x.device)
                out = self.stage(inputs)
                if rank < world - 1:
                    _send(out, rank + 1)
                else:
                    correct += (out.argmax(1) == y[start : start + batch]).sum()
        finally:
            self.stage.train()
        dist.broadcast(correct, src=world - 1)
        return int(correct) / len(y)


def _send(tensor: Tensor, dst: int) -> None:
    shape = torch.zeros(8, dtype=torch.int64, device=tensor.device)
    shape[: tensor.dim()] = torch.tensor(tensor.shape)
    dist.send(shape, dst=dst)
    dist.send(tensor.contiguous(), dst=dst)


def _receive(src: int, device: torch.device) -> Tensor:
    shape = torch.zeros(8, dtype=torch.int64, device=device)
    dist.recv(shape, src=src)
    tensor = torch.empty([int(d) for d in shape if d > 0], device=device)
    dist.recv(tensor, src=src)
    return tensor


def _own_group(world: int) -> dist.ProcessGroup:
    """A group of every rank for one runtime: its own messages, nothing shared."""
    group = dist.new_group(list(range(world)))
    assert isinstance(group, dist.ProcessGroup)  # every rank is a member, so never NON_GROUP_MEMBER
    return group


def _sides(model: nn.Module, args: argparse.Namespace, sample: Tensor) -> list[StageSide]:
    """Both pipelines' stages of this rank, cut at the same blocks (by forward+backward time
    averaged over the ranks), the plain one from a copy of the same initial weights."""
    rank, world = dist.get_rank(), dist.get_world_size()
    costs = agreed_block_costs(blocks_of(model), sample)
    copies = (
        [("2BP", True, model)] if args.no_compare else [("2BP", True, model), ("plain", False, copy.deepcopy(model))]
    )
    sides = []
    for name, twobp, whole in copies:
        stage = split_model(whole, world, costs=costs)[rank]
        runtime = PipelineRuntime(
            stage,
            schedule(args.schedule, world, args.micro_batches, twobp)[rank],
            num_micro_batches=args.micro_batches,
            loss_fn=F.cross_entropy,
            twobp=twobp,
            group=_own_group(world),
            device=sample.device,
            timeout=TIMEOUT,
        )
        sides.append(StageSide(name, stage, runtime, args.lr))
    return sides


def _train(args: argparse.Namespace, device: torch.device) -> None:
    first, world = dist.get_rank() == 0, dist.get_world_size()
    data = load_digits_32(args.seed).to(device)
    model = build_resnet(args.model, args.seed).to(device)
    num_parameters = sum(p.numel() for p in model.parameters())
    sides = _sides(model, args, data.train_x[: max(1, args.batch_size // args.micro_batches)])
    del model  # the other ranks' blocks
    if first:
        how = f" as a {world}-stage pipeline, schedule {args.schedule}, 2BP against the same pipeline without it"
        threads = f"{torch.get_num_threads()} thread(s) per rank"
        print(setting(args, data, num_parameters, how, steps_per_epoch(args, len(data.train_y)), threads), flush=True)
    train(sides, data, args, reporting=first)
    if first:
        print(summary(sides, args.batch_size))
        if args.timeline and sides[0].timeline is not None:
            title = f"{MODELS[args.model]}, {world} stages, {args.schedule}, 2BP (last step)"
            plot_timeline(sides[0].timeline, args.timeline, title=title)
            print(f"  timeline of the last 2BP step written to {args.timeline}")
