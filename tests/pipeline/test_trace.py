"""Chrome trace JSON structure and the PNG timeline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from twobp_autograd.pipeline.actions import Action, B, F, I, W
from twobp_autograd.pipeline.schedules import schedule
from twobp_autograd.pipeline.simulator import StageCosts, simulate
from twobp_autograd.pipeline.trace import (
    Event,
    action_label,
    plot_timeline,
    plot_timelines,
    read_chrome_trace,
    to_chrome_trace,
    write_chrome_trace,
)

TIMELINES = [
    [Event(0, F(0), 0.0, 0.001), Event(0, I(0), 0.003, 0.004), Event(0, W(0, 1), 0.005, 0.007)],
    [Event(1, F(0), 0.001, 0.002), Event(1, B(0), 0.002, 0.003)],
]


@pytest.mark.parametrize(
    "action,label",
    [(F(3), "F3"), (I(3), "I3"), (B(0), "B0"), (W(3), "W3"), (W(), "W*"), (W(0, 1), "W0,1"), (W(0, 2), "W0,2"),
     (W(0, 1, 2, 3), "W0-3"), (W(5, 0, 1, 2), "W0-2,5")],
    ids=str,
)
def test_action_label(action: Action, label: str) -> None:
    assert action_label(action) == label


def test_chrome_trace_structure() -> None:
    trace = to_chrome_trace(TIMELINES)
    metadata = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    assert {(e["pid"], e["name"], json.dumps(e["args"])) for e in metadata} == {
        (0, "process_name", '{"name": "rank 0"}'),
        (1, "process_name", '{"name": "rank 1"}'),
        (0, "process_sort_index", '{"sort_index": 0}'),
        (1, "process_sort_index", '{"sort_index": 1}'),
    }
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["pid"], e["name"], e["cat"]) for e in spans] == [
        (0, "F0", "forward"),
        (0, "I0", "backward_p1"),
        (0, "W0,1", "backward_p2"),
        (1, "F0", "forward"),
        (1, "B0", "backward"),
    ]
    assert [e["ts"] for e in spans] == pytest.approx([0, 3000, 5000, 1000, 2000])
    assert [e["dur"] for e in spans] == pytest.approx([1000, 1000, 2000, 1000, 1000])
    assert spans[2]["args"] == {"micro_batches": [0, 1], "stage": None}
    assert all(e["tid"] == 0 for e in spans)


def test_chrome_trace_scales_simulated_units() -> None:
    trace = to_chrome_trace([[Event(0, F(0), 2, 3)]], seconds_per_unit=1e-3)
    (span,) = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert (span["ts"], span["dur"]) == pytest.approx((2000, 1000))


def test_write_chrome_trace_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "step.json"
    write_chrome_trace(path, TIMELINES + [[Event(2, W(), 0.0, 0.5)]])
    assert json.loads(path.read_text()) == to_chrome_trace(TIMELINES + [[Event(2, W(), 0.0, 0.5)]])
    read = read_chrome_trace(path)
    assert [[e.action for e in timeline] for timeline in read] == [[F(0), I(0), W(0, 1)], [F(0), B(0)], [W()]]
    assert [t for e in read[0] for t in (e.start, e.end)] == pytest.approx([0.0, 0.001, 0.003, 0.004, 0.005, 0.007])


@pytest.mark.parametrize("twobp", [False, True], ids=["plain", "2bp"])
def test_plot_timeline_writes_a_png(tmp_path: Path, twobp: bool) -> None:
    pytest.importorskip("matplotlib")
    result = simulate(schedule("1f1b-2", 3, twobp=twobp), StageCosts(1, 1, 1, concat_efficiency=0.6))
    path = tmp_path / "timeline.png"
    plot_timeline(result.timelines, path, title="1F1B-2, 3 stages")
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000


def test_plot_timelines_stacks_panels_on_one_axis(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    costs = StageCosts(1, 1, 1)
    panels = [
        (f"2BP {'on' if on else 'off'}", simulate(schedule("gpipe", 2, twobp=on), costs).timelines)
        for on in (False, True)
    ]
    path = tmp_path / "panels.png"
    plot_timelines(panels, path, "GPipe, 2 stages")
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_a_rank_with_several_stages_keeps_each_actions_stage(tmp_path: Path) -> None:
    """On the V rank 0 runs F0 of stage 0 and of stage 3: both were written as ``F0`` and read
    back without their stage."""
    timelines = simulate(schedule("zbv", 2, 4, twobp=True), StageCosts(1, 1, 1)).timelines
    trace = to_chrome_trace(timelines)
    names = [(e["pid"], e["name"]) for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(set(names)) == len(names)
    path = tmp_path / "zbv.json"
    write_chrome_trace(path, timelines)
    assert [[e.action for e in t] for t in read_chrome_trace(path)] == [[e.action for e in t] for t in timelines]
