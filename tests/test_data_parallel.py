"""GradientSynchroniser against DDP on the unpatched model, and pipeline x data parallel
against one process.

Each scenario runs once in spawned gloo ranks (starting processes is the slow part) and
returns one result per rank; the tests below read them. Every rank gets different data, so a
synchroniser that reduced nothing (or summed instead of averaging) would not match DDP.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import warnings
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

import twobp_autograd
import twobp_autograd as twobp
from tests.ranks import run_scenario
from tests.utils import TOLERANCES, Scale, assert_grads_match
from twobp_autograd.data_parallel import GradientSynchroniser
from twobp_autograd.pipeline.runtime import PipelineError, PipelineRuntime, RankMetrics, StepReport
from twobp_autograd.pipeline.schedules import default_num_micro_batches, placement, schedule
from twobp_autograd.pipeline.split import split_model as split

VOCAB, WIDTH, STEPS, MICRO_BATCHES = 11, 8, 2, 2


# -- spawning --------------------------------------------------------------------------------


# -- a model with every case at once ---------------------------------------------------------


class Net(nn.Module):
    """Patched layers, an unpatched module, BatchNorm buffers, a tied embedding/output weight,
    a weight used both by its patched Linear and directly (half deferred, half immediate), a
    layer nobody uses, and one only some ranks use."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.scale = Scale(2 * WIDTH)
        self.norm = nn.BatchNorm1d(2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.unused = nn.Linear(3, 3)
        self.sometimes = nn.Linear(WIDTH, WIDTH)
        self.use_sometimes = False

    def forward(self, tokens: Tensor) -> Tensor:
        e = self.embed(tokens)  # (batch, WIDTH)
        h = self.up(e) + 0.5 * (e @ self.up.weight.t())
        h = self.down(F.gelu(self.norm(self.scale(h))))
        if self.use_sometimes:
            h = h + self.sometimes(h)
        return self.head(h)


def _batch(rank: int, step: int, micro: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randint(0, VOCAB, (6,), generator=g), torch.randint(0, VOCAB, (6,), generator=g)


def _grads(model: nn.Module) -> dict[str, Tensor | None]:
    return {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}


def _versus_ddp(rank: int) -> dict:
    torch.manual_seed(rank)  # different initial weights per rank: both must take rank 0's
    model = Net()
    reference = copy.deepcopy(model)
    model.use_sometimes = reference.use_sometimes = rank == 0
    twobp.patch(model)
    sync = GradientSynchroniser(model, bucket_bytes=256)  # many buckets
    ddp = DistributedDataParallel(reference, find_unused_parameters=True)
    optimizer, ddp_optimizer = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ddp.parameters(), lr=0.1)
    result: dict = {"steps": [], "untouched_before_sync": [], "queued": [], "launched_in_flush": []}
    launches_seen: list[int] = []

    def record_launches(_: Tensor) -> None:
        if sync._armed:
            launches_seen.append(sync.launched)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(record_launches)
    for step in range(STEPS):
        launches_seen.clear()
        for micro in range(MICRO_BATCHES):
            x, y = _batch(rank, step, micro)
            F.cross_entropy(model(x), y).backward()
            if micro < MICRO_BATCHES - 1:
                with ddp.no_sync():
                    F.cross_entropy(ddp(x), y).backward()
            else:
                F.cross_entropy(ddp(x), y).backward()
        result["queued"].append(twobp.pending().jobs)
        result["untouched_before_sync"].append(model.down.weight.grad is None and model.embed.weight.grad is None)
        sync.synchronise()
        # A bucket was in flight while the flush still delivered gradients: the overlap.
        result["launched_in_flush"].append(any(0 < n < sync.num_buckets for n in launches_seen))
        result["steps"].append((_grads(model), _grads(reference)))
        optimizer.step()
        ddp_optimizer.step()
        optimizer.zero_grad()
        ddp_optimizer.zero_grad()
    result["params"] = tuple({n: p.detach().clone() for n, p in net.named_parameters()} for net in (model, reference))
    result["buffers"] = (dict(model.named_buffers()), dict(reference.named_buffers()))
    return result


# -- pipeline x data parallel ------------------------------------------------------------------

# Several stages per rank too: each stage has its queue, and the synchroniser must not take the
# first stage's final flush for the end of the other's work (it reduced partial gradients, 0.19 off).
#: (schedule, 2BP on, each stage's queue capped): capped at 0, every backward's work is flushed
#: early, so a rank's other stage has nothing queued while its backwards are still to come (its
#: gradients were taken as final at the first stage's last flush: 2e-2 off, silently).
PIPELINE_SETTINGS = [
    ("gpipe", True, False), ("1f1b-2", True, False), ("zb", True, False), ("1f1b-1", False, False),
    ("zbv", True, False), ("interleaved-1f1b", True, False),
    ("1f1b-2", True, True), ("zbv", True, True), ("interleaved-1f1b", True, True),
]  # fmt: skip
PIPELINE_IDS = [
    f"{name}-{'2bp' if twobp else 'plain'}{'-capped' if capped else ''}" for name, twobp, capped in PIPELINE_SETTINGS
]


def _mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(4, 8), nn.LayerNorm(8), nn.GELU(), Scale(8),
        nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 3),
    )  # fmt: skip


def _pipeline_data(replica: int, step: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(100 * replica + step)
    return torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)


