"""What reads ``.grad`` for a step (clipping, GradScaler's unscale_) is refused while work for its
parameters is queued, leaving every gradient as it was; after the flush it runs as on plain autograd.
``zero_grad`` before the flush drops the queued work of the parameters it zeroes, as plain autograd
drops their gradients. The step itself: tests/test_queue.py (step, closures) and
tests/test_fsdp.py (sharded parameters)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils import clip_grad_norm_  # imported by name before anything is patched in this module

import twobp_autograd as twobp
from tests.utils import assert_grads_match, patched_and_reference
from twobp_autograd import warn_once


def _model() -> nn.Module:
    # PReLU keeps plain autograd: its gradient is in .grad after backward, the Linears' are queued.
    return nn.Sequential(nn.Linear(6, 8), nn.PReLU(), nn.Linear(8, 2))


def _model_with_batch_norm() -> nn.Module:
    # BatchNorm's gradients are finished in backward and handed over at the flush: another kind of job.
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.PReLU(), nn.Linear(8, 2))


def _scaler() -> torch.amp.GradScaler:
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.zeros(()))  # sets the scale up, as scaling the loss does (the tests scale by 4.0 themselves)
    return scaler


def _scaler_unscale(model: nn.Module) -> None:
    _scaler().unscale_(torch.optim.SGD(model.parameters(), lr=0.1))


def _scaler_step(model: nn.Module) -> None:
    _scaler().step(torch.optim.SGD(model.parameters(), lr=0.1))


READERS: dict[str, Callable[[nn.Module], object]] = {
    "clip_grad_norm_": lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1),
    "clip_grad_norm_-imported-by-name": lambda m: clip_grad_norm_(list(m.parameters()), 0.1),
    "clip_grad_norm_-inf-norm": lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1, norm_type="inf"),
    "clip_grads_with_norm_": lambda m: torch.nn.utils.clip_grads_with_norm_(m.parameters(), 0.1, torch.tensor(5.0)),
    "clip_grad_value_": lambda m: torch.nn.utils.clip_grad_value_(m.parameters(), 0.01),
    "GradScaler.unscale_": _scaler_unscale,
    "GradScaler.step": _scaler_step,
}


@pytest.mark.parametrize("read", READERS.values(), ids=READERS.keys())
def test_a_grad_reader_before_the_flush_is_refused_and_changes_nothing(read: Callable[[nn.Module], object]) -> None:
    model = twobp.patch(_model())
    model(torch.randn(4, 6)).pow(2).sum().backward()
    before = {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}
    assert before["1.weight"] is not None and before["0.weight"] is None  # PReLU's now, the Linears' queued
    with pytest.raises(RuntimeError, match=r"twobp: .*still queued.*flush_weight_grads\(\)"):
        read(model)
    for name, p in model.named_parameters():
        expected = before[name]
        assert (p.grad is None) if expected is None else torch.equal(p.grad, expected), name
    twobp.flush_weight_grads()


def _own_unscale_scaler() -> torch.amp.GradScaler:
    """A GradScaler subclass defined after the guards, whose unscale_ does not call GradScaler's
    (as FSDP's ShardedGradScaler, whose step calls its own): it read the scaled .grad unguarded."""

    class OwnUnscale(torch.amp.GradScaler):
        def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.div_(self.get_scale())

    return OwnUnscale("cpu", init_scale=4.0)


def _sharded_scaler() -> torch.amp.GradScaler:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler("cpu", init_scale=4.0)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
@pytest.mark.parametrize("make", [_own_unscale_scaler, _sharded_scaler], ids=["own-subclass", "ShardedGradScaler"])
def test_a_scaler_subclass_with_its_own_unscale_is_refused_before_the_flush(
    make: Callable[[], torch.amp.GradScaler],
) -> None:
    """ShardedGradScaler's unscale_ before the flush ran: the flush then added still-scaled
    gradients and the step used them (parameters 20-50 off)."""
    model = twobp.patch(_model())
    scaler = make()
    scaler.scale(model(torch.randn(4, 6)).pow(2).sum()).backward()
    with pytest.raises(RuntimeError, match=r"twobp: \w+\.unscale_ over parameters"):
        scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.1))
    assert model[0].weight.grad is None
    twobp.discard_weight_grads()


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.Adam], ids=["SGD", "Adam"])
def test_a_fused_optimizers_scaler_step_refused_before_the_flush_then_retried_steps_as_plain(optimizer) -> None:
    """A fused optimizer unscales in its own step: GradScaler.step set its grad_scale, the step
    guard refused, and the scale stayed: the retried step, as the refusal said, divided the
    gradients by the scale twice (SGD's parameters up to 100% off)."""
    model = _model()
    reference = copy.deepcopy(model)
    twobp.patch(model)
    x = torch.randn(4, 6)
    sides = []
    for net in (model, reference):
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
        sides.append((net, scaler, optimizer(net.parameters(), lr=0.1, fused=True)))
        scaler.scale(net(x).pow(2).sum()).backward()
    model_scaler, model_optimizer = sides[0][1:]
    with pytest.raises(RuntimeError, match=r"twobp: GradScaler.step over parameters whose weight gradients"):
        model_scaler.step(model_optimizer)
    assert not hasattr(model_optimizer, "grad_scale")
    twobp.flush_weight_grads()
    for _, scaler, opt in sides:
        scaler.step(opt)
        scaler.update()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("read", READERS.values(), ids=READERS.keys())
