"""The demo in one process (``--stages 1``): the whole model patched for 2BP against a deep
copy of it on plain autograd, every micro-batch's backward then one flush per step."""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import flush_weight_grads, patch
from .data import build_resnet, load_digits_32
from .summary import setting, summary
from .training import Side, steps_per_epoch, train

__all__ = ["train_in_one_process"]


class ModelSide(Side):
    def __init__(self, name: str, model: nn.Module, args: argparse.Namespace, *, twobp: bool) -> None:
        super().__init__(name)
        self.model, self.twobp, self.micro_batches = model, twobp, args.micro_batches
        self.optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    def parameters(self) -> list[tuple[str, Tensor]]:
        return list(self.model.named_parameters())

    def step(self, x: Tensor, y: Tensor) -> None:
        device = x.device
        _sync(device)
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        # tensor_split, as the pipeline runtime: exactly m micro-batches, each weighted by its share
        for micro_x, micro_y in zip(
            x.tensor_split(self.micro_batches), y.tensor_split(self.micro_batches), strict=True
        ):
            loss = F.cross_entropy(self.model(micro_x), micro_y) * (len(micro_y) / len(y))
            loss.backward()  # patched: backward-p1 only, the weight-gradient work is queued
            total += loss.item()
        if self.twobp:
            flush_weight_grads()  # backward-p2: one concatenated weight-grad call per layer
        self.optimizer.step()
        _sync(device)
        self.step_seconds.append(time.perf_counter() - start)
        self.losses.append(total)

    @torch.no_grad()
    def test_accuracy(self, x: Tensor, y: Tensor, batch: int = 256) -> float:
        self.model.eval()
        correct = sum(
            int((self.model(x[i : i + batch]).argmax(1) == y[i : i + batch]).sum()) for i in range(0, len(y), batch)
        )
        self.model.train()
        return correct / len(y)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_in_one_process(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    data = load_digits_32(args.seed).to(device)
    model = build_resnet(args.model, args.seed).to(device)
    reference = copy.deepcopy(model)  # same initial weights, stays on plain autograd
    report = patch(model, report=True)
    sides = [ModelSide("2BP", model, args, twobp=True)]
    if not args.no_compare:
        sides.append(ModelSide("plain", reference, args, twobp=False))
    how = f", {len(report.patched)} modules patched, {len(report.skipped)} on plain autograd"
    num_parameters = sum(p.numel() for p in model.parameters())
    steps = steps_per_epoch(args, len(data.train_y))
    print(setting(args, data, num_parameters, how, steps, f"{torch.get_num_threads()} threads"))
    train(sides, data, args, reporting=True)
    print(summary(sides, args.batch_size))
