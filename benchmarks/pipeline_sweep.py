"""The pipeline sweep: every model ``bench pipeline`` offers x every schedule, 2BP on and off,
against the performance model (docs/performance.md) and the simulator fed with measured stage costs.

The schedules are the one-stage-per-rank ones (GPipe, 1F1B-1, 1F1B-2, zb) and those whose
ranks hold two stages each (interleaved 1F1B on the loop placement, ZB-V on the V): on 2
ranks the latter cut the model into 4 stages. Per model, on 2 gloo ranks with one thread each:

1. ``bench pipeline`` (all schedules, 2BP off and on alternating step by step): measured
   throughput, bubble and step time;
2. ``stage_costs.py`` on the same model, seed and 2-rank cut: per-block F, B, I, W(n), the
   storages each block saves per micro-batch and what it queues, and the p2p latency. Every
   block is timed alone, so any cut (4 stages included) is a sum of blocks;
3. from those, offline: the *ideal* 2BP/off ratio of each schedule (docs/performance.md's model:
   balanced stages at the slowest stage's F, I, W, W', no communication, B = I + W), the
   *simulated* step times (the same action lists replayed with every stage's own measured
   terms, its B and the latency) to compare with the measured ones, the modelled peak
   activation memory, and simulated predictions for 4 and 8 ranks (p stages, or 2p for the
   two-stage-per-rank schedules; N = p or 2p micro-batches of the measured size).

Every cut is the one ``partition`` makes of the block costs ``bench pipeline`` recorded (its
first run's). What cannot be computed from what was measured (the modelled memory of a cut
whose blocks' storages were not recorded) is named under ``not_available`` instead.

Then ``pipelining_zb.py`` (PyTorch's zero-bubble schedules with 2BP's W vs PyTorch's split
W). Everything lands in ``<out>/pipeline.json``; ``plot_results.py`` turns it into
``pipeline.md``, ``pipeline.png`` and a timeline per model.

Each part is saved under ``<out>/raw/`` as soon as it is done, named by a hash of its
configuration, so an interrupted sweep resumes where it stopped (``--force`` redoes it).

    python benchmarks/pipeline_sweep.py            # full: ~30 min on 2 idle cores
    python benchmarks/pipeline_sweep.py --quick    # smoke run, 5-7 min, into results/quick/

Run it on an otherwise idle machine: the ranks share the cores with anything else running,
and the recorded load average says how idle it was.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from local_ranks import KEEP_FREED_MEMORY, allocator_environment  # beside this script

from twobp_autograd.pipeline import bench
from twobp_autograd.pipeline.actions import Action, Held, RankMemory
from twobp_autograd.pipeline.schedules import (
    MULTI_STAGE_SCHEDULES,
    SCHEDULES,
    default_num_micro_batches,
    placement,
    schedule,
)
from twobp_autograd.pipeline.simulator import SimulationResult, StageCosts, simulate
from twobp_autograd.pipeline.split import partition
from twobp_autograd.pipeline.trace import write_chrome_trace

__all__ = [
    "SWEEP_SCHEDULES",
    "Mode",
    "MODES",
    "StageTerms",
    "weight_grad_curve",
    "latency_model",
    "stage_terms",
    "ideal_ratio",
    "simulate_pair",
    "modeled_peak_bytes",
    "stages_per_rank",
    "message_bytes",
    "analyse_model",
    "main",
]

HERE = Path(__file__).resolve().parent
WORLD = 2
PREDICT_STAGES = (4, 8)  # ranks: the stages of each schedule's placement on them
#: What the sweep runs: one stage per rank, then two (loop and V placements).
SWEEP_SCHEDULES: tuple[str, ...] = SCHEDULES + MULTI_STAGE_SCHEDULES


@dataclass(frozen=True)
class Mode:
    """How long each part runs; ``quick`` also shrinks the models."""

    name: str
    steps: int
    warmup: int
    cost_repeats: int
    counts: tuple[int, ...]
    bench_shape: tuple[str, ...] = ()
    zb_arguments: tuple[str, ...] = ()
    zb_schedules: tuple[str, ...] = ("zbv", "interleaved_zb")
    latency_repeats: int = 20


MODES = {
    "full": Mode("full", steps=6, warmup=2, cost_repeats=3, counts=(1, 2, 4, 8)),
    "quick": Mode(
        "quick",
        steps=1,
        warmup=1,
        cost_repeats=1,
        counts=(1, 2),
        # depth 4: the MLP's 4 blocks make the 4 stages of the two-stage-per-rank schedules
        bench_shape=("--width", "64", "--depth", "4", "--seq-len", "16", "--image-size", "32", "--batch-size", "8"),
        zb_arguments=(
            "--width", "64", "--hidden", "256", "--seq", "8", "--batch", "8", "--warmup", "1", "--rounds", "2"
        ),  # fmt: skip
        zb_schedules=("zbv",),
        latency_repeats=5,
    ),
}


# -- stage terms from per-block measurements -------------------------------------------------


@dataclass
class StageTerms:
    """One stage's measured per-micro-batch terms (seconds) at one micro-batch size."""

    forward_off: float
    forward_on: float
    backward: float
    input_grad: float
    weight_grad: dict[int, float]  # n -> time of one W over n concatenated micro-batches
    boundary_bytes: int  # what the stage sends on (its output)
    saved_bytes_off: int | None = None  # per micro-batch, from F to B (measured per 2-rank stage)
    saved_bytes_on: int | None = None  # from F to I
    pending_bytes: int = 0  # from I to W
    curve: Callable[[int], float] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.curve = weight_grad_curve(self.weight_grad)

    def costs(self, twobp: bool, *, split_backward: bool = False, concatenation: bool = True) -> StageCosts:
        """The simulator's costs: measured F/B with 2BP off, F/I/W(n) with it on.
        ``split_backward``: B = I + W(1) instead of the measured B (the performance model's);
        ``concatenation`` False: W(n) = n W(1), no concatenation gain."""
        w1 = self.weight_grad[1]
        return StageCosts(
            forward=self.forward_on if twobp else self.forward_off,
            input_grad=self.input_grad,
            weight_grad=w1,
            full_backward=None if split_backward else self.backward,
            weight_grad_by_count=self.curve if concatenation else (lambda n: n * w1),
        )

    def summary(self) -> dict[str, Any]:
        return {
            "forward_off": self.forward_off,
            "forward_on": self.forward_on,
            "backward": self.backward,
            "input_grad": self.input_grad,
            "weight_grad_1": self.weight_grad[1],
            "weight_grad_per_micro_batch": {str(n): t / n for n, t in sorted(self.weight_grad.items())},
            "split_overhead": (self.input_grad + self.weight_grad[1]) / self.backward if self.backward else None,
            "forward_overhead": self.forward_on / self.forward_off if self.forward_off else None,
            "boundary_bytes": self.boundary_bytes,
            "saved_bytes_off": self.saved_bytes_off,
            "saved_bytes_on": self.saved_bytes_on,
            "pending_bytes": self.pending_bytes,
        }