def test_a_grad_reader_after_the_flush_runs_as_on_plain_autograd(read: Callable[[nn.Module], object]) -> None:
    model = _model()
    reference = copy.deepcopy(model)
    twobp.patch(model)
    x = torch.randn(4, 6)
    for net in (model, reference):
        (net(x).pow(2).sum() * 4.0).backward()  # 4.0: the scalers' scale
    twobp.flush_weight_grads()
    read(model)
    read(reference)
    for (name, p), q in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q[1].grad, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(p, q[1], rtol=1e-5, atol=1e-6, msg=name)  # the scaler steps


def test_readers_of_other_parameters_are_not_refused() -> None:
    model = twobp.patch(_model())
    other = nn.Linear(3, 2)
    model(torch.randn(4, 6)).sum().backward()
    other(torch.randn(4, 3)).sum().backward()
    torch.nn.utils.clip_grad_norm_(other.parameters(), 0.1)
    torch.nn.utils.clip_grad_value_(other.parameters(), 0.1)
    twobp.flush_weight_grads()


def test_a_disabled_scaler_leaves_the_check_to_the_step() -> None:
    model = twobp.patch(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    model(torch.randn(4, 6)).sum().backward()
    scaler.unscale_(optimizer)  # does nothing when disabled
    with pytest.raises(RuntimeError, match=r"optimizer\.step\(\).*still queued"):
        scaler.step(optimizer)
    twobp.flush_weight_grads()


def _optimizer_zero_grad(model: nn.Module, set_to_none: bool) -> None:
    torch.optim.SGD(model.parameters(), lr=0.1).zero_grad(set_to_none=set_to_none)


def _module_zero_grad(model: nn.Module, set_to_none: bool) -> None:
    model.zero_grad(set_to_none=set_to_none)


def _first_layer_zero_grad(model: nn.Module, set_to_none: bool) -> None:
    model[0].zero_grad(set_to_none=set_to_none)


def _weights_only_zero_grad(model: nn.Module, set_to_none: bool) -> None:
    # A parameter group that holds a layer's weight but not its bias: half of one job is dropped
    # (BatchNorm's weight handed its bias's gradient that way, silently).
    weights = [p for name, p in model.named_parameters() if name.endswith("weight")]
    torch.optim.SGD(weights, lr=0.1).zero_grad(set_to_none=set_to_none)


ZERO_GRADS: dict[str, Callable[[nn.Module, bool], None]] = {
    "optimizer": _optimizer_zero_grad,
    "module": _module_zero_grad,
    "first-layer-only": _first_layer_zero_grad,
    "weights-only": _weights_only_zero_grad,
}


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set-to-none", "zeros"])
@pytest.mark.parametrize("zero_grad", ZERO_GRADS.values(), ids=ZERO_GRADS.keys())
@pytest.mark.parametrize("own_queue", [False, True], ids=["default-queue", "own-queue"])
@pytest.mark.parametrize("backward_after", [True, False], ids=["another-backward-after", "last-micro-batch-skipped"])
def test_zero_grad_before_the_flush_drops_that_work_as_plain_drops_those_grads(
    zero_grad: Callable[[nn.Module, bool], None], set_to_none: bool, own_queue: bool, backward_after: bool
) -> None:
    """A micro-batch skipped by zero_grad (a non-finite loss, say) must not reach the flush;
    the work of parameters it does not zero stays queued, and a later backward's is kept.
    ``set_to_none=False`` leaves zeros where plain backward had made a gradient, not None: an
    optimizer steps a zero gradient (momentum, weight decay) but skips a None."""
    model = _model_with_batch_norm()
    reference = copy.deepcopy(model)
    twobp.patch(model)
    queue = twobp.WeightGradQueue() if own_queue else None
    skipped, kept = torch.randn(4, 6), torch.randn(5, 6)
    with twobp.use_queue(queue) if queue is not None else contextlib.nullcontext():
        model(skipped).pow(2).sum().backward()
        zero_grad(model, set_to_none)
        if backward_after:
            model(kept).pow(2).sum().backward()
    reference(skipped).pow(2).sum().backward()
    zero_grad(reference, set_to_none)
    if backward_after:
        reference(kept).pow(2).sum().backward()
    twobp.flush_weight_grads(queue)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), f"{name}: {p.grad} against plain's {q.grad}"
        if q.grad is not None:
            assert p.grad.stride() == q.grad.stride(), name
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    for net in (model, reference):
        torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1).step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("zero_grad", [_optimizer_zero_grad, _module_zero_grad], ids=["optimizer", "module"])
