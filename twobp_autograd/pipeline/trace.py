"""What happened on each rank, when: the timeline type, Chrome/Perfetto trace JSON, a PNG.

The simulator and the runtime both produce timelines of :class:`Event`, one list per rank, so
a predicted step and a measured one are written and drawn by the same code and can be laid
side by side (open the JSON in ``chrome://tracing`` or https://ui.perfetto.dev).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Sequence

from .actions import Action

__all__ = ["Event", "Timelines", "action_label", "to_chrome_trace", "write_chrome_trace", "plot_timeline"]


@dataclass(frozen=True)
class Event:
    """``action`` ran on ``rank`` from ``start`` to ``end`` (seconds, any common origin)."""

    rank: int
    action: Action
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


Timelines = Sequence[Sequence[Event]]
"""One sequence of events per rank, indexed by rank."""

CATEGORIES: dict[str, str] = {"F": "forward", "B": "backward", "I": "backward_p1", "W": "backward_p2"}
COLOURS: dict[str, str] = {"F": "#4C72B0", "B": "#8172B2", "I": "#DD8452", "W": "#55A868"}
LEGEND: dict[str, str] = {
    "F": "F  forward",
    "B": "B  full backward",
    "I": "I  backward-p1 (input grads)",
    "W": "W  backward-p2 (weight grads)",
}


def action_label(action: Action) -> str:
    """``F3``, ``I3``, ``W*`` (all pending), ``W0-3`` (a run of micro-batches) or ``W0,2``."""
    if action.micro_batches is None:
        return f"{action.kind}*"
    return action.kind + _compact(action.micro_batches)


def to_chrome_trace(timelines: Timelines, *, seconds_per_unit: float = 1.0) -> dict[str, Any]:
    """Trace Event Format: one process per rank, one complete (``"X"``) event per action.

    Times are multiplied by ``seconds_per_unit`` and written in microseconds, as the format
    expects; pass the unit of a simulation's costs if it was not seconds.
    """
    events: list[dict[str, Any]] = []
    for rank in range(len(timelines)):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}})
    to_us = seconds_per_unit * 1e6
    for timeline in timelines:
        for event in timeline:
            events.append(
                {
                    "ph": "X",
                    "name": action_label(event.action),
                    "cat": CATEGORIES[event.action.kind],
                    "pid": event.rank,
                    "tid": 0,
                    "ts": event.start * to_us,
                    "dur": event.duration * to_us,
                    "args": {"micro_batches": _micro_batches(event.action)},
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | os.PathLike[str], timelines: Timelines, *, seconds_per_unit: float = 1.0) -> None:
    with open(path, "w", encoding="utf-8") as file:
        json.dump(to_chrome_trace(timelines, seconds_per_unit=seconds_per_unit), file)


def plot_timeline(
    timelines: Timelines,
    path: str | os.PathLike[str],
    title: str = "",
    *,
    time_unit: str = "s",
) -> None:
    """Draw one row per rank (rank 0 on top), each action a bar coloured by kind and labelled
    when it is wide enough, and save it as an image (format from the file name). Needs
    matplotlib (the ``bench`` extra); renders off-screen with Agg."""
    # Figure without pyplot: no global backend switch, nothing left open in the caller's session.
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    num_ranks = len(timelines)
    events = [event for timeline in timelines for event in timeline]
    origin = min((e.start for e in events), default=0.0)
    span = (max((e.end for e in events), default=1.0) - origin) or 1.0
    most_actions = max((len(timeline) for timeline in timelines), default=0)
    width_in = min(4.0 + 0.4 * most_actions, 16.0)
    figure = Figure(figsize=(width_in, 1.4 + 0.5 * num_ranks), layout="constrained")
    axes = figure.subplots()
    points_per_unit = 0.85 * width_in * 72 / span
    for event in events:
        row = num_ranks - 1 - event.rank
        left, width = event.start - origin, event.duration
        axes.broken_barh(
            [(left, width)], (row - 0.4, 0.8), facecolors=COLOURS[event.action.kind], edgecolor="white", linewidth=0.8
        )
        label = action_label(event.action)
        if width * points_per_unit >= 5.5 * len(label) + 3:  # 8 pt digits are about 5 pt wide
            axes.text(left + width / 2, row, label, ha="center", va="center", fontsize=8, color="white")
    axes.set_yticks(range(num_ranks), [f"rank {rank}" for rank in reversed(range(num_ranks))])
    axes.set_ylim(-0.6, num_ranks - 0.4)
    axes.set_xlim(0, span)
    axes.set_xlabel(f"time ({time_unit})")
    axes.grid(axis="x", alpha=0.3)
    axes.set_axisbelow(True)
    kinds = [kind for kind in LEGEND if any(e.action.kind == kind for e in events)]
    figure.legend(
        handles=[Patch(color=COLOURS[kind], label=LEGEND[kind]) for kind in kinds],
        loc="outside lower center",
        ncol=max(len(kinds), 1),
        frameon=False,
        fontsize=8,
    )
    if title:
        axes.set_title(title)
    figure.savefig(path, dpi=120)


def _micro_batches(action: Action) -> list[int] | str:
    return "all pending" if action.micro_batches is None else list(action.micro_batches)


def _compact(micro_batches: Sequence[int]) -> str:
    """``(0, 1, 2, 5)`` -> ``0-2,5``: a concatenated W over many micro-batches stays short."""
    runs: list[list[int]] = []
    for k in sorted(micro_batches):
        if runs and k == runs[-1][-1] + 1:
            runs[-1].append(k)
        else:
            runs.append([k])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ",".join(map(str, run)) for run in runs)
