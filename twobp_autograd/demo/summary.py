"""What the demo prints, alike for both ways of running it: the setting, one line per epoch,
and a summary of the two sides (2BP first, then plain when there is a comparison)."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .data import IMAGE_SIZE, MODELS, DigitsSplit

if TYPE_CHECKING:
    from .training import Side

__all__ = ["setting", "epoch_line", "summary"]


def setting(
    args: argparse.Namespace, data: DigitsSplit, num_parameters: int, how: str, steps: int, threads: str
) -> str:
    """The model and ``how`` it is trained, the data, the steps, the device and ``threads``."""
    return (
        f"{MODELS[args.model]} ({num_parameters / 1e6:.1f} M parameters){how}; digits {IMAGE_SIZE}x{IMAGE_SIZE}: "
        f"{len(data.train_y)} train / {len(data.test_y)} test; {steps} steps/epoch of {args.batch_size} in "
        f"{args.micro_batches} micro-batches; device {data.train_x.device}, {threads}"
    )


def epoch_line(epoch: int, sides: Sequence[Side], steps: int, batch_size: int) -> str:
    line = f"epoch {epoch}:"
    for side in sides:
        median = statistics.median(side.step_seconds[-steps:])
        line += (
            f"  {side.name} loss {statistics.fmean(side.losses[-steps:]):.4f} test acc {side.accuracies[-1]:.1%}"
            f" median step {median:.3f} s ({batch_size / median:.1f} samples/s)"
        )
    return line


def summary(sides: Sequence[Side], batch_size: int) -> str:
    lines = ["", "summary"]
    for side in sides:
        median = statistics.median(_settled(side.step_seconds))
        lines.append(
            f"  {side.name:5} final test accuracy {side.accuracies[-1]:.1%} (chance 10%), "
            f"median step {median:.3f} s, {batch_size / median:.2f} samples/s"
        )
    if len(sides) == 2:
        twobp, plain = sides
        # From the same weights and batch, the first step's gradients differ only in the fp32
        # order the flush sums them in (one concatenated call per layer against per micro-batch);
        # Adam then moves both alike, and a deep net with small BatchNorm batches amplifies that
        # rounding step by step, as it would any reordering of plain autograd's sums.
        grads = twobp.first_step_grad_difference
        lines.append(
            f"  first step's gradients, 2BP against plain: max relative difference {grads:.1e} over the "
            f"parameters (each: largest element difference over plain's largest); later steps drift at the "
            f"rounding level that any change of summation order causes (last step's loss: "
            f"{twobp.losses[-1]:.4f} vs {plain.losses[-1]:.4f})"
            if grads is not None
            else f"  last step's loss: {twobp.losses[-1]:.4f} vs {plain.losses[-1]:.4f}"
        )
        ratios = [a / b for a, b in zip(_settled(twobp.step_seconds), _settled(plain.step_seconds), strict=True)]
        lines.append(
            f"  median per-step ratio 2BP/plain: step time {statistics.median(ratios):.3f}, "
            f"throughput {statistics.median(1 / r for r in ratios):.3f}"
        )
    return "\n".join(lines)


def _settled(seconds: list[float]) -> list[float]:
    """The first step of each side pays one-off allocations; left out when there are more."""
    return seconds[1:] if len(seconds) > 1 else seconds