def test_zero_grad_keeping_zeros_after_a_discard_leaves_zeros_as_plain(
    zero_grad: Callable[[nn.Module, bool], None],
) -> None:
    """A failed step dropped with discard_weight_grads() and then zero_grad(set_to_none=False):
    plain leaves zeros where its backward made a gradient; the discard had left nothing queued
    for zero_grad to see, so .grad stayed None, and the next step skipped what plain steps."""
    model = _model_with_batch_norm()
    reference = copy.deepcopy(model)
    twobp.patch(model)
    x = torch.randn(4, 6)
    model(x).pow(2).sum().backward()
    twobp.discard_weight_grads()
    zero_grad(model, False)
    reference(x).pow(2).sum().backward()
    zero_grad(reference, False)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert q.grad is not None and p.grad is not None, name
        assert torch.equal(p.grad, q.grad) and p.grad.stride() == q.grad.stride(), name


class _TwoHeads(nn.Module):
    """Two outputs, each from its own Linear, and a parameter neither uses."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)
        self.unused = nn.Parameter(torch.ones(4))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.first(x), self.second(x)


@pytest.mark.parametrize("discard_first", [False, True], ids=["zero_grad", "discard-then-zero_grad"])
def test_zero_grad_keeping_zeros_leaves_none_where_no_backward_reached_a_replayed_parameter(
    discard_first: bool,
) -> None:
    """A recompute-rule module whose backward reached one of two outputs: plain leaves the other
    output's parameters (and one no output uses) None through zero_grad(set_to_none=False); the
    dropped job listed them all and they got zeros, which weight decay then moved (4.7e-3)."""
    twobp.register(_TwoHeads, twobp.ops.recompute)
    model = _TwoHeads()
    reference = copy.deepcopy(model)
    twobp.patch(model)
    x = torch.randn(3, 4)
    for net in (model, reference):
        net(x)[0].pow(2).sum().backward()
        if discard_first and net is model:
            twobp.discard_weight_grads()
        net.zero_grad(set_to_none=False)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), f"{name}: {p.grad} against plain's {q.grad}"
    assert model.first.weight.grad is not None and model.second.weight.grad is None
    for net in (model, reference):
        torch.optim.SGD(net.parameters(), lr=0.1, weight_decay=0.1).step()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("discard_first", [False, True], ids=["zero_grad", "discard-then-zero_grad"])
def test_zero_grad_keeping_zeros_makes_them_in_the_grad_dtype(discard_first: bool) -> None:
    """Parameters with an fp64 grad_dtype: the zeros for dropped work were made in the
    parameter's dtype, which PyTorch refuses to assign (its error, from inside zero_grad)."""
    model = _model_with_batch_norm()
    reference = copy.deepcopy(model)
    twobp.patch(model)
    x = torch.randn(4, 6)
    for net in (model, reference):
        for p in net.parameters():
            p.grad_dtype = torch.float64
        net(x).pow(2).sum().backward()
        if discard_first and net is model:
            twobp.discard_weight_grads()
        net.zero_grad(set_to_none=False)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert q.grad is not None and p.grad is not None, name
        assert p.grad.dtype == q.grad.dtype == torch.float64 and torch.equal(p.grad, q.grad), name


