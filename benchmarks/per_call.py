"""What the split costs per call and per stage, each side measured against plain autograd in
the same process, interleaved (A B A B, the order rotating every round), medians of per-round
ratios.

- **Per layer** (tiny Linear, Conv2d, LayerNorm, MultiheadAttention, BatchNorm2d, RMSNorm,
  Embedding, and a module of a user's own under the recompute rule: the regime where the
  Python around each op is what costs): patched forward / plain forward, and patched forward +
  backward + flush / plain forward + backward. Targets: <= 1.6 and <= 1.8.
- **Per stage** (a few middle blocks of the sweep's models): F on/off (patched forward / plain
  forward), (I+W)/B (backward-p1 + flush / full backward) and, side by side, PyTorch's own split
  on the plain stage (``stage_backward_input`` + ``stage_backward_weight``) over the same B.
  Targets: F on/off <= 1.03, (I+W)/B <= 1.05 and no dearer than PyTorch's split.
- **Where a stage's split cost sits**: the backward (plain) and backward-p1 + flush (2BP) run
  under ``torch.profiler`` a few extra rounds: the kernels' own (I+W)/B (the top-level ATen
  calls' CPU time), and the time outside kernels (Python, autograd's engine) per side; and the
  flush's kernels timed right after backward-p1, with the caches evicted, and warm (run again at
  once): what running weight gradients after the backward, on tensors that left the cache, costs.

On a GPU (``--device cuda``) every timed part ends in a synchronisation, so a layer's time
per call is the host's launch rate, or the kernels' where they take longer: what a step of
such layers waits for. The profiler and cache parts, which read the CPU's own kernel times,
run on the CPU only.

    python benchmarks/per_call.py [--rounds 30] [--calls 200] [--models mlp transformer ...] [--device cuda]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from local_ranks import (  # beside this script
    allocator_environment,
    count,
    device_name,
    recorded_arguments,
    synchronized_clock,
    write_json,
)
from torch import Tensor, nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch.profiler import ProfilerActivity, profile

import twobp_autograd as twobp
from twobp_autograd.pipeline.split import blocks_of, defer_norms
from twobp_autograd.pipeline.zoo import MODELS, build_model

__all__ = ["main", "layer_ratios", "stage_ratios"]

RESULTS = Path(__file__).resolve().parent / "results" / "per_call.json"
STAGE_MODELS = ("resnet152", "transformer", "mlp", "llama", "bert")


# -- per layer -------------------------------------------------------------------------------


#: ``call(module, input) -> output``: how a layer case is called.
LayerCall = Callable[[nn.Module, Tensor], Tensor]


class _ScaleShift(nn.Module):
    """A module of a user's own, ``x * scale + shift``: the generic recompute rule defers it."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.scale, self.shift = nn.Parameter(torch.ones(features)), nn.Parameter(torch.zeros(features))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale + self.shift


twobp.register(_ScaleShift, twobp.ops.recompute)


def _layer_cases(device: torch.device) -> dict[str, tuple[nn.Module, LayerCall, Tensor]]:
    """name -> (module, call, input): each layer at a size where per-call overhead dominates."""

    def attention(module: nn.Module, x: Tensor) -> Tensor:
        return module(x, x, x, need_weights=False)[0]

    def direct(module: nn.Module, x: Tensor) -> Tensor:
        return module(x)

    torch.manual_seed(0)
    cases = {
        "Linear(32, 32), 8 rows": (nn.Linear(32, 32), direct, torch.randn(8, 32)),
        "Conv2d(4, 4, 3), 2x4x8x8": (nn.Conv2d(4, 4, 3, padding=1), direct, torch.randn(2, 4, 8, 8)),
        "LayerNorm(32), 8 rows": (nn.LayerNorm(32), direct, torch.randn(8, 32)),
        "MultiheadAttention(32, 4), 2x8": (
            nn.MultiheadAttention(32, 4, batch_first=True), attention, torch.randn(2, 8, 32)
        ),
        "BatchNorm2d(4), 2x4x8x8": (nn.BatchNorm2d(4), direct, torch.randn(2, 4, 8, 8)),
        "RMSNorm(32), 8 rows": (nn.RMSNorm(32), direct, torch.randn(8, 32)),
        "Embedding(100, 32), 8 tokens": (nn.Embedding(100, 32), direct, torch.randint(0, 100, (8,))),
        "ScaleShift(32) (recompute rule), 8 rows": (_ScaleShift(32), direct, torch.randn(8, 32)),
    }
    return {name: (module.to(device), call, x.to(device)) for name, (module, call, x) in cases.items()}