def weight_grad_curve(points: Mapping[int, float]) -> Callable[[int], float]:
    """W(n) from measured points (n must include 1): linear between them, and beyond the
    largest at its per-micro-batch time (concatenation gains nothing more)."""
    ns = sorted(points)
    if not ns or ns[0] != 1:
        raise ValueError(f"W(n) needs a measured W(1), got n = {ns}")

    def at(n: int) -> float:
        if n in points:
            return points[n]
        if n > ns[-1]:
            return points[ns[-1]] * n / ns[-1]
        low = max(k for k in ns if k < n)
        high = min(k for k in ns if k > n)
        return points[low] + (points[high] - points[low]) * (n - low) / (high - low)

    return at


def latency_model(points: Sequence[Sequence[float]]) -> Callable[[int], float]:
    """One-way message time from (bytes, seconds) points: the least-squares line, never below
    the fastest measured message."""
    xs = [float(b) for b, _ in points]
    ys = [float(t) for _, t in points]
    floor = min(ys)
    if len(points) < 2 or max(xs) == min(xs):
        return lambda num_bytes: floor
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum((x - mean_x) ** 2 for x in xs)
    slope = max(slope, 0.0)
    intercept = mean_y - slope * mean_x
    return lambda num_bytes: max(floor, intercept + slope * num_bytes)


