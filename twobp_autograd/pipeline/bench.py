"""``bench pipeline``: throughput, bubble and memory of each schedule with 2BP on and off.

    torchrun --nproc-per-node 2 -m twobp_autograd bench pipeline --model mlp --schedule all
    python -m twobp_autograd bench pipeline --nproc 2 ...     # spawns the ranks itself

Every rank builds the same model from one seed (:mod:`.zoo`) and keeps its own stages
(balanced by the block times that run: patched F + I + W at the schedule's micro-batch size
with 2BP on, plain F + B off, averaged over ranks so that all cut alike). Every run takes its
turn step by step (A B C A B C ..., the order rotating each round), so that drift of a shared,
noisy machine falls on all sides of each ratio. ``--baseline torch`` adds PyTorch's own
schedules (:mod:`.torch_baseline`) on the same modules and micro-batches, and every row's
ratio to PyTorch's GPipe. Rank 0 prints a table, and on request writes the
JSON of every step and, for the last step of each run, a Chrome trace and a PNG timeline
(:mod:`.bench_report`).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from .. import WeightGradQueue
from . import (
    MULTI_STAGE_SCHEDULES,
    SCHEDULES,
    PipelineRuntime,
    RankMetrics,
    StepReport,
    bench_report,
    default_num_micro_batches,
    placement,
    schedule,
)
from .launch import process_group, run_as_ranks
from .split import (
    PipelineModel,
    TiedGradients,
    agreed_block_costs,
    blocks_of,
    defer_norms,
    parameter_costs,
    split_model,
)
from .torch_baseline import TORCH_SCHEDULES, TorchPipeline, stage_examples, timed, torch_placement
from .zoo import DEFAULT_BATCH, MODELS, add_model_arguments, build_model

__all__ = ["MODELS", "main", "parse_args"]  # MODELS: the --model choices

Run = tuple[str, bool]  # (schedule, 2BP on)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m twobp_autograd bench pipeline", description=__doc__.split("\n\n")[0]
    )
    add_model_arguments(parser, batch_size=None, batch_help="samples per step (default per model)")
    parser.add_argument(
        "--schedule", type=_schedule_spec, default=["all"], nargs="+", metavar="NAME",
        help=f"{', '.join((*SCHEDULES, *MULTI_STAGE_SCHEDULES))} or all; zb:N and zbv:N bound the micro-batches "
        "waiting for their W at N (max_pending), so that bounds compare in one run",
    )
    parser.add_argument("--baseline", choices=("none", "torch"), default="none", help="torch: PyTorch's schedules too")
    parser.add_argument("--twobp", choices=("on", "off", "both"), default="both")
    parser.add_argument("--steps", type=int, default=5, help="measured steps per run (after --warmup)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured steps per run first")
    parser.add_argument(
        "--micro-batches", type=int, default=None, help="default: the schedule's (p, or 2p for 1f1b-2 and zb)"
    )
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
    for flag in ("micro_batches", "batch_size", "width", "depth", "seq_len", "image_size", "threads"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    if args.nproc < 1 or args.weight_grad_streams < 1:
        parser.error("--nproc and --weight-grad-streams must be at least 1")
    if args.offload and not torch.cuda.is_available():
        parser.error("--offload parks pending W in pinned host memory: it needs CUDA")
    batch_size = args.batch_size or DEFAULT_BATCH[args.model]
    if args.micro_batches is not None and args.micro_batches > batch_size:
        parser.error(
            f"--micro-batches {args.micro_batches} is more than the {batch_size} samples of a step (--batch-size)"
        )
    ranks = int(os.environ.get("WORLD_SIZE", args.nproc)) if "RANK" in os.environ else args.nproc
    interleaved = {"interleaved-1f1b", "all"} & {_schedule_of(spec)[0] for spec in args.schedule}
    if interleaved and args.micro_batches is not None and args.micro_batches % ranks:
        parser.error(
            f"interleaved-1f1b runs micro-batches in groups of the {ranks} ranks: --micro-batches "
            f"{args.micro_batches} is not a multiple (or leave interleaved-1f1b out of --schedule)"
        )
    if args.baseline == "torch" and args.micro_batches is None:
        # Each of our schedules has its own default; PyTorch's would run at another.
        parser.error("--baseline torch compares every schedule at one micro-batch count: give --micro-batches")
    if args.baseline == "torch":
        m = args.micro_batches
        # PyTorch's stages are built for one micro-batch shape (a smaller last one fails mid-step,
        # its loss broadcast against the target first), and its schedules refuse some counts.
        if batch_size % m:
            parser.error(
                f"--baseline torch: PyTorch's stages take micro-batches of one shape; the {batch_size} samples "
                f"(--batch-size) do not divide into --micro-batches {m}"
            )
        if m < ranks:
            parser.error(f"--baseline torch: PyTorch's 1F1B needs at least one micro-batch per rank ({ranks}), not {m}")
        if m % (m // ranks):
            parser.error(
                f"--baseline torch: PyTorch's interleaved schedules run m // ranks = {m // ranks} rounds, which must "
                f"divide --micro-batches {m}"
            )
    chosen = [_schedule_of(spec)[0] for spec in args.schedule]
    names = [*SCHEDULES, *MULTI_STAGE_SCHEDULES] if "all" in chosen else chosen
    stages = max(len(placement(name, ranks)) for name in names)
    blocks = len(blocks_of(build_model(args.model, args, seed=args.seed)[0]))
    if stages > blocks:
        parser.error(
            f"{stages} stages on {ranks} ranks (--nproc; zbv and interleaved-1f1b put 2 on each) but the "
            f"{args.model} model has {blocks} blocks to cut: give fewer ranks or a deeper model (--depth)"
        )
    if args.json and os.path.isdir(args.json):
        parser.error(f"--json {args.json!r} is a directory: name the file to write")
    if args.trace and os.path.exists(args.trace) and not os.path.isdir(args.trace):
        parser.error(f"--trace {args.trace!r} is a file: name a directory for the traces")
    return args


def _schedule_spec(text: str) -> str:
    name, colon, bound = text.partition(":")
    if name not in (*SCHEDULES, *MULTI_STAGE_SCHEDULES, "all"):
        raise argparse.ArgumentTypeError(f"unknown schedule {name!r}")
    if colon and (name not in ("zb", "zbv") or not bound.isdigit() or int(bound) < 1):
        raise argparse.ArgumentTypeError(f"{text!r}: only zb:N and zbv:N take a bound, N >= 1")
    return text


def _schedule_of(spec: str) -> tuple[str, int | None]:
    """``"zb:4"`` -> ``("zb", 4)``; a plain name has no bound."""
    name, _, bound = spec.partition(":")
    return name, int(bound) if bound else None


def main(argv: Sequence[str] | None = None) -> int:
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

    chosen = [args.schedule] if isinstance(args.schedule, str) else list(args.schedule)
    schedules = [*SCHEDULES, *MULTI_STAGE_SCHEDULES] if "all" in chosen else chosen
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.twobp]
    runs = [(name, twobp) for name in schedules for twobp in modes]
    num_micro = {
        name: args.micro_batches or default_num_micro_batches(_schedule_of(name)[0], world) for name in schedules
    }
    splits = _Splits(args, model, inputs, batch_size)
    runtimes: dict[Run, PipelineRuntime | TorchPipeline] = {}
    for name, twobp in runs:
        base, max_pending = _schedule_of(name)
        owners = placement(base, world)
        pipeline = splits.get(len(owners), num_micro[name], twobp)
        mine = {index: pipeline[index] for index, owner in enumerate(owners) if owner == rank}
        runtime = runtimes[name, twobp] = PipelineRuntime(
            mine if len(mine) > 1 else mine[rank],
            schedule(base, world, num_micro[name], twobp, max_pending=max_pending)[rank],
            num_micro_batches=num_micro[name],
            loss_fn=loss_fn,
            twobp=twobp,
            device=device,
            timeout=args.timeout,
            queue=_queues(args, mine) if twobp else None,
            placement=owners,
        )
        runtime.step_peak_rss = True  # the bench's own process: its rows compare by step
    if args.baseline == "torch":
        m = args.micro_batches  # given (parse_args): the same count as ours
        micro_batch = inputs[: -(-batch_size // m)]
        for name in TORCH_SCHEDULES:
            owners = torch_placement(name, world)
            pipeline = splits.get(len(owners), m, False)
            mine = {index: pipeline[index] for index, owner in enumerate(owners) if owner == rank}
            examples = stage_examples(pipeline.stages, micro_batch)
            runtimes[name, False] = TorchPipeline.build(name, mine, examples, m, loss_fn, device)
            num_micro[name] = m
    # embeddings shared by the first and last rank
    tied = TiedGradients(splits.get(world, num_micro[schedules[0]], modes[0]))
    reports, wall = _measure(args, runtimes, model, tied, inputs if rank == 0 else None, targets)
    if rank == 0:
        bench_report.report(args, reports, num_micro, batch_size, splits.costs_used, device, wall)


class _Splits:
    """The model cut into n stages, balanced on the block costs at one micro-batch size with
    2BP on or off; each measured once (a collective) and cut once. The cuts share the model's
    modules: no parameter is copied."""

    def __init__(self, args: argparse.Namespace, model: nn.Module, inputs: torch.Tensor, batch_size: int) -> None:
        self.args, self.model, self.inputs, self.batch_size = args, model, inputs, batch_size
        self.blocks = blocks_of(model)
        self.costs: dict[tuple[int, bool], list[float]] = {}
        self.cuts: dict[tuple[int, tuple[float, ...]], PipelineModel] = {}
        self.costs_used: list[float] = []

    def get(self, num_stages: int, num_micro_batches: int, twobp: bool) -> PipelineModel:
        size = -(-self.batch_size // num_micro_batches)
        if self.args.balance == "params":
            costs = parameter_costs(self.blocks)
        else:
            if (size, twobp) not in self.costs:
                self.costs[size, twobp] = agreed_block_costs(self.blocks, self.inputs[:size], twobp=twobp)
            costs = self.costs[size, twobp]
        self.costs_used = self.costs_used or costs  # the JSON's block_costs: the first run's cut
        key = (num_stages, tuple(costs))
        if key not in self.cuts:
            self.cuts[key] = split_model(self.model, num_stages, costs=costs)
        return self.cuts[key]


def _queues(args: argparse.Namespace, stages: dict[int, nn.Module]) -> dict[int, WeightGradQueue]:
    return {
        index: WeightGradQueue(offload_to_host=args.offload, weight_grad_streams=args.weight_grad_streams)
        for index in stages
    }


def _measure(
    args: argparse.Namespace,
    runtimes: dict[Run, PipelineRuntime | TorchPipeline],
    model: nn.Module,
    tied: TiedGradients,
    inputs: torch.Tensor | None,
    targets: torch.Tensor,
) -> tuple[dict[Run, list[StepReport]], dict[Run, list[float]]]:
    """Every run's steps, taking turns step by step in an order that rotates each round; rank
    0's reports of the measured ones, and every run's wall time per step (between barriers)."""
    progress = None
    if dist.get_rank() == 0 and not args.no_progress:
        from tqdm import tqdm

        total, desc = (args.warmup + args.steps) * len(runtimes), f"{args.model} x{dist.get_world_size()}"
        progress = tqdm(total=total, desc=desc, unit="step")
    reports: dict[Run, list[StepReport]] = {run: [] for run in runtimes if isinstance(runtimes[run], PipelineRuntime)}
    wall: dict[Run, list[float]] = {run: [] for run in runtimes}
    order = list(runtimes)
    for step in range(args.warmup + args.steps):
        shift = step % len(order)
        for run in order[shift:] + order[:shift]:
            runtime = runtimes[run]
            last = runtime.last if isinstance(runtime, PipelineRuntime) else runtime.num_stages - 1 in runtime.modules
            seconds, result = _timed_step(runtime, inputs, targets if last else None)
            tied.all_reduce()
            for p in model.parameters():
                p.grad = None
            if progress is not None:
                progress.update()
            if step >= args.warmup:
                wall[run].append(seconds)
                if isinstance(result, StepReport):
                    reports[run].append(result)
    if progress is not None:
        progress.close()
    return reports, wall


def _timed_step(
    runtime: PipelineRuntime | TorchPipeline, inputs: torch.Tensor | None, targets: torch.Tensor | None
) -> tuple[float, object]:
    """One step of ``runtime`` between barriers: its seconds and what its step returned."""
    if isinstance(runtime, PipelineRuntime):
        # The metrics go to rank 0 after the clock stops: PyTorch's steps gather none, and on a
        # small model the gather (pickled timelines, two messages a rank) doubled the step time.
        pipeline, metrics = runtime, list[RankMetrics]()
        # Without gather, a step returns this rank's metrics.
        seconds = timed(lambda: metrics.append(cast(RankMetrics, pipeline.step(inputs, targets, gather=False))))
        return seconds, pipeline.gather_report(metrics[0])
    seconds = timed(lambda: runtime.step(inputs, targets))
    return seconds, None


if __name__ == "__main__":
    raise SystemExit(main())
