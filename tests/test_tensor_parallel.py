"""Tensor parallelism (``torch.distributed.tensor.parallel``) on patched models, two gloo ranks
(and FSDP2 over it on a 2 x 2 mesh, torchtitan's layout, four ranks):
the layers compute with DTensor weights, inputs and output gradients, so the deferred kernels
and the flush's hand-over run on DTensors. Each setting's gradients (values and placements)
after the flush, and the parameters after an optimizer step, against the same plan on the
unpatched model.

The model is a Llama-style block stack as torchtitan parallelizes it: a row-wise embedding,
column-wise q/k/v and feed-forward inputs, row-wise outputs, the norms sequence-parallel (or
replicated), a column-wise head. All settings of one world size run in one spawn.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

import twobp_autograd as twobp
from tests.ranks import run_scenario
from tests.utils import TokenStack, close_to_reference
from twobp_autograd.data_parallel import GradientSynchroniser

WORLD = 2
MICRO_BATCHES = 3
VOCAB, WIDTH, HEADS, HIDDEN = 16, 32, 4, 640  # the feed-forward weights pass the flush's copy size


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        batch, length, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds HEADS / WORLD of them.
        q, k, v = (proj(x).view(batch, length, -1, WIDTH // HEADS).transpose(1, 2) for proj in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(batch, length, -1))


class Block(nn.Module):
    def __init__(self, norm: type[nn.Module]) -> None:
        super().__init__()
        self.attention_norm, self.attention = norm(WIDTH), Attention()
        self.ffn_norm = norm(WIDTH)
        self.w1, self.w3 = nn.Linear(WIDTH, HIDDEN), nn.Linear(WIDTH, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.attention_norm(x))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Net(TokenStack):
    def __init__(self, norm: type[nn.Module]) -> None:
        blocks = [Block(norm) for _ in range(2)]
        super().__init__(nn.Embedding(VOCAB, WIDTH), blocks, norm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False))


@dataclass(frozen=True)
class Setting:
    norm: str = "LayerNorm"  # or "RMSNorm"
    sequence_parallel: bool = True
    order: str = "patch_then_parallelize"  # or "parallelize_then_patch"
    strategy: str = "auto"  # the queue's flush strategy
    capped: bool = False  # max_pending_bytes=0: every job flushed inside its backward
    embedding: str = "rowwise"  # or "colwise" (the embedding dimension sharded)
    loss_parallel: bool = False  # cross-entropy on vocabulary-sharded logits
    fsdp: bool = False  # fully_shard over "dp" of the model tensor-parallel over "tp" (2 x 2 ranks)
    checkpoint: bool = False  # each block in a non-reentrant checkpoint_wrapper, after parallelizing

    @property
    def id(self) -> str:
        parts = ["fsdp2"] * self.fsdp
        parts += [self.norm, "sequence_parallel" if self.sequence_parallel else "norms_replicated", self.order]
        parts += (
            [self.strategy] * (self.strategy != "auto") + ["capped"] * self.capped + ["checkpoint"] * self.checkpoint
        )
        return "-".join(
            parts
            + [f"embedding_{self.embedding}"] * (self.embedding != "rowwise")
            + ["loss_parallel"] * self.loss_parallel
        )


SETTINGS = [
    Setting(),
    Setting(norm="RMSNorm"),
    Setting(sequence_parallel=False),
    Setting(norm="RMSNorm", sequence_parallel=False, order="parallelize_then_patch"),
    Setting(order="parallelize_then_patch", strategy="concat"),
    Setting(norm="RMSNorm", strategy="loop"),
    Setting(norm="RMSNorm", strategy="concat", embedding="colwise"),
    Setting(capped=True),
    Setting(norm="RMSNorm", loss_parallel=True),
    Setting(norm="RMSNorm", checkpoint=True),
    Setting(fsdp=True),
    Setting(fsdp=True, norm="RMSNorm", order="parallelize_then_patch"),
    Setting(fsdp=True, sequence_parallel=False, capped=True),
    Setting(fsdp=True, checkpoint=True, order="parallelize_then_patch"),
]


def _plan(setting: Setting) -> tuple[dict[str, ParallelStyle], dict[str, ParallelStyle]]:
    """(the root's plan, each block's plan), as torchtitan writes them."""
    layout = Shard(1) if setting.sequence_parallel else Replicate()
    embed_style = RowwiseParallel if setting.embedding == "rowwise" else ColwiseParallel
    root: dict[str, ParallelStyle] = {
        "embed": embed_style(input_layouts=Replicate(), output_layouts=layout),
        # Under loss_parallel the logits stay sharded over the vocabulary.
        "head": ColwiseParallel(input_layouts=layout, output_layouts=Shard(-1), use_local_output=False)
        if setting.loss_parallel
        else ColwiseParallel(input_layouts=layout, output_layouts=Replicate()),
    }
    block: dict[str, ParallelStyle] = {
        "attention.q": ColwiseParallel(input_layouts=layout),
        "attention.k": ColwiseParallel(input_layouts=layout),
        "attention.v": ColwiseParallel(input_layouts=layout),
        "attention.o": RowwiseParallel(output_layouts=layout),
        "w1": ColwiseParallel(input_layouts=layout),
        "w3": ColwiseParallel(input_layouts=layout),
        "w2": RowwiseParallel(output_layouts=layout),
    }
    if setting.sequence_parallel:
        root["norm"] = SequenceParallel()
        block.update(attention_norm=SequenceParallel(), ffn_norm=SequenceParallel())
    return root, block


def _build(setting: Setting, patched: bool) -> nn.Module:
    torch.manual_seed(0)
    model = Net(getattr(nn, setting.norm))
    if patched and setting.order == "patch_then_parallelize":
        twobp.patch(model)
    mesh = init_device_mesh("cpu", (WORLD, WORLD) if setting.fsdp else (1, WORLD), mesh_dim_names=("dp", "tp"))
    root_plan, block_plan = _plan(setting)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], copy.deepcopy(block_plan))
    parallelize_module(model, mesh["tp"], root_plan)
    if setting.checkpoint:  # torchtitan's order: tensor parallel, activation checkpointing, FSDP2
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    if setting.fsdp:
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    if patched and setting.order == "parallelize_then_patch":
        report = twobp.patch(model, report=True)
        block = "blocks.0._checkpoint_wrapped_module" if setting.checkpoint else "blocks.0"
        assert {f"{block}.w1", f"{block}.attention_norm", "embed", "head"} <= set(report.patched), report
    return model


def _step(model: nn.Module, setting: Setting, queue: twobp.WeightGradQueue) -> None:
    with twobp.use_queue(queue), loss_parallel() if setting.loss_parallel else contextlib.nullcontext():
        for micro in range(MICRO_BATCHES):
            # Every rank of a tensor-parallel group sees the same batch; data-parallel ranks their own.
            g = torch.Generator().manual_seed(100 * (dist.get_rank() // WORLD) + micro)
            tokens = torch.randint(0, VOCAB, (2, 6), generator=g)
            targets = torch.randint(0, VOCAB, (2 * 6,), generator=g)
            loss = F.cross_entropy(model(tokens).flatten(0, 1), targets) / MICRO_BATCHES
            loss.backward()


def _grads(model: nn.Module) -> dict[str, tuple[object, Tensor] | None]:
    """Every parameter's gradient: (placements, the full tensor), or None."""
    found: dict[str, tuple[object, Tensor] | None] = {}
    for name, p in model.named_parameters():
        grad = p.grad
        if grad is None:
            found[name] = None
        elif isinstance(grad, DTensor):
            found[name] = (tuple(grad.placements), grad.full_tensor())
        else:
            found[name] = (None, grad.clone())
    return found


