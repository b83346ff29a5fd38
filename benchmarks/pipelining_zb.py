"""PyTorch's zero-bubble schedules with 2BP's deferred W (``dw_builder``) against the same
schedules with PyTorch's own autograd-graph split of I and W (stages unpatched).

Two gloo ranks on this machine, one thread each, four stages (two per rank). Both variants are
built side by side from one model and measured in interleaved rounds (the order alternates
each round), so machine noise hits both alike; the median step times and their ratio are
printed and written to a JSON file. Every variant's gradients are first checked against each
other, so a faster but wrong W cannot pass unnoticed.

    python benchmarks/pipelining_zb.py --schedule zbv --micro-batches 4
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from local_ranks import count  # beside this script
from torch import nn

import twobp_autograd as twobp
from twobp_autograd.pipeline import dw_builder, split_model
from twobp_autograd.pipeline.launch import process_group, run_as_ranks
from twobp_autograd.pipeline.torch_baseline import (
    TORCH_SCHEDULES,
    TorchPipeline,
    stage_examples,
    timed,
    torch_placement,
)

WORLD = 2
STAGES = 4
SCHEDULES = {"interleaved_zb": "torch-interleaved-zb", "zbv": "torch-zbv"}  # -> torch_baseline's names
VARIANTS = ("twobp", "torch")


def make_model(width: int, hidden: int, blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *(
            nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width), nn.LayerNorm(width))
            for _ in range(blocks)
        )
    )


def build(variant: str, args: argparse.Namespace, rank: int) -> tuple[TorchPipeline, dict[int, nn.Module]]:
    """The schedule over this rank's stages (equal runs of blocks), each variant on its own copy."""
    name = SCHEDULES[args.schedule]
    model = make_model(args.width, args.hidden, args.blocks)
    pipeline = split_model(model, STAGES, costs=[1.0] * args.blocks)
    examples = stage_examples(pipeline.stages, torch.zeros(args.batch // args.micro_batches, args.seq, args.width))
    owners = torch_placement(name, WORLD)
    modules = {index: copy.deepcopy(pipeline[index]) for index, owner in enumerate(owners) if owner == rank}
    builders = None
    if variant == "twobp":
        builders = {index: dw_builder(twobp.patch(module)) for index, module in modules.items()}
    schedule = TorchPipeline.build(
        name, modules, examples, args.micro_batches, F.mse_loss, torch.device("cpu"), dw_builders=builders
    )
    return schedule, modules


def timed_step(
    schedule: TorchPipeline, modules: dict[int, nn.Module], inputs: torch.Tensor, targets: torch.Tensor
) -> float:
    for module in modules.values():
        module.zero_grad(set_to_none=True)
    return timed(lambda: schedule.step(inputs, targets))


def worst_relative_difference(a: dict[int, nn.Module], b: dict[int, nn.Module]) -> float:
    worst = 0.0
    for index in a:
        for p, q in zip(a[index].parameters(), b[index].parameters(), strict=True):
            assert p.grad is not None and q.grad is not None
            worst = max(worst, ((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-30)).item())
    return worst


def worker(args: argparse.Namespace) -> None:
    with process_group(timeout=300.0, backend="gloo", threads=args.threads):
        rank = dist.get_rank()
        times, difference, deferred_jobs = measure(args, rank)
    if rank == 0:
        report(args, times, difference, deferred_jobs)


def measure(args: argparse.Namespace, rank: int) -> tuple[dict[str, list[float]], float, int]:
    """Each variant's step times (interleaved rounds after a warm-up), the worst relative
    gradient difference between them, and the jobs 2BP deferred in the warm-up."""
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(args.batch, args.seq, args.width, generator=generator)
    targets = torch.randn(args.batch, args.seq, args.width, generator=generator)
    built = {variant: build(variant, args, rank) for variant in VARIANTS}

    for _ in range(args.warmup):
        for variant in VARIANTS:
            timed_step(*built[variant], inputs, targets)
    difference = torch.tensor([worst_relative_difference(built["twobp"][1], built["torch"][1])])
    dist.all_reduce(difference, op=dist.ReduceOp.MAX)
    builders = [dw_builder(module) for module in built["twobp"][1].values()]  # the builders given at build time
    deferred_jobs = torch.tensor([sum(b.jobs_built for b in builders)])
    dist.all_reduce(deferred_jobs)
    if deferred_jobs.item() == 0:
        raise RuntimeError("the 2BP variant deferred nothing: its stages were not patched")

    times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    for round_index in range(args.rounds):
        order = VARIANTS if round_index % 2 == 0 else VARIANTS[::-1]
        for variant in order:
            times[variant].append(timed_step(*built[variant], inputs, targets))
    return times, difference.item(), int(deferred_jobs.item())


def report(args: argparse.Namespace, times: dict[str, list[float]], difference: float, deferred_jobs: int) -> None:
    medians = {variant: statistics.median(ts) for variant, ts in times.items()}
    # Per round, the two variants ran back to back: their ratio is robust to slow drifts in load.
    paired = statistics.median(t / o for t, o in zip(times["torch"], times["twobp"], strict=True))
    result = {
        "benchmark": "pipelining_zb",
        "schedule": TORCH_SCHEDULES[SCHEDULES[args.schedule]][0],
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "ranks": WORLD,
        "stages": STAGES,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "step_seconds": times,
        "median_step_seconds": medians,
        "speedup_twobp_over_torch_split": medians["torch"] / medians["twobp"],
        "median_paired_speedup": paired,
        "worst_relative_grad_difference": difference,
        "deferred_jobs_in_warmup": deferred_jobs,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{result['schedule']}, m={args.micro_batches}, {args.rounds} interleaved rounds: "
        f"median step {medians['twobp']:.3f} s with 2BP's deferred W, {medians['torch']:.3f} s with "
        f"PyTorch's split W -> speedup {result['speedup_twobp_over_torch_split']:.3f}x "
        f"(median of per-round ratios {paired:.3f}x) "
        f"(gradients agree to {difference:.1e} relative); wrote {out}"
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="zbv")
    parser.add_argument("--micro-batches", type=count(), default=4)
    parser.add_argument("--batch", type=count(), default=32, help="samples per step (split into micro-batches)")
    parser.add_argument("--seq", type=count(), default=64)
    parser.add_argument("--width", type=count(), default=512)
    parser.add_argument("--hidden", type=count(), default=2048)
    parser.add_argument(
        "--blocks", type=count(), default=8, help="Linear-GELU-Linear-LayerNorm blocks, split over 4 stages"
    )
    parser.add_argument("--warmup", type=count(1), default=2, help="untimed steps per variant")
    parser.add_argument("--rounds", type=count(), default=7, help="timed steps per variant, interleaved")
    parser.add_argument("--threads", type=count(), default=1, help="intra-op threads per rank")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "pipelining_zb.json"))
    args = parser.parse_args()
    if args.blocks % STAGES or args.batch % args.micro_batches:
        parser.error(f"--blocks must divide by {STAGES} and --batch by --micro-batches")
    return args


if __name__ == "__main__":
    run_as_ranks(worker, parse_args(), WORLD)
