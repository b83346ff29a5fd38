"""twobp_autograd.pipeline.adapter: PyTorch's own pipeline schedules run 2BP's deferred weight
gradients through ``PipelineStage(dw_builder=...)``; two gloo ranks on this machine, four
stages (two per rank), checked against the same model trained in one process."""

from __future__ import annotations

import copy
import datetime
import gc
import os
import socket
import threading
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

import twobp_autograd as twobp
from tests.utils import TOLERANCES
from twobp_autograd.pipeline import dw_builder
from twobp_autograd.pipeline.adapter import StageWeightGrads, WeightGradRunner

WORLD = 2
STAGES = 4
BLOCKS = 8
WIDTH = 16
ROWS = 4  # per micro-batch
MICRO_BATCHES = 4

SCHEDULES = {
    "interleaved_zb": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,  # V placement; overlaps one micro-batch's forward with another's backward
    # Not split: every backward is full, so each runner is called as soon as it is built.
    "interleaved_1f1b": ScheduleInterleaved1F1B,
}


@dataclass(frozen=True)
class Setting:
    schedule: str
    static_shapes: bool  # False: PyTorch infers shapes with a real forward and an input-only backward

    @property
    def id(self) -> str:
        return f"{self.schedule}-{'static' if self.static_shapes else 'inferred'}-shapes"


SETTINGS = [
    Setting("interleaved_zb", static_shapes=True),
    Setting("interleaved_zb", static_shapes=False),
    Setting("zbv", static_shapes=True),
    Setting("zbv", static_shapes=False),
    Setting("interleaved_1f1b", static_shapes=False),
    Setting("dualpipev", static_shapes=False),
]


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *(
            nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH), nn.LayerNorm(WIDTH))
            for _ in range(BLOCKS)
        )
    )


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(MICRO_BATCHES * ROWS, WIDTH, generator=generator)
    targets = torch.randn(MICRO_BATCHES * ROWS, WIDTH, generator=generator)
    return inputs, targets


def stage_module(model: nn.Sequential, stage: int) -> nn.Sequential:
    per_stage = BLOCKS // STAGES
    return model[stage * per_stage : (stage + 1) * per_stage]


def stages_of_rank(schedule: str, rank: int) -> list[int]:
    if schedule in ("zbv", "dualpipev"):  # V shape: rank 0 holds the first and the last stage
        return [rank, STAGES - 1 - rank]
    return [rank, rank + WORLD]


def deferred_params(module: nn.Module) -> list[nn.Parameter]:
    return [p for m in module.modules() if isinstance(m, nn.Linear) for p in m.parameters()]


class RecordingBuilder:
    """Wraps a stage's builder to record what each runner holds and that backward-p1 left the
    deferred weights' ``.grad`` untouched until the stage's first W step."""

    def __init__(self, builder: StageWeightGrads) -> None:
        self.builder = builder
        self.jobs_per_runner: list[int] = []
        self.untouched_before_first_w: bool | None = None

    def __call__(self) -> Any:
        runner: WeightGradRunner = self.builder()
        assert runner.jobs is not None
        self.jobs_per_runner.append(len(runner.jobs))

        def run() -> None:
            module = self.builder.module
            assert module is not None
            if self.untouched_before_first_w is None:
                self.untouched_before_first_w = all(p.grad is None for p in deferred_params(module))
            runner()

        return run


def run_setting(setting: Setting, rank: int) -> dict[str, Any]:
    model = make_model()
    inputs, targets = make_data()
    indices = stages_of_rank(setting.schedule, rank)
    stages, recorders, modules = [], [], {}
    for index in indices:
        module = twobp.patch(stage_module(model, index))
        recorder = RecordingBuilder(dw_builder(module))
        shapes = {}
        if setting.static_shapes:  # requires_grad as at run time: received activations and outputs
            shapes = {
                "input_args": torch.empty(ROWS, WIDTH, requires_grad=index > 0),
                "output_args": torch.empty(ROWS, WIDTH, requires_grad=True),
            }
        stages.append(PipelineStage(module, index, STAGES, torch.device("cpu"), dw_builder=recorder, **shapes))
        recorders.append(recorder)
        modules[index] = module
    schedule = SCHEDULES[setting.schedule](stages, n_microbatches=MICRO_BATCHES, loss_fn=F.mse_loss)
    args = (inputs,) if 0 in indices else ()
    target = targets if STAGES - 1 in indices else None
    schedule.step(*args, target=target)
    result = {
        "grads": {
            f"{index}.{name}": None if p.grad is None else p.grad.clone()
            for index, module in modules.items()
            for name, p in module.named_parameters()
        },
        "pending": {index: tuple(r.builder.queue.pending()) for index, r in zip(indices, recorders, strict=True)},
        "default_pending": tuple(twobp.pending()),
        "jobs_per_runner": {index: r.jobs_per_runner for index, r in zip(indices, recorders, strict=True)},
        "untouched_before_first_w": {
            index: r.untouched_before_first_w for index, r in zip(indices, recorders, strict=True)
        },
    }
    for recorder in recorders:
        recorder.builder.remove()
    return result