class _CountedTwoHeads(_TwoHeads):
    calls = 0

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        type(self).calls += 1
        return super().forward(x)


def test_zero_grad_to_none_runs_no_queued_replay() -> None:
    """Telling which dropped parameters plain would have given a gradient may run a replay; a
    zero_grad() to None needs no answer, and ran every queued job's (50x slower, measured)."""
    twobp.register(_CountedTwoHeads, twobp.ops.recompute)
    model = twobp.patch(_CountedTwoHeads())
    for _ in range(3):
        model(torch.randn(3, 4))[0].sum().backward()
    before = _CountedTwoHeads.calls
    model.zero_grad()
    assert _CountedTwoHeads.calls == before and twobp.pending().jobs == 0


def test_zero_grad_of_one_batch_norm_parameter_frees_its_finished_gradient() -> None:
    """BatchNorm's job holds both finished gradients: dropping one frees it (the other stays)."""
    model = twobp.patch(nn.Sequential(nn.Linear(6, 256), nn.BatchNorm1d(256)))
    model(torch.randn(4, 6)).pow(2).sum().backward()
    before = twobp.pending().bytes
    torch.optim.SGD([model[1].weight], lr=0.1).zero_grad()
    assert twobp.pending().bytes == before - 256 * 4
    twobp.flush_weight_grads()
    assert model[1].weight.grad is None and model[1].bias.grad is not None


def test_zero_grad_of_other_parameters_keeps_the_work() -> None:
    model = twobp.patch(_model())
    model(torch.randn(4, 6)).sum().backward()
    assert twobp.pending().jobs == 2
    nn.Linear(3, 2).zero_grad()
    torch.optim.SGD(nn.Linear(3, 2).parameters(), lr=0.1).zero_grad()
    assert twobp.pending().jobs == 2
    twobp.flush_weight_grads()


def test_a_step_refused_over_work_in_a_queue_of_ones_own_says_to_flush_that_queue():
    """twobp.flush_weight_grads() flushes the current queue only: following the message's first
    advice left the work of a queue the forwards ran under with use_queue, and the step refused
    again without saying why."""
    model = twobp.patch(nn.Linear(3, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    queue = twobp.WeightGradQueue()
    with twobp.use_queue(queue):
        model(torch.randn(2, 3)).sum().backward()
    with pytest.raises(RuntimeError, match=r"1 queue\(s\) other than the current one, .* flush each, queue.flush\(\)"):
        optimizer.step()
    queue.flush()
    optimizer.step()


def _attention_weights_only() -> nn.Module:
    """A loss on the attention weights alone never reaches v: its own parameters get no gradient."""

    class WeightsOnly(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention = nn.MultiheadAttention(6, 2, kdim=6, vdim=4, add_bias_kv=True)

        def forward(self, x: Tensor) -> Tensor:
            return self.attention(x, x, torch.ones(*x.shape[:-1], 4))[1]

    return WeightsOnly()


#: A model, and which of its parameters (by name) the optimizer holds.
DCP_CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[str], bool]]] = {
    "all-queued": (lambda: nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2)), lambda name: True),
    "some-in-grad": (_model, lambda name: True),
    "queued-work-makes-none": (_attention_weights_only, lambda name: "v_proj" in name or "bias_v" in name),
}


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
@pytest.mark.parametrize("make, held", DCP_CASES.values(), ids=DCP_CASES.keys())
def test_a_distributed_checkpoint_of_a_fresh_optimizer_between_backward_and_flush_is_as_on_plain_autograd(
    make: Callable[[], nn.Module], held: Callable[[str], bool]
) -> None:
    """DCP's ``get_optimizer_state_dict`` initialises a fresh optimizer's state with a step at lr 0
    unless a ``.grad`` exists; with every gradient queued that step was refused, leaving lr at 0
    and zeros as ``.grad``. The queues are flushed first: where the queued work makes no
    gradient (v's parameters above), the state is initialised as on plain autograd. Two steps.
    (DCP's private check is wrapped: this fails if PyTorch renames it.)"""
    from torch.distributed.checkpoint import state_dict

    reference = make()
    model = twobp.patch(copy.deepcopy(reference))
    assert getattr(state_dict._init_optim_state, "__wrapped__", None) is not None  # wrapped by patch()
    optimizers = [
        torch.optim.Adam([p for name, p in net.named_parameters() if held(name)], lr=1e-2)
        for net in (model, reference)
    ]
    for _ in range(2):
        x = torch.randn(4, 3, 6)
        saved = []
        for net, optimizer in zip((model, reference), optimizers, strict=True):
            net(x).pow(2).sum().backward()
            saved.append(state_dict.get_optimizer_state_dict(net, optimizer))
            assert optimizer.param_groups[0]["lr"] == 1e-2
        twobp.flush_weight_grads()
        torch.testing.assert_close(saved[0]["state"], saved[1]["state"])
        assert saved[0]["param_groups"] == saved[1]["param_groups"]
        assert_grads_match(model, reference)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("has_builder", [False, True], ids=["without-dw-builder", "with-dw-builder"])
