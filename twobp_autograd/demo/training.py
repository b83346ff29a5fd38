"""The training loop both ways of running the demo share: the same batches in the same
order for both sides of the comparison, their steps taking turns (and which goes first), so a
slow patch of a shared machine lands on both alike, and both scored after every epoch. After
the first step the two sides' gradients (from the same weights and batch) are compared."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .data import DigitsSplit
from .summary import epoch_line

__all__ = ["Side", "gradient_difference", "steps_per_epoch", "train"]


class Side:
    """One side of the comparison (2BP, or the same without it) and what its steps measured."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.step_seconds: list[float] = []
        self.losses: list[float] = []
        self.accuracies: list[float] = []
        # the first step's gradients against the other side's (see gradient_difference)
        self.first_step_grad_difference: float | None = None

    def parameters(self) -> list[tuple[str, Tensor]]:
        """This process's named parameters, in the same order on both sides."""
        raise NotImplementedError

    def most_over_ranks(self, value: float) -> float:
        """``value``'s largest over the processes that share the model (one: itself)."""
        return value

    def step(self, x: Tensor, y: Tensor) -> None:
        """One optimizer step on the batch; its time and mean loss are appended where this
        process measures them."""
        raise NotImplementedError

    def test_accuracy(self, x: Tensor, y: Tensor) -> float:
        raise NotImplementedError


def gradient_difference(side: Side, reference: Side) -> float:
    """The largest over parameters of ``max |g - g_ref| / max |g_ref|``: ``.grad`` as the last
    step left it, on every process holding part of the model. inf where only one side has a
    gradient or the names differ; 0 where both have none."""
    worst = 0.0
    for (name, p), (name_ref, p_ref) in zip(side.parameters(), reference.parameters(), strict=True):
        if name != name_ref or (p.grad is None) != (p_ref.grad is None):
            worst = float("inf")
        elif p.grad is not None and p_ref.grad is not None:
            scale = p_ref.grad.abs().max().clamp_min(torch.finfo(p_ref.grad.dtype).tiny)
            difference = float((p.grad - p_ref.grad).abs().max() / scale)
            # NaN on either side is no agreement (max() would pass over a NaN difference)
            worst = max(worst, difference if math.isfinite(difference) else float("inf"))
    return side.most_over_ranks(worst)


def steps_per_epoch(args: argparse.Namespace, num_samples: int) -> int:
    steps = num_samples // args.batch_size
    return steps if args.max_steps is None else min(steps, args.max_steps)


def train(sides: Sequence[Side], data: DigitsSplit, args: argparse.Namespace, *, reporting: bool) -> None:
    """``args.epochs`` passes over the training split; with ``reporting``, a progress bar and
    one line per epoch."""
    from tqdm import tqdm

    steps = steps_per_epoch(args, len(data.train_y))
    shuffle = torch.Generator().manual_seed(args.seed)  # the same order on every rank
    step_index = 0
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(len(data.train_y), generator=shuffle).to(data.train_y.device)
        bar = tqdm(
            range(steps), desc=f"epoch {epoch}/{args.epochs}", leave=False, dynamic_ncols=True, disable=not reporting
        )
        for i in bar:
            batch = order[i * args.batch_size : (i + 1) * args.batch_size]
            for side in sides if step_index % 2 == 0 else sides[::-1]:
                side.step(data.train_x[batch], data.train_y[batch])
            if step_index == 0 and len(sides) == 2:  # .grad holds the first step's until the next zero_grad
                sides[0].first_step_grad_difference = gradient_difference(sides[0], sides[1])
            step_index += 1
            if reporting:
                bar.set_postfix(loss=f"{sides[0].losses[-1]:.3f}", s_per_step=f"{sides[0].step_seconds[-1]:.2f}")
        bar.close()
        for side in sides:
            side.accuracies.append(side.test_accuracy(data.test_x, data.test_y))
        if reporting:
            print(epoch_line(epoch, sides, steps, args.batch_size), flush=True)