def _params(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.full_tensor() if isinstance(p, DTensor) else p.detach().clone() for n, p in model.named_parameters()}


def _run_setting(setting: Setting, rank: int) -> dict:
    ours, plain = _build(setting, patched=True), _build(setting, patched=False)
    queue = twobp.WeightGradQueue(setting.strategy, max_pending_bytes=0 if setting.capped else None)  # type: ignore[arg-type]
    _step(plain, setting, twobp.WeightGradQueue())
    _step(ours, setting, queue)
    queued = twobp.pending(queue).jobs
    twobp.flush_weight_grads(queue)
    result: dict = {"queued": queued, "ours": _grads(ours), "plain": _grads(plain)}
    for model in (ours, plain):  # the step takes DTensor gradients as they were delivered
        torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9).step()
    result["ours_params"], result["plain_params"] = _params(ours), _params(plain)
    return result


def _synchroniser_refused() -> str:
    try:
        GradientSynchroniser(_build(Setting(), patched=True))
    except TypeError as error:
        return str(error)
    return "constructed"


def _scenario(fsdp: bool, rank: int) -> dict:
    results: dict = {} if fsdp else {"synchroniser": _synchroniser_refused()}
    for setting in (s for s in SETTINGS if s.fsdp == fsdp):
        try:
            results[setting.id] = _run_setting(setting, rank)
        except Exception as error:  # noqa: BLE001 - one setting's failure is that test's report
            results[setting.id] = {"error": f"{type(error).__name__}: {error}"}
    return results


