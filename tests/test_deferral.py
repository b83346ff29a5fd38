"""README contract point 1 (and 5's create_graph): .grad untouched by backward-p1, equal to
plain autograd after the flush, for every way autograd can be driven, and with the autograd
features a training step combines with it (hooks, retain_grad, anomaly mode, version counters,
vmapped backward, the recompute rule)."""

import contextlib
import copy
import functools
import math
import random
import sys
import threading
import warnings
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn.utils.prune
from torch import Tensor, nn

import twobp_autograd
import twobp_autograd as twobp
from tests.utils import assert_grads_match, assert_no_grads, patched_and_reference
from twobp_autograd import warn_once
from twobp_autograd.data_parallel import GradientSynchroniser
from twobp_autograd.deferral import defer_weight_grads, detached
from twobp_autograd.flush import PartlyDelivered
from twobp_autograd.job import WeightGradJob
from twobp_autograd.queue import current_queue


def mlp(dtype=torch.float32) -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 3)).to(dtype)


def loss_of(model, x):
    return model(x).pow(2).mean()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("micro_batches", [1, 4], ids=["one-micro-batch", "four-micro-batches"])
def test_accumulation_over_backward_calls(dtype, micro_batches):
    patched, reference = patched_and_reference(mlp(dtype))
    for _ in range(micro_batches):
        x = torch.randn(5, 6, dtype=dtype)
        loss_of(patched, x).backward()
        loss_of(reference, x).backward()
    assert_no_grads(patched)
    assert twobp.pending().jobs == 3 * micro_batches
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, dtype)


def test_flush_adds_to_existing_grads_and_respects_set_to_none():
    patched, reference = patched_and_reference(mlp())
    opt_p = torch.optim.SGD(patched.parameters(), lr=0.1)
    opt_r = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        for _ in range(2):
            x = torch.randn(4, 6)
            loss_of(patched, x).backward()
            loss_of(reference, x).backward()
        twobp.flush_weight_grads()
        assert_grads_match(patched, reference)
        opt_p.step()
        opt_r.step()
        # zero_grad(set_to_none=False) on one step, True on the others: both must match
        opt_p.zero_grad(set_to_none=step != 1)
        opt_r.zero_grad(set_to_none=step != 1)
    for p, q in zip(patched.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q)


@pytest.mark.parametrize(
    "flush_context",
    [torch.enable_grad, torch.no_grad, torch.inference_mode],
    ids=["grad-mode", "no-grad", "inference-mode"],
)
def test_a_flush_under_no_grad_or_inference_mode_leaves_gradients_the_next_steps_can_use(flush_context):
    """A step run under ``no_grad`` / ``inference_mode`` (flush, clip, step): the flushed .grad
    are plain tensors (not inference tensors, which every later in-place update refuses)."""
    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)))
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1) for model in (patched, reference)]
    for _ in range(3):
        for _ in range(2):
            x = torch.randn(4, 6)
            loss_of(patched, x).backward()
            loss_of(reference, x).backward()
        with flush_context():
            twobp.flush_weight_grads()
            assert_grads_match(patched, reference)
            assert not any(p.grad.is_inference() for p in patched.parameters())
            for model, optimizer in zip((patched, reference), optimizers, strict=True):
                nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # in place on every .grad
                optimizer.step()
                optimizer.zero_grad(set_to_none=False)  # zero_() in place
    for p, q in zip(patched.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def test_retain_graph_backward_twice():
    patched, reference = patched_and_reference(mlp())
    x = torch.randn(4, 6)
    for model in (patched, reference):
        loss = loss_of(model, x)
        loss.backward(retain_graph=True)
        loss.backward()
    assert twobp.pending().jobs == 6
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


def test_module_called_several_times_and_leading_dims():
    layer = nn.Linear(6, 6)
    patched, reference = patched_and_reference(layer)
    x = torch.randn(2, 3, 6)
    for model in (patched, reference):
        model(torch.tanh(model(model(x)))).sum().backward()
    assert twobp.pending().jobs == 3
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


def test_tied_weights_across_modules():
    model = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 5))
    model[2].weight = model[0].weight
    patched, reference = patched_and_reference(model)
    assert reference[2].weight is reference[0].weight
    x = torch.randn(3, 5)
    loss_of(patched, x).backward()
    loss_of(reference, x).backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


@pytest.mark.parametrize("frozen", ["whole-layer", "weight-only", "bias-only"])
def test_frozen_parameters(frozen):
    model = mlp()
    if frozen == "whole-layer":
        model[2].requires_grad_(False)
    elif frozen == "weight-only":
        model[2].weight.requires_grad_(False)
    else:
        model[2].bias.requires_grad_(False)
    patched, reference = patched_and_reference(model)
    x = torch.randn(4, 6)
    loss_of(patched, x).backward()
    loss_of(reference, x).backward()
    assert_no_grads(patched)
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


def test_input_only_backward_queues_nothing():
    """torch.distributed.pipelining infers shapes with an input-only pass: it must not queue."""
    patched = twobp.patch(mlp())
    x = torch.randn(4, 6, requires_grad=True)
    (gx,) = torch.autograd.grad(loss_of(patched, x), x)
    assert twobp.pending().jobs == 0
    loss_of(patched, x).backward(inputs=[x])
    assert twobp.pending().jobs == 0
    assert_no_grads(patched)
    twobp.flush_weight_grads()
    assert_no_grads(patched)
    reference = copy.deepcopy(twobp.unpatch(patched))
    x_ref = x.detach().requires_grad_()
    torch.testing.assert_close(gx, torch.autograd.grad(loss_of(reference, x_ref), x_ref)[0])


def test_backward_with_weight_inputs_is_deferred_and_scoped():
    patched, reference = patched_and_reference(mlp())
    x = torch.randn(4, 6)
    wanted_p = [patched[2].weight]
    wanted_r = [reference[2].weight]
    loss_of(patched, x).backward(inputs=wanted_p)
    loss_of(reference, x).backward(inputs=wanted_r)
    assert twobp.pending().jobs == 1
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


def test_autograd_grad_of_weights_returns_them_at_once():
    patched, reference = patched_and_reference(mlp())
    x = torch.randn(4, 6)
    got = torch.autograd.grad(loss_of(patched, x), [patched[0].weight, patched[4].bias])
    want = torch.autograd.grad(loss_of(reference, x), [reference[0].weight, reference[4].bias])
    assert twobp.pending().jobs == 0
    assert_no_grads(patched)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("call", ["backward", "autograd.grad"])
def test_create_graph_is_refused_not_silently_wrong(call):
    patched = twobp.patch(mlp(torch.float64))
    loss = loss_of(patched, torch.randn(4, 6, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="create_graph=True"):
        if call == "backward":
            loss.backward(create_graph=True)
        else:
            torch.autograd.grad(loss, list(patched.parameters()), create_graph=True)
    assert twobp.pending().jobs == 0


def test_a_create_graph_refusal_says_that_parameters_reached_before_it_hold_gradients():
    """The refusal can only come at the first patched node the engine runs: a parameter used
    after the patched layers (a learned logit scale) has its gradient already, and running the
    step again as the refusal said, without zeroing, doubled it."""
    model = nn.Linear(3, 2).double()
    scale = nn.Parameter(torch.tensor(2.0, dtype=torch.float64))
    twobp.patch(model)
    loss = (model(torch.randn(4, 3, dtype=torch.float64)) * scale).pow(2).sum()
    with pytest.raises(RuntimeError, match=r"create_graph=True.*may hold this backward's gradient.*zero_grad\(\)"):
        loss.backward(create_graph=True)
    assert scale.grad is not None  # what the refusal warns about


def test_post_accumulate_hooks_see_the_gradient_at_flush():
    """During backward-p1 a deferred parameter's post-accumulate hooks are called with None (its
    gradient does not exist yet, as for any custom autograd Function returning None); at the
    flush they see the real gradient."""
    patched, reference = patched_and_reference(mlp())
    seen = []
    patched[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad))
    x = torch.randn(4, 6)
    loss_of(patched, x).backward()
    assert seen == [None] and twobp.pending().jobs == 3
    twobp.flush_weight_grads()
    assert len(seen) == 2 and seen[1] is patched[0].weight.grad
    loss_of(reference, x).backward()
    assert_grads_match(patched, reference)


def test_a_hooked_parameter_frozen_between_backward_and_flush_gets_its_gradient():
    """Plain computed the gradient during backward; the flush, which moves a hooked parameter's
    hook first, registered it on a parameter that no longer requires grad: PyTorch refused, and
    the flush failed with PartlyDelivered, that gradient lost."""
    patched, reference = patched_and_reference(mlp())
    seen = []
    patched[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad))
    x = torch.randn(4, 6)
    loss_of(patched, x).backward()
    loss_of(reference, x).backward()
    patched[0].weight.requires_grad_(False)
    twobp.flush_weight_grads()
    assert not patched[0].weight.requires_grad
    assert len(seen) == 2 and seen[1] is patched[0].weight.grad
    assert_grads_match(patched, reference)


def test_post_accumulate_hooks_at_the_flush_are_those_of_the_backward():
    """Plain calls the hooks a parameter has when its backward accumulates: not one registered
    after that backward, and one removed since was called already. The flush calls the same
    ones, leaves the hooks as it found them, and keeps what a hook registers or removes."""
    patched, reference = patched_and_reference(mlp())
    weight, calls = patched[0].weight, []

    def at_flush(p):
        return not twobp.has_queued_work(p)

    def kept(p):
        calls.append(("kept", at_flush(p)))

    def after_backward(p):
        calls.append(("after backward", at_flush(p)))

    weight.register_post_accumulate_grad_hook(kept)
    removed = weight.register_post_accumulate_grad_hook(lambda p: calls.append(("removed", at_flush(p))))

    def register_once(p):
        calls.append(("registering", at_flush(p)))
        if at_flush(p):  # once: at the first flush
            registering.remove()
            p.register_post_accumulate_grad_hook(lambda q: calls.append(("registered by a hook", at_flush(q))))

    registering = weight.register_post_accumulate_grad_hook(register_once)
    x = torch.randn(4, 6)
    loss_of(patched, x).backward()
    assert calls == [("kept", False), ("removed", False), ("registering", False)]
    removed.remove()
    weight.register_post_accumulate_grad_hook(after_backward)
    calls.clear()
    twobp.flush_weight_grads()
    assert calls == [("kept", True), ("removed", True), ("registering", True)]
    hooks = list(weight._post_accumulate_grad_hooks.values())
    assert len(hooks) == 3 and hooks[:2] == [kept, after_backward]  # and the one registered by a hook
    loss_of(reference, x).backward()
    assert_grads_match(patched, reference)
    calls.clear()
    loss_of(patched, x).backward()
    twobp.flush_weight_grads()
    assert [name for name, got in calls if got] == ["kept", "after backward", "registered by a hook"]


def test_a_hook_of_a_backward_whose_gradient_zero_grad_dropped_is_not_called_at_the_flush():
    """The first backward's weight gradient is skipped (zero_grad) while its Linear's job stays
    for the bias; a clamp hook of that backward, removed since, must not clamp the second
    backward's gradient (it did: the job still carried the hook, 7.8 off)."""
    torch.manual_seed(0)
    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(4, 3)).double())
    x1, x2 = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)

    def clamp(p):
        if p.grad is not None:
            p.grad.clamp_(-0.1, 0.1)

    for model in (patched, reference):
        weight = model[0].weight
        handle = weight.register_post_accumulate_grad_hook(clamp)
        model(x1).pow(2).sum().backward()
        torch.optim.SGD([weight], lr=0.1).zero_grad(set_to_none=True)  # skip this micro-batch for the weight
        handle.remove()
        model(x2).pow(2).sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


def test_hooks_changed_between_two_backwards_of_one_flush_are_the_last_ones_with_a_warning():
    """A logger removed between two backwards that one flush sums: plain called it with the first
    gradient; the flush calls the last backward's hooks (none), once, and says so."""
    patched, _ = patched_and_reference(mlp())
    weight, seen = patched[0].weight, []
    handle = weight.register_post_accumulate_grad_hook(lambda p: seen.append(twobp.has_queued_work(p)))
    loss_of(patched, torch.randn(4, 6)).backward()
    handle.remove()
    loss_of(patched, torch.randn(4, 6)).backward()
    warn_once.given.discard("hooks changed between backwards")
    with pytest.warns(UserWarning, match="hooks changed between backward calls whose work one flush delivers"):
        twobp.flush_weight_grads()
    assert seen == [True]  # during the first backward only


