"""FSDP2 with 2BP against FSDP2 on the unpatched model: step time and peak memory.

Two gloo ranks spawned in one run, each with its own data; the zoo's transformer (embedding,
pre-norm blocks, head) sharded as users shard it: ``fully_shard`` on every block, then on the
root. A step runs ``--micro-batches`` backward passes with gradient sync on the last only
(FSDP2's accumulation idiom, ``set_requires_gradient_sync``; ``--sync-each`` reduces every
micro-batch instead), then, on the patched side, ``twobp.flush_weight_grads()`` (which
reduce-scatters each group as its deferred gradients become final), then ``optimizer.step()``.

The two sides alternate step by step (rotating which goes first), so machine noise falls on
both alike; before timing, their sharded gradients are checked equal. Peak memory is measured
in separate rounds (a sampling thread would disturb the timing): the heap in use (glibc's
``mallinfo2``) sampled every half millisecond, over the step's start and in total. A step
takes as long as its slowest rank; memory is the higher rank's. Rank 0 prints medians and
ratios and writes the JSON.

    python benchmarks/fsdp.py --steps 6

``--device cuda``: one NCCL rank on the GPU (NCCL refuses two ranks on one device), each step
timed to a synchronisation, memory as the CUDA caching allocator's peak of allocated bytes.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from local_ranks import (
    add_model_arguments,
    count,
    device_name,
    recorded_arguments,
    run_on_local_ranks,
    synchronized_clock,
    write_results,
)
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import twobp_autograd as twobp
from twobp_autograd.pipeline.memory_probe import heap_in_use
from twobp_autograd.pipeline.zoo import build_model

#: Ranks per device type (one GPU holds one NCCL rank).
WORLD = {"cpu": 2, "cuda": 1}
SIDES = ("fsdp2", "fsdp2_2bp")

# The zoo's head flattens its logits (a view), for which FSDP2 warns about in-place use; none here.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser, batch_size=16, batch_help="samples per rank per step")
    parser.set_defaults(model="transformer")
    parser.add_argument("--micro-batches", type=count(), default=4)
    parser.add_argument(
        "--sync-each", action="store_true", help="reduce-scatter after every micro-batch (FSDP2's default)"
    )
    parser.add_argument(
        "--max-pending-mib",
        type=float,
        default=None,
        help="2BP side: a queue with this max_pending_bytes (early flushes bound its memory)",
    )
    parser.add_argument(
        "--flush-each",
        action="store_true",
        help="2BP side: flush after every micro-batch's backward (FSDP2 alone has no bubble to fill)",
    )
    parser.add_argument("--steps", type=count(), default=6, help="measured steps per side")
    parser.add_argument("--memory-steps", type=count(0), default=2, help="steps per side with the memory sampler")
    parser.add_argument("--warmup", type=count(0), default=2)
    parser.add_argument("--device", choices=sorted(WORLD), default="cpu")
    parser.add_argument("--json", default=str(Path(__file__).parent / "results" / "fsdp.json"))
    return parser.parse_args()


def _sharded(args: argparse.Namespace, patched: bool) -> nn.Module:
    model, _, _ = build_model(args.model, args)  # the same seed: the same weights on both sides
    model.to(args.device)
    if patched:
        twobp.patch(model)
    mesh = init_device_mesh(args.device, (WORLD[args.device],))
    for module in model.modules():
        if type(module).__name__ == "LlamaLikeBlock":
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class _HeapSampler:
    """The most heap in use while running, sampled from a thread every ``interval`` seconds."""

    def __init__(self, interval: float = 5e-4) -> None:
        self.interval = interval
        self.start = heap_in_use() or 0
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, heap_in_use() or 0)
            time.sleep(self.interval)

    def __enter__(self) -> _HeapSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, heap_in_use() or 0)


class _CudaPeak:
    """The CUDA caching allocator's peak of allocated bytes while running."""

    def __enter__(self) -> _CudaPeak:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.start = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.synchronize()
        self.peak = torch.cuda.max_memory_allocated()


