"""The sweep's schedules replayed by the simulator on stage terms measured elsewhere: on a GPU
by ``stage_costs.py --device cuda`` (one process, both ranks' blocks in turn, no link between
ranks timed: the replay's hand-over is free), or on the CPU. The stages are cut again on the
measured terms (plain F + B per block at the largest micro-batch size), as ``bench pipeline``
balances on the costs that run. Per schedule, at p = 2 and the sweep's micro-batch counts: the
performance model's ideal 2BP on/off, the simulated one with every stage's own terms, the
simulated bubbles; and the simulated 2BP on/off at p = 4 and 8.

    python benchmarks/replay_costs.py benchmarks/results/gpu/costs_*.json --out benchmarks/results/gpu/replay.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from local_ranks import write_json  # beside this script
from pipeline_sweep import analyse_model

__all__ = ["main", "rebalanced", "replay"]

RAW = Path(__file__).resolve().parent / "results" / "raw"


def rebalanced(costs: Mapping[str, Any]) -> dict[str, Any]:
    """``costs`` with its block costs replaced by the measured plain F + B of each block at the
    largest micro-batch size (the loss pseudo-block stays in the last block's stage)."""
    size = str(max(costs["micro_sizes"]))
    measured: dict[int, float] = {}
    for rank in costs["ranks"]:
        for index, block in zip(rank["blocks"], rank["per_size"][size], strict=False):
            measured[index] = block["forward_off"] + block["backward"]
    return {**costs, "block_costs": [measured[i] for i in range(len(measured))]}


def _bench_for(costs: Mapping[str, Any], raw: Path) -> dict[str, Any]:
    """The sweep's bench JSON whose arguments the costs were measured with (its batch and
    micro-batch counts; its step times, from another machine, are not used)."""
    for path in sorted(raw.glob("*/bench.json")):
        bench = json.loads(path.read_text())
        if bench["arguments"] == costs["bench_arguments"]:
            return bench
    raise SystemExit(f"no bench.json under {raw} was run with {costs['bench_arguments']}")


def replay(costs: Mapping[str, Any], raw: Path = RAW) -> dict[str, Any]:
    """Per schedule: ideal, simulated and predicted 2BP on/off from ``costs``."""
    analysis = analyse_model(_bench_for(costs, raw), rebalanced(costs))
    analysis.pop("_simulated_timeline")
    rows = {}
    for name, entry in analysis["schedules"].items():
        simulated = entry["simulated"]
        rows[name] = {
            "micro_batches": entry["micro_batches"],
            "micro_batch_size": entry["micro_batch_size"],
            "ideal": entry["ideal"]["throughput_ratio"],
            "simulated": simulated["throughput_ratio"],
            "bubble_off": simulated["bubble_off"],
            "bubble_on": simulated["bubble_on"],
            "step_time_off": simulated["step_time_off"],
            "step_time_on": simulated["step_time_on"],
            "predicted": {
                p: prediction.get("throughput_ratio") for p, prediction in entry["predicted"].items()
            },
        }
    return {"model": costs["bench_arguments"]["model"], "device": costs.get("device"), "schedules": rows}


def _print(result: Mapping[str, Any]) -> None:
    print(f"\n{result['model']} on {result['device']}: 2BP on/off")
    print(f"{'schedule':<18}{'m':>3}{'ideal':>8}{'simulated':>11}{'bubble off/on':>16}{'p=4':>7}{'p=8':>7}")
    for name, row in result["schedules"].items():
        predicted = [row["predicted"].get(p) for p in ("4", "8")]
        shown = [f"{v:>7.3f}" if v is not None else f"{'-':>7}" for v in predicted]
        print(
            f"{name:<18}{row['micro_batches']:>3}{row['ideal']:>8.3f}{row['simulated']:>11.3f}"
            f"{row['bubble_off']:>9.2f} /{row['bubble_on']:>5.2f}{shown[0]}{shown[1]}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("costs", nargs="+", type=Path, help="stage_costs.py outputs")
    parser.add_argument("--raw", type=Path, default=RAW, help="the sweep's raw results (its bench.json files)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    results = [replay(json.loads(path.read_text()), args.raw) for path in args.costs]
    for result in results:
        _print(result)
    if args.out is not None:
        write_json(args.out, {"benchmark": "replay_costs", "costs": [str(p) for p in args.costs], "models": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