def test_has_queued_work_over_several_parameters_asks_of_any():
    """``has_queued_work(model.parameters())`` answered False while work was queued (a generator
    is no parameter of any job): it asks of each; what is no tensor is refused."""
    model = twobp.patch(mlp())
    assert not twobp.has_queued_work(model.parameters())
    loss_of(model, torch.randn(4, 6)).backward()
    assert twobp.has_queued_work(model.parameters()) and twobp.has_queued_work([model[0].bias])
    with pytest.raises(TypeError, match="twobp: has_queued_work takes a tensor or tensors"):
        twobp.has_queued_work(["weight"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="twobp: has_queued_work takes a tensor or tensors"):
        twobp.has_queued_work(None)  # type: ignore[arg-type]
    twobp.flush_weight_grads()
    assert not twobp.has_queued_work(model.parameters())


def test_a_hook_registered_after_the_backward_and_removed_during_its_flush_stays_removed():
    """The flush leaves out a hook registered after its backward; a hook of that backward
    removing it during the flush removes it for good (it came back after the flush)."""
    patched, _ = patched_and_reference(mlp())
    weight, calls, late = patched[0].weight, [], []

    def remover(p):
        if not twobp.has_queued_work(p) and late:
            late.pop().remove()

    weight.register_post_accumulate_grad_hook(remover)
    loss_of(patched, torch.randn(4, 6)).backward()
    late.append(weight.register_post_accumulate_grad_hook(lambda p: calls.append("late")))
    twobp.flush_weight_grads()
    assert calls == [] and list(weight._post_accumulate_grad_hooks.values()) == [remover]


def test_an_optimizer_in_backward_hook_removed_before_the_flush_still_steps():
    """Taking optimizer-in-backward's hooks down after the last backward, before its flush:
    plain stepped in that backward; the flush steps too (it lost that step, silently)."""
    torch.manual_seed(0)
    patched, reference = patched_and_reference(mlp())
    handles = _optimizer_in_backward(patched, skip="queued", set_to_none=True)
    reference_handles = _optimizer_in_backward(reference, skip="queued", set_to_none=True)
    x = torch.randn(4, 6)
    loss_of(patched, x).backward()
    loss_of(reference, x).backward()
    for handle in handles + reference_handles:
        handle.remove()
    twobp.flush_weight_grads()
    for (name, p), q in zip(patched.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


class _TiedLM(nn.Module):
    """Embedding and head sharing one weight: two contributions to it in every backward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(tokens))).flatten(0, 1)


def _tied_lm_step(model: nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 10, (4, 5), generator=generator)
    targets = torch.randint(0, 10, (20,), generator=generator)
    nn.functional.cross_entropy(model(tokens), targets).backward()


def _clamped(grad: torch.Tensor | None) -> torch.Tensor | None:
    return None if grad is None else grad.clamp(-0.01, 0.01)


# (case, what the patched side does around its backward calls)
_HOOKED_CASES = ["three-backward-calls-per-flush", "tied-weight-capped-queue", "tied-weight-two-queues"]


@pytest.mark.filterwarnings("ignore:twobp. a parameter with a tensor hook")
@pytest.mark.parametrize("case", _HOOKED_CASES)
def test_a_non_linear_tensor_hook_sees_each_backward_s_gradient(case):
    """A tensor hook runs on each backward's gradient in plain autograd; applied to a sum over
    several backward calls, or to part of one backward's gradient (a capped queue's early flush,
    two queues sharing a tied weight), a clamp would give another result. Such a parameter
    takes its gradient during backward, as plain autograd does."""
    torch.manual_seed(0)
    if case == "three-backward-calls-per-flush":
        patched, reference = patched_and_reference(mlp())
        hooked = [(patched[0].weight, reference[0].weight), (patched[4].bias, reference[4].bias)]
    else:
        patched, reference = patched_and_reference(_TiedLM())
        hooked = [(patched.embed.weight, reference.embed.weight)]
    for ours, theirs in hooked:
        ours.register_hook(_clamped)
        theirs.register_hook(_clamped)
    if case == "three-backward-calls-per-flush":
        for _ in range(3):
            x = torch.randn(5, 6)
            loss_of(patched, x).backward()
            loss_of(reference, x).backward()
        # Computed in backward, as plain does; their layers still queue the other parameter.
        assert patched[0].weight.grad is not None and patched[4].bias.grad is not None
        assert patched[0].bias.grad is None and twobp.pending().jobs == 9
        twobp.flush_weight_grads()
    elif case == "tied-weight-capped-queue":
        queue = twobp.WeightGradQueue(max_pending_bytes=64)
        with twobp.use_queue(queue):
            _tied_lm_step(patched, 0)
        queue.flush()
        _tied_lm_step(reference, 0)
    else:
        embed_queue, head_queue = twobp.WeightGradQueue(), twobp.WeightGradQueue()
        tokens = torch.randint(0, 10, (4, 5))
        with twobp.use_queue(embed_queue):
            hidden = torch.tanh(patched.embed(tokens))
        with twobp.use_queue(head_queue):
            patched.head(hidden).pow(2).sum().backward()
        embed_queue.flush()
        head_queue.flush()
        reference.head(torch.tanh(reference.embed(tokens))).pow(2).sum().backward()
    assert_grads_match(patched, reference)


@pytest.mark.filterwarnings("ignore:twobp. a capped WeightGradQueue")
@pytest.mark.parametrize("model_kind", ["tied-embedding-and-head", "linear-applied-twice"])
def test_optimizer_in_backward_with_a_capped_queue_steps_once_on_the_whole_gradient(model_kind):
    """A capped queue flushes old work early, inside the backward; for a parameter with two
    contributions that would deliver its gradient in two parts, and an optimizer-in-backward
    hook would step on each (or step between the two uses, which autograd then refuses). Such
    parameters' work waits for the flush the caller runs."""
    torch.manual_seed(0)
    if model_kind == "tied-embedding-and-head":
        patched, reference = patched_and_reference(_TiedLM())
    else:
        patched, reference = patched_and_reference(nn.Sequential(nn.Linear(6, 6), nn.Tanh()))
    _optimizer_in_backward(patched, skip="none")
    _optimizer_in_backward(reference, skip="none")
    queue = twobp.WeightGradQueue(max_pending_bytes=64)
    for seed in range(3):
        if model_kind == "tied-embedding-and-head":
            with twobp.use_queue(queue):
                _tied_lm_step(patched, seed)
            _tied_lm_step(reference, seed)
        else:
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))
            with twobp.use_queue(queue):
                patched[0](patched(x)).pow(2).sum().backward()
            reference[0](reference(x)).pow(2).sum().backward()
        queue.flush()
    for (name, p), q in zip(patched.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def _optimizer_in_backward(model: nn.Module, *, skip: str, set_to_none: bool = True, marked: bool = False) -> list:
    """PyTorch's optimizer-in-backward idiom: one optimizer per parameter, stepped (and its
    gradient freed, or zeroed) by the parameter's post-accumulate-grad hook, which returns at
    once while ``p.grad`` is None (``skip="none"``) or work is queued for ``p`` (``"queued"``),
    or never (``"never"``)."""
    optimizers = {p: torch.optim.SGD([p], lr=0.1, momentum=0.9) for p in model.parameters()}

    def step(p):
        if (skip == "none" and p.grad is None) or (skip == "queued" and twobp.has_queued_work(p)):
            return
        optimizers[p].step()
        optimizers[p].zero_grad(set_to_none=set_to_none)

    if marked:  # "copes with partial gradients": it may still step the parameter
        step = twobp_autograd.queue.takes_partial_gradients(step)
    return [p.register_post_accumulate_grad_hook(step) for p in model.parameters()]


def test_optimizer_in_backward_steps_at_the_flush():
    patched, reference = patched_and_reference(mlp())
    _optimizer_in_backward(patched, skip="none")
    _optimizer_in_backward(reference, skip="none")
    for _ in range(3):
        x = torch.randn(4, 6)
        loss_of(patched, x).backward()
        twobp.flush_weight_grads()
        loss_of(reference, x).backward()
    for (name, p), q in zip(patched.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is None, name  # freed by the hook
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


class _LearnedQueries(nn.Module):
    """Learned query tokens expanded to the batch (a Q-Former's, a Perceiver's latents): at one
    sample the expand, and each layer's saved input, is a view of the parameter itself."""

    def __init__(self) -> None:
        super().__init__()
        self.queries = nn.Parameter(torch.randn(1, 3, 4))
        self.norm, self.attention = nn.LayerNorm(4), nn.MultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        queries = self.queries.expand(x.shape[0], -1, -1)
        mixed = self.attention(queries, x, x, need_weights=False)[0]
        return self.head(self.norm(queries) + mixed) + self.head(queries)


def test_learned_queries_of_a_model_sharded_by_fully_shard_at_one_sample(one_rank_group):
    """At one sample a patched layer saved a view of FSDP2's unsharded parameter, whose storage
    FSDP2 frees after backward: the flush failed on unallocated data, where FSDP2 on the
    unpatched model trains. Such a saved parameter is copied when backward queues the work."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    patched, reference = patched_and_reference(_LearnedQueries().double())
    for model in (reference, twobp.unpatch(patched)):
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    twobp.patch(patched)
    for _ in range(2):
        x = torch.randn(1, 5, 4, dtype=torch.float64)
        for model in (patched, reference):
            model(x).pow(2).mean().backward()
    twobp.flush_weight_grads()
    for (name, p), q in zip(patched.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad.full_tensor(), rtol=1e-10, atol=1e-12, msg=name)


class _LearnedBagWeights(nn.Module):
    """An EmbeddingBag whose per-sample weights are a parameter of their own."""

    def __init__(self) -> None:
        super().__init__()
        self.bag, self.head = nn.EmbeddingBag(10, 4, mode="sum"), nn.Linear(4, 2)
        self.weights = nn.Parameter(torch.rand(6))

    def forward(self, x: Tensor) -> Tensor:
        tokens = torch.tensor([1, 2, 3, 4, 5, 6])
        return self.head(self.bag(tokens, torch.tensor([0, 3]), per_sample_weights=self.weights)) * x.mean()


@pytest.mark.parametrize(
    ("model", "batch", "context"),
    [
        (_LearnedQueries, 1, contextlib.nullcontext),
        (_LearnedQueries, 2, contextlib.nullcontext),
        (_LearnedQueries, 1, torch.autograd.forward_ad.dual_level),  # Linear's and attention's tap path
        (_LearnedBagWeights, 1, contextlib.nullcontext),
        (_LearnedQueries, 1, "marked"),  # a hook marked takes_partial_gradients still steps
    ],
    ids=[
        "queries-one-sample", "queries-two-samples", "queries-under-forward-ad", "bag-per-sample-weights",
        "queries-one-sample-marked-hook",
    ],
)  # fmt: skip
def test_optimizer_in_backward_steps_a_parameter_a_patched_layer_saved_as_its_input(model, batch, context):
    """The parameter's gradient is plain's, in backward, and its hook steps it in place there;
    each patched layer had saved it, or a view of it (queries expanded to one sample), for the
    flush, which refused (modified in place). It is copied for the flush."""
    patched, reference = patched_and_reference(model().double())
    marked, context = context == "marked", contextlib.nullcontext if context == "marked" else context
    _optimizer_in_backward(patched, skip="queued", marked=marked)
    _optimizer_in_backward(reference, skip="queued", marked=marked)
    for _ in range(3):
        x = torch.randn(batch, 5, 4, dtype=torch.float64)
        with context():
            patched(x).pow(2).mean().backward()
        twobp.flush_weight_grads()
        reference(x).pow(2).mean().backward()
    for (name, p), q in zip(patched.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=name)


class _TanhAffine(nn.Module):
    """A per-sample block for the recompute rule whose parameter ``a`` two of its ops read."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4))

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x * self.a + self.b) * self.a


class _QueriedTanhAffine(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.queries, self.block = nn.Parameter(torch.randn(1, 3, 4)), _TanhAffine()

    def forward(self, x: Tensor) -> Tensor:
        queries = self.queries.expand(x.shape[0], -1, -1)
        return self.block(queries).pow(2).sum() + (queries * x.mean()).sum()


@pytest.mark.parametrize("model_kind", ["learned-queries", "plain-input"])
def test_optimizer_in_backward_on_a_recompute_parameter_with_a_tensor_hook(model_kind):
    """A tensor hook makes ``a`` take its gradient in backward; the rule's node handed it on at
    once, before the forward's own nodes (which saved the detached ``a``, sharing its storage)
    ran, and the optimizer's hook stepped ``a`` in place there: backward failed with autograd's
    raw in-place error (plain accumulates ``a`` after all its uses), or the flush's replay found
    ``a`` changed. Such a call keeps plain autograd, one warning."""
    twobp.register(_TanhAffine, twobp.ops.recompute)
    torch.manual_seed(0)
    model = _QueriedTanhAffine() if model_kind == "learned-queries" else nn.Sequential(_TanhAffine())
    patched, reference = patched_and_reference(model.double())
    for model in (patched, reference):
        (model.block if model_kind == "learned-queries" else model[0]).a.register_hook(lambda g: g)
        _optimizer_in_backward(model, skip="queued")
    for seed in range(3):
        x = torch.randn(2, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        if model_kind == "learned-queries":
            x = x[:1]
        for model in (patched, reference):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model(x).pow(2).sum().backward()
        twobp.flush_weight_grads()
    for (name, p), q in zip(patched.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=name)


def test_a_tensor_hook_beside_the_synchronisers_own_hook_keeps_the_rule_deferring(one_rank_group):
    """The synchroniser's post-accumulate-grad hook reads ``.grad``, never changes the parameter:
    with a user's tensor hook on ``a`` (a gradient clamp) the whole call had gone to plain
    autograd, ``b`` no longer deferred, with a warning of an optimizer stepped in backward."""
    twobp.register(_TanhAffine, twobp.ops.recompute)
    model = twobp.patch(nn.Sequential(_TanhAffine()).double())
    sync = GradientSynchroniser(model)
    model[0].a.register_hook(lambda g: g.clamp(-1, 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(2, 3, 4, dtype=torch.float64)).pow(2).sum().backward()
    assert not [w for w in caught if "such calls keep plain autograd" in str(w.message)]
    assert twobp.pending().jobs == 1  # b's work; a's gradient came at once, through its hook
    sync.synchronise()
    sync.close()


def test_a_tensor_hook_registered_after_a_recompute_forward_on_a_stepped_parameter_is_named():
    """Registered between the forward and its backward, the hook cannot keep that call on plain
    autograd: the flush's refusal of the changed parameter says why and what to do."""
    twobp.register(_TanhAffine, twobp.ops.recompute)
    patched = twobp.patch(nn.Sequential(_TanhAffine()).double())
    _optimizer_in_backward(patched, skip="queued")
    output = patched(torch.randn(2, 4, dtype=torch.float64))
    patched[0].a.register_hook(lambda g: g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        output.pow(2).sum().backward()
    with pytest.raises(RuntimeError, match=r"twobp: .*register the tensor hook before the forward"):
        twobp.flush_weight_grads()
    twobp.discard_weight_grads()


class _HandWrittenTiedLM(nn.Module):
    """A patched embedding whose weight a functional head also uses: one of its two
    contributions is plain autograd's, in backward, the other deferred."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.hidden = nn.Linear(8, 8)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(torch.tanh(self.hidden(self.embed(tokens))), self.embed.weight).flatten(0, 1)


@pytest.mark.parametrize(
    "model_kind, set_to_none",
    [("mlp", False), ("embedding-with-a-functional-head", True), ("embedding-with-a-functional-head", False)],
    ids=["zeroed-not-freed", "partly-plain-weight", "partly-plain-weight-zeroed"],
)
def test_optimizer_in_backward_skipping_while_work_is_queued(model_kind, set_to_none):
    """Where .grad is not None during backward (zeroed instead of freed, or a weight with a
    plain use besides its patched one), the hook tells its two calls apart with
    twobp.has_queued_work, and steps once, at the flush, on the whole gradient."""
    torch.manual_seed(0)
    model = mlp() if model_kind == "mlp" else _HandWrittenTiedLM()
    patched, reference = patched_and_reference(model)
    _optimizer_in_backward(patched, skip="queued", set_to_none=set_to_none)
    _optimizer_in_backward(reference, skip="queued", set_to_none=set_to_none)
    for seed in range(3):
        if model_kind == "mlp":
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))
            loss_of(patched, x).backward()
            twobp.flush_weight_grads()
            loss_of(reference, x).backward()
        else:
            _tied_lm_step(patched, seed)
            twobp.flush_weight_grads()
            _tied_lm_step(reference, seed)
    for (name, p), q in zip(patched.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_optimizer_in_backward_hooks_registered_between_two_backwards_step_once_on_the_sum():
    """Plain's hooks, registered after the first backward, step once, in the second, on both
    backwards' gradients; so does the flush of both (it was refused as a sum over two calls).
    Hooked in both backwards, the same flush is still refused: plain stepped twice."""
    torch.manual_seed(0)
    patched, reference = patched_and_reference(mlp())
    x1, x2 = torch.randn(4, 6), torch.randn(4, 6)
    loss_of(patched, x1).backward()
    loss_of(reference, x1).backward()
    _optimizer_in_backward(patched, skip="queued")
    _optimizer_in_backward(reference, skip="queued")
    loss_of(patched, x2).backward()
    loss_of(reference, x2).backward()
    twobp.flush_weight_grads()
    for (name, p), q in zip(patched.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    loss_of(patched, x1).backward()
    loss_of(patched, x2).backward()
    # Parameters delivered before the refused one were stepped by their hooks: the message says so.
    with pytest.raises(PartlyDelivered, match="handed over have run.*sums the weight gradients of several backward"):
        twobp.flush_weight_grads()


def test_one_optimizer_stepped_from_one_parameters_hook_is_refused_mid_flush():
    """One optimizer over the whole model stepped from a parameter's hook ("the last gradient
    is in"): a flush delivers in its own order, not plain backward's, so the step would run on
    part of the gradients and the rest would land after it. Refused, naming the fix. (Hooked on
    every parameter, so that whichever the flush delivers first steps.)"""
    patched = twobp.patch(mlp())
    optimizer = torch.optim.SGD(patched.parameters(), lr=0.1)

    def step(p):
        if not twobp.has_queued_work(p):
            optimizer.step()
            optimizer.zero_grad()

    for p in patched.parameters():
        p.register_post_accumulate_grad_hook(step)
    before = [p.detach().clone() for p in patched.parameters()]
    loss_of(patched, torch.randn(4, 6)).backward()
    with pytest.raises(PartlyDelivered, match="yet to hand .* their gradients.*its own hook"):
        twobp.flush_weight_grads()
    for p, b in zip(patched.parameters(), before, strict=True):
        torch.testing.assert_close(p, b, rtol=0, atol=0)  # no step taken


def _act_on_all(model: nn.Module, action: str):
    """What a hook on one parameter may do to all of them "once the last gradient is in"."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.zeros(()))  # the scaler is in use: unscale_ acts

    def act(p):
        if twobp.has_queued_work(p):
            return
        if action == "clip-norm":
            nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        elif action == "clip-value":
            nn.utils.clip_grad_value_(model.parameters(), 0.05)
        elif action == "unscale":
            scaler.unscale_(optimizer)
        elif action == "zero-grad":
            optimizer.zero_grad()
        else:  # clipping first bumps the undelivered .grad's version: the step is still refused
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            optimizer.step()

    return act


@pytest.mark.parametrize("action", ["clip-norm", "clip-value", "unscale", "zero-grad", "clip-then-step"])
def test_acting_on_every_gradient_from_one_parameters_hook_is_refused_mid_flush(action):
    """Clipping, unscaling or zeroing every gradient from the hook of the parameter plain
    backward accumulates last: a flush delivers in its own order, so it would act on part of
    them (measured: clipped gradients 0.05 off, two biases 1.3 and 2.6 off). Refused."""
    patched = twobp.patch(mlp(torch.float64))
    for p in patched.parameters():  # whichever the flush delivers first acts
        p.register_post_accumulate_grad_hook(_act_on_all(patched, action))
        p.grad = torch.zeros_like(p)  # as zero_grad(set_to_none=False) leaves them
    loss_of(patched, torch.randn(4, 6, dtype=torch.float64)).backward()
    with pytest.raises(PartlyDelivered, match="in a post-accumulate-grad hook while the flush has yet to hand"):
        twobp.flush_weight_grads()


@pytest.mark.parametrize("split", ["tags", "queues"])
def test_optimizer_in_backward_over_backward_calls_flushed_apart_is_refused(split):
    """Two backward calls whose work is flushed by two flushes (by tag, or from two queues): a
    hook that waits while work is queued steps at the second on both calls' sum, where plain
    steps after each (measured 0.13 off). Refused as for one flush of both."""
    patched = twobp.patch(mlp(torch.float64))
    _optimizer_in_backward(patched, skip="queued")
    queues = [twobp.WeightGradQueue()] * 2 if split == "tags" else [twobp.WeightGradQueue(), twobp.WeightGradQueue()]
    for call, queue in enumerate(queues):
        with twobp.use_queue(queue), queue.tagged(call):
            loss_of(patched, torch.randn(4, 6, dtype=torch.float64)).backward()
    queues[0].flush(tags=[0])
    with pytest.raises(PartlyDelivered, match="several backward calls"):
        queues[1].flush(tags=[1])


def test_optimizer_in_backward_accumulating_over_flushed_backward_calls_steps_as_plain():
    """One flush per backward, a hook stepping every second call (gradient accumulation in
    optimizer-in-backward): each delivery was a whole backward call's, so the step on two of
    them is plain's, not the refused sum of one flush over several calls."""
    patched, reference = patched_and_reference(mlp(torch.float64))
    for model in (patched, reference):
        optimizers = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}
        calls = dict.fromkeys(optimizers, 0)

        def step(p, optimizers=optimizers, calls=calls):
            if twobp.has_queued_work(p):
                return
            calls[p] += 1
            if calls[p] % 2 == 0:
                optimizers[p].step()
                optimizers[p].zero_grad()

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(step)
    for seed in range(4):
        x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        loss_of(patched, x).backward()
        twobp.flush_weight_grads()
        loss_of(reference, x).backward()
    for (name, p), q in zip(patched.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12, msg=name)


def test_a_hook_raising_mid_flush_leaves_no_state_behind():
    """A flush whose hook raised: the user clears .grad by hand and goes on; the next flushes'
    steps are not refused for what the failed one had begun to deliver."""
    patched = twobp.patch(mlp(torch.float64))
    optimizers = {p: torch.optim.SGD([p], lr=0.1) for p in patched.parameters()}
    failing = [True]

    def step(p):
        if twobp.has_queued_work(p):
            return
        if failing[0]:
            failing[0] = False
            raise ValueError("a hook failed")
        optimizers[p].step()
        optimizers[p].zero_grad()

    for p in patched.parameters():
        p.register_post_accumulate_grad_hook(step)
    loss_of(patched, torch.randn(4, 6, dtype=torch.float64)).backward()
    with pytest.raises(PartlyDelivered, match="a hook failed"):
        twobp.flush_weight_grads()
    for p in patched.parameters():
        p.grad = None
    for _ in range(2):
        loss_of(patched, torch.randn(4, 6, dtype=torch.float64)).backward()
        twobp.flush_weight_grads()
    assert all(p.grad is None for p in patched.parameters())  # stepped and freed by every hook
    assert all(len(p._post_accumulate_grad_hooks) == 1 for p in patched.parameters())  # ours removed


def test_optimizer_in_backward_stepping_on_none_is_refused_with_the_fix():
    """Its step during backward would skip the parameter (no gradient yet) and its zero_grad drop
    the queued work: refused, naming the idiom's fix."""
    patched = twobp.patch(mlp())
    _optimizer_in_backward(patched, skip="never")
    with pytest.raises(RuntimeError, match="post-accumulate-grad hook.*twobp.has_queued_work"):
        loss_of(patched, torch.randn(4, 6)).backward()
    twobp.discard_weight_grads()


def test_optimizer_in_backward_over_several_backward_calls_per_flush_is_refused():
    """Plain autograd steps after each backward and runs the next forward on the stepped
    weights; one flush for several backward calls cannot do that: its hook's step is refused,
    naming the fix, instead of stepping once on the sum."""
    patched = twobp.patch(mlp())
    _optimizer_in_backward(patched, skip="none")
    before = [p.detach().clone() for p in patched.parameters()]
    for _ in range(2):
        loss_of(patched, torch.randn(4, 6)).backward()
    with pytest.raises(PartlyDelivered, match="several backward calls.*flush after every backward"):
        twobp.flush_weight_grads()
    assert twobp.pending().jobs == 0
    for p, b in zip(patched.parameters(), before, strict=True):
        torch.testing.assert_close(p, b, rtol=0, atol=0)  # no step taken


def test_bf16_autocast_on_cpu():
    patched, reference = patched_and_reference(mlp())
    x = torch.randn(8, 6)
    for model in (patched, reference):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        assert out.dtype == torch.bfloat16
        out.float().pow(2).mean().backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.bfloat16)


@pytest.mark.parametrize("strategy", ["concat", "loop", "auto"])
def test_flush_strategies_agree(strategy):
    queue = twobp.WeightGradQueue(strategy, max_concat_bytes=256)
    patched, reference = patched_and_reference(mlp())
    with twobp.use_queue(queue):
        for batch in (3, 5, 2):
            x = torch.randn(batch, 6)
            loss_of(patched, x).backward()
            loss_of(reference, x).backward()
    assert twobp.pending().jobs == 0 and twobp.pending(queue).jobs == 9
    twobp.flush_weight_grads(queue)
    assert_grads_match(patched, reference)


@pytest.mark.parametrize("style", ["weight_norm-hook", "parametrization-after-patch"])
def test_weight_rebuilt_each_call_stays_on_autograd_and_bias_is_deferred(style):
    """A weight computed from other parameters at each call is no leaf: its gradient must flow
    through that computation during backward; only leaf parameters are deferred."""
    import warnings

    model = mlp()
    if style == "weight_norm-hook":  # cannot be deep-copied: build the twin from the state
        reference = mlp()
        reference.load_state_dict(model.state_dict())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            for m in (model, reference):
                torch.nn.utils.weight_norm(m[2])
        patched = twobp.patch(model)
    else:
        patched, reference = patched_and_reference(model)
        for m in (patched, reference):
            torch.nn.utils.parametrizations.weight_norm(m[2])
    for _ in range(2):
        x = torch.randn(4, 6)
        loss_of(patched, x).backward()
        loss_of(reference, x).backward()
    assert patched[2].bias.grad is None and patched[0].weight.grad is None
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


# -- autograd features combined with a training step ------------------------------------------


def convnet() -> nn.Module:
    """Conv, BatchNorm, LayerNorm, attention and linear layers: every kind of tap and Function."""
    return nn.Sequential(
        nn.Conv2d(2, 4, 3),
        nn.BatchNorm2d(4),
        nn.Tanh(),
        nn.Flatten(2),  # (batch, 4 positions, 9 features)
        nn.LayerNorm(9),
        nn.Linear(9, 6),
        SelfAttention(),
        nn.Linear(6, 2),
    )


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(6, 2, batch_first=True)

    def forward(self, x):
        return self.attention(x, x, x)[0]


def convnet_input():
    return torch.randn(3, 2, 5, 5)


def finish_and_compare(patched, reference, jobs: int) -> None:
    """The patched model deferred ``jobs`` jobs and wrote no .grad; after the flush its
    gradients are plain autograd's and nothing is left queued."""
    assert twobp.pending().jobs == jobs
    assert_no_grads(patched)
    twobp.flush_weight_grads()
    assert twobp.pending().jobs == 0
    assert_grads_match(patched, reference)


@pytest.mark.parametrize("layer", [0, 4, 5], ids=["conv", "layernorm", "linear"])
def test_retain_grad_and_tensor_hooks_on_a_patched_output(layer):
    """retain_grad() and a hook that rescales the gradient, on a patched module's output: the
    retained gradient and the weight gradients below the hook are plain autograd's."""
    patched, reference = patched_and_reference(convnet())
    x = convnet_input()
    retained, seen = [], []
    for model in (patched, reference):
        hidden = model[: layer + 1](x)
        hidden.retain_grad()
        hidden.register_hook(lambda g: (seen.append(g), g * 3)[1])
        model[layer + 1 :](hidden).pow(2).sum().backward()
        retained.append(hidden.grad)
    torch.testing.assert_close(retained[0], retained[1])
    torch.testing.assert_close(seen[0], seen[1])
    finish_and_compare(patched, reference, jobs=7)


def test_retain_grad_on_a_patched_output_modified_in_place():
    patched, reference = patched_and_reference(mlp())
    x = torch.randn(4, 6)
    retained = []
    for model in (patched, reference):
        hidden = model[:3](x)
        hidden.retain_grad()
        model[3:](hidden).pow(2).sum().backward()  # model[3] is ReLU(inplace=True)
        retained.append(hidden.grad)
    torch.testing.assert_close(retained[0], retained[1])
    finish_and_compare(patched, reference, jobs=3)


def test_tensor_hook_on_a_linear_output_then_modified_in_place():
    """A patched Linear returns plain's form (no view for a 2-D product): a hook registered
    on its output before an in-place op is still called."""
    patched, reference = patched_and_reference(mlp())
    x = torch.randn(4, 6)
    calls = []
    for model in (patched, reference):
        seen = []
        hidden = model[:3](x)
        hidden.register_hook(seen.append)
        model[3:](hidden).pow(2).sum().backward()  # model[3] is ReLU(inplace=True)
        calls.append(len(seen))
    twobp.flush_weight_grads()
    assert calls[0] == calls[1] == 1


def _frozen(module: nn.Module, *names: str) -> nn.Module:
    for name in names:
        module.get_parameter(name).requires_grad_(False)
    return module


def _cross_attention(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    memory = torch.ones(2, 5, module.kdim, dtype=torch.float64)  # key is value: packed k/v where it can be
    return module(x, memory, memory, need_weights=False)[0]


# (id, module, call, whether the input needs a gradient): where plain autograd saves no input,
# (the weight of the product it feeds is frozen, or the norm's input needs no gradient).
_NO_INPUT_SAVED = [
    ("linear-frozen-weight", lambda: _frozen(nn.Linear(8, 8), "weight"), None, True),
    ("rms-norm-input-without-grad", lambda: nn.RMSNorm(8), None, False),
    ("rms-norm-4d-input-without-grad", lambda: nn.RMSNorm((3, 8)), None, False),
    (
        "attention-frozen-in-proj-cross",
        lambda: _frozen(nn.MultiheadAttention(8, 2, batch_first=True), "in_proj_weight"),
        _cross_attention,
        True,
    ),
    (
        "attention-frozen-q-proj-kdim",
        lambda: _frozen(nn.MultiheadAttention(8, 2, kdim=6, vdim=6, batch_first=True), "q_proj_weight"),
        _cross_attention,
        True,
    ),
]


@pytest.mark.parametrize("autocast", [False, True], ids=["no-autocast", "autocast"])
@pytest.mark.parametrize("when", ["before-backward", "before-flush"])
@pytest.mark.parametrize(
    "make, call, input_grad", [c[1:] for c in _NO_INPUT_SAVED], ids=[c[0] for c in _NO_INPUT_SAVED]
)
def test_an_input_plain_does_not_save_may_change_in_place(make, call, input_grad, when, autocast):
    """Plain autograd keeps a layer's input only where a gradient needs it (addmm's for a
    trainable weight; the norm's input for its own gradient, else only x_hat): such an input
    may then change in place after the forward (a residual added in place, bias-only
    fine-tuning), before backward or before the flush, and the gradients are plain's. Under
    autocast (CPU, fp64 tensors left alone) the ops take their other path, the tap."""
    call = call or (lambda module, x: module(x))
    patched, reference = patched_and_reference(make().to(torch.float64))
    x0 = torch.randn(2, 3, 8, dtype=torch.float64)
    if isinstance(patched, nn.RMSNorm) and len(patched.normalized_shape) == 2:
        x0 = torch.randn(2, 4, 3, 8, dtype=torch.float64)
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    for model in (patched, reference):
        x = x0.clone().requires_grad_(input_grad)
        hidden = x * 1.0 if input_grad else x
        with context:
            out = call(model, hidden)
            if when == "before-backward":
                with torch.no_grad():
                    hidden.add_(1.0)
            (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum().backward()
            if when == "before-flush":
                with torch.no_grad():
                    hidden.add_(1.0)
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)


@pytest.mark.parametrize("mode", ["all", "any"])
def test_multi_grad_hook_over_patched_outputs(mode):
    patched, reference = patched_and_reference(convnet())
    x = convnet_input()
    seen = []
    for model in (patched, reference):
        conv, norm = model[0](x), None
        norm = model[1:5](conv)
        torch.autograd.graph.register_multi_grad_hook(
            (conv, norm), lambda g: seen.append([t.clone() for t in g] if mode == "all" else [g.clone()]), mode=mode
        )
        model[5:](norm).pow(2).sum().backward()
    for got, want in zip(seen[0], seen[1], strict=True):
        torch.testing.assert_close(got, want)
    finish_and_compare(patched, reference, jobs=7)


def test_anomaly_mode_catches_a_nan_that_only_a_deferred_weight_gradient_has():
    """Plain autograd's check_nan raises in backward when a node returns NaN; a weight gradient
    made at the flush is checked there, by the flush, naming its kernel. The work stays queued."""
    x = torch.tensor([[float("inf"), 1.0, 2.0]])
    plain, patched = nn.Linear(3, 2), twobp.patch(nn.Linear(3, 2))
    with torch.autograd.detect_anomaly(check_nan=True):
        with pytest.raises(RuntimeError, match="returned nan values"):
            (plain(x) * 0).sum().backward()
        (patched(x) * 0).sum().backward()  # the input gradient is finite
    with pytest.raises(RuntimeError, match="twobp: the deferred weight-gradient kernel 'linear_weight_grad' .* nan"):
        twobp.flush_weight_grads()
    assert twobp.pending().jobs == 1 and patched.weight.grad is None
    twobp.discard_weight_grads()


def test_a_nan_refused_after_a_delivery_bucket_says_only_what_holds():
    """Wrapped in PartlyDelivered (part of the work in .grad, the rest dropped), the refusal still
    said that nothing reached .grad and the work stayed queued."""
    class Finite(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return torch.nan_to_num(x)

    layers = twobp.patch(nn.Sequential(nn.Linear(3, 2), Finite(), nn.Linear(2, 2)))
    queue = twobp.WeightGradQueue(delivery_bucket_bytes=1)
    with torch.autograd.detect_anomaly(check_nan=True), twobp.use_queue(queue):
        # The first layer's input holds an inf: its weight gradient (run second) alone is NaN.
        layers(torch.tensor([[float("inf"), 1.0, 2.0]])).sum().backward()
    with pytest.raises(PartlyDelivered, match="returned nan values") as raised:
        queue.flush()
    assert "stays queued" not in str(raised.value) and "Nothing reached" not in str(raised.value)
    assert layers[2].weight.grad is not None and queue.pending().jobs == 0


def test_anomaly_mode_checks_only_the_work_of_backwards_run_under_it():
    """A NaN weight gradient from a backward run without anomaly mode (plain leaves it in .grad)
    beside another layer's backward run under it: the flush checked every group and raised."""
    first, second = twobp.patch(nn.Linear(2, 2)), twobp.patch(nn.Linear(2, 2))
    (first(torch.tensor([[float("inf"), 1.0]])) * 0).sum().backward()
    with torch.autograd.detect_anomaly(check_nan=True):
        second(torch.randn(3, 2)).sum().backward()
    twobp.flush_weight_grads()
    assert first.weight.grad.isnan().any() and second.weight.grad.isfinite().all()


_STOPPED_BY_ANOMALY_MODE = {
    "Linear": (lambda: nn.Linear(4, 4), (5, 4), lambda layer: layer.weight.data.__setitem__((1, 2), math.nan)),
    "Linear-non-contiguous-input": (
        lambda: nn.Linear(4, 4), (4, 5), lambda layer: layer.weight.data.__setitem__((1, 2), math.nan)
    ),
    "Conv2d": (lambda: nn.Conv2d(4, 4, 1), (2, 4, 3, 3), lambda layer: layer.weight.data.__setitem__((1, 2), math.nan)),
    "LayerNorm": (lambda: nn.LayerNorm(4), (5, 4), lambda layer: layer.weight.data.__setitem__(1, math.nan)),
    "BatchNorm2d": (lambda: nn.BatchNorm2d(4), (2, 4, 3, 3), lambda layer: layer.weight.data.__setitem__(1, math.nan)),
}


def _masked_nan_loss(model: nn.Module, layer: str, x: Tensor) -> Tensor:
    """The loss of a layer with a NaN in a weight whose output channel the loss masks out: its
    input gradient is NaN, its weight gradients are finite."""
    _, _, poison = _STOPPED_BY_ANOMALY_MODE[layer]
    poison(model[1])
    out = model(x)
    keep = torch.ones(out.shape[1], dtype=torch.bool)
    keep[1] = False
    return torch.where(keep.view([1, -1] + [1] * (out.dim() - 2)), out, 0.0).pow(2).sum()


@pytest.mark.parametrize("capped", [False, True], ids=["queue", "capped-queue"])
@pytest.mark.parametrize("layer", list(_STOPPED_BY_ANOMALY_MODE))
def test_anomaly_mode_stopping_a_layers_node_leaves_its_weight_gradients_out_as_plain(layer, capped):
    """Anomaly mode stops plain's node, which computed the weight gradients too, and none reaches
    .grad; the layer had queued them, and the flush handed them over (a capped queue's early
    flush, inside the layer's node, before anomaly mode stopped it)."""
    make, shape, _ = _STOPPED_BY_ANOMALY_MODE[layer]
    patched, reference = patched_and_reference(nn.Sequential(nn.Identity(), make()).double())
    x = torch.randn(*shape, dtype=torch.float64)
    if layer.endswith("non-contiguous-input"):
        x = x.t()
    queue = twobp.WeightGradQueue(max_pending_bytes=0) if capped else current_queue()
    for model in (patched, reference):
        with twobp.use_queue(queue), torch.autograd.detect_anomaly(check_nan=True):
            with pytest.raises(RuntimeError, match="nan values"):
                _masked_nan_loss(model, layer, x.clone().requires_grad_()).backward()
    twobp.flush_weight_grads(queue)
    assert_grads_match(patched, reference, torch.float64)


@pytest.mark.parametrize("layer", ["Linear", "LayerNorm"])
def test_anomaly_mode_checks_only_the_input_gradients_a_backward_wants(layer):
    """``backward(inputs=[weight])``: plain's node leaves the input gradient uncomputed, and its
    NaN raises nothing; the deferred node computed it, and anomaly mode raised (and then dropped
    the layer's queued work)."""
    make, shape, _ = _STOPPED_BY_ANOMALY_MODE[layer]
    patched, reference = patched_and_reference(nn.Sequential(nn.Identity(), make()).double())
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    with torch.autograd.detect_anomaly(check_nan=True):
        for model in (patched, reference):
            _masked_nan_loss(model, layer, x).backward(inputs=[model[1].weight])
    twobp.flush_weight_grads()
    assert x.grad is None
    assert_grads_match(patched, reference, torch.float64)


def test_anomaly_mode_under_autograd_grad_of_a_leaf_input_names_the_nan():
    """Asking autograd whether it runs a leaf's accumulator raises under autograd.grad: the NaN
    the node returned was reported as that question's error."""
    layer = twobp.patch(nn.Linear(4, 4).double())
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    loss = _masked_nan_loss(nn.Sequential(nn.Identity(), layer), "Linear", x)
    with torch.autograd.detect_anomaly(check_nan=True), pytest.raises(RuntimeError, match="returned nan values"):
        torch.autograd.grad(loss, [x])


@pytest.mark.parametrize("check_nan", [True, False])
def test_anomaly_mode(check_nan):
    patched, reference = patched_and_reference(convnet())
    x = convnet_input()
    with torch.autograd.detect_anomaly(check_nan=check_nan):
        for model in (patched, reference):
            model(x).pow(2).sum().backward()
    finish_and_compare(patched, reference, jobs=7)


def test_increment_version_of_a_patched_output_before_its_consumers():
    patched, reference = patched_and_reference(mlp())
    x = torch.randn(4, 6)
    for model in (patched, reference):
        hidden = model[0](x)
        torch.autograd.graph.increment_version(hidden)  # nothing saved it yet
        model[1:](hidden).pow(2).sum().backward()
    finish_and_compare(patched, reference, jobs=3)


def test_increment_version_of_a_saved_input_is_refused_as_in_plain_pytorch():
    """The tap saves the input of a patched Linear through autograd's saved tensors, so a
    change marked on it after the forward is caught at backward, as plain autograd catches it.
    (The layers above it ran their backward first: their work is queued, as plain autograd
    would have written their .grad; discard_weight_grads() starts the next step clean.)"""
    for model in (mlp(), twobp.patch(mlp())):
        hidden = torch.randn(4, 6, requires_grad=True) * 1
        output = model(hidden)
        torch.autograd.graph.increment_version(hidden)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            output.sum().backward()
    twobp.discard_weight_grads()


def test_one_output_read_by_two_consumers():
    patched, reference = patched_and_reference(mlp())
    x = torch.randn(4, 6)
    for model in (patched, reference):
        hidden = model[0](x)
        (model[1:](hidden).pow(2).sum() + hidden.pow(3).sum()).backward()
    finish_and_compare(patched, reference, jobs=3)


def test_backward_over_several_roots_with_gradients():
    patched, reference = patched_and_reference(mlp())
    x = torch.randn(4, 6)
    for model in (patched, reference):
        hidden = model[:3](x)
        torch.autograd.backward([model[3:](hidden).sum(), hidden.pow(2).sum()], [torch.tensor(2.0), None])
    finish_and_compare(patched, reference, jobs=3)


def test_allow_mutation_on_saved_tensors():
    patched, reference = patched_and_reference(mlp())
    x = torch.randn(4, 6)
    for model in (patched, reference):
        with torch.autograd.graph.allow_mutation_on_saved_tensors():
            hidden = model[:2](x)
            output = model[2:](hidden)
            hidden.mul_(2)  # saved by the next Linear: cloned for backward by the context
            output.pow(2).sum().backward()
    finish_and_compare(patched, reference, jobs=3)


@pytest.mark.parametrize("with_weights", [False, True], ids=["inputs", "inputs-and-weights"])
def test_batched_grad_outputs_vmap_the_backward(with_weights):
    """autograd.grad(is_grads_batched=True) runs the backward under vmap over a batch of output
    gradients: it never accumulates, so nothing is queued; what it returns is plain's."""
    patched, reference = patched_and_reference(convnet())
    x = convnet_input()
    grad_outputs = torch.randn(4, 3, 4, 2)
    results = []
    for model in (patched, reference):
        leaf = x.clone().requires_grad_()
        inputs = [leaf, *model.parameters()] if with_weights else [leaf]
        results.append(torch.autograd.grad(model(leaf), inputs, grad_outputs, is_grads_batched=True))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want)
    assert twobp.pending().jobs == 0
    assert_no_grads(patched)


@pytest.mark.parametrize("vectorize", [False, True])
def test_functional_jacobian_of_the_input(vectorize):
    patched, reference = patched_and_reference(mlp(torch.float64))
    x = torch.randn(3, 6, dtype=torch.float64)
    got = torch.autograd.functional.jacobian(patched, x, vectorize=vectorize)
    torch.testing.assert_close(got, torch.autograd.functional.jacobian(reference, x, vectorize=vectorize))
    assert twobp.pending().jobs == 0


def test_functional_jvp_names_the_forward_mode_alternative():
    """torch.autograd.functional.jvp takes a double backward (create_graph=True) inside."""
    model = twobp.patch(mlp(torch.float64))
    x = torch.randn(3, 6, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="twobp: create_graph=True.*torch.func.jvp"):
        torch.autograd.functional.jvp(model, x, torch.randn_like(x))


class Gate(nn.Module):
    """Ends in an op that saves its own result for backward (sigmoid; relu does too)."""

    def __init__(self, features: int, last) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(features))
        self.last = last

    def forward(self, x):
        return self.last(x * self.weight)


@pytest.mark.parametrize("last", [torch.sigmoid, torch.relu, torch.exp], ids=["sigmoid", "relu", "exp"])
def test_recompute_rule_on_a_module_whose_last_op_saves_its_result(last):
    """The tap re-parents the output without changing it: the op that made it still finds its
    saved result unmodified (it used to see a version bump and refuse the backward)."""
    twobp.register(Gate, twobp.ops.recompute)
    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(6, 6), Gate(6, last), nn.Linear(6, 2)))
    for _ in range(2):
        x = torch.randn(4, 6)
        for model in (patched, reference):
            model(x).pow(2).sum().backward()
    finish_and_compare(patched, reference, jobs=6)


class ViewOfGate(Gate):
    """``Gate`` whose output is a view of what its last op made (and saved, as sigmoid and exp
    save their result)."""

    def forward(self, x):
        return super().forward(x)[:, 1:]


@pytest.mark.parametrize("hooked", [False, True], ids=["plain-use", "hook-on-output"])
@pytest.mark.parametrize("last", [torch.sigmoid, torch.exp], ids=["sigmoid", "exp"])
def test_an_output_that_is_a_view_of_what_the_op_saved(last, hooked):
    """A view shares its counter with its base: left bumped after the tap, the op's saved result
    read as modified in place and backward refused; put back without more, a hook registered on
    the view crashed the process (its cached grad_fn went stale)."""
    twobp.register(ViewOfGate, twobp.ops.recompute)
    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(6, 6), ViewOfGate(6, last)).double())
    for _ in range(2):
        x = torch.randn(4, 6, dtype=torch.float64)
        for model in (patched, reference):
            output = model(x)
            if hooked:
                output.register_hook(lambda grad: grad * 2)
            output.pow(2).sum().backward()
    finish_and_compare(patched, reference, jobs=4)


