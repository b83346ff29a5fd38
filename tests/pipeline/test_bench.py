"""The bench command end to end on two spawned CPU ranks, with a model small enough to be quick."""

from __future__ import annotations

import json

import pytest

from twobp_autograd.pipeline.bench import main, parse_args

pytest.importorskip("matplotlib")

TINY = ["--width", "32", "--depth", "2", "--seq-len", "4", "--batch-size", "4", "--balance", "params"]


@pytest.mark.parametrize("model", ["transformer", "mlp"])
def test_bench_writes_table_json_and_traces(model: str, tmp_path, capfd) -> None:
    out = tmp_path / "bench.json"
    traces = tmp_path / "traces"
    argv = ["pipeline", "--model", model, "--schedule", "1f1b-1", "--twobp", "both", "--steps", "2", "--warmup", "0"]
    # Token targets split with their inputs at a batch m does not divide (they were flattened, and refused).
    uneven = ["--batch-size", "6", "--micro-batches", "4"] if model == "transformer" else []
    outputs = ["--nproc", "2", "--json", str(out), "--trace", str(traces), "--no-progress"]
    assert main(argv + TINY + uneven + outputs) == 0

    table = capfd.readouterr().out
    assert "samples/s" in table and "vs 2BP off" in table and "bubble" in table
    document = json.loads(out.read_text())
    rows = {row["twobp"]: row for row in document["summary"]}
    assert rows[False]["ratio_to_off"] == 1.0 and rows[True]["ratio_to_off"] > 0
    assert all(0 <= row["bubble_ratio"] < 1 and row["samples_per_s"] > 0 for row in rows.values())
    steps = document["steps"]
    assert all(jobs > 0 for step in steps[f"{model}-1f1b-1-2bp-on"] for jobs in step["deferred_jobs"])
    assert all(jobs == 0 for step in steps[f"{model}-1f1b-1-2bp-off"] for jobs in step["deferred_jobs"])
    for twobp in ("on", "off"):
        assert (traces / f"{model}-1f1b-1-2bp-{twobp}.json").stat().st_size > 0
        assert (traces / f"{model}-1f1b-1-2bp-{twobp}.png").stat().st_size > 0


def test_bench_runs_pytorch_schedules_beside_ours(capfd, tmp_path) -> None:
    argv = [
        "pipeline", "--model", "mlp", "--schedule", "zbv", "zb", "zb:1", "--twobp", "on", "--baseline", "torch",
        "--steps", "1",
    ]  # fmt: skip
    tiny = [*TINY[:2], "--depth", "4", *TINY[4:]]  # 4 blocks: two stages per rank
    out = tmp_path / "bench.json"
    options = ["--warmup", "0", *tiny, "--nproc", "2", "--no-progress", "--micro-batches", "4", "--json", str(out)]
    assert main(argv + options) == 0
    table = capfd.readouterr().out
    rows = {line.split()[0]: line.split() for line in table.splitlines() if line.strip().startswith(("torch-", "zb"))}
    assert set(rows) == {
        "zb", "zb:1", "zbv", "torch-gpipe", "torch-1f1b", "torch-interleaved-1f1b", "torch-interleaved-zb", "torch-zbv"
    }  # fmt: skip
    assert rows["torch-gpipe"][-1] == "1.000" and all(float(row[-1]) > 0 for row in rows.values())
    assert "vs torch GPipe" in table
    summary = json.loads(out.read_text())["summary"]  # every row has every key (None where not measured)
    assert all(row.keys() == summary[0].keys() for row in summary)
    assert all(row["samples_per_s"] is None for row in summary if row["schedule"].startswith("torch-"))


@pytest.mark.parametrize("spec", ["zb:0", "gpipe:2", "zbv:x", "nope"])
def test_a_bound_is_only_for_zb_and_zbv(spec: str, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--schedule", spec])
    assert "--schedule" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--micro-batches", "8", "--batch-size", "4"], "--micro-batches 8 is more than the 4 samples"),
        (["--baseline", "torch"], "--baseline torch compares every schedule at one micro-batch count"),
        (["--json", "."], "is a directory"),
        (["--trace", __file__], "is a file"),
        (["--micro-batches", "3", "--nproc", "2"], "--micro-batches 3 is not a multiple"),
        (["--schedule", "interleaved-1f1b", "--micro-batches", "6", "--nproc", "4"], "groups of the 4 ranks"),
        (["--schedule", "gpipe", "--baseline", "torch", "--micro-batches", "4", "--batch-size", "6"], "do not divide"),
        (["--schedule", "gpipe", "--baseline", "torch", "--micro-batches", "1", "--nproc", "2"], "per rank (2)"),
        (["--schedule", "gpipe", "--baseline", "torch", "--micro-batches", "5", "--batch-size", "10"], "2 rounds"),
        (["--model", "mlp", "--depth", "1", "--schedule", "gpipe"], "has 1 blocks to cut"),
        (["--model", "mlp", "--depth", "3", "--schedule", "zbv"], "4 stages on 2 ranks"),
    ],
    ids=[
        "more-micro-batches-than-samples", "torch-baseline-without-a-count", "json-a-directory", "trace-a-file",
        "all-schedules-with-interleaved-at-an-odd-count", "interleaved-at-a-count-ranks-do-not-divide",
        "torch-baseline-uneven-micro-batches", "torch-baseline-fewer-micro-batches-than-ranks",
        "torch-baseline-count-its-rounds-do-not-divide", "more-ranks-than-blocks", "more-v-stages-than-blocks",
    ],  # fmt: skip
)
def test_options_that_cannot_work_are_refused_before_any_rank_starts(argv: list[str], says: str, capsys) -> None:
    """Each failed in every rank after spawning (a traceback per rank), or, for the outputs, after
    the whole run; the torch baseline ran PyTorch's schedules at another micro-batch count than
    ours and divided one step time by the other."""
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert says in capsys.readouterr().err
