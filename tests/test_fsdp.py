"""FSDP2 (``fully_shard``) on patched models, two gloo ranks: each rank's sharded ``.grad`` after
the flush against FSDP2 on the unpatched model and against one process, over the ways users
shard (per block and root, patch before or after ``fully_shard``), ``reshard_after_forward``,
gradient accumulation with and without ``set_requires_gradient_sync``, bf16 mixed precision
and activation checkpointing; and the refusals.

All settings run in one spawn of two ranks (starting processes is the slow part); the tests
below read what each rank returned.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import twobp_autograd as twobp
from tests.ranks import run_scenario
from tests.utils import Scale, TokenStack, close_to_reference
from twobp_autograd import fsdp_hooks
from twobp_autograd.data_parallel import GradientSynchroniser
from twobp_autograd.flush import watch_flushes
from twobp_autograd.registry import rules_restored_after

WORLD = 2
MICRO_BATCHES = 3
ROWS = 4  # per micro-batch and rank
VOCAB, WIDTH = 13, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 3 * WIDTH)
        self.scale = Scale(3 * WIDTH)
        self.down = nn.Linear(3 * WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(F.gelu(self.scale(self.up(self.norm(x)))))


class Net(TokenStack):
    """Embedding, three blocks, a final norm and head: patched and unpatched parameters in
    every FSDP2 group, odd sizes so that sharding pads."""

    def __init__(self) -> None:
        super().__init__(
            nn.Embedding(VOCAB, WIDTH), [Block() for _ in range(3)], nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)
        )


class DeferredNet(TokenStack):
    """Net without the unpatched Scale: every parameter gets its gradient from the flush."""

    def __init__(self) -> None:
        blocks = [Block() for _ in range(3)]
        for block in blocks:
            block.scale = nn.Identity()  # type: ignore[assignment]
        super().__init__(nn.Embedding(VOCAB, WIDTH), blocks, nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB))


@dataclass(frozen=True)
class Setting:
    order: str = "patch_then_shard"  # or "shard_then_patch"
    reshard_after_forward: bool = True
    accumulate: str = "sync_each"  # or "sync_last": set_requires_gradient_sync(False) but for the last
    precision: str = "fp32"  # or a key of POLICIES: bf16 parameters, or a bf16 reduction
    checkpoint: bool = False  # non-reentrant checkpoint_wrapper around each block
    shard_head: bool = False  # fully_shard on the head Linear itself: its class becomes FSDPLinear
    capped: bool = False  # a queue with max_pending_bytes: the oldest work is flushed inside backward

    @property
    def id(self) -> str:
        parts = [self.order, f"reshard_{self.reshard_after_forward}", self.accumulate]
        parts += (
            [self.precision] * (self.precision != "fp32")
            + ["checkpoint"] * self.checkpoint
            + ["head_sharded"] * self.shard_head
            + ["capped"] * self.capped
        )
        return "-".join(parts)


SETTINGS = [
    Setting(),
    Setting(order="shard_then_patch", shard_head=True),
    Setting(shard_head=True),
    Setting(reshard_after_forward=False),
    Setting(accumulate="sync_last"),
    Setting(order="shard_then_patch", reshard_after_forward=False, accumulate="sync_last"),
    Setting(precision="bf16_params"),
    Setting(precision="bf16_reduce", accumulate="sync_last"),
    Setting(checkpoint=True),
    Setting(order="shard_then_patch", checkpoint=True, accumulate="sync_last"),
    Setting(capped=True),
    Setting(capped=True, accumulate="sync_last", reshard_after_forward=False),
]


POLICIES = {
    "fp32": MixedPrecisionPolicy(),
    "bf16_params": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    "bf16_reduce": MixedPrecisionPolicy(reduce_dtype=torch.bfloat16),
}


def _data(rank: int, micro: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(100 * rank + micro)
    return torch.randint(0, VOCAB, (ROWS, 5), generator=g), torch.randint(0, VOCAB, (ROWS * 5,), generator=g)


def _loss(model: nn.Module, tokens: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(model(tokens).flatten(0, 1).float(), targets) / MICRO_BATCHES


def _build(setting: Setting, patched: bool, mesh: DeviceMesh | None = None) -> nn.Module:
    """Net on the mesh's device (default: the CPU ranks of the spawn), sharded as ``setting`` says."""
    mesh = init_device_mesh("cpu", (WORLD,)) if mesh is None else mesh
    torch.manual_seed(0)
    model = Net().to(mesh.device_type)
    if setting.checkpoint:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    if patched and setting.order == "patch_then_shard":
        twobp.patch(model)
    policy = POLICIES[setting.precision]
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=setting.reshard_after_forward, mp_policy=policy)
    if setting.shard_head:
        fully_shard(model.head, mesh=mesh, reshard_after_forward=setting.reshard_after_forward, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=setting.reshard_after_forward, mp_policy=policy)
    if patched and setting.order == "shard_then_patch":
        report = twobp.patch(model, report=True)
        assert "blocks.0.up" in report.patched or "blocks.0._checkpoint_wrapped_module.up" in report.patched, report
        assert "head" in report.patched, report  # found as nn.Linear although its class is FSDPLinear
    return model