def test_a_pipeline_stage_scaling_over_queued_work_flushes_it_first_and_says_why(
    has_builder: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A schedule scales .grad at the end of its step: queued work is flushed first. The warning
    told a stage that had a dw_builder to build one; its work was queued outside the stage's
    forward (a reentrant checkpoint's re-run forward, a patched module in loss_fn)."""
    pipelining = pytest.importorskip("torch.distributed.pipelining")
    monkeypatch.setattr(warn_once, "given", set())  # one warning per process and cause
    stage_base = next(c for c in pipelining.PipelineStage.__mro__ if "scale_grads" in c.__dict__)
    module = twobp.patch(nn.Linear(3, 3))
    reference = copy.deepcopy(module)
    stage = type("Stage", (), {"submod": module, "dw_builder": (lambda: None) if has_builder else None})()
    x = torch.randn(4, 3)
    module(x).sum().backward()
    reference(x).sum().backward()
    advice = "use_reentrant=False" if has_builder else r"PipelineStage\(..., dw_builder="
    with pytest.warns(UserWarning, match=f"still queued; they are flushed before it scales.*{advice}"):
        stage_base.scale_grads(stage, 2)
    for p in reference.parameters():
        p.grad.div_(2)
    assert twobp.pending().jobs == 0
    assert_grads_match(module, reference)


@pytest.mark.parametrize("model", [_model, _model_with_batch_norm], ids=["linear", "batch-norm"])
def test_a_hook_on_a_parameters_accumulator_registered_without_keeping_the_node_sees_the_flush(
    model: Callable[[], nn.Module],
) -> None:
    """A parameter holds its AccumulateGrad node weakly; in plain autograd the backward's graph
    keeps it, and a prehook registered on it after the forward, alive until the gradient comes.
    The graph is freed after backward-p1, and the flush delivered through a new node without the
    hook (a halving hook's weight gradient 0.55 off, silently)."""

    def halve(grads: tuple[Tensor | None, ...]) -> tuple[Tensor, ...] | None:
        return None if grads[0] is None else (grads[0] * 0.5,)

    patched = model()
    reference = copy.deepcopy(patched)
    twobp.patch(patched)
    x = torch.randn(4, 6)
    for net in (patched, reference):
        output = net(x)
        for param in net.parameters():
            torch.autograd.graph.get_gradient_edge(param).node.register_prehook(halve)  # not kept
        output.pow(2).sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


class _StepTakesAScale(torch.optim.SGD):
    """An optimizer whose step takes a value, not a closure (a learning-rate scale)."""

    def step(self, scale=1.0):  # type: ignore[override]
        for group in self.param_groups:
            group["lr"] *= scale
        return super().step()


def test_a_step_argument_that_is_no_closure_is_left_alone():
    """Any argument was taken for a closure and wrapped: step(0.5) failed with
    "float() argument must be ... not 'function'" (plain runs it)."""
    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
    x = torch.randn(5, 3)
    for model in (patched, reference):
        model(x).pow(2).sum().backward()
        if model is patched:
            with pytest.raises(RuntimeError, match="twobp: optimizer.step"):  # still checked, before the step
                _StepTakesAScale(model.parameters(), lr=0.1).step(0.5)
            twobp.flush_weight_grads()
        _StepTakesAScale(model.parameters(), lr=0.1).step(0.5)
    for ours, theirs in zip(patched.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs)


def _flat_grads(model: nn.Module) -> Tensor:
    """Every parameter's .grad a zeroed view into one flat buffer (as DDP's gradient_as_bucket_view)."""
    flat = torch.zeros(sum(p.numel() for p in model.parameters()))
    offset = 0
    for p in model.parameters():
        p.grad = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat


#: Gradient averages written by hand, each given the model and its flat gradient buffer.
HAND_REDUCTIONS: dict[str, Callable[[nn.Module, Tensor], object]] = {
    "all_reduce-of-each-grad": lambda m, _: [torch.distributed.all_reduce(p.grad) for p in m.parameters()],
    "all_reduce-of-grad.data": lambda m, _: [torch.distributed.all_reduce(p.grad.data) for p in m.parameters()],
    "all_reduce-async": lambda m, _: [
        torch.distributed.all_reduce(p.grad, async_op=True).wait() for p in m.parameters()
    ],
    "reduce-to-rank-0": lambda m, _: [torch.distributed.reduce(p.grad, dst=0) for p in m.parameters()],
    "all_reduce-of-the-flat-buffer": lambda _, flat: torch.distributed.all_reduce(flat),
    "all_reduce_coalesced": lambda m, _: torch.distributed.all_reduce_coalesced([p.grad for p in m.parameters()]),
    # ZeRO-2 by hand: each rank keeps the sum of its shard of the flat buffer (reduce-scatters went
    # through: 6.73 off on two gloo ranks).
    "reduce_scatter_tensor-of-the-flat-buffer": lambda _, flat: torch.distributed.reduce_scatter_tensor(
        torch.empty_like(flat), flat
    ),
    "reduce_scatter-of-the-flat-buffer": lambda _, flat: torch.distributed.reduce_scatter(
        torch.empty_like(flat), [flat]
    ),
    # Rank 0's gradients to every rank (went through: the flush then added each rank's own).
    "broadcast-of-each-grad": lambda m, _: [torch.distributed.broadcast(p.grad, src=0) for p in m.parameters()],
}


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
@pytest.mark.filterwarnings("ignore::FutureWarning")  # reduce_scatter_tensor, all_reduce_coalesced: deprecated
@pytest.mark.parametrize("reduce", HAND_REDUCTIONS.values(), ids=HAND_REDUCTIONS.keys())
def test_a_gradient_average_by_hand_before_the_flush_is_refused_and_after_it_runs_as_plain(
    reduce: Callable[[nn.Module, Tensor], object], one_rank_group: None
) -> None:
    """``dist.all_reduce(p.grad)`` before the flush (``.grad`` kept as zeros, or views of one
    buffer) averaged the partial gradients, and the flush then added each rank's own weight
    gradients unaveraged: every deferred parameter wrong on every rank, silently (found on two
    gloo ranks: 0.22 off on a scale of 0.17). With one rank the sum is the gradient itself, so
    after the flush the average equals plain's."""
    patched, reference = patched_and_reference(_model())
    x = torch.randn(4, 6)
    flats = [_flat_grads(net) for net in (patched, reference)]
    for net in (patched, reference):
        net(x).pow(2).sum().backward()
    before = [p.grad.clone() for p in patched.parameters()]
    with pytest.raises(RuntimeError, match=r"twobp: torch.distributed.\w+ of a .grad over parameters whose"):
        reduce(patched, flats[0])
    for p, expected in zip(patched.parameters(), before, strict=True):
        assert torch.equal(p.grad, expected)
    twobp.flush_weight_grads()
    for net, flat in zip((patched, reference), flats, strict=True):
        reduce(net, flat)
    assert_grads_match(patched, reference)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
@pytest.mark.parametrize("flat", [False, True], ids=["grads-apart", "grads-in-one-flat-buffer"])
def test_reductions_of_other_tensors_run_while_work_is_queued(flat: bool, one_rank_group: None) -> None:
    """A loss or metric reduced between backward and flush, and the gradient of a parameter
    without queued work (PReLU's, computed in backward), are no partial gradients: also where
    that gradient is a slice of a flat buffer whose other slices are (an overlapped average by
    hand, in a post-accumulate-grad hook: it was refused, its buffer shared with queued ones)."""
    model = twobp.patch(_model())
    if flat:
        _flat_grads(model)
    reduced = []
    model[1].weight.register_post_accumulate_grad_hook(lambda p: reduced.append(torch.distributed.all_reduce(p.grad)))
    loss = model(torch.randn(4, 6)).pow(2).sum()
    loss.backward()
    torch.distributed.all_reduce(loss.detach())
    assert len(reduced) == 1 and twobp.pending().jobs == 2
    twobp.flush_weight_grads()


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_a_compiled_all_reduce_still_traces_into_one_graph(one_rank_group: None) -> None:
    twobp.patch(_model())  # the guards are in place

    def doubled_sum(t: Tensor) -> Tensor:
        torch.distributed.all_reduce(t)
        return t * 2

    compiled = torch.compile(doubled_sum, fullgraph=True, backend="eager")
    assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 2.0))


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
@pytest.mark.parametrize("layout", ["flat-buffer-kept-as-a-parameter", "strided-view-with-gaps"])
def test_a_hand_average_over_gradients_laid_out_unusually_is_refused(layout: str, one_rank_group: None) -> None:
    """A flat buffer kept as an nn.Parameter was taken for a tensor subclass without memory of its
    own, and a .grad with gaps (every other column of a buffer) was measured by its nbytes: a
    reduction of its buffer's last row missed it. Both passed unrefused."""
    model = twobp.patch(nn.Linear(6, 4))
    if layout == "flat-buffer-kept-as-a-parameter":
        buffer = nn.Parameter(torch.zeros(4 * 6 + 4), requires_grad=False)
        model.weight.grad, model.bias.grad = buffer[:24].view(4, 6), buffer[24:]
        reduced = buffer
    else:
        buffer = torch.zeros(4, 12)
        model.weight.grad = buffer[:, ::2]
        reduced = buffer[3]  # the last row: the gradient's last 6 elements, 12 apart
    model(torch.randn(3, 6)).pow(2).sum().backward()
    with pytest.raises(RuntimeError, match=r"twobp: torch.distributed.all_reduce of a .grad over parameters whose"):
        torch.distributed.all_reduce(reduced)
    twobp.flush_weight_grads()
    torch.distributed.all_reduce(reduced)