def _timed(run: Callable[[], Any], calls: int, device: torch.device) -> float:
    start = synchronized_clock(device)
    for _ in range(calls):
        run()
    return (synchronized_clock(device) - start) / calls


def _interleaved(sides: Sequence[Callable[[], float]], rounds: int, warmup: int) -> list[list[float]]:
    """Each side's result per round, the sides run in a rotating order within every round."""
    for _ in range(warmup):
        for side in sides:
            side()
    results: list[list[float]] = [[] for _ in sides]
    for round_index in range(rounds):
        order = [(round_index + k) % len(sides) for k in range(len(sides))]
        for k in order:
            results[k].append(sides[k]())
    return results


def _median_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> float:
    return statistics.median(n / d for n, d in zip(numerators, denominators, strict=True))


def _layer_sides(plain: nn.Module, call: LayerCall, x: Tensor, calls: int) -> list[Callable[[], float]]:
    """Seconds per call of: plain forward, patched forward, plain forward + backward, and
    patched forward + backward + flush."""
    patched = twobp.patch(copy.deepcopy(plain))
    if x.is_floating_point():  # not an embedding's indices
        x.requires_grad_(True)

    def train_step(module: nn.Module, flush: bool) -> None:
        call(module, x).sum().backward()
        if flush:
            twobp.flush_weight_grads()

    return [
        lambda: _timed(lambda: call(plain, x), calls, x.device),
        lambda: _timed(lambda: call(patched, x), calls, x.device),
        lambda: _timed(lambda: train_step(plain, False), calls, x.device),
        lambda: _timed(lambda: train_step(patched, True), calls, x.device),
    ]


def layer_ratios(
    rounds: int, calls: int, warmup: int = 2, device: torch.device | str = "cpu"
) -> dict[str, dict[str, float]]:
    """Per layer: medians of the plain and patched times per call, and of their per-round ratios."""
    summary = {}
    for name, (plain, call, x) in _layer_cases(torch.device(device)).items():
        sides = _layer_sides(plain, call, x, calls)
        forward_plain, forward_patched, step_plain, step_patched = _interleaved(sides, rounds, warmup)
        summary[name] = {
            "forward_plain_us": statistics.median(forward_plain) * 1e6,
            "forward_patched_us": statistics.median(forward_patched) * 1e6,
            "forward_ratio": _median_ratio(forward_patched, forward_plain),
            "step_plain_us": statistics.median(step_plain) * 1e6,
            "step_patched_us": statistics.median(step_patched) * 1e6,
            "step_ratio": _median_ratio(step_patched, step_plain),
        }
    return summary


# -- per stage -------------------------------------------------------------------------------


