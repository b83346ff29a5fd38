"""The pipeline sweep (benchmarks/): its model of a step against hand-worked values, and one
tiny end-to-end run (bench, stage costs, analysis, tables and figures) that must resume from
what it saved."""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path

import pytest

from twobp_autograd.pipeline.actions import F, I, W
from twobp_autograd.pipeline.schedules import schedule

pytest.importorskip("matplotlib")

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def sweep(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import pipeline_sweep

    return pipeline_sweep


def terms(sweep, forward=1.0, backward=4.5, input_grad=2.0, weight_grad=None, **extra):
    return sweep.StageTerms(
        forward_off=forward,
        forward_on=forward,
        backward=backward,
        input_grad=input_grad,
        weight_grad=weight_grad or {1: 3.0, 2: 4.8, 4: 9.0},
        boundary_bytes=1000,
        **extra,
    )


def test_weight_grad_curve_interpolates_then_extrapolates_per_micro_batch(sweep) -> None:
    curve = sweep.weight_grad_curve({1: 1.0, 2: 1.6, 4: 2.8})
    assert [curve(n) for n in (1, 2, 4)] == [1.0, 1.6, 2.8]
    assert curve(3) == pytest.approx(2.2)
    assert curve(8) == pytest.approx(5.6)  # 2.8 per 4 micro-batches, no further gain
    with pytest.raises(ValueError, match="W\\(1\\)"):
        sweep.weight_grad_curve({2: 1.0})


def test_latency_model_is_a_line_not_below_the_fastest_message(sweep) -> None:
    model = sweep.latency_model([[1, 1e-4], [1_000_001, 1.1e-3]])
    assert model(500_001) == pytest.approx(6e-4)
    assert model(0) == pytest.approx(1e-4)
    assert sweep.latency_model([[1, 5e-4], [100, 2e-4]])(1) == pytest.approx(3.5e-4)  # noise, falling: their mean
    assert sweep.latency_model([[8, 3e-4]])(10**9) == 3e-4


@pytest.mark.parametrize("num_stages,m", [(2, 2), (2, 4), (4, 4), (3, 6)], ids=str)
def test_ideal_gpipe_ratio_is_design_closed_form(sweep, num_stages: int, m: int) -> None:
    stage = terms(sweep)
    f, i, w1, w = 1.0, 2.0, 3.0, stage.curve(m)
    expected = (m + num_stages - 1) * (f + i + w1) / ((m + num_stages - 1) * (f + i) + w)
    assert sweep.ideal_ratio("gpipe", num_stages, m, stage) == pytest.approx(expected)
    # Without the concatenation gain W' = W: a smaller (here) ideal.
    plain = (m + num_stages - 1) * (f + i + w1) / ((m + num_stages - 1) * (f + i) + m * w1)
    assert sweep.ideal_ratio("gpipe", num_stages, m, stage, concatenation=False) == pytest.approx(plain)


def test_simulation_uses_each_stage_its_own_measured_terms(sweep) -> None:
    slow, fast = terms(sweep, forward=2.0), terms(sweep, forward=1.0)
    off, on = sweep.simulate_pair("gpipe", [slow, fast], 2, latency=0.5)
    # 2BP off. Rank 1: F0 2.5-3.5, F1 4.5-5.5, B0 5.5-10, B1 10-14.5. Rank 0: B0 10.5-15, B1 15-19.5.
    assert off.step_time == pytest.approx(19.5)
    assert on.step_time < off.step_time


def test_modeled_peak_bytes_holds_graphs_until_i_and_queued_work_until_w(sweep) -> None:
    gpipe_on = [F(0), F(1), I(0), I(1), W(0, 1)]
    assert sweep.modeled_peak_bytes(gpipe_on, graph_bytes=10, pending_bytes=7) == 20
    assert sweep.modeled_peak_bytes(gpipe_on, graph_bytes=10, pending_bytes=15) == 30
    one_f_one_b = schedule("1f1b-2", 2, 4, twobp=False)[0]
    assert sweep.modeled_peak_bytes(one_f_one_b, graph_bytes=10, pending_bytes=0) == 20


def _block(forward: float, w1: float, pending: int = 5, **extra) -> dict:
    return {
        "name": "B", "forward_off": forward, "forward_on": forward * 1.1, "backward": 2 * forward,
        "input_grad": forward, "weight_grad": {"1": w1, "2": 1.5 * w1}, "output_bytes": 64, "pending_bytes": pending,
        **extra,
    }  # fmt: skip


def test_stage_terms_sum_blocks_per_cut_with_the_loss_on_the_last(sweep) -> None:
    costs = {
        "block_costs": [1.0, 1.0, 1.0, 1.0],
        "ranks": [
            {
                "rank": 0,
                "blocks": [0, 1],
                "per_size": {"4": [_block(1, 1, stage_saved_bytes_off=100, stage_saved_bytes_on=90), _block(2, 2)]},
            },
            {
                "rank": 1,
                "blocks": [2, 3],
                "per_size": {
                    "4": [
                        _block(3, 3, stage_saved_bytes_off=300, stage_saved_bytes_on=270),
                        _block(4, 4),
                        _block(0.5, 0, pending=0),
                    ]
                },
            },
        ],
    }
    cut, two = sweep.stage_terms(costs, 4, 2)
    assert cut == [range(0, 2), range(2, 4)]
    assert (two[0].forward_off, two[1].forward_off) == (3, 7.5)
    assert two[1].weight_grad == {1: 7, 2: 10.5}
    assert (two[0].saved_bytes_off, two[1].saved_bytes_on, two[0].pending_bytes) == (100, 270, 10)
    cut, four = sweep.stage_terms(costs, 4, 4)
    assert len(cut) == 4 and [t.forward_off for t in four] == [1, 2, 3, 4.5]
    assert all(t.saved_bytes_off is None for t in four)  # only the measured 2-rank stages know theirs


def _stored_block(forward: float, off: list, on: list, *, out: int = 64, pending: int = 5) -> dict:
    """A block as stage_costs.py records it: B = I + W(1), W(2) = 1.5 W(1), its saved storages."""
    return {
        "name": "B", "forward_off": forward, "forward_on": forward, "backward": 2 * forward, "input_grad": forward,
        "weight_grad": {"1": forward, "2": 1.5 * forward}, "output_bytes": out, "pending_bytes": pending,
        "saved_storages_off": off, "saved_storages_on": on,
    }  # fmt: skip


#: 4 unit blocks on 2 measured ranks. Rank 0's blocks share storage 0 (100 bytes), so its
#: measured stage holds 150 bytes and its blocks, as stages of their own, 100 and 150; the
#: loss saves rank 1's storage 1 again.
FOUR_BLOCKS = {
    "block_costs": [1.0] * 4,
    "latency_points": [[1, 0.0]],
    "ranks": [
        {
            "rank": 0,
            "blocks": [0, 1],
            "per_size": {
                "2": [_stored_block(1, [[0, 100]], [[0, 90]]), _stored_block(1, [[0, 100], [1, 50]], [[1, 50]])]
            },
        },
        {
            "rank": 1,
            "blocks": [2, 3],
            "per_size": {
                "2": [
                    _stored_block(1, [[0, 30]], [[0, 30]]),
                    _stored_block(1, [[1, 20]], [[1, 20]]),
                    _stored_block(0, [[1, 20], [2, 10]], [[2, 10]], pending=0),
                ]
            },
        },
    ],
}


def test_saved_bytes_of_any_cut_count_each_blocks_storage_once(sweep) -> None:
    _, two = sweep.stage_terms(FOUR_BLOCKS, 2, 2)
    assert [(t.saved_bytes_off, t.saved_bytes_on) for t in two] == [(150, 140), (60, 60)]
    _, four = sweep.stage_terms(FOUR_BLOCKS, 2, 4)
    assert [(t.saved_bytes_off, t.saved_bytes_on) for t in four] == [(100, 90), (150, 50), (30, 30), (30, 30)]
    assert [t.pending_bytes for t in four] == [5, 5, 5, 5]


def test_messages_between_ranks_only_under_each_placement(sweep) -> None:
    four = [terms(sweep) for _ in range(4)]
    for stage, size in enumerate((64, 1000, 64)):
        four[stage].boundary_bytes = size
    assert [sweep.stages_per_rank(n) for n in ("gpipe", "zb", "interleaved-1f1b", "zbv")] == [1, 1, 2, 2]
    assert sweep.message_bytes("interleaved-1f1b", four) == 1000  # stage 1 -> 2 crosses from rank 1 to 0
    assert sweep.message_bytes("zbv", four) == 64  # the V's tip: stages 1 and 2 both on rank 1
    assert sweep.message_bytes("1f1b-2", four) == 1000  # 4 stages on 4 ranks


def _summary_row(name: str, twobp: bool, step: float) -> dict:
    return {
        "schedule": name, "twobp": twobp, "micro_batches": 4, "step_time_median": step, "samples_per_s": 8 / step,
        "bubble_ratio": 0.2, "peak_bytes": 1000,
    }  # fmt: skip


def test_analysis_of_two_stages_per_rank_cuts_four_stages(sweep) -> None:
    """Unit F and I, B = 2, W(2) = 1.5, no latency: the simulated ratio is the ideal one, and
    interleaved 1F1B's step without 2BP is its 24 units of work plus (p - 1)(F + B) / v = 3.
    Its modelled peak without 2BP (hand-worked): rank 1 holds 3 micro-batches of stage 1 (150
    bytes each) at once, stage 3's all released by then: 450."""
    names = ("gpipe", "interleaved-1f1b", "zbv")
    bench_doc = {"summary": [_summary_row(n, on, 25.0 if on else 30.0) for n in names for on in (False, True)]}
    result = sweep.analyse_model(bench_doc, FOUR_BLOCKS, "zbv")
    assert list(result["schedules"]) == list(names) and result["timeline_schedule"] == "zbv"
    assert result["cuts"] == {"2": [[0, 2], [2, 4]], "4": [[0, 1], [1, 2], [2, 3], [3, 4]]}
    assert list(result["stage_terms"]) == ["2"] and len(result["stage_terms_by_cut"]["4"]["2"]) == 4
    interleaved, zbv = result["schedules"]["interleaved-1f1b"], result["schedules"]["zbv"]
    assert (interleaved["stages"], interleaved["placement"]) == (4, [0, 1, 0, 1])
    assert (zbv["stages"], zbv["placement"]) == (4, [0, 1, 1, 0])
    expected = {  # (off, on) simulated steps, ideal, ideal if W' = W, modelled peak bytes off and on
        "gpipe": ((30.0, 26.0), 30 / 26, 1.0714285714285714, (600, 560)),
        "interleaved-1f1b": ((27.0, 24.0), 1.125, 1.08, (450, 400)),
        "zbv": ((28.0, 24.5), 28 / 24.5, 1.12, (480, 360)),  # ZB-V's order: its W mostly one at a time
    }
    for name, (steps, ideal, plain, memory) in expected.items():
        entry = result["schedules"][name]
        assert (entry["simulated"]["step_time_off"], entry["simulated"]["step_time_on"]) == pytest.approx(steps)
        assert entry["simulated"]["throughput_ratio"] == pytest.approx(ideal)
        assert entry["ideal"]["throughput_ratio"] == pytest.approx(ideal)
        assert entry["ideal"]["throughput_ratio_without_concatenation_gain"] == pytest.approx(plain)
        assert entry["measured_over_ideal"] == pytest.approx(1.2 / ideal)
        assert (entry["memory_modeled"]["peak_bytes_off"], entry["memory_modeled"]["peak_bytes_on"]) == memory
        assert "not_available" not in entry
    # p = 4 ranks: 4 stages for GPipe, 8 for the two-stage-per-rank schedules (4 blocks cannot).
    assert result["schedules"]["gpipe"]["predicted"]["4"]["stages"] == 4
    assert interleaved["predicted"] == {
        "4": {"skipped": "4 blocks cannot make 8 stages"},
        "8": {"skipped": "4 blocks cannot make 16 stages"},
    }


def test_analysis_says_what_older_measurements_cannot_give(sweep) -> None:
    """Costs recorded before blocks' storages were: 4 stages have no saved bytes, so no modelled memory."""
    older = copy.deepcopy(FOUR_BLOCKS)
    for rank in older["ranks"]:
        for block in rank["per_size"]["2"]:
            del block["saved_storages_off"], block["saved_storages_on"]
        rank["per_size"]["2"][0].update(stage_saved_bytes_off=150, stage_saved_bytes_on=140)
    older["ranks"][1]["per_size"]["2"][0].update(stage_saved_bytes_off=60, stage_saved_bytes_on=60)
    bench_doc = {"summary": [_summary_row(n, on, 25.0) for n in ("gpipe", "zbv") for on in (False, True)]}
    result = sweep.analyse_model(bench_doc, older)
    assert result["schedules"]["gpipe"]["memory_modeled"]["peak_bytes_off"] == 600  # the measured 2-rank stages'
    zbv = result["schedules"]["zbv"]
    assert "memory_modeled" not in zbv and "4-stage cut" in zbv["not_available"]["memory_modeled"]
    assert zbv["simulated"]["step_time_off"] == pytest.approx(28.0)  # timing needs no bytes


def test_tiny_sweep_end_to_end_then_resumes_without_measuring(sweep, tmp_path, monkeypatch) -> None:
    """Two spawned bench ranks and two measuring ranks on a 4-block MLP (4 stages for the
    two-stage-per-rank schedules): ~40 s on 2 busy cores."""
    tiny = sweep.Mode(
        "quick", steps=1, warmup=0, cost_repeats=1, counts=(1, 2),
        bench_shape=("--width", "16", "--depth", "4", "--seq-len", "4", "--batch-size", "4", "--balance", "params"),
        latency_repeats=2,
    )  # fmt: skip
    monkeypatch.setitem(sweep.MODES, "quick", tiny)
    argv = ["--quick", "--models", "mlp", "--no-pipelining-zb", "--out", str(tmp_path)]
    assert sweep.main(argv) == 0

    document = json.loads((tmp_path / "pipeline.json").read_text())
    assert document["kind"].startswith("smoke run") and document["machine"]["torch"]
    (model,) = document["models"]
    assert "error" not in model and list(model["schedules"]) == list(sweep.SWEEP_SCHEDULES)
    for name, entry in model["schedules"].items():
        assert entry["micro_batches"] == (2 if name in ("gpipe", "1f1b-1") else 4)
        for figure in ("measured", "ideal", "simulated"):
            ratio = entry[figure]["throughput_ratio"]
            assert math.isfinite(ratio) and ratio > 0
        assert entry["simulated"]["step_time_on"] > 0 and entry["memory_modeled"]["peak_bytes_on"] > 0
        assert entry["stages"] == (4 if name in ("interleaved-1f1b", "zbv") else 2)
        assert entry["predicted"]["8"]["skipped"]  # 4 blocks cannot make 8 stages
    assert model["cuts"] == {"2": [[0, 2], [2, 4]], "4": [[0, 1], [1, 2], [2, 3], [3, 4]]}
    # The stage costs came from a stage that really deferred: something was queued between I and W.
    raw = next((tmp_path / "raw").glob("mlp-*"))
    costs = json.loads((raw / "costs.json").read_text())
    assert all(any(b["pending_bytes"] > 0 for b in rank["per_size"]["2"]) for rank in costs["ranks"])
    bench = json.loads((raw / "bench.json").read_text())
    assert all(jobs > 0 for step in bench["steps"]["mlp-gpipe-2bp-on"] for jobs in step["deferred_jobs"])

    table = (tmp_path / "pipeline.md").read_text()
    # 6 schedules in the two tables of schedules, and 2 stages at each of 2 micro-batch sizes
    assert table.count("| mlp | ") == 2 * 6 + 2 * 2 and "smoke run" in table and "1.70x" in table
    assert "| mlp | zbv (4 stages) | 4 |" in table and "| mlp | interleaved-1f1b (2p stages) |" in table
    for image in ("pipeline.png", "timeline_mlp.png"):
        assert (tmp_path / image).stat().st_size > 10_000

    def no_measuring(*args, **kwargs):
        raise AssertionError("a saved part was measured again")

    monkeypatch.setattr(sweep, "_run", no_measuring)
    (tmp_path / "pipeline.json").unlink()
    assert sweep.main(argv) == 0
    assert json.loads((tmp_path / "pipeline.json").read_text())["models"][0]["schedules"] == model["schedules"]

    # Under --keep-freed-memory every part runs anew (other names), its processes started with
    # glibc's tunables set, and the results say so.
    from local_ranks import KEEP_FREED_MEMORY

    seen: list[dict[str, str]] = []

    def record_environment(command, log):
        seen.append({name: os.environ.get(name, "") for name in KEEP_FREED_MEMORY})
        raise RuntimeError("not measured here")

    for name in KEEP_FREED_MEMORY:
        monkeypatch.delenv(name, raising=False)  # restored (unset) after the test
    monkeypatch.setattr(sweep, "_run", record_environment)
    assert sweep.main([*argv, "--keep-freed-memory"]) == 1  # the model "failed": nothing measured
    assert seen == [KEEP_FREED_MEMORY]
    document = json.loads((tmp_path / "pipeline.json").read_text())
    assert document["machine"]["allocator"] == KEEP_FREED_MEMORY


def test_readme_table_goes_between_the_markers_and_only_there(sweep, tmp_path) -> None:
    import plot_results

    entry = {
        "micro_batches": 2,
        "measured": {"throughput_ratio": 1.234, "bubble_off": 0.3, "bubble_on": 0.15, "peak_memory_ratio": 1.5},
        "ideal": {"throughput_ratio": 1.3},
        "measured_over_ideal": 0.95,
        "simulated": {"throughput_ratio": 1.2},
        "predicted": {"4": {"throughput_ratio": 1.25}},
        "memory_modeled": {"ratio": 1.6},
    }
    schedules = {"zbv": {**entry, "placement": [0, 1, 1, 0]}, "gpipe": entry, "unknown": entry}
    document = {"kind": "full sweep", "models": [{"model": "mlp", "schedules": schedules}]}
    table = plot_results.readme_table(document)
    figures = "1.23 | 1.30 | 0.95 | 1.20 | 1.25 | – | 0.30 → 0.15 | 1.50x | 1.60x |"
    assert table.splitlines()[2:] == [
        f"| MLP (512→2048 blocks) | GPipe (2) | {figures}",
        f"| MLP (512→2048 blocks) | ZB-V, 4 stages (2) | {figures}",
    ]  # in the README's order; a schedule it does not list is left to pipeline.md

    start, end = plot_results.README_MARKERS
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{start}\nold table\n{end}\nafter\n")
    assert plot_results.update_readme(table, readme)
    assert readme.read_text() == f"intro\n{start}\n{table}\n{end}\nafter\n"
    readme.write_text("no markers\n")
    assert not plot_results.update_readme(table, readme) and readme.read_text() == "no markers\n"


def test_pipeline_page_labels_two_stages_per_rank_and_says_what_is_not_available(sweep, tmp_path) -> None:
    import plot_results

    rows = [_summary_row(n, on, 25.0 if on else 30.0) for n in ("gpipe", "zbv") for on in (False, True)]
    bench_doc = {"summary": rows}
    model = {"model": "mlp", **sweep.analyse_model(bench_doc, FOUR_BLOCKS)}
    del model["_simulated_timeline"]
    model["schedules"]["zbv"]["not_available"] = {"memory_modeled": "no storages"}
    machine = {"torch": "2", "cpu_count": 2, "processor": "x"}
    document = {
        "kind": "smoke run", "command": "sweep", "date": "today", "machine": machine, "ranks": 2,
        "threads_per_rank": 1, "mode": {"warmup": 1, "steps": 1}, "models": [model],
    }  # fmt: skip
    page = plot_results.markdown(document).splitlines()
    two_ranks = [line for line in page if line.startswith("| mlp | zbv")]
    assert two_ranks[0].startswith(
        "| mlp | zbv (4 stages) | 4 | 1.200 | 1.143 | 1.120 | 1.050 | 1.143 | -6.7% / -2.0% |"
    )
    assert two_ranks[1] == (
        "| mlp | zbv (2p stages) | – | 4 blocks cannot make 8 stages | – | – | 4 blocks cannot make 16 stages | – |"
    )
    assert "Not available: mlp, zbv: memory_modeled: no storages." in page
    assert [line for line in page if line.startswith("| mlp | gpipe |")][1].startswith("| mlp | gpipe | 4 | 1.235 |")
    plot_results.plot_ratios(document, tmp_path / "pipeline.png")
    assert (tmp_path / "pipeline.png").stat().st_size > 10_000


@pytest.fixture
def stage_costs(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import stage_costs

    return stage_costs


def test_saved_bytes_counts_activations_once_and_no_parameters(stage_costs) -> None:
    import torch

    linear = torch.nn.Linear(8, 3)
    x = torch.randn(4, 8, requires_grad=True)
    with stage_costs.saved_bytes(list(linear.parameters())) as counted:
        out = linear(x)
        counted.block = 1
        again = linear(x)  # the same input saved twice: one storage
    assert counted.bytes == x.numel() * 4
    assert counted.block_storages(2) == [[[0, x.numel() * 4]], [[0, x.numel() * 4]]]  # each block holds it
    (out + again).sum().backward()


def test_measure_stage_times_every_block_and_leaves_the_stage_as_it_was(stage_costs) -> None:
    import torch
    import torch.nn.functional as F

    import twobp_autograd as twobp

    blocks = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU()), torch.nn.Linear(16, 4)]
    inputs = list(torch.randn(12, 8).tensor_split(4))
    targets = list(torch.randn(12, 4).tensor_split(4))
    measured = stage_costs.measure_stage(
        blocks, inputs, targets, loss_fn=F.mse_loss, first=False, counts=[1, 2, 4], repeats=2
    )
    assert [b["name"] for b in measured] == ["Sequential", "Linear", "loss"]
    for block in measured[:2]:
        assert all(block[q] > 0 for q in ("forward_off", "forward_on", "backward", "input_grad"))
        assert set(block["weight_grad"]) == {"1", "2", "4"} and all(t > 0 for t in block["weight_grad"].values())
        assert block["pending_bytes"] > 0  # something was queued between I and W
    assert measured[2]["weight_grad"]["1"] == 0 and measured[2]["pending_bytes"] == 0
    assert measured[0]["stage_saved_bytes_off"] >= 3 * 8 * 4  # at least the first Linear's input
    for flag in ("off", "on"):  # the stage's storages, each in every block that saves it
        storages = {tuple(pair) for block in measured for pair in block[f"saved_storages_{flag}"]}
        assert sum(size for _, size in storages) == measured[0][f"stage_saved_bytes_{flag}"]
    assert 3 * 16 * 4 in [size for _, size in measured[1]["saved_storages_off"]]  # the Linear's input
    assert measured[1]["output_bytes"] == 3 * 4 * 4
    # Unpatched, no gradient, nothing queued: the model is handed back untouched.
    assert all(p.grad is None for b in blocks for p in b.parameters())
    assert twobp.pending().jobs == 0
    out = blocks[1](blocks[0](inputs[0]))
    out.sum().backward()
    assert blocks[1].weight.grad is not None


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the message is for machines without CUDA")
def test_cuda_options_benchmark_says_it_needs_a_gpu(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import cuda_options

    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        cuda_options.main([])


def test_zb_bound_replay_picks_a_bound_no_slower_than_zb_or_1f1b_2(sweep) -> None:
    """benchmarks/zb_bound.py on the committed sweep results: at the bound fastest_max_pending
    picks, zb is no slower than at its default, and ahead of 1F1B-2, on every model and p."""
    import zb_bound

    models = [d for d in zb_bound.RAW.iterdir() if (d / "costs.json").exists()]
    assert models, "no committed sweep results to replay"
    for model_dir in models:
        for p in (2, 4, 8):
            row = zb_bound.replay(model_dir, p)
            assert row["zb_at_best"] >= row["zb"] and row["zb_at_best"] > row["1f1b-2"], (model_dir.name, p, row)


def test_zb_bound_without_results_says_so(sweep, tmp_path, capsys) -> None:
    """A --raw that is missing (a traceback) or holds no results (the header alone, exit 0)."""
    import zb_bound

    for raw in (tmp_path / "missing", tmp_path):
        with pytest.raises(SystemExit):
            zb_bound.main(["--raw", str(raw)])
        assert "no <model>-*/costs.json under it" in capsys.readouterr().err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the message is for machines without CUDA")
@pytest.mark.parametrize("script", ["per_call", "stage_costs", "compiled", "cuda_precision"])
def test_device_cuda_without_a_gpu_says_so(monkeypatch, script) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    module = __import__(script)
    argv = [] if script == "cuda_precision" else ["--device", "cuda"]
    if script == "stage_costs":
        argv += ["--bench-json", "unused.json", "--out", "unused.json", "--micro-sizes", "1"]
    with pytest.raises(SystemExit, match="CUDA is not available"):
        module.main(argv)


def test_replay_rebalances_on_the_measured_blocks_and_simulates_every_schedule(monkeypatch) -> None:
    """benchmarks/replay_costs.py on the committed GPU stage terms: the cut follows the measured
    plain F + B of each block, and every sweep schedule gets an ideal and a simulated ratio."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import replay_costs

    costs = json.loads((BENCHMARKS / "results" / "gpu" / "costs_mlp.json").read_text())
    balanced = replay_costs.rebalanced(costs)
    size = str(max(costs["micro_sizes"]))
    first = costs["ranks"][0]
    block = first["per_size"][size][0]
    assert balanced["block_costs"][first["blocks"][0]] == block["forward_off"] + block["backward"]
    assert len(balanced["block_costs"]) == len(costs["block_costs"])
    result = replay_costs.replay(costs)
    assert result["device"] == costs["device"]
    for name, row in result["schedules"].items():
        assert row["ideal"] > 0 and row["simulated"] > 0, name
        assert row["simulated"] == pytest.approx(row["step_time_off"] / row["step_time_on"])


@pytest.mark.parametrize(
    ("script", "argv"),
    [
        ("overhead", ["--rounds", "0"]),
        ("per_call", ["--stage-rounds", "0"]),
        ("compiled", ["--rounds", "0"]),
        ("fsdp", ["--steps", "0"]),
        ("data_parallel", ["--warmup", "-1"]),
        ("memory", ["--steps", "0"]),
        ("pipelining_zb", ["--warmup", "0"]),
    ],
)
def test_benchmarks_refuse_empty_counts_before_running(monkeypatch, capsys, script, argv) -> None:
    """A count of 0 (steps, rounds) would end a run in a median of nothing: refused at parsing."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setattr("sys.argv", [f"{script}.py", *argv])
    with pytest.raises(SystemExit):
        __import__(script).parse_args()
    assert "must be at least" in capsys.readouterr().err
