"""What ``torch.compile`` does to 2BP's overhead: one training step (forward, backward, the flush
on the patched side, ``optimizer.step``, ``zero_grad``) of the compiled patched model against the
compiled plain model (``backend="inductor"``), and, in the same run and the same rounds, of the
eager patched model against the eager plain one. Models: torchvision's ResNet-152 at a small
input (optionally only its first blocks: see --resnet-blocks) and Hugging Face's Llama from
``twobp_autograd.pipeline.zoo``, run as the chain of its pipeline blocks with its own norm class
deferred. Target: compiled patched / compiled plain <= 1.05.

All four models are deep copies of one (same weights), each with its own SGD optimizer. Before
timing, one step's gradients on the same batch are checked (a benchmark of a wrong model is
worthless): the compiled and eager patched models' against eager autograd's within rtol 1e-3,
the compiled plain model's, and the compiled patched against the compiled plain, within 5e-2
(inductor's plain model is the one that drifts: its fused batch norms), and the graph breaks
and graphs Dynamo made for each compiled side are counted (``torch._dynamo.utils.counters``).
The first step of each compiled side, which compiles, is timed apart. Then the four sides run
interleaved (A B C D, the order rotating every round); the statistic is the median over rounds
of the per-round ratio. The load average is recorded before and after each model.

On a GPU (``--device cuda``) each step ends in a synchronisation, and cuDNN's TF32 is off so
that the gradient check compares fp32 with fp32.

    python benchmarks/compiled.py [--models resnet152 llama] [--rounds 15] [--threads 1] [--resnet-blocks N]
    python benchmarks/compiled.py --device cuda
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from local_ranks import count, device_name, recorded_arguments, synchronized_clock, write_json  # beside this script
from torch import Tensor, nn
from torch._dynamo.utils import counters

import twobp_autograd as twobp

__all__ = ["main", "MODELS", "check_gradients", "parse_args"]

RESULTS = Path(__file__).resolve().parent / "results" / "compiled.json"
MODELS = ("resnet152", "llama")
LossFn = Callable[[Tensor, Tensor], Tensor]
#: Compiled patched against compiled plain, per parameter: |a - b| <= atol + rtol * |b| with
#: atol = rtol * max|b| (a fused kernel and a deferred one sum in different orders; the
#: absolute part follows the parameter's largest entry, as tests/utils.py does).
RTOL = 1e-3
#: Inductor's compiled *plain* model against eager autograd (measured: up to 2% of the largest
#: entry on ResNet, whose batch norms over 2 samples amplify the reordered sums of inductor's
#: fused kernels); the compiled patched model stays within RTOL of eager, so the two compiled
#: models are compared with this looser bound.
PLAIN_RTOL = 5e-2


@dataclass
class Side:
    """One model and how it is stepped, and the seconds each timed step took."""

    name: str
    model: nn.Module
    patched: bool
    optimizer: torch.optim.Optimizer
    times: list[float] = field(default_factory=list)


@dataclass
class Workload:
    """A plain model, one batch and its loss, and what the model is."""

    description: str
    model: nn.Module
    batch: tuple[Tensor, Tensor]
    loss_fn: LossFn


def _load() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def _resnet152(args: argparse.Namespace) -> Workload:
    import torchvision

    torch.manual_seed(args.seed)
    model: nn.Module = torchvision.models.resnet152(num_classes=10)
    what = "torchvision resnet152(num_classes=10)"
    if args.resnet_blocks is not None:
        blocks = [b for layer in (model.layer1, model.layer2, model.layer3, model.layer4) for b in layer]
        blocks = blocks[: args.resnet_blocks]
        stem = nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool)
        head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(1), nn.Linear(blocks[-1].conv3.out_channels, 10))
        model = nn.Sequential(stem, *blocks, head)
        what = f"torchvision resnet152: stem, its first {len(blocks)} bottleneck blocks, a pooled Linear head"
    generator = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=generator)
    y = torch.randint(0, 10, (args.batch_size,), generator=generator)
    description = f"{what}, batch {args.batch_size} at {args.image_size}x{args.image_size}"
    return Workload(description, model.train(), (x, y), F.cross_entropy)


def _llama(args: argparse.Namespace) -> Workload:
    from twobp_autograd.pipeline.split import blocks_of, defer_norms
    from twobp_autograd.pipeline.zoo import build_model

    options = argparse.Namespace(width=args.width, depth=args.depth, seq_len=args.seq_len, image_size=args.image_size)
    model, make_batch, loss_fn = build_model("llama", options, seed=args.seed)
    defer_norms(model)  # before patching: LlamaRMSNorm defers too
    chain = nn.Sequential(*blocks_of(model)).train()
    batch = make_batch(args.batch_size, torch.Generator().manual_seed(args.seed + 1))
    width, depth, seq = args.width or 256, args.depth or 8, args.seq_len or 64
    description = (
        f"Hugging Face LlamaForCausalLM, width {width}, {depth} layers, vocab 1000, batch {args.batch_size} x {seq}"
        " tokens"
    )
    return Workload(description, chain, batch, loss_fn)


def _step(side: Side, work: Workload) -> float:
    """Seconds of one training step of ``side``."""
    x, y = work.batch
    start = synchronized_clock(x.device)
    work.loss_fn(side.model(x), y).backward()
    if side.patched:
        twobp.flush_weight_grads()
    side.optimizer.step()
    side.optimizer.zero_grad(set_to_none=True)
    return synchronized_clock(x.device) - start


def _gradients(model: nn.Module, work: Workload, patched: bool) -> dict[str, Tensor]:
    """One forward and backward on the batch (and the flush); the gradients, then cleared."""
    x, y = work.batch
    work.loss_fn(model(x), y).backward()
    if patched:
        twobp.flush_weight_grads()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def check_gradients(patched: dict[str, Tensor], plain: dict[str, Tensor], rtol: float = RTOL) -> float:
    """Assert every gradient of ``patched`` within ``rtol`` (see :data:`RTOL`) of ``plain``'s;
    return the largest |difference| / max|plain| over the parameters."""
    differ = patched.keys() ^ plain.keys()
    assert not differ, f"gradients differ in which parameters have one: {sorted(differ)}"
    worst = 0.0
    for name, reference in plain.items():
        largest = reference.abs().max().item() or 1.0
        torch.testing.assert_close(
            patched[name], reference, rtol=rtol, atol=rtol * largest, msg=lambda m, n=name: f"{n}: {m}"
        )
        worst = max(worst, (patched[name] - reference).abs().max().item() / largest)
    return worst


def _strip(grads: dict[str, Tensor]) -> dict[str, Tensor]:
    """Parameter names without the ``_orig_mod.`` that ``torch.compile``'s wrapper adds."""
    return {name.replace("_orig_mod.", ""): grad for name, grad in grads.items()}


