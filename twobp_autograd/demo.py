"""The demo: torchvision's ResNet-152, unchanged, trained with 2BP on scikit-learn's bundled
digits, step for step against the same model on plain autograd.

By default it runs as a pipeline (see :mod:`.demo_pipeline`); ``--stages 1`` is the
single-process comparison below.

Both models start from the same weights and see the same micro-batches, so their losses
must agree (up to float summation order) while 2BP moves the weight-gradient work out of
backward into one flush per step. The two trainings alternate step by step (and which one
goes first), so a slow patch of the shared machine lands on both sides alike; the medians of
their step times give the overhead ratio.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["add_arguments", "main", "load_digits_32", "build_resnet", "DigitsSplit", "MODELS"]

IMAGE_SIZE = 32
MODELS = {"resnet152": "ResNet-152", "resnet18": "ResNet-18"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--epochs", type=int, default=2, help="passes over the training split (default 2)")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per optimizer step (default 4)")
    parser.add_argument(
        "--batch-size", type=int, default=96, help="samples per optimizer step, split into the micro-batches (default 96)"
    )
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
    parser.add_argument("--seed", type=int, default=0, help="weights, split and shuffling (default 0)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="default cpu")
    parser.add_argument("--no-compare", action="store_true", help="train the patched model only (no plain run)")
    parser.add_argument(
        "--stages",
        type=int,
        default=2,
        help="pipeline stages, one local rank each (default 2; under torchrun: its ranks); 1 = one process",
    )
    parser.add_argument(
        "--schedule",
        default="gpipe",
        choices=["gpipe", "1f1b-1", "1f1b-2", "zb"],
        # On two CPU cores GPipe's one concatenated W per stage finishes the demo soonest.
        help="pipeline schedule (default gpipe)",
    )
    parser.add_argument("--model", default="resnet152", choices=list(MODELS), help="default resnet152; resnet18 is quick")
    parser.add_argument("--max-steps", type=int, default=None, help="at most this many steps per epoch (quick runs)")
    parser.add_argument(
        "--timeline",
        default="demo_timeline.png",
        help="PNG timeline of one pipelined 2BP step (default demo_timeline.png; '' for none)",
    )


@dataclass
class DigitsSplit:
    train_x: Tensor
    train_y: Tensor
    test_x: Tensor
    test_y: Tensor


def load_digits_32(seed: int) -> DigitsSplit:
    """scikit-learn's 1797 8x8 grey digits as 3x32x32 images, normalised with the training
    split's statistics; a stratified 75/25 train/test split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = F.interpolate(images, size=IMAGE_SIZE, mode="bilinear", align_corners=False)
    labels = torch.tensor(digits.target, dtype=torch.long)
    train_idx, test_idx = train_test_split(
        torch.arange(len(labels)).numpy(), test_size=0.25, random_state=seed, stratify=labels.numpy()
    )
    train_x, test_x = images[train_idx], images[test_idx]
    mean, std = train_x.mean(), train_x.std()
    # ResNet's stem wants 3 channels; the grey digit is repeated (a view, no copy).
    def prepare(x: Tensor) -> Tensor:
        return ((x - mean) / std).expand(-1, 3, -1, -1).contiguous()

    return DigitsSplit(prepare(train_x), labels[train_idx], prepare(test_x), labels[test_idx])


@dataclass
class Run:
    """One side of the comparison: a model, its optimizer, and what its steps measured."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    step: Callable[["Run", list[tuple[Tensor, Tensor]]], float]
    step_seconds: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    accuracies: list[float] = field(default_factory=list)


def _accumulate(run: Run, micro_batches: list[tuple[Tensor, Tensor]]) -> float:
    """Forward and backward of every micro-batch; returns the step's mean loss."""
    total = 0.0
    for x, y in micro_batches:
        loss = F.cross_entropy(run.model(x), y) / len(micro_batches)
        loss.backward()  # patched: backward-p1 only, the weight-gradient work is queued
        total += loss.item()
    return total


def plain_step(run: Run, micro_batches: list[tuple[Tensor, Tensor]]) -> float:
    run.optimizer.zero_grad(set_to_none=True)
    loss = _accumulate(run, micro_batches)
    run.optimizer.step()
    return loss


def twobp_step(run: Run, micro_batches: list[tuple[Tensor, Tensor]]) -> float:
    import twobp_autograd as twobp

    run.optimizer.zero_grad(set_to_none=True)
    loss = _accumulate(run, micro_batches)
    twobp.flush_weight_grads()  # backward-p2: one concatenated weight-grad call per layer
    run.optimizer.step()
    return loss


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(run: Run, micro_batches: list[tuple[Tensor, Tensor]], device: torch.device) -> None:
    _sync(device)
    start = time.perf_counter()
    loss = run.step(run, micro_batches)
    _sync(device)
    run.step_seconds.append(time.perf_counter() - start)
    run.losses.append(loss)


def build_resnet(name: str, seed: int) -> nn.Module:
    """torchvision's ResNet for the 10 digit classes, from ``seed`` (every rank builds the same).

    torchvision's own zero_init_residual starts every block as the identity (Goyal et al.):
    the default init's stem gradients explode on 8x8-pixel digits with small micro-batches."""
    import torchvision

    torch.manual_seed(seed)
    return getattr(torchvision.models, name)(num_classes=10, zero_init_residual=True)


