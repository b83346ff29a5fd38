"""What bounding the weight-gradient queue costs: a schedule (1F1B-2 by default; ``--schedule
zbv`` for the V with two stages per rank) on two pipeline ranks with 2BP off, 2BP on, and 2BP on
with ``WeightGradQueue(max_pending_bytes=cap)`` (a rank with two stages gives each queue half).

Memory is the runtime's CPU peak: the process heap in use (glibc ``mallinfo2``: bytes in
allocated chunks, every arena and mmap, so tensors and autograd's saved activations alike),
sampled after every action of the schedule, minus the heap at the step's start (transients
inside an action, e.g. a flush's concatenation, are not seen; nor is the one micro-batch of
weight work a capped stage may hold beyond the cap inside a backward-p1 action, flushed once its
input-gradient send is posted). The queue's peak pending bytes
are recorded too. Peak RSS is process-wide and monotonic, so it is not split per run.

Unless ``--cap-mib`` is given, the cap is ``--cap-fraction`` of the 2BP-off peak of each rank,
measured first: pending work is what 2BP adds, so a cap of 10% aims at the target below.
Targets, reported and not enforced: capped peak <= 1.10x 2BP off, at >= 95% of uncapped 2BP
throughput. The runs alternate step by step (rotating the order) so noise falls on all alike.

    python benchmarks/memory.py --steps 10 [--schedule zbv]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from local_ranks import add_model_arguments, count, recorded_arguments, run_on_local_ranks, write_results

from twobp_autograd import WeightGradQueue
from twobp_autograd.pipeline import PipelineRuntime, RankMetrics, StepReport, placement, schedule, split_model
from twobp_autograd.pipeline.zoo import build_model

WORLD = 2
RUNS = ("2bp_off", "2bp_on", "2bp_capped")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser, batch_size=32)
    parser.add_argument(
        "--cap-mib", type=float, default=None, help="max_pending_bytes per rank (default: from --cap-fraction)"
    )
    parser.add_argument("--cap-fraction", type=float, default=0.10, help="cap as a fraction of the rank's 2BP-off peak")
    parser.add_argument("--schedule", choices=("1f1b-2", "zb", "interleaved-1f1b", "zbv"), default="1f1b-2")
    parser.add_argument("--steps", type=count(), default=6, help="measured steps per run")
    parser.add_argument("--warmup", type=count(0), default=1)
    parser.add_argument("--json", default=str(Path(__file__).parent / "results" / "memory.json"))
    return parser.parse_args()


def _benchmark(rank: int, args: argparse.Namespace) -> None:
    model, make_batch, loss_fn = build_model(args.model, args)
    owners = placement(args.schedule, WORLD)
    pipeline = split_model(model, len(owners))
    stages = {index: pipeline[index] for index, owner in enumerate(owners) if owner == rank}
    parameters = [p for stage in stages.values() for p in stage.parameters()]
    del model
    inputs, targets = make_batch(args.batch_size, torch.Generator().manual_seed(1))
    m = 2 * WORLD  # twice as many micro-batches as ranks, as 1F1B-2

    def runtime(twobp: bool, cap: int | None = None) -> PipelineRuntime:
        actions = schedule(args.schedule, WORLD, m, twobp)[rank]
        queues = {i: WeightGradQueue(max_pending_bytes=None if cap is None else cap // len(stages)) for i in stages}
        return PipelineRuntime(
            stages if len(stages) > 1 else stages[rank], actions, num_micro_batches=m, loss_fn=loss_fn,
            twobp=twobp, queue=queues if twobp else None, timeout=600.0, placement=owners,
        )  # fmt: skip

    def step(run: PipelineRuntime) -> tuple[RankMetrics, float | None]:
        """This rank's metrics, and the pipeline's step time (on rank 0)."""
        for p in parameters:
            p.grad = None
        report = run.step(inputs if run.first else None, targets if run.last else None)
        if isinstance(report, StepReport):
            return report.ranks[rank], report.step_time
        return report, None

    off = runtime(False)
    for _ in range(2):  # the second step shows the steady state
        off_peak = step(off)[0].peak_bytes
    cap = int(args.cap_mib * 2**20) if args.cap_mib is not None else int(args.cap_fraction * off_peak)
    runs = {
        "2bp_off": off,
        "2bp_on": runtime(True),
        "2bp_capped": runtime(True, cap),
    }

    measured: dict[str, list[dict[str, Any]]] = {name: [] for name in RUNS}
    for round_ in range(args.warmup + args.steps):
        shift = round_ % len(RUNS)
        for name in RUNS[shift:] + RUNS[:shift]:
            own, step_time = step(runs[name])
            if round_ >= args.warmup:
                measured[name].append(
                    {
                        "step_time": step_time,
                        "heap_peak_delta": own.peak_bytes,
                        "peak_pending_bytes": own.peak_pending_bytes,
                        "deferred_jobs": own.deferred_jobs,
                    }
                )
    gathered: list[Any] = [None] * WORLD
    dist.all_gather_object(gathered, {"rank": rank, "cap": cap, "runs": measured, "peak_rss": own.peak_rss})
    if rank == 0:
        _report(args, gathered)


def _report(args: argparse.Namespace, ranks: list[dict[str, Any]]) -> None:
    summary: dict[str, dict[str, Any]] = {}
    for name in RUNS:
        step_times = [s["step_time"] for s in ranks[0]["runs"][name]]
        summary[name] = {
            "step_time_median": statistics.median(step_times),
            "samples_per_s": args.batch_size / statistics.median(step_times),
            # per rank: the highest of its steps; the pipeline's peak is its highest rank
            "heap_peak_delta_per_rank": [max(s["heap_peak_delta"] for s in r["runs"][name]) for r in ranks],
            "peak_pending_bytes_per_rank": [max(s["peak_pending_bytes"] for s in r["runs"][name]) for r in ranks],
            "deferred_jobs_per_rank": [max(s["deferred_jobs"] for s in r["runs"][name]) for r in ranks],
        }
        summary[name]["heap_peak_delta"] = max(summary[name]["heap_peak_delta_per_rank"])
    caps = [r["cap"] for r in ranks]
    memory_ratio = summary["2bp_capped"]["heap_peak_delta"] / summary["2bp_off"]["heap_peak_delta"]
    throughput_ratio = summary["2bp_capped"]["samples_per_s"] / summary["2bp_on"]["samples_per_s"]
    targets = {
        "capped_peak_over_off": memory_ratio,
        "capped_peak_over_off_target": 1.10,
        "capped_throughput_over_uncapped": throughput_ratio,
        "capped_throughput_over_uncapped_target": 0.95,
        "met": memory_ratio <= 1.10 and throughput_ratio >= 0.95,
    }
    print(
        f"{args.model}, {args.schedule} on {WORLD} gloo ranks, batch {args.batch_size}, median of {args.steps} steps; "
        f"caps {[f'{c / 2**20:.1f} MiB' for c in caps]}"
    )
    print(f"  {'run':>11}  {'samples/s':>9}  {'peak heap delta MiB (per rank)':>32}  {'peak pending MiB':>18}")
    for name, row in summary.items():
        heap = ", ".join(f"{b / 2**20:.1f}" for b in row["heap_peak_delta_per_rank"])
        pending = ", ".join(f"{b / 2**20:.1f}" for b in row["peak_pending_bytes_per_rank"])
        print(f"  {name:>11}  {row['samples_per_s']:9.2f}  {heap:>32}  {pending:>18}")
    print(f"  capped peak / 2BP off peak: {memory_ratio:.3f} (target <= 1.10)")
    print(f"  capped / uncapped throughput: {throughput_ratio:.3f} (target >= 0.95)")
    document = {
        "arguments": recorded_arguments(args),
        "schedule": args.schedule,
        "memory_measure": "glibc mallinfo2 heap in use after each action, minus the step's start",
        "caps": caps,
        "summary": summary,
        "targets": targets,
        "peak_rss_per_rank": [r["peak_rss"] for r in ranks],
        "steps": {name: [r["runs"][name] for r in ranks] for name in RUNS},
    }
    write_results(args.json, WORLD, document)


if __name__ == "__main__":
    run_on_local_ranks(_benchmark, parse_args(), WORLD)