def _compile_first(side: Side, work: Workload) -> dict[str, Any]:
    """The first step of a compiled side (it compiles, forward and backward), timed, with the
    graph breaks and graphs Dynamo made for it; the gradients it computed."""
    counters.clear()
    start = time.perf_counter()
    grads = _gradients(side.model, work, side.patched)
    seconds = time.perf_counter() - start
    breaks = dict(counters["graph_break"])
    return {
        "first_step_s": seconds,
        "graph_breaks": sum(breaks.values()),
        "graph_break_reasons": {reason[:200]: n for reason, n in breaks.items()},
        "unique_graphs": counters["stats"]["unique_graphs"],
        "calls_captured": counters["stats"]["calls_captured"],
        "grads": grads,
    }


def _sides(work: Workload, args: argparse.Namespace) -> list[Side]:
    """Eager plain, eager patched, compiled plain, compiled patched: deep copies of one model."""

    def side(name: str, patched: bool, compiled: bool) -> Side:
        model = copy.deepcopy(work.model)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
        if patched:
            model = twobp.patch(model)
        if compiled:
            model = torch.compile(model, backend=args.backend)
        return Side(name, model, patched, optimizer)

    return [
        side("eager-plain", False, False),
        side("eager-2bp", True, False),
        side("compiled-plain", False, True),
        side("compiled-2bp", True, True),
    ]


def _interleave(sides: list[Side], work: Workload, rounds: int, warmup: int, name: str) -> int:
    """Time ``rounds`` rounds after ``warmup``; return the graphs Dynamo compiled while timing
    (0 unless a timed step recompiled)."""
    for _ in range(warmup):
        for side in sides:
            _step(side, work)
    counters.clear()
    for round_index in range(rounds):
        shift = round_index % len(sides)  # rotate who goes first
        for side in sides[shift:] + sides[:shift]:
            side.times.append(_step(side, work))
        line = "  ".join(f"{s.name} {s.times[-1]:.3f}s" for s in sides)
        print(f"{name} round {round_index + 1}/{rounds}: {line}", flush=True)
    return counters["stats"]["unique_graphs"]


