"""What ``bench pipeline`` reports on rank 0: a table of each run's medians, and on request
the JSON of every step and, for the last step of each run, a Chrome trace and a PNG timeline.
The JSON is what benchmarks/ reads back (the sweep, the stage costs), so its keys stay put."""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any

import torch
import torch.distributed as dist

from . import StepReport, plot_timeline, write_chrome_trace

__all__ = ["report"]

Runs = dict[tuple[str, bool], list[StepReport]]


def report(
    args: argparse.Namespace, reports: Runs, num_micro: dict[str, int], batch_size: int, costs: list[float], device: torch.device
) -> None:
    """Print the table; write the JSON (``--json``) and the traces (``--trace``)."""
    world, threads = dist.get_world_size(), torch.get_num_threads()
    summary = _summarise(reports, num_micro, batch_size)
    print(_table(summary, args, world, device, threads))
    if args.json:
        _write_json(args.json, args, world, device, threads, costs, summary, reports)
    if args.trace:
        _write_traces(args.trace, args.model, reports)


def _summarise(reports: Runs, num_micro: dict[str, int], batch_size: int) -> list[dict[str, Any]]:
    rows = []
    for (name, twobp), steps in reports.items():
        step_times = [r.step_time for r in steps]
        rows.append(
            {
                "schedule": name,
                "twobp": twobp,
                "micro_batches": num_micro[name],
                "step_time_median": statistics.median(step_times),
                "samples_per_s": batch_size / statistics.median(step_times),
                "bubble_ratio": statistics.median(r.bubble_ratio for r in steps),
                "peak_bytes": max(m.peak_bytes for r in steps for m in r.ranks),
                "peak_rss": max(m.peak_rss for r in steps for m in r.ranks),
                "loss": steps[-1].loss,
            }
        )
    off = {row["schedule"]: row["samples_per_s"] for row in rows if not row["twobp"]}
    for row in rows:
        row["ratio_to_off"] = row["samples_per_s"] / off[row["schedule"]] if row["schedule"] in off else None
    return rows


def _table(rows: list[dict[str, Any]], args: argparse.Namespace, world: int, device: torch.device, threads: int) -> str:
    memory = "peak alloc MiB" if device.type == "cuda" else "peak heap MiB"
    header = ["schedule", "2BP", "m", "samples/s", "vs 2BP off", "bubble", memory, "peak RSS MiB"]
    lines = [
        f"{args.model}: {world} ranks on {device.type}, {threads} thread(s) each, "
        f"median of {args.steps} step(s) after {args.warmup} warm-up, off/on alternating",
        "",
    ]
    table = [header] + [
        [
            row["schedule"],
            "on" if row["twobp"] else "off",
            str(row["micro_batches"]),
            f"{row['samples_per_s']:.2f}",
            "-" if row["ratio_to_off"] is None else f"{row['ratio_to_off']:.3f}",
            f"{row['bubble_ratio']:.3f}",
            f"{row['peak_bytes'] / 2**20:.1f}",
            f"{row['peak_rss'] / 2**20:.0f}",
        ]
        for row in rows
    ]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in table]
    return "\n".join(lines)


def _run_name(model: str, name: str, twobp: bool) -> str:
    return f"{model}-{name}-2bp-{'on' if twobp else 'off'}"


def _write_json(
    path: str,
    args: argparse.Namespace,
    world: int,
    device: torch.device,
    threads: int,
    costs: list[float],
    rows: list[dict[str, Any]],
    reports: Runs,
) -> None:
    document = {
        "arguments": vars(args),
        "world_size": world,
        "device": str(device),
        "threads_per_rank": threads,
        "torch": torch.__version__,
        "block_costs": costs,
        "summary": rows,
        "steps": {
            _run_name(args.model, name, twobp): [
                {
                    "step_time": r.step_time,
                    "bubble_ratio": r.bubble_ratio,
                    "throughput": r.throughput,
                    "idle": r.idle,
                    "loss": r.loss,
                    "peak_bytes": [m.peak_bytes for m in r.ranks],
                    "deferred_jobs": [m.deferred_jobs for m in r.ranks],
                }
                for r in steps
            ]
            for (name, twobp), steps in reports.items()
        },
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as file:
        json.dump(document, file, indent=2)


def _write_traces(directory: str, model: str, reports: Runs) -> None:
    os.makedirs(directory, exist_ok=True)
    for (name, twobp), steps in reports.items():
        timelines = [m.events for m in steps[-1].ranks]
        base = os.path.join(directory, _run_name(model, name, twobp))
        write_chrome_trace(base + ".json", timelines)
        plot_timeline(timelines, base + ".png", title=f"{model}, {name}, 2BP {'on' if twobp else 'off'} (last measured step)")