VIEWS = {
    "slice": (lambda y: y[:, 1:], True),
    "transpose": (lambda y: y.t(), True),
    "diagonal": (lambda y: y.diagonal(), True),
    "unfold": (lambda y: y.unfold(1, 2, 1), False),
    "expand": (lambda y: y[:, :1].expand(-1, 3), False),
    "chunk": (lambda y: y.chunk(2, 1)[0], False),
    "split": (lambda y: y.split(2, 1)[1], False),
    "unbind": (lambda y: y.unbind(1)[0], False),
}


class ViewOfProduct(nn.Module):
    def __init__(self, view) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6))
        self.view = view

    def forward(self, x):
        return self.view(x * self.weight)


@pytest.mark.filterwarnings("ignore:twobp. ViewOfProduct called with")
@pytest.mark.parametrize("kind", VIEWS)
def test_the_recompute_rule_on_a_module_whose_output_is_a_view(kind):
    """A view the tap can re-parent is deferred. One whose elements overlap (unfold, expand)
    gave each overlapping element's weight gradient twice (silently 2x plain's), one made by an
    op with several outputs (chunk, split, unbind) crashed with autograd's error: such calls
    keep plain autograd."""
    view, deferred = VIEWS[kind]
    twobp.register(ViewOfProduct, twobp.ops.recompute)
    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(6, 6), ViewOfProduct(view)).double())
    for _ in range(2):
        x = torch.randn(6, 6, dtype=torch.float64)
        for model in (patched, reference):
            model(x).pow(2).sum().backward()
    if deferred:
        finish_and_compare(patched, reference, jobs=4)
    else:  # the Linear's work alone; the view's module wrote its .grad in backward, as plain
        assert twobp.pending().jobs == 2
        twobp.flush_weight_grads()
        assert_grads_match(patched, reference)


@pytest.mark.parametrize("kind", [kind for kind, (_, deferred) in VIEWS.items() if not deferred])
def test_defer_weight_grads_refuses_a_view_it_cannot_tap(kind):
    model = ScaleShift()
    x = torch.randn(6, 4, requires_grad=True)
    output = VIEWS[kind][0](torch.cat([x, x], 1).t() * 2)
    with pytest.raises(RuntimeError, match="twobp: defer_weight_grads cannot take an output that is a view"):
        twobp.deferral.defer_weight_grads(output, (model.weight,), (x.detach(),), _scale_shift_grads)


@pytest.mark.parametrize("substitute", ["other-leaves", "computed-from-the-parameters"])
@pytest.mark.parametrize("input_requires_grad", [True, False], ids=["input-requires-grad", "input-without-grad"])
def test_recompute_rule_under_functional_call_differentiates_the_parameters_it_was_given(
    substitute, input_requires_grad
):
    """torch.func.functional_call swaps other tensors in for the forward only: the flush must
    re-run the module on those (it re-read the module's own, giving the substitutes' gradient
    from other values), and a substitute computed from the parameter (MAML's p - lr * g) must
    pass its gradient on to the parameter at once (it was cut: no gradient at all)."""
    twobp.register(Gate, twobp.ops.recompute)
    patched, reference = patched_and_reference(Gate(4, torch.tanh).double())
    x = torch.randn(3, 4, dtype=torch.float64)
    substitutes = []
    for model in (patched, reference):
        if substitute == "other-leaves":
            weight = (model.weight.detach() * 3).requires_grad_()
        else:
            weight = model.weight * 0.9
        substitutes.append(weight)
        inputs = x.clone().requires_grad_(input_requires_grad)
        torch.func.functional_call(model, {"weight": weight}, (inputs,)).pow(3).sum().backward()
    twobp.flush_weight_grads()
    if substitute == "other-leaves":
        torch.testing.assert_close(substitutes[0].grad, substitutes[1].grad, rtol=1e-12, atol=1e-12)
        assert patched.weight.grad is None and reference.weight.grad is None
    assert_grads_match(patched, reference, torch.float64)


class DropoutScale(nn.Module):
    """A per-sample block with dropout: the kind of module README suggests for the recompute rule."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(features))
        self.dropout = nn.Dropout(0.5)

    def forward(self, x):
        return self.dropout(x * self.weight)


def test_recompute_rule_keeps_plain_autograd_for_a_forward_that_draws_random_numbers():
    """The flush re-runs the forward later, on joined micro-batches: it cannot draw the same
    dropout mask. Such a call runs again on plain autograd from the same random state (same
    output, same generator state after it), and the module stays on plain autograd after."""
    twobp.register(DropoutScale, twobp.ops.recompute_rowwise)
    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(6, 6), DropoutScale(6), nn.Linear(6, 2)))
    for step in range(3):
        x = torch.randn(4, 6)
        outputs, states = [], []
        for model in (patched, reference):
            torch.manual_seed(step)
            with pytest.warns(UserWarning, match="DropoutScale.*random draws") if step == 0 and model is patched else (
                contextlib.nullcontext()
            ):
                outputs.append(model(x))
            states.append(torch.get_rng_state())
            outputs[-1].pow(2).sum().backward()
        torch.testing.assert_close(outputs[0], outputs[1])
        assert torch.equal(states[0], states[1]), "the generator ends where one plain forward leaves it"
        assert twobp.pending().jobs == 2 * (step + 1), "the two Linears defer, the dropout block does not"
    assert patched[1].weight.grad is not None and patched[0].weight.grad is None
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


class LayerDrop(nn.Module):
    """Skips its layer at random by a draw from Python's ``random``, as fairseq's LayerDrop does."""

    draw: Callable[[], float] = staticmethod(random.random)

    def __init__(self, features: int) -> None:
        super().__init__()
        self.linear = nn.Linear(features, features)
        self.gate = nn.Parameter(torch.randn(features))

    def forward(self, x):
        if self.training and self.draw() < 0.5:
            return x * self.gate
        return torch.tanh(self.linear(x)) * self.gate


class NumpyLayerDrop(LayerDrop):
    """Hugging Face's wav2vec2 draws its LayerDrop with ``np.random.uniform``."""

    draw = staticmethod(np.random.uniform)


@pytest.mark.parametrize("kind", [LayerDrop, NumpyLayerDrop], ids=["python", "numpy"])
def test_recompute_rule_keeps_plain_autograd_for_a_forward_that_draws_from_a_host_generator(kind):
    """Only torch's generators were watched: the first call's trials drew too (its output was not
    plain's) and the flush's replay drew again and took other branches (the gate's gradient 23.5
    off over four micro-batches). Such a call runs again on plain autograd from the generator's
    state at the call, which ends where one plain forward leaves it."""
    twobp.register(kind, twobp.ops.recompute)
    patched, reference = patched_and_reference(kind(4).double())
    for micro_batch in range(4):
        x = torch.randn(3, 4, dtype=torch.float64)
        outputs, states = [], []
        for model in (patched, reference):
            random.seed(micro_batch)
            np.random.seed(micro_batch)
            warned = micro_batch == 0 and model is patched
            expected = f"{kind.__name__}.*random draws"
            with pytest.warns(UserWarning, match=expected) if warned else contextlib.nullcontext():
                outputs.append(model(x))
            states.append((random.random(), np.random.uniform()))
            outputs[-1].pow(2).sum().backward()
        torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)
        assert states[0] == states[1], "the generators end where one plain forward leaves them"
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)


class ScheduledLayerDrop(nn.Module):
    """LayerDrop whose rate a schedule raises from zero: no draw on the first calls."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.gate = nn.Parameter(torch.randn(4))
        self.rate = 0.0

    def forward(self, x):
        if self.rate > 0 and random.random() < self.rate:
            return x * self.gate
        return torch.tanh(self.linear(x)) * self.gate


@pytest.mark.parametrize("rule", ["recompute", "recompute_rowwise"])
def test_recompute_rule_watches_host_generators_when_a_schedule_starts_drawing(rule):
    """The host generators are watched on the calls that run trials; the plain rule, which seeks no
    rows-apart verdict, ran none after the first call, so a rate raised later went unseen: the
    replay drew again and took the other branch (a dropped layer's weights got gradients)."""
    kind = ScheduledLayerDrop
    twobp.register(kind, getattr(twobp.ops, rule))
    patched, reference = patched_and_reference(kind().double())
    for step in range(6):
        rate = 0.0 if step < 2 else 0.5
        x = torch.randn(3, 4, dtype=torch.float64)
        for model in (patched, reference):
            model.rate = rate
            random.seed(step)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # taken for random once it draws, warned
                model(x).pow(2).sum().backward()
        twobp.flush_weight_grads()
        assert_grads_match(patched, reference, torch.float64)
        patched.zero_grad()
        reference.zero_grad()


def test_recompute_rule_watches_numpy_under_another_bit_generator():
    """NumPy's global generator set to PCG64 (``np.random.set_bit_generator``) reports its state as
    a dict, not the Mersenne Twister's tuple: every module's first call failed reading it."""
    twobp.register(NumpyLayerDrop, twobp.ops.recompute)
    patched, reference = patched_and_reference(NumpyLayerDrop(4).double())
    bit_generator = np.random.get_bit_generator()
    np.random.set_bit_generator(np.random.PCG64(0))
    try:
        for micro_batch in range(3):
            x = torch.randn(3, 4, dtype=torch.float64)
            draws = []
            for model in (patched, reference):
                np.random.seed(micro_batch)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # taken for random, warned
                    model(x).pow(2).sum().backward()
                draws.append(np.random.uniform())
            assert draws[0] == draws[1]
    finally:
        np.random.set_bit_generator(bit_generator)
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)


class WarmupScale(nn.Module):
    """Per sample, but its forward counts its calls in a buffer (a warm-up factor)."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(features))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        if self.training:
            self.calls += 1
        return x * self.weight * (self.calls / 4).clamp(max=1.0)


class ModeScale(nn.Module):
    """Per sample; its output depends on ``training`` and on a buffer it only reads."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(features))
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x):
        return x * self.weight * (self.scale if self.training else 1.0)


def test_recompute_rule_keeps_plain_autograd_for_a_forward_that_changes_its_buffers():
    """The flush's replay would count (and read) the calls again, at their count by then: the
    weight gradients were 0.86 off. Such a call runs again on plain autograd from the buffers
    it started with, and the module stays on plain autograd after (one warning)."""
    twobp.register(WarmupScale, twobp.ops.recompute)
    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(4, 4), WarmupScale(4)).double())
    for step in range(3):
        x = torch.randn(2, 4, dtype=torch.float64)
        for model in (patched, reference):
            with pytest.warns(UserWarning, match="WarmupScale.*changes the module's buffers") if step == 0 and (
                model is patched
            ) else contextlib.nullcontext():
                model(x).pow(2).sum().backward()
        assert patched[1].calls.item() == reference[1].calls.item() == step + 1
    assert twobp.pending().jobs == 3, "the Linear defers, the counting block does not"
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)


class ConvWithBatchNorm(nn.Module):
    """A user block holding a parameter of its own and a BatchNorm child: the child's running
    statistics change in place without a version bump (ATen's batch_norm kernels write them so)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3, 3, 3))
        self.norm = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.norm(nn.functional.conv2d(x, self.weight, padding=1))


def test_recompute_rule_sees_buffers_changed_without_a_version_bump():
    """The rule looked for a stateful forward by version counters only: the running statistics
    were updated twice per call (its first-call check, then the forward) and again by each
    flush's replay (5.2 off after two steps), and a forward reading them computed other outputs."""
    twobp.register(ConvWithBatchNorm, twobp.ops.recompute)
    model = nn.Sequential(ConvWithBatchNorm(), nn.ReLU(), nn.Conv2d(4, 2, 3)).double()
    patched, reference = patched_and_reference(model)
    for step in range(2):
        x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
        for model in (patched, reference):
            with pytest.warns(UserWarning, match="ConvWithBatchNorm.*changes the module's buffers") if step == 0 and (
                model is patched
            ) else contextlib.nullcontext():
                model(x).pow(2).sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)
    for (name, ours), plain in zip(patched.named_buffers(), reference.buffers(), strict=True):
        torch.testing.assert_close(ours, plain, rtol=1e-12, atol=1e-12, msg=name)


def test_recompute_rule_replays_the_forward_in_its_training_mode_and_refuses_changed_buffers():
    """``eval()`` between backward and flush must not change what the replay computes (it
    did: 2.1 off; calls in eval mode run plain autograd). A buffer the forward read and that
    changed in place before the flush cannot be replayed: refused, work kept."""
    twobp.register(ModeScale, twobp.ops.recompute)
    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(4, 4), ModeScale(4)).double())
    for mode in (True, False, True):
        x = torch.randn(3, 4, dtype=torch.float64)
        for model in (patched, reference):
            model.train(mode)(x).pow(2).sum().backward()
    patched.eval()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)

    patched.train()(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
    with torch.no_grad():
        patched[1].scale.mul_(3)
    with pytest.raises(RuntimeError, match=r"twobp: buffer\(s\) or parameter\(s\) \['scale'\] of a ModeScale"):
        twobp.flush_weight_grads()
    assert twobp.pending().jobs == 2
    twobp.discard_weight_grads()


def _noise_around_the_forward(net: nn.Module, forward: Callable[[], Tensor]) -> Tensor:
    """Weight noise by rebinding ``.data``: perturbed for the forward, restored before backward."""
    clean = [p.data for p in net.parameters()]
    for p in net.parameters():
        p.data = p.data + 0.3
    output = forward()
    for p, data in zip(net.parameters(), clean, strict=True):
        p.data = data
    return output


def _to_fp64_after_the_forward(net: nn.Module, forward: Callable[[], Tensor]) -> Tensor:
    output = forward()
    net.double()
    return output


@pytest.mark.parametrize("change", [_noise_around_the_forward, _to_fp64_after_the_forward], ids=["noise", "to-fp64"])
@pytest.mark.parametrize("layer", ["linear", "attention"])
def test_a_weights_data_rebound_between_forward_and_backward_leaves_plains_input_gradient(change, layer):
    """Plain's addmm saves a view of the weight (``weight.t()``), so its input gradient uses the
    storage the forward read even after ``p.data = t`` (weight noise restored before backward,
    ``.double()``); the patched Linear saved the parameter itself and read the new data (0.6
    off on a Linear, 8.7 through MultiheadAttention's projections; ``.double()`` crashed)."""
    if layer == "linear":
        model: nn.Module = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    else:
        model = nn.MultiheadAttention(6, 2, batch_first=True)
    patched, reference = patched_and_reference(model)
    x = torch.randn(2, 4, 6)
    input_grads = []
    for net in (patched, reference):
        source = x.clone().requires_grad_()
        if layer == "linear":
            output = change(net, lambda net=net, source=source: net(source))
        else:
            output = change(net, lambda net=net, source=source: net(source, source, source, need_weights=False)[0])
        output.square().sum().backward()
        input_grads.append(source.grad)
    twobp.flush_weight_grads()
    torch.testing.assert_close(input_grads[0], input_grads[1], rtol=1e-5, atol=1e-6)
    if change is _noise_around_the_forward:
        assert_grads_match(patched, reference)
    else:  # plain's .grad keeps the forward's dtype (fp32), the flush's is the parameter's (README)
        for (name, p), q in zip(patched.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad.double(), rtol=1e-5, atol=1e-6, msg=name)


def test_recompute_rule_refuses_a_parameter_changed_between_forward_and_backward():
    """Plain's gradient of ``tanh(x * w)`` comes from what its forward saved (the output, x),
    so a change to w before backward does not show there; the replay at the flush would read
    the new w. Refused at the flush (the work's own check starts at backward)."""
    twobp.register(Gate, twobp.ops.recompute)
    patched = twobp.patch(Gate(4, torch.tanh).double())
    output = patched(torch.randn(3, 4, dtype=torch.float64))
    with torch.no_grad():
        patched.weight.mul_(0.5)
    output.sum().backward()
    with pytest.raises(RuntimeError, match=r"twobp: buffer\(s\) or parameter\(s\) \['weight'\] of a Gate"):
        twobp.flush_weight_grads()
    twobp.discard_weight_grads()


def _prune_and_remove(model: nn.Module) -> None:
    torch.nn.utils.prune.l1_unstructured(model[1], "weight", amount=0.5)
    torch.nn.utils.prune.remove(model[1], "weight")


def _halve_through_a_vector(model: nn.Module) -> None:
    vector = torch.nn.utils.parameters_to_vector(model.parameters())
    torch.nn.utils.vector_to_parameters(vector * 0.5, model.parameters())


@pytest.mark.parametrize(
    "change", [_prune_and_remove, _halve_through_a_vector], ids=["prune-remove", "vector-to-parameters"]
)
@pytest.mark.parametrize("when", ["between-micro-batches", "before-the-flush"])
def test_recompute_rule_replays_the_values_its_forward_saw_after_a_parameters_data_is_swapped(change, when):
    """``prune.remove`` and ``vector_to_parameters`` set ``param.data`` (no version change):
    the flush replayed the forward with the new values (0.03-0.18 off). It replays the tensors
    the forward computed with, as plain autograd's backward used them."""
    twobp.register(Gate, twobp.ops.recompute)
    model = nn.Sequential(nn.Linear(6, 6), Gate(6, torch.tanh), nn.Linear(6, 2)).double()
    patched, reference = patched_and_reference(model)
    xs = [torch.randn(4, 6, dtype=torch.float64) for _ in range(2)]
    for net in (patched, reference):
        net(xs[0]).square().sum().backward()
        if when == "between-micro-batches":
            change(net)
        net(xs[1]).square().sum().backward()
        if when == "before-the-flush":
            change(net)
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


class RoutedScale(nn.Module):
    """A Mixtral-like block in miniature: its router's logits also leave through a forward hook
    (Hugging Face captures them so for the router's auxiliary loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(4, 2)
        self.scale = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return x * self.scale * self.router(x).softmax(-1)[..., :1]


def test_recompute_rule_keeps_plain_autograd_for_a_module_whose_submodules_have_forward_hooks():
    """The router's logits taken out by a hook were made with detached parameters: the auxiliary
    loss never reached the router's weight (about 50% off), and the trial run added stray
    logits to the captured list. Such a module keeps plain autograd, with one warning."""
    twobp.register(RoutedScale, twobp.ops.recompute)
    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(4, 4), RoutedScale()))
    xs = [torch.randn(3, 4) for _ in range(2)]
    for model in (patched, reference):
        captured: list[torch.Tensor] = []
        model[1].router.register_forward_hook(lambda module, args, output, captured=captured: captured.append(output))
        for x in xs:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                output = model(x)
            (output.pow(2).sum() + captured[-1].pow(2).sum()).backward()
        assert len(captured) == 2
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


class TanhOfLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.randn(8))

    def forward(self, x):
        return torch.tanh(self.linear(x)) * self.scale


@pytest.mark.parametrize("strategy", ["concat", "loop"])
@pytest.mark.parametrize("autocast", ["every-call", "some-calls"])
def test_recompute_rule_replays_a_forward_in_the_autocast_it_ran_in(strategy, autocast):
    """Forward under bf16 autocast, backward outside (the usual recipe): the flush replayed the
    block outside autocast and failed on a bf16 input meeting an fp32 weight ("mat1 and mat2 must
    have the same dtype"); calls with and without autocast were joined into one replay."""
    twobp.register(TanhOfLinear, twobp.ops.recompute_rowwise)
    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(8, 8), TanhOfLinear(), nn.Linear(8, 2)))
    queue = twobp.WeightGradQueue(strategy)
    for call in range(3):
        x = torch.randn(4, 8)
        enabled = autocast == "every-call" or call != 1
        for model in (patched, reference):
            with twobp.use_queue(queue), torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
                output = model(x)
            output.float().pow(2).sum().backward()
    queue.flush()
    assert_grads_match(patched, reference, dtype=torch.bfloat16)  # the products ran in bf16


