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
    args: argparse.Namespace,
    reports: Runs,
    num_micro: dict[str, int],
    batch_size: int,
    costs: list[float],
    device: torch.device,
    wall: dict[tuple[str, bool], list[float]] | None = None,
) -> None:
    """Print the table; write the JSON (``--json``) and the traces (``--trace``). ``wall``:
    every run's step times between barriers (PyTorch's runs have only those)."""
    world, threads = dist.get_world_size(), torch.get_num_threads()
    summary = _summarise(reports, num_micro, batch_size)
    if wall:
        summary = _with_wall_times(summary, wall, num_micro)
    print(_table(summary, args, world, device, threads))
    if args.json:
        _write_json(args.json, args, world, device, threads, costs, summary, reports)
    if args.trace:
        _write_traces(args.trace, args.model, reports)


def _summarise(reports: Runs, num_micro: dict[str, int], batch_size: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
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
                # "process" where a rank could not reset its high-water mark: then every row of
                # that rank shows its peak since it started, and the rows do not compare
                "peak_rss_scope": (
                    "process" if any(m.peak_rss_scope == "process" for r in steps for m in r.ranks) else "step"
                ),
                "loss": steps[-1].loss,
            }
        )
    off = {row["schedule"]: row["samples_per_s"] for row in rows if not row["twobp"]}
    for row in rows:
        row["ratio_to_off"] = row["samples_per_s"] / off[row["schedule"]] if row["schedule"] in off else None
    return rows


#: The summary keys of a run of this package's runtime that PyTorch's runs have no figure for.
_MEASURED_BY_OUR_RUNS = (
    "step_time_median", "samples_per_s", "bubble_ratio", "peak_bytes", "peak_rss", "peak_rss_scope", "loss",
    "ratio_to_off",
)  # fmt: skip


def _with_wall_times(
    rows: list[dict[str, Any]], wall: dict[tuple[str, bool], list[float]], num_micro: dict[str, int]
) -> list[dict[str, Any]]:
    """Each row's median step time between barriers, PyTorch's rows added, and every row's
    throughput over PyTorch's GPipe (its step time over the row's)."""
    by_run = {(row["schedule"], row["twobp"]): row for row in rows}
    for (name, twobp), times in wall.items():
        if (name, twobp) not in by_run:  # PyTorch's: what only this package's runs measure is None
            by_run[name, twobp] = {
                **dict.fromkeys(_MEASURED_BY_OUR_RUNS),
                "schedule": name,
                "twobp": twobp,
                "micro_batches": num_micro[name],
            }
        by_run[name, twobp]["wall_step_median"] = statistics.median(times)
    reference = by_run.get(("torch-gpipe", False), {}).get("wall_step_median")
    for row in by_run.values():
        row["vs_torch_gpipe"] = reference / row["wall_step_median"] if reference and "wall_step_median" in row else None
    return list(by_run.values())


def _cell(row: dict[str, Any], key: str, form: str, scale: float = 1.0) -> str:
    value = row.get(key)
    return "-" if value is None else format(value / scale, form)


def _table(rows: list[dict[str, Any]], args: argparse.Namespace, world: int, device: torch.device, threads: int) -> str:
    memory = "peak alloc MiB" if device.type == "cuda" else "peak heap MiB"
    process_rss = any(row.get("peak_rss_scope") == "process" for row in rows)
    rss = "process peak RSS MiB" if process_rss else "step peak RSS MiB"
    header = ["schedule", "2BP", "m", "samples/s", "vs 2BP off", "bubble", memory, rss, "s/step", "vs torch GPipe"]
    lines = [
        f"{args.model}: {world} ranks on {device.type}, {threads} thread(s) each, "
        f"median of {args.steps} step(s) after {args.warmup} warm-up, runs taking turns step by step",
    ]
    if process_rss:
        lines.append(
            "peak RSS: each rank's peak since its process started (its high-water mark could not be reset "
            "through /proc/self/clear_refs), the same for every row: it does not compare 2BP on and off"
        )
    lines.append("")
    table = [header] + [
        [
            row["schedule"],
            "on" if row["twobp"] else "off",
            str(row["micro_batches"]),
            _cell(row, "samples_per_s", ".2f"),
            _cell(row, "ratio_to_off", ".3f"),
            _cell(row, "bubble_ratio", ".3f"),
            _cell(row, "peak_bytes", ".1f", 2**20),
            _cell(row, "peak_rss", ".0f", 2**20),
            _cell(row, "wall_step_median", ".3f"),
            _cell(row, "vs_torch_gpipe", ".3f"),
        ]
        for row in rows
    ]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)) for r in table]
    return "\n".join(lines)


def _run_name(model: str, name: str, twobp: bool) -> str:
    return f"{model}-{name.replace(':', '-max-pending-')}-2bp-{'on' if twobp else 'off'}"


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
                    "peak_rss": [m.peak_rss for m in r.ranks],
                    "peak_rss_scope": [m.peak_rss_scope for m in r.ranks],
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
        title = f"{model}, {name}, 2BP {'on' if twobp else 'off'} (last measured step)"
        plot_timeline(timelines, base + ".png", title=title)
