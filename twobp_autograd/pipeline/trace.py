"""What happened on each rank, when: the timeline type, Chrome/Perfetto trace JSON, a PNG.

The simulator and the runtime both produce timelines of :class:`Event`, one list per rank, so
a predicted step and a measured one are written and drawn by the same code and can be laid
side by side (open the JSON in ``chrome://tracing`` or https://ui.perfetto.dev), and a trace
read back draws like the timelines it was written from.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .actions import Action, ActionKind

__all__ = [
    "Event",
    "Timelines",
    "action_label",
    "to_chrome_trace",
    "write_chrome_trace",
    "read_chrome_trace",
    "plot_timeline",
    "plot_timelines",
]


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

_COLOURS: dict[ActionKind, str] = {
    ActionKind.FORWARD: "#4C72B0",
    ActionKind.BACKWARD: "#8172B2",
    ActionKind.BACKWARD_P1: "#DD8452",
    ActionKind.BACKWARD_P2: "#55A868",
}


def action_label(action: Action) -> str:
    """``F3``, ``I3``, ``W*`` (all pending), ``W0-3`` (a run of micro-batches) or ``W0,2``;
    ``F3@s2`` where the action names its stage (a rank holding several)."""
    where = "" if action.stage is None else f"@s{action.stage}"
    if action.micro_batches is None:
        return f"{action.kind}*{where}"
    return f"{action.kind}{_compact(action.micro_batches)}{where}"


def to_chrome_trace(timelines: Timelines, *, seconds_per_unit: float = 1.0) -> dict[str, Any]:
    """Trace Event Format: one process per rank, one complete (``"X"``) event per action,
    its category the kind's name (``forward``, ``backward``, ``backward_p1``, ``backward_p2``).

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
                    "cat": event.action.kind.name.lower(),
                    "pid": event.rank,
                    "tid": 0,
                    "ts": event.start * to_us,
                    "dur": event.duration * to_us,
                    "args": {"micro_batches": _micro_batches(event.action), "stage": event.action.stage},
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | os.PathLike[str], timelines: Timelines, *, seconds_per_unit: float = 1.0) -> None:
    with open(path, "w", encoding="utf-8") as file:
        json.dump(to_chrome_trace(timelines, seconds_per_unit=seconds_per_unit), file)


def read_chrome_trace(path: str | os.PathLike[str]) -> list[list[Event]]:
    """The timelines of a trace :func:`write_chrome_trace` wrote (times in seconds)."""
    with open(path, encoding="utf-8") as file:
        trace = json.load(file)
    timelines: dict[int, list[Event]] = {}
    for raw in trace["traceEvents"]:
        if raw.get("ph") != "X":
            continue
        micro_batches = raw["args"]["micro_batches"]
        kind = ActionKind[raw["cat"].upper()]
        action = Action(
            kind, None if isinstance(micro_batches, str) else tuple(micro_batches), raw["args"].get("stage")
        )
        start = raw["ts"] / 1e6
        timelines.setdefault(raw["pid"], []).append(Event(raw["pid"], action, start, start + raw["dur"] / 1e6))
    return [timelines.get(rank, []) for rank in range(max(timelines, default=-1) + 1)]


def plot_timeline(timelines: Timelines, path: str | os.PathLike[str], title: str = "", *, time_unit: str = "s") -> None:
    """Draw one row per rank (rank 0 on top), each action a bar coloured by kind and labelled
    when it is wide enough, and save it as an image (format from the file name). Needs
    matplotlib (the ``bench`` extra); renders off-screen with Agg."""
    plot_timelines([("", timelines)], path, title, time_unit=time_unit)


def plot_timelines(
    panels: Sequence[tuple[str, Timelines]], path: str | os.PathLike[str], title: str = "", *, time_unit: str = "s"
) -> None:
    """Like :func:`plot_timeline`, for several (caption, timelines) stacked on one time axis:
    a measured step over the simulated one, 2BP off over on."""
    # Figure without pyplot: no global backend switch, nothing left open in the caller's session.
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    events = [event for _, timelines in panels for timeline in timelines for event in timeline]
    origin = min((e.start for e in events), default=0.0)
    span = (max((e.end for e in events), default=1.0) - origin) or 1.0
    most_actions = max((len(timeline) for _, timelines in panels for timeline in timelines), default=0)
    width_in = min(4.0 + 0.4 * most_actions, 16.0)
    height_in = 1.0 + sum(0.4 + 0.5 * len(timelines) for _, timelines in panels)
    figure = Figure(figsize=(width_in, height_in), layout="constrained")
    axes_list = figure.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for axes, (caption, timelines) in zip(axes_list, panels, strict=True):
        _draw_ranks(axes, timelines, origin, points_per_unit=0.85 * width_in * 72 / span)
        if caption:
            axes.set_title(caption, fontsize=9, loc="left")
    axes_list[-1].set_xlim(0, span)
    axes_list[-1].set_xlabel(f"time ({time_unit})")
    kinds = [kind for kind in ActionKind if any(e.action.kind is kind for e in events)]
    figure.legend(
        handles=[Patch(color=_COLOURS[kind], label=f"{kind}  {kind.description}") for kind in kinds],
        loc="outside lower center",
        ncol=max(len(kinds), 1),
        frameon=False,
        fontsize=8,
    )
    if title:
        figure.suptitle(title, fontsize=10)
    figure.savefig(path, dpi=120)


def _draw_ranks(axes: Any, timelines: Timelines, origin: float, *, points_per_unit: float) -> None:
    num_ranks = len(timelines)
    for timeline in timelines:
        for event in timeline:
            row = num_ranks - 1 - event.rank
            left, width = event.start - origin, event.duration
            colour = _COLOURS[event.action.kind]
            axes.broken_barh([(left, width)], (row - 0.4, 0.8), facecolors=colour, edgecolor="white", linewidth=0.8)
            label = action_label(event.action)
            if width * points_per_unit >= 5.5 * len(label) + 3:  # 8 pt digits are about 5 pt wide
                axes.text(left + width / 2, row, label, ha="center", va="center", fontsize=8, color="white")
    axes.set_yticks(range(num_ranks), [f"rank {rank}" for rank in reversed(range(num_ranks))])
    axes.set_ylim(-0.6, num_ranks - 0.4)
    axes.grid(axis="x", alpha=0.3)
    axes.set_axisbelow(True)


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