def test_recompute_rule_keeps_plain_autograd_for_a_module_whose_submodules_have_backward_hooks():
    """A full backward hook on a child fired again at the flush, on the replay's joined gradient
    (or once more per micro-batch), after its calls in backward."""
    twobp.register(TanhOfLinear, twobp.ops.recompute_rowwise)
    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(8, 8), TanhOfLinear()))
    xs = [torch.randn(4, 8) for _ in range(3)]
    for model in (patched, reference):
        shapes: list[tuple[int, ...]] = []
        record = lambda m, grad_in, grad_out, shapes=shapes: shapes.append(grad_out[0].shape)  # noqa: E731
        model[1].linear.register_full_backward_hook(record)
        for x in xs:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model(x).pow(2).sum().backward()
        twobp.flush_weight_grads()
        assert shapes == [(4, 8)] * 3
    assert_grads_match(patched, reference)


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return x * self.weight


class CheckpointsInside(Scale):
    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(t * self.weight), x, use_reentrant=False)


def test_recompute_rule_keeps_plain_autograd_for_a_checkpoint_inside_the_forward():
    """The checkpoint's recomputation in backward read the real parameters, not the forward's
    detached stand-ins, and unpacked other tensors than the forward saved: the Linear before it
    got silently wrong gradients (0.51 off). Such calls keep plain autograd, one warning."""
    twobp.register(CheckpointsInside, twobp.ops.recompute)
    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(4, 4), CheckpointsInside()))
    x = torch.randn(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        patched(x).sum().backward()
    twobp.flush_weight_grads()
    reference(x).sum().backward()
    assert_grads_match(patched, reference)


class WithAnAuxiliaryLoss(Scale):
    def forward(self, x):
        scaled = x * self.weight
        return scaled, torch.stack([scaled.pow(2).mean()])


def test_recompute_rule_joins_no_call_with_an_output_without_a_batch_dim():
    """An auxiliary loss of shape (1,) beside the batched output: its gradients were joined
    into (2,) against the replay's (1,), and the flush failed with PyTorch's size error."""
    twobp.register(WithAnAuxiliaryLoss, twobp.ops.recompute_rowwise)
    patched, reference = patched_and_reference(WithAnAuxiliaryLoss())
    queue = twobp.WeightGradQueue("concat")
    for _ in range(2):
        x = torch.randn(3, 4)
        for model in (patched, reference):
            with twobp.use_queue(queue):
                output, auxiliary = model(x)
            (output.sum() + auxiliary.sum()).backward()
    queue.flush()
    assert_grads_match(patched, reference)


class CountsCalls(Scale):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x * self.weight


@pytest.mark.parametrize(
    ("layers", "steps", "initial_state"), [(1, 1, False), (2, 2, False), (1, 1, True)], ids=["step", "layers", "h0"]
)
def test_recompute_rule_joins_calls_only_where_their_rows_are_apart(layers, steps, initial_state):
    """A time-major GRU (batch_first=False, PyTorch's default) registered with the rule: where its
    steps matched its layers (a decoder's one-step calls), every tensor's dim 0 agreed, so the
    flush joined micro-batches' steps into one sequence and replayed it (0.48 to 0.90 off,
    silently), or failed on the joined initial state. A rule module whose rows are apart still
    joins: one replay for all micro-batches."""
    twobp.register((nn.GRU, CountsCalls), twobp.ops.recompute_rowwise)
    model = nn.ModuleList([nn.GRU(4, 4, num_layers=layers), CountsCalls()]).double()
    patched, reference = patched_and_reference(model)
    queue = twobp.WeightGradQueue("concat")
    for _ in range(3):
        x = torch.randn(steps, 2, 4, dtype=torch.float64)
        state = (torch.randn(layers, 2, 4, dtype=torch.float64),) if initial_state else ()
        for net in (patched, reference):
            with twobp.use_queue(queue):
                output, _ = net[0](x, *state)
                net[1](output.flatten(0, 1)).pow(2).sum().backward()
    calls = patched[1].calls
    queue.flush()
    assert_grads_match(patched, reference, torch.float64)
    assert patched[1].calls - calls == 1, "the row-wise module's micro-batches are replayed joined"


class CausalMean(nn.Module):
    """Time-major (L, B, E): a running mean along L, each batch column apart."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        steps = torch.arange(1, x.shape[0] + 1, dtype=x.dtype).view(-1, 1, 1)
        return (x @ self.weight).cumsum(0) / steps


class MaxScale(nn.Module):
    """Scales by the batch's largest activation: rows mixed by a max a duplicate row cannot move."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        h = self.linear(x)
        return h / h.abs().amax(0, keepdim=True)


class TokenCausalMean(nn.Module):
    """CausalMean over time-major token ids (L, B): no float input to put rows of other values in."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 4))

    def forward(self, ids):
        steps = torch.arange(1, ids.shape[0] + 1, dtype=self.table.dtype).view(-1, 1, 1)
        return self.table[ids].cumsum(0) / steps


class TokenMaxScale(nn.Module):
    """MaxScale over token ids."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 4))

    def forward(self, ids):
        h = self.table[ids]
        return h / h.abs().amax(0, keepdim=True)


class MaskedCentred(nn.Module):
    """Logits centred over the batch (rows mixed), a padding class masked to -inf."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 5)

    def forward(self, x):
        h = self.linear(x)
        return (h - h.mean(0, keepdim=True)).index_fill(-1, torch.tensor([4]), float("-inf"))


class FlipMix(nn.Module):
    """Time-major (T, N, D): each step mixed with its mirror step, a mix symmetric about the middle."""

    def __init__(self) -> None:
        super().__init__()
        self.weight, self.mirror = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4))

    def forward(self, x):
        return torch.tanh(x * self.weight + x.flip(0) * self.mirror)


class CentreFrame(nn.Module):
    """Time-major (T, N, D): each step less the centre step."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return torch.tanh((x - x[x.shape[0] // 2]) * self.weight)


def _floats(shape):
    return torch.randn(shape, dtype=torch.float64)


def _tokens(shape):
    return torch.randint(0, 10, shape)


@pytest.mark.parametrize(
    ("make", "shapes", "batch"),
    [
        (CausalMean, [(1, 2, 4), (3, 2, 4), (3, 2, 4)], _floats),
        (MaxScale, [(8, 4), (8, 4)], _floats),
        (TokenCausalMean, [(1, 3), (3, 3), (3, 3)], _tokens),
        (TokenMaxScale, [(6, 2), (6, 2)], _tokens),
        (MaskedCentred, [(6, 4), (6, 4)], _floats),
        (FlipMix, [(4, 2, 4), (4, 2, 4)], _floats),
        (FlipMix, [(1, 2, 4), (1, 2, 4)], _floats),
        (CentreFrame, [(4, 2, 4), (4, 2, 4)], _floats),
        (CentreFrame, [(5, 2, 4), (5, 2, 4)], _floats),
    ],
    ids=["running-mean-first-call-of-one-step", "batch-max", "token-ids-running-mean", "token-ids-batch-max",
         "batch-centred-with-a-masked-class", "mirror-steps", "mirror-steps-of-one-step", "centre-frame-even",
         "centre-frame-odd"],
)
def test_recompute_rule_trial_sees_mixing_a_duplicate_row_cannot_show(make, shapes, batch):
    """The row trial appended a copy of the first row: a causal mix whose first call had one
    step, or a max over the batch, came back unchanged, and joined replays were 19-35 off.
    Integer inputs got copies of their own rows as the other rows (the same blindness), and an
    output holding -inf (a masked class) made the comparison's tolerance infinite (0.79, 0.78
    and 0.13 off, relative). One row put on each side hid a mix symmetric about the middle
    (mirror steps, the centre frame: 7.0 and 13.6 off)."""
    twobp.register(make, twobp.ops.recompute_rowwise)
    patched, reference = patched_and_reference(make().double())
    queue = twobp.WeightGradQueue("concat")
    for shape in shapes:
        x = batch(shape)
        for model in (patched, reference):
            with twobp.use_queue(queue):
                out = model(x)
            (out.log_softmax(-1) if make is MaskedCentred else out).select(-1, 0).pow(2).sum().backward()
    queue.flush()
    assert_grads_match(patched, reference, torch.float64)


class ScaledPositions(nn.Module):
    """Positions scaled by the batch's longest sequence: rows mixed through an index side input."""

    def __init__(self, position: float | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4))
        self.position = nn.Parameter(torch.randn(4) if position is None else torch.full((4,), position))

    def forward(self, x, lengths):
        positions = torch.arange(x.shape[1], dtype=x.dtype)[:, None] / lengths.max()
        return torch.tanh(x * self.weight + positions * self.position)


@pytest.mark.parametrize(
    ("position", "lengths"),
    [
        (None, [[[3], [2], [4]], [[6], [5], [2]]]),
        (0.0, [[[3], [2], [4]], [[6], [5], [2]]]),
        (None, [[[3]], [[5]], [[2]], [[6]]]),
    ],
    ids=["three-rows", "closed-position-weight", "one-row"],
)
def test_recompute_rule_trial_sees_mixing_through_an_index_side_input(position, lengths):
    """Beside a float input, an index input got copies of its rows around the batch, which move
    no max: joined, the positions were scaled by all micro-batches' longest (1.64 off). Behind a
    parameter at zero the halves at the parameters' values showed nothing either (0.35 off), and a
    batch of one row has no halves: it was joined on the rows around alone (0.40 off)."""
    twobp.register(ScaledPositions, twobp.ops.recompute_rowwise)
    patched, reference = patched_and_reference(ScaledPositions(position).double())
    steps = [[(torch.randn(len(rows), 6, 4, dtype=torch.float64), torch.tensor(rows)) for rows in lengths]] * 2
    _joined_steps_match(patched, reference, steps)


def _joined_steps_match(patched: nn.Module, reference: nn.Module, steps: list[list[tuple[Tensor, ...]]]) -> None:
    """Each step's micro-batches (the calls' arguments) through both models, the patched one's
    work joined wherever the rule lets it (``concat``), flushed, compared in float64 and stepped."""
    queue = twobp.WeightGradQueue("concat")
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1) for model in (patched, reference)]
    for micro_batches in steps:
        for arguments in micro_batches:
            for model in (patched, reference):
                with twobp.use_queue(queue):
                    model(*arguments).pow(2).sum().backward()
        queue.flush()
        assert_grads_match(patched, reference, torch.float64)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()


class GatedAttention(nn.Module):
    """A residual attention behind a learned gate (ReZero: zeros; LayerScale: 1e-5), time-major as
    nn.MultiheadAttention is by default; over token ids where ``tokens``; the gate as the difference
    of two parameters alike where ``difference``."""

    def __init__(self, gate: float, tokens: bool = False, difference: bool = False) -> None:
        super().__init__()
        self.embedding = nn.Embedding(20, 8) if tokens else None
        self.attention = nn.MultiheadAttention(8, 2)
        self.gate = nn.Parameter(torch.full((8,), gate))
        self.closing = nn.Parameter(torch.full((8,), gate)) if difference else None

    def forward(self, x):
        h = x if self.embedding is None else self.embedding(x)
        gate = self.gate if self.closing is None else self.gate - self.closing
        return h + gate * self.attention(h, h, h, need_weights=False)[0]


@pytest.mark.parametrize(
    ("gate", "tokens", "difference"),
    [(0.0, False, False), (1e-5, False, False), (0.0, True, False), (0.0, False, True)],
    ids=["zero-gate", "layer-scale", "zero-gate-over-token-ids", "gate-as-a-difference"],
)
def test_recompute_rule_trial_sees_mixing_its_parameters_hide(gate, tokens, difference):
    """The row trial ran at the parameters' values: behind a closed gate the steps' mixing did not
    show, and the verdict outlived the optimizer's opening it (every attention gradient about 50%
    off at the second step). Over token ids only the halves were tried, at the parameters' values
    (0.37 off at once); two parameters alike moved alike kept a gate made of their difference
    closed (0.21 off)."""
    twobp.register(GatedAttention, twobp.ops.recompute_rowwise)
    patched, reference = patched_and_reference(GatedAttention(gate, tokens, difference).double())

    def micro_batch() -> tuple[Tensor]:
        return (torch.randint(0, 20, (5, 2)) if tokens else torch.randn(5, 2, 8, dtype=torch.float64),)

    _joined_steps_match(patched, reference, [[micro_batch(), micro_batch()] for _ in range(2)])


class _MixesInGradientOnly(nn.Module):
    """Rows mixed in the gradient alone: the forward's values are row-wise (``m - m.detach()`` is
    zero), so no trial of values can see it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.forwards = 0

    def forward(self, x):
        self.forwards += 1
        y = self.linear(x)
        mean = y.mean(0, keepdim=True)
        return y + (mean - mean.detach())


class _ShutGate(_MixesInGradientOnly):
    """A batch statistic behind a gate a very negative logit shuts (its mix 6e-6 of the output)."""

    def __init__(self) -> None:
        super().__init__()
        self.logit = nn.Parameter(torch.tensor(-12.0))

    def forward(self, x):
        self.forwards += 1
        y = self.linear(x)
        return y + torch.sigmoid(self.logit) * y.mean(0, keepdim=True)


class _RowsApart(_MixesInGradientOnly):
    def forward(self, x):
        self.forwards += 1
        return torch.tanh(self.linear(x))


@pytest.mark.parametrize(
    "make", [_MixesInGradientOnly, _ShutGate, _RowsApart], ids=["gradient-only", "shut-gate", "rows-apart"]
)
def test_recompute_rule_replays_each_call_on_its_own(make):
    """The plain rule joins nothing: a mix no trial can see (in the gradient alone, 12.9% off
    joined; behind a shut gate, 4.5% off once opened) is replayed right, and so is a module whose
    rows are apart, once per call (recompute_rowwise joins those)."""
    twobp.register(make, twobp.ops.recompute)
    patched, reference = patched_and_reference(make().double())
    queue = twobp.WeightGradQueue("concat")
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1) for model in (patched, reference)]
    for logit in (-12.0, 0.0):  # the optimizer opening the gate, as it may
        for model in (patched, reference):
            if isinstance(model, _ShutGate):
                with torch.no_grad():
                    model.logit.fill_(logit)
        for _ in range(3):
            x = torch.randn(3, 4, dtype=torch.float64)
            for model in (patched, reference):
                with twobp.use_queue(queue):
                    model(x).pow(2).sum().backward()
        forwards = patched.forwards
        queue.flush()
        assert patched.forwards - forwards == 3, "each call replayed on its own"
        assert_grads_match(patched, reference, torch.float64)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()


class _Constrained(nn.Module):
    """Row-wise, with parameters that must stay in a range: a variance under a square root, a scale
    under a log, a frozen mask of -inf entries."""

    def __init__(self) -> None:
        super().__init__()
        self.variance = nn.Parameter(torch.rand(4) + 0.5)
        self.scale = nn.Parameter(torch.rand(4) + 0.5)
        self.mask = nn.Parameter(torch.tensor([0.0, float("-inf"), 0.0, 0.0]), requires_grad=False)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if bool((self.variance <= 0).any()):
            raise ValueError("the variance must be positive")
        h = x / torch.sqrt(self.variance + 1e-5) * torch.log(self.scale + 1)
        return h.masked_fill(self.mask.isinf(), 0.0)


def test_recompute_rule_trial_at_other_values_keeps_parameters_in_range():
    """The trial at other values moved parameters by a symmetric draw: a variance went negative (a
    NaN, or the forward's own error), and such row-wise modules were replayed once per micro-batch
    instead of once joined."""
    twobp.register(_Constrained, twobp.ops.recompute_rowwise)
    patched, reference = patched_and_reference(_Constrained().double())
    queue = twobp.WeightGradQueue("concat")
    for _ in range(3):
        x = torch.randn(4, 4, dtype=torch.float64)
        for model in (patched, reference):
            with twobp.use_queue(queue):
                model(x).pow(2).sum().backward()
    calls = patched.calls
    queue.flush()
    assert_grads_match(patched, reference, torch.float64)
    assert patched.calls - calls == 1, "one joined replay"


class _FrozenFloat8Base(nn.Module):
    """A frozen float8 base weight and a trained low-rank adapter beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Parameter((torch.randn(8, 8) * 0.3).to(torch.float8_e4m3fn), requires_grad=False)
        self.down = nn.Parameter(torch.randn(2, 8) * 0.1)
        self.up = nn.Parameter(torch.randn(8, 2) * 0.1)

    def forward(self, x):
        return x @ self.base.to(x.dtype).T + (x @ self.down.T) @ self.up.T


def test_recompute_rule_trial_at_other_values_leaves_a_parameter_it_cannot_draw_for():
    """No normal draws exist for float8: every call failed drawing the base weight's other values."""
    twobp.register(_FrozenFloat8Base, twobp.ops.recompute)
    patched, reference = patched_and_reference(_FrozenFloat8Base())
    for _ in range(2):
        x = torch.randn(3, 8)
        for model in (patched, reference):
            model(x).pow(2).sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


class SparseProjection(nn.Module):
    """A fixed sparse projection held as a buffer (a graph's adjacency, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.register_buffer("projection", torch.eye(6).flip(0).to_sparse())

    def forward(self, x):
        return torch.sparse.mm(self.projection, self.linear(x).t()).t()


def test_recompute_rule_on_a_module_with_a_sparse_buffer():
    """Buffers compared by content (aten::equal, which has no sparse kernel) crashed every call."""
    twobp.register(SparseProjection, twobp.ops.recompute)
    patched, reference = patched_and_reference(SparseProjection().double())
    for _ in range(2):
        x = torch.randn(4, 6, dtype=torch.float64)
        for model in (patched, reference):
            model(x).pow(2).sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)


class Router(nn.Module):
    """A mixture-of-experts router: gate weights and the chosen experts' (integer) indices."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 8))

    def forward(self, x):
        return (x @ self.weight.t()).softmax(-1).topk(2, dim=-1)


def test_recompute_rule_on_a_module_with_an_output_without_gradient():
    """The replay's integer output has no gradient to differentiate (autograd's error at the flush)."""
    twobp.register(Router, twobp.ops.recompute)
    patched, reference = patched_and_reference(Router().double())
    for _ in range(2):
        x = torch.randn(5, 8, dtype=torch.float64)
        for model in (patched, reference):
            probs, chosen = model(x)
            (probs * chosen).sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)


def test_recompute_rule_on_an_empty_batch_gives_zeros_as_plain():
    """A module with two outputs called on a batch of 0: plain gives its parameter a zero
    gradient; the kernel read "no output reached" from the empty flags and left None."""
    twobp.register(Shaped, twobp.ops.recompute)
    patched, reference = patched_and_reference(Shaped("list"))
    x = torch.randn(0, 4, dtype=torch.float64)
    for model in (patched, reference):
        sum(out.sum() for out in model(x)).backward()
    twobp.flush_weight_grads()
    assert patched.weight.grad is not None
    assert_grads_match(patched, reference, torch.float64)


