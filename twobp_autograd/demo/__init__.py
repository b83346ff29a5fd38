"""The demo: torchvision's ResNet-152, unchanged, trained with 2BP on scikit-learn's bundled
digits, step for step against the same model without 2BP.

By default it runs as a pipeline, one stage per rank (:mod:`.pipeline`); ``--stages 1`` trains
the whole model in this process against plain autograd (:mod:`.single_process`). Both sides
start from the same weights and see the same micro-batches, so their first step's gradients must
agree (up to float summation order; the demo prints by how much) while 2BP moves the
weight-gradient work out of backward; the medians of their step times give the ratio.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence

import torch

from ..pipeline import SCHEDULES
from .data import MODELS, TRAIN_SAMPLES

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m twobp_autograd demo",
        description="Train torchvision's ResNet-152, unchanged, on scikit-learn's bundled 8x8 digits "
        "as a 2-stage pipeline (two local ranks, or the ranks torchrun gives) with 2BP, against the "
        "same pipeline without it; --stages 1 trains it in this process against plain autograd.",
    )
    parser.add_argument("--epochs", type=int, default=2, help="passes over the training split (default 2)")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per optimizer step (default 4)")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=96,
        help="samples per optimizer step, split into the micro-batches (default 96)",
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
    # On two CPU cores GPipe's one concatenated W per stage finishes the demo soonest.
    parser.add_argument("--schedule", default="gpipe", choices=SCHEDULES, help="pipeline schedule (default gpipe)")
    parser.add_argument(
        "--model", default="resnet152", choices=list(MODELS), help="default resnet152; resnet18 is quick"
    )
    parser.add_argument("--max-steps", type=int, default=None, help="at most this many steps per epoch (quick runs)")
    parser.add_argument(
        "--timeline",
        default="demo_timeline.png",
        help="PNG timeline of one pipelined 2BP step (default demo_timeline.png; '' for none)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but CUDA is not available")
    if not (args.lr > 0 and math.isfinite(args.lr)):  # Adam's own check (lr >= 0) is a traceback, 0 trains nothing
        parser.error(f"--lr must be a positive number (Adam's learning rate), not {args.lr}")
    if args.micro_batches < 1 or args.epochs < 1:
        parser.error("--micro-batches and --epochs must be at least 1")
    if args.batch_size < args.micro_batches:
        parser.error("--batch-size must be at least --micro-batches")
    if args.batch_size > TRAIN_SAMPLES:
        parser.error(f"--batch-size must be at most {TRAIN_SAMPLES}, the training digits (one step per epoch)")
    if args.stages < 1 or (args.max_steps is not None and args.max_steps < 1):
        parser.error("--stages and --max-steps must be at least 1")
    if args.timeline and not os.path.isdir(os.path.dirname(os.path.abspath(args.timeline))):
        parser.error(f"--timeline: no directory {os.path.dirname(os.path.abspath(args.timeline))!r}")
    if args.stages > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun's ranks are the stages
        from ..pipeline.split import blocks_of
        from .data import build_resnet

        stages = int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ else args.stages
        blocks = len(blocks_of(build_resnet(args.model, args.seed)))
        if stages > blocks:
            parser.error(f"{stages} stages (--stages, or torchrun's ranks) but {args.model} has {blocks} blocks to cut")
        from ..pipeline.launch import run_as_ranks
        from .pipeline import rank_main

        run_as_ranks(rank_main, args, args.stages)
    else:
        from .single_process import train_in_one_process

        train_in_one_process(args)
    return 0