def _benchmark(rank: int, args: argparse.Namespace) -> None:
    _, make_batch, loss_fn = build_model(args.model, args)
    models = {"fsdp2": _sharded(args, patched=False), "fsdp2_2bp": _sharded(args, patched=True)}
    optimizers = {side: torch.optim.AdamW(model.parameters(), lr=1e-4) for side, model in models.items()}
    inputs, targets = make_batch(args.batch_size, torch.Generator().manual_seed(1 + rank))
    inputs, targets = inputs.to(args.device), targets.to(args.device)
    micro = list(zip(inputs.tensor_split(args.micro_batches), targets.tensor_split(args.micro_batches), strict=True))
    cap = None if args.max_pending_mib is None else int(args.max_pending_mib * 2**20)
    queue = twobp.WeightGradQueue(max_pending_bytes=cap)
    held_before_flush: list[int] = []  # bytes the deferred work keeps alive when backward ends

    def step(side: str, *, update: bool = True) -> float:
        model, optimizer = models[side], optimizers[side]
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        start = synchronized_clock(args.device)
        for index, (x, y) in enumerate(micro):
            model.set_requires_gradient_sync(args.sync_each or index == len(micro) - 1)  # type: ignore[operator]
            with twobp.use_queue(queue):
                (loss_fn(model(x), y) / len(micro)).backward()
            if side == "fsdp2_2bp" and args.flush_each and index < len(micro) - 1:
                queue.flush()
        if side == "fsdp2_2bp":
            held_before_flush.append(queue.pending().bytes)
            queue.flush()
        if update:
            optimizer.step()
        return synchronized_clock(args.device) - start

    for side in SIDES:  # the same data and weights: the sharded gradients must agree before anything is timed
        step(side, update=False)
    for (name, p), q in zip(models["fsdp2_2bp"].named_parameters(), models["fsdp2"].parameters(), strict=True):
        if not torch.allclose(p.grad.to_local(), q.grad.to_local(), rtol=1e-4, atol=1e-6):
            raise AssertionError(f"{name}: the sharded gradient differs from FSDP2's on the unpatched model")

    times: dict[str, list[float]] = {side: [] for side in SIDES}
    for round_ in range(args.warmup + args.steps):
        for side in SIDES if round_ % 2 == 0 else SIDES[::-1]:
            elapsed = step(side)
            if round_ >= args.warmup:
                times[side].append(elapsed)
    memory: dict[str, dict[str, int]] = {side: {"over_start": 0, "total": 0} for side in SIDES}
    for round_ in range(args.memory_steps):
        for side in SIDES if round_ % 2 == 0 else SIDES[::-1]:
            optimizers[side].zero_grad(set_to_none=True)
            with _CudaPeak() if args.device == "cuda" else _HeapSampler() as sampler:
                step(side)
            memory[side]["over_start"] = max(memory[side]["over_start"], sampler.peak - sampler.start)
            memory[side]["total"] = max(memory[side]["total"], sampler.peak)
    slowest = {side: [max(column) for column in zip(*_gathered(ts), strict=True)] for side, ts in times.items()}
    highest = {side: {key: max(r[key] for r in _gathered(m)) for key in m} for side, m in memory.items()}
    highest["fsdp2_2bp"]["deferred_work"] = max(max(held) for held in _gathered(held_before_flush))
    if rank == 0:
        _report(args, slowest, highest)


def _gathered(value: Any) -> list[Any]:
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


def _report(args: argparse.Namespace, times: dict[str, list[float]], memory: dict[str, dict[str, int]]) -> None:
    medians = {side: statistics.median(ts) for side, ts in times.items()}
    ratios = {
        "step_time": medians["fsdp2_2bp"] / medians["fsdp2"],
        "peak_memory_over_step_start": memory["fsdp2_2bp"]["over_start"] / memory["fsdp2"]["over_start"],
        "peak_memory_total": memory["fsdp2_2bp"]["total"] / memory["fsdp2"]["total"],
    }
    sync = "every micro-batch" if args.sync_each else "the last micro-batch"
    cap = "" if args.max_pending_mib is None else f", 2BP queue capped at {args.max_pending_mib:g} MiB"
    cap += ", 2BP flushed after every micro-batch" if args.flush_each else ""
    rows = args.batch_size // args.micro_batches
    world, backend = dist.get_world_size(), dist.get_backend()
    print(
        f"{args.model}: {world} {backend} ranks, {args.micro_batches} micro-batches of {rows}, "
        f"sync on {sync}{cap}, median of {args.steps} steps"
    )
    for side in SIDES:
        mib = {key: value / 2**20 for key, value in memory[side].items()}
        print(
            f"  {side:>10}: {medians[side] * 1e3:8.1f} ms   peak {mib['over_start']:7.1f} MiB over the step's "
            f"start, {mib['total']:7.1f} MiB in all"
        )
    print(f"  deferred work held when the last backward ends: {memory['fsdp2_2bp']['deferred_work'] / 2**20:.1f} MiB")
    for name, value in ratios.items():
        print(f"  2bp/plain {name}: {value:.3f}")
    write_results(
        args.json,
        world,
        {
            "arguments": recorded_arguments(args),
            "device": device_name(args.device),
            "median_step_time": medians,
            "peak_memory_bytes": memory,
            "ratios": ratios,
            "step_times": times,
        },
    )


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda, but CUDA is not available")
    run_on_local_ranks(_benchmark, arguments, WORLD[arguments.device], "nccl" if arguments.device == "cuda" else "gloo")
