"""Turn the sweep's ``pipeline.json`` into ``pipeline.md`` (every table),
``pipeline.png`` (2BP/off throughput per model and schedule: measured, ideal, simulated),
``timeline_<model>.png`` (one schedule's measured steps, 2BP off and on, over the simulated one)
and, for a full sweep, the README's pipeline table (between its ``pipeline-table`` markers).

Kept apart from the sweep so the figures can be redrawn without measuring again:

    python benchmarks/plot_results.py [benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from twobp_autograd.pipeline.trace import plot_timelines, read_chrome_trace

__all__ = [
    "PAPER", "README", "README_MARKERS", "write_all", "markdown", "readme_table", "update_readme", "plot_ratios", "main"
]  # fmt: skip

README = Path(__file__).resolve().parent.parent / "README.md"
README_MARKERS = ("<!-- pipeline-table: written by benchmarks/plot_results.py -->", "<!-- /pipeline-table -->")
MODEL_NAMES = {
    "resnet152": "ResNet-152 (torchvision)",
    "transformer": "Transformer (pre-norm blocks)",
    "mlp": "MLP (512→2048 blocks)",
    "llama": "LLaMA-like (HF Llama)",
    "bert": "BERT (HF)",
    "mamba": "Mamba (HF)",
}
PAPER_SCHEDULES = {"gpipe": "GPipe", "1f1b-1": "1F1B-1", "1f1b-2": "1F1B-2"}
#: The README's rows: the paper's schedules, then this library's own (two stages per rank last).
README_SCHEDULES = {**PAPER_SCHEDULES, "zb": "ZB", "interleaved-1f1b": "interleaved 1F1B", "zbv": "ZB-V"}

# What the paper states, and only that: its abstract's headline (arXiv 2405.18047). Its
# per-model, per-schedule figures are not reproduced here.
PAPER = {
    "throughput_ratio": 1.70,
    "schedule": "1f1b-2",
    "models": ("transformer", "llama"),  # LLaMA-like models of bench
    "label": "paper: 1.70x (LLaMa-like 7B, 4 GPUs)",
}
BARS = (
    ("measured", "measured, 2 ranks", "#4C72B0"),
    ("ideal", "ideal (performance model), 2 ranks", "#BBBBBB"),
    ("simulated", "simulated, 2 ranks", "#55A868"),
    ("predicted_4", "simulated, 4 ranks", "#DD8452"),
)


def _ratio(entry: Mapping[str, Any], bar: str) -> float | None:
    if bar == "measured":
        return entry["measured"]["throughput_ratio"]
    if bar in ("ideal", "simulated"):
        return entry[bar]["throughput_ratio"]
    predicted = entry.get("predicted", {}).get(bar.split("_")[1], {})
    return predicted.get("throughput_ratio")


def _several_stages_per_rank(entry: Mapping[str, Any]) -> int | None:
    """The stage count of a schedule whose ranks hold several stages, else None."""
    owners = entry.get("placement") or ()
    return len(owners) if len(owners) > len(set(owners)) else None


def _label(name: str, entry: Mapping[str, Any]) -> str:
    """The schedule's name, with its stage count where its ranks hold several stages."""
    stages = _several_stages_per_rank(entry)
    return name if stages is None else f"{name} ({stages} stages)"


def _fmt(value: float | None, digits: int = 3, suffix: str = "") -> str:
    return "–" if value is None else f"{value:.{digits}f}{suffix}"


def _percent(value: float | None) -> str:
    return "–" if value is None else f"{value * 100:+.1f}%"


def _mib(value: float | None) -> str:
    return "–" if value is None else f"{value / 2**20:.1f}"


def markdown(document: Mapping[str, Any]) -> str:
    models = [m for m in document["models"] if "error" not in m]
    lines = [
        *_introduction(document),
        *_two_ranks_table(models),
        *_more_stages_table(models),
        *_stage_terms_table(models),
        *_pipelining_zb_table(document.get("pipelining_zb") or []),
        *_the_paper(),
    ]
    failed = [m for m in document["models"] if "error" in m]
    if failed:
        lines += ["", "Failed: " + "; ".join(f"{m['model']}: {m['error'].splitlines()[0]}" for m in failed)]
    return "\n".join(lines) + "\n"