def _pipeline_times_data(rank: int, stages: int = 2, replicas: int = 2) -> dict:
    mesh = dist.device_mesh.init_device_mesh("cpu", (replicas, stages), mesh_dim_names=("dp", "pp"))
    replica, stage_index = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    results = {}
    for (name, twobp_on, capped), setting_id in zip(PIPELINE_SETTINGS, PIPELINE_IDS, strict=True):
        torch.manual_seed(0)
        model = _mlp()
        reference = copy.deepcopy(model)
        owners = placement(name, stages)
        mine = [index for index, owner in enumerate(owners) if owner == stage_index]
        held = {index: split(model, len(owners))[index] for index in mine}
        stage = nn.ModuleList(held.values())
        sync = GradientSynchroniser(stage, group=mesh.get_group("dp"), bucket_bytes=64)
        m = default_num_micro_batches(name, stages)
        queues = {index: twobp.WeightGradQueue(max_pending_bytes=0) for index in mine} if capped else None
        runtime = PipelineRuntime(
            held if len(held) > 1 else held[stage_index], schedule(name, stages, m, twobp_on)[stage_index],
            num_micro_batches=m, loss_fn=F.mse_loss, twobp=twobp_on, group=mesh.get_group("pp"), timeout=30.0,
            grad_sync=sync, placement=owners,
            queue=queues if queues is None or len(held) > 1 else queues[stage_index],
        )  # fmt: skip
        deferred = []
        for step in range(2):  # the second step launches in the agreed order
            for p in model.parameters():
                p.grad = None
            reference.zero_grad(set_to_none=True)
            inputs, targets = _pipeline_data(replica, step)
            report = runtime.step(inputs if stage_index == 0 else None, targets if owners[-1] == stage_index else None)
            own = report.ranks[stage_index] if isinstance(report, StepReport) else report
            assert isinstance(own, RankMetrics)
            deferred.append(own.deferred_jobs)
            for r in range(replicas):  # one process: every replica's micro-batches, mean over all
                x_all, y_all = _pipeline_data(r, step)
                for x, y in zip(x_all.tensor_split(m), y_all.tensor_split(m), strict=True):
                    (F.mse_loss(reference(x), y) / (m * replicas)).backward()
        reference_stage = nn.ModuleList(split(reference, len(owners))[index] for index in mine)
        results[setting_id] = {"deferred": deferred, "grads": (_grads(stage), _grads(reference_stage))}
        sync.close()
    return results


# -- the tests ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def versus_ddp(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_scenario(_versus_ddp, 2, str(tmp_path_factory.mktemp("ddp")))


@pytest.fixture(scope="module")
def pipeline_times_data(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_scenario(_pipeline_times_data, 4, str(tmp_path_factory.mktemp("pp_dp")))


def _assert_same(ours: dict[str, Tensor | None], theirs: dict[str, Tensor | None], what: str) -> None:
    rtol, atol = TOLERANCES[torch.float32]
    assert ours.keys() == theirs.keys()
    for name in ours:
        a, b = ours[name], theirs[name]
        assert (a is None) == (b is None), f"{what} {name}: ours is {a is None and 'None' or 'set'}, DDP's is not"
        if a is not None:
            label = f"{what} {name}"
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m, label=label: f"{label}: {m}")


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("step", range(STEPS), ids=lambda s: f"step{s}")
def test_gradients_equal_ddp_on_the_unpatched_model(versus_ddp: list[dict], rank: int, step: int) -> None:
    result = versus_ddp[rank]
    assert result["queued"][step] > 0, "nothing was deferred: the patch fell back to plain autograd"
    assert result["untouched_before_sync"][step], "a deferred .grad was written before the synchroniser's flush"
    ours, theirs = result["steps"][step]
    assert ours["unused.weight"] is None  # used by no rank
    assert theirs["sometimes.weight"] is not None  # used by rank 0 only: averaged everywhere
    _assert_same(ours, theirs, f"rank {rank} step {step}")


@pytest.mark.parametrize("rank", [0, 1])
def test_parameters_and_buffers_after_steps_equal_ddp(versus_ddp: list[dict], rank: int) -> None:
    params, buffers = versus_ddp[rank]["params"], versus_ddp[rank]["buffers"]
    _assert_same(*params, f"rank {rank} parameter")
    _assert_same(*buffers, f"rank {rank} buffer")
    _assert_same(versus_ddp[0]["params"][0], params[0], f"rank {rank} vs rank 0")


def test_reduction_overlaps_the_flush(versus_ddp: list[dict]) -> None:
    assert all(all(r["launched_in_flush"]) for r in versus_ddp)


@pytest.mark.parametrize("setting", PIPELINE_IDS)
def test_pipeline_times_data_parallel_equals_one_process(pipeline_times_data: list[dict], setting: str) -> None:
    for rank, results in enumerate(pipeline_times_data):
        result = results[setting]
        if setting.endswith("-2bp"):  # capped at 0, every job is flushed at once
            assert all(d > 0 for d in result["deferred"]), f"rank {rank}: nothing was deferred"
        _assert_same(*result["grads"], f"rank {rank}")


def test_join_over_uneven_inputs_is_refused_with_the_way_out(one_rank_group: None) -> None:
    """Join asks its joinables for a hook that shadows the others' reductions; without one the
    error was an AttributeError from inside Join."""
    from torch.distributed.algorithms.join import Join

    synchroniser = GradientSynchroniser(twobp.patch(nn.Linear(3, 2)))
    with pytest.raises(RuntimeError, match="twobp: GradientSynchroniser does not take part in Join.*drop_last"):
        Join([synchroniser])


