"""Data parallelism on a patched model: all-reduce overlapped with the flush, against the
same flush followed by the all-reduce, and against DDP on the unpatched model.

Two gloo ranks spawned in one run, each with its own data. Every step accumulates
``--micro-batches`` backward passes and then synchronises gradients:

- ``overlapped``: ``GradientSynchroniser.synchronise()`` — each bucket's all-reduce starts as
  soon as the flush has made its gradients final;
- ``flush_then_reduce``: ``twobp.flush_weight_grads()``, then the same synchroniser (every
  bucket is ready at once: nothing overlaps the flush);
- ``ddp``: ``DistributedDataParallel`` on an unpatched copy, ``no_sync`` for all micro-batches
  but the last (its reduction overlaps that last backward).

The three run interleaved step by step (rotating which goes first), so machine noise falls on
all alike; before timing, their gradients are checked equal. Rank 0 prints medians and ratios
and writes the JSON.

    python benchmarks/data_parallel.py --steps 20
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from local_ranks import add_model_arguments, count, recorded_arguments, run_on_local_ranks, write_results
from torch.nn.parallel import DistributedDataParallel

import twobp_autograd as twobp
from twobp_autograd.data_parallel import GradientSynchroniser
from twobp_autograd.pipeline.zoo import build_model

WORLD = 2
VARIANTS = ("overlapped", "flush_then_reduce", "ddp")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser, batch_size=16, batch_help="samples per rank per step")
    parser.add_argument("--micro-batches", type=count(), default=4)
    parser.add_argument("--bucket-mib", type=float, default=25.0)
    parser.add_argument("--steps", type=count(), default=10, help="measured steps per variant")
    parser.add_argument("--warmup", type=count(0), default=2)
    parser.add_argument("--json", default=str(Path(__file__).parent / "results" / "data_parallel.json"))
    args = parser.parse_args()
    if args.batch_size < args.micro_batches:
        parser.error("--batch-size must be at least --micro-batches (each micro-batch needs a sample)")
    return args


def _benchmark(rank: int, args: argparse.Namespace) -> None:
    model, make_batch, loss_fn = build_model(args.model, args)
    plain = copy.deepcopy(model)
    twobp.patch(model)
    sync = GradientSynchroniser(model, bucket_bytes=int(args.bucket_mib * 2**20))
    ddp = DistributedDataParallel(plain, bucket_cap_mb=args.bucket_mib)
    inputs, targets = make_batch(args.batch_size, torch.Generator().manual_seed(1 + rank))
    micro = list(zip(inputs.tensor_split(args.micro_batches), targets.tensor_split(args.micro_batches), strict=True))

    def step(variant: str) -> float:
        network = ddp if variant == "ddp" else model
        for p in network.parameters():
            p.grad = None
        dist.barrier()
        start = time.perf_counter()
        for index, (x, y) in enumerate(micro):
            loss = loss_fn(network(x), y) / len(micro)
            if variant == "ddp" and index < len(micro) - 1:
                with ddp.no_sync():
                    loss.backward()
            else:
                loss.backward()
        if variant == "overlapped":
            sync.synchronise()
        elif variant == "flush_then_reduce":
            twobp.flush_weight_grads()
            sync.synchronise()
        return time.perf_counter() - start

    step("overlapped")
    step("ddp")  # the same data and weights: the gradients must agree before anything is timed
    for (name, p), q in zip(model.named_parameters(), ddp.module.parameters(), strict=True):
        if not torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-5):
            raise AssertionError(f"{name}: the synchronised gradient differs from DDP's")

    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for round_ in range(args.warmup + args.steps):
        shift = round_ % len(VARIANTS)
        for variant in VARIANTS[shift:] + VARIANTS[:shift]:
            elapsed = step(variant)
            if round_ >= args.warmup:
                times[variant].append(elapsed)
    slowest = {v: [0.0] * len(ts) for v, ts in times.items()}
    for v, ts in times.items():  # a step takes as long as its slowest rank
        gathered: list[Any] = [None] * WORLD
        dist.all_gather_object(gathered, ts)
        slowest[v] = [max(column) for column in zip(*gathered, strict=True)]
    if rank == 0:
        _report(args, slowest)


def _report(args: argparse.Namespace, times: dict[str, list[float]]) -> None:
    medians = {v: statistics.median(ts) for v, ts in times.items()}
    ratios = {f"{v}/ddp": medians[v] / medians["ddp"] for v in VARIANTS if v != "ddp"}
    ratios["overlapped/flush_then_reduce"] = medians["overlapped"] / medians["flush_then_reduce"]
    print(
        f"{args.model}: {WORLD} gloo ranks, {args.micro_batches} micro-batches of "
        f"{args.batch_size // args.micro_batches}, median of {args.steps} steps"
    )
    for v in VARIANTS:
        print(f"  {v:>18}: {medians[v] * 1e3:8.1f} ms")
    for name, value in ratios.items():
        print(f"  {name:>28}: {value:.3f}")
    document = {
        "arguments": recorded_arguments(args),
        "median_step_time": medians,
        "ratios": ratios,
        "step_times": times,
    }
    write_results(args.json, WORLD, document)


if __name__ == "__main__":
    run_on_local_ranks(_benchmark, parse_args(), WORLD)