def _blocks_by_index(
    costs: Mapping[str, Any], size: int
) -> tuple[list[dict[str, Any]], dict[str, Any] | None, dict[int, dict[str, Any]]]:
    """Per-block measurements of the whole model at one micro size (from both ranks, each
    tagged with its ``rank``), the loss pseudo-block, and the stage-level saved bytes by
    first block index."""
    blocks: dict[int, dict[str, Any]] = {}
    loss = None
    stage_level: dict[int, dict[str, Any]] = {}
    for rank in costs["ranks"]:
        measured = [{**block, "rank": rank["rank"]} for block in rank["per_size"][str(size)]]
        # measured may end with the loss pseudo-block, past the blocks: zipped up to the blocks
        for index, block in zip(rank["blocks"], measured, strict=False):
            blocks[index] = block
        if len(measured) > len(rank["blocks"]):
            loss = measured[-1]
        stage_level[rank["blocks"][0]] = measured[0]
    missing = sorted(set(range(len(costs["block_costs"]))) - set(blocks))
    if missing:
        raise ValueError(f"blocks {missing} were not measured")
    return [blocks[i] for i in range(len(blocks))], loss, stage_level


def _storage_bytes(members: Sequence[Mapping[str, Any]], key: str) -> int | None:
    """The bytes of the storages ``members`` save, each counted once (a storage is named by
    the rank that measured it and its number there); None if a block's were not recorded."""
    if any(key not in block for block in members):
        return None
    storages = {(block["rank"], number): size for block in members for number, size in block[key]}
    return sum(storages.values())


def stage_terms(costs: Mapping[str, Any], size: int, num_stages: int) -> tuple[list[range], list[StageTerms]]:
    """The cut ``bench pipeline``'s balancing makes for ``num_stages`` stages, and each stage's
    terms at micro-batch size ``size``: sums of its blocks' (the loss on the last). A stage's
    saved bytes are its blocks' storages counted once; without those (older measurements),
    the measured stage's own count when the cut is the measured one, else None."""
    blocks, loss, stage_level = _blocks_by_index(costs, size)
    ranges = partition(costs["block_costs"], num_stages)
    terms = []
    for index, part in enumerate(ranges):
        members = [blocks[i] for i in part] + ([loss] if loss is not None and index == num_stages - 1 else [])
        counts = sorted({int(n) for n in members[0]["weight_grad"]})
        first = stage_level.get(part.start, {}) if num_stages == WORLD else {}
        saved = {flag: _storage_bytes(members, f"saved_storages_{flag}") for flag in ("off", "on")}
        terms.append(
            StageTerms(
                forward_off=sum(b["forward_off"] for b in members),
                forward_on=sum(b["forward_on"] for b in members),
                backward=sum(b["backward"] for b in members),
                input_grad=sum(b["input_grad"] for b in members),
                weight_grad={n: sum(b["weight_grad"][str(n)] for b in members) for n in counts},
                boundary_bytes=blocks[part[-1]]["output_bytes"],
                saved_bytes_off=saved["off"] if saved["off"] is not None else first.get("stage_saved_bytes_off"),
                saved_bytes_on=saved["on"] if saved["on"] is not None else first.get("stage_saved_bytes_on"),
                pending_bytes=sum(b["pending_bytes"] for b in members),
            )
        )
    return ranges, terms


# -- models of a step ------------------------------------------------------------------------


def stages_per_rank(name: str) -> int:
    """How many stages each rank holds under schedule ``name``."""
    return len(placement(name, 1))