def _train_step(model: nn.Module, setting: Setting, rank: int, queue: twobp.WeightGradQueue | None = None) -> None:
    device = model.head.weight.device
    for micro in range(MICRO_BATCHES):
        if setting.accumulate == "sync_last":
            model.set_requires_gradient_sync(micro == MICRO_BATCHES - 1)  # type: ignore[operator]
        with twobp.use_queue(queue) if queue is not None else contextlib.nullcontext():
            _loss(model, *(t.to(device) for t in _data(rank, micro))).backward()


def _sharded_grads(model: nn.Module) -> dict[str, Tensor | None]:
    grads: dict[str, Tensor | None] = {}
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), f"{name} is not sharded"
        grads[name] = None if p.grad is None else p.grad.to_local().clone()
    return grads


def _full_grads(model: nn.Module) -> dict[str, Tensor | None]:
    return {name: None if p.grad is None else p.grad.full_tensor() for name, p in model.named_parameters()}


def _run_setting(setting: Setting, rank: int, mesh: DeviceMesh | None = None) -> dict:
    ours, plain = _build(setting, patched=True, mesh=mesh), _build(setting, patched=False, mesh=mesh)
    # Capped: about one block's work of one micro-batch, so early flushes happen in every backward.
    queue = twobp.WeightGradQueue(max_pending_bytes=4096) if setting.capped else None
    _train_step(plain, setting, rank)
    _train_step(ours, setting, rank, queue)
    queued = twobp.pending(queue).jobs
    freed_while_queued = _unsharded_storage_freed(ours)
    deferred_untouched = all(p.grad is None for name, p in ours.named_parameters() if name.endswith("up.weight"))
    events: list[str] = []
    stop_logging = watch_flushes(functools.partial(_EventLog, events))
    twobp.flush_weight_grads(queue)
    stop_logging()
    result = {
        "queued": queued,
        "deferred_untouched": deferred_untouched,
        "ours": _sharded_grads(ours),
        "plain": _sharded_grads(plain),
        "ours_full": _full_grads(ours),
        "plain_full": _full_grads(plain),
        "events": events,
        "unsharded_freed": (freed_while_queued, _unsharded_storage_freed(ours))
        if setting.reshard_after_forward
        else None,
    }
    # A second step, after an optimizer step on both: parameters equal, so the step used .grad.
    for model in (ours, plain):
        torch.optim.SGD(model.parameters(), lr=0.5).step()
        model.zero_grad()
    _train_step(plain, setting, rank)
    _train_step(ours, setting, rank, queue)
    twobp.flush_weight_grads(queue)
    result["second_ours"], result["second_plain"] = _sharded_grads(ours), _sharded_grads(plain)
    return result


class _EventLog:
    """A flush watch (asked after the FSDP2 one) recording the order of reductions and
    deliveries: a reduction logged before a later delivery overlapped the rest of the flush."""

    def __init__(self, events: list[str], params: object, early: bool) -> None:
        self.events = events
        self._reduce_group = fsdp_hooks.reduce_group
        fsdp_hooks.reduce_group = self._logged_reduce  # type: ignore[assignment]

    def _logged_reduce(self, group: object) -> None:
        self.events.append("reduce")
        self._reduce_group(group)

    def completes(self, params: object) -> bool:
        return False  # only watches: FSDP2's own watch says when to hand over

    def holds_back(self, param: object) -> bool:
        return False

    def delivered(self, params: object) -> None:
        self.events.append("delivered")

    def finished(self) -> None:
        fsdp_hooks.reduce_group = self._reduce_group  # type: ignore[assignment]

    def abandoned(self) -> None:
        fsdp_hooks.reduce_group = self._reduce_group  # type: ignore[assignment]