class Shaped(nn.Module):
    """Returns its product in a container of the kind asked for, with what else is asked for."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, dtype=torch.float64))
        self.register_buffer("mask", torch.ones(4, dtype=torch.float64))
        self.kind = kind

    def forward(self, x):
        y = x * self.weight
        return {
            "1-tuple": lambda: (y,),
            "list": lambda: [y, y * 2],
            "dict": lambda: {"y": y},
            "with-none": lambda: (y, None),
            "with-int": lambda: (y, 3),
            "with-its-input": lambda: (y, x),
            "with-a-view-of-its-input": lambda: (y, x.t()),
            "with-its-buffer": lambda: (y, self.mask),
            "with-its-parameter": lambda: (y, self.weight),
            "two-views-of-one": lambda: (y, y.view(-1)),
            "with-a-view-of-a-fresh-tensor": lambda: ((x * self.weight).t(), y),  # an output.view(B, T, C)
        }[self.kind]()


RETURNED_AS_THEY_ARE = ["1-tuple", "list"]
PLAIN_AUTOGRAD = ["dict", "with-none", "with-int", "with-its-input", "with-a-view-of-its-input", "with-its-buffer",
                  "with-its-parameter", "two-views-of-one", "with-a-view-of-a-fresh-tensor"]  # fmt: skip


@pytest.mark.parametrize("kind", RETURNED_AS_THEY_ARE + PLAIN_AUTOGRAD)
def test_recompute_rule_returns_outputs_as_the_forward_does_and_leaves_its_inputs_and_buffers_alone(kind, monkeypatch):
    """A 1-tuple came back as a bare tensor (indexing it then took a row, silently) and a list
    as a tuple; outputs the tap cannot re-parent in place (the module's own input or buffer, a
    view of one, two views of one tensor, a view among several outputs) made the caller's input or the module's buffer a
    non-leaf with a history, or failed; non-tensor outputs failed. Such calls keep plain autograd."""
    monkeypatch.setattr(warn_once, "given", set())  # each reason warns once per process
    twobp.register(Shaped, twobp.ops.recompute)
    patched, reference = patched_and_reference(Shaped(kind))
    with contextlib.ExitStack() as stack:
        if kind in PLAIN_AUTOGRAD:
            stack.enter_context(pytest.warns(UserWarning, match="is not deferred; such calls keep plain autograd"))
        for _ in range(2):
            x = torch.randn(3, 4, dtype=torch.float64)
            outputs = [model(x) for model in (patched, reference)]
            assert type(outputs[0]) is type(outputs[1])
            assert x.is_leaf and not x.requires_grad and patched.mask.is_leaf and not patched.mask.requires_grad
            for output in outputs:
                first = output["y"] if isinstance(output, dict) else output[0]
                first.pow(3).sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)
    copy.deepcopy(patched)  # a buffer given a history would refuse


class TwoOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4))
        self.shift = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return x * self.weight, x + self.shift


@pytest.mark.parametrize("strategy", ["concat", "loop"])
@pytest.mark.parametrize("reached", ["first-only", "first-only-then-both"])
def test_a_parameter_no_backward_reaches_stays_none_under_the_recompute_rule(strategy, reached):
    """A loss on the first output only: plain never reaches ``shift`` and leaves its .grad None.
    The tap used to hand the kernel zeros for the second output, which gave ``shift`` a zero
    .grad (AdamW's weight decay then moved it). The kernel now leaves out the outputs no
    backward reached; a micro-batch that did reach it still counts."""
    twobp.register(TwoOutputs, twobp.ops.recompute)
    patched, reference = patched_and_reference(TwoOutputs())
    queue = twobp.WeightGradQueue(strategy)
    for step in range(2):
        x = torch.randn(3, 4)
        both = reached == "first-only-then-both" and step == 1
        for model in (patched, reference):
            with twobp.use_queue(queue):
                first, second = model(x)
            (first.sum() + (second.pow(2).sum() if both else 0)).backward()
    queue.flush()
    assert_grads_match(patched, reference)
    assert (patched.shift.grad is None) == (reached == "first-only")


class ScaledByATemperature(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2))

    def forward(self, x, temperature):
        return x * self.weight / temperature


@pytest.mark.parametrize(
    "inputs",
    [
        lambda: (torch.randn(3, 2), torch.rand(1) + 0.5),  # a side input without a batch dim
        lambda: (torch.randn(2), torch.rand(2) + 0.5),  # an unbatched call
        lambda: (torch.randn(1, 2), torch.rand(1) + 0.5),  # a batch of one beside a 1-D side input
    ],
    ids=["side-input", "unbatched", "batch-of-one"],
)
def test_the_recompute_rule_joins_only_calls_whose_inputs_hold_a_batch_on_dim_0(inputs):
    """Joined on dim 0, a (1,) temperature broadcast over the features instead of the rows (9.4
    off with two features) or the flush failed with PyTorch's shape error. Such calls replay one
    micro-batch at a time."""
    twobp.register(ScaledByATemperature, twobp.ops.recompute_rowwise)
    patched, reference = patched_and_reference(ScaledByATemperature())
    queue = twobp.WeightGradQueue("concat")
    for _ in range(3):
        args = inputs()
        with twobp.use_queue(queue):
            patched(*args).pow(3).sum().backward()
        reference(*args).pow(3).sum().backward()
    queue.flush()
    assert_grads_match(patched, reference)


def test_a_rule_of_ones_own_with_an_unreached_output_warns(monkeypatch):
    """A rule of one's own whose kernel is not told which outputs were reached takes zeros for
    the others: a parameter only they reach gets zeros where plain leaves None. Said, not silent."""
    monkeypatch.setattr(warn_once, "given", set())

    def both_parts(saved, grad_outputs, needs):
        (x,) = saved
        return [(grad_outputs[0] * x).sum(0) if needs[0] else None, grad_outputs[1].sum(0) if needs[1] else None]

    @twobp.register(TwoOutputs)
    def deferred(module, x):
        outputs = (x * twobp.deferral.detached(module.weight), x + twobp.deferral.detached(module.shift))
        params = (module.weight, module.shift)
        return twobp.deferral.defer_weight_grads(outputs, params, (x.detach(),), both_parts)

    patched, reference = patched_and_reference(TwoOutputs())
    x = torch.randn(3, 4)
    with pytest.warns(UserWarning, match="twobp: a backward reached only some outputs"):
        patched(x)[0].sum().backward()
    reference(x)[0].sum().backward()
    twobp.flush_weight_grads()
    torch.testing.assert_close(patched.weight.grad, reference.weight.grad)
    assert reference.shift.grad is None and torch.count_nonzero(patched.shift.grad) == 0


def test_gradient_edges_as_inputs():
    """autograd.grad / backward(inputs=...) given GradientEdges (as torch.distributed.pipelining
    passes them) scope the work like the tensors themselves."""
    from torch.autograd.graph import get_gradient_edge

    patched, reference = patched_and_reference(mlp())
    x = torch.randn(4, 6)
    returned = []
    for model in (patched, reference):
        hidden = model[0](x)
        loss = model[1:](hidden).pow(2).sum()
        returned.append(torch.autograd.grad(loss, [get_gradient_edge(hidden), get_gradient_edge(model[4].weight)]))
    for got, want in zip(*returned, strict=True):
        torch.testing.assert_close(got, want)
    assert twobp.pending().jobs == 0
    for model in (patched, reference):
        loss_of(model, x).backward(inputs=[get_gradient_edge(model[2].weight)])
    finish_and_compare(patched, reference, jobs=1)


def _attention(module, x):
    return module(x, x, x, need_weights=False)[0]


LAYERS_FROZEN_AFTER_FORWARD = {
    "linear": (lambda: nn.Linear(4, 3), lambda: torch.randn(5, 4), None),
    "conv2d": (lambda: nn.Conv2d(4, 3, 3), lambda: torch.randn(2, 4, 5, 5), None),
    "layer-norm": (lambda: nn.LayerNorm(4), lambda: torch.randn(5, 4), None),
    "batch-norm": (lambda: nn.BatchNorm1d(4), lambda: torch.randn(5, 4), None),
    "group-norm": (lambda: nn.GroupNorm(2, 4), lambda: torch.randn(5, 4, 3), None),
    "instance-norm": (lambda: nn.InstanceNorm1d(4, affine=True), lambda: torch.randn(5, 4, 3), None),
    "rms-norm": (lambda: nn.RMSNorm(4), lambda: torch.randn(5, 4), None),
    "embedding": (lambda: nn.Embedding(7, 4), lambda: torch.randint(0, 7, (5,)), None),
    "attention": (lambda: nn.MultiheadAttention(4, 2, batch_first=True), lambda: torch.randn(2, 3, 4), _attention),
}


@pytest.mark.parametrize("unfrozen_before_backward", [False, True], ids=["frozen-at-backward", "unfrozen-again"])
@pytest.mark.parametrize("frozen", ["all", "weight-only"])
@pytest.mark.parametrize("layer", LAYERS_FROZEN_AFTER_FORWARD.values(), ids=LAYERS_FROZEN_AFTER_FORWARD.keys())
def test_parameters_frozen_between_forward_and_backward(layer, frozen, unfrozen_before_backward):
    """As autograd's accumulator decides when backward reaches it: a parameter that no longer
    requires grad then gets nothing (a GAN's discriminator frozen for the generator's loss
    after a shared forward), one unfrozen again before backward gets its gradient."""
    make, make_input, call = layer
    patched, reference = patched_and_reference(make())
    x = make_input()
    for net in (patched, reference):
        out = call(net, x) if call is not None else net(x)
        weight = net.in_proj_weight if isinstance(net, nn.MultiheadAttention) else net.weight
        params = list(net.parameters()) if frozen == "all" else [weight]
        for p in params:
            p.requires_grad_(False)
        if unfrozen_before_backward:
            for p in params:
                p.requires_grad_(True)
        out.pow(2).sum().backward()
        for p in params:
            p.requires_grad_(True)
    assert all((p.grad is None) != unfrozen_before_backward for p in params)  # plain's verdict (reference ran last)
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


def test_a_rule_of_ones_own_that_misuses_the_tap_is_told_so():
    """A user rule (README, How to add an op) whose kernel returns a gradient too few, or that
    hands the tap a non-tensor to save, got Python's zip or attribute error from inside."""

    def too_few(saved, grad_outputs, needs):
        return []

    @twobp.register(Scale)
    def deferred(module, x):
        output = x * twobp.deferral.detached(module.weight)
        return twobp.deferral.defer_weight_grads(output, (module.weight,), (x.detach(),), too_few)

    model = twobp.patch(Scale())
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="twobp: the weight-gradient kernel .*too_few' returned 0 gradients"):
        twobp.flush_weight_grads()
    twobp.discard_weight_grads()

    @twobp.register(Scale)
    def saves_a_float(module, x):
        output = x * twobp.deferral.detached(module.weight)
        return twobp.deferral.defer_weight_grads(output, (module.weight,), (x.detach(), 0.5), too_few)

    with pytest.raises(TypeError, match=r"twobp: defer_weight_grads takes .* saved \['Tensor', 'float'\]"):
        twobp.patch(Scale())(torch.randn(3, 4))


def _scale_grad(saved, grad_outputs, needs):
    return [(grad_outputs[0] * saved[0]).sum(0)]


@pytest.mark.parametrize("tied_upstream", [False, True], ids=["alone", "weight-also-used-upstream"])
def test_a_rule_of_ones_own_computing_with_a_deferred_parameter_itself_is_refused(tied_upstream):
    """A rule that forgot ``detached`` on a parameter it defers: autograd gave that gradient in
    backward and the kernel again at the flush, twice plain's, silently. Refused on the module's
    first call; a use of the same parameter upstream, on plain autograd, is not the rule's."""

    @twobp.register(Scale)
    def forgot_detached(module, x):
        return twobp.deferral.defer_weight_grads(x * module.weight, (module.weight,), (x.detach(),), _scale_grad)

    def detaches(module, x):
        output = x * twobp.deferral.detached(module.weight)
        return twobp.deferral.defer_weight_grads(output, (module.weight,), (x.detach(),), _scale_grad)

    model = twobp.patch(Scale().double())
    x = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="twobp: a deferred op computed its output with a parameter of shape"):
        model(x * model.weight if tied_upstream else x)
    twobp.register(Scale, detaches)
    patched, reference = patched_and_reference(Scale().double())
    for net in (patched, reference):
        (net(x * net.weight) if tied_upstream else net(x)).pow(2).sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)


class _Projection(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(5, 6))

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight)


def test_a_rule_that_forgot_detached_is_refused_where_autocast_cast_its_weight_upstream():
    """Autocast caches the cast of a parameter: the rule got the copy made by a use upstream
    (an older node, where the walk stops), and its doubled gradient went through."""

    def kernel(saved, grad_outputs, needs):
        return [grad_outputs[0].t().float() @ saved[0].float()]

    @twobp.register(_Projection)
    def forgot_detached(module, x):
        output = torch.nn.functional.linear(x, module.weight)
        return twobp.deferral.defer_weight_grads(output, (module.weight,), (x.detach().to(output.dtype),), kernel)

    model = twobp.patch(_Projection())
    x = torch.randn(4, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = x + torch.nn.functional.linear(x, model.weight).sum()  # the weight cast upstream (a tied use)
        with pytest.raises(RuntimeError, match="twobp: a deferred op computed its output with a parameter"):
            model(h)


class _TiedAutoencoder(nn.Module):
    """The decoder's weight is the encoder's: one parameter under two names."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Parameter(torch.randn(3, 5, dtype=torch.float64))
        self.decoder = self.encoder

    def forward(self, x):
        return torch.nn.functional.linear(torch.tanh(torch.nn.functional.linear(x, self.encoder)), self.decoder.t())


def test_recompute_rule_substitutes_a_parameter_under_each_of_its_names():
    """Its second name read the parameter itself (correct, half in backward, half deferred), which
    the first-call check took for a rule that forgot ``detached``: the step was refused."""
    twobp.register(_TiedAutoencoder, twobp.ops.recompute)
    patched, reference = patched_and_reference(_TiedAutoencoder())
    for _ in range(2):
        x = torch.randn(4, 5, dtype=torch.float64)
        for net in (patched, reference):
            net(x).pow(2).sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)


def test_a_first_call_on_another_thread_than_its_inputs_upstream_is_not_refused():
    """Autograd numbers its nodes per thread: a tied weight used upstream on the main thread has
    higher numbers than a worker thread's first call, whose check took that use for its own."""
    head = nn.Linear(8, 11, bias=False)
    patched, reference = patched_and_reference(head)
    ids = torch.randint(0, 11, (4, 6))
    for _ in range(50):  # the main thread's numbers run ahead
        torch.randn(2, requires_grad=True).exp()
    for net in (patched, reference):
        hidden = torch.nn.functional.embedding(ids, net.weight)  # tied, on plain autograd
        outputs: list[Tensor] = []

        def first_call(net: nn.Module = net, hidden: Tensor = hidden, outputs: list[Tensor] = outputs) -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16):  # Linear's tap path: the check runs
                outputs.append(net(hidden))

        worker = threading.Thread(target=first_call)
        worker.start()
        worker.join()
        outputs[0].float().pow(2).sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.bfloat16)


class _SharedConvBlock(nn.Module):
    """Uses a shared conv's weight itself (a tied transposed conv, plain autograd), then the conv."""

    def __init__(self, conv: nn.Conv1d) -> None:
        super().__init__()
        self.conv, self.gamma = conv, nn.Parameter(torch.ones(8, 1))

    def forward(self, x, *, scale=1.0):  # a keyword argument: the recompute rule keeps plain autograd
        tied = torch.nn.functional.conv1d(x, self.conv.weight.transpose(0, 1), padding="same")
        return self.conv(torch.tanh(tied * scale)) * self.gamma


def test_the_first_call_check_of_one_module_is_not_applied_to_anothers_later_call_inside_it():
    """A conv shared by two blocks, its first call made in the first block: inside the second
    block's first call, its later call was checked against the block's start, where the block's
    own tied use of the conv's weight looked like the conv's rule not detaching it: refused."""
    twobp.register(_SharedConvBlock, twobp.ops.recompute)
    conv = nn.Conv1d(8, 8, 3, padding="same")
    patched, reference = patched_and_reference(nn.Sequential(_SharedConvBlock(conv), _SharedConvBlock(conv)))
    x = torch.randn(4, 8, 5)
    for net in (patched, reference):
        net[1](net[0](x, scale=0.5), scale=0.5).pow(2).sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


def test_a_module_given_its_own_parameter_as_input_is_not_refused():
    """``lin(lin.weight)`` (a Gram term): the input's edge reaches the weight's accumulator, as
    in plain autograd, which the first-call check took for a rule that forgot ``detached``."""
    patched, reference = patched_and_reference(nn.Linear(4, 4))
    for net in (patched, reference):
        with torch.autocast("cpu", dtype=torch.bfloat16):  # Linear's tap path: the check runs
            output = net(net.weight)
        output.float().pow(2).sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.bfloat16)


class ScaleShift(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4))
        self.bias = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return x * self.weight + self.bias


def _scale_shift_grads(saved, grad_outputs, needs):
    x, grad = saved[0], grad_outputs[0]
    return [(grad * x).sum(0), grad.sum(0)]


BAD_KERNELS = {
    "one-too-few": lambda saved, grad_outputs, needs: _scale_shift_grads(saved, grad_outputs, needs)[:1],
    "one-too-many": lambda saved, grad_outputs, needs: [*_scale_shift_grads(saved, grad_outputs, needs), None],
    "wrong-shape": lambda saved, grad_outputs, needs: [g[None] for g in _scale_shift_grads(saved, grad_outputs, needs)],
    "a-float": lambda saved, grad_outputs, needs: [1.0, None],
    "a-generator": lambda saved, grad_outputs, needs: (g for g in _scale_shift_grads(saved, grad_outputs, needs)),
    "another-device": lambda saved, grad_outputs, needs: [
        g.to("meta") for g in _scale_shift_grads(saved, grad_outputs, needs)
    ],
}


@pytest.mark.parametrize("strategy", ["auto", "concat", "loop"])
@pytest.mark.parametrize("micro_batches", [1, 3])
@pytest.mark.parametrize("kernel", BAD_KERNELS.values(), ids=BAD_KERNELS.keys())
def test_a_kernel_returning_other_than_one_gradient_per_parameter_is_refused_with_the_work_kept(
    kernel, micro_batches, strategy
):
    """With several micro-batches one kernel call each, a gradient too few left the bias None
    (silently); a gradient of the wrong shape or on another device failed in the hand-over,
    reported as partly delivered, and dropped the work. Each is now refused before anything
    reaches .grad."""

    @twobp.register(ScaleShift)
    def deferred(module, x):
        output = x * twobp.deferral.detached(module.weight) + twobp.deferral.detached(module.bias)
        return twobp.deferral.defer_weight_grads(
            output, (module.weight, module.bias), (x.detach(),), kernel, concatenate=True
        )

    model = twobp.patch(ScaleShift())
    queue = twobp.WeightGradQueue(strategy)
    with twobp.use_queue(queue):
        for _ in range(micro_batches):
            model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="twobp: the weight-gradient kernel .* for 2 parameters of shapes"):
        queue.flush()
    assert queue.pending().jobs == micro_batches and model.weight.grad is None and model.bias.grad is None
    queue.clear()


def test_saved_tensors_that_cannot_be_joined_are_told_to_run_apart():
    """A tensor saved without a batch dimension (a 0-d one here) failed to join under concat with
    torch's own error; the message says to pass concatenate=False."""

    @twobp.register(ScaleShift)
    def deferred(module, x):
        output = x * twobp.deferral.detached(module.weight) + twobp.deferral.detached(module.bias)
        return twobp.deferral.defer_weight_grads(
            output, (module.weight, module.bias), (x.detach(), module.weight.detach().sum()), _scale_shift_grads
        )

    model = twobp.patch(ScaleShift())
    queue = twobp.WeightGradQueue("concat")
    with twobp.use_queue(queue):
        model(torch.randn(3, 4)).sum().backward()
        model(torch.randn(5, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="twobp: .* could not be joined on dim 0.*concatenate=False"):
        queue.flush()
    assert queue.pending().jobs == 2
    queue.clear()


def test_running_out_of_memory_while_joining_is_raised_as_it_is(monkeypatch):
    """Only a join failure is told to pass concatenate=False; an out-of-memory error stays one."""
    from twobp_autograd import flush as flush_module

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("out of memory (simulated)")

    model = twobp.patch(nn.Linear(4, 4))
    queue = twobp.WeightGradQueue("concat")
    with twobp.use_queue(queue):
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
    monkeypatch.setattr(flush_module.torch, "cat", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError, match="simulated"):
        queue.flush()
    monkeypatch.undo()
    assert queue.pending().jobs == 2
    queue.clear()


def test_params_or_saved_given_as_a_tensor_alone_are_refused():
    """Iterated, a tensor is its rows: params=module.weight deferred nothing (None where plain
    has a gradient), saved=x handed the kernel the first row only."""
    model = ScaleShift()
    x = torch.randn(3, 4, requires_grad=True)
    output = x * model.weight.detach()
    with pytest.raises(TypeError, match="twobp: defer_weight_grads takes params and saved as sequences"):
        twobp.deferral.defer_weight_grads(output, model.weight, (x.detach(),), _scale_shift_grads)
    with pytest.raises(TypeError, match="twobp: defer_weight_grads takes params and saved as sequences"):
        twobp.deferral.defer_weight_grads(output, (model.weight,), x.detach(), _scale_shift_grads)


def test_a_partial_kernel_with_an_unhashable_argument_is_refused_at_the_forward():
    """A kernel configured with a list (a module attribute) went through backward and then
    failed at the flush with a bare "unhashable type: 'list'"."""
    model = ScaleShift()
    x = torch.randn(3, 4, requires_grad=True)
    kernel = functools.partial(_scale_shift_grads, channels=[0, 1])
    with pytest.raises(TypeError, match=r"twobp: defer_weight_grads needs a hashable group.*a tuple, not a list"):
        twobp.deferral.defer_weight_grads(x * model.weight.detach(), (model.weight,), (x.detach(),), kernel)


class TwoShifts(nn.Module):
    """Two outputs, each with a parameter of its own that needs only the output's gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4))

    def forward(self, x):
        return x + self.first, x - self.second


def _two_shifts_grads(saved, grad_outputs, needs):
    (reached,) = saved  # only the mask saves_reached appends
    first, second = grad_outputs
    return [
        first.sum(0) if needs[0] and reached[:, 0].any() else None,
        -second.sum(0) if needs[1] and reached[:, 1].any() else None,
    ]


def test_several_outputs_reached_apart_with_nothing_saved():
    """saves_reached took the rows of its mask from saved[0]: a kernel that saves nothing (it
    needs only the output gradients) crashed every backward with an IndexError."""

    @twobp.register(TwoShifts)
    def two_shifts(module, x):
        outputs = (x + module.first.detach(), x - module.second.detach())
        params = (module.first, module.second)
        return twobp.deferral.defer_weight_grads(outputs, params, (), _two_shifts_grads, saves_reached=True)

    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(4, 4), TwoShifts()).double())
    for _ in range(2):
        x = torch.randn(3, 4, dtype=torch.float64)
        for model in (patched, reference):
            model(x)[0].pow(2).sum().backward()  # the second output's parameter stays None
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)


class ExpScale(nn.Module):
    """``exp(x * weight)``: its weight's gradient reads the result, which exp saves too."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4) * 0.1)

    def forward(self, x):
        return torch.exp(x * self.weight)


def _exp_scale_grads(saved, grad_outputs, needs):
    x, result = saved
    return [(grad_outputs[0] * result * x).sum(0)]


def test_a_rule_saving_its_own_output_for_the_kernel():
    """The tap's re-parenting bumps the output's version counter, which a saved alias (the result
    itself, detached) shares: every backward failed with "modified by an inplace operation"."""

    @twobp.register(ExpScale)
    def exp_scale(module, x):
        result = torch.exp(x * module.weight.detach())
        saved = (x.detach(), result.detach())
        return twobp.deferral.defer_weight_grads(result, (module.weight,), saved, _exp_scale_grads)

    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(4, 4), ExpScale()).double())
    for _ in range(2):
        x = torch.randn(3, 4, dtype=torch.float64)
        for model in (patched, reference):
            model(x).pow(2).sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)


def test_several_outputs_that_are_views_of_one_tensor_are_told_what_to_pass():
    model = ScaleShift()
    x = torch.randn(3, 4, requires_grad=True)
    both = torch.cat([x, x], 1) * 2
    with pytest.raises(RuntimeError, match="twobp: defer_weight_grads cannot take several outputs that are views"):
        twobp.deferral.defer_weight_grads(both.chunk(2, 1), (model.weight,), (x.detach(),), _scale_shift_grads)


class ChangesItsInput(nn.Module):
    """``x.mul_(2)`` (or an in-place ReLU, ``inplace_relu``) on its input; from call ``from_call`` on."""

    def __init__(self, inplace_relu: bool = False, from_call: int = 0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4))
        self.inplace_relu, self.from_call, self.calls = inplace_relu, from_call, 0

    def forward(self, x):
        if self.calls >= self.from_call:
            x.relu_() if self.inplace_relu else x.mul_(2)
        self.calls += 1
        return x * self.weight


@pytest.mark.parametrize("inplace_relu", [False, True], ids=["mul_", "relu_"])
def test_the_recompute_rule_keeps_a_forward_that_changes_its_input_in_place_on_plain_autograd(inplace_relu):
    """The flush replayed the forward on the saved input, which held the changed values (x.mul_(2):
    twice plain's weight gradient, silently, and the input doubled again). The first call runs on
    copies of the inputs: such a forward goes to plain autograd (one warning), the caller's input
    changed once, as plain changes it; an in-place ReLU (which the replay happened to survive)
    too, no longer refused."""
    twobp.register(ChangesItsInput, twobp.ops.recompute)
    model = twobp.patch(ChangesItsInput(inplace_relu))
    reference = twobp.unpatch(copy.deepcopy(model))
    for _ in range(2):
        x = torch.randn(3, 4)
        ours, theirs = x.clone(), x.clone()
        model(ours).sum().backward()
        assert twobp.pending().jobs == 0, "deferred: the flush would replay on the changed input"
        reference(theirs).sum().backward()
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert_grads_match(model, reference)


def test_the_recompute_rule_refuses_a_forward_that_starts_changing_its_input_in_place():
    """A module whose first calls left their inputs alone runs later calls on the inputs
    themselves: one that changes them then cannot be undone, and is refused."""
    twobp.register(ChangesItsInput, twobp.ops.recompute)
    model = twobp.patch(ChangesItsInput(from_call=sys.maxsize))
    model(torch.randn(3, 4)).sum().backward()  # runs its forward more than once: the trials
    twobp.flush_weight_grads()
    model.from_call = model.calls
    with pytest.raises(RuntimeError, match="twobp: ChangesItsInput's forward changed its input in place"):
        model(torch.randn(3, 4))
    model(torch.randn(3, 4)).sum().backward()
    assert twobp.pending().jobs == 0, "plain autograd from then on"
    assert model.weight.grad is not None


