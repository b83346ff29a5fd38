"""The command line and the demo's data, without training anything (the demo itself is run
by hand: it takes minutes)."""

from __future__ import annotations

import sys

import pytest
import torch

from twobp_autograd.__main__ import build_parser, main


def test_demo_options_parse() -> None:
    args = build_parser().parse_args(
        ["demo", "--epochs", "3", "--micro-batches", "2", "--batch-size", "8", "--seed", "1", "--no-compare"]
    )
    assert (args.command, args.epochs, args.micro_batches, args.batch_size, args.seed) == ("demo", 3, 2, 8, 1)
    assert args.no_compare and args.device == "cpu"


def test_demo_rejects_unknown_device() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--device", "tpu"])


def test_bench_pipeline_forwards_its_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = pytest.importorskip("twobp_autograd.pipeline.bench")
    received: list[list[str]] = []
    monkeypatch.setattr(bench, "main", lambda argv: received.append(list(argv)) or 0)
    assert main(["bench", "pipeline", "--steps", "2", "--schedule", "gpipe"]) == 0
    assert received == [["--steps", "2", "--schedule", "gpipe"]]


def test_bench_pipeline_missing_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "twobp_autograd.pipeline.bench", None)  # import fails as if absent
    assert main(["bench", "pipeline"]) == 2
    assert "pipeline benchmark" in capsys.readouterr().err


def test_digits_become_normalised_three_channel_32x32_images() -> None:
    pytest.importorskip("sklearn")
    from twobp_autograd.demo import load_digits_32

    data = load_digits_32(seed=0)
    assert data.train_x.shape[1:] == (3, 32, 32) and data.test_x.shape[1:] == (3, 32, 32)
    assert len(data.train_y) + len(data.test_y) == 1797 and len(data.test_y) == 450
    assert set(data.train_y.tolist()) == set(range(10)) == set(data.test_y.tolist())
    assert abs(data.train_x.mean().item()) < 1e-4 and abs(data.train_x.std().item() - 1) < 1e-3
    assert torch.equal(data.train_x[:, 0], data.train_x[:, 2])  # grey repeated on 3 channels
