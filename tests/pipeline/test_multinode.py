"""The multi-machine path on one machine: two torchrun agents, one per "node", meet through a
c10d rendezvous over TCP and run across them, as two hosts would: the pipeline bench (an MLP,
and a Hugging Face Llama whose tied embeddings, on the first and last rank, are summed across
the two "nodes" after each step), and the pipeline demo with the README's command."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from twobp_autograd.pipeline.launch import free_port

DEADLINE = 120.0
TINY = ["--width", "16", "--depth", "2", "--seq-len", "4", "--batch-size", "4", "--balance", "params", "--threads", "1"]


def _run_two_nodes(program: list[str], tmp_path: Path) -> str:
    """``torchrun --nnodes 2 ... -m <program>`` as two agents; their combined output."""
    port = free_port()
    logs = [tmp_path / f"node{rank}.log" for rank in range(2)]
    agents = [_agent(program, rank, port, logs[rank]) for rank in range(2)]
    end = time.monotonic() + DEADLINE
    codes = []
    try:
        for agent in agents:
            codes.append(agent.wait(timeout=max(1.0, end - time.monotonic())))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
    outputs = "\n".join(f"--- node {rank} ---\n{log.read_text()}" for rank, log in enumerate(logs))
    assert codes == [0, 0], f"exit codes {codes} (a missing one ran past {DEADLINE:g} s)\n{outputs}"
    return outputs


def _agent(program: list[str], node_rank: int, port: int, log: Path) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node_rank),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "twobp-multinode",
        "--max-restarts", "0", "-m", *program,
    ]  # fmt: skip
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as output:
        return subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=environment)


#: ~15 s (mlp) and ~25 s (llama) on two loaded cores, nearly all of it two torchrun agents and
#: two ranks starting and importing torch (and transformers): the step itself is tiny.
@pytest.mark.parametrize("model", ["mlp", "llama"])
def test_two_nodes_run_the_pipeline_bench(model: str, tmp_path: Path) -> None:
    if model == "llama":
        pytest.importorskip("transformers")
    json_path = tmp_path / "bench.json"
    program = [
        "twobp_autograd.pipeline.bench",
        "--model", model, "--schedule", "1f1b-1", "--twobp", "both", "--steps", "1", "--warmup", "0",
        "--timeout", "60", "--no-progress", "--json", str(json_path), *TINY,
    ]  # fmt: skip
    outputs = _run_two_nodes(program, tmp_path)

    document = json.loads(json_path.read_text())  # written by global rank 0, on either node
    assert document["world_size"] == 2
    steps = document["steps"]
    assert all(jobs > 0 for jobs in steps[f"{model}-1f1b-1-2bp-on"][0]["deferred_jobs"]), "2BP deferred nothing"
    assert all(jobs == 0 for jobs in steps[f"{model}-1f1b-1-2bp-off"][0]["deferred_jobs"])
    assert "samples/s" in outputs
    assert all(math.isfinite(row["loss"]) for row in document["summary"])


def test_two_nodes_run_the_demo(tmp_path: Path) -> None:
    """The README's demo command under torchrun: one pipeline stage per "node" (ResNet-18 and
    two steps to keep it short), 2BP against the same pipeline without it, the same first gradients."""
    pytest.importorskip("sklearn")
    program = ["twobp_autograd", "demo", "--model", "resnet18", "--epochs", "1", "--max-steps", "2", "--timeline", ""]
    outputs = _run_two_nodes(program, tmp_path)
    assert "as a 2-stage pipeline" in outputs
    agreement = re.search(r"first step's gradients, 2BP against plain: max relative difference (\S+) ", outputs)
    assert agreement and float(agreement.group(1)) < 1e-4, outputs
    assert "2BP   final test accuracy" in outputs and "plain final test accuracy" in outputs