def steps_per_epoch(args: argparse.Namespace, num_samples: int) -> int:
    steps = num_samples // args.batch_size
    return steps if args.max_steps is None else min(steps, args.max_steps)


def check_arguments(args: argparse.Namespace) -> None:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda, but CUDA is not available")
    if args.batch_size < args.micro_batches:
        raise SystemExit("error: --batch-size must be at least --micro-batches")
    if args.stages < 1 or (args.max_steps is not None and args.max_steps < 1):
        raise SystemExit("error: --stages and --max-steps must be at least 1")


@torch.no_grad()
def accuracy(model: nn.Module, x: Tensor, y: Tensor, batch: int = 256) -> float:
    model.eval()
    correct = sum(int((model(x[i : i + batch]).argmax(1) == y[i : i + batch]).sum()) for i in range(0, len(y), batch))
    model.train()
    return correct / len(y)


def main(args: argparse.Namespace) -> None:
    check_arguments(args)
    if args.stages > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun's ranks are the stages
        from .demo_pipeline import main as pipeline_main

        pipeline_main(args)
        return
    single_process_main(args)


def single_process_main(args: argparse.Namespace) -> None:
    """The whole model in this process, 2BP against plain autograd step for step."""
    from tqdm import tqdm

    import twobp_autograd as twobp

    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    data = load_digits_32(args.seed)
    train_x, train_y = data.train_x.to(device), data.train_y.to(device)
    test_x, test_y = data.test_x.to(device), data.test_y.to(device)

    model = build_resnet(args.model, args.seed).to(device)
    reference = copy.deepcopy(model)  # same initial weights, stays on plain autograd
    report = twobp.patch(model, report=True)
    runs = [Run("2BP", model, torch.optim.Adam(model.parameters(), lr=args.lr), twobp_step)]
    if not args.no_compare:
        runs.append(Run("plain", reference, torch.optim.Adam(reference.parameters(), lr=args.lr), plain_step))

    steps = steps_per_epoch(args, len(train_y))
    print(
        f"{MODELS[args.model]} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters), "
        f"{len(report.patched)} modules patched, {len(report.skipped)} on plain autograd; "
        f"digits {IMAGE_SIZE}x{IMAGE_SIZE}: {len(train_y)} train / {len(test_y)} test; "
        f"{steps} steps/epoch of {args.batch_size} in {args.micro_batches} micro-batches; "
        f"device {device}, {torch.get_num_threads()} threads"
    )
    shuffle = torch.Generator().manual_seed(args.seed)
    step_index = 0
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(len(train_y), generator=shuffle).to(device)
        bar = tqdm(range(steps), desc=f"epoch {epoch}/{args.epochs}", leave=False, dynamic_ncols=True)
        for i in bar:
            batch = order[i * args.batch_size : (i + 1) * args.batch_size]
            micro_batches = [(train_x[idx], train_y[idx]) for idx in batch.chunk(args.micro_batches)]
            # Alternate which side runs first, so neither always inherits a warm cache.
            for run in runs if step_index % 2 == 0 else runs[::-1]:
                timed_step(run, micro_batches, device)
            step_index += 1
            bar.set_postfix(loss=f"{runs[0].losses[-1]:.3f}", s_per_step=f"{runs[0].step_seconds[-1]:.2f}")
        bar.close()
        line = f"epoch {epoch}:"
        for run in runs:
            run.accuracies.append(accuracy(run.model, test_x, test_y))
            epoch_losses = run.losses[-steps:]
            line += (
                f"  {run.name} loss {statistics.fmean(epoch_losses):.4f} test acc {run.accuracies[-1]:.1%}"
                f" median step {statistics.median(run.step_seconds[-steps:]):.3f} s"
            )
        print(line, flush=True)
    _summary(runs)


def _summary(runs: list[Run]) -> None:
    twobp_run = runs[0]
    # The first step of each side pays one-off allocations; leave it out when there are more.
    def settled(seconds: list[float]) -> list[float]:
        return seconds[1:] if len(seconds) > 1 else seconds

    print("\nsummary")
    print(f"  2BP   final test accuracy {twobp_run.accuracies[-1]:.1%} (chance 10%)")
    if len(runs) == 1:
        print(f"  2BP   median step {statistics.median(settled(twobp_run.step_seconds)):.3f} s (no plain run)")
        return
    plain_run = runs[1]
    first = abs(twobp_run.losses[0] - plain_run.losses[0]) / abs(plain_run.losses[0])
    ratios = [a / b for a, b in zip(settled(twobp_run.step_seconds), settled(plain_run.step_seconds))]
    print(f"  plain final test accuracy {plain_run.accuracies[-1]:.1%}")
    # From the same weights the first step's loss agrees exactly; the flush then adds each
    # weight gradient in another fp32 order, and a 152-layer net with small BatchNorm batches
    # amplifies that rounding step by step, as it would any reordering of plain autograd's sums.
    print(
        f"  first-step losses agree to {first:.1e} (relative); later steps drift at the rounding level "
        f"that any change of summation order causes (last step: {twobp_run.losses[-1]:.4f} vs "
        f"{plain_run.losses[-1]:.4f})"
    )
    print(
        f"  median step: 2BP {statistics.median(settled(twobp_run.step_seconds)):.3f} s, plain "
        f"{statistics.median(settled(plain_run.step_seconds)):.3f} s; median per-step ratio 2BP/plain "
        f"{statistics.median(ratios):.3f}"
    )