def _unsharded_storage_freed(model: nn.Module) -> bool:
    """After backward and flush, every unsharded parameter's storage is freed again."""
    return all(
        fsdp_param._unsharded_param.untyped_storage().size() == 0
        for group in fsdp_hooks.groups_of(model)
        for fsdp_param in group.fsdp_params
        if hasattr(fsdp_param, "_unsharded_param")
    )


def _misuse(rank: int) -> dict:
    setting = Setting()
    model = _build(setting, patched=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _loss(model, *_data(rank, 0)).backward()
    refusals: dict[str, str] = {}
    try:
        optimizer.step()
    except RuntimeError as error:
        refusals["step"] = str(error)
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    except RuntimeError as error:
        refusals["clip"] = str(error)
    try:
        model.zero_grad()
    except RuntimeError as error:
        refusals["zero_grad"] = str(error)
    twobp.flush_weight_grads()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # allowed once flushed
    optimizer.step()
    queue = twobp.WeightGradQueue()  # forwards under use_queue: the refusal names that queue
    with twobp.use_queue(queue):
        _loss(model, *_data(rank, 1)).backward()
    try:
        model.zero_grad()
    except RuntimeError as error:
        refusals["zero_grad_other_queue"] = str(error)
    queue.clear()

    torch.manual_seed(0)
    late = twobp.patch(Net())
    _loss(late, *_data(rank, 0)).backward()  # work queued on the parameters fully_shard replaces
    mesh = init_device_mesh("cpu", (WORLD,))
    fully_shard(late, mesh=mesh)
    try:
        twobp.flush_weight_grads()
    except RuntimeError as error:
        refusals["shard_after_queue"] = str(error)
    twobp.discard_weight_grads()

    try:
        GradientSynchroniser(_build(setting, patched=True))
    except TypeError as error:
        refusals["replicated_sync_on_sharded"] = str(error)
    return refusals


def _one_process_grads(setting: Setting) -> dict[str, Tensor]:
    torch.manual_seed(0)
    model = Net()
    if setting.checkpoint:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    for rank in range(WORLD):
        for micro in range(MICRO_BATCHES):
            (_loss(model, *_data(rank, micro)) / WORLD).backward()
    return {name: p.grad for name, p in model.named_parameters()}


class _Widening(nn.Module):
    """A Linear, then a Conv1d over its output spread along a length each micro-batch chooses:
    jobs of the Conv1d group apart by length, so a rank whose lengths differ from another's
    finishes the two FSDP2 groups in another order."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.conv = nn.Conv1d(4, 4, 1)

    def forward(self, x: Tensor, length: int) -> Tensor:
        return self.conv(self.linear(x).unsqueeze(-1).expand(-1, -1, length).contiguous())


#: Per rank, the length of each micro-batch (rank 0 finishes the Linear's group first, rank 1 last).
_LENGTHS = {0: (4, 8), 1: (8, 8)}


def _shapes_by_rank(rank: int) -> dict:
    """The flush reduced each group when it finished, so the ranks reduce-scattered in other
    orders and gloo paired one rank's Linear with the other's Conv1d (0.3 off, silently)."""
    mesh = init_device_mesh("cpu", (WORLD,))
    grads = {}
    for patched in (False, True):
        torch.manual_seed(0)
        model = _Widening()
        if patched:
            twobp.patch(model)
        fully_shard(model.linear, mesh=mesh)
        fully_shard(model.conv, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for micro, length in enumerate(_LENGTHS[rank]):
            generator = torch.Generator().manual_seed(10 * rank + micro)
            x, y = torch.randn(3, 4, generator=generator), torch.randn(3, 4, length, generator=generator)
            F.mse_loss(model(x, length), y).backward()
        twobp.flush_weight_grads()
        grads[patched] = _full_grads(model)
    return {"ours": grads[True], "plain": grads[False]}


class _Routed(nn.Module):
    """A patched Linear or a plain scale, as its rank's routing says (an expert a rank's tokens
    reach, or not)."""

    def __init__(self) -> None:
        super().__init__()
        self.expert, self.scale = nn.Linear(4, 4), nn.Parameter(torch.ones(4))
        self.routed = True

    def forward(self, x: Tensor) -> Tensor:
        return x + (self.expert(x) if self.routed else x * self.scale)


def _unused_params_reduced(rank: int) -> dict:
    """``set_reduce_scatter_unused_params(True)``, rank 0 routed to the first block's expert and
    rank 1 to the second's: FSDP2 reduces every group on every rank (zeros for the unused), the
    flush reduced only the group its rank deferred work for, and gloo paired rank 0's first group
    with rank 1's second (0.07-0.09 off, silently). Such groups' gradients are made in backward."""
    mesh = init_device_mesh("cpu", (WORLD,))
    grads, queued = {}, 0
    for patched in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), _Routed(), _Routed(), nn.Linear(4, 3))
        model[2].routed, model[3].routed = rank == 0, rank == 1
        if patched:
            twobp.patch(model)
        for block in (model[0], model[2], model[3]):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for block in (model[2], model[3]):  # the root's would flag every group (recurse=True)
            block.set_reduce_scatter_unused_params(True, recurse=False)
        generator = torch.Generator().manual_seed(rank)
        x, y = torch.randn(6, 4, generator=generator), torch.randint(0, 3, (6,), generator=generator)
        F.cross_entropy(model(x), y).backward()
        queued = twobp.pending().jobs if patched else queued
        twobp.flush_weight_grads()
        grads[patched] = _full_grads(model)
    return {"ours": grads[True], "plain": grads[False], "queued": queued}


def _capped_with_other_lengths(rank: int) -> dict:
    """A capped queue whose ranks hold other amounts of work (5 tokens a sequence on one, 40 on
    the other) flushes early at other moments on each: the early flushes reduced on one rank
    only and the ranks waited on each other forever. Inside backward, and after it (the cap
    enforced once the block ends, as a pipeline stage does)."""
    results = {}
    for when in CAPPED_WHEN:
        grads, left = {}, 0
        for patched in (False, True):
            model = _build(Setting(), patched)
            # sync_last: only one rank flushes early (the other holds all its work till the flush).
            cap = None if when == "sync_last" and rank == 0 else 4096
            queue = twobp.WeightGradQueue(max_pending_bytes=cap)
            # Tagged: the cap enforced once after all micro-batches, so one early flush takes
            # several tags' work.
            with queue.cap_enforced_after() if when == "tagged" else contextlib.nullcontext():
                for micro in range(MICRO_BATCHES):
                    if when == "sync_last":
                        model.set_requires_gradient_sync(micro == MICRO_BATCHES - 1)  # type: ignore[operator]
                    g = torch.Generator().manual_seed(100 * rank + micro)
                    length = 5 if rank == 0 else 40
                    tokens = torch.randint(0, VOCAB, (ROWS, length), generator=g)
                    targets = torch.randint(0, VOCAB, (ROWS * length,), generator=g)
                    capped = queue.cap_enforced_after() if when == "after_backward" else contextlib.nullcontext()
                    tagged = queue.tagged(micro) if when == "tagged" else contextlib.nullcontext()
                    with twobp.use_queue(queue), tagged, capped:
                        _loss(model, tokens, targets).backward()
            # Tagged: flushed by tag, as a pipeline stage flushes (the held work keeps its tag).
            queue.flush(list(range(MICRO_BATCHES)) if when == "tagged" else None)
            left = queue.pending().jobs
            grads[patched] = _sharded_grads(model)
        results[when] = {"ours": grads[True], "plain": grads[False], "left": left}
    return results


#: Where the cap is enforced: inside backward, after each (as a pipeline stage does), after all
#: of them over tagged work; inside backward with sync off but for the last micro-batch (an early
#: flush's gradient in .grad on one rank only was reduced by FSDP2's own post-backward there).
CAPPED_WHEN = ("in_backward", "after_backward", "tagged", "sync_last")


def _recompute_rule_under_fsdp(rank: int) -> dict:
    """A module registered with the recompute rule inside sharded blocks: the flush replayed its
    forward on parameters whose unsharded storage FSDP2 had freed (a segfault). It keeps plain
    autograd there."""
    grads = {}
    with rules_restored_after():
        twobp.register(Scale, twobp.ops.recompute)
        for patched in (False, True):
            model = _build(Setting(), patched)
            _train_step(model, Setting(), rank)
            twobp.flush_weight_grads()
            grads[patched] = _full_grads(model)
    return {"ours": grads[True], "plain": grads[False]}


class _Queries(nn.Module):
    """Learned queries through a patched Linear: frozen, or trainable but read past autograd
    (``.detach()``, a stop-gradient as VQ-VAE codebooks take, or ``.data``)."""

    def __init__(self, read: str) -> None:
        super().__init__()
        self.read = read
        self.queries = nn.Parameter(torch.randn(5, 4), requires_grad=read != "frozen")
        self.proj = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        queries = {"detached": self.queries.detach(), "data": self.queries.data}.get(self.read, self.queries)
        return x + self.proj(queries)


#: How a sharded block reads its parameter as a patched layer's input.
QUERY_READS = ("frozen", "detached", "data")


def _parameters_as_inputs(rank: int) -> dict:
    """A parameter of a sharded block as a patched layer's input, frozen or read past autograd:
    the job kept it uncopied, FSDP2 freed its unsharded storage after backward, and the flush
    failed inside the weight kernel ("data is not allocated yet")."""
    mesh = init_device_mesh("cpu", (WORLD,))
    results = {}
    for read in QUERY_READS:
        grads = {}
        for patched in (False, True):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, 4), _Queries(read), nn.Linear(4, 3))
            if patched:
                twobp.patch(model)
            fully_shard(model[1], mesh=mesh)
            fully_shard(model, mesh=mesh)
            for micro in range(2):
                x = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(10 * rank + micro))
                model(x).pow(2).sum().backward()
            try:
                twobp.flush_weight_grads()
            except RuntimeError as error:  # this case's tests fail, not every test of the module
                twobp.discard_weight_grads()
                results[read] = {"error": str(error)}
                break
            grads[patched] = _full_grads(model)
        else:
            results[read] = {"ours": grads[True], "plain": grads[False]}
    return results


def _scenario(rank: int) -> dict:
    results = {setting.id: _run_setting(setting, rank) for setting in SETTINGS}
    results["parameters_as_inputs"] = _parameters_as_inputs(rank)
    results["recompute_rule"] = _recompute_rule_under_fsdp(rank)
    results["misuse"] = _misuse(rank)
    results["shapes_by_rank"] = _shapes_by_rank(rank)
    results["capped_with_other_lengths"] = _capped_with_other_lengths(rank)
    results["unused_params_reduced"] = _unused_params_reduced(rank)
    return results


# -- the tests ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_scenario(_scenario, WORLD, str(tmp_path_factory.mktemp("fsdp")), deadline=300.0)


def _assert_all_close(ours: dict, theirs: dict, what: str, check: Callable[[Tensor, Tensor], bool]) -> None:
    assert ours.keys() == theirs.keys()
    for name in ours:
        a, b = ours[name], theirs[name]
        assert (a is None) == (b is None), f"{what} {name}: one .grad is None, the other is not"
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, (
                f"{what} {name}: {a.dtype} {a.shape} vs {b.dtype} {b.shape}"
            )
            assert check(a, b), f"{what} {name}: largest difference {(a - b).abs().max().item():.3g}"


FP32_SETTINGS = [s for s in SETTINGS if s.precision == "fp32"]
BF16_SETTINGS = [s for s in SETTINGS if s.precision != "fp32"]


@pytest.mark.parametrize("setting", FP32_SETTINGS, ids=[s.id for s in FP32_SETTINGS])
@pytest.mark.parametrize("rank", range(WORLD))
def test_sharded_grads_equal_fsdp2_on_the_unpatched_model(ranks: list[dict], setting: Setting, rank: int) -> None:
    result = ranks[rank][setting.id]
    assert result["queued"] > 0, "nothing was deferred: the patch did not reach the sharded modules"
    assert result["deferred_untouched"] or setting.capped, "a deferred weight had a gradient before the flush"
    _assert_all_close(result["ours"], result["plain"], f"rank {rank}", close_to_reference)
    _assert_all_close(result["second_ours"], result["second_plain"], f"rank {rank} second step", close_to_reference)


@pytest.fixture
def one_rank_nccl_mesh(tmp_path) -> Iterator[DeviceMesh]:
    """An NCCL group of this process alone on its GPU: NCCL refuses two ranks on one device, and
    gloo's reduce-scatter takes no CUDA tensors, so one rank is what a single GPU can test."""
    torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl",
        store=dist.FileStore(str(tmp_path / "store"), 1),
        rank=0,
        world_size=1,
        device_id=torch.device("cuda", 0),
    )
    try:
        yield init_device_mesh("cuda", (1,))
    finally:
        dist.destroy_process_group()