def test_the_recompute_rule_keeps_inputs_made_under_inference_mode_on_plain_autograd():
    """A frozen encoder's features made under inference_mode: plain trains the module's own
    parameters on them; the rule failed reading their version counter (it has none)."""
    class AddsBias(nn.Module):  # saves nothing of its input, so plain accepts an inference tensor
        def __init__(self) -> None:
            super().__init__()
            self.bias = nn.Parameter(torch.randn(4))

        def forward(self, x):
            return x + self.bias

    twobp.register(AddsBias, twobp.ops.recompute)
    model = twobp.patch(AddsBias())
    reference = twobp.unpatch(copy.deepcopy(model))
    with torch.inference_mode():
        features = torch.randn(3, 4)
    model(features).sum().backward()
    reference(features).sum().backward()
    assert twobp.pending().jobs == 0
    assert_grads_match(model, reference)


def test_an_input_changing_recompute_module_inside_a_non_reentrant_checkpoint_trains_as_plain():
    """Its first call ran the forward on recorded copies and then on plain autograd, so the
    checkpoint counted more saved tensors in the forward than in its recomputation
    (CheckpointError). The trial now records nothing."""
    twobp.register(ChangesItsInput, twobp.ops.recompute)
    model = twobp.patch(nn.Sequential(nn.Linear(4, 4), ChangesItsInput()))
    reference = twobp.unpatch(copy.deepcopy(model))
    for _ in range(2):
        x = torch.randn(3, 4)
        for net in (model, reference):
            torch.utils.checkpoint.checkpoint(net, x, use_reentrant=False).pow(2).sum().backward()
        twobp.flush_weight_grads()
    assert_grads_match(model, reference)


class _Gate(nn.Module):
    """tanh(x W^T + b), with an activation child: a user's module under the recompute rule."""

    def __init__(self, n: int = 6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, n))
        self.bias = nn.Parameter(torch.randn(n))
        self.act = nn.Tanh()

    def forward(self, x):
        return self.act(x @ self.weight.t() + self.bias)


def _gate_net() -> nn.Module:
    twobp.register(_Gate, twobp.ops.recompute)
    return nn.Sequential(nn.Linear(4, 6), _Gate(), nn.Linear(6, 2)).double()


@pytest.mark.parametrize("when", ["between-micro-batches", "before-flush"])
def test_recompute_rule_replays_the_weight_a_forward_pre_hook_set_for_that_call(when):
    """Pruning's forward pre-hook sets the masked weight as a plain attribute at each call; a
    pruning round between backward and flush (or between micro-batches) made the replay read the
    newest one: the bias gradient 0.48-0.55 off, silently."""
    model = _gate_net()
    reference = copy.deepcopy(model)
    for net in (model, reference):
        torch.nn.utils.prune.l1_unstructured(net[1], "weight", 0.3)
    twobp.patch(model)
    for micro_batch in range(2):
        x = torch.randn(5, 4, dtype=torch.float64)
        for net in (model, reference):
            net(x).square().sum().backward()
            if when == "between-micro-batches" and micro_batch == 0 or when == "before-flush" and micro_batch == 1:
                torch.nn.utils.prune.l1_unstructured(net[1], "weight", 0.3)
    twobp.flush_weight_grads()
    assert_grads_match(model, reference, torch.float64)


@pytest.mark.parametrize("change", ["child-swapped", "parametrization-removed"])
def test_recompute_rule_refuses_a_flush_after_the_module_changed_structure(change):
    """A child swapped between backward and flush was replayed in place of the forward's (0.41
    off, silently); a parametrization removed made the flush fail inside PyTorch
    (AttributeError). Both are refused, the work kept, as for a parameter changed in place."""
    model = twobp.patch(_gate_net())
    if change == "parametrization-removed":  # registered after patch: the class is the rule's
        torch.nn.utils.parametrize.register_parametrization(model[1], "weight", nn.Tanh())
    model(torch.randn(5, 4, dtype=torch.float64)).square().sum().backward()
    if change == "child-swapped":
        model[1].act = nn.Sigmoid()
    else:
        torch.nn.utils.parametrize.remove_parametrizations(model[1], "weight", leave_parametrized=False)
    with pytest.raises(RuntimeError, match="twobp: .*no longer where they were"):
        twobp.flush_weight_grads()
    assert twobp.pending().jobs > 0
    twobp.discard_weight_grads()


class _Rotary(nn.Module):
    """A rotary cache kept in plain attributes, grown when a longer sequence comes."""

    def __init__(self) -> None:
        super().__init__()
        self.max_len, self.cos, self.sin = 0, None, None

    def forward(self, x):
        steps = x.shape[1]
        if steps > self.max_len:
            angles = torch.arange(steps, dtype=x.dtype)[:, None] * torch.arange(1, 3, dtype=x.dtype)
            self.cos, self.sin, self.max_len = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2), steps
        x1, x2 = x.chunk(2, -1)
        return x * self.cos[:steps] + torch.cat([-x2, x1], -1) * self.sin[:steps]


class _RotaryAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.rotary = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4), _Rotary()

    def forward(self, x):
        q, k = self.rotary(self.q(x)), self.rotary(self.k(x))
        return torch.softmax(q @ k.transpose(1, 2), -1) @ self.v(x)


class _RunningScale(nn.Module):
    """Divides by a running mean of |x| kept in a plain attribute (not a buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4))
        self.running = torch.ones(4, dtype=torch.float64)

    def forward(self, x):
        with torch.no_grad():
            self.running.mul_(0.5).add_(0.5 * x.abs().mean(0))
        return x * self.weight / self.running


class _ObservedScale(nn.Module):
    """A running max kept in a plain attribute, sized in place on the first call (as observers do)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4))
        self.seen_max = torch.empty(0, dtype=torch.float64)

    def forward(self, x):
        with torch.no_grad():
            largest = x.abs().amax(0)
            if self.seen_max.numel() == 0:
                self.seen_max.resize_(largest.shape).copy_(largest)
            else:
                torch.maximum(self.seen_max, largest, out=self.seen_max)
        return x * self.weight


class _SparseAdjacency(nn.Module):
    """A graph convolution whose adjacency is a sparse plain attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))
        self.adjacency = torch.eye(4, dtype=torch.float64).flip(0).to_sparse()

    def forward(self, x):
        return torch.sparse.mm(self.adjacency, (x @ self.weight).t()).t()


@pytest.mark.parametrize(
    ("make", "shapes"),
    [
        (_RotaryAttention, [(3, 5, 4), (2, 8, 4), (2, 5, 4)]),
        (_RunningScale, [(3, 4), (2, 4), (4, 4)]),
        (_SparseAdjacency, [(3, 4), (2, 4)]),
        (_ObservedScale, [(3, 4), (2, 4)]),
    ],
    ids=[
        "cache-grown-by-the-forward", "statistic-updated-in-place-by-the-forward", "sparse-attribute",
        "attribute-resized-in-place-by-the-forward",
    ],
)
def test_recompute_rule_with_tensors_kept_as_plain_attributes(make, shapes):
    """A cache the forward grows was replayed with the one the forward found (a size error at the
    flush); a statistic updated in place was neither rewound after the first call's trials nor seen
    as state (outputs 0.1-0.24 off, gradients up to 5.8); a sparse attribute crashed every call; an
    attribute resized in place crashed the rewind."""
    twobp.register(make, twobp.ops.recompute)
    model = nn.Sequential(nn.Linear(4, 4), make()).double()
    patched, reference = patched_and_reference(model)
    for shape in shapes:
        x = torch.randn(shape, dtype=torch.float64)
        for net in (patched, reference):
            net(x).pow(2).sum().backward()
        torch.testing.assert_close(patched(x).detach(), reference(x).detach(), rtol=1e-10, atol=1e-12)
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)


class _HooksItsChildOnce(nn.Module):
    """Registers a forward hook on its child on its first call, guarded by a flag attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.child = nn.Linear(4, 4).double()
        self.scale = nn.Parameter(torch.randn(4, dtype=torch.float64))
        self.hooked = False

    def forward(self, x):
        if not self.hooked:
            self.child.register_forward_hook(lambda module, args, output: output * 2)
            self.hooked = True
        return self.child(x) * self.scale


class _BuildsItsHeadsOnce(nn.Module):
    """Builds its heads on its first call (sized by the input), guarded by a flag attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(4, dtype=torch.float64))
        self.heads = nn.ModuleList()
        self.built = False

    def forward(self, x):
        if not self.built:
            torch.manual_seed(7)  # the same heads for the patched module and its plain copy
            self.heads.extend(nn.Linear(x.shape[-1], 4).double() for _ in range(2))
            self.built = True
        return sum(head(x) for head in self.heads) * self.scale


@pytest.mark.parametrize("make", [_HooksItsChildOnce, _BuildsItsHeadsOnce], ids=["hook", "submodules"])
def test_recompute_rule_rewinds_what_a_guarded_first_forward_adds_with_its_flag(make):
    """A first forward's trials run it three times: what it adds under a flag attribute must be
    added once (a rewind of the flag alone, tried and reverted, left three hooks or six heads
    where plain has one or two, outputs and gradients off by 6-280, silently)."""
    twobp.register(make, twobp.ops.recompute)
    patched, reference = patched_and_reference(make())
    for _ in range(2):
        x = torch.randn(5, 4, dtype=torch.float64)
        outputs = [net(x) for net in (patched, reference)]
        torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-12, atol=1e-12)
        for output in outputs:
            output.pow(2).sum().backward()
        twobp.flush_weight_grads()
        assert_grads_match(patched, reference, torch.float64)


class _CountsLargeInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, dtype=torch.float64))
        self.seen = torch.zeros((), dtype=torch.float64)

    def forward(self, x):
        if x.abs().max() > 10:
            with torch.no_grad():
                self.seen.add_(1)
        return x * self.weight + self.seen


def test_recompute_rule_refuses_a_later_call_that_changes_an_attribute_in_place():
    """Attributes are copied only on a module's first calls: a later call that changes one in
    place was run again on plain autograd, the change applied twice (outputs 1.0 off). Refused,
    as a later call that changes its input is; plain autograd from then on."""
    twobp.register(_CountsLargeInputs, twobp.ops.recompute)
    model = twobp.patch(_CountsLargeInputs())
    model(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
    twobp.flush_weight_grads()
    with pytest.raises(RuntimeError, match="twobp: _CountsLargeInputs's forward changed a tensor kept as a plain"):
        model(torch.full((3, 4), 20.0, dtype=torch.float64))
    assert model.seen.item() == 1
    model(torch.full((3, 4), 20.0, dtype=torch.float64)).sum().backward()
    assert model.seen.item() == 2 and twobp.pending().jobs == 0


def test_recompute_rule_refuses_a_flush_after_a_tensor_attribute_changed_in_place():
    """A temperature kept in a plain attribute, annealed in place after each micro-batch: the
    replay read the new one (1.51 off, silently). Refused, as for a buffer."""

    class Tempered(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, dtype=torch.float64))
            self.temperature = torch.ones((), dtype=torch.float64)

        def forward(self, x):
            return torch.tanh(x * self.weight / self.temperature)

    twobp.register(Tempered, twobp.ops.recompute)
    model = twobp.patch(Tempered())
    model(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
    model.temperature.mul_(0.5)
    with pytest.raises(RuntimeError, match=r"twobp: buffer\(s\) or parameter\(s\) \['temperature'\]"):
        twobp.flush_weight_grads()
    twobp.discard_weight_grads()


class _TrimmedEmbedding(nn.Module):
    """Token ids (N, L) padded with 0 at the end, trimmed to the batch's longest sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 4, dtype=torch.float64))

    def forward(self, ids):
        return self.table[ids[:, : int((ids != 0).sum(1).max())]]


def test_recompute_rule_trial_on_token_ids_whose_output_length_follows_the_batch():
    """The halves' outputs, shorter than the whole batch's, were compared by broadcasting: a size
    error on the first call."""
    twobp.register(_TrimmedEmbedding, twobp.ops.recompute)
    patched, reference = patched_and_reference(_TrimmedEmbedding())
    ids = torch.tensor([[1, 2, 3, 4, 0], [5, 6, 0, 0, 0], [7, 8, 9, 0, 0], [3, 0, 0, 0, 0]])
    for net in (patched, reference):
        net(ids).pow(2).sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)


class _BatchStandardize(nn.Module):
    """Normalises over dim 0 (a batch statistic, no buffers)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(4)), nn.Parameter(torch.zeros(4))

    def forward(self, x):
        mean, var = x.mean(0, keepdim=True), x.var(0, keepdim=True, unbiased=False)
        return (x - mean) * torch.rsqrt(var + 1e-5) * self.weight + self.bias


def test_recompute_rule_keeps_a_bf16_batch_statistic_over_many_rows_apart():
    """Over 512 rows the trial's two extra rows move a bf16 batch mean by 1-3%: a tolerance of a
    few bf16 ulps (3.1%) took such a module for one whose rows are apart, and its micro-batches
    were replayed joined, with the joined batch's statistics (15.5 off)."""
    twobp.register(_BatchStandardize, twobp.ops.recompute_rowwise)
    patched, reference = patched_and_reference(_BatchStandardize().bfloat16())
    queue = twobp.WeightGradQueue("concat")
    for i in range(2):
        x, grad = (torch.randn(512, 4) * (1 + i) + i).bfloat16(), torch.randn(512, 4).bfloat16()
        for net in (patched, reference):
            with twobp.use_queue(queue):
                out = net(x)
            out.backward(grad)
    queue.flush()
    assert_grads_match(patched, reference, torch.bfloat16)


class _TemperedByAnAttribute(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6, dtype=torch.float64))
        self.temperature = 2.0

    def forward(self, x):
        return torch.tanh(x * self.weight / self.temperature)


@pytest.mark.parametrize("number", [float, np.float64, np.float32], ids=["float", "np.float64", "np.float32"])
@pytest.mark.parametrize("strategy", ["concat", "loop"])
def test_recompute_rule_replays_the_python_values_its_forward_read(strategy, number):
    """A temperature set per micro-batch (from a NumPy schedule too) and annealed after the last
    backward: the flush replayed with the value it found (1.5 off), and joined calls that read
    other values."""
    twobp.register(_TemperedByAnAttribute, twobp.ops.recompute_rowwise)
    patched, reference = patched_and_reference(
        nn.Sequential(nn.Linear(6, 6), _TemperedByAnAttribute(), nn.Linear(6, 2)).double()
    )
    queue = twobp.WeightGradQueue(strategy)
    for step in range(3):
        x = torch.randn(4, 6, dtype=torch.float64)
        for model in (patched, reference):
            model[1].temperature = number(2.0 + step)
            with twobp.use_queue(queue):
                model(x).pow(2).sum().backward()
            model[1].temperature = 0.5
    queue.flush()
    assert_grads_match(patched, reference, torch.float64)


class _StandardizesInTraining(nn.Module):
    def forward(self, x):
        return (x - x.mean(0, keepdim=True)) / (x.std(0, keepdim=True) + 1e-5) if self.training else x


class _BlockWithABatchNormChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm, self.gain = nn.Linear(6, 6), _StandardizesInTraining(), nn.Parameter(torch.ones(6))

    def forward(self, x):
        return self.gain * torch.tanh(self.norm(self.fc(x)))


def test_recompute_rule_tries_rows_apart_again_for_other_training_flags():
    """First called with its batch-statistic child in eval (rows apart), then trained: its
    calls were joined and standardized over all micro-batches (3.15 off)."""
    twobp.register(_BlockWithABatchNormChild, twobp.ops.recompute_rowwise)
    patched, reference = patched_and_reference(
        nn.Sequential(nn.Linear(6, 6), _BlockWithABatchNormChild(), nn.Linear(6, 2)).double()
    )
    queue = twobp.WeightGradQueue("concat")
    for step in range(4):
        x = torch.randn(4, 6, dtype=torch.float64) * (1 + step)
        for model in (patched, reference):
            model[1].norm.train(step > 0)
            with twobp.use_queue(queue):
                model(x).pow(2).sum().backward()
    queue.flush()
    assert_grads_match(patched, reference, torch.float64)


class _HooksAnIntermediate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6))

    def forward(self, x):
        h = x * self.weight
        h.register_hook(lambda g: g * 0.5)
        return torch.tanh(h)


@pytest.mark.parametrize("first", [True, False], ids=["first-layer", "inner"])
def test_recompute_rule_keeps_plain_autograd_for_a_forward_that_needs_a_graph(first):
    """A tensor hook on an intermediate: the first-call trial runs without a graph, where
    register_hook raises (plain trains)."""
    twobp.register(_HooksAnIntermediate, twobp.ops.recompute)
    layers = [_HooksAnIntermediate(), nn.Linear(6, 2)]
    if not first:
        layers.insert(0, nn.Linear(6, 6))
    patched, reference = patched_and_reference(nn.Sequential(*layers))
    for _ in range(2):
        x = torch.randn(4, 6)
        for model in (patched, reference):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model(x).pow(2).sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


class _GainAfterRelu(nn.Module):
    """Plain saves relu's output and the gain, never the input."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.full((6,), 0.1))

    def forward(self, x):
        return self.gain * torch.relu(x)


def test_recompute_rule_names_the_fix_for_an_input_changed_in_place_after_its_forward():
    """``h += block(h)``: plain trains (it saved no input of the block); the rule saves the block's
    input for its replay, and backward failed with autograd's own in-place error, naming no fix."""
    twobp.register(_GainAfterRelu, twobp.ops.recompute)
    inner, block, head = twobp.patch(nn.Linear(6, 6)), twobp.patch(_GainAfterRelu()), nn.Linear(6, 2)
    h = inner(torch.randn(4, 6))
    h += block(h)
    with pytest.raises(RuntimeError, match=r"twobp: a tensor a patched layer saved .*`h = h \+ block\(h\)`"):
        head(h).sum().backward()
    twobp.discard_weight_grads()


def test_recompute_rule_replays_a_scalar_whose_name_became_a_parameter_and_puts_every_value_back():
    """Between backward and flush a public float became a parameter of that name: the replay's
    setattr was refused by nn.Module (a TypeError), leaving the values it had set so far in
    place of the user's. The replay reads what the forward read, and leaves the module as it was."""

    class TwoScalars(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(6, dtype=torch.float64))
            self.temperature, self.scale = 2.0, 0.5

        def forward(self, x):
            return torch.tanh(x * self.weight / self.temperature) * self.scale

    twobp.register(TwoScalars, twobp.ops.recompute)
    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(6, 6), TwoScalars()).double())
    x = torch.randn(4, 6, dtype=torch.float64)
    for model in (patched, reference):
        model(x).pow(2).sum().backward()
        model[1].temperature = 9.0
        del model[1].scale
        model[1].scale = nn.Parameter(torch.tensor(0.25, dtype=torch.float64))
    twobp.flush_weight_grads()
    assert patched[1].temperature == 9.0 and isinstance(patched[1].scale, nn.Parameter)
    assert patched[1].scale.grad is None
    assert_grads_match(patched[0], reference[0])
    torch.testing.assert_close(patched[1].weight.grad, reference[1].weight.grad)


class _ReadsDefaults(nn.Module):
    """Reads values a schedule sets on the instance only later: a class default, getattr's
    default, and a tensor attribute's absence."""

    scale = 1.0

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6, dtype=torch.float64))

    def forward(self, x):
        y = torch.tanh(x * self.weight) * self.scale * getattr(self, "gain", 1.0)
        mask = getattr(self, "mask", None)
        return y if mask is None else y * mask


@pytest.mark.parametrize("rule", ["recompute", "recompute_rowwise"])
def test_recompute_rule_replays_the_defaults_a_forward_read_before_the_instance_set_its_own(rule):
    """A schedule set ``m.scale`` (over the class's default), ``m.gain`` (over getattr's) and
    ``m.mask`` after a micro-batch's backward: its replay at the flush read them (3x the
    gradient, silently), where only values the forward saw on the instance were put back."""
    twobp.register(_ReadsDefaults, getattr(twobp.ops, rule))
    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(6, 6), _ReadsDefaults()).double())
    for step, (scale, gain) in enumerate([(3.0, 0.5), (-2.0, 4.0)]):
        x = torch.randn(4, 6, dtype=torch.float64)
        for model in (patched, reference):
            model(x).pow(2).sum().backward()
            model[1].scale, model[1].gain = scale, gain
            model[1].mask = torch.full((6,), 1.0 + step, dtype=torch.float64)
    twobp.flush_weight_grads()
    assert patched[1].scale == -2.0 and patched[1].gain == 4.0 and patched[1].mask[0] == 2.0
    assert_grads_match(patched, reference, torch.float64)


class _Activated(nn.Module):
    """Reads its activation, a class default a schedule may replace on the instance."""

    act = staticmethod(torch.tanh)

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4).double()

    def forward(self, x):
        return self.act(self.lin(x))


@pytest.mark.parametrize("rule", ["recompute", "recompute_rowwise"])
def test_recompute_rule_does_not_join_calls_before_and_after_a_public_name_was_set(rule):
    """An activation (no scalar, no tensor) set on the instance between two micro-batches: the
    second call reads it, the first the class default it shadows. Their replays were joined
    under one call's state (the row-wise rule's: one call replayed with the other's activation,
    silently)."""
    twobp.register(_Activated, getattr(twobp.ops, rule))
    patched, reference = patched_and_reference(_Activated())
    queue = twobp.WeightGradQueue(strategy="concat")
    xs = [torch.randn(3, 4, dtype=torch.float64) for _ in range(2)]
    for model in (patched, reference):
        with twobp.use_queue(queue):
            model(xs[0]).square().sum().backward()
            model.act = torch.sigmoid
            model(xs[1]).square().sum().backward()
    twobp.flush_weight_grads(queue)
    assert_grads_match(patched, reference, torch.float64)


class _GainedBlock(nn.Module):
    """A block reading a gain that a buffer may provide later, and a mask registered as None, around a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6, bias=False).double()
        self.register_buffer("mask", None)

    def forward(self, x):
        y = torch.tanh(self.lin(x)) * getattr(self, "gain", 1.0)
        return y if self.mask is None else y * self.mask


class _TripledLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 3


@pytest.mark.parametrize(
    "change",
    [
        "buffer-on-the-module", "parameter-on-the-module", "prune-a-child", "hook-on-a-child", "child-wrapped",
        "none-buffer-set", "none-bias-set", "child-class-swapped",
    ],
)  # fmt: skip
def test_recompute_rule_refuses_a_flush_after_parts_were_added_to_the_module(change):
    """Between backward and flush a buffer or parameter was added where the forward read a default
    (the replay read it: 3x off), a child was pruned (its mask and pre-hook ran at the replay:
    0.9x), or a child got a hook or a wrapped forward (3x): all silently. Refused now."""
    twobp.register(_GainedBlock, twobp.ops.recompute)
    model = twobp.patch(nn.Sequential(nn.Linear(6, 6), _GainedBlock()).double())
    model(torch.randn(4, 6, dtype=torch.float64)).pow(2).sum().backward()
    block = model[1]
    if change == "buffer-on-the-module":
        block.register_buffer("gain", torch.tensor(3.0, dtype=torch.float64))
    elif change == "parameter-on-the-module":
        block.gain = nn.Parameter(torch.tensor(3.0, dtype=torch.float64))
    elif change == "prune-a-child":
        torch.nn.utils.prune.l1_unstructured(block.lin, "weight", amount=0.5)
    elif change == "hook-on-a-child":
        block.lin.register_forward_hook(lambda module, args, output: output * 3)
    elif change == "none-buffer-set":
        block.mask = torch.full((6,), 3.0, dtype=torch.float64)
    elif change == "none-bias-set":
        block.lin.bias = nn.Parameter(torch.ones(6, dtype=torch.float64))
    elif change == "child-class-swapped":
        block.lin.__class__ = _TripledLinear
    else:
        inner = block.lin.forward
        block.lin.forward = lambda *args: inner(*args) * 3
    with pytest.raises(RuntimeError, match="changed between its forward and the flush"):
        twobp.flush_weight_grads()
    twobp.discard_weight_grads()


def test_recompute_rule_replays_after_its_children_were_unpatched_and_patched_again():
    """Their instance forwards are new calls, which compute as the class's: no refusal (was one)."""
    twobp.register(_GainedBlock, twobp.ops.recompute)
    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(6, 6), _GainedBlock()).double())
    x = torch.randn(4, 6, dtype=torch.float64)
    for model in (patched, reference):
        model(x).pow(2).sum().backward()
    twobp.patch(twobp.unpatch(patched))
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)


def test_recompute_rule_leaves_a_first_calls_own_error_to_the_user_and_stays_deferred():
    """A first call with a wrong input shape: the trial's failure was taken for a forward that
    needs a graph, with a warning saying so, before the user's own error."""

    class Gain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(6))

        def forward(self, x):
            return torch.tanh(x * self.weight)

    twobp.register(Gain, twobp.ops.recompute)
    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(6, 6), Gain()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match="must match the size"):
            patched[1](torch.randn(4, 5, requires_grad=True))
    x = torch.randn(4, 6)
    for model in (patched, reference):
        model(x).pow(2).sum().backward()
    assert twobp.pending().jobs == 2
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


class _BranchesOnAFlag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6, dtype=torch.float64))
        self.flag = np.bool_(True)

    def forward(self, x):
        h = x * self.weight
        return h.sin() if self.flag else h.cos()