def message_bytes(name: str, terms: Sequence[StageTerms]) -> int:
    """The largest activation sent between ranks under ``name``'s placement of ``terms``' stages
    (a hand-over between two stages of one rank sends nothing)."""
    owners = placement(name, len(terms) // stages_per_rank(name))
    crossing = [t.boundary_bytes for s, t in enumerate(terms[:-1]) if owners[s] != owners[s + 1]]
    return max(crossing, default=0)


def simulate_pair(
    name: str, terms: Sequence[StageTerms], num_micro_batches: int, latency: float
) -> tuple[SimulationResult, SimulationResult]:
    """Replay ``name`` with 2BP off and on, every stage with its own measured terms (on
    ``len(terms)`` ranks, or half as many for the schedules holding two stages per rank)."""
    p = len(terms) // stages_per_rank(name)
    off = simulate(
        schedule(name, p, num_micro_batches, twobp=False), [t.costs(False) for t in terms], p2p_latency=latency
    )
    on = simulate(schedule(name, p, num_micro_batches, twobp=True), [t.costs(True) for t in terms], p2p_latency=latency)
    return off, on


def ideal_ratio(
    name: str, num_ranks: int, num_micro_batches: int, bottleneck: StageTerms, *, concatenation: bool = True
) -> float:
    """The performance model (docs/performance.md) for ``name`` on ``num_ranks`` ranks (as many
    stages, or twice as many for the two-stage-per-rank schedules): every stage costs the
    bottleneck stage's F (2BP off), I and W (B = I + W; W(n) as measured, or n W(1) without
    ``concatenation``), no communication. Throughput ratio 2BP on / off. For GPipe this is
    (m+p-1)(F+I+W) / ((m+p-1)(F+I) + m W')."""
    off_costs = bottleneck.costs(False, split_backward=True, concatenation=concatenation)
    on_costs = StageCosts(
        forward=off_costs.forward,
        input_grad=off_costs.input_grad,
        weight_grad=off_costs.weight_grad,
        weight_grad_by_count=off_costs.weight_grad_by_count,
    )
    off = simulate(schedule(name, num_ranks, num_micro_batches, twobp=False), off_costs)
    on = simulate(schedule(name, num_ranks, num_micro_batches, twobp=True), on_costs)
    return off.step_time / on.step_time


def modeled_peak_bytes(
    actions: Sequence[Action],
    graph_bytes: int | Mapping[int, int],
    pending_bytes: int | Mapping[int, int],
    rank: int = 0,
) -> int:
    """Peak activation bytes of ``rank`` running ``actions``: each micro-batch of a stage holds
    that stage's ``graph_bytes`` from its F to its B or I, and its ``pending_bytes`` from its I
    to its W (one figure for every stage, or one per stage index)."""
    memory: dict[int, RankMemory] = {}
    peak = 0
    for action in actions:
        memory.setdefault(action.stage_on(rank), RankMemory()).run(action)
        held = sum(
            stage.size({Held.GRAPH: _of(graph_bytes, index), Held.PENDING_WEIGHT_GRADS: _of(pending_bytes, index)})
            for index, stage in memory.items()
        )
        peak = max(peak, held)
    return peak


def _of(amount: int | Mapping[int, int], stage: int) -> int:
    return amount if isinstance(amount, int) else amount[stage]


def _bottleneck(terms: Sequence[StageTerms]) -> StageTerms:
    return max(terms, key=lambda t: t.forward_off + t.backward)


def analyse_model(
    bench_doc: Mapping[str, Any], costs: Mapping[str, Any], timeline_schedule: str = "1f1b-2"
) -> dict[str, Any]:
    """Every figure of one model: measured (bench), ideal, simulated, memory, predictions."""
    rows = {(row["schedule"], row["twobp"]): row for row in bench_doc["summary"]}
    schedules = [name for name in SWEEP_SCHEDULES if (name, False) in rows and (name, True) in rows]
    batch = round(rows[schedules[0], False]["samples_per_s"] * rows[schedules[0], False]["step_time_median"])
    latency = latency_model(costs["latency_points"])
    result: dict[str, Any] = {"batch_size": batch, "stage_terms": {}, "schedules": {}, "cuts": {}}
    timeline = None
    for name in schedules:
        off_row, on_row = rows[name, False], rows[name, True]
        m = off_row["micro_batches"]
        size = -(-batch // m)
        num_stages = WORLD * stages_per_rank(name)
        ranges, terms = stage_terms(costs, size, num_stages)
        result["cuts"][str(num_stages)] = [[r.start, r.stop] for r in ranges]
        summaries = [t.summary() for t in terms]
        if num_stages == WORLD:
            result["stage_terms"].setdefault(str(size), summaries)
        else:
            result.setdefault("stage_terms_by_cut", {}).setdefault(str(num_stages), {}).setdefault(str(size), summaries)
        message = latency(message_bytes(name, terms))
        sim_off, sim_on = simulate_pair(name, terms, m, message)
        ideal = ideal_ratio(name, WORLD, m, _bottleneck(terms))
        measured = _measured(off_row, on_row)
        entry: dict[str, Any] = {
            "micro_batches": m,
            "micro_batch_size": size,
            "stages": num_stages,
            "placement": list(placement(name, WORLD)),
            "measured": measured,
            "ideal": {
                "throughput_ratio": ideal,
                "throughput_ratio_without_concatenation_gain": ideal_ratio(
                    name, WORLD, m, _bottleneck(terms), concatenation=False
                ),
            },
            "measured_over_ideal": measured["throughput_ratio"] / ideal,
            "simulated": {
                "p2p_latency": message,
                "step_time_off": sim_off.step_time,
                "step_time_on": sim_on.step_time,
                "throughput_ratio": sim_off.step_time / sim_on.step_time,
                "bubble_off": sim_off.bubble_ratio,
                "bubble_on": sim_on.bubble_ratio,
                "step_time_error_off": sim_off.step_time / off_row["step_time_median"] - 1,
                "step_time_error_on": sim_on.step_time / on_row["step_time_median"] - 1,
            },
            "predicted": {str(p): _predicted(name, costs, size, p, latency) for p in PREDICT_STAGES},
        }
        memory = _modeled_memory(name, terms, m)
        if memory is not None:
            entry["memory_modeled"] = memory
        else:
            entry["not_available"] = {
                "memory_modeled": f"the bytes each block saves were not recorded: no saved bytes for a "
                f"{num_stages}-stage cut (re-measure the stage costs)"
            }
        if name == timeline_schedule:
            timeline = sim_on
        result["schedules"][name] = entry
    result["timeline_schedule"] = timeline_schedule if timeline is not None else None
    result["_simulated_timeline"] = timeline  # written as a trace by the caller, not into JSON
    return result


def _measured(off_row: Mapping[str, Any], on_row: Mapping[str, Any]) -> dict[str, Any]:
    """What ``bench pipeline`` measured for one schedule, 2BP off against on."""
    return {
        "step_time_off": off_row["step_time_median"],
        "step_time_on": on_row["step_time_median"],
        "throughput_ratio": on_row["samples_per_s"] / off_row["samples_per_s"],
        "bubble_off": off_row["bubble_ratio"],
        "bubble_on": on_row["bubble_ratio"],
        "bubble_ratio_on_over_off": (
            on_row["bubble_ratio"] / off_row["bubble_ratio"] if off_row["bubble_ratio"] else None
        ),
        # the runtime's CPU peak: heap in use after any action over the step's start
        "peak_heap_bytes_off": off_row["peak_bytes"],
        "peak_heap_bytes_on": on_row["peak_bytes"],
        "peak_memory_ratio": on_row["peak_bytes"] / off_row["peak_bytes"] if off_row["peak_bytes"] else None,
    }


def _modeled_memory(name: str, terms: Sequence[StageTerms], num_micro_batches: int) -> dict[str, Any] | None:
    """Peak activation bytes over the ranks, 2BP off and on, from the measured bytes per
    stage; None when a stage's are unknown."""
    off_bytes = {s: t.saved_bytes_off for s, t in enumerate(terms) if t.saved_bytes_off is not None}
    on_bytes = {s: t.saved_bytes_on for s, t in enumerate(terms) if t.saved_bytes_on is not None}
    if len(off_bytes) < len(terms) or len(on_bytes) < len(terms):
        return None
    pending = {s: t.pending_bytes for s, t in enumerate(terms)}
    plans = {flag: schedule(name, WORLD, num_micro_batches, twobp=flag) for flag in (False, True)}
    off_peak = max(modeled_peak_bytes(plans[False][r], off_bytes, 0, r) for r in range(WORLD))
    on_peak = max(modeled_peak_bytes(plans[True][r], on_bytes, pending, r) for r in range(WORLD))
    return {"peak_bytes_off": off_peak, "peak_bytes_on": on_peak, "ratio": on_peak / off_peak if off_peak else None}


def _predicted(
    name: str, costs: Mapping[str, Any], size: int, num_ranks: int, latency: Callable[[int], float]
) -> dict[str, Any]:
    """The simulated step of ``name`` on ``num_ranks`` ranks, its stages cut from the measured blocks."""
    n = default_num_micro_batches(name, num_ranks)
    num_stages = num_ranks * stages_per_rank(name)
    if len(costs["block_costs"]) < num_stages:
        return {"skipped": f"{len(costs['block_costs'])} blocks cannot make {num_stages} stages"}
    cut, terms = stage_terms(costs, size, num_stages)
    off, on = simulate_pair(name, terms, n, latency(message_bytes(name, terms)))
    return {
        "micro_batches": n,
        "stages": num_stages,
        "cut": [[r.start, r.stop] for r in cut],
        "step_time_off": off.step_time,
        "step_time_on": on.step_time,
        "throughput_ratio": off.step_time / on.step_time,
        "bubble_off": off.bubble_ratio,
        "bubble_on": on.bubble_ratio,
        "ideal_throughput_ratio": ideal_ratio(name, num_ranks, n, _bottleneck(terms)),
    }


# -- running the parts -----------------------------------------------------------------------


def _digest(config: Mapping[str, Any]) -> str:
    """A part's name: its configuration, and the allocator settings where any are set (results
    measured under glibc's defaults keep the names they had)."""
    allocator = allocator_environment()
    named = {**config, "allocator": allocator} if allocator else config
    return hashlib.sha1(json.dumps(named, sort_keys=True).encode()).hexdigest()[:10]


def _repo_path(path: Path) -> str:
    """``path`` as the parts (run from the repository root) get it: relative, so nothing they
    record names this machine's directories."""
    return os.path.relpath(path, HERE.parent)


def _run(command: Sequence[str], log: Path) -> None:
    """Run a part in its own process (its ranks, its memory), its output kept in ``log``."""
    printable = " ".join(command[1:]) if command[0] == sys.executable else " ".join(command)
    print(f"  $ python {printable}", flush=True)
    start = time.perf_counter()
    with log.open("w") as stream:
        completed = subprocess.run(list(command), stdout=stream, stderr=subprocess.STDOUT, cwd=HERE.parent)
    print(f"    {time.perf_counter() - start:.0f} s", flush=True)
    if completed.returncode != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-25:])
        raise RuntimeError(f"exit status {completed.returncode}:\n{tail}")