def _section(title: str, prose: str | None, columns: Sequence[str]) -> list[str]:
    """A heading, its prose and the head of its table."""
    return ["", f"## {title}", "", *([prose, ""] if prose else []), *_table_head(columns)]


def _table_head(columns: Sequence[str]) -> list[str]:
    return [f"| {' | '.join(columns)} |", "|" + "---|" * len(columns)]


def _allocator(settings: Mapping[str, str] | None) -> str:
    if not settings:
        return "glibc's malloc with its defaults"
    return "malloc settings " + ", ".join(f"`{name}={value}`" for name, value in settings.items())


def _introduction(document: Mapping[str, Any]) -> list[str]:
    machine = document["machine"]
    return [
        "# Pipeline benchmark: 2BP on vs off",
        "",
        f"*{document['kind']}.* `{document['command']}` on {document['date']}"
        + (f", commit `{document['git_commit'][:10]}`" if document.get("git_commit") else "")
        + f": torch {machine['torch']}, {machine['cpu_count']} cores ({machine['processor']}), "
        f"{document['ranks']} gloo ranks with {document['threads_per_rank']} thread each; load average "
        f"{_load(machine.get('load_average_1_5_15'))} at the start, "
        f"{_load(machine.get('load_average_at_end'))} at the end; {_allocator(machine.get('allocator'))}. "
        f"Each run: {document['mode']['warmup']} warm-up + {document['mode']['steps']} measured steps, 2BP off and on "
        "alternating step by step; medians.",
        "",
        "Which figure is what:",
        "",
        "- **measured**: timed on this machine, two processes (`bench pipeline`); throughput is samples/s "
        "of the whole step, the bubble is idle time / (ranks x step time).",
        "- **ideal**: the performance model (docs/performance.md), computed: every stage costs the slowest "
        "stage's measured F, I, W and W' (= W(n)/n, concatenated), B = I + W, no communication. For GPipe that is "
        "(m+p-1)(F+I+W) / ((m+p-1)(F+I) + m W').",
        "- **simulated**: computed by replaying the same action lists (`pipeline/simulator.py`) with every stage's own "
        "measured F, B, I, W(n) and the measured p2p latency; its step time is compared with the measured one.",
        "- **modelled memory**: computed from measured bytes: what autograd saves per micro-batch (F to B, or F to I) "
        "and what the queue holds from I to W, replayed over each rank's actions; the peak over ranks.",
        "- **measured memory**: the heap in use (glibc `mallinfo2`: tensors and autograd's saved activations alike) "
        "after each action, over the step's start; the peak over ranks and steps.",
        "",
        "interleaved-1f1b (loop placement) and zbv (V placement) hold two stages per rank: on 2 ranks the model is "
        "cut into 4 stages, whose terms are sums of the same per-block measurements; the ideal is theirs at the "
        "slowest of the 4 stages.",
    ]


