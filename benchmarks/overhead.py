"""What 2BP costs when nothing fills the bubble: one training step of 4 micro-batches, patched
(4 backward-p1 + 1 flush) against plain autograd (4 full backward), in one process, on three
models: torchvision's ResNet-152, the sweep's transformer (pre-norm Llama-like blocks) and
Hugging Face's Llama, the last two built by ``twobp_autograd.pipeline.zoo`` and run as the chain
of their pipeline blocks (their own norm classes deferred, as the sweep does), with their loss.

In a pipeline the flush runs in otherwise idle time; here it runs right after the backward
calls, so the ratio patched/plain is the pure overhead of splitting the backward (the tap, the
saved tensors, the concatenation, a different kernel shape). Target: <= 1.00.

The sides alternate within every round, in a rotating order, after warm-up, so a machine
whose speed drifts slows them alike; the statistic is the median over rounds of the per-round
ratio. Also timed: the split itself (forward, backward-p1 and flush against plain forward and
backward) and the flush strategies (one concatenated kernel per layer against one per
micro-batch). The load average is recorded before and after each model.

    python benchmarks/overhead.py [--models resnet152 transformer llama] [--rounds 15] [--threads 1] [--profile]
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from local_ranks import count, device_name, recorded_arguments, synchronized_clock, write_json  # beside this script
from torch import Tensor, nn

import twobp_autograd as twobp

__all__ = ["main", "MODELS", "Workload", "build"]

RESULTS = Path(__file__).resolve().parent / "results" / "overhead.json"
MODELS = ("resnet152", "transformer", "llama")
Batch = list[tuple[Tensor, Tensor]]
LossFn = Callable[[Tensor, Tensor], Tensor]
PARTS = ("total", "forward", "backward", "flush")


@dataclass
class Side:
    """One way of running the step, and the seconds each of its rounds took."""

    name: str
    step: Callable[[], dict[str, float]]
    rounds: list[dict[str, float]] = field(default_factory=list)

    def median(self, part: str) -> float:
        return statistics.median(r[part] for r in self.rounds)


@dataclass
class Workload:
    """One model, plain and patched (deep copies, same weights), its micro-batches and loss."""

    description: str
    plain: nn.Module
    patched: nn.Module
    batch: Batch
    loss_fn: LossFn



def _load() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def plain_step(work: Workload, device: torch.device) -> dict[str, float]:
    work.plain.zero_grad(set_to_none=True)
    forward = backward = 0.0
    for x, y in work.batch:
        t0 = synchronized_clock(device)
        loss = work.loss_fn(work.plain(x), y) / len(work.batch)
        t1 = synchronized_clock(device)
        loss.backward()
        t2 = synchronized_clock(device)
        forward, backward = forward + t1 - t0, backward + t2 - t1
    return {"total": forward + backward, "forward": forward, "backward": backward, "flush": 0.0}


def twobp_step(work: Workload, device: torch.device, queue: twobp.WeightGradQueue) -> dict[str, float]:
    work.patched.zero_grad(set_to_none=True)
    forward = backward = 0.0
    for x, y in work.batch:
        t0 = synchronized_clock(device)
        with twobp.use_queue(queue):
            loss = work.loss_fn(work.patched(x), y) / len(work.batch)
        t1 = synchronized_clock(device)
        loss.backward()  # backward-p1: input gradients; the weight work goes to `queue`
        t2 = synchronized_clock(device)
        forward, backward = forward + t1 - t0, backward + t2 - t1
    t3 = synchronized_clock(device)
    queue.flush()  # backward-p2
    flush = synchronized_clock(device) - t3
    return {"total": forward + backward + flush, "forward": forward, "backward": backward, "flush": flush}


def _resnet152(args: argparse.Namespace, device: torch.device) -> Workload:
    import torchvision

    torch.manual_seed(args.seed)
    plain = torchvision.models.resnet152(num_classes=10).to(device)
    patched = twobp.patch(copy.deepcopy(plain))
    shape = (args.batch_size, 3, args.image_size, args.image_size)
    batch = [
        (torch.randn(shape, device=device), torch.randint(0, 10, (args.batch_size,), device=device))
        for _ in range(args.micro_batches)
    ]
    if args.channels_last:
        plain, patched = (m.to(memory_format=torch.channels_last) for m in (plain, patched))
        batch = [(x.contiguous(memory_format=torch.channels_last), y) for x, y in batch]
    description = (
        f"torchvision resnet152(num_classes=10), {args.micro_batches} micro-batches of {args.batch_size} "
        f"at {args.image_size}x{args.image_size}"
    )
    return Workload(description, plain, patched, batch, F.cross_entropy)


def _zoo(name: str, args: argparse.Namespace, device: torch.device) -> Workload:
    """The zoo's model as the chain of its pipeline blocks (one stage holding them all)."""
    from twobp_autograd.pipeline.split import blocks_of, defer_norms
    from twobp_autograd.pipeline.zoo import build_model

    options = argparse.Namespace(width=args.width, depth=args.depth, seq_len=args.seq_len, image_size=args.image_size)
    model, make_batch, loss_fn = build_model(name, options, seed=args.seed)
    defer_norms(model)  # before patching: the model's own norm classes defer too
    plain = nn.Sequential(*blocks_of(model)).to(device)
    patched = twobp.patch(copy.deepcopy(plain))
    generator = torch.Generator().manual_seed(args.seed + 1)
    batch = [make_batch(args.batch_size, generator) for _ in range(args.micro_batches)]
    batch = [(x.to(device), y.to(device)) for x, y in batch]
    width, depth, seq = args.width or 256, args.depth or 8, args.seq_len or 64
    kind = {"transformer": "pre-norm Llama-like blocks (zoo 'transformer')", "llama": "Hugging Face LlamaForCausalLM"}
    description = (
        f"{kind.get(name, name)}, width {width}, {depth} blocks, vocab 1000, {args.micro_batches} micro-batches of "
        f"{args.batch_size} x {seq} tokens"
    )
    return Workload(description, plain, patched, batch, loss_fn)


