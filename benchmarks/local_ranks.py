"""What the benchmarks here have in common: the models of ``bench pipeline`` and their
options, a benchmark function run on a few local gloo ranks (the package's own launcher),
each with its share of the cores, and its results written with the environment they were
measured in and the arguments they ran with (paths relative: no machine's paths kept)."""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from twobp_autograd.pipeline import zoo
from twobp_autograd.pipeline.launch import process_group, run_as_ranks

__all__ = [
    "KEEP_FREED_MEMORY",
    "add_model_arguments",
    "allocator_environment",
    "count",
    "device_name",
    "run_on_local_ranks",
    "recorded_arguments",
    "write_json",
    "synchronized_clock",
    "write_results",
]

#: glibc malloc tunables (read when a process starts) that keep freed memory in the process:
#: no trimming of the heap's top, and blocks up to 32 MiB (glibc's ceiling) from the heap, not
#: from mmap. With glibc's defaults a CPU step hands freed memory back to the system and
#: faults it in again on the next; a split backward, which holds output gradients until its
#: flush, pays that more than a plain one (README, "glibc's malloc and the split").
KEEP_FREED_MEMORY = {"MALLOC_TRIM_THRESHOLD_": str(1 << 30), "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}

#: What a results file records of the allocator settings it was measured under.
_ALLOCATOR_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_ARENA_MAX", "LD_PRELOAD")


def count(minimum: int = 1) -> Callable[[str], int]:
    """An argparse ``type``: an integer of at least ``minimum`` (steps, rounds, sizes), so that a
    0 is refused at the command line, not by a median of nothing after the run."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = "count"  # what argparse names in its message: "invalid count value"
    return parse


def add_model_arguments(parser: argparse.ArgumentParser, *, batch_size: int, batch_help: str | None = None) -> None:
    """The model options of ``bench pipeline``'s zoo (an MLP by default), and threads per rank."""
    zoo.add_model_arguments(parser, batch_size=batch_size, batch_help=batch_help)
    parser.add_argument("--threads", type=count(), default=None, help="CPU threads per rank (default: cores / ranks)")


def run_on_local_ranks(benchmark: Callable[[int, Any], Any], args: Any, world: int, backend: str = "gloo") -> None:
    """``benchmark(rank, args)`` on ``world`` spawned ranks of ``backend``, ``args.threads``
    threads each (default: the cores divided among the ranks)."""
    run_as_ranks(functools.partial(_rank_main, benchmark, backend), args, world)


def _rank_main(benchmark: Callable[[int, Any], Any], backend: str, args: Any) -> None:
    with process_group(timeout=600.0, backend=backend, threads=args.threads):
        benchmark(dist.get_rank(), args)


def write_results(path: str, world: int, document: dict[str, Any]) -> None:
    """``document`` as JSON at ``path``, with the world size, torch version and machine."""
    environment = {
        "world_size": world,
        "torch": torch.__version__,
        "machine": platform.platform(),
        "cpu_count": os.cpu_count(),
        "allocator": allocator_environment(),
    }
    write_json(path, {**environment, **document})


def allocator_environment() -> dict[str, str]:
    """The allocator variables set in this process's environment (a preloaded library by its
    file name only)."""
    found = {name: os.environ[name] for name in _ALLOCATOR_VARIABLES if os.environ.get(name)}
    if "LD_PRELOAD" in found:
        found["LD_PRELOAD"] = " ".join(Path(part).name for part in found["LD_PRELOAD"].split())
    return found


def synchronized_clock(device: torch.device | str | None = None) -> float:
    """Seconds, once ``device``'s queued work is done (a GPU runs behind the host)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def device_name(device: torch.device | str) -> str:
    """The GPU's name, or the processor's: what a result was measured on."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or "cpu"


def write_json(path: str | Path, document: dict[str, Any]) -> None:
    """``document`` as indented JSON at ``path``, its directory made if missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {path}")


def recorded_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """``args`` as a results file records them: a path relative to the working directory, or
    by its name where it lies elsewhere."""
    return {key: _relative(value) if _is_path(value) else value for key, value in vars(args).items()}


def _is_path(value: Any) -> bool:
    return isinstance(value, Path) or (isinstance(value, str) and os.path.isabs(value))


def _relative(path: str | Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return Path(path).name