def test_synchronising_another_queue_than_the_forwards_used_is_refused(one_rank_group: None) -> None:
    """The forwards ran under use_queue(queue), the synchroniser flushed the default one: its
    reductions would start before those gradients exist, and they would land unreduced. Refused,
    naming the queue to pass; passing it gives plain's gradients (one rank: the mean is its own)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    reference = copy.deepcopy(model)
    synchroniser = GradientSynchroniser(twobp.patch(model))
    queue = twobp.WeightGradQueue()
    x = torch.randn(5, 3)
    with twobp.use_queue(queue):
        model(x).pow(2).sum().backward()
    with pytest.raises(RuntimeError, match=r"twobp: GradientSynchroniser: 4 parameter.*synchronise\(queue\)"):
        synchroniser.synchronise()
    synchroniser.synchronise(queue)
    reference(x).pow(2).sum().backward()
    assert_grads_match(model, reference)


def _backward_of_a_half_deferred_model() -> tuple[nn.Module, nn.Module, GradientSynchroniser, Tensor]:
    """A model whose last layer is plain (its bucket launches in backward), after one backward;
    its unpatched copy, its synchroniser and the input."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    reference = copy.deepcopy(model)
    synchroniser = GradientSynchroniser(twobp.patch(model, exclude=["2"]), bucket_bytes=64)
    x = torch.randn(4, 4, dtype=torch.float64)
    model(x).pow(2).sum().backward()
    return model, reference, synchroniser, x


def test_a_step_whose_synchronise_failed_leaves_nothing_to_the_next(one_rank_group: None) -> None:
    """The flush failed (a saved input refilled in place) after a plain layer's bucket was
    launched: the next step's finish() waited on that reduction and wrote the failed step's
    gradient back (0.13 off on 2 ranks, then every parameter). A failed flush forgets its step."""
    model, reference, synchroniser, x = _backward_of_a_half_deferred_model()
    x.add_(1.0)  # a loader refilling its buffer before the step ends
    with pytest.raises(RuntimeError, match="twobp: a tensor that a queued weight-gradient job needs"):
        synchroniser.synchronise()
    model.zero_grad()
    x = torch.randn(4, 4, dtype=torch.float64)
    model(x).pow(2).sum().backward()
    synchroniser.synchronise()
    reference(x).pow(2).sum().backward()
    assert_grads_match(model, reference, dtype=torch.float64)