def _ratio(numerator: Side, denominator: Side) -> dict[str, float]:
    ratios = [n / d for n, d in zip(numerator.times, denominator.times, strict=True)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One model: the gradient check, the compile counts, and the interleaved step times."""
    load_before = _load()
    work = _resnet152(args) if name == "resnet152" else _llama(args)
    work.model.to(args.device)
    work.batch = (work.batch[0].to(args.device), work.batch[1].to(args.device))
    torch._dynamo.reset()
    eager_plain, eager_patched, compiled_plain, compiled_patched = sides = _sides(work, args)
    compile_plain, compile_patched = _compile_first(compiled_plain, work), _compile_first(compiled_patched, work)
    reference = _gradients(eager_plain.model, work, False)
    plain_grads, patched_grads = (_strip(c.pop("grads")) for c in (compile_plain, compile_patched))
    check = {
        "rtol": RTOL,
        "compiled_2bp_vs_eager_plain": check_gradients(patched_grads, reference),
        "eager_2bp_vs_eager_plain": check_gradients(_gradients(eager_patched.model, work, True), reference),
        "compiled_plain_vs_eager_plain_rtol": PLAIN_RTOL,
        "compiled_plain_vs_eager_plain": check_gradients(plain_grads, reference, PLAIN_RTOL),
        "compiled_2bp_vs_compiled_plain": check_gradients(patched_grads, plain_grads, PLAIN_RTOL),
    }
    print(
        f"{name}: gradients match; largest |diff|/max: " + ", ".join(f"{k} {v:.2e}" for k, v in check.items())
        + f"; graph breaks plain {compile_plain['graph_breaks']}, patched {compile_patched['graph_breaks']}; "
        f"first step plain {compile_plain['first_step_s']:.1f}s, patched {compile_patched['first_step_s']:.1f}s",
        flush=True,
    )
    recompiled = _interleave(sides, work, args.rounds, args.warmup, name)
    ratios = {
        "compiled_2bp_over_compiled_plain": _ratio(compiled_patched, compiled_plain),
        "eager_2bp_over_eager_plain": _ratio(eager_patched, eager_plain),
        "compiled_plain_over_eager_plain": _ratio(compiled_plain, eager_plain),
        "compiled_2bp_over_eager_2bp": _ratio(compiled_patched, eager_patched),
    }
    load_after = _load()
    _print_model(work.description, sides, ratios, load_before, load_after)
    return {
        "model": work.description,
        "load_average_before": load_before,
        "load_average_after": load_after,
        "gradient_check": check,
        "compile": {"plain": compile_plain, "2bp": compile_patched, "graphs_compiled_while_timing": recompiled},
        "step_s_median": {s.name: statistics.median(s.times) for s in sides},
        "ratios": ratios,
        "times": {s.name: s.times for s in sides},
    }


def _print_model(
    description: str, sides: list[Side], ratios: dict[str, dict[str, float]], before: Any, after: Any
) -> None:
    print(f"\n{description}, {torch.get_num_threads()} threads (medians):")
    print("  " + "  ".join(f"{s.name} {statistics.median(s.times):.3f}s" for s in sides))
    for key, row in ratios.items():
        print(f"  {key:<36}{row['median']:>7.3f}  (min {row['min']:.3f}, max {row['max']:.3f})")
    print(f"  load average before {before}, after {after}\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", choices=MODELS, default=list(MODELS), help="models to time, in turn")
    parser.add_argument("--rounds", type=count(), default=15, help="timed rounds, each running every side once")
    # At least 1: the compiling step runs no optimizer step, and a compiled side's first whole
    # step recompiles (its gradients exist then): timed, it made the ratios nonsense.
    parser.add_argument("--warmup", type=count(1), default=2, help="untimed rounds after the compiling step")
    parser.add_argument("--batch-size", type=count(), default=2)
    parser.add_argument("--image-size", type=count(), default=64, help="resnet152 input resolution")
    parser.add_argument(
        "--resnet-blocks", type=count(), default=None, help="only the first N of ResNet-152's 50 bottleneck blocks"
    )
    parser.add_argument("--width", type=count(), default=None, help="llama hidden size (zoo default 256)")
    parser.add_argument("--depth", type=count(), default=None, help="llama layers (zoo default 8)")
    parser.add_argument("--seq-len", type=count(), default=None, help="tokens per sample (zoo default 64)")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--lr", type=float, default=1e-3, help="SGD learning rate")
    parser.add_argument("--threads", type=count(), default=1, help="torch.set_num_threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON results (default results/compiled.json)")
    return parser.parse_args(argv)



def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("error: --device cuda, but CUDA is not available")
        torch.backends.cudnn.allow_tf32 = False
    torch.set_num_threads(args.threads)
    models = {name: measure(name, args) for name in args.models}
    document = {
        "benchmark": "compiled",
        "config": recorded_arguments(args),
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "device": device_name(args.device),
        },
        "models": models,
    }
    write_json(args.out, document)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