def _fsdp2_keeps_a_list_of_groups() -> bool:
    """Whether this release's FSDP2 is the one 2BP's support is built on (torch 2.11's is not:
    refused by name, tests/test_fsdp_hooks.py)."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    return hasattr(FSDPState(), "_fsdp_param_groups")


@pytest.mark.skipif(not torch.cuda.is_available() or not dist.is_nccl_available(), reason="needs CUDA and NCCL")
@pytest.mark.skipif(not _fsdp2_keeps_a_list_of_groups(), reason="FSDP2 with 2BP needs torch 2.14's FSDP2 internals")
@pytest.mark.parametrize("setting", FP32_SETTINGS, ids=[s.id for s in FP32_SETTINGS])
def test_on_cuda_with_nccl_grads_equal_fsdp2_on_the_unpatched_model(one_rank_nccl_mesh: DeviceMesh, setting: Setting):
    """FSDP2 on CUDA reduces on its own streams: the flush's reductions must wait for the
    deferred kernels and the gradients land as FSDP2's own (two steps, an optimizer between)."""
    result = _run_setting(setting, 0, one_rank_nccl_mesh)  # (PyTorch's default: no TF32 in matmuls)
    assert result["queued"] > 0
    _assert_all_close(result["ours"], result["plain"], "cuda", close_to_reference)
    _assert_all_close(result["second_ours"], result["second_plain"], "cuda second step", close_to_reference)