def test_recompute_rule_replays_a_numpy_flag_its_forward_read():
    """``np.random.rand() < p`` is an np.bool_, no numbers.Number: a flag set per micro-batch
    was read as at the flush (3.08 off)."""
    twobp.register(_BranchesOnAFlag, twobp.ops.recompute)
    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(6, 6), _BranchesOnAFlag()).double())
    for step in range(3):
        x = torch.randn(4, 6, dtype=torch.float64)
        for model in (patched, reference):
            model[1].flag = np.bool_(step % 2 == 0)
            model(x).pow(2).sum().backward()
            model[1].flag = np.bool_(False)
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)


def test_a_backward_run_under_inference_mode_gives_its_gradients_at_once():
    """Plain allows it; the queue's version check crashed on the inference-mode output gradients."""
    patched, reference = patched_and_reference(mlp(torch.float64))
    x = torch.randn(3, 6, dtype=torch.float64)
    for model in (patched, reference):
        loss = model(x).square().sum()
        with torch.inference_mode():
            loss.backward()
    assert twobp.pending().jobs == 0
    assert_grads_match(patched, reference)


class _PositionEmbedded(nn.Module):
    """A parameter of the activation's own shape added to it (a ViT's pos_embedding)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.head = nn.Linear(4, 4), nn.Linear(4, 2)
        self.pos = nn.Parameter(torch.randn(1, 3, 4))

    def forward(self, x):
        return self.head(self.proj(x) + self.pos)


@pytest.mark.parametrize("strategy", ["auto", "concat", "loop"])
def test_a_parameter_of_the_activations_shape_with_one_sample_micro_batches_matches_plain(strategy):
    """Autograd may hand pos the activation's gradient tensor itself as .grad while the Linear
    before it queues a view of it: accumulating the next micro-batch into that .grad must not
    reach the queued work (the version check would refuse it; here it is accepted and equal)."""
    patched, reference = patched_and_reference(_PositionEmbedded().double())
    queue = twobp.WeightGradQueue(strategy)
    for _ in range(3):
        x = torch.randn(1, 3, 4, dtype=torch.float64)
        with twobp.use_queue(queue):
            patched(x).square().sum().backward()
        reference(x).square().sum().backward()
    queue.flush()
    assert_grads_match(patched, reference, torch.float64)


class _PositionTable(nn.Module):
    """A ``(T, D)`` position table added through ``unsqueeze(0)`` to an embedding's output: at
    a micro-batch of one sample autograd gives the table a view of the embedding's output
    gradient, uncopied, as its ``.grad``."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.head = nn.Embedding(20, 4), nn.Linear(4, 4)
        self.positions = nn.Parameter(torch.randn(3, 4))
        self.kept: list[Tensor] = []

    def forward(self, tokens: Tensor, keep: str) -> Tensor:
        hidden = self.tokens(tokens) + self.positions.unsqueeze(0)
        if keep == "hook":  # a gradient logger keeps what its hook is handed
            hidden.register_hook(self.kept.append)
        elif keep == "retain_grad":
            hidden.retain_grad()
            self.kept.append(hidden)
        return self.head(hidden)


@pytest.mark.parametrize("keep", ["none", "hook", "retain_grad"])
def test_an_output_gradient_held_elsewhere_and_changed_in_place_later_leaves_the_queued_work_alone(keep):
    """What else holds a patched layer's output gradient at the end of its backward (a
    parameter's ``.grad``, which the next backward accumulates into in place; a hook's or
    ``retain_grad``'s copy the user then changes) may change it before the flush: the queue
    copies such gradients then. Each was refused at the flush as modified in place."""
    patched, reference = patched_and_reference(_PositionTable().double())
    for _ in range(3):
        tokens = torch.randint(0, 20, (1, 3))
        for model in (patched, reference):
            model(tokens, keep).pow(3).sum().backward()
            for kept in model.kept:
                (kept.grad if keep == "retain_grad" else kept).mul_(7.0)
            model.kept.clear()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)


@pytest.mark.parametrize("layer", ["linear", "conv"])
def test_an_expanded_output_gradient_made_in_inference_mode_and_changed_later_leaves_the_queued_work_alone(layer):
    """``y.backward(g.expand_as(y))`` with ``g`` made under inference_mode (a reused buffer),
    changed in place before the flush: autograd hands the expanded view on uncopied, and an
    inference tensor has no version counter to refuse the change by: the flush computed from the
    changed values (bias gradient 50 where plain gives 5). Such gradients are copied as queued."""
    make = {"linear": lambda: nn.Linear(4, 3), "conv": lambda: nn.Conv1d(4, 3, 1)}[layer]
    patched, reference = patched_and_reference(make().double())
    x = torch.randn(5, 4, 1, dtype=torch.float64) if layer == "conv" else torch.randn(5, 4, dtype=torch.float64)
    for model in (patched, reference):
        output = model(x)
        with torch.inference_mode():
            buffer = torch.ones(output.shape[1:], dtype=torch.float64)
        output.backward(buffer.expand_as(output))
        with torch.inference_mode():
            buffer.mul_(10)
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)


def test_output_gradients_only_the_queue_holds_are_not_copied(monkeypatch):
    """The copy is for gradients something else holds: a plain training step makes none (the
    storage's Python object holds a reference of its own, which the count once mistook for
    another holder: every output gradient was copied at every backward)."""
    copied: list[object] = []
    own = WeightGradJob.own_grad_outputs
    monkeypatch.setattr(WeightGradJob, "own_grad_outputs", lambda job, held: (copied.append(job), own(job, held)))
    model = twobp.patch(mlp())
    for _ in range(2):
        x, labels = torch.randn(4, 6), torch.randint(0, 3, (4,))
        nn.functional.cross_entropy(model(x), labels).backward()
        model(x).pow(3).sum().backward()
    twobp.flush_weight_grads()
    assert copied == []
    table = twobp.patch(_PositionTable())
    table(torch.randint(0, 20, (1, 3)), "none").pow(3).sum().backward()
    assert len(copied) == 1, "the embedding's output gradient, given to the table's .grad too"
    twobp.flush_weight_grads()


class _ElsewhereTensor(torch.Tensor):
    """Reports the meta device, computes on the CPU: activations on another device than the
    parameter (a GPU's, for a parameter kept in host memory), on a machine with one device."""

    @staticmethod
    def __new__(cls, elem: Tensor) -> "_ElsewhereTensor":
        wrapper = Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, elem.shape, dtype=elem.dtype, device="meta", requires_grad=elem.requires_grad, strides=elem.stride()
        )
        wrapper.elem = elem
        return wrapper

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(t):
            return t.elem if isinstance(t, _ElsewhereTensor) else t

        out = func(*torch.utils._pytree.tree_map(unwrap, args), **torch.utils._pytree.tree_map(unwrap, kwargs or {}))
        return torch.utils._pytree.tree_map(lambda t: _ElsewhereTensor(t) if isinstance(t, Tensor) else t, out)


class _ToElsewhere(torch.autograd.Function):
    """``w.to(device)`` from the host parameter, and its gradient's way back."""

    @staticmethod
    def forward(ctx, w: Tensor) -> Tensor:
        return _ElsewhereTensor(w.detach().clone())

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.elem


class _HostScaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x) * _ToElsewhere.apply(self.w)


def _host_scaled_weight_grad(saved, grad_outputs, needs):
    return [(saved[0] * grad_outputs[0]).sum(0).elem]  # made where the activations are, handed to the host


def test_a_rule_whose_tensors_live_on_another_device_than_its_parameter_flushes():
    """The check against a model moved between backward and flush compares the parameters'
    device with theirs in backward, not with the job's tensors': a rule's activations and
    output gradients may live on another device (it refused this as a move)."""

    @twobp.register(_HostScaled)
    def host_scaled(module: _HostScaled, x: Tensor) -> Tensor:
        t = torch.tanh(x)
        out = t * _ToElsewhere.apply(detached(module.w))
        return defer_weight_grads(out, (module.w,), (t.detach(),), _host_scaled_weight_grad, concatenate=False)

    patched, reference = patched_and_reference(_HostScaled())
    for _ in range(2):
        x = torch.randn(3, 4, dtype=torch.float64)
        for model in (patched, reference):
            ones = _ElsewhereTensor(torch.ones(3, 4, dtype=torch.float64))
            torch.autograd.backward(model(_ElsewhereTensor(x)), ones)
    assert_no_grads(patched)
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)


class _GatedUnit(nn.Module):
    """A module for the recompute rule: a gated projection, long enough a forward for threads to interleave."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, 2 * width) * 0.3)
        self.bias = nn.Parameter(torch.full((2 * width,), 0.1))

    def forward(self, x: Tensor) -> Tensor:
        h = x @ self.weight + self.bias
        for _ in range(10):
            h = h * 1.001
        a, g = h.chunk(2, -1)
        return a * torch.sigmoid(g)


@pytest.mark.parametrize("backward", ["after-the-threads", "in-the-threads"])
def test_threads_running_one_module_under_the_recompute_rule_train_it_as_plain(backward: str):
    """The rule runs the module with detached stand-ins in place of its parameters: another
    thread's call saw them, took the module for frozen and ran it on plain autograd over the
    stand-ins (its gradient lost), or took a stand-in for the parameter and put it back for good
    (the module trained no more; in every run of 4 threads x 8 calls). Each thread has its queue."""
    twobp.register(_GatedUnit, twobp.ops.recompute)
    patched, reference = patched_and_reference(_GatedUnit().double())
    callers = [patched] * 4
    parameters = dict(patched.named_parameters())
    queues = [twobp.WeightGradQueue() for _ in range(4)]
    outputs: list[list[tuple[Tensor, Tensor]]] = [[] for _ in queues]

    def train(k: int) -> None:
        generator = torch.Generator().manual_seed(k)
        for _ in range(8):
            x = torch.randn(32, 16, generator=generator, dtype=torch.float64, requires_grad=True)
            with twobp.use_queue(queues[k]):
                y = callers[k](x)
                if backward == "in-the-threads":
                    y.sum().backward()
            outputs[k].append((x.detach(), y))

    threads = [threading.Thread(target=train, args=(k,)) for k in range(len(queues))]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch as often as they can
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    for queue, calls in zip(queues, outputs, strict=True):
        for x, y in calls:
            if backward == "after-the-threads":
                y.sum().backward()
            reference(x).sum().backward()
        queue.flush()
    assert dict(patched.named_parameters()) == parameters  # the module's own, not stand-ins
    assert_grads_match(patched, reference)


def test_a_patched_call_pickled_without_its_rules_lock_gets_it_when_loaded():
    """A call pickled before the recompute rule's lock existed loaded without it (the patched
    call then took none: the thread race came back), and new pickles named the private lock."""
    twobp.register(_GatedUnit, twobp.ops.recompute)
    call = twobp.patch(_GatedUnit()).forward
    state = call.__getstate__()
    assert "runs_alone" not in state
    loaded = object.__new__(type(call))
    loaded.__setstate__(state)
    assert loaded.runs_alone is twobp.ops.recompute.runs_alone


class _MixedWithMadeTensors(nn.Module):
    """A module for the recompute rule whose forward makes tensors with the factory defaults."""

    def __init__(self, width: int = 5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width))

    def forward(self, x: Tensor) -> Tensor:
        ramp = torch.arange(x.shape[-1]) / x.shape[-1]  # no dtype= or device=
        return (x * self.weight) @ torch.eye(x.shape[-1]) + ramp


@pytest.mark.parametrize("flush_under", ["meta-device", "float64-default-dtype"])
def test_a_recompute_replay_makes_tensors_as_its_forward_did(flush_under: str):
    """The flush's replay ran the forward under the defaults of the flush's caller: inside
    ``with torch.device("meta")`` the eye was made on meta and the weight's gradient was CPU
    memory never written (plain's wholly replaced, silently); under another default dtype the
    replay failed on a dtype mismatch."""
    twobp.register(_MixedWithMadeTensors, twobp.ops.recompute)
    patched, reference = patched_and_reference(_MixedWithMadeTensors())
    x = torch.randn(4, 5)
    for net in (patched, reference):
        net(x).pow(2).sum().backward()
    if flush_under == "meta-device":
        with torch.device("meta"):
            twobp.flush_weight_grads()
    else:
        dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            twobp.flush_weight_grads()
        finally:
            torch.set_default_dtype(dtype)
    assert_grads_match(patched, reference)


@pytest.mark.parametrize("made_under", ["meta-device", "fake-tensor-mode"])
def test_a_recompute_module_runs_a_shape_estimate_as_plain_does(made_under: str):
    """A model built on the meta device (a memory estimate), or run under FakeTensorMode: the
    rule's first-call trials read values (``.item()``, ``torch.equal``) and failed where plain's
    forward runs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    twobp.register(_GatedUnit, twobp.ops.recompute)
    if made_under == "meta-device":
        with torch.device("meta"):
            model = _GatedUnit()
        context: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
        x = torch.randn(4, 16, device="meta", requires_grad=True)
    else:
        model = _GatedUnit()
        context = FakeTensorMode(allow_non_fake_inputs=True)
        x = torch.randn(4, 16)
    plain = copy.deepcopy(model)
    twobp.patch(model)
    with context:
        shapes = [net(x).shape for net in (model, plain)]
    assert shapes[0] == shapes[1] == (4, 16)
    twobp.discard_weight_grads()


class _Branches(nn.Module):
    """A module for the recompute rule whose forward runs its branches (also under the rule) on a
    thread pool and waits for them."""

    def __init__(self) -> None:
        super().__init__()
        self.branches = nn.ModuleList([_GatedUnit() for _ in range(3)])
        self.scale = nn.Parameter(torch.ones(16))

    def forward(self, x: Tensor) -> Tensor:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(3) as pool:
            outputs = list(pool.map(lambda branch: branch(x), self.branches))
        return sum(outputs) * self.scale


@pytest.mark.parametrize("mode", ["training", "eval"])
def test_a_recompute_forward_waiting_for_threads_running_other_such_modules_finishes(mode: str):
    """One lock for every call of the rule deadlocked here: the outer forward held it while its
    pool's threads waited for it (in eval too, where the calls run plain forwards)."""
    twobp.register(_GatedUnit, twobp.ops.recompute)
    twobp.register(_Branches, twobp.ops.recompute)
    patched, reference = patched_and_reference(_Branches().double())
    if mode == "eval":
        patched.eval()
        reference.eval()
    x = torch.randn(4, 16, dtype=torch.float64)
    done: list[Tensor] = []
    worker = threading.Thread(target=lambda: done.append(patched(x)), daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert done, "the forward did not finish within 60 s (a deadlock)"
    done[0].sum().backward()
    reference(x).sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


def test_a_rewind_of_one_recompute_module_does_not_hide_another_threads_draws():
    """Module B (dropout) draws its mask; module A, on its first call, sees the default generator
    moved, takes itself for random and rewound the generator to where it found it, where B did:
    B's own check then saw no draw, B deferred, and its flush replayed another mask (weight
    gradient up to 85% off). The schedule is forced with events; a rewind is now made only where
    no other thread runs the rule."""
    ready, a_inside, b_drew, a_done = (threading.Event() for _ in range(4))

    class Deterministic(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(16, 16, dtype=torch.float64))
            self.waited = False

        def forward(self, x: Tensor) -> Tensor:
            if torch.is_grad_enabled() and not self.waited:  # the rule's deferred forward
                self.waited = True
                a_inside.set()
                b_drew.wait(10)
            return torch.tanh(x @ self.weight)

    class Dropping(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(16, 16, dtype=torch.float64))
            self.waited = False

        def forward(self, x: Tensor) -> Tensor:
            first = torch.is_grad_enabled() and not self.waited
            if first:
                self.waited = True
                ready.set()
                a_inside.wait(10)
            mask = (torch.rand(x.shape[0], 16, dtype=x.dtype) > 0.5).to(x.dtype)
            if first:
                b_drew.set()
                a_done.wait(10)
            return (x @ self.weight) * mask * 2.0

    twobp.register(Deterministic, twobp.ops.recompute)
    twobp.register(Dropping, twobp.ops.recompute)
    a, b = twobp.patch(Deterministic()), twobp.patch(Dropping())
    x = torch.randn(8, 16, dtype=torch.float64)
    outputs: list[Tensor] = []

    def run_a() -> None:
        ready.wait(10)
        a(torch.ones(8, 16, dtype=torch.float64, requires_grad=True))
        a_done.set()

    def run_b() -> None:
        queue = twobp.WeightGradQueue()
        with twobp.use_queue(queue):
            y = b(x)
            y.sum().backward()
        torch.rand(5)  # a draw before the flush (the next batch's shuffle)
        queue.flush()
        outputs.append(y)

    threads = [threading.Thread(target=run_a), threading.Thread(target=run_b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    mask = (outputs[0].detach() != 0).to(x.dtype)  # the mask B's forward used
    torch.testing.assert_close(b.weight.grad, x.T @ (mask * 2.0), rtol=1e-12, atol=1e-12)


class _Centring(nn.Module):
    """A module for the recompute rule that centres over the batch once a schedule sets its flag."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(5))
        self.centre = False

    def forward(self, x: Tensor) -> Tensor:
        y = x * self.weight
        if self.centre:
            y = y - y.mean(0)
        if x.dim() == 3:  # time-major (T, N, C): a running sum over time
            y = y.cumsum(0)
        return y


@pytest.mark.parametrize("change", ["a-public-flag-set", "a-public-number-set", "time-major-inputs"])
def test_a_recompute_modules_calls_unlike_its_first_are_tried_again_before_they_are_joined(change: str):
    """Whether the flush may join a module's calls on dim 0 was decided on its first calls and kept
    per training flags only: calls after a flag a schedule sets, or with inputs of another rank,
    were joined under the first calls' verdict (the weight's gradient 124% and 135% off)."""
    twobp.register(_Centring, twobp.ops.recompute_rowwise)
    patched, reference = patched_and_reference(_Centring().double())
    queue = twobp.WeightGradQueue("concat")  # join whatever may be joined
    first = torch.randn(3, 5, dtype=torch.float64)
    later = [torch.randn(n, 5, dtype=torch.float64) for n in (2, 4)]
    if change == "time-major-inputs":
        later = [torch.randn(n, 2, 5, dtype=torch.float64) for n in (2, 4)]
    for net in (patched, reference):
        net.centre = 0 if change == "a-public-number-set" else False
        with twobp.use_queue(queue):
            net(first).pow(3).sum().backward()
            net.centre = {"a-public-flag-set": True, "a-public-number-set": 1}.get(change, False)
            for x in later:
                net(x).pow(3).sum().backward()
    queue.flush()
    assert_grads_match(patched, reference)


class _CachesWhenFrozen(nn.Module):
    """A module for the recompute rule that caches its standardised weight while it is frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(5, 5))

    def forward(self, x: Tensor) -> Tensor:
        if not self.weight.requires_grad:  # frozen: standardise once
            if getattr(self, "_frozen", None) is None:
                self._frozen = (self.weight - self.weight.mean()) / self.weight.std()
            weight = self._frozen
        else:
            weight = (self.weight - self.weight.mean()) / self.weight.std()
        return torch.tanh(x @ weight)


def test_a_recompute_forward_that_adds_a_tensor_attribute_keeps_plain_autograd():
    """The forward runs on detached stand-ins, which require no grad: it took the frozen path and
    kept a cache made from them, which later calls used after the step had changed the weight
    (plain never takes that path; every gradient 26-45% off from the second step). A tensor
    attribute the forward adds is state the flush cannot replay: the module keeps plain autograd."""
    twobp.register(_CachesWhenFrozen, twobp.ops.recompute)
    patched, reference = patched_and_reference(_CachesWhenFrozen().double())
    optimizers = [torch.optim.SGD(net.parameters(), lr=0.1) for net in (patched, reference)]
    with pytest.warns(UserWarning, match="adds tensors kept as plain attributes"):
        for _ in range(3):
            x = torch.randn(4, 5, dtype=torch.float64)
            for net in (patched, reference):
                net(x).pow(3).sum().backward()
            twobp.flush_weight_grads()
            assert_grads_match(patched, reference)
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()


class _Annealed(nn.Module):
    """A module for the recompute rule reading a temperature a schedule sets before every call."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(5))
        self.temperature = 1.0
        self._forwards = 0

    def forward(self, x: Tensor) -> Tensor:
        self._forwards += 1
        return torch.tanh(x * self.weight / self.temperature)


@pytest.mark.parametrize("setting", ["a-number", "a-string"])
def test_a_recompute_module_reading_a_value_set_at_every_call_runs_its_trials_a_few_times(setting: str):
    """Whether rows are treated apart is tried again for another public value (a mode a schedule
    sets may change it), for at most 8 values: a value a schedule sets at every call ran the
    forward three times per call, and kept a verdict per value. Past them calls are not joined
    (calls that saw other values are not joined anyway)."""
    twobp.register(_Annealed, twobp.ops.recompute_rowwise)
    patched, reference = patched_and_reference(_Annealed())
    calls, tried = 12, 0
    for step in range(calls):
        x = torch.randn(4, 5)
        for net in (patched, reference):
            if setting == "a-number":
                net.temperature = 1.0 + step / 10
            else:
                net.phase = f"step {step}"  # read by no one: a public string all the same
            net(x).pow(3).sum().backward()
        tried = tried or patched._forwards  # the call and its trials
    forwards = patched._forwards
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)
    assert tried > 1
    assert forwards == tried * 8 + (calls - 8), forwards  # trials for the first 8 values, then one per call


class _CheckpointsInside(nn.Module):
    """A module for the recompute rule whose forward checkpoints a part of itself, reentrantly."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.outer = nn.Parameter(torch.randn(6)), nn.Parameter(torch.randn(6))

    def part(self, h: Tensor, weight: Tensor) -> Tensor:
        return torch.tanh(h * weight)

    def forward(self, x: Tensor) -> Tensor:
        return torch.utils.checkpoint.checkpoint(self.part, x, self.inner, use_reentrant=True) * self.outer


def test_a_recompute_forward_with_a_reentrant_checkpoint_inside_is_refused_at_the_flush_saying_why():
    """The flush's replay differentiates with torch.autograd.grad, which a reentrant checkpoint
    refuses: the flush failed with PyTorch's own error, naming neither the module nor a way out.
    The refusal keeps the work queued, and the module's later calls keep plain autograd."""
    twobp.register(_CheckpointsInside, twobp.ops.recompute)
    patched, reference = patched_and_reference(_CheckpointsInside())
    x = torch.randn(3, 6, requires_grad=True)
    patched(x).pow(2).sum().backward()
    with pytest.raises(RuntimeError, match=r"twobp: _CheckpointsInside's forward runs torch.utils.checkpoint"):
        twobp.flush_weight_grads()
    assert twobp.pending().jobs == 1
    twobp.discard_weight_grads()
    for net in (patched, reference):
        net(x).pow(2).sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


class _LazyTable(nn.Module):
    """A module for the recompute rule that builds a table from its weight when a longer input comes."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4))
        self.longest = 0

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[0] > self.longest:
            self.longest = x.shape[0]
            self.table = self.weight.repeat(x.shape[0], 1)
        return torch.tanh(x) * self.table[: x.shape[0]]


@pytest.mark.parametrize("strategy", ["auto", "concat"])
def test_a_recompute_module_building_a_table_lazily_keeps_plain_autograd_with_plain_gradients(strategy: str):
    """Such a forward adds a tensor attribute: the module keeps plain autograd. But its first
    call's trials had built the table from the stand-ins (which require no grad) and set the
    length, so the plain forward reused that table: the weight's gradient was lost (None). The
    call now undoes what the trials added before running plain autograd."""
    twobp.register(_LazyTable, twobp.ops.recompute)
    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(4, 4), _LazyTable()).double())
    queue = twobp.WeightGradQueue(strategy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # once per module type: "adds tensors kept as plain attributes"
        for rows in (3, 3, 5, 2):
            x = torch.randn(rows, 4, dtype=torch.float64)
            reference(x).pow(2).sum().backward()
            with twobp.use_queue(queue):
                patched(x).pow(2).sum().backward()
    queue.flush()
    assert_grads_match(patched, reference)
    assert patched[1].longest == reference[1].longest == 5


class _Counting(nn.Module):
    """A module for the recompute rule whose forward counts its calls in a public attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.calls = 0
        self._forwards = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        self._forwards += 1
        return torch.tanh(self.linear(x))


def test_a_recompute_forward_counting_its_calls_is_tried_once_and_joined():
    """The join verdict is kept per public value the forward reads, but a counter the forward
    itself changes is no setting: it made a verdict, and two trial forwards, per call, and past
    8 verdicts the calls were no longer joined."""
    twobp.register(_Counting, twobp.ops.recompute_rowwise)
    patched, reference = patched_and_reference(_Counting().double())
    queue = twobp.WeightGradQueue("concat")
    tried = 0
    for _ in range(12):
        x = torch.randn(3, 4, dtype=torch.float64)
        reference(x).pow(2).sum().backward()
        with twobp.use_queue(queue):
            patched(x).pow(2).sum().backward()
        tried = tried or patched._forwards  # the first call and its trials
    forwards = patched._forwards
    queue.flush()
    assert_grads_match(patched, reference)
    # The second call seeks a verdict once more (without the counter in its key), then one per call.
    assert forwards <= 2 * tried + 10, forwards
    assert patched._forwards - forwards == 1  # one joined replay at the flush


class _CentringByTensor(nn.Module):
    """A module for the recompute rule that centres over the batch where a tensor it holds says so:
    a buffer (``fill_`` between flushes), a tensor attribute, or a row of a table it holds a view of
    (the view set per call: one start, other lengths)."""

    TABLE = torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64)

    def __init__(self, held_as: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(5, dtype=torch.float64))
        if held_as == "buffer":
            self.register_buffer("centre", torch.zeros((), dtype=torch.float64))
        else:
            self.centre = self.TABLE[:1] if held_as == "view-of-a-table" else torch.zeros((), dtype=torch.float64)

    def forward(self, x: Tensor) -> Tensor:
        y = x * self.weight
        if self.centre.sum() > 0:
            y = y - y.mean(0)
        return y


@pytest.mark.parametrize("held_as", ["buffer", "tensor-attribute", "view-of-a-table"])
def test_a_recompute_modules_calls_after_a_tensor_it_reads_changed_are_tried_again(held_as: str):
    """The join verdict was kept per training flags, public scalars and input ranks: a mode kept in
    a buffer (as README advises for state) or a tensor attribute switched to centring over the
    batch, and the later calls were joined under the row-wise verdict (25% and 46% off)."""
    twobp.register(_CentringByTensor, twobp.ops.recompute_rowwise)
    patched, reference = patched_and_reference(_CentringByTensor(held_as))
    queue = twobp.WeightGradQueue("concat")
    first, later = torch.randn(3, 5, dtype=torch.float64), [torch.randn(n, 5, dtype=torch.float64) for n in (2, 3)]
    for net in (patched, reference):
        with twobp.use_queue(queue):
            net(first).pow(3).sum().backward()
        queue.flush()
        if held_as == "buffer":
            net.centre.fill_(1.0)
        elif held_as == "tensor-attribute":
            net.centre = torch.ones((), dtype=torch.float64)
        with twobp.use_queue(queue):
            for k, x in enumerate(later, start=2):
                if held_as == "view-of-a-table":
                    net.centre = _CentringByTensor.TABLE[:k]
                net(x).pow(3).sum().backward()
    queue.flush()
    assert_grads_match(patched, reference, torch.float64)


@pytest.mark.parametrize("held_as", ["buffer", "tensor-attribute"])
def test_a_recompute_modules_mode_tensor_assigned_anew_each_step_is_never_judged_by_an_old_one(held_as: str):
    """Keyed by id() or data pointer and version, a mode tensor assigned anew each step (version 0)
    took the key of one freed steps before: a centring step was judged by a row-wise step's verdict
    and joined (148% and 160% off)."""
    twobp.register(_CentringByTensor, twobp.ops.recompute_rowwise)
    patched, reference = patched_and_reference(_CentringByTensor(held_as))
    queue = twobp.WeightGradQueue("concat")
    for mode in [0, 0, 1, 0, 1, 1, 0, 1, 0, 0, 1, 1, 0, 1, 0, 1]:
        xs = [torch.randn(n, 5, dtype=torch.float64) for n in (2, 3)]
        for net in (patched, reference):
            net.centre = torch.full((), float(mode), dtype=torch.float64)
            with twobp.use_queue(queue):
                for x in xs:
                    net(x).pow(3).sum().backward()
            queue.flush()
        assert_grads_match(patched, reference, torch.float64)
        for net in (patched, reference):
            net.weight.grad = None


class _ReturnsItsTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, dtype=torch.float64))
        self.table = torch.randn(3, 4, dtype=torch.float64)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return torch.tanh(x * self.weight), self.table


