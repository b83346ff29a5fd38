"""The command line, the demo's data, and a few steps of the demo on the small ResNet (the
full demo is run by hand: it takes minutes)."""

from __future__ import annotations

import argparse
import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from twobp_autograd import demo
from twobp_autograd.__main__ import SUBCOMMANDS, main
from twobp_autograd.pipeline import SCHEDULES


def test_demo_options_parse() -> None:
    args = demo.build_parser().parse_args(
        ["--epochs", "3", "--micro-batches", "2", "--batch-size", "8", "--seed", "1", "--no-compare"]
    )
    assert (args.epochs, args.micro_batches, args.batch_size, args.seed) == (3, 2, 8, 1)
    assert args.no_compare and args.device == "cpu"


def test_demo_rejects_unknown_device() -> None:
    with pytest.raises(SystemExit):
        demo.build_parser().parse_args(["--device", "tpu"])


def test_demo_offers_every_schedule() -> None:
    schedule = next(a for a in demo.build_parser()._actions if a.dest == "schedule")
    assert tuple(schedule.choices) == SCHEDULES


def test_the_command_line_lists_its_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as help_exit:
        main(["--help"])
    assert help_exit.value.code == 0
    listed = capsys.readouterr().out
    assert all(" ".join(command.words) in listed for command in SUBCOMMANDS)
    for unknown in ([], ["bench"], ["train"], ["bench", "--help"], ["bench", "pipelines"]):
        with pytest.raises(SystemExit) as error:
            main(unknown)
        assert error.value.code == 2
        if unknown[:1] == ["bench"]:  # not "invalid choice: 'bench'"
            assert "'bench' is the start of a command: bench pipeline" in capsys.readouterr().err


def test_a_command_quoted_as_one_word_says_to_pass_two(capsys: pytest.CaptureFixture[str]) -> None:
    """The usage lists "bench pipeline" with its space; quoted, it was an "unknown command"."""
    for quoted in (["bench pipeline"], ["bench pipeline", "--steps", "2"], [" bench  pipeline "]):
        with pytest.raises(SystemExit) as error:
            main(quoted)
        assert error.value.code == 2
        assert "pass it as 2 words: bench pipeline" in capsys.readouterr().err


@pytest.mark.parametrize("lr", ["-1", "0", "nan", "inf"])
def test_demo_refuses_a_learning_rate_adam_cannot_train_with(lr: str, capsys: pytest.CaptureFixture[str]) -> None:
    """-1 ended in Adam's ValueError traceback after the data and model were built; 0 trained nothing."""
    with pytest.raises(SystemExit) as error:
        demo.main(["--lr", lr, "--no-compare", "--stages", "1"])
    assert error.value.code == 2
    assert "--lr must be a positive number" in capsys.readouterr().err


def test_demo_refuses_more_stages_than_the_model_has_blocks(capsys: pytest.CaptureFixture[str]) -> None:
    """Each of 11 spawned ranks printed a traceback before the same one-line refusal (200 hung)."""
    with pytest.raises(SystemExit) as error:
        demo.main(["--stages", "11", "--model", "resnet18", "--no-compare"])
    assert error.value.code == 2
    assert "11 stages (--stages, or torchrun's ranks) but resnet18 has 10 blocks" in capsys.readouterr().err


def test_bench_pipeline_forwards_its_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = pytest.importorskip("twobp_autograd.pipeline.bench")
    received: list[list[str]] = []
    monkeypatch.setattr(bench, "main", lambda argv: received.append(list(argv)) or 0)
    assert main(["bench", "pipeline", "--steps", "2", "--schedule", "gpipe"]) == 0
    assert received == [["--steps", "2", "--schedule", "gpipe"]]


def test_bench_pipeline_missing_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "twobp_autograd.pipeline.bench", None)  # import fails as if absent
    assert main(["bench", "pipeline"]) == 2
    assert "pipeline benchmark" in capsys.readouterr().err


def test_failed_ranks_end_the_command_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each rank prints its own error; the launcher's own traceback on top said nothing more."""
    bench = pytest.importorskip("twobp_autograd.pipeline.bench")
    from twobp_autograd.pipeline.launch import RanksFailed

    failure = "local ranks failed (rank: exit code) {1: 1}; their errors are printed above"

    def fail(argv: list[str]) -> int:
        raise RanksFailed(failure)

    monkeypatch.setattr(bench, "main", fail)
    assert main(["bench", "pipeline"]) == 1
    assert capsys.readouterr().err == f"error: {failure}\n"


def test_demo_refuses_a_batch_larger_than_the_training_digits(capsys: pytest.CaptureFixture[str]) -> None:
    """Past the training set an epoch would have no step, and the run nothing to report."""
    with pytest.raises(SystemExit):
        demo.main(["--batch-size", "1348", "--no-compare"])
    assert "at most 1347" in capsys.readouterr().err