def _run_model(model: str, mode: Mode, raw: Path, *, force: bool, timeline_schedule: str) -> dict[str, Any]:
    bench_args = [
        "--model", model, "--schedule", *SWEEP_SCHEDULES, "--twobp", "both",
        "--steps", str(mode.steps), "--warmup", str(mode.warmup),
        "--threads", "1", "--nproc", str(WORLD), "--no-progress", *mode.bench_shape,
    ]  # fmt: skip
    directory = raw / f"{model}-{_digest({'bench': bench_args, 'costs': [mode.counts, mode.cost_repeats]})}"
    directory.mkdir(parents=True, exist_ok=True)
    bench_json, costs_json, traces = directory / "bench.json", directory / "costs.json", directory / "traces"
    bench_command = [sys.executable, "-m", "twobp_autograd", "bench", "pipeline", *bench_args]
    if force or not bench_json.exists():
        costs_json.unlink(missing_ok=True)  # measured against the old run's cut
        _run([*bench_command, "--json", _repo_path(bench_json), "--trace", _repo_path(traces)], directory / "bench.log")
    bench_doc = json.loads(bench_json.read_text())
    if force or not costs_json.exists():
        batch = round(bench_doc["summary"][0]["samples_per_s"] * bench_doc["summary"][0]["step_time_median"])
        sizes = sorted({-(-batch // row["micro_batches"]) for row in bench_doc["summary"]}, reverse=True)
        _run(
            [
                sys.executable, _repo_path(HERE / "stage_costs.py"),
                "--bench-json", _repo_path(bench_json), "--out", _repo_path(costs_json),
                "--micro-sizes", *map(str, sizes), "--counts", *map(str, mode.counts),
                "--repeats", str(mode.cost_repeats), "--latency-repeats", str(mode.latency_repeats), "--threads", "1",
            ],  # fmt: skip
            directory / "costs.log",
        )
    costs = json.loads(costs_json.read_text())
    analysis = analyse_model(bench_doc, costs, timeline_schedule)
    simulated = analysis.pop("_simulated_timeline")
    figures: dict[str, str] = {}
    if simulated is not None:
        path = directory / f"simulated-{timeline_schedule}-2bp-on.json"
        write_chrome_trace(path, simulated.timelines)
        figures["simulated_on"] = str(path)
        for flag in ("off", "on"):
            measured = traces / f"{model}-{timeline_schedule}-2bp-{flag}.json"
            if measured.exists():
                figures[f"measured_{flag}"] = str(measured)
    return {
        "model": model,
        "command": "python -m twobp_autograd bench pipeline " + " ".join(bench_args),
        "block_count": len(bench_doc["block_costs"]),
        "threads_per_rank": bench_doc["threads_per_rank"],
        "latency_points": costs["latency_points"],
        "cost_repeats": costs["repeats"],
        "weight_grad_counts": costs["counts"],
        **analysis,
        "_traces": figures,
    }


def _run_pipelining_zb(mode: Mode, raw: Path, *, force: bool) -> list[dict[str, Any]]:
    results = []
    for name in mode.zb_schedules:
        arguments = ["--schedule", name, *mode.zb_arguments]
        out = raw / f"pipelining_zb-{name}-{_digest({'zb': arguments})}.json"
        try:
            if force or not out.exists():
                _run(
                    [sys.executable, _repo_path(HERE / "pipelining_zb.py"), *arguments, "--out", _repo_path(out)],
                    out.with_suffix(".log"),
                )
            document = json.loads(out.read_text())
            document["command"] = "python benchmarks/pipelining_zb.py " + " ".join(arguments)
            results.append(document)
        except Exception as error:  # one failed part must not lose the others
            print(f"  pipelining_zb {name} failed: {error}", file=sys.stderr)
            results.append({"schedule": name, "error": str(error)})
    return results


def _machine_info() -> dict[str, Any]:
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cuda": torch.cuda.is_available(),
        "load_average_1_5_15": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "allocator": allocator_environment(),
    }


def _git_commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small models, few steps: a 5-7 minute smoke run")
    parser.add_argument(
        "--models", nargs="+", default=None, help=f"default: every model bench offers ({', '.join(bench.MODELS)})"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="default: benchmarks/results (quick: benchmarks/results/quick)"
    )
    parser.add_argument("--timeline-schedule", choices=SWEEP_SCHEDULES, default="1f1b-2")
    parser.add_argument("--no-pipelining-zb", action="store_true", help="skip PyTorch's ZB schedules comparison")
    parser.add_argument("--no-plots", action="store_true", help="JSON only (plot later with plot_results.py)")
    parser.add_argument("--force", action="store_true", help="re-measure parts already saved")
    parser.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="run every part with glibc's malloc keeping freed memory (both sides alike; see README)",
    )
    args = parser.parse_args(argv)
    unknown = set(args.models or ()) - set(bench.MODELS)
    if unknown:
        parser.error(f"unknown models {sorted(unknown)}; bench offers {', '.join(bench.MODELS)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    mode = MODES["quick" if args.quick else "full"]
    out: Path = args.out or (HERE / "results" / ("quick" if args.quick else ""))
    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    models = list(args.models or bench.MODELS)
    if args.keep_freed_memory:
        os.environ.update(KEEP_FREED_MEMORY)  # read by each part's processes as they start
    started = time.perf_counter()
    document: dict[str, Any] = {
        "kind": "smoke run (quick mode): not figures to quote" if args.quick else "full sweep",
        "command": "python benchmarks/pipeline_sweep.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
        "machine": _machine_info(),
        "ranks": WORLD,
        "threads_per_rank": 1,
        "mode": {
            "name": mode.name,
            "steps": mode.steps,
            "warmup": mode.warmup,
            "cost_repeats": mode.cost_repeats,
            "weight_grad_counts": list(mode.counts),
        },
        "models": [],
    }
    for model in models:
        print(f"{model}:", flush=True)
        try:
            document["models"].append(
                _run_model(model, mode, raw, force=args.force, timeline_schedule=args.timeline_schedule)
            )
        except Exception as error:
            print(f"  {model} failed: {error}", file=sys.stderr)
            document["models"].append({"model": model, "error": str(error)})
    if not args.no_pipelining_zb:
        print("pipelining_zb:", flush=True)
        document["pipelining_zb"] = _run_pipelining_zb(mode, raw, force=args.force)
    document["machine"]["load_average_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    document["wall_seconds"] = time.perf_counter() - started
    # Trace paths are kept relative to the output directory, so the results can move.
    for entry in document["models"]:
        entry["traces"] = {k: os.path.relpath(v, out) for k, v in entry.pop("_traces", {}).items()}
    path = out / "pipeline.json"
    path.write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {path}")
    if not args.no_plots:
        import plot_results

        for written in plot_results.write_all(document, out, readme=plot_results.README if args.out is None else None):
            print(f"wrote {written}")
    failed = [m["model"] for m in document["models"] if "error" in m]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
