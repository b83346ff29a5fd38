"""``zb``'s bound on micro-batches waiting for W, replayed on the sweep's measured stage costs.

For every model the sweep measured (``benchmarks/results/raw/<model>-*/``: its per-block F, I,
W(n) and latency points, its batch) and p = 2, 4, 8 ranks with N = 2p micro-batches of the
measured size, prints the simulated 2BP/off throughput of ``1f1b-2``, of ``zb`` at its default
bound (p) and at the bound :func:`~twobp_autograd.pipeline.fastest_max_pending` picks. Nothing
is timed here: it reads what the last sweep recorded.

    python benchmarks/zb_bound.py
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from pipeline_sweep import latency_model, message_bytes, stage_terms

from twobp_autograd.pipeline import fastest_max_pending, schedule, simulate

RAW = Path(__file__).resolve().parent / "results" / "raw"


def replay(model_dir: Path, num_ranks: int) -> dict[str, float]:
    costs = json.loads((model_dir / "costs.json").read_text())
    rows = {(r["schedule"], r["twobp"]): r for r in json.loads((model_dir / "bench.json").read_text())["summary"]}
    off_row = rows["zb", False]
    batch = round(off_row["samples_per_s"] * off_row["step_time_median"])
    size = -(-batch // off_row["micro_batches"])  # the micro-batch size measured on 2 ranks
    m = 2 * num_ranks
    _, terms = stage_terms(costs, size, num_ranks)
    latency = latency_model(costs["latency_points"])(message_bytes("zb", terms))
    on = [t.costs(True) for t in terms]
    off = simulate(schedule("1f1b-2", num_ranks, m, False), [t.costs(False) for t in terms], p2p_latency=latency)

    def ratio(name: str, **kwargs: int) -> float:
        return off.step_time / simulate(schedule(name, num_ranks, m, **kwargs), on, p2p_latency=latency).step_time

    best = fastest_max_pending("zb", num_ranks, m, on, p2p_latency=latency)
    return {
        "1f1b-2": ratio("1f1b-2"), "zb": ratio("zb"), "best_bound": best, "zb_at_best": ratio("zb", max_pending=best)
    }  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--raw", type=Path, default=RAW, help="the sweep's raw results")
    args = parser.parse_args(argv)
    model_dirs = sorted(d for d in args.raw.iterdir() if (d / "costs.json").exists()) if args.raw.is_dir() else []
    if not model_dirs:
        parser.error(f"--raw {args.raw}: no <model>-*/costs.json under it (the sweep's raw results)")
    print("model        p  1f1b-2   zb (p)  bound  zb (bound)")
    for model_dir in model_dirs:
        for p in (2, 4, 8):
            row = replay(model_dir, p)
            print(
                f"{model_dir.name.split('-')[0]:<12} {p}  {row['1f1b-2']:.3f}    {row['zb']:.3f}   "
                f"{row['best_bound']:>4}   {row['zb_at_best']:.3f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