def test_digits_become_normalised_three_channel_32x32_images() -> None:
    pytest.importorskip("sklearn")
    from twobp_autograd.demo.data import TRAIN_SAMPLES, load_digits_32

    data = load_digits_32(seed=0)
    assert data.train_x.shape[1:] == (3, 32, 32) and data.test_x.shape[1:] == (3, 32, 32)
    assert len(data.train_y) == TRAIN_SAMPLES and len(data.test_y) == 1797 - TRAIN_SAMPLES == 450
    assert set(data.train_y.tolist()) == set(range(10)) == set(data.test_y.tolist())
    assert abs(data.train_x.mean().item()) < 1e-4 and abs(data.train_x.std().item() - 1) < 1e-3
    assert torch.equal(data.train_x[:, 0], data.train_x[:, 2])  # grey repeated on 3 channels


def test_demo_options_default_to_a_two_stage_resnet152_pipeline() -> None:
    args = demo.build_parser().parse_args([])
    assert (args.stages, args.model, args.schedule, args.max_steps) == (2, "resnet152", "gpipe", None)
    quick = demo.build_parser().parse_args(
        ["--stages", "1", "--model", "resnet18", "--schedule", "1f1b-2", "--max-steps", "3"]
    )
    assert (quick.stages, quick.model, quick.schedule, quick.max_steps) == (1, "resnet18", "1f1b-2", 3)


def _run_demo(arguments: list[str]) -> str:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    result = subprocess.run(
        [sys.executable, "-m", "twobp_autograd", "demo", *arguments],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.parametrize("micro_batches", [3, 4])
def test_the_single_process_demo_steps_on_the_whole_batch_loss(micro_batches: int) -> None:
    """A batch of 9 in 4 micro-batches: torch.chunk gave 3 chunks of 3, each loss divided by 4,
    so the step and the reported loss took 3/4 of the batch loss; the pipeline demo's was right."""
    from twobp_autograd.demo.single_process import ModelSide

    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    x, y = torch.randn(9, 5), torch.randint(0, 3, (9,))
    expected = torch.nn.functional.cross_entropy(model(x), y).item()
    side = ModelSide("plain", model, argparse.Namespace(micro_batches=micro_batches, lr=0.0), twobp=False)
    side.step(x, y)
    assert side.losses == [pytest.approx(expected, rel=1e-6)]


def test_the_demo_compares_the_first_steps_gradients() -> None:
    """What the summary prints after the first step: a gradient off by 2x on one side shows as
    1.0 (Adam's first update, lr x sign, would have hidden it from the next loss)."""
    from twobp_autograd.demo.single_process import ModelSide
    from twobp_autograd.demo.summary import summary
    from twobp_autograd.demo.training import gradient_difference

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
    sides = [ModelSide(name, m, argparse.Namespace(micro_batches=2, lr=0.0), twobp=False) for name, m in
             (("2BP", model), ("plain", copy.deepcopy(model)))]  # fmt: skip
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    for side in sides:
        side.step(x, y)
    assert gradient_difference(*sides) == 0.0
    sides[0].model[0].weight.grad.mul_(2)
    assert gradient_difference(*sides) == pytest.approx(1.0)
    sides[0].model[0].weight.grad[0, 0] = float("nan")  # max() passed over a NaN difference: 0.0
    assert gradient_difference(*sides) == float("inf")
    sides[0].model[0].weight.grad.copy_(sides[1].model[0].weight.grad)
    sides[0].model[2].bias.grad = None
    assert gradient_difference(*sides) == float("inf")
    sides[0].first_step_grad_difference, sides[0].accuracies, sides[1].accuracies = 0.5, [0.1], [0.1]
    assert "max relative difference 5.0e-01" in summary(sides, 6)


@pytest.mark.parametrize("stages", [2, 1], ids=["pipeline-2-stages", "single-process"])
def test_demo_runs_a_few_resnet18_steps_and_reports_accuracy(stages: int, tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    pytest.importorskip("torchvision")
    timeline = tmp_path / "timeline.png"
    # A few steps of the small ResNet: not a training result, only that every part runs
    # (spawned ranks, both pipelines, pipelined evaluation, the timeline).
    out = _run_demo(
        ["--stages", str(stages), "--model", "resnet18", "--epochs", "1", "--max-steps", "2", "--batch-size", "16",
         "--timeline", str(timeline)]
    )  # fmt: skip
    assert re.search(r"epoch 1:\s+2BP loss \d+\.\d+ test acc \d+\.\d%.*plain loss \d+\.\d+ test acc \d+\.\d%", out), out
    assert "final test accuracy" in out
    # The first step's gradients from the same weights: fp32 summation order apart (ResNet-18's
    # largest gap about 1e-5 of its parameter's largest element; the first losses it printed
    # came before any gradient, always 0).
    difference = re.search(r"first step's gradients, 2BP against plain: max relative difference (\S+) ", out)
    assert difference and float(difference.group(1)) < 1e-4, out
    if stages == 2:
        assert "2-stage pipeline" in out and "samples/s" in out
        assert timeline.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "modules patched" in out and not timeline.exists()