def test_a_recompute_forward_returning_a_tensor_it_holds_trains_as_plain():
    """The deferral re-parents its outputs in place: the held table joined the first call's graph,
    and the second micro-batch's backward went through it a second time (autograd's error)."""
    twobp.register(_ReturnsItsTable, twobp.ops.recompute_rowwise)
    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(4, 4), _ReturnsItsTable()).double())
    with pytest.warns(UserWarning, match="outputs that are its inputs, parameters or buffers"):
        for _ in range(2):
            x = torch.randn(3, 4, dtype=torch.float64)
            for net in (patched, reference):
                y, table = net(x)
                (y * table).sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)


class _MaxNorm(nn.Module):
    """A module for the recompute rule that keeps its weight's rows within a norm in its forward,
    as models constrained by max-norm do."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4, dtype=torch.float64) * 3)
        self._how = how  # private: not a setting the rule keys its verdicts by

    def forward(self, x: Tensor) -> Tensor:
        if self._how == "data-rebound":
            self.weight.data = torch.renorm(self.weight.data, 2, 0, 1.0)
        elif self._how == "data-scaled-in-place":
            self.weight.data.mul_(0.9)
        elif self._how == "in-place-under-no-grad":
            with torch.no_grad():
                self.weight.copy_(torch.renorm(self.weight, 2, 0, 1.0))
        return torch.tanh(x @ self.weight)


@pytest.mark.parametrize("how", ["data-rebound", "data-scaled-in-place", "in-place-under-no-grad"])
def test_a_recompute_forward_that_changes_its_parameters_keeps_plain_autograd(how: str, monkeypatch):
    """The rule runs the forward on detached stand-ins: a constraint rebinding ``.data`` reached the
    stand-in only (the weight never constrained: 1.55 off after three steps), one scaling it in
    place through ``.data`` ran in each trial and again in the replay (18% off), and one under
    no_grad bumped the version the flush checks (every flush refused)."""
    monkeypatch.setattr(warn_once, "given", set())  # each reason warns once per process
    twobp.register(_MaxNorm, twobp.ops.recompute)
    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(4, 4), _MaxNorm(how)).double())
    optimizers = [torch.optim.SGD(net.parameters(), lr=0.1) for net in (patched, reference)]
    with pytest.warns(UserWarning, match="changes its parameters"):
        for _ in range(3):
            for _ in range(2):
                x = torch.randn(3, 4, dtype=torch.float64)
                for net in (patched, reference):
                    net(x).pow(2).sum().backward()
            twobp.flush_weight_grads()
            assert_grads_match(patched, reference, torch.float64)
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
            torch.testing.assert_close(patched[1].weight, reference[1].weight)


def test_a_recompute_forward_that_starts_changing_its_parameters_in_place_is_refused(monkeypatch):
    """A change a later call makes in place cannot be undone to run the call again on plain
    autograd: refused, the module plain from then on."""
    monkeypatch.setattr(warn_once, "given", set())
    twobp.register(_MaxNorm, twobp.ops.recompute)
    model = twobp.patch(_MaxNorm("none"))
    model(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
    twobp.flush_weight_grads()
    model.weight.grad = None
    model._how = "in-place-under-no-grad"
    with pytest.raises(RuntimeError, match="twobp: _MaxNorm's forward changed one of its parameters in place"):
        model(torch.randn(3, 4, dtype=torch.float64))
    with pytest.warns(UserWarning, match="changes its parameters"):
        model(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
    assert model.weight.grad is not None and twobp.pending().jobs == 0


class _BuildsItsHead(nn.Module):
    """A module for the recompute rule that builds its head from its input's size, in one of the
    ways models do: where it has none, under a private flag, in place of a placeholder, one per
    size met, or before a tensor hook (which the trial, run without a graph, cannot register) with a
    cache made from its weight."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, dtype=torch.float64))
        self.how = how
        self._built = False
        self._cache: Tensor | None = None
        if how == "placeholder":
            self.head = nn.Identity()
        if how == "per-size":
            self.heads = nn.ModuleDict()

    def forward(self, x: Tensor) -> Tensor:
        width = x.shape[-1]
        if self.how == "per-size":
            if str(width) not in self.heads:
                self.heads[str(width)] = nn.Linear(width, 4, dtype=torch.float64)
            return self.heads[str(width)](torch.tanh(x * self.weight[:width]))
        if self.how == "placeholder" and isinstance(self.head, nn.Identity):
            self.head = nn.Linear(width, 4, dtype=torch.float64)
        if self.how == "private-flag" and not self._built:
            self.head, self._built = nn.Linear(width, 4, dtype=torch.float64), True
        if self.how in ("missing", "before-a-hook") and not hasattr(self, "head"):
            self.head = nn.Linear(width, 4, dtype=torch.float64)
        h = torch.tanh(x * self.weight)
        if self.how == "before-a-hook":
            if self._cache is None:
                self._cache = self.weight * 2
            h.register_hook(lambda g: g)
            h = h * self._cache
        return self.head(h)


@pytest.mark.parametrize("how", ["missing", "private-flag", "placeholder", "per-size", "before-a-hook"])
def test_a_recompute_forward_that_builds_parts_of_itself_trains_and_draws_as_plain(how: str):
    """The first call's trial built the head (drawing its initial weights), and the rewind after it
    put the generator back before those draws: the forward drew nothing after, and the dropout after
    it drew another mask than plain's (every output and gradient off); a head under a private flag
    was dropped with its flag kept (AttributeError), a placeholder's replacement and a later size's
    head were kept with their draws rewound, and a trial failing on a hook kept the head and a
    cache made from the stand-in, which requires no grad (the weight's gradient 52% off)."""
    twobp.register(_BuildsItsHead, twobp.ops.recompute)
    torch.manual_seed(0)
    model = nn.Sequential(_BuildsItsHead(how), nn.Dropout(0.5))
    patched, reference = patched_and_reference(model)
    # One call before a hook: plain's second backward would go through the cache's freed graph.
    widths = {"per-size": [4, 4, 3, 3], "before-a-hook": [4]}.get(how, [4, 4, 4])
    outputs, generators = [], []
    for net in (patched, reference):
        torch.manual_seed(1)
        outputs.append([])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # per-size and before-a-hook: plain autograd, warned
            for i, width in enumerate(widths):
                if i and width != widths[i - 1]:
                    twobp.flush_weight_grads()  # a head added while work is queued: the flush refuses
                y = net(torch.randn(3, width, dtype=torch.float64))
                outputs[-1].append(y.detach())
                y.pow(2).sum().backward()
        generators.append(torch.get_rng_state())
    twobp.flush_weight_grads()
    torch.testing.assert_close(outputs[0], outputs[1])
    assert torch.equal(generators[0], generators[1])
    assert_grads_match(patched, reference, torch.float64)


def test_a_recompute_first_call_that_fails_once_fails_as_plain_and_stays_deferred():
    """A first call that failed once for a reason of its own (its trial failed, with its call count
    kept, and the forward run again passed): the error never reached the user, and the module was
    sent to plain autograd with a warning that blamed a tensor hook."""

    class FailsOnce(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4))
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            if self.calls == 1:
                raise ValueError("the loader's first batch was not ready")
            return torch.tanh(x * self.weight)

    twobp.register(FailsOnce, twobp.ops.recompute)
    model = twobp.patch(FailsOnce())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="the loader's first batch was not ready"):
            model(torch.randn(3, 4))
        model(torch.randn(3, 4)).sum().backward()
    assert twobp.pending().jobs == 1
    twobp.flush_weight_grads()


def test_a_recompute_forward_that_needs_a_graph_is_named_with_its_trials_error(monkeypatch):
    monkeypatch.setattr(warn_once, "given", set())
    twobp.register(_HooksAnIntermediate, twobp.ops.recompute)
    model = twobp.patch(_HooksAnIntermediate())
    with pytest.warns(UserWarning, match="the trial raised RuntimeError: cannot register a hook"):
        model(torch.randn(3, 6)).sum().backward()


class _ActNorm(nn.Module):
    """Glow's ActNorm, for the recompute rule: its first batch sets its parameters (under a flag,
    private or public) so that the outputs start normalised."""

    def __init__(self, private: bool) -> None:
        super().__init__()
        self.loc = nn.Parameter(torch.zeros(4, dtype=torch.float64))
        self.logs = nn.Parameter(torch.zeros(4, dtype=torch.float64))
        self.private = private
        self._initialized = self.initialized = False

    def forward(self, x: Tensor) -> Tensor:
        if not (self._initialized if self.private else self.initialized):
            with torch.no_grad():
                self.loc.copy_(-x.mean(0))
                self.logs.copy_(-torch.log(x.std(0) + 1e-6))
            self._initialized = self.initialized = True
        return (x + self.loc) * torch.exp(self.logs)


@pytest.mark.parametrize("private", [True, False], ids=["private-flag", "public-flag"])
def test_a_recompute_forward_initialising_its_parameters_from_the_first_batch_trains_as_plain(private: bool):
    """The first call's trial initialised the parameters (through the stand-ins, which share their
    memory) and set the private flag; the rewind put the parameters back but not the flag, so the
    call itself skipped the initialisation: never initialised, gradients 168 off."""
    twobp.register(_ActNorm, twobp.ops.recompute)
    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(4, 4).double(), _ActNorm(private)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # it keeps plain autograd, warned
        for _ in range(3):
            x = torch.randn(8, 4, dtype=torch.float64) * 3 + 1
            for net in (patched, reference):
                net(x).pow(2).sum().backward()
            twobp.flush_weight_grads()
            assert_grads_match(patched, reference, torch.float64)
            for p, q in zip(patched.parameters(), reference.parameters(), strict=True):
                torch.testing.assert_close(p, q)


def test_a_recompute_forward_initialising_under_a_flag_it_cannot_put_back_is_refused():
    """The flag in a dict: the trial set it, the rewind put the parameters back but not the dict,
    and the call skipped the initialisation (never initialised, gradients 5.0 off on 7.1)."""

    class ActNormFlaggedInADict(_ActNorm):
        def __init__(self) -> None:
            super().__init__(private=True)
            self.status = {"initialized": False}

        def forward(self, x: Tensor) -> Tensor:
            self._initialized = self.status["initialized"]
            self.status["initialized"] = True
            return super().forward(x)

    twobp.register(ActNormFlaggedInADict, twobp.ops.recompute)
    model = twobp.patch(ActNormFlaggedInADict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="twobp: ActNormFlaggedInADict's first call changed its parameters"):
            model(torch.randn(8, 4, dtype=torch.float64))


class _ProjectsThenNormalises(nn.Module):
    """Hugging Face Levit's attention projections: a Linear, then a BatchNorm1d over its tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(12, 20, bias=False)
        self.batch_norm = nn.BatchNorm1d(20)

    def forward(self, x: Tensor) -> Tensor:
        h = self.linear(x)
        return self.batch_norm(h.flatten(0, 1)).reshape_as(h)


def test_a_recompute_forward_changing_its_buffers_on_a_strided_input_keeps_plain_autograd():
    """The trial and the run again on plain autograd compute the inner Linear apart (a strided
    3-D input as it is, and as 2-D rows): the running mean they leave differed by 4e-18, taken
    for an initialisation the run again skipped, and the call was refused."""
    twobp.register(_ProjectsThenNormalises, twobp.ops.recompute)
    patched, reference = patched_and_reference(_ProjectsThenNormalises().double())
    with pytest.warns(UserWarning, match="_ProjectsThenNormalises.*changes the module's buffers"):
        for _ in range(2):
            x = torch.randn(2, 12, 9, dtype=torch.float64).transpose(1, 2)  # conv features as tokens
            for model in (patched, reference):
                model(x).pow(2).sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)
    torch.testing.assert_close(patched.batch_norm.running_mean, reference.batch_norm.running_mean)


def test_a_recompute_forward_updating_a_small_buffer_entry_under_a_flag_it_cannot_put_back_is_refused():
    """The check that a call run again on plain autograd changed the buffers as the trial did is up
    to rounding; its tolerance was a share of the buffer's largest entry (1e-4), so an update of
    small entries beside a large one passed as rounding, and the module went on un-updated."""

    class CentredByACadenceInADict(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4, dtype=torch.float64))
            self.register_buffer("running_mean", torch.tensor([1000.0, 0.0, 0.0, 0.0], dtype=torch.float64))
            self.status = {"step": 0}

        def forward(self, x: Tensor) -> Tensor:
            if self.status["step"] % 2 == 0:
                with torch.no_grad():
                    self.running_mean.mul_(0.9).add_(0.1 * x.mean(0))
            self.status["step"] += 1
            return (x - self.running_mean) * self.weight

    twobp.register(CentredByACadenceInADict, twobp.ops.recompute)
    model = twobp.patch(CentredByACadenceInADict())
    x = torch.randn(8, 4, dtype=torch.float64) + torch.tensor([1000.0, 0.5, 0.5, 0.5], dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="twobp: CentredByACadenceInADict's first call changed its"):
            model(x)


class _HooksItsTrunkAndBuildsAHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(4, 4, dtype=torch.float64)
        self.head: nn.Module | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.head is None:
            self.head = nn.Linear(4, 2, dtype=torch.float64)
            self.trunk.register_forward_hook(lambda module, args, output: output * 2)
        return self.head(self.trunk(x))


def test_a_recompute_first_call_building_a_head_and_hooking_registers_the_hook_once():
    """Undoing what the trial built put the flag back but kept the hook it registered (hooks live in
    a dict changed in place): the call registered it again, and the trunk's output was doubled
    twice (gradients 154 off)."""
    twobp.register(_HooksItsTrunkAndBuildsAHead, twobp.ops.recompute)
    torch.manual_seed(0)
    patched, reference = patched_and_reference(_HooksItsTrunkAndBuildsAHead())
    for net in (patched, reference):
        torch.manual_seed(1)
        net(torch.ones(3, 4, dtype=torch.float64)).pow(2).sum().backward()
    twobp.flush_weight_grads()
    assert len(patched.trunk._forward_hooks) == len(reference.trunk._forward_hooks) == 1
    assert_grads_match(patched, reference, torch.float64)


class _Shifted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, dtype=torch.float64))
        self.register_buffer("shift", torch.zeros(4, dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight + self.shift


def test_a_recompute_module_with_a_buffer_made_under_inference_mode_trains_as_plain(monkeypatch):
    """A buffer refreshed under inference_mode (a serving path): the rule read its version
    counter, and plain's training step failed with PyTorch's 'Inference tensors do not track
    version counter'."""
    monkeypatch.setattr(warn_once, "given", set())
    twobp.register(_Shifted, twobp.ops.recompute)
    model = twobp.patch(_Shifted())
    with torch.inference_mode():
        model.shift = torch.full((4,), 0.5, dtype=torch.float64)
    x = torch.randn(3, 4, dtype=torch.float64)
    with pytest.warns(UserWarning, match="made under torch.inference_mode"):
        model(x).pow(2).sum().backward()
    torch.testing.assert_close(model.weight.grad, (2 * (x * model.weight + 0.5) * x).sum(0).detach())


class _TableInReentrantBlock(nn.Module):
    """A (T, D) table used inside a reentrant-checkpointed block and added to a patched layer's
    output after it: at one sample the outer backward gives the table a view of that output
    gradient as .grad, and the block's nested backward accumulates into it in place."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.positions = nn.Parameter(torch.randn(3, 4))

    def block(self, x: Tensor) -> Tensor:
        return torch.tanh(self.a(x + self.positions.unsqueeze(0)))

    def forward(self, x: Tensor) -> Tensor:
        hidden = torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=True)
        return self.b(hidden) + self.positions.unsqueeze(0)


def test_an_output_gradient_a_nested_backward_accumulates_into_is_copied_before():
    patched, reference = patched_and_reference(_TableInReentrantBlock().double())
    for _ in range(2):
        x = torch.randn(1, 3, 4, dtype=torch.float64, requires_grad=True)
        for model in (patched, reference):
            model(x).pow(3).sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)


class _TwoHeads(nn.Module):
    """Every patched op family whose output can get no gradient at all: heads side by side."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.conv = nn.Conv1d(3, 3, 1)
        self.norm = nn.LayerNorm(3)
        self.batch_norm = nn.BatchNorm1d(3)
        self.embedding = nn.Embedding(5, 3)

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        ids = torch.arange(x.shape[0]) % 5
        conv = self.conv(x.unsqueeze(-1)).squeeze(-1)
        return self.linear(x), conv, self.norm(x), self.batch_norm(x), self.embedding(ids)


class _FirstOnly(torch.autograd.Function):
    """Gives its other inputs no gradient, as many custom Functions do."""

    @staticmethod
    def forward(ctx, first: Tensor, *others: Tensor) -> Tensor:
        ctx.others = len(others)
        return first * 2

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        return (grad * 2, *(None,) * ctx.others)


@pytest.mark.parametrize("how", ["full-backward-hook", "function-returning-none"])
def test_a_layer_whose_output_gets_no_gradient_leaves_its_grads_none(how: str) -> None:
    """The Functions materialised a missing output gradient as zeros and queued zero weight
    gradients: .grad zeros where plain leaves None, and AdamW's weight decay then moved the
    parameters plain leaves alone (5e-3 after one step)."""
    model = _TwoHeads().double()
    if how == "full-backward-hook":
        model.register_full_backward_hook(lambda module, grad_input, grad_output: None)
    patched, reference = patched_and_reference(model)
    for _ in range(2):
        x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
        for net in (patched, reference):
            outputs = net(x)
            (outputs[0] if how == "full-backward-hook" else _FirstOnly.apply(*outputs)).pow(2).sum().backward()
    twobp.flush_weight_grads()
    assert reference.conv.weight.grad is None  # the case: plain leaves the other heads untouched
    assert_grads_match(patched, reference, torch.float64)


@pytest.mark.parametrize("kwargs", [dict(kdim=3, vdim=5), dict(add_bias_kv=True)], ids=["kdim-vdim", "bias-kv"])
def test_zero_grad_before_the_flush_leaves_attention_parameters_backward_never_reached_none(kwargs: dict) -> None:
    """A loss on the attention weights alone never reaches v: dropping the queued work gave its
    parameters zeros where plain leaves None (the attention kernel was not asked which ones it
    fills)."""
    patched, reference = patched_and_reference(nn.MultiheadAttention(4, 2, **kwargs).double())
    q = torch.randn(3, 2, 4, dtype=torch.float64)
    k = torch.randn(3, 2, kwargs.get("kdim", 4), dtype=torch.float64)
    v = torch.randn(3, 2, kwargs.get("vdim", 4), dtype=torch.float64)
    for net in (patched, reference):
        _, weights = net(q, k, v)
        weights.pow(2).sum().backward()
        net.zero_grad(set_to_none=False)
    twobp.flush_weight_grads()
    assert any(p.grad is None for p in reference.parameters())
    assert_grads_match(patched, reference, torch.float64)


class _ScaledPassThrough(torch.autograd.Function):
    """A custom Function as fused kernels are written: autograd materialises a missing gradient
    into zeros before its backward runs."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x * 1

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad


class _ScaleRows(nn.Module):
    def __init__(self, through_a_function: bool, with_indices: bool) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(3))
        self.through_a_function, self.with_indices = through_a_function, with_indices

    def forward(self, x: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        scaled = x * self.scale
        scaled = _ScaledPassThrough.apply(scaled) if self.through_a_function else scaled
        return (scaled, (x > 0).long()) if self.with_indices else scaled  # a router's weights and indices


class _BesideALinear(nn.Module):
    def __init__(self, through_a_function: bool, with_indices: bool) -> None:
        super().__init__()
        self.linear, self.scaled = nn.Linear(3, 3), _ScaleRows(through_a_function, with_indices)

    def forward(self, x: Tensor) -> Tensor:
        scaled = self.scaled(x)
        return _FirstOnly.apply(self.linear(x), scaled[0] if isinstance(scaled, tuple) else scaled)


@pytest.mark.parametrize(
    "through_a_function, with_indices",
    [(False, False), (True, False), (True, True)],
    ids=["plain-ops", "custom-function-inside", "custom-function-inside-beside-integer-indices"],
)
def test_a_recompute_module_whose_output_gets_no_gradient_replays_as_plain_runs_it(
    through_a_function: bool, with_indices: bool
) -> None:
    """Plain runs the module's graph with no gradient: its own nodes give None, but a custom
    Function inside materialises zeros, and its parameter gets a zero .grad (AdamW's weight decay
    then moves it). The recompute rule queued nothing there (None, 1.2e-3 off after one step);
    then missed it beside integer outputs, which never carry a gradient."""
    twobp.register(_ScaleRows, twobp.ops.recompute)
    patched, reference = patched_and_reference(_BesideALinear(through_a_function, with_indices).double())
    for _ in range(2):
        x = torch.randn(4, 3, dtype=torch.float64)
        for net in (patched, reference):
            net(x).pow(2).sum().backward()
    assert twobp.pending().jobs > 0
    twobp.flush_weight_grads()
    assert (reference.scaled.scale.grad is None) is not through_a_function  # the two cases
    assert_grads_match(patched, reference, torch.float64)