def test_a_synchronise_that_failed_before_any_gradient_keeps_its_work_for_the_retry(
    one_rank_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flush under the synchroniser that raised before anything reached .grad (a refusal that
    says the work stays queued, a kernel out of memory) dropped its work: synchronised again,
    every deferred .grad stayed None. The work stays queued; the retry equals plain."""
    model, reference, synchroniser, x = _backward_of_a_half_deferred_model()
    queued = twobp.pending().jobs
    run_group = twobp_autograd.flush._run_group

    def out_of_memory_once(*args: object, **kwargs: object) -> object:
        monkeypatch.setattr(twobp_autograd.flush, "_run_group", run_group)
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(twobp_autograd.flush, "_run_group", out_of_memory_once)
    with pytest.raises(RuntimeError, match="out of memory"):
        synchroniser.synchronise()
    assert twobp.pending().jobs == queued > 0
    synchroniser.synchronise()
    reference(x).pow(2).sum().backward()
    assert_grads_match(model, reference, dtype=torch.float64)


@pytest.mark.parametrize("setting", ["capped-queue", "nothing-deferred", "flushed-by-the-caller"])
def test_an_optimizer_step_before_synchronise_is_refused(one_rank_group: None, setting: str) -> None:
    """Under DDP the gradients are averaged as backward ends. Here the step before synchronise()
    was refused only while weight work stayed queued: with a capped queue (flushed early), no
    deferred layer, or a flush of the caller's, each rank stepped on its own gradients and the
    replicas drifted apart (0.05 on 2 ranks)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    twobp.patch(model, exclude=["0", "2"] if setting == "nothing-deferred" else [])
    synchroniser = GradientSynchroniser(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    queue = twobp.WeightGradQueue(max_pending_bytes=0 if setting == "capped-queue" else None)
    with twobp.use_queue(queue), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # patch() finding nothing to defer says so
        model(torch.randn(5, 3)).pow(2).sum().backward()
    if setting == "flushed-by-the-caller":
        queue.flush()
    assert len(queue) == 0
    with pytest.raises(RuntimeError, match=r"twobp: optimizer.step\(\) over parameters of a GradientSynchroniser"):
        optimizer.step()
    synchroniser.synchronise(queue)
    optimizer.step()  # synchronised: the step runs


def test_a_step_with_a_closure_is_checked_after_the_closure(one_rank_group: None) -> None:
    """step(closure) runs the step's last backward, and its synchronise(), inside the step (LBFGS;
    PyTorch Lightning with accumulated micro-batches): checked before the closure, a synchronised
    step was refused; and a closure that did not synchronise stepped on this rank's gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    reference = copy.deepcopy(model)
    twobp.patch(model)
    synchroniser = GradientSynchroniser(model)
    xs = [torch.randn(5, 3) for _ in range(3)]
    for net in (model, reference):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        for x in xs[:-1]:  # accumulated micro-batches, outside the step
            net(x).pow(2).sum().backward()

        def closure(net: nn.Module = net) -> Tensor:
            loss = net(xs[-1]).pow(2).sum()
            loss.backward()
            if net is model:
                synchroniser.synchronise()
            return loss

        optimizer.step(closure)
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs)

    def unsynchronised() -> Tensor:
        loss = model(xs[0]).pow(2).sum()
        loss.backward()
        twobp.flush_weight_grads()
        return loss

    with pytest.raises(RuntimeError, match=r"twobp: optimizer.step\(\) over parameters of a GradientSynchroniser"):
        torch.optim.SGD(model.parameters(), lr=0.1).step(unsynchronised)
    synchroniser.close()


def test_a_replaced_synchroniser_still_held_is_named_in_the_refusal(one_rank_group: None) -> None:
    """A synchroniser replaced by a new one (README: build a new one after unfreezing) but still
    referenced keeps its hooks: its gradients are never synchronised, so every step is refused;
    the error says to close() it, not only to synchronise."""
    model = twobp.patch(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
    replaced = GradientSynchroniser(model)
    synchroniser = GradientSynchroniser(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(5, 3)).pow(2).sum().backward()
    synchroniser.synchronise()
    with pytest.raises(RuntimeError, match=r"2 synchronisers cover them.*close\(\) it"):
        optimizer.step()
    replaced.close()
    optimizer.step()
    synchroniser.close()


@pytest.mark.parametrize("reader", ["clip_grad_norm_", "clip_grad_value_", "unscale_"])
def test_gradients_read_before_synchronise_are_refused_with_nothing_queued(one_rank_group: None, reader) -> None:
    """Clipping (DDP's order: backward, clip, step) or a scaler's unscale_ before synchronise() was
    refused only while weight work was queued: with a capped queue, or nothing deferred, each rank
    clipped by its own norm (0.65 and 8.9 where the mean's is 4.5) or found its own infs, and the
    synchroniser averaged what they left."""
    model = twobp.patch(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
    synchroniser = GradientSynchroniser(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    queue = twobp.WeightGradQueue(max_pending_bytes=0)  # flushed as it fills
    scaler = torch.amp.GradScaler("cpu")
    with twobp.use_queue(queue):
        scaler.scale(model(torch.randn(5, 3)).pow(2).sum()).backward()
    assert not twobp.has_queued_work(model[0].weight)
    read = {
        "clip_grad_norm_": lambda: nn.utils.clip_grad_norm_(model.parameters(), 0.1),
        "clip_grad_value_": lambda: nn.utils.clip_grad_value_(model.parameters(), 0.1),
        "unscale_": lambda: scaler.unscale_(optimizer),
    }[reader]
    refusal = "over parameters of a GradientSynchroniser whose gradients a backward"
    with pytest.raises(RuntimeError, match=refusal) as refused:
        read()
    assert "closure" not in str(refused.value)  # a step's advice: clipping has no closure
    synchroniser.synchronise(queue)
    read()
    optimizer.step()
    synchroniser.close()


def test_the_step_check_tells_disjoint_synchronisers_zeroed_gradients_and_hooks_apart(one_rank_group: None) -> None:
    """Two synchronisers over disjoint halves are no replaced one (closing one would leave its half
    unaveraged); gradients zeroed since the backward make a step that changes nothing (plain and
    DDP run it); a step from a post-accumulate-grad hook runs inside synchronise() itself."""
    model = twobp.patch(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
    first, second = GradientSynchroniser(model[0]), GradientSynchroniser(model[2])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(5, 3)).pow(2).sum().backward()
    first.synchronise()
    with pytest.raises(RuntimeError, match=r"twobp: optimizer.step\(\) over parameters") as refused:
        optimizer.step()
    assert "close()" not in str(refused.value)
    optimizer.zero_grad()  # set_to_none: nothing to step on
    optimizer.step()
    first.close()
    second.close()

    synchroniser = GradientSynchroniser(model)
    optimizers = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}

    def step_in_backward(param: Tensor) -> None:
        if not twobp.has_queued_work(param):
            optimizers[param].step()

    handles = [p.register_post_accumulate_grad_hook(step_in_backward) for p in model.parameters()]
    model(torch.randn(5, 3)).pow(2).sum().backward()
    with pytest.raises(RuntimeError, match="optimizer-in-backward.*do not combine"):
        synchroniser.synchronise()
    for handle in handles:
        handle.remove()
    synchroniser.close()
    model.zero_grad()


class _Shift(nn.Module):
    """A parameter no rule defers: its gradient accumulates, and its hooks run, in backward."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(4))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.shift


def test_a_step_in_backward_hooked_before_the_synchroniser_is_refused(one_rank_group: None) -> None:
    """The optimizer-in-backward hook registered before the synchroniser: the synchroniser moves
    its own hook after the user's, so from the second step on the user's step ran before anything
    marked the gradients unsynchronised, on each rank's own gradient (replicas 0.6 apart)."""
    model = twobp.patch(nn.Sequential(nn.Linear(3, 4), _Shift()))
    shift = model[1].shift
    optimizer = torch.optim.SGD([shift], lr=0.1)
    shift.register_post_accumulate_grad_hook(lambda p: optimizer.step())
    synchroniser = GradientSynchroniser(model)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="optimizer-in-backward.*do not combine"):
            model(torch.randn(5, 3)).pow(2).sum().backward()
        twobp.discard_weight_grads()
        model.zero_grad()

    # A step on synchronised gradients from the hook of another backward (of a parameter outside
    # the model) runs, as in plain: refusing every step inside a backward refused it.
    outside = nn.Parameter(torch.ones(2))
    outside.register_post_accumulate_grad_hook(lambda p: optimizer.step())
    shift.grad = torch.ones(4)
    synchroniser.synchronise()
    outside.sum().backward()
    assert torch.equal(shift, torch.full((4,), -0.1)), "stepped once, on the mean"
    synchroniser.close()


@pytest.mark.parametrize("bucket_bytes", [4, 100_000], ids=["bucket-per-parameter", "one-bucket"])
def test_a_hook_registered_after_the_synchroniser_edits_what_is_reduced(one_rank_group: None, bucket_bytes) -> None:
    """A post-accumulate-grad hook clamping each gradient, registered after the synchroniser:
    the synchroniser's hook ran first at the flush, launched its bucket with the unclamped
    gradient and wrote that mean over the clamp (0.58 off). DDP reduces what the hooks leave."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    reference = copy.deepcopy(model)
    synchroniser = GradientSynchroniser(twobp.patch(model), bucket_bytes=bucket_bytes)

    def clamp(param: Tensor) -> None:
        if param.grad is not None and not twobp.has_queued_work(param):
            param.grad.clamp_(-0.05, 0.05)

    for net in (model, reference):
        for p in net.parameters():
            p.register_post_accumulate_grad_hook(clamp)
    x = torch.randn(5, 3)
    model(x).pow(2).sum().backward()
    synchroniser.synchronise()
    reference(x).pow(2).sum().backward()
    assert_grads_match(model, reference)


@pytest.mark.parametrize("broadcast_buffers", [True, False])
def test_rank_local_buffers_are_left_alone_without_broadcast_buffers(
    one_rank_group: None, monkeypatch, broadcast_buffers
) -> None:
    """As DDP: broadcast_buffers=False leaves each rank's buffers as they are from the start
    (they were overwritten with rank 0's when the synchroniser was built)."""
    from twobp_autograd import data_parallel

    broadcast: list[int] = []
    real = data_parallel.broadcast_tensors

    def recorded(tensors, **options):
        tensors = list(tensors)
        broadcast.extend(map(id, tensors))
        return real(tensors, **options)

    monkeypatch.setattr(data_parallel, "broadcast_tensors", recorded)
    model = twobp.patch(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)))
    GradientSynchroniser(model, broadcast_buffers=broadcast_buffers)
    assert all(id(p) in broadcast for p in model.parameters())
    assert all((id(b) in broadcast) == broadcast_buffers for b in model.buffers())


def test_a_synchroniser_over_a_ranks_stages_broadcasts_all_their_buffers_each_step(
    one_rank_group: None, monkeypatch
) -> None:
    """Over an nn.ModuleList of a rank's stages (as README advises for zbv): the pipeline calls
    the stages, never the list, so its pre-hook never fired and every replica's BatchNorm
    statistics drifted from rank 0's after the first step (1.78 off at the second), silently."""
    from twobp_autograd import data_parallel

    broadcast: list[list[int]] = []
    real = data_parallel.broadcast_tensors

    def recorded(tensors, **options):
        tensors = list(tensors)
        broadcast.append([id(t) for t in tensors])
        return real(tensors, **options)

    stages = nn.ModuleList(twobp.patch(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))) for _ in range(2))
    sync = GradientSynchroniser(stages)
    monkeypatch.setattr(data_parallel, "broadcast_tensors", recorded)
    for _ in range(2):
        stages[1](stages[0](torch.randn(4, 3))).sum().backward()
        sync.synchronise()
    buffers = [id(b) for b in stages.buffers()]
    assert [calls for calls in broadcast if set(calls) & set(buffers)] == [buffers, buffers]


