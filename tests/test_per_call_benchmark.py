"""benchmarks/per_call.py runs end to end with tiny settings and writes its JSON (a smoke
test: no timing is asserted, the machine's load decides those)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture
def per_call(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import per_call

    return per_call


def test_tiny_per_call_run_writes_every_layer_and_stage(per_call, tmp_path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("torchvision")
    out = tmp_path / "per_call.json"
    argv = [
        "--rounds", "2", "--calls", "2", "--warmup", "1", "--stage-rounds", "2", "--stage-blocks", "1",
        "--micro-batch", "1", "--width", "16", "--depth", "2", "--seq-len", "4", "--image-size", "32",
        "--kernel-rounds", "2", "--out", str(out),
    ]  # fmt: skip
    assert per_call.main(argv) == 0
    document = json.loads(out.read_text())
    assert len(document["layers"]) == 8 and set(document["stages"]) == set(per_call.STAGE_MODELS)
    for row in document["layers"].values():
        assert all(math.isfinite(row[k]) and row[k] > 0 for k in ("forward_ratio", "step_ratio"))
    for row in document["stages"].values():
        ratios = ("F_on_off", "split_over_B", "pytorch_split_over_B", "split_over_pytorch_split")
        ratios += ("kernels_split_over_B", "W_kernels_after_I_over_warm", "W_kernels_cold_over_warm")
        assert all(math.isfinite(row[k]) and row[k] > 0 for k in ratios)
        assert 0 < row["B_kernels_ms"] and 0 < row["split_kernels_ms"]
