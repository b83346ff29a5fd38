"""What 2BP costs when nothing fills the bubble: ResNet-152, one step of 4 micro-batches,
patched (4 backward-p1 + 1 flush) against plain autograd (4 full backward), in one process.

In a pipeline the flush runs in otherwise idle time; here it runs right after the backward
calls, so the ratio patched/plain is the pure overhead of splitting the backward (the tap, the
saved tensors, the concatenation, a different kernel shape). Target: <= 1.00.

The sides alternate within every round, in a rotating order, after warm-up, so a machine
whose speed drifts slows them alike; the statistic is the median over rounds of the per-round
ratio. Also timed: the split itself (forward, backward-p1 and flush against plain forward and
backward) and the flush strategies (one concatenated kernel per layer against one per
micro-batch).

    python benchmarks/overhead.py [--rounds 15] [--threads N] [--profile]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision
from torch import Tensor, nn

import twobp_autograd as twobp

__all__ = ["main"]

RESULTS = Path(__file__).resolve().parent / "results" / "overhead.json"
Batch = list[tuple[Tensor, Tensor]]


@dataclass
class Side:
    """One way of running the step, and the seconds each of its rounds took."""

    name: str
    step: Callable[[], dict[str, float]]
    rounds: list[dict[str, float]] = field(default_factory=list)

    def median(self, part: str) -> float:
        return statistics.median(r[part] for r in self.rounds)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _clock(device: torch.device) -> float:
    _sync(device)
    return time.perf_counter()


def plain_step(model: nn.Module, batch: Batch, device: torch.device) -> dict[str, float]:
    model.zero_grad(set_to_none=True)
    forward = backward = 0.0
    for x, y in batch:
        t0 = _clock(device)
        loss = F.cross_entropy(model(x), y) / len(batch)
        t1 = _clock(device)
        loss.backward()
        t2 = _clock(device)
        forward, backward = forward + t1 - t0, backward + t2 - t1
    return {"total": forward + backward, "forward": forward, "backward": backward, "flush": 0.0}


def twobp_step(model: nn.Module, batch: Batch, device: torch.device, queue: twobp.WeightGradQueue) -> dict[str, float]:
    model.zero_grad(set_to_none=True)
    forward = backward = 0.0
    for x, y in batch:
        t0 = _clock(device)
        with twobp.use_queue(queue):
            loss = F.cross_entropy(model(x), y) / len(batch)
        t1 = _clock(device)
        loss.backward()  # backward-p1: input gradients; the weight work goes to `queue`
        t2 = _clock(device)
        forward, backward = forward + t1 - t0, backward + t2 - t1
    t3 = _clock(device)
    queue.flush()  # backward-p2
    flush = _clock(device) - t3
    return {"total": forward + backward + flush, "forward": forward, "backward": backward, "flush": flush}


def build(args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, nn.Module, Batch]:
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
    return plain, patched, batch


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds, each running every side once")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=2, help="samples per micro-batch")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count(), help="torch.set_num_threads (default: all cores)"
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-loop", action="store_true", help="skip the per-micro-batch flush strategy")
    parser.add_argument("--profile", action="store_true", help="print a torch.profiler table per side at the end")
    parser.add_argument("--profile-rows", type=int, default=25)
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"JSON results (default {RESULTS})")
    args = parser.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda, but CUDA is not available")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    plain, patched, batch = build(args, device)
    concat_queue, loop_queue = twobp.WeightGradQueue("concat"), twobp.WeightGradQueue("loop")
    sides = [
        Side("plain", lambda: plain_step(plain, batch, device)),
        Side("2bp-concat", lambda: twobp_step(patched, batch, device, concat_queue)),
    ]
    if not args.no_loop:
        sides.append(Side("2bp-loop", lambda: twobp_step(patched, batch, device, loop_queue)))

    for _ in range(args.warmup):
        for side in sides:
            side.step()
    for round_index in range(args.rounds):
        shift = round_index % len(sides)  # rotate who goes first
        for side in sides[shift:] + sides[:shift]:
            side.rounds.append(side.step())
        print(
            f"round {round_index + 1}/{args.rounds}: "
            + "  ".join(f"{s.name} {s.rounds[-1]['total']:.3f}s" for s in sides),
            flush=True,
        )

    base = sides[0]
    summary: dict[str, dict[str, float]] = {}
    print(
        f"\nResNet-152, {args.micro_batches} micro-batches of {args.batch_size} "
        f"at {args.image_size}x{args.image_size}, "
        f"{device}, {torch.get_num_threads()} threads, {args.rounds} rounds (medians):"
    )
    print(f"  {'side':<12}{'step':>9}{'forward':>9}{'backward':>10}{'flush':>9}{'ratio/plain':>13}")
    for side in sides:
        ratios = [r["total"] / b["total"] for r, b in zip(side.rounds, base.rounds, strict=True)]
        summary[side.name] = {part: side.median(part) for part in ("total", "forward", "backward", "flush")}
        summary[side.name]["ratio_to_plain"] = statistics.median(ratios)
        summary[side.name]["ratio_to_plain_min"] = min(ratios)
        summary[side.name]["ratio_to_plain_max"] = max(ratios)
        row = summary[side.name]
        print(
            f"  {side.name:<12}{row['total']:>8.3f}s{row['forward']:>8.3f}s{row['backward']:>9.3f}s"
            f"{row['flush']:>8.3f}s{row['ratio_to_plain']:>13.3f}"
        )
    concat = summary["2bp-concat"]
    # The split: plain backward = I + W; 2BP = I' (backward-p1) + W' (the flush).
    print(
        f"  split: plain backward {summary['plain']['backward']:.3f}s = I+W;  2BP backward-p1 "
        f"{concat['backward']:.3f}s + flush {concat['flush']:.3f}s = "
        f"{concat['backward'] + concat['flush']:.3f}s "
        f"({(concat['backward'] + concat['flush']) / summary['plain']['backward']:.3f} of plain backward)"
    )
    if "2bp-loop" in summary:
        print(f"  flush strategies: concat {concat['flush']:.3f}s, loop {summary['2bp-loop']['flush']:.3f}s")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    environment = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
    }
    result = {
        "benchmark": "overhead",
        "model": "torchvision resnet152(num_classes=10)",
        "config": config,
        "environment": environment,
        "summary": summary,
        "rounds": {s.name: s.rounds for s in sides},
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")

    if args.profile:
        profile(sides, device, args.profile_rows)


if __name__ == "__main__":
    main()