def _spawn(tmp_path_factory: pytest.TempPathFactory, fsdp: bool) -> list[dict]:
    world = WORLD * WORLD if fsdp else WORLD
    directory = str(tmp_path_factory.mktemp("tensor_parallel"))
    return run_scenario(functools.partial(_scenario, fsdp), world, directory, deadline=240.0)


@pytest.fixture(scope="module")
def tensor_parallel_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _spawn(tmp_path_factory, fsdp=False)


@pytest.fixture(scope="module")
def fsdp_tensor_parallel_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _spawn(tmp_path_factory, fsdp=True)


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.id)
def test_tensor_parallel_gradients_and_step_equal_the_unpatched_plan(
    request: pytest.FixtureRequest, setting: Setting
) -> None:
    rank_results = request.getfixturevalue(
        "fsdp_tensor_parallel_results" if setting.fsdp else "tensor_parallel_results"
    )
    for rank, results in enumerate(rank_results):
        result = results[setting.id]
        assert "error" not in result, f"rank {rank}: {result['error']}"
        assert setting.capped or result["queued"] > 0, "nothing was deferred"
        for name, want in result["plain"].items():
            got = result["ours"][name]
            assert (got is None) == (want is None), f"rank {rank} {name}: .grad {got} where plain has {want}"
            if want is None:
                continue
            assert got[0] == want[0], f"rank {rank} {name}: placements {got[0]}, plain's {want[0]}"
            assert close_to_reference(got[1], want[1]), f"rank {rank} {name}: {(got[1] - want[1]).abs().max()}"
        for name, want in result["plain_params"].items():
            assert close_to_reference(result["ours_params"][name], want), f"rank {rank} {name} after the step"


def test_gradient_synchroniser_refuses_tensor_parallel_parameters(tensor_parallel_results: list[dict]) -> None:
    """Their gradients need not be laid out as the parameters: FSDP2 over "dp" is the way."""
    for results in tensor_parallel_results:
        assert results["synchroniser"].startswith("twobp:") and "fully_shard" in results["synchroniser"]


# -- pipeline x tensor parallel: this package's runtime over a ("pp", "tp") mesh, four ranks ----

PIPELINE_SCHEDULES = ["gpipe", "1f1b-2", "zb"]
PIPELINE_BLOCKS = 4


def _pipeline_blocks() -> list[Block]:
    torch.manual_seed(0)
    return [Block(nn.LayerNorm) for _ in range(PIPELINE_BLOCKS)]