def test_bucket_bytes_written_as_a_float_works(one_rank_group: None) -> None:
    """bucket_bytes=25e6 (as DDP users write bucket_cap_mb) made every flush fail on its float
    delivery bucket, after the work was taken: every .grad None."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    reference = copy.deepcopy(model)
    synchroniser = GradientSynchroniser(twobp.patch(model), bucket_bytes=25e6)
    x = torch.randn(5, 3)
    model(x).pow(2).sum().backward()
    synchroniser.synchronise()
    reference(x).pow(2).sum().backward()
    assert_grads_match(model, reference)


def test_a_dropped_synchroniser_and_its_model_are_freed(one_rank_group: None) -> None:
    """Its hooks on the parameters held it, and it the parameters: PyTorch's collector does not
    look into post-accumulate-grad hooks, so every model a sweep built stayed alive with its
    gradients (the whole model per trial)."""
    model = twobp.patch(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)))
    synchroniser = GradientSynchroniser(model)
    model(torch.randn(5, 3)).pow(2).sum().backward()
    synchroniser.synchronise()
    alive = [weakref.ref(model), weakref.ref(synchroniser)]
    del model, synchroniser
    gc.collect()
    assert [ref() for ref in alive] == [None, None]


def test_a_sparse_gradient_is_refused_naming_the_fix(one_rank_group: None) -> None:
    model = twobp.patch(nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2)))
    with pytest.raises(TypeError, match=r"twobp: GradientSynchroniser reduces dense gradients only.*sparse=False"):
        GradientSynchroniser(model)  # at construction, not at a flush that had already taken the work


def _skipped_step(rank: int) -> dict:
    """Rank 1 skips the second step; rank 0's first training forward broadcasts BatchNorm's
    buffers, which waited without a timeout (until the peer's process ended)."""
    import time

    torch.manual_seed(0)
    model = twobp.patch(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)))
    synchroniser = GradientSynchroniser(model, timeout=2.0)
    model(torch.randn(6, 4)).sum().backward()
    synchroniser.synchronise()
    if rank == 1:
        time.sleep(8.0)
        return {}
    start = time.perf_counter()
    try:
        model(torch.randn(6, 4)).sum().backward()
        synchroniser.synchronise()
    except RuntimeError as error:
        return {"error": str(error), "elapsed": time.perf_counter() - start}
    return {"error": None}