@pytest.mark.parametrize("setting", FP32_SETTINGS, ids=[s.id for s in FP32_SETTINGS])
def test_gathered_grads_equal_one_process(ranks: list[dict], setting: Setting) -> None:
    reference = _one_process_grads(setting)
    _assert_all_close(ranks[0][setting.id]["ours_full"], reference, "gathered", close_to_reference)


@pytest.mark.parametrize("setting", BF16_SETTINGS, ids=[s.id for s in BF16_SETTINGS])
def test_bf16_mixed_precision_within_plain_fsdp2s_own_error(ranks: list[dict], setting: Setting) -> None:
    reference = _one_process_grads(setting)
    result = ranks[0][setting.id]
    assert result["queued"] > 0
    for name, expected in reference.items():
        ours, plain = result["ours_full"][name], result["plain_full"][name]
        assert ours.dtype == plain.dtype == torch.float32, name  # kept in the sharded parameters' dtype
        plain_error = (plain - expected).abs().max().item()
        our_error = (ours - expected).abs().max().item()
        assert close_to_reference(ours, expected, torch.bfloat16), f"{name}: error {our_error:.3g}"
        # Plus one bf16 rounding of the gradient's scale: where plain's error is itself one lucky
        # rounding, ours (summed in another order before the cast) may round once the other way.
        one_rounding = 2**-8 * expected.abs().max().item()
        assert our_error <= 2 * plain_error + one_rounding, (
            f"{name}: error {our_error:.3g}, plain FSDP2's {plain_error:.3g}"
        )


