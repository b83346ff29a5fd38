"""Command line: ``python -m twobp_autograd demo`` and ``python -m twobp_autograd bench pipeline``.

The subcommands import their modules lazily, so ``demo`` needs neither ``torch.distributed``
nor the pipeline code, and ``bench`` needs neither torchvision nor scikit-learn.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m twobp_autograd",
        description="2-stage backpropagation (2BP) for unchanged PyTorch models.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{demo,bench}")

    from .demo import add_arguments  # light: only argparse and the defaults

    demo = commands.add_parser(
        "demo",
        help="train ResNet-152 on scikit-learn's digits as a 2BP pipeline, against the same pipeline without 2BP",
        description="Train torchvision's ResNet-152, unchanged, on scikit-learn's bundled 8x8 digits "
        "as a 2-stage pipeline (two local ranks, or the ranks torchrun gives) with 2BP, against the "
        "same pipeline without it; --stages 1 trains it in this process against plain autograd.",
    )
    add_arguments(demo)

    bench = commands.add_parser("bench", help="benchmarks (bench pipeline --help)", add_help=False)
    bench.add_argument("target", choices=["pipeline"], help="what to benchmark")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of that benchmark")
    return parser


def main(argv: "Sequence[str] | None" = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `bench pipeline ...` hands everything after the target to the benchmark's own parser.
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] == "pipeline":
        return _bench_pipeline(argv[2:])
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from .demo import main as demo_main

        demo_main(args)
        return 0
    return _bench_pipeline(args.rest)  # unreachable: argparse only accepts `pipeline`


def _bench_pipeline(argv: list[str]) -> int:
    try:
        from .pipeline.bench import main as bench_main
    except ImportError as error:
        # Only the benchmark module's own absence is reported this way; a broken import
        # inside it keeps its traceback.
        if getattr(error, "name", None) not in ("twobp_autograd.pipeline.bench", "twobp_autograd.pipeline"):
            raise
        print(
            "error: the pipeline benchmark (twobp_autograd.pipeline.bench) is not available in "
            "this installation.",
            file=sys.stderr,
        )
        return 2
    return int(bench_main(argv) or 0)


if __name__ == "__main__":
    sys.exit(main())