def _two_ranks_table(models: Sequence[Mapping[str, Any]]) -> list[str]:
    columns = (
        "model", "schedule", "m", "2BP/off throughput, measured", "ideal", "ideal if W' = W", "measured / ideal",
        "simulated", "simulated step vs measured, off / on", "bubble off → on, measured",
        "peak memory on/off, measured", "peak activation memory on/off, modelled",
    )  # fmt: skip
    lines = _section("Two ranks: measured against the model", None, columns)
    missing = []
    for model in models:
        for name, e in model["schedules"].items():
            memory = e.get("memory_modeled", {})
            missing += [f"{model['model']}, {name}: {what}: {why}" for what, why in e.get("not_available", {}).items()]
            lines.append(
                f"| {model['model']} | {_label(name, e)} | {e['micro_batches']} | "
                f"{_fmt(e['measured']['throughput_ratio'])} | "
                f"{_fmt(e['ideal']['throughput_ratio'])} | "
                f"{_fmt(e['ideal']['throughput_ratio_without_concatenation_gain'])} | "
                f"{_fmt(e['measured_over_ideal'])} | "
                f"{_fmt(e['simulated']['throughput_ratio'])} | {_percent(e['simulated']['step_time_error_off'])} / "
                f"{_percent(e['simulated']['step_time_error_on'])} | {_fmt(e['measured']['bubble_off'])} → "
                f"{_fmt(e['measured']['bubble_on'])} | {_fmt(e['measured'].get('peak_memory_ratio'), 2, 'x')} | "
                f"{_fmt(memory.get('ratio'), 2, 'x')} |"
            )
    lines += ["", *(f"Not available: {line}." for line in missing)] if missing else []
    return lines + [
        "",
        "Targets: measured within 5% of ideal (above the W' = W ideal where concatenation makes W' < W), simulated "
        "step within 10% of measured.",
    ]