@pytest.mark.parametrize("rank", range(WORLD))
def test_groups_are_reduced_while_the_flush_goes_on(ranks: list[dict], rank: int) -> None:
    events = ranks[rank][Setting().id]["events"]
    assert events.count("reduce") == 4, events  # three blocks and the root
    assert events.index("reduce") < len(events) - 1 - events[::-1].index("delivered"), events


def test_unsharded_parameters_are_freed_after_backward_and_flush(ranks: list[dict]) -> None:
    """The deferred work holds activations and output gradients, not the unsharded weights."""
    freed = [r[s.id]["unsharded_freed"] for r in ranks for s in SETTINGS if s.reshard_after_forward]
    assert all(while_queued and after_flush for while_queued, after_flush in freed), freed


#: What each misuse must be refused with: (the message's start, a fix it names).
MISUSES = {
    "step": ("twobp: optimizer.step()", "flush_weight_grads()"),
    "clip": ("twobp: gradient clipping", "flush_weight_grads()"),
    # Unlike unsharded parameters' (dropped, as plain zero_grad drops them): the work is queued
    # on FSDP2's unsharded stand-ins, whose reduction the flush still owes.
    "zero_grad": ("twobp: FSDPNet.zero_grad()", "discard_weight_grads()"),
    "zero_grad_other_queue": ("twobp: FSDPNet.zero_grad()", "other than the current one"),
    "shard_after_queue": ("twobp: ", "before calling fully_shard"),
    "replicated_sync_on_sharded": ("twobp: ", "flush_weight_grads()"),
}


@pytest.mark.parametrize("rank", range(WORLD))
@pytest.mark.parametrize("misuse", MISUSES)
def test_misuse_over_queued_sharded_work_is_refused(ranks: list[dict], rank: int, misuse: str) -> None:
    """An optimizer step, clipping or zero_grad over sharded parameters with work queued,
    fully_shard over queued work, the replicated synchroniser on a sharded model."""
    start, fix = MISUSES[misuse]
    message = ranks[rank]["misuse"].get(misuse, "")
    assert message.startswith(start) and fix in message, message


# -- HSDP: fully_shard over a 2-D ("replicate", "shard") mesh, four ranks ---------------------

HSDP_ACCUMULATIONS = ["sync_each", "sync_last"]