def build(name: str, args: argparse.Namespace, device: torch.device) -> Workload:
    """The workload called ``name`` (one of :data:`MODELS`)."""
    return _resnet152(args, device) if name == "resnet152" else _zoo(name, args, device)


def _sides(work: Workload, args: argparse.Namespace, device: torch.device) -> list[Side]:
    concat_queue, loop_queue = twobp.WeightGradQueue("concat"), twobp.WeightGradQueue("loop")
    sides = [
        Side("plain", lambda: plain_step(work, device)),
        Side("2bp-concat", lambda: twobp_step(work, device, concat_queue)),
    ]
    if not args.no_loop:
        sides.append(Side("2bp-loop", lambda: twobp_step(work, device, loop_queue)))
    return sides


def _run_rounds(name: str, sides: list[Side], rounds: int, warmup: int) -> None:
    for _ in range(warmup):
        for side in sides:
            side.step()
    for round_index in range(rounds):
        shift = round_index % len(sides)  # rotate who goes first
        for side in sides[shift:] + sides[:shift]:
            side.rounds.append(side.step())
        print(
            f"{name} round {round_index + 1}/{rounds}: "
            + "  ".join(f"{s.name} {s.rounds[-1]['total']:.3f}s" for s in sides),
            flush=True,
        )


def summarize(sides: list[Side]) -> dict[str, dict[str, float]]:
    """Per side: the median of each part, and the median, min and max of the per-round ratio."""
    base = sides[0]
    summary: dict[str, dict[str, float]] = {}
    for side in sides:
        ratios = [r["total"] / b["total"] for r, b in zip(side.rounds, base.rounds, strict=True)]
        summary[side.name] = {part: side.median(part) for part in PARTS}
        summary[side.name]["ratio_to_plain"] = statistics.median(ratios)
        summary[side.name]["ratio_to_plain_min"] = min(ratios)
        summary[side.name]["ratio_to_plain_max"] = max(ratios)
    return summary