def run_without_dw_builder(schedule_name: str, rank: int) -> dict[str, Any]:
    """Patched stages built as for unpatched ones (no ``dw_builder``): the schedule never runs
    their queued work, and it scales .grad by 1/n at the end of its step."""
    model = make_model()
    inputs, targets = make_data()
    indices = stages_of_rank(schedule_name, rank)
    modules = {index: twobp.patch(stage_module(model, index)) for index in indices}
    stages = [PipelineStage(modules[index], index, STAGES, torch.device("cpu")) for index in indices]
    schedule = SCHEDULES[schedule_name](stages, n_microbatches=MICRO_BATCHES, loss_fn=F.mse_loss)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        schedule.step(*((inputs,) if 0 in indices else ()), target=targets if STAGES - 1 in indices else None)
    return {
        "grads": {
            f"{i}.{n}": None if p.grad is None else p.grad.clone()
            for i, m in modules.items()
            for n, p in m.named_parameters()
        },
        "default_pending": tuple(twobp.pending()),
        "warned": any("dw_builder" in str(w.message) for w in caught),
    }


#: One stage per rank: these schedules end a step through ``perform_reduce_grad``.
SINGLE_STAGE_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def run_single_stage_without_dw_builder(schedule_name: str, rank: int) -> dict[str, Any]:
    model = make_model()
    inputs, targets = make_data()
    per_rank = BLOCKS // WORLD
    module = twobp.patch(model[rank * per_rank : (rank + 1) * per_rank])  # keeps the model's names
    stage = PipelineStage(module, rank, WORLD, torch.device("cpu"))
    schedule = SINGLE_STAGE_SCHEDULES[schedule_name](stage, n_microbatches=MICRO_BATCHES, loss_fn=F.mse_loss)
    schedule.step(*((inputs,) if rank == 0 else ()), target=targets if rank == WORLD - 1 else None)
    return {name: None if p.grad is None else p.grad.clone() for name, p in module.named_parameters()}


def worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        results = {setting.id: run_setting(setting, rank) for setting in SETTINGS}
        results.update({f"no-dw-builder-{name}": run_without_dw_builder(name, rank) for name in SCHEDULES})
        results.update(
            {f"single-stage-{name}": run_single_stage_without_dw_builder(name, rank) for name in SINGLE_STAGE_SCHEDULES}
        )
        dist.barrier()
    finally:
        dist.destroy_process_group()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every setting run once on two ranks (one spawn for all: starting ranks dominates)."""
    out_dir = tmp_path_factory.mktemp("adapter")
    mp.spawn(worker, args=(free_port(), str(out_dir)), nprocs=WORLD, join=True)
    per_rank = [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(WORLD)]
    merged: dict[str, dict[str, Any]] = {}
    for setting in SETTINGS:
        parts = [results[setting.id] for results in per_rank]
        merged[setting.id] = {
            key: {k: v for part in parts for k, v in part[key].items()} for key in parts[0] if key != "default_pending"
        }
        merged[setting.id]["default_pending"] = [part["default_pending"] for part in parts]
    for name in SCHEDULES:
        parts = [results[f"no-dw-builder-{name}"] for results in per_rank]
        merged[f"no-dw-builder-{name}"] = {
            "grads": {k: v for part in parts for k, v in part["grads"].items()},
            "default_pending": [part["default_pending"] for part in parts],
            "warned": [part["warned"] for part in parts],
        }
    for name in SINGLE_STAGE_SCHEDULES:
        merged[f"single-stage-{name}"] = {
            k: v for results in per_rank for k, v in results[f"single-stage-{name}"].items()
        }
    return merged


@pytest.fixture(scope="module")
def reference_grads() -> dict[str, torch.Tensor | None]:
    """The same step in one process on plain autograd: mean of the micro-batch losses."""
    model = make_model()
    inputs, targets = make_data()
    for x, y in zip(inputs.chunk(MICRO_BATCHES), targets.chunk(MICRO_BATCHES), strict=True):
        (F.mse_loss(model(x), y) / MICRO_BATCHES).backward()
    return {f"{s}.{name}": p.grad for s in range(STAGES) for name, p in stage_module(model, s).named_parameters()}


@pytest.mark.parametrize("setting", SETTINGS, ids=[s.id for s in SETTINGS])
def test_step_gradients_match_one_process(setting: Setting, pipelined: dict, reference_grads: dict) -> None:
    grads = pipelined[setting.id]["grads"]
    assert grads.keys() == reference_grads.keys()
    rtol, atol = TOLERANCES[torch.float32]
    for name, expected in reference_grads.items():
        assert grads[name] is not None, f"{name}: no gradient after the step"
        torch.testing.assert_close(grads[name], expected, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("setting", SETTINGS, ids=[s.id for s in SETTINGS])
def test_each_runner_holds_one_micro_batch_of_deferred_work(setting: Setting, pipelined: dict) -> None:
    jobs = pipelined[setting.id]["jobs_per_runner"]
    assert sorted(jobs) == list(range(STAGES))
    for stage, counts in jobs.items():
        assert len(counts) == MICRO_BATCHES, f"stage {stage}: {len(counts)} runners for {MICRO_BATCHES} micro-batches"
        # Equal counts: shape inference's input-only backward queued nothing into the first one.
        assert counts[0] > 0 and len(set(counts)) == 1, f"stage {stage}: jobs per runner {counts}"


@pytest.mark.parametrize("setting", SETTINGS, ids=[s.id for s in SETTINGS])
def test_backward_input_leaves_weight_grads_to_the_runner(setting: Setting, pipelined: dict) -> None:
    untouched = pipelined[setting.id]["untouched_before_first_w"]
    assert all(untouched.values()), untouched


@pytest.mark.parametrize("setting", SETTINGS, ids=[s.id for s in SETTINGS])
def test_nothing_stays_queued_after_the_step(setting: Setting, pipelined: dict) -> None:
    assert all(p == (0, 0) for p in pipelined[setting.id]["pending"].values()), pipelined[setting.id]["pending"]
    leaked = pipelined[setting.id]["default_pending"]
    assert all(p == (0, 0) for p in leaked), "work leaked into the default queue"


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_without_dw_builder_the_queued_work_is_flushed_before_the_schedule_scales(
    schedule: str, pipelined: dict, reference_grads: dict
) -> None:
    """The schedule divides .grad by the number of micro-batches at the end of its step: work
    still queued then (no dw_builder runs it) was left out and came n times too large."""
    result = pipelined[f"no-dw-builder-{schedule}"]
    rtol, atol = TOLERANCES[torch.float32]
    for name, expected in reference_grads.items():
        assert result["grads"][name] is not None, f"{name}: no gradient after the step"
        torch.testing.assert_close(result["grads"][name], expected, rtol=rtol, atol=atol, msg=name)
    assert all(p == (0, 0) for p in result["default_pending"])


@pytest.mark.parametrize("schedule", list(SINGLE_STAGE_SCHEDULES))
def test_single_stage_schedules_without_dw_builder_flush_before_scaling(schedule: str, pipelined: dict) -> None:
    model = make_model()
    inputs, targets = make_data()
    for x, y in zip(inputs.chunk(MICRO_BATCHES), targets.chunk(MICRO_BATCHES), strict=True):
        (F.mse_loss(model(x), y) / MICRO_BATCHES).backward()
    grads = pipelined[f"single-stage-{schedule}"]
    rtol, atol = TOLERANCES[torch.float32]
    for name, p in model.named_parameters():
        assert grads[name] is not None, f"{name}: no gradient after the step"
        torch.testing.assert_close(grads[name], p.grad, rtol=rtol, atol=atol, msg=name)


def test_without_dw_builder_one_warning_names_it(pipelined: dict) -> None:
    assert any(any(pipelined[f"no-dw-builder-{schedule}"]["warned"]) for schedule in SCHEDULES)


# -- one process: the builder and its hooks ---------------------------------------------------


@pytest.fixture
def outside() -> Any:
    """The queue that forwards outside any stage feed during the test (isolated from others)."""
    with twobp.use_queue(twobp.WeightGradQueue()) as queue:
        yield queue
    queue.clear()  # what the tests queued there on purpose


@pytest.fixture
def stage() -> Any:
    """A patched Linear with its builder; the builder is removed afterwards."""
    module = twobp.patch(nn.Linear(3, 3))
    builder = dw_builder(module)
    yield module, builder
    builder.queue.clear()
    builder.remove()


def test_stage_forward_feeds_its_own_queue_only(stage: Any, outside: twobp.WeightGradQueue) -> None:
    first, first_builder = stage
    second = twobp.patch(nn.Linear(3, 3))
    second_builder = dw_builder(second)
    x = torch.randn(2, 3)
    first(x).sum().backward()
    second(x).sum().backward()
    assert (len(first_builder.queue), len(second_builder.queue), len(outside)) == (1, 1, 0)
    assert first.weight.grad is None
    first_builder()()
    assert first.weight.grad is not None and second.weight.grad is None
    second_builder.queue.clear()
    second_builder.remove()


def test_queue_is_left_when_forward_raises(stage: Any, outside: twobp.WeightGradQueue) -> None:
    module, builder = stage
    with pytest.raises(RuntimeError):
        module(torch.randn(2, 4))  # wrong width
    twobp.patch(nn.Linear(3, 3))(torch.randn(2, 3)).sum().backward()
    assert (len(builder.queue), len(outside)) == (0, 1), "the failed forward left the stage's queue in use"


def test_input_only_grad_queues_nothing(outside: twobp.WeightGradQueue) -> None:
    module = twobp.patch(nn.Sequential(nn.Linear(3, 4), nn.GELU(), nn.Linear(4, 2)))
    builder = dw_builder(module)
    x = torch.randn(5, 3, requires_grad=True)
    (grad,) = torch.autograd.grad(module(x), x, torch.ones(5, 2))
    assert grad.shape == x.shape
    assert (len(builder.queue), len(outside)) == (0, 0)
    assert all(p.grad is None for p in module.parameters())
    module(x).sum().backward()  # the same stage does queue for a backward that reaches its weights
    assert len(builder.queue) == 2
    builder.queue.clear()
    builder.remove()


def test_runner_runs_once(stage: Any) -> None:
    module, builder = stage
    module(torch.randn(2, 3)).sum().backward()
    runner = builder()
    runner()
    with pytest.raises(RuntimeError, match="already ran"):
        runner()


def test_one_builder_per_module(stage: Any) -> None:
    module, builder = stage
    assert dw_builder(module) is builder
    with pytest.raises(ValueError, match="another queue"):
        dw_builder(module, twobp.WeightGradQueue())
    builder.remove()
    again = dw_builder(module)
    assert again is not builder
    again.remove()


def test_a_copy_of_the_stage_module_is_not_the_stage(stage: Any, outside: twobp.WeightGradQueue) -> None:
    module, builder = stage
    duplicate = copy.deepcopy(module)
    duplicate(torch.randn(2, 3)).sum().backward()
    assert (len(builder.queue), len(outside)) == (0, 1)
    module(torch.randn(2, 3)).sum().backward()
    assert (len(builder.queue), len(outside)) == (1, 1)


def test_builder_does_not_keep_the_module_alive() -> None:
    module = twobp.patch(nn.Linear(3, 3))
    builder = dw_builder(module)
    alive = weakref.ref(module)
    del module
    gc.collect()
    assert alive() is None and builder.module is None


class _WaitsForTheOtherThread(nn.Module):
    """A stage whose forward on thread "first" is still running when thread "second" enters,
    and whose "second" forward stays inside until "first" has left."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.first_inside, self.second_inside, self.first_left = (threading.Event() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if threading.current_thread().name == "first":
            self.first_inside.set()
            self.second_inside.wait(10)
        else:
            self.second_inside.set()
            self.first_left.wait(10)
        return self.linear(x)


def test_two_threads_in_a_stage_forward_at_once_each_leave_their_own_queue_block():
    """The builder's hooks enter the stage's queue around each forward: kept in one list for all
    threads, one thread's exit left the other's block (a ValueError from the queue's context
    variable, or the wrong queue popped)."""
    stage = twobp.patch(_WaitsForTheOtherThread())
    builder = dw_builder(stage)
    errors: dict[str, BaseException] = {}

    def run(name: str) -> None:
        try:
            stage(torch.randn(2, 3)).sum().backward()
        except BaseException as error:  # noqa: BLE001 - reported below
            errors[name] = error
        finally:
            if name == "first":
                stage.first_left.set()

    threads = [threading.Thread(target=run, args=(name,), name=name) for name in ("first", "second")]
    threads[0].start()
    assert stage.first_inside.wait(10)
    threads[1].start()
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    assert len(builder.queue) == 2
    builder.queue.clear()