@pytest.mark.parametrize("rank", range(WORLD))
def test_ranks_whose_micro_batches_differ_in_shape_reduce_the_groups_in_one_order(ranks: list[dict], rank: int) -> None:
    result = ranks[rank]["shapes_by_rank"]
    _assert_all_close(result["ours"], result["plain"], f"rank {rank}", close_to_reference)


@pytest.mark.parametrize("when", CAPPED_WHEN)
@pytest.mark.parametrize("rank", range(WORLD))
def test_a_capped_queue_whose_ranks_hold_other_amounts_of_work_reduces_on_all_ranks_at_once(
    ranks: list[dict], rank: int, when: str
) -> None:
    result = ranks[rank]["capped_with_other_lengths"][when]
    assert result["left"] == 0, "work left queued after flushing every tag"
    _assert_all_close(result["ours"], result["plain"], f"rank {rank}", close_to_reference)


@pytest.mark.parametrize("rank", range(WORLD))
def test_groups_that_reduce_unused_parameters_get_their_gradients_in_backward(ranks: list[dict], rank: int) -> None:
    result = ranks[rank]["unused_params_reduced"]
    assert result["queued"] > 0, "the unflagged groups' layers still defer"
    _assert_all_close(result["ours"], result["plain"], f"rank {rank}", close_to_reference)


@pytest.mark.parametrize("read", QUERY_READS)
@pytest.mark.parametrize("rank", range(WORLD))
def test_a_sharded_parameter_read_as_a_patched_layers_input_is_kept_for_the_flush(
    ranks: list[dict], rank: int, read: str
) -> None:
    result = ranks[rank]["parameters_as_inputs"][read]
    assert "error" not in result, result.get("error")
    _assert_all_close(result["ours"], result["plain"], f"rank {rank}", close_to_reference)


@pytest.mark.parametrize("rank", range(WORLD))
def test_a_module_under_the_recompute_rule_inside_sharded_blocks_keeps_plain_autograd(
    ranks: list[dict], rank: int
) -> None:
    result = ranks[rank]["recompute_rule"]
    _assert_all_close(result["ours"], result["plain"], f"rank {rank}", close_to_reference)