def _print_summary(description: str, summary: dict[str, dict[str, float]], rounds: int) -> None:
    print(f"\n{description}, {torch.get_num_threads()} threads, {rounds} rounds (medians):")
    print(f"  {'side':<12}{'step':>9}{'forward':>9}{'backward':>10}{'flush':>9}{'ratio/plain':>13}")
    for name, row in summary.items():
        print(
            f"  {name:<12}{row['total']:>8.3f}s{row['forward']:>8.3f}s{row['backward']:>9.3f}s"
            f"{row['flush']:>8.3f}s{row['ratio_to_plain']:>13.3f}"
        )
    concat, plain_backward = summary["2bp-concat"], summary["plain"]["backward"]
    # The split: plain backward = I + W; 2BP = I' (backward-p1) + W' (the flush).
    split = concat["backward"] + concat["flush"]
    print(
        f"  split: plain backward {plain_backward:.3f}s = I+W;  2BP backward-p1 {concat['backward']:.3f}s"
        f" + flush {concat['flush']:.3f}s = {split:.3f}s ({split / plain_backward:.3f} of plain backward)"
    )
    if "2bp-loop" in summary:
        print(f"  flush strategies: concat {concat['flush']:.3f}s, loop {summary['2bp-loop']['flush']:.3f}s")


def profile(sides: list[Side], device: torch.device, rows: int) -> None:
    """Where each side's time goes, by operator (self time), one step each."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort_by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    for side in sides:
        with torch_profile(activities=activities) as prof:
            side.step()
        print(f"\n== profile: {side.name} (one step) ==")
        print(prof.key_averages().table(sort_by=sort_by, row_limit=rows))


def measure(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """One model's sides, timed interleaved: its description, summary, rounds and load."""
    load_before = _load()
    work = build(name, args, device)
    sides = _sides(work, args, device)
    _run_rounds(name, sides, args.rounds, args.warmup)
    summary = summarize(sides)
    _print_summary(work.description, summary, args.rounds)
    load_after = _load()
    print(f"  load average before {load_before}, after {load_after}")
    if args.profile:
        profile(sides, device, args.profile_rows)
    return {
        "model": work.description,
        "load_average_before": load_before,
        "load_average_after": load_after,
        "summary": summary,
        "rounds": {s.name: s.rounds for s in sides},
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", choices=MODELS, default=list(MODELS), help="models to time, in turn")
    parser.add_argument("--rounds", type=count(), default=15, help="timed rounds, each running every side once")
    parser.add_argument("--warmup", type=count(0), default=3, help="untimed rounds first")
    parser.add_argument("--micro-batches", type=count(), default=4)
    parser.add_argument("--batch-size", type=count(), default=2, help="samples per micro-batch")
    parser.add_argument("--image-size", type=count(), default=64, help="resnet152 input resolution")
    parser.add_argument("--width", type=count(), default=None, help="transformer/llama hidden size (zoo: 256)")
    parser.add_argument("--depth", type=count(), default=None, help="blocks of transformer/llama (zoo default 8)")
    parser.add_argument("--seq-len", type=count(), default=None, help="tokens per sample (zoo default 64)")
    parser.add_argument("--threads", type=count(), default=1, help="torch.set_num_threads")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--channels-last", action="store_true", help="resnet152 in channels-last")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-loop", action="store_true", help="skip the per-micro-batch flush strategy")
    parser.add_argument("--profile", action="store_true", help="print a torch.profiler table per side")
    parser.add_argument("--profile-rows", type=count(), default=25)
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON results (default results/overhead.json)")
    return parser.parse_args(argv)


def _environment(device: torch.device) -> dict[str, Any]:
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "device": device_name(device),
    }



def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda, but CUDA is not available")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    models = {name: measure(name, args, device) for name in args.models}
    config, environment = recorded_arguments(args), _environment(device)
    write_json(args.out, {"benchmark": "overhead", "config": config, "environment": environment, "models": models})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
