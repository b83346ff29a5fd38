"""Pipeline x FSDP2 on a 2 x 2 ("pp", "dp") mesh of four gloo ranks: stages sharded with
``fully_shard`` over their data-parallel pair, patched, and run by PyTorch's own
``torch.distributed.pipelining`` schedules with our ``dw_builder``, and by this package's
runtime with :class:`~twobp_autograd.fsdp.ShardedGradientSync`. Each rank's gathered gradients
must equal the same model trained in one process on every replica's micro-batches.

Everything runs in one spawn of four ranks; the tests read what each rank returned.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble

import twobp_autograd as twobp
from tests.ranks import run_scenario
from tests.utils import Scale, close_to_reference
from twobp_autograd.fsdp import ShardedGradientSync
from twobp_autograd.pipeline import PipelineRuntime, dw_builder
from twobp_autograd.pipeline.schedules import default_num_micro_batches, schedule

PIPELINE, REPLICAS = 2, 2
WORLD = PIPELINE * REPLICAS
BLOCKS, WIDTH, ROWS = 8, 12, 4
MICRO_BATCHES = 4  # PyTorch's schedules


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *(
            nn.Sequential(
                nn.Linear(WIDTH, 2 * WIDTH),
                nn.GELU(),
                Scale(2 * WIDTH),
                nn.Linear(2 * WIDTH, WIDTH),
                nn.LayerNorm(WIDTH),
            )
            for _ in range(BLOCKS)
        )
    )


def replica_data(replica: int, micro_batches: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(10 + replica)
    return torch.randn(micro_batches * ROWS, WIDTH, generator=g), torch.randn(micro_batches * ROWS, WIDTH, generator=g)


def shard(module: nn.Sequential, mesh: DeviceMesh) -> nn.Sequential:
    for block in module:
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


def gathered(modules: list[nn.Module]) -> dict[str, Tensor | None]:
    """The stages' gradients gathered over the data-parallel pair, by their names in the model
    (a slice of a Sequential keeps them)."""
    return {
        name: None if p.grad is None else p.grad.full_tensor()
        for module in modules
        for name, p in module.named_parameters()
    }


# -- PyTorch's schedules with our dw_builder -----------------------------------------------------

TORCH_SCHEDULES = {"interleaved_zb": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble}
TORCH_STAGES = 4  # two per pipeline rank


@dataclass(frozen=True)
class TorchSetting:
    schedule: str
    static_shapes: bool

    @property
    def id(self) -> str:
        return f"{self.schedule}-{'static' if self.static_shapes else 'inferred'}-shapes"


TORCH_SETTINGS = [TorchSetting("interleaved_zb", True), TorchSetting("zbv", False)]


def _torch_schedule(setting: TorchSetting, mesh: DeviceMesh) -> dict:
    pp_rank, replica = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    per_stage = BLOCKS // TORCH_STAGES
    indices = [pp_rank, TORCH_STAGES - 1 - pp_rank] if setting.schedule == "zbv" else [pp_rank, pp_rank + PIPELINE]
    model = make_model()
    modules, stages, builders = {}, [], []
    for index in indices:
        module = twobp.patch(shard(model[index * per_stage : (index + 1) * per_stage], mesh["dp"]))
        builder = dw_builder(module)
        shapes = {}
        if setting.static_shapes:
            shapes = {
                "input_args": torch.empty(ROWS, WIDTH, requires_grad=index > 0),
                "output_args": torch.empty(ROWS, WIDTH, requires_grad=True),
            }
        stages.append(
            PipelineStage(
                module,
                index,
                TORCH_STAGES,
                torch.device("cpu"),
                group=mesh.get_group("pp"),
                dw_builder=builder,
                **shapes,
            )
        )
        modules[index], builders = module, [*builders, builder]
    runner = TORCH_SCHEDULES[setting.schedule](stages, n_microbatches=MICRO_BATCHES, loss_fn=F.mse_loss)
    inputs, targets = replica_data(replica, MICRO_BATCHES)
    runner.step(*((inputs,) if 0 in indices else ()), target=targets if TORCH_STAGES - 1 in indices else None)
    result = {
        "deferred": [b.jobs_built for b in builders],
        "pending": [tuple(b.queue.pending()) for b in builders],
        "grads": gathered([modules[i] for i in sorted(modules)]),
    }
    for builder in builders:
        builder.remove()
    return result


# -- this package's runtime --------------------------------------------------------------------

RUNTIME_SETTINGS = [("gpipe", True), ("1f1b-2", True), ("zb", True), ("1f1b-1", False)]
RUNTIME_IDS = [f"runtime-{name}-{'2bp' if on else 'plain'}" for name, on in RUNTIME_SETTINGS]


def _runtime(name: str, twobp_on: bool, mesh: DeviceMesh) -> dict:
    pp_rank, replica = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    per_stage = BLOCKS // PIPELINE
    stage = shard(make_model()[pp_rank * per_stage : (pp_rank + 1) * per_stage], mesh["dp"])
    m = default_num_micro_batches(name, PIPELINE)
    runtime = PipelineRuntime(
        stage, schedule(name, PIPELINE, m, twobp_on)[pp_rank], num_micro_batches=m, loss_fn=F.mse_loss,
        twobp=twobp_on, group=mesh.get_group("pp"), timeout=30.0, grad_sync=ShardedGradientSync(stage),
    )  # fmt: skip
    inputs, targets = replica_data(replica, m)
    report = runtime.step(inputs if pp_rank == 0 else None, targets if pp_rank == PIPELINE - 1 else None, gather=False)
    return {
        "deferred": [report.deferred_jobs],
        "pending": [tuple(runtime.queue.pending())],
        "grads": gathered([stage]),
        "m": m,
    }


def _capped_with_other_lengths(name: str, mesh: DeviceMesh) -> dict:
    """A capped queue whose replicas hold other amounts of work (16 tokens a sample against 1):
    one replica's early flushes had made some groups' gradients before the step's flushes, so it
    reduced them at the end of the step while the other reduced them in its flushes, in another
    order (silently wrong; a hang under 1f1b-2). Against the same runtime with 2BP off."""
    pp_rank, replica = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    per_stage = BLOCKS // PIPELINE
    m = default_num_micro_batches(name, PIPELINE)
    g = torch.Generator().manual_seed(10 + replica)
    tokens = 16 if replica == 0 else 1
    inputs, targets = (torch.randn(m * ROWS, tokens, WIDTH, generator=g) for _ in range(2))
    grads = {}
    for twobp_on in (False, True):
        stage = shard(make_model()[pp_rank * per_stage : (pp_rank + 1) * per_stage], mesh["dp"])
        runtime = PipelineRuntime(
            stage, schedule(name, PIPELINE, m, twobp_on)[pp_rank], num_micro_batches=m, loss_fn=F.mse_loss,
            twobp=twobp_on, group=mesh.get_group("pp"), timeout=30.0, grad_sync=ShardedGradientSync(stage),
            queue=twobp.WeightGradQueue(max_pending_bytes=3000) if twobp_on else None,
        )  # fmt: skip
        runtime.step(inputs if pp_rank == 0 else None, targets if pp_rank == PIPELINE - 1 else None, gather=False)
        grads[twobp_on] = gathered([stage])
    return {"ours": grads[True], "plain": grads[False]}


CAPPED_SCHEDULES = ["gpipe", "1f1b-2"]


def _scenario(rank: int) -> dict:
    mesh = init_device_mesh("cpu", (PIPELINE, REPLICAS), mesh_dim_names=("pp", "dp"))
    results = {setting.id: _torch_schedule(setting, mesh) for setting in TORCH_SETTINGS}
    for (name, on), setting_id in zip(RUNTIME_SETTINGS, RUNTIME_IDS, strict=True):
        results[setting_id] = _runtime(name, on, mesh)
    for name in CAPPED_SCHEDULES:
        results[f"capped-{name}"] = _capped_with_other_lengths(name, mesh)
    return results


# -- the tests ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_scenario(_scenario, WORLD, str(tmp_path_factory.mktemp("fsdp_pipeline")), deadline=400.0)


def one_process_grads(micro_batches: int) -> dict[str, Tensor]:
    """Every replica's micro-batches through the whole model: mean over all of them."""
    model = make_model()
    for replica in range(REPLICAS):
        inputs, targets = replica_data(replica, micro_batches)
        for x, y in zip(inputs.chunk(micro_batches), targets.chunk(micro_batches), strict=True):
            (F.mse_loss(model(x), y) / (micro_batches * REPLICAS)).backward()
    return {name: p.grad for name, p in model.named_parameters()}