def _more_stages_table(models: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = _section(
        "More stages (simulated)",
        "Same measured per-block terms on p ranks: the model cut into p stages (2p for interleaved-1f1b and zbv, "
        "two per rank) by the benchmark's balancing, "
        "N = p (GPipe, 1F1B-1) or 2p (1F1B-2, zb, interleaved-1f1b, zbv) micro-batches of the measured size, "
        "the latency model at the largest message between ranks. "
        "W(n) beyond the largest measured n is extrapolated at that n's per-micro-batch time.",
        ("model", "schedule", "p=4: N", "p=4: 2BP/off", "p=4: ideal", "p=8: N", "p=8: 2BP/off", "p=8: ideal"),
    )
    for model in models:
        for name, e in model["schedules"].items():
            label = f"{name} (2p stages)" if _label(name, e) != name else name
            cells = []
            for p in ("4", "8"):
                predicted = e["predicted"].get(p, {})
                if "skipped" in predicted or not predicted:
                    cells += ["–", predicted.get("skipped", "–"), "–"]
                else:
                    cells += [
                        str(predicted["micro_batches"]),
                        _fmt(predicted["throughput_ratio"]),
                        _fmt(predicted["ideal_throughput_ratio"]),
                    ]
            lines.append(f"| {model['model']} | {label} | " + " | ".join(cells) + " |")
    return lines


def _stage_terms_table(models: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = _section(
        "Measured stage terms (ms per micro-batch, one thread)",
        "Medians over repeats, each block timed alone and summed per stage. (I+W)/B above 1 is what splitting "
        "the backward costs; F on/off what the patched forward costs.",
        (
            "model", "micro-batch", "stage", "F off", "F on", "B", "I", "W(1)", "W' (largest n)", "(I+W)/B",
            "F on/off", "p2p one-way (µs)",
        ),  # fmt: skip
    )
    for model in models:
        for size, stages in model["stage_terms"].items():
            latencies = (
                e["simulated"]["p2p_latency"] for e in model["schedules"].values() if e["micro_batch_size"] == int(size)
            )
            latency = next(latencies, None)
            for index, t in enumerate(stages):
                per_micro = t["weight_grad_per_micro_batch"]
                largest = max(per_micro, key=int)
                lines.append(
                    f"| {model['model']} | {size} | {index} | "
                    f"{t['forward_off'] * 1e3:.1f} | {t['forward_on'] * 1e3:.1f} | "
                    f"{t['backward'] * 1e3:.1f} | {t['input_grad'] * 1e3:.1f} | {t['weight_grad_1'] * 1e3:.1f} | "
                    f"{per_micro[largest] * 1e3:.1f} (n={largest}) | {_fmt(t['split_overhead'], 2)} | "
                    f"{_fmt(t['forward_overhead'], 2)} | {_fmt(None if latency is None else latency * 1e6, 0)} |"
                )
    return lines


def _pipelining_zb_table(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    if not runs:
        return []
    lines = _section(
        "PyTorch's zero-bubble schedules: 2BP's deferred W against PyTorch's split W (measured)",
        "`benchmarks/pipelining_zb.py`: the same torch.distributed.pipelining schedule, 4 stages on 2 ranks, "
        "once with 2BP's queued W as the stages' `dw_builder` and once with PyTorch's own autograd-graph split; "
        "interleaved rounds.",
        ("schedule", "m", "step, 2BP W (s)", "step, PyTorch split W (s)", "speedup", "gradients agree to"),
    )
    for r in runs:
        if "error" in r:
            lines.append(f"| {r['schedule']} | failed: {r['error'].splitlines()[0]} | | | | |")
            continue
        medians = r["median_step_seconds"]
        lines.append(
            f"| {r['schedule']} | {r['config']['micro_batches']} | {medians['twobp']:.3f} | {medians['torch']:.3f} | "
            f"{r['speedup_twobp_over_torch_split']:.3f}x | {r['worst_relative_grad_difference']:.1e} |"
        )
    return lines


def _the_paper() -> list[str]:
    return [
        "",
        "## The paper",
        "",
        "Rae, Lee & Richings (arXiv 2405.18047) report a 1.70x throughput increase for a LLaMa-like 7B transformer "
        "on 4 GPUs (marked in `pipeline.png` on the LLaMA-like model's 1F1B-2 group). Its per-schedule figures for "
        "its other models (BERT-Large, Mamba-1.4B, ResNet-152) are not quoted here. Those are GPU runs of 1.4B–7B "
        "models; the figures above are 2 CPU processes with small models, so only the direction and the agreement "
        "with the model carry over, not the size of the gain.",
    ]


def _load(values: Sequence[float] | None) -> str:
    return "unknown" if not values else "/".join(f"{v:.1f}" for v in values)


def plot_ratios(document: Mapping[str, Any], path: Path) -> None:
    """One panel per model: per schedule, the 2BP/off throughput ratio measured, ideal,
    simulated (2 ranks) and simulated for 4 stages; the paper's figure where it applies."""
    from matplotlib.figure import Figure

    models = [m for m in document["models"] if "error" not in m]
    columns = min(3, max(1, len(models)))
    rows = -(-max(1, len(models)) // columns)
    figure = Figure(figsize=(max(9.0, 4.4 * columns), 1.0 + 3.6 * rows), layout="constrained")
    axes_grid = figure.subplots(rows, columns, squeeze=False)
    axes_list = list(axes_grid.flat)
    for unused in axes_list[len(models) :]:
        unused.set_visible(False)
    width = 0.8 / len(BARS)
    # the grid may have more axes than models (the spare ones hidden above)
    for axes, model in zip(axes_list, models, strict=False):
        names = list(model["schedules"])
        for b, (bar, label, colour) in enumerate(BARS):
            xs, ys = [], []
            for i, name in enumerate(names):
                value = _ratio(model["schedules"][name], bar)
                if value is not None:
                    xs.append(i - 0.4 + width * (b + 0.5))
                    ys.append(value)
            axes.bar(xs, ys, width, label=label, color=colour)
        if model["model"] in PAPER["models"] and PAPER["schedule"] in names:
            x = names.index(PAPER["schedule"])
            paper = [PAPER["throughput_ratio"]] * 2
            axes.plot([x - 0.4, x + 0.4], paper, color="#C44E52", linewidth=2, label=PAPER["label"])
        axes.axhline(1.0, color="black", linewidth=0.8)
        axes.set_xticks(range(len(names)), names, rotation=25, ha="right", fontsize=8)
        axes.set_title(model["model"])
        axes.set_ylabel("throughput, 2BP on / off")
        axes.grid(axis="y", alpha=0.3)
        axes.set_axisbelow(True)
    handles, labels = {}, []
    for axes in axes_list:
        for handle, label in zip(*axes.get_legend_handles_labels(), strict=True):
            if label not in handles:
                handles[label] = handle
                labels.append(label)
    figure.legend(
        [handles[label] for label in labels], labels, loc="outside lower center", ncol=3, frameon=False, fontsize=8
    )
    figure.suptitle(f"2BP/off throughput ratio ({document['kind']})", fontsize=10)
    figure.savefig(path, dpi=120)


def readme_table(document: Mapping[str, Any]) -> str:
    """The README's table: every model under the paper's three schedules and ours, two
    significant decimals (the full figures are in pipeline.md)."""
    lines = _table_head(
        (
            "model", "schedule (m)", "measured", "ideal", "measured / ideal", "simulated, 2 ranks",
            "simulated, 4 stages", "simulated, 8 stages", "bubble off → on (measured)", "peak memory on/off, measured",
            "peak activation memory on/off, modelled",
        )  # fmt: skip
    )
    for model in document["models"]:
        for name, label in README_SCHEDULES.items():
            e = model.get("schedules", {}).get(name)
            if e is None:
                continue
            stages = _several_stages_per_rank(e)
            label = label if stages is None else f"{label}, {stages} stages"
            predicted = e.get("predicted", {})
            lines.append(
                f"| {MODEL_NAMES.get(model['model'], model['model'])} | {label} ({e['micro_batches']}) | "
                f"{_fmt(e['measured']['throughput_ratio'], 2)} | {_fmt(e['ideal']['throughput_ratio'], 2)} | "
                f"{_fmt(e['measured_over_ideal'], 2)} | {_fmt(e['simulated']['throughput_ratio'], 2)} | "
                f"{_fmt(predicted.get('4', {}).get('throughput_ratio'), 2)} | "
                f"{_fmt(predicted.get('8', {}).get('throughput_ratio'), 2)} | "
                f"{_fmt(e['measured']['bubble_off'], 2)} → {_fmt(e['measured']['bubble_on'], 2)} | "
                f"{_fmt(e['measured'].get('peak_memory_ratio'), 2, 'x')} | "
                f"{_fmt(e.get('memory_modeled', {}).get('ratio'), 2, 'x')} |"
            )
    return "\n".join(lines)


def update_readme(table: str, readme: Path = README) -> bool:
    """Put ``table`` between the README's markers; False (nothing written) without them."""
    text = readme.read_text() if readme.exists() else ""
    start, end = README_MARKERS
    if start not in text or end not in text:
        return False
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    readme.write_text(f"{head}{start}\n{table}\n{end}{tail}")
    return True


def write_all(document: Mapping[str, Any], out: Path, readme: Path | None = None) -> list[Path]:
    """Write pipeline.md, pipeline.png and one timeline PNG per model into ``out``; with
    ``readme``, a full sweep's table into that README too."""
    written = []
    if readme is not None and document.get("kind") == "full sweep" and update_readme(readme_table(document), readme):
        written.append(readme)
    md = out / "pipeline.md"
    md.write_text(markdown(document))
    written.append(md)
    png = out / "pipeline.png"
    plot_ratios(document, png)
    written.append(png)
    for model in document["models"]:
        traces = model.get("traces") or {}
        panels = [
            (
                f"{caption} ({'measured' if key.startswith('measured') else 'simulated from measured stage terms'})",
                read_chrome_trace(out / traces[key]),
            )
            for key, caption in (("measured_off", "2BP off"), ("measured_on", "2BP on"), ("simulated_on", "2BP on"))
            if key in traces and (out / traces[key]).exists()
        ]
        if panels:
            path = out / f"timeline_{model['model']}.png"
            schedule = model.get("timeline_schedule")
            plot_timelines(panels, path, f"{model['model']}, {schedule}, one step ({document['kind']})")
            written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "results", nargs="?", type=Path, help="folder holding pipeline.json (default: benchmarks/results, "
        "whose figures and tables also go into README.md)"
    )  # fmt: skip
    args = parser.parse_args(argv)
    out = args.results if args.results is not None else Path(__file__).resolve().parent / "results"
    if not (out / "pipeline.json").is_file():
        parser.error(f"no pipeline.json in {out}")
    document = json.loads((out / "pipeline.json").read_text())
    # The README shows the default results only.
    for path in write_all(document, out, readme=None if args.results is not None else README):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