def _stage(model_name: str, args: argparse.Namespace) -> tuple[nn.Module, Tensor]:
    """``args.stage_blocks`` blocks from the middle of the model, and their input for one
    micro-batch of ``args.micro_batch`` samples (what the blocks before them hand over)."""
    options = argparse.Namespace(width=args.width, depth=args.depth, seq_len=args.seq_len, image_size=args.image_size)
    model, make_batch, _ = build_model(model_name, options, seed=0)
    defer_norms(model)  # as the sweep does: the model's own norm classes defer too
    blocks = blocks_of(model.to(args.device))
    start = max(1, (len(blocks) - args.stage_blocks) // 2)
    stage = nn.Sequential(*blocks[start : start + args.stage_blocks]).train()
    x, _ = make_batch(args.micro_batch, torch.Generator().manual_seed(1))
    x = x.to(args.device)
    with torch.no_grad():
        for block in blocks[:start]:
            x = block(x)
    return stage, x


class _StageSides:
    """The three ways of running one stage's forward and backward, each timed by part."""

    def __init__(self, plain: nn.Module, x: Tensor) -> None:
        self.plain = plain
        self.patched = twobp.patch(copy.deepcopy(plain))
        self.x = x
        self.queue = twobp.WeightGradQueue()
        self.grad = torch.randn_like(self._forward(plain)[1])

    def _clock(self) -> float:
        return synchronized_clock(self.x.device)

    def _forward(self, stage: nn.Module) -> tuple[Tensor, Tensor, float]:
        x = self.x.detach().requires_grad_()
        start = self._clock()
        out = stage(x)
        return x, out, self._clock() - start

    def plain_autograd(self) -> dict[str, float]:
        _, out, forward = self._forward(self.plain)
        start = self._clock()
        out.backward(self.grad)
        backward = self._clock() - start
        self.plain.zero_grad(set_to_none=True)
        return {"F": forward, "B": backward}

    def twobp_split(self) -> dict[str, float]:
        with twobp.use_queue(self.queue):
            _, out, forward = self._forward(self.patched)
        start = self._clock()
        out.backward(self.grad)
        middle = self._clock()
        self.queue.flush()
        end = self._clock()
        self.patched.zero_grad(set_to_none=True)
        return {"F": forward, "I": middle - start, "W": end - middle}

    def pytorch_split(self) -> dict[str, float]:
        x, out, forward = self._forward(self.plain)
        start = self._clock()
        _, groups = stage_backward_input([out], [self.grad], [x], self.plain.parameters())
        middle = self._clock()
        stage_backward_weight(self.plain.parameters(), groups)
        end = self._clock()
        self.plain.zero_grad(set_to_none=True)
        return {"F": forward, "I": middle - start, "W": end - middle}


def _top_level_aten_ms(events: Sequence[Any]) -> tuple[float, int]:
    """Summed CPU time (ms) and number of the ATen calls in ``events`` that no other ATen call
    made (a kernel's own inner calls count once, inside it): the time in kernels."""
    total_us, calls = 0.0, 0
    for event in events:
        if not event.name.startswith("aten::"):
            continue
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None:
            total_us += event.cpu_time_total
            calls += 1
    return total_us / 1e3, calls


@contextlib.contextmanager
def _kineto_quiet() -> Iterator[None]:
    """The profiler's C++ backend logs every start and stop on stderr (fd 2): muted meanwhile."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _backward_kernels(sides: _StageSides, rounds: int) -> dict[str, float]:
    """Median kernel time, ATen calls and wall time of plain B and of 2BP's I + W, each run
    under ``torch.profiler`` (about a microsecond per recorded call, on both sides alike; a
    Python dispatch mode would add ten times that per call, and 2BP makes more of them)."""
    kernels: dict[str, list[float]] = {"B": [], "I+W": []}
    walls: dict[str, list[float]] = {"B": [], "I+W": []}
    calls: dict[str, list[int]] = {"B": [], "I+W": []}
    for round_ in range(rounds):
        for side in ("B", "I+W") if round_ % 2 else ("I+W", "B"):
            stage = sides.plain if side == "B" else sides.patched
            with twobp.use_queue(sides.queue):
                _, out, _ = sides._forward(stage)
            with _kineto_quiet(), profile(activities=[ProfilerActivity.CPU]) as profiled:
                start = time.perf_counter()
                out.backward(sides.grad)
                sides.queue.flush()
                walls[side].append(time.perf_counter() - start)
            kernel_ms, count = _top_level_aten_ms(profiled.events())
            kernels[side].append(kernel_ms)
            calls[side].append(count)
            stage.zero_grad(set_to_none=True)
    ms = {side: statistics.median(values) for side, values in kernels.items()}
    outside = {side: statistics.median(walls[side]) * 1e3 - ms[side] for side in walls}
    return {
        "B_kernels_ms": ms["B"],
        "split_kernels_ms": ms["I+W"],
        "kernels_split_over_B": ms["I+W"] / ms["B"],
        "B_outside_kernels_ms": outside["B"],
        "split_outside_kernels_ms": outside["I+W"],
        "B_aten_calls": statistics.median(calls["B"]),
        "split_aten_calls": statistics.median(calls["I+W"]),
    }


#: Written before a "cold" run: larger than the last-level cache of the machines measured here.
_EVICTION_BYTES = 64 << 20


def _weight_kernels_warm_and_cold(sides: _StageSides, rounds: int) -> dict[str, float]:
    """The flush's kernels on one micro-batch's jobs, run three times: right after the
    backward-p1 that queued them (where a flush runs in this benchmark), after writing a buffer
    larger than the cache (cold), and again at once (warm: their tensors cached). Plain autograd
    runs each layer's weight-gradient kernel while its output gradient is still cached; a
    deferred one finds it in memory. Medians of the ratios to warm."""
    evict = torch.empty(_EVICTION_BYTES // 4)
    after_backward, cold = [], []

    def run(jobs: list[Any]) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            for job in jobs:
                job.kernel(*job.on_device(), job.needs)
        return time.perf_counter() - start

    for _ in range(rounds):
        with twobp.use_queue(sides.queue):
            _, out, _ = sides._forward(sides.patched)
        out.backward(sides.grad)
        jobs = sides.queue.take()
        first = run(jobs)
        evict.fill_(1.0)
        evicted = run(jobs)
        warm = run(jobs)
        after_backward.append(first / warm)
        cold.append(evicted / warm)
    return {
        "W_kernels_after_I_over_warm": statistics.median(after_backward),
        "W_kernels_cold_over_warm": statistics.median(cold),
    }


def stage_ratios(model_name: str, args: argparse.Namespace) -> dict[str, float]:
    """F on/off, (I+W)/B ours and PyTorch's, and ours over PyTorch's, medians of per-round ratios."""
    sides = _StageSides(*_stage(model_name, args))
    plain, ours, theirs = _interleaved(
        [sides.plain_autograd, sides.twobp_split, sides.pytorch_split], args.stage_rounds, args.warmup
    )
    backward = [r["B"] for r in plain]
    ours_split = [r["I"] + r["W"] for r in ours]
    theirs_split = [r["I"] + r["W"] for r in theirs]
    return {
        "F_off_ms": statistics.median(r["F"] for r in plain) * 1e3,
        "B_ms": statistics.median(backward) * 1e3,
        "I_ms": statistics.median(r["I"] for r in ours) * 1e3,
        "W_ms": statistics.median(r["W"] for r in ours) * 1e3,
        "F_on_off": _median_ratio([r["F"] for r in ours], [r["F"] for r in plain]),
        "split_over_B": _median_ratio(ours_split, backward),
        "pytorch_split_over_B": _median_ratio(theirs_split, backward),
        "split_over_pytorch_split": _median_ratio(ours_split, theirs_split),
        **(_cpu_kernel_figures(sides, args.kernel_rounds) if args.device == "cpu" and args.kernel_rounds else {}),
    }


def _cpu_kernel_figures(sides: _StageSides, rounds: int) -> dict[str, float]:
    return {**_backward_kernels(sides, rounds), **_weight_kernels_warm_and_cold(sides, rounds)}


# -- command line ----------------------------------------------------------------------------


def _print_layers(layers: dict[str, dict[str, float]]) -> None:
    print(f"{'layer':<34}{'fwd plain':>11}{'fwd 2BP':>10}{'ratio':>8}{'f+b plain':>12}{'f+b+flush':>11}{'ratio':>8}")
    for name, row in layers.items():
        print(
            f"{name:<34}{row['forward_plain_us']:>9.1f}us{row['forward_patched_us']:>8.1f}us{row['forward_ratio']:>8.2f}"
            f"{row['step_plain_us']:>10.1f}us{row['step_patched_us']:>9.1f}us{row['step_ratio']:>8.2f}"
        )


_STAGE_HEADER = (
    f"{'stage':<14}{'F off':>9}{'B':>9}{'F on/off':>10}{'(I+W)/B':>9}{'PyTorch (I+W)/B':>17}{'ours/PyTorch':>14}"
    f"{'kernels (I+W)/B':>17}{'outside kernels B / I+W':>25}{'W kernels after I / cold, over warm':>37}"
)


def _print_stage(name: str, row: dict[str, float]) -> None:
    line = (
        f"{name:<14}{row['F_off_ms']:>7.2f}ms{row['B_ms']:>7.2f}ms{row['F_on_off']:>10.3f}{row['split_over_B']:>9.3f}"
        f"{row['pytorch_split_over_B']:>17.3f}{row['split_over_pytorch_split']:>14.3f}"
    )
    if "kernels_split_over_B" in row:
        line += (
            f"{row['kernels_split_over_B']:>17.3f}"
            f"{row['B_outside_kernels_ms']:>12.2f}ms /{row['split_outside_kernels_ms']:>6.2f}ms"
            f"{row['W_kernels_after_I_over_warm']:>29.3f} /{row['W_kernels_cold_over_warm']:>6.3f}"
        )
    print(line)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=count(), default=30, help="interleaved rounds per layer")
    parser.add_argument("--calls", type=count(), default=200, help="calls timed together in one layer round")
    parser.add_argument("--warmup", type=count(0), default=3, help="untimed rounds first")
    parser.add_argument("--models", nargs="*", choices=MODELS, default=list(STAGE_MODELS), help="stages to time")
    parser.add_argument("--stage-rounds", type=count(), default=30, help="interleaved rounds per stage")
    parser.add_argument(
        "--kernel-rounds", type=count(0), default=10, help="extra rounds per stage with every ATen call timed"
    )
    parser.add_argument("--stage-blocks", type=count(), default=2, help="blocks per stage, from the model's middle")
    parser.add_argument("--micro-batch", type=count(), default=4, help="samples per micro-batch of a stage")
    parser.add_argument("--width", type=count(), default=None, help="hidden size (the sweep's default when omitted)")
    parser.add_argument("--depth", type=count(), default=None)
    parser.add_argument("--seq-len", type=count(), default=None)
    parser.add_argument("--image-size", type=count(), default=64)
    parser.add_argument("--threads", type=count(), default=1, help="torch.set_num_threads")
    parser.add_argument("--no-layers", action="store_true", help="time the stages only")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"JSON results (default {RESULTS})")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda, but CUDA is not available")
    torch.set_num_threads(args.threads)
    layers = {} if args.no_layers else layer_ratios(args.rounds, args.calls, args.warmup, args.device)
    if layers:
        _print_layers(layers)
    stages = {}
    if args.models:
        print(_STAGE_HEADER)
    for model_name in args.models:
        stages[model_name] = stage_ratios(model_name, args)
        _print_stage(model_name, stages[model_name])
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    document = {
        "benchmark": "per_call",
        "config": recorded_arguments(args),
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "load_average": load,
            "allocator": allocator_environment(),
            "device": device_name(args.device),
        },
        "layers": layers,
        "stages": stages,
    }
    print(f"load average {load}")
    write_json(args.out, document)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
