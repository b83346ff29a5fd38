"""The CUDA-only queue options, timed and weighed: host offload of pending W and W on
several streams, against 2BP's default queue and plain autograd, on one GPU.

A step = ``--micro-batches`` forward + backward-p1 calls, then one flush (plain: forward +
backward per micro-batch). Each round runs every variant once, in turn (A B C ... A B C ...),
so drift slows them alike; reported: the median step time over rounds, its ratio to the
default 2BP queue, and the peak GPU memory of a step.

    python benchmarks/cuda_options.py                      # ResNet-50, 8 micro-batches of 16
    python benchmarks/cuda_options.py --model mlp --rounds 30

Writes ``benchmarks/results/cuda_options.json``. Without a GPU it says so and exits.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from local_ranks import count, recorded_arguments, write_results  # noqa: E402

import twobp_autograd as twobp  # noqa: E402

VARIANTS = {
    "plain": None,
    "2bp": {},
    "2bp offload": {"offload_to_host": True},
    "2bp 2 streams": {"weight_grad_streams": 2},
    "2bp 4 streams": {"weight_grad_streams": 4},
    "2bp offload + 4 streams": {"offload_to_host": True, "weight_grad_streams": 4},
}


def build(name: str, micro_batch: int) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    if name == "resnet50":
        import torchvision

        model = torchvision.models.resnet50(num_classes=100)
        return model, lambda: torch.randn(micro_batch, 3, 128, 128, device="cuda")
    width = 4096
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()]
    return nn.Sequential(*layers), lambda: torch.randn(micro_batch, width, device="cuda")


def step(model: nn.Module, inputs: list[torch.Tensor], queue: twobp.WeightGradQueue | None) -> None:
    for x in inputs:
        if queue is None:
            model(x).float().pow(2).mean().backward()
        else:
            with twobp.use_queue(queue):
                model(x).float().pow(2).mean().backward()
    if queue is not None:
        queue.flush()
    model.zero_grad(set_to_none=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("resnet50", "mlp"), default="resnet50")
    parser.add_argument("--micro-batches", type=count(), default=8)
    parser.add_argument("--micro-batch", type=count(), default=16)
    parser.add_argument("--rounds", type=count(), default=20)
    parser.add_argument("--warmup", type=count(0), default=3)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "cuda_options.json"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("cuda_options.py times CUDA-only options and needs a CUDA GPU; none is visible here.")

    torch.manual_seed(0)
    base, make_input = build(args.model, args.micro_batch)
    models = {name: copy.deepcopy(base).cuda() for name in VARIANTS}
    for name, options in VARIANTS.items():
        if options is not None:
            twobp.patch(models[name])
    queues = {name: None if options is None else twobp.WeightGradQueue(**options) for name, options in VARIANTS.items()}
    inputs = [make_input() for _ in range(args.micro_batches)]
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    peaks: dict[str, int] = {name: 0 for name in VARIANTS}
    for round_ in range(args.warmup + args.rounds):
        for name in VARIANTS:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            step(models[name], inputs, queues[name])
            torch.cuda.synchronize()
            if round_ >= args.warmup:
                times[name].append(time.perf_counter() - start)
                peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated())
    reference = statistics.median(times["2bp"])
    summary = {
        name: {
            "step_s": statistics.median(times[name]),
            "ratio_to_2bp": statistics.median(times[name]) / reference,
            "peak_bytes": peaks[name],
            "peak_ratio_to_2bp": peaks[name] / peaks["2bp"],
        }
        for name in VARIANTS
    }
    print(
        f"{args.model}, {args.micro_batches} micro-batches of {args.micro_batch}, "
        f"{torch.cuda.get_device_name()}, {args.rounds} rounds (medians):"
    )
    for name, row in summary.items():
        print(
            f"  {name:<24} step {row['step_s'] * 1e3:8.1f} ms  x{row['ratio_to_2bp']:.3f} of 2bp  "
            f"peak {row['peak_bytes'] / 2**20:8.0f} MiB  x{row['peak_ratio_to_2bp']:.2f}"
        )
    document = {"device": torch.cuda.get_device_name(), "arguments": recorded_arguments(args), "variants": summary}
    write_results(args.out, 1, document)


if __name__ == "__main__":
    main()