def _per_block_and_root(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _hsdp(rank: int) -> dict:
    """FSDP2's post-backward reduce-scatters within a shard group, then all-reduces across the
    replicas: the flush runs that same post-backward, group by group."""
    mesh = init_device_mesh("cpu", (WORLD, WORLD), mesh_dim_names=("replicate", "shard"))
    results = {}
    for accumulate in HSDP_ACCUMULATIONS:
        setting, grads, queued = Setting(accumulate=accumulate), {}, 0
        for patched in (False, True):
            torch.manual_seed(0)
            model = _per_block_and_root(twobp.patch(Net()) if patched else Net(), mesh)
            _train_step(model, setting, rank)
            queued = twobp.pending().jobs
            twobp.flush_weight_grads()
            grads[patched] = _full_grads(model)
        results[accumulate] = {"queued": queued, "ours": grads[True], "plain": grads[False]}
    # All-reduce off (accumulating across replicas): FSDP2 adds each reduction into one flat
    # buffer per group laid out by the parameters reduced; backward reduced the plain ones, the
    # flush the deferred ones, and their gradients were added across parameters, silently. Off
    # while flushing, or on but with backward's partial reduction pending: refused.
    for refused in ("all_reduce_off", "partial_pending"):
        torch.manual_seed(0)
        model = _per_block_and_root(twobp.patch(Net()), mesh)
        model.set_requires_all_reduce(False)  # type: ignore[operator]
        _loss(model, *_data(rank, 0)).backward()
        model.set_requires_all_reduce(refused == "all_reduce_off")  # type: ignore[operator]
        try:
            twobp.flush_weight_grads()
            results[refused] = None
        except RuntimeError as error:
            results[refused] = {"error": str(error), "type": type(error).__name__, "kept": twobp.pending().jobs}
        twobp.discard_weight_grads()
    # Every parameter deferred: backward reduces none of a group and every flush reduces all of
    # it, so FSDP2's buffer has one layout: a flush after each micro-batch, the all-reduce off
    # but for the last, equals HSDP on the unpatched model.
    grads, queued = {}, 0
    for patched in (False, True):
        torch.manual_seed(0)
        model = _per_block_and_root(twobp.patch(DeferredNet()) if patched else DeferredNet(), mesh)
        for micro in range(MICRO_BATCHES):
            model.set_requires_all_reduce(micro == MICRO_BATCHES - 1)  # type: ignore[operator]
            _loss(model, *_data(rank, micro)).backward()
            queued += twobp.pending().jobs
            twobp.flush_weight_grads()
        grads[patched] = _full_grads(model)
    results["all_deferred"] = {"queued": queued, "ours": grads[True], "plain": grads[False]}
    return results


@pytest.fixture(scope="module")
def hsdp_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_scenario(_hsdp, WORLD * WORLD, str(tmp_path_factory.mktemp("hsdp")), deadline=300.0)


@pytest.mark.parametrize("refused", ["all_reduce_off", "partial_pending"])
def test_an_hsdp_flush_with_the_all_reduce_off_is_refused(hsdp_ranks: list[dict], refused: str) -> None:
    """Refused as the flush starts: no gradient delivered, the work still queued."""
    for rank, results in enumerate(hsdp_ranks):
        refusal = results[refused]
        assert refusal and refusal["error"].startswith("twobp: a flush would reduce an HSDP group"), f"rank {rank}"
        assert refusal["type"] == "RuntimeError" and refusal["kept"] > 0, f"rank {rank}: {refusal}"


def test_an_hsdp_group_whose_parameters_all_come_from_flushes_accumulates_with_the_all_reduce_off(
    hsdp_ranks: list[dict],
) -> None:
    for rank, results in enumerate(hsdp_ranks):
        result = results["all_deferred"]
        assert result["queued"] > 0, "nothing was deferred"
        _assert_all_close(result["ours"], result["plain"], f"rank {rank}", close_to_reference)


@pytest.mark.parametrize("accumulate", HSDP_ACCUMULATIONS)
def test_hsdp_grads_equal_hsdp_on_the_unpatched_model(hsdp_ranks: list[dict], accumulate: str) -> None:
    for rank, results in enumerate(hsdp_ranks):
        result = results[accumulate]
        assert result["queued"] > 0, "nothing was deferred"
        _assert_all_close(result["ours"], result["plain"], f"rank {rank}", close_to_reference)


class _Raised(Exception):
    pass


def test_a_backward_that_raised_after_a_flush_inside_it_leaves_no_reduction_behind(one_rank_group: None) -> None:
    """A flush from a hook inside a backward leaves its groups' reductions to that backward's
    end, a callback the engine never runs when the backward raises: each failed step's groups
    (FSDP2's parameter groups, and through them the model) stayed recorded for good."""
    from twobp_autograd import fsdp

    torch.manual_seed(0)
    model = twobp.patch(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)))
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer)
    fully_shard(model)

    def flush_inside(grad: Tensor) -> Tensor:
        twobp.flush_weight_grads()
        return grad

    def raise_inside(grad: Tensor) -> Tensor:
        raise _Raised

    for _ in range(3):
        first = model[1](model[0](torch.randn(4, 8)))
        first.register_hook(raise_inside)  # reached last
        last = model[3](model[2](first))
        last.register_hook(flush_inside)  # after the head's backward
        with pytest.raises(_Raised):
            model[4](last).sum().backward()
        twobp.discard_weight_grads()
        model.zero_grad()
    assert not fsdp._after_backward


def test_a_flush_failing_after_a_hand_over_leaves_no_gradient_for_the_next_step(
    one_rank_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The head's gradients reached its group (the root, reduced last) before the next layer's
    kernel failed: PartlyDelivered said to zero the gradients and run the step again, but zero_grad
    clears the sharded .grad only, and FSDP2's next post-backward reduced the unsharded leftovers
    into the rerun's .grad (0.129 off on two gloo ranks)."""
    from twobp_autograd import flush

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    plain = copy.deepcopy(model)
    twobp.patch(model)
    for net in (model, plain):
        fully_shard(net[0])
        fully_shard(net[2])
        fully_shard(net)  # the root holds the head, computed first and reduced last
    run_group, runs = flush._run_group, [0]

    def failing_third(group, options):
        runs[0] += 1
        if runs[0] == 3:
            raise torch.OutOfMemoryError("the first layer's kernel ran out of memory")
        return run_group(group, options)

    x = torch.randn(3, 4)
    model(x).pow(2).sum().backward()
    monkeypatch.setattr(flush, "_run_group", failing_third)
    with pytest.raises(flush.PartlyDelivered, match="zero_grad"):
        twobp.flush_weight_grads()
    monkeypatch.setattr(flush, "_run_group", run_group)
    model.zero_grad()
    for net in (model, plain):
        net(x).pow(2).sum().backward()
    twobp.flush_weight_grads()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad.full_tensor(), msg=name)