ALL_IDS = [s.id for s in TORCH_SETTINGS] + RUNTIME_IDS


@pytest.mark.parametrize("setting", ALL_IDS)
def test_pipelined_sharded_gradients_equal_one_process(ranks: list[dict], setting: str) -> None:
    micro_batches = ranks[0][setting].get("m", MICRO_BATCHES)
    reference = one_process_grads(micro_batches)
    for rank, results in enumerate(ranks):
        result = results[setting]
        if not setting.endswith("-plain"):
            assert all(d > 0 for d in result["deferred"]), f"rank {rank}: nothing was deferred"
        assert all(p == (0, 0) for p in result["pending"]), f"rank {rank}: work left queued {result['pending']}"
        for name, grad in result["grads"].items():
            assert grad is not None, f"rank {rank} {name}: no gradient"
            expected = reference[name]
            assert close_to_reference(grad, expected), (
                f"rank {rank} {name}: largest difference {(grad - expected).abs().max().item():.3g}"
            )


@pytest.mark.parametrize("name", CAPPED_SCHEDULES)
def test_a_capped_queue_whose_replicas_hold_other_amounts_of_work_equals_2bp_off(ranks: list[dict], name: str) -> None:
    for rank, results in enumerate(ranks):
        result = results[f"capped-{name}"]
        for param, grad in result["ours"].items():
            expected = result["plain"][param]
            assert grad is not None and expected is not None, f"rank {rank} {param}: no gradient"
            assert close_to_reference(grad, expected), (
                f"rank {rank} {param}: largest difference {(grad - expected).abs().max().item():.3g}"
            )
