"""``bench pipeline``: throughput, bubble and memory of each schedule with 2BP on and off.

    torchrun --nproc-per-node 2 -m twobp_autograd bench pipeline --model mlp --schedule all
    python -m twobp_autograd bench pipeline --nproc 2 ...     # spawns the ranks itself

Every rank builds the same model from one seed (:mod:`.zoo`) and keeps its own stage
(balanced by measured block time, averaged over ranks so that all cut alike). The runs of one
schedule alternate 2BP off and on step by step (A B A B), so that drift of a shared, noisy
machine falls on both sides of each ratio. Rank 0 prints a table, and on request writes the
JSON of every step and, for the last step of each run, a Chrome trace and a PNG timeline
(:mod:`.bench_report`).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from .. import WeightGradQueue
from . import SCHEDULES, PipelineRuntime, StepReport, bench_report, default_num_micro_batches, schedule
from .launch import process_group, run_as_ranks
from .split import TiedGradients, agreed_block_costs, blocks_of, defer_norms, parameter_costs, split_model
from .zoo import DEFAULT_BATCH, MODELS, add_model_arguments, build_model

__all__ = ["MODELS", "main", "parse_args"]  # MODELS: the --model choices

Run = tuple[str, bool]  # (schedule, 2BP on)


def parse_args(argv: "Sequence[str] | None") -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="twobp_autograd bench pipeline", description=__doc__.split("\n\n")[0])
    add_model_arguments(parser, batch_size=None, batch_help="samples per step (default per model)")
    parser.add_argument("--schedule", choices=(*SCHEDULES, "all"), default="all")
    parser.add_argument("--twobp", choices=("on", "off", "both"), default="both")
    parser.add_argument("--steps", type=int, default=5, help="measured steps per run (after --warmup)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured steps per run first")
    parser.add_argument("--micro-batches", type=int, default=None, help="default: the schedule's (p, or 2p for 1f1b-2 and zb)")
    parser.add_argument("--balance", choices=("time", "params"), default="time", help="what stages are balanced by")
    parser.add_argument("--json", default=None, help="write every step's metrics here (rank 0)")
    parser.add_argument("--trace", default=None, help="directory for Chrome traces and PNG timelines")
    parser.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not launched by torchrun")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads per rank (default: cores / ranks)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds any rank waits for a peer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--offload", action="store_true", help="2BP: park pending W in pinned host memory (CUDA)")
    parser.add_argument("--weight-grad-streams", type=int, default=1, help="2BP: CUDA streams a flush spreads W over")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be at least 1 and --warmup at least 0")
    return args


def main(argv: "Sequence[str] | None" = None) -> int:
    argv = list(argv) if argv is not None else None
    if argv and argv[0] == "pipeline":  # tolerate the sub-command name being passed along
        argv = argv[1:]
    args = parse_args(argv)
    run_as_ranks(_rank_main, args, args.nproc)
    return 0


def _rank_main(args: argparse.Namespace) -> None:
    with process_group(timeout=args.timeout, threads=args.threads) as device:
        _benchmark(args, device)


def _benchmark(args: argparse.Namespace, device: torch.device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, make_batch, loss_fn = build_model(args.model, args, seed=args.seed)
    model.to(device)
    defer_norms(model)  # Llama's and Mamba's own RMSNorms defer their weight gradients too
    batch_size = args.batch_size or DEFAULT_BATCH[args.model]
    inputs, targets = make_batch(batch_size, torch.Generator().manual_seed(args.seed + 1))
    inputs, targets = inputs.to(device), targets.to(device)

    schedules = list(SCHEDULES) if args.schedule == "all" else [args.schedule]
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.twobp]
    runs = [(name, twobp) for name in schedules for twobp in modes]
    num_micro = {name: args.micro_batches or default_num_micro_batches(name, world) for name in schedules}

    blocks = blocks_of(model)
    sample = inputs[: math.ceil(batch_size / max(num_micro.values()))]
    costs = parameter_costs(blocks) if args.balance == "params" else agreed_block_costs(blocks, sample)
    pipeline = split_model(model, world, costs=costs)
    stage = pipeline[rank]
    tied = TiedGradients(pipeline)  # embeddings shared by the first and last rank
    del model, pipeline, blocks  # the other ranks' blocks
    runtimes = {
        (name, twobp): PipelineRuntime(
            stage,
            schedule(name, world, num_micro[name], twobp)[rank],
            num_micro_batches=num_micro[name],
            loss_fn=loss_fn,
            twobp=twobp,
            device=device,
            timeout=args.timeout,
            queue=WeightGradQueue(offload_to_host=args.offload, weight_grad_streams=args.weight_grad_streams) if twobp else None,
        )
        for name, twobp in runs
    }
    reports = _measure(args, runtimes, stage, tied, inputs if rank == 0 else None, targets if rank == world - 1 else None)
    if rank == 0:
        bench_report.report(args, reports, num_micro, batch_size, costs, device)


def _measure(
    args: argparse.Namespace,
    runtimes: dict[Run, PipelineRuntime],
    stage: nn.Module,
    tied: TiedGradients,
    inputs: "torch.Tensor | None",
    targets: "torch.Tensor | None",
) -> dict[Run, list[StepReport]]:
    """Every run's steps, taking turns step by step; rank 0's reports of the measured ones."""
    progress = None
    if dist.get_rank() == 0 and not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(total=(args.warmup + args.steps) * len(runtimes), desc=f"{args.model} x{dist.get_world_size()}", unit="step")
    reports: dict[Run, list[StepReport]] = {run: [] for run in runtimes}
    for step in range(args.warmup + args.steps):
        for run, runtime in runtimes.items():  # A B A B: each schedule's off and on runs take turns
            report = runtime.step(inputs, targets)
            tied.all_reduce()
            for p in stage.parameters():
                p.grad = None
            if progress is not None:
                progress.update()
            if isinstance(report, StepReport) and step >= args.warmup:
                reports[run].append(report)
    if progress is not None:
        progress.close()
    return reports


if __name__ == "__main__":
    raise SystemExit(main())