def test_a_rank_that_skips_a_step_ends_the_others_within_the_timeout(tmp_path) -> None:
    waiting, _ = run_scenario(_skipped_step, 2, str(tmp_path))
    assert waiting["error"] is not None and waiting["elapsed"] < 6.0, waiting
    assert waiting["error"].startswith("twobp: GradientSynchroniser: a collective"), waiting


def _grad_dtype_used_on_one_rank(rank: int, bucket_bytes: int | None) -> dict:
    """A layer only rank 0 uses (a branch its batch takes), parameters with an fp64 grad_dtype."""
    torch.manual_seed(0)
    model = twobp.patch(nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 2)]))
    for p in model.parameters():
        p.grad_dtype = torch.float64
    options = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    synchroniser = GradientSynchroniser(model, timeout=10.0, **options)
    torch.manual_seed(1 + rank)
    h = model[0](torch.randn(3, 4))
    (model[1](h) if rank == 0 else h).sum().backward()
    synchroniser.synchronise()
    return {name: (None if p.grad is None else p.grad.dtype) for name, p in model.named_parameters()}


@pytest.mark.parametrize("bucket_bytes", [None, 1], ids=["one-bucket", "bucket-per-parameter"])
def test_a_gradient_in_its_grad_dtype_reaches_the_rank_that_made_none(tmp_path, bucket_bytes) -> None:
    """The rank without a gradient of its own got the mean in the parameter's dtype, which
    PyTorch refuses to assign to a parameter with another grad_dtype: both ranks ended. A bucket
    of such parameters alone was filled with zeros in the parameter's dtype there, fp64 on the
    other rank: the all-reduce met buffers of different sizes."""
    scenario = functools.partial(_grad_dtype_used_on_one_rank, bucket_bytes=bucket_bytes)
    for result in run_scenario(scenario, 2, str(tmp_path)):
        assert result == dict.fromkeys(["0.weight", "0.bias", "1.weight", "1.bias"], torch.float64), result


