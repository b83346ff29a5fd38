"""Command line: ``python -m twobp_autograd demo`` and ``python -m twobp_autograd bench pipeline``.

Each subcommand is a module with ``main(argv) -> int`` that parses its own arguments; it is
imported only when named, so one subcommand never needs what another imports (``bench``
neither torchvision nor scikit-learn).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["SUBCOMMANDS", "Subcommand", "build_parser", "main"]


@dataclass(frozen=True)
class Subcommand:
    words: tuple[str, ...]
    module: str
    what: str  # for the error when the module is missing
    help: str

    def run(self, argv: list[str]) -> int:
        try:
            module = importlib.import_module(self.module)
        except ImportError as error:
            # Only the absence of the module (or of its package) is reported this way; a broken
            # import inside it keeps its traceback.
            parts = self.module.split(".")
            if error.name not in {".".join(parts[:end]) for end in range(2, len(parts) + 1)}:
                raise
            print(f"error: {self.what} ({self.module}) is not available in this installation.", file=sys.stderr)
            return 2
        from .pipeline.launch import RanksFailed

        try:
            return int(module.main(argv) or 0)
        except RanksFailed as error:  # each rank printed its own error: one line more, not a traceback
            print(f"error: {error}", file=sys.stderr)
            return 1


SUBCOMMANDS = (
    Subcommand(
        ("demo",),
        "twobp_autograd.demo",
        "the demo",
        "train ResNet-152 on scikit-learn's digits as a 2BP pipeline, against the same pipeline without 2BP",
    ),
    Subcommand(
        ("bench", "pipeline"),
        "twobp_autograd.pipeline.bench",
        "the pipeline benchmark",
        "throughput, bubble and memory of each pipeline schedule, 2BP on and off",
    ),
)


def build_parser() -> argparse.ArgumentParser:
    """The top level only, for ``--help`` and for what names no subcommand."""
    parser = argparse.ArgumentParser(
        prog="python -m twobp_autograd",
        description="2-stage backpropagation (2BP) for unchanged PyTorch models.",
        epilog="Each subcommand takes --help.",
    )
    names = [" ".join(command.words) for command in SUBCOMMANDS]
    commands = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(names) + "}")
    for name, command in zip(names, SUBCOMMANDS, strict=True):
        commands.add_parser(name, help=command.help, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    for command in SUBCOMMANDS:
        if argv[: len(command.words)] == list(command.words):
            return command.run(argv[len(command.words) :])
    parser = build_parser()
    # A command quoted as one word ("bench pipeline"): the usage lists it with its space, and
    # argparse would take it, to no subcommand.
    for command in SUBCOMMANDS:
        if len(command.words) > 1 and argv[:1] and argv[0].split() == list(command.words):
            name = " ".join(command.words)
            parser.error(f"'{argv[0]}' was given as one word (quoted); pass it as {len(command.words)} words: {name}")
    # The first word of a longer command alone ("bench", "bench --help"): argparse would call
    # it an invalid choice.
    longer = [" ".join(command.words) for command in SUBCOMMANDS if argv[:1] == list(command.words[:1])]
    if longer:
        parser.error(f"'{argv[0]}' is the start of a command: {', '.join(longer)} (each takes --help)")
    parser.parse_args(argv)  # --help, or the error that names the subcommands
    parser.error(f"unknown command: {' '.join(argv)}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