def _pipeline_data(micro_batches: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(micro_batches * 2, 6, WIDTH, generator=g), torch.randn(micro_batches * 2, 6, WIDTH, generator=g)


def _pipeline(rank: int) -> dict:
    """Each pipeline stage's blocks tensor-parallel over its pair of ranks; the stages' inputs
    and outputs replicated (every rank of a pair sends and receives the whole activation)."""
    from twobp_autograd.pipeline import PipelineRuntime
    from twobp_autograd.pipeline.schedules import default_num_micro_batches, schedule

    mesh = init_device_mesh("cpu", (WORLD, WORLD), mesh_dim_names=("pp", "tp"))
    pp, per_stage = mesh.get_local_rank("pp"), PIPELINE_BLOCKS // WORLD
    _, block_plan = _plan(Setting(sequence_parallel=False))
    results = {}
    for name in PIPELINE_SCHEDULES:
        stage = twobp.patch(nn.Sequential(*_pipeline_blocks()[pp * per_stage : (pp + 1) * per_stage]))
        for block in stage:
            parallelize_module(block, mesh["tp"], copy.deepcopy(block_plan))
        m = default_num_micro_batches(name, WORLD)
        runtime = PipelineRuntime(
            stage, schedule(name, WORLD, m, True)[pp], num_micro_batches=m, loss_fn=F.mse_loss,
            twobp=True, group=mesh.get_group("pp"), timeout=60.0,
        )  # fmt: skip
        inputs, targets = _pipeline_data(m)
        report = runtime.step(inputs if pp == 0 else None, targets if pp == WORLD - 1 else None, gather=False)
        grads = {f"{pp * per_stage + int(n.split('.')[0])}.{n.split('.', 1)[1]}": g for n, g in _grads(stage).items()}
        results[name] = {"m": m, "deferred": report.deferred_jobs, "grads": grads}
    return results


@pytest.fixture(scope="module")
def pipeline_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    directory = str(tmp_path_factory.mktemp("pipeline_tensor_parallel"))
    return run_scenario(_pipeline, WORLD * WORLD, directory, deadline=240.0)


@pytest.mark.parametrize("name", PIPELINE_SCHEDULES)
def test_pipelined_tensor_parallel_gradients_equal_one_process(pipeline_results: list[dict], name: str) -> None:
    m = pipeline_results[0][name]["m"]
    model = nn.Sequential(*_pipeline_blocks())
    inputs, targets = _pipeline_data(m)
    for x, y in zip(inputs.chunk(m), targets.chunk(m), strict=True):
        (F.mse_loss(model(x), y) / m).backward()
    for rank, results in enumerate(pipeline_results):
        result = results[name]
        assert result["deferred"] > 0, f"rank {rank}: nothing was deferred"
        for key, got in result["grads"].items():
            want = model.get_parameter(key).grad
            assert got is not None and want is not None, f"rank {rank} {key}"
            assert close_to_reference(got[1], want), f"rank {rank} {key}: {(got[1] - want).abs().max()}"


# -- torchtitan's full layout: PyTorch's pipelining x FSDP2 x tensor parallel, eight ranks -------


def _three_dimensional(rank: int) -> dict:
    """A 2 x 2 x 2 ("pp", "dp", "tp") mesh: four stages (two per pipeline rank, interleaved
    zero bubble with our dw_builder), each block tensor-parallel over "tp" and sharded over "dp"."""
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleavedZeroBubble

    from twobp_autograd.pipeline import dw_builder

    mesh = init_device_mesh("cpu", (WORLD, WORLD, WORLD), mesh_dim_names=("pp", "dp", "tp"))
    pp, replica = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    _, block_plan = _plan(Setting(sequence_parallel=False))
    blocks, indices, modules, stages = _pipeline_blocks(), [pp, pp + WORLD], {}, []
    for index in indices:
        module = twobp.patch(nn.Sequential(blocks[index]))
        parallelize_module(module[0], mesh["tp"], copy.deepcopy(block_plan))
        fully_shard(module, mesh=mesh["dp"])
        builder = dw_builder(module)
        stages.append(
            PipelineStage(
                module, index, PIPELINE_BLOCKS, torch.device("cpu"), group=mesh.get_group("pp"), dw_builder=builder
            )
        )
        modules[index] = module
    schedule = ScheduleInterleavedZeroBubble(stages, n_microbatches=4, loss_fn=F.mse_loss)
    inputs, targets = _replica_data(replica)
    schedule.step(*((inputs,) if 0 in indices else ()), target=targets if PIPELINE_BLOCKS - 1 in indices else None)
    return {
        f"{index}.{name.split('.', 1)[1]}": grad
        for index, module in modules.items()
        for name, grad in _grads(module).items()
    }


def _replica_data(replica: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(10 + replica)
    return torch.randn(8, 6, WIDTH, generator=g), torch.randn(8, 6, WIDTH, generator=g)


def test_pipelining_over_fsdp2_over_tensor_parallel_equals_one_process(tmp_path: object) -> None:
    ranks = run_scenario(_three_dimensional, WORLD**3, str(tmp_path), deadline=240.0)
    model = nn.Sequential(*_pipeline_blocks())
    for replica in range(WORLD):  # every replica's micro-batches: the mean over all of them
        inputs, targets = _replica_data(replica)
        for x, y in zip(inputs.chunk(4), targets.chunk(4), strict=True):
            (F.mse_loss(model(x), y) / (4 * WORLD)).backward()
    for rank, grads in enumerate(ranks):
        assert grads, f"rank {rank}: no gradients"
        for key, got in grads.items():
            want = model.get_parameter(key).grad
            assert got is not None and close_to_reference(got[1], want), f"rank {rank} {key}"