def _synchronised_under_inference_mode(rank: int) -> dict:
    """A layer only rank 0 uses; the synchronise() under inference_mode, then a step and a second
    backward accumulating without zeroing, as plain allows."""
    torch.manual_seed(0)
    model = twobp.patch(nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 2)]))
    synchroniser = GradientSynchroniser(model, timeout=10.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        h = model[0](torch.randn(3, 4))
        (model[1](h) if rank == 0 or step == 1 else h).sum().backward()
        with torch.inference_mode():
            synchroniser.synchronise()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    return {name: p.grad.is_inference() for name, p in model.named_parameters()}


def test_a_gradient_written_back_under_inference_mode_is_no_inference_tensor(tmp_path) -> None:
    """The rank without a gradient of its own got the mean in a .grad made under the caller's
    inference_mode: an inference tensor, which the next zero_grad(set_to_none=False) refused."""
    for result in run_scenario(_synchronised_under_inference_mode, 2, str(tmp_path)):
        assert result == dict.fromkeys(["0.weight", "0.bias", "1.weight", "1.bias"], False), result


def _replicas_training_other_parameters(rank: int) -> dict:
    torch.manual_seed(0)
    model = twobp.patch(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    if rank == 1:
        model[0].bias.requires_grad_(False)
    try:
        GradientSynchroniser(model, timeout=10.0)
    except RuntimeError as error:
        return {"error": str(error)}
    return {"error": None}


def test_replicas_that_train_other_parameters_are_refused_at_construction(tmp_path) -> None:
    """As DDP checks: replica 1 froze a bias replica 0 trains; the first bucket's all-reduce
    met sizes that did not match, and gloo aborted both processes."""
    for result in run_scenario(_replicas_training_other_parameters, 2, str(tmp_path)):
        assert result["error"] and "do not train the same parameters" in result["error"], result


def _unfrozen_after_building(rank: int) -> dict:
    import warnings

    torch.manual_seed(0)
    model = twobp.patch(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    model[0].requires_grad_(False)
    synchroniser = GradientSynchroniser(model)
    model[0].requires_grad_(True)  # trains from now on, unknown to the synchroniser
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(3, 4) + rank).sum().backward()
        synchroniser.synchronise()
    return {"warnings": [str(w.message) for w in caught]}


def test_a_parameter_unfrozen_after_the_synchroniser_was_built_is_warned_about(tmp_path) -> None:
    """It is not averaged (as under DDP): the ranks' copies drifted apart (0.14 in 3 steps), silently."""
    for result in run_scenario(_unfrozen_after_building, 2, str(tmp_path)):
        assert any("not averaged" in w for w in result["warnings"]), result


@pytest.mark.parametrize("cap", [0, None], ids=["capped", "uncapped"])
def test_a_weight_tied_across_a_ranks_stages_waits_for_the_last_of_their_backwards(
    one_rank_group: None, cap: int | None
) -> None:
    """One rank holds both stages, which share a bias. zbv's actions with the second stage's
    last W moved before the first stage's last backward: that flush took the shared bias as
    final (capped at 0, nothing was queued for it; uncapped, the flush delivered it), reduced it
    then, and the first stage's last contribution was lost when the mean was written back."""
    name = "zbv"
    torch.manual_seed(0)
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    second.bias = first.bias
    reference = nn.Sequential(copy.deepcopy(first), nn.Tanh(), copy.deepcopy(second))
    reference[2].bias = reference[0].bias
    stages = {0: nn.Sequential(first, nn.Tanh()), 1: nn.Sequential(second)}
    m = default_num_micro_batches(name, 1)
    actions = list(schedule(name, 1, m, True)[0])
    last_w_of_second = max(i for i, a in enumerate(actions) if str(a).startswith("W") and str(a).endswith("@s1"))
    last_i_of_first = max(i for i, a in enumerate(actions) if str(a).startswith("I") and str(a).endswith("@s0"))
    actions.insert(last_i_of_first, actions.pop(last_w_of_second))
    runtime = PipelineRuntime(
        stages, actions, num_micro_batches=m, loss_fn=F.mse_loss, twobp=True,
        group=dist.group.WORLD, timeout=30.0, placement=placement(name, 1),
        grad_sync=GradientSynchroniser(nn.ModuleList(stages.values()), bucket_bytes=4),  # one per bucket
        queue={index: twobp.WeightGradQueue(max_pending_bytes=cap) for index in stages},
    )  # fmt: skip
    x, y = torch.randn(2 * m, 4), torch.randn(2 * m, 4)
    runtime.step(x, y)
    for xs, ys in zip(x.tensor_split(m), y.tensor_split(m), strict=True):
        (F.mse_loss(reference(xs), ys) / m).backward()
    for ours, theirs in ((first, reference[0]), (second, reference[2])):
        for name_, p in ours.named_parameters():
            torch.testing.assert_close(p.grad, dict(theirs.named_parameters())[name_].grad, msg=name_)


def test_a_gradient_sync_whose_flush_takes_no_params_is_refused_when_the_runtime_is_built(
    one_rank_group: None,
) -> None:
    class OldSync:
        def flush(self, queue, tags):  # the two-argument form
            queue.flush(tags)

        def finish(self) -> None: ...

        def reset(self) -> None: ...

    with pytest.raises(TypeError, match=r"twobp: OldSync.flush takes \(queue, tags\)"):
        PipelineRuntime(
            nn.Linear(4, 4), schedule("gpipe", 1, 2, True)[0], num_micro_batches=2, loss_fn=F.mse_loss,
            group=dist.group.WORLD, grad_sync=OldSync(),
        )  # fmt: skip


def _retry_after_a_refusal_with_a_branch_on_one_rank(rank: int) -> dict:
    """Forwards under use_queue(queue), synchronise() on the default queue refused, then the
    retry the refusal names, synchronise(queue); a branch only rank 0's batch takes."""
    torch.manual_seed(0)
    model = nn.ModuleDict({name: nn.Linear(6, 6, bias=False) for name in ("first", "second", "branch")}).double()
    reference = copy.deepcopy(model)
    twobp.patch(model)
    queue = twobp.WeightGradQueue()
    synchroniser = GradientSynchroniser(model, bucket_bytes=1, timeout=10.0)

    def loss(net: nn.ModuleDict, data_rank: int) -> Tensor:
        x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(data_rank))
        h = net["second"](torch.tanh(net["first"](x)))
        return (h + net["branch"](h) if data_rank == 0 else h).pow(2).mean()

    with twobp.use_queue(queue):
        loss(model, rank).backward()
    for data_rank in range(2):
        (loss(reference, data_rank) / 2).backward()
    try:
        synchroniser.synchronise()
    except RuntimeError as error:
        refused = str(error)
    synchroniser.synchronise(queue)
    return {
        "refused": refused,
        "off": {n: None if p.grad is None else float((p.grad - q.grad).abs().max())
                for (n, p), q in zip(model.named_parameters(), reference.parameters(), strict=True)},
    }  # fmt: skip


def test_a_retried_synchronise_pairs_every_ranks_buckets_where_ranks_use_other_parameters(tmp_path) -> None:
    """Before the refusal, each rank had launched the buckets its unused parameters made ready at
    once, other prefixes on each rank; forgotten, they were still sent, and the retry's
    reductions paired with them: gradients off by up to 0.158, then a timeout."""
    for result in run_scenario(_retry_after_a_refusal_with_a_branch_on_one_rank, 2, str(tmp_path)):
        assert result["refused"].startswith("twobp:"), result
        assert all(off is not None and off < 1e-12 for off in result["off"].values()), result


def _rerun_after_one_rank_refused_with_buffers(rank: int) -> dict:
    """Rank 0's forwards ran under use_queue(queue): its synchronise() is refused, rank 1's raises
    ReductionFailed; both drop the step and run it again, BatchNorm buffers broadcast."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3)).double()
    reference = copy.deepcopy(model)
    twobp.patch(model)
    synchroniser = GradientSynchroniser(model, bucket_bytes=1, timeout=10.0)
    queue = twobp.WeightGradQueue()

    def data(data_rank: int, step: int) -> Tensor:
        return torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * step + data_rank))

    with twobp.use_queue(queue) if rank == 0 else contextlib.nullcontext():
        model(data(rank, 1)).pow(2).mean().backward()
    try:
        synchroniser.synchronise()
    except RuntimeError as error:
        failed = type(error).__name__
    model.zero_grad()
    model(data(rank, 2)).pow(2).mean().backward()
    synchroniser.synchronise()
    for data_rank in range(2):
        (reference(data(data_rank, 2)).pow(2).mean() / 2).backward()
    pairs = zip(model.parameters(), reference.parameters(), strict=True)
    return {"failed": failed, "off": [float((p.grad - q.grad).abs().max()) for p, q in pairs]}


def test_every_rank_runs_the_next_step_after_one_ranks_synchronise_failed(tmp_path) -> None:
    """The failed rank had skipped finish(), so its next forward did not broadcast the buffers
    while its peer's did: that broadcast paired with a reduction, and every rank timed out."""
    results = run_scenario(_rerun_after_one_rank_refused_with_buffers, 2, str(tmp_path))
    assert [r["failed"] for r in results] == ["RuntimeError", "ReductionFailed"], results
    for result in results:
        assert max(result["off"]) < 1e-12, result


def _pipeline_replica_failing_alone(rank: int) -> dict:
    """A 2 x 1 mesh (two replicas of a one-stage pipeline); replica 1 fails steps 0, 2 and 4 on
    its own (its loss, its targets refused before the schedule, a hook inside its synchroniser's
    flush) and both go on; steps 1, 3 and 5 must be the mean of both replicas' batches."""
    mesh = dist.device_mesh.init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "pp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3)).double()
    reference = copy.deepcopy(model)
    twobp.patch(model)
    sync = GradientSynchroniser(model, group=mesh.get_group("dp"), bucket_bytes=64, timeout=20.0)
    step_now, m = [0], 2

    def loss_fn(output: Tensor, target: Tensor) -> Tensor:
        if rank == 1 and step_now[0] == 0:
            raise ValueError("the loss failed")
        return F.mse_loss(output, target)

    def hook(p: Tensor) -> None:
        if rank == 1 and step_now[0] == 4:
            raise ValueError("the hook failed")

    model[3].bias.register_post_accumulate_grad_hook(hook)
    runtime = PipelineRuntime(
        model, schedule("gpipe", 1, m, True)[0], num_micro_batches=m, loss_fn=loss_fn, twobp=True,
        group=mesh.get_group("pp"), timeout=20.0, grad_sync=sync,
    )  # fmt: skip

    def data(replica: int, step: int) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(100 * replica + step)
        return torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randn(8, 3, generator=g, dtype=torch.float64)

    failed, off = [], []
    for step in range(6):
        step_now[0] = step
        model.zero_grad(set_to_none=True)
        x, y = data(rank, step)
        try:
            runtime.step(x, (y, y[:-1]) if rank == 1 and step == 2 else y, gather=False)
        except (ValueError, PipelineError) as error:
            failed.append(f"{step}: {type(error).__name__}")
            continue
        reference.zero_grad(set_to_none=True)
        for replica in range(2):
            xs, ys = data(replica, step)
            for x_micro, y_micro in zip(xs.tensor_split(m), ys.tensor_split(m), strict=True):
                (F.mse_loss(reference(x_micro), y_micro) / (2 * m)).backward()
        pairs = zip(model.parameters(), reference.parameters(), strict=True)
        off.append(max(float((p.grad - q.grad).abs().max()) for p, q in pairs))
    return {"failed": failed, "off": off}


def test_a_pipeline_replica_failing_alone_makes_its_peers_raise_and_the_next_step_pairs(tmp_path) -> None:
    """A replica whose step failed before its reductions only forgot them: its peer's reduction
    paired with its next step's, both stepped on means of different steps (0.18 off), silently."""
    results = run_scenario(_pipeline_replica_failing_alone, 2, str(tmp_path))
    assert results[0]["failed"] == ["0: PipelineError", "2: PipelineError", "4: PipelineError"], results
    assert results[1]["failed"] == ["0: ValueError", "2: ValueError", "4: ValueError"], results
    for result in results:
        assert len(result["off"]) == 3 and max(result["off"]) < 1e-12, results


def _one_rank_gives_up_a_step(rank: int, where: str) -> dict:
    """Rank 1 fails its first step (before its forward, or between a flush that sent every
    bucket and finish) and gives it up; the next step must be the mean."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3)).double()
    reference = copy.deepcopy(model)
    twobp.patch(model)
    sync = GradientSynchroniser(model, bucket_bytes=1, timeout=10.0)

    def data(data_rank: int, step: int) -> Tensor:
        return torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * step + data_rank))

    failed = []
    try:
        if rank == 1 and where == "before-forward":
            raise ValueError("the data failed")
        model(data(rank, 0)).pow(2).mean().backward()
        sync.flush()
        if rank == 1:
            raise ValueError("the step failed after its flush")
        sync.finish()
    except (ValueError, RuntimeError) as error:
        failed.append(type(error).__name__)
        if rank == 1:  # the peer's failed finish gave the step up itself
            sync.abort()
    model.zero_grad()
    model(data(rank, 1)).pow(2).mean().backward()
    sync.synchronise()
    for data_rank in range(2):
        (reference(data(data_rank, 1)).pow(2).mean() / 2).backward()
    pairs = zip(model.parameters(), reference.parameters(), strict=True)
    return {"failed": failed, "off": [float((p.grad - q.grad).abs().max()) for p, q in pairs]}


@pytest.mark.parametrize(
    "where, peer_failed",
    [("before-forward", ["ReductionFailed"]), ("after-every-bucket-was-sent", [])],
    ids=["before-forward", "after-every-bucket-was-sent"],
)
def test_a_rank_that_gives_up_a_step_pairs_with_its_peers_next_step(tmp_path, where, peer_failed) -> None:
    """Before its forward: its peer's forward had broadcast the BatchNorm buffers, which paired
    with the first aborted bucket (gloo killed the peer). After every bucket was sent on the first
    step: the peer then agreed on the bucket order, which paired with the next step's first
    bucket."""
    scenario = functools.partial(_one_rank_gives_up_a_step, where=where)
    results = run_scenario(scenario, 2, str(tmp_path))
    assert [r["failed"] for r in results] == [peer_failed, ["ValueError"]], results
    for result in results:
        assert max(result["off"]) < 1e-12, result