_PRE_HOOK_FIRST = """
import torch
from torch import nn
scale = nn.Parameter(torch.ones(2, dtype=torch.float64))
halved = []
def halve(optimizer, args, kwargs):  # a library's global hook, registered before the first patch()
    scale.grad.div_(2)
    halved.append(True)
from torch.optim.optimizer import register_optimizer_step_pre_hook
register_optimizer_step_pre_hook(halve)
import twobp_autograd as twobp
layer = twobp.patch(nn.Linear(2, 2).double())
optimizer = torch.optim.SGD([scale, *layer.parameters()], lr=0.1)
(layer(torch.ones(3, 2, dtype=torch.float64)) * scale).sum().backward()
before = scale.grad.clone()
try:
    optimizer.step()
except RuntimeError as error:
    print("refused" if str(error).startswith("twobp:") else "other-error")
print("unchanged" if torch.equal(scale.grad, before) and not halved else "changed")
twobp.discard_weight_grads()
"""


def test_a_global_step_pre_hook_registered_before_patch_runs_after_the_refusal(tmp_path) -> None:
    """The guard was appended to the global step pre-hooks: one registered earlier (at a library's
    import) ran first, and halved a gradient of the step the guard then refused; the step run again
    after the flush, as the refusal says, halved it twice."""
    import subprocess
    import sys

    script = tmp_path / "pre_hook_first.py"
    script.write_text(_PRE_HOOK_FIRST)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["refused", "unchanged"], result.stdout


def test_zero_grad_between_backward_and_flush_runs_the_optimizer_in_backward_step_plain_ran():
    """Plain's hook stepped the optimizer in backward, before the zero_grad; the zero_grad dropped
    the queued work, and with it the step (0.49 off, silently)."""
    torch.manual_seed(0)
    patched, reference = patched_and_reference(nn.Linear(4, 4).double())
    for net in (patched, reference):
        for p in net.parameters():
            optimizer = torch.optim.SGD([p], lr=0.1)

            def step(p: torch.Tensor, optimizer: torch.optim.Optimizer = optimizer) -> None:
                if not twobp.has_queued_work(p):  # the call during backward: no gradient yet
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)

            p.register_post_accumulate_grad_hook(step)
    x = torch.randn(3, 4, dtype=torch.float64)
    for net in (patched, reference):
        net(x).pow(2).sum().backward()
        net.zero_grad()  # a micro-batch skipped after the step was taken
    twobp.flush_weight_grads()
    for p, q in zip(patched.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q)
