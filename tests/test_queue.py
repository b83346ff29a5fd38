"""The queue: byte accounting, tags, separate queues, and README contract point 5 (misuse
gets a clear error, never a silent wrong step)."""

import contextlib
import copy
import gc
import math
import os
import random
import signal
import sys
import threading
import warnings
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import Tensor, nn

import twobp_autograd as twobp
from tests.utils import assert_grads_match, patched_and_reference
from twobp_autograd import queue as queue_module
from twobp_autograd import warn_once
from twobp_autograd.queue import current_queue, queues_with_work


def test_pending_bytes_are_the_tensors_held():
    layer = twobp.patch(nn.Linear(16, 8))
    x = torch.randn(5, 16)
    layer(x).pow(2).sum().backward()
    layer(torch.randn(5, 16)).pow(2).sum().backward()
    jobs, held = twobp.pending()
    assert jobs == 2
    # Per job: the 5x16 saved rows and the 5x8 output gradient, fp32.
    assert held == 2 * (5 * 16 + 5 * 8) * 4
    held_storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for j in current_queue()._jobs for t in j.tensors()
    }
    assert held == sum(held_storages.values())
    twobp.flush_weight_grads()
    assert twobp.pending() == (0, 0)


def test_tagged_flush_runs_only_those_micro_batches():
    queue = twobp.WeightGradQueue()
    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
    xs = [torch.randn(2, 3) for _ in range(3)]
    with twobp.use_queue(queue):
        for mb, x in enumerate(xs):
            with queue.tagged(mb):
                patched(x).sum().backward()
    assert queue.tags() == [0, 1, 2]
    queue.flush(tags=[1])
    reference(xs[1]).sum().backward()
    assert_grads_match(patched, reference)
    assert queue.tags() == [0, 2]
    queue.flush()
    for x in (xs[0], xs[2]):
        reference(x).sum().backward()
    assert_grads_match(patched, reference)


def test_queue_is_bound_at_forward_time():
    stage0, stage1 = twobp.patch(nn.Linear(3, 3)), twobp.patch(nn.Linear(3, 3))
    q0, q1 = twobp.WeightGradQueue(), twobp.WeightGradQueue()
    with twobp.use_queue(q0):
        h = stage0(torch.randn(2, 3))
    with twobp.use_queue(q1):
        out = stage1(h)
    out.sum().backward()  # backward outside any use_queue block
    assert (len(q0), len(q1), twobp.pending().jobs) == (1, 1, 0)
    q1.flush()
    assert stage1.weight.grad is not None and stage0.weight.grad is None
    q0.flush()
    assert stage0.weight.grad is not None


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3))


def _micro_batches(count: int, rows: int = 4, width: int = 6) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(rows, width, generator=generator) for _ in range(count)]


@pytest.mark.parametrize("worker", ["pool", "exited-thread"])
def test_forward_on_another_thread_is_flushed_by_the_training_thread(worker):
    """A forward run by a worker thread (a pool, a serving thread that has since exited) feeds
    the process-wide default queue: the training thread's flush reaches it, and a step with
    the flush forgotten is refused."""
    from concurrent.futures import ThreadPoolExecutor

    patched, reference = patched_and_reference(_mlp())
    xs = _micro_batches(3)
    if worker == "pool":
        with ThreadPoolExecutor(2) as pool:
            outputs = list(pool.map(patched, xs))
    else:
        outputs = []
        for x in xs:
            thread = threading.Thread(target=lambda x=x: outputs.append(patched(x)))
            thread.start()
            thread.join()
    for out in outputs:
        out.pow(2).sum().backward()
    outputs.clear()
    for x in xs:
        reference(x).pow(2).sum().backward()
    assert twobp.pending().jobs == 3 * 3
    with pytest.raises(RuntimeError, match="flush_weight_grads"):
        torch.optim.SGD(patched.parameters(), lr=0.1).step()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)
    assert not queues_with_work()


def test_backward_on_a_worker_thread_is_flushed_by_the_main_thread():
    patched, reference = patched_and_reference(_mlp())
    xs = _micro_batches(2)
    threads = [threading.Thread(target=lambda x=x: patched(x).pow(2).sum().backward()) for x in xs]
    for thread in threads:
        thread.start()
        thread.join()
    for x in xs:
        reference(x).pow(2).sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


def test_use_queue_is_per_thread():
    """A thread's use_queue block does not capture another thread's forwards."""
    layer = twobp.patch(nn.Linear(3, 3))
    own = twobp.WeightGradQueue()
    entered, done = threading.Event(), threading.Event()

    def other_thread():
        entered.wait(30)
        layer(torch.randn(2, 3)).sum().backward()
        done.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    with twobp.use_queue(own):
        entered.set()
        assert done.wait(30)
    thread.join()
    assert (len(own), twobp.pending().jobs) == (0, 1)
    twobp.discard_weight_grads()


def test_use_queue_is_per_asyncio_task():
    """Two tasks on one thread, each training its model under its own queue and awaiting inside
    the block: each queue gets its own task's work (a thread-wide stack swapped them, and a
    task's clear() then dropped nothing while the other's flush put its work in .grad)."""
    import asyncio

    models = [patched_and_reference(nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))) for _ in range(2)]
    queues = [twobp.WeightGradQueue() for _ in range(2)]
    xs = [[torch.randn(2, 3) for _ in range(2)] for _ in range(2)]

    async def train(k: int) -> None:
        with twobp.use_queue(queues[k]):
            for x in xs[k]:
                await asyncio.sleep(0)  # the other task runs its forward here
                models[k][0](x).sum().backward()

    async def both() -> None:
        await asyncio.gather(train(0), train(1))

    asyncio.run(both())
    for k, ((patched, reference), queue) in enumerate(zip(models, queues, strict=True)):
        assert queue.has_work_for(list(patched.parameters())), k
        assert not queue.has_work_for(list(models[1 - k][0].parameters())), k
        queue.flush()
        for x in xs[k]:
            reference(x).sum().backward()
        assert_grads_match(patched, reference)


@pytest.mark.parametrize("inside_another_block", [False, True], ids=["alone", "inside-a-newer-block-of-its-queue"])
def test_use_queue_blocks_left_out_of_order_are_refused_and_leave_the_stack_clean(inside_another_block):
    """Two generators each yielding inside their use_queue block share their thread's stack:
    one's forwards ran under the other's queue. Left out of order, the exit says so and takes
    only its own block (it restored the stack as at its entry, leaving the other generator's
    queue current for good; and inside a newer block of its queue, took that block for its own)."""
    first, second = twobp.WeightGradQueue(), twobp.WeightGradQueue()

    def loop(queue: twobp.WeightGradQueue):
        with twobp.use_queue(queue):
            yield

    a, b = loop(first), loop(second)
    next(a)
    next(b)
    with twobp.use_queue(first) if inside_another_block else contextlib.nullcontext():
        with pytest.raises(RuntimeError, match="twobp: use_queue blocks were left out of order"):
            next(a, None)
        assert current_queue() is (first if inside_another_block else second)
    assert current_queue() is second
    next(b, None)
    assert current_queue() is queue_module._default_queue


def test_tagged_blocks_left_out_of_order_are_refused_and_leave_the_open_tag():
    """Two generators each yielding inside a tagged block of one queue: the first one's exit,
    out of order, restored the tag as at its entry (none), and after the second's exit the
    queue kept the first's tag for good: later untagged work carried it, and ``flush([None])``
    missed it. Now the exit says so and drops only its own block."""
    queue = twobp.WeightGradQueue()
    layer = twobp.patch(nn.Linear(3, 2))

    def loop(tag: str):
        with queue.tagged(tag):
            yield

    first, second = loop("first"), loop("second")
    next(first)
    next(second)
    with pytest.raises(RuntimeError, match="twobp: queue.tagged blocks were left out of order"):
        next(first, None)
    next(second, None)
    with twobp.use_queue(queue):
        layer(torch.randn(2, 3)).sum().backward()
    assert queue.tags() == [None]
    queue.flush([None])
    assert queue.pending() == (0, 0)


def test_a_queue_dropped_with_work_warns():
    layer = twobp.patch(nn.Linear(3, 3))
    queue = twobp.WeightGradQueue()
    with twobp.use_queue(queue):
        layer(torch.randn(2, 3)).sum().backward()
    with pytest.warns(RuntimeWarning, match="garbage collected before a flush"):
        del queue
        gc.collect()


@pytest.mark.parametrize("optimizer_type", [torch.optim.SGD, torch.optim.LBFGS], ids=["sgd", "lbfgs"])
def test_step_with_a_closure_that_forgets_the_flush_is_refused(optimizer_type):
    model = twobp.patch(_mlp())
    optimizer = optimizer_type(model.parameters(), lr=0.1)
    x = torch.randn(4, 6)

    def closure():
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="inside the closure"):
        optimizer.step(closure)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True)), "the step ran"
    twobp.discard_weight_grads()


@pytest.mark.parametrize("optimizer_type", [torch.optim.SGD, torch.optim.LBFGS], ids=["sgd", "lbfgs"])
@pytest.mark.parametrize("as_keyword", [False, True], ids=["positional", "keyword"])
def test_step_with_a_closure_that_flushes_matches_plain(optimizer_type, as_keyword):
    patched, reference = patched_and_reference(_mlp())
    x = torch.randn(4, 6)
    for net, flush in ((patched, twobp.flush_weight_grads), (reference, lambda: None)):
        optimizer = optimizer_type(net.parameters(), lr=0.1)

        def closure(net=net, optimizer=optimizer, flush=flush):
            optimizer.zero_grad()
            loss = net(x).pow(2).mean()
            loss.backward()
            flush()
            return loss

        for _ in range(2):
            optimizer.step(closure=closure) if as_keyword else optimizer.step(closure)
    for (name, p), q in zip(patched.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def _frozen_mid_step_model(kind: str) -> tuple[nn.Module, torch.Tensor]:
    if kind == "conv-batchnorm":
        model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1))
        return model, torch.randn(2, 2, 6, 6)
    if kind == "embedding":
        return nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 2)), torch.randint(0, 10, (4, 3))
    return _mlp(), torch.randn(4, 6)


@pytest.mark.parametrize("kind", ["mlp", "conv-batchnorm", "embedding"])
@pytest.mark.parametrize("freeze", ["first-layer", "everything"])
@pytest.mark.parametrize("strategy", ["auto", "concat", "loop"])
def test_freezing_parameters_between_backward_and_flush_keeps_their_gradient(kind, freeze, strategy):
    """Plain autograd computed those gradients during backward; the flush delivers them, and
    the parameters stay frozen afterwards."""
    model, x = _frozen_mid_step_model(kind)
    patched, reference = patched_and_reference(model)
    queue = twobp.WeightGradQueue(strategy)
    for _ in range(2):
        with twobp.use_queue(queue):
            patched(x).float().pow(2).mean().backward()
        reference(x).float().pow(2).mean().backward()
    frozen = list(patched.parameters()) if freeze == "everything" else list(patched[0].parameters())
    for p in frozen:
        p.requires_grad_(False)
    queue.flush()
    assert all(not p.requires_grad for p in frozen)
    assert queue.pending() == (0, 0)
    assert_grads_match(patched, reference)


def _relative_error(grad: torch.Tensor, exact: torch.Tensor) -> float:
    return ((grad.double() - exact).abs().max() / exact.abs().max()).item()


_BF16_LAYERS = {
    "linear": (lambda: nn.Linear(64, 64), (8, 64)),
    "conv2d": (lambda: nn.Conv2d(8, 8, 3, padding=1), (2, 8, 6, 6)),
}


@pytest.mark.parametrize("strategy", ["auto", "concat", "loop"])
@pytest.mark.parametrize("micro_batches", [16, 64])
@pytest.mark.parametrize("kind", list(_BF16_LAYERS))
def test_bf16_autocast_gradients_are_accumulated_as_precisely_as_plain(kind, strategy, micro_batches):
    """Plain autograd accumulates each micro-batch's bf16 weight gradient into the fp32 .grad;
    summing them in bf16 first loses a bit per micro-batch (it was ten times plain's error at
    16 micro-batches of 8 on a 64-wide Linear). Both are measured against fp64 on the
    bf16-rounded operands autocast computes with; ours must stay within plain's own error."""
    make_layer, input_shape = _BF16_LAYERS[kind]
    patched, reference = patched_and_reference(make_layer())
    exact = copy.deepcopy(reference).double()
    with torch.no_grad():
        for p in exact.parameters():
            p.copy_(p.to(torch.bfloat16))
    queue = twobp.WeightGradQueue(strategy)
    for _ in range(micro_batches):
        x = torch.randn(input_shape)
        for net in (patched, reference):
            with twobp.use_queue(queue), torch.autocast("cpu", dtype=torch.bfloat16):
                out = net(x)
            out.float().pow(2).sum().backward()
        exact(x.to(torch.bfloat16).double()).pow(2).sum().backward()
    queue.flush()
    for name in ("weight", "bias"):
        ours, plain, fp64 = (getattr(net, name).grad for net in (patched, reference, exact))
        assert ours.dtype == plain.dtype == torch.float32
        ours_error, plain_error = _relative_error(ours, fp64), _relative_error(plain, fp64)
        assert ours_error <= 1.5 * plain_error, f"{name}: {ours_error:.2e} against plain's {plain_error:.2e}"


@pytest.mark.parametrize("autocast_in", ["flush-only", "backward-only"])
@pytest.mark.parametrize("kind", list(_BF16_LAYERS))
def test_the_flush_computes_in_the_autocast_its_backward_ran_in(kind, autocast_in):
    """Plain autograd computes a weight gradient in backward, under whatever autocast backward
    runs in; the flush ran it under its own caller's (a flush inside a bf16 autocast block made
    fp32 gradients 1e4 times less precise than plain's, and the reverse dropped plain's bf16)."""
    make_layer, input_shape = _BF16_LAYERS[kind]
    patched, reference = patched_and_reference(make_layer())
    in_backward = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_in == "backward-only")
    in_flush = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_in == "flush-only")
    x = torch.randn(input_shape)
    for net in (patched, reference):
        out = net(x).pow(2).sum()
        with in_backward:
            out.backward()
    with in_flush:
        twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


@pytest.mark.parametrize("strategy", ["auto", "concat"])
@pytest.mark.parametrize("kind", list(_BF16_LAYERS))
def test_a_forward_region_in_another_autocast_dtype_joins_at_the_flush(kind, strategy):
    """An fp16 AMP step whose forward has a region forced to bf16 (a nested autocast): the
    flush joined that region's bf16 tensors under the backward's fp16 autocast, whose cat
    promotes between its own dtypes only, and failed with a message about dim 0."""
    make_layer, input_shape = _BF16_LAYERS[kind]
    patched, reference = patched_and_reference(make_layer())
    queue = twobp.WeightGradQueue(strategy)
    for _ in range(2):
        x = torch.randn(input_shape)
        for net in (patched, reference):
            with twobp.use_queue(queue), torch.autocast("cpu", dtype=torch.float16):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = net(x)
                out.float().pow(2).sum().backward()
    queue.flush()
    assert_grads_match(patched, reference, dtype=torch.bfloat16)


_BF16_PARAMETER_LAYERS = {
    "embedding": (lambda: nn.Embedding(4, 16), lambda g: torch.randint(0, 4, (64,), generator=g)),
    "layer-norm": (lambda: nn.LayerNorm(32), lambda g: torch.randn(8, 32, generator=g)),
    "linear": (lambda: nn.Linear(32, 8), lambda g: torch.randn(8, 32, generator=g)),
}


@pytest.mark.parametrize("kind", list(_BF16_PARAMETER_LAYERS))
def test_bf16_parameters_joined_micro_batches_are_summed_as_precisely_as_plain(kind):
    """A bf16 layer whose micro-batches one kernel call joins: the CPU kernels of Embedding and
    LayerNorm sum the joined rows in bf16 (relative error 0.42 and 0.041 against plain's 0.011
    and 0.0086 at 32 micro-batches); they now sum in fp32, as Linear's always did."""
    make_layer, make_input = _BF16_PARAMETER_LAYERS[kind]
    base = make_layer()
    exact, plain, patched = copy.deepcopy(base).double(), copy.deepcopy(base).bfloat16(), copy.deepcopy(base).bfloat16()
    twobp.patch(patched)
    queue = twobp.WeightGradQueue("concat")
    generator = torch.Generator().manual_seed(1)
    for _ in range(32):
        x = make_input(generator)
        inputs = {dtype: x.to(dtype) if x.is_floating_point() else x for dtype in (torch.float64, torch.bfloat16)}
        exact(inputs[torch.float64]).pow(2).sum().backward()
        plain(inputs[torch.bfloat16]).float().pow(2).sum().backward()
        with twobp.use_queue(queue):
            patched(inputs[torch.bfloat16]).float().pow(2).sum().backward()
    queue.flush()
    fp64 = exact.weight.grad
    ours_error, plain_error = _relative_error(patched.weight.grad, fp64), _relative_error(plain.weight.grad, fp64)
    assert ours_error <= 1.5 * plain_error, f"{ours_error:.2e} against plain's {plain_error:.2e}"


def test_optimizer_step_with_queued_work_is_refused():
    model = twobp.patch(nn.Linear(3, 2))
    other = nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    with pytest.raises(RuntimeError, match="flush_weight_grads"):
        optimizer.step()
    other(torch.randn(1, 3)).sum().backward()
    torch.optim.SGD(other.parameters(), lr=0.1).step()  # unrelated parameters: allowed
    twobp.flush_weight_grads()
    optimizer.step()


def test_amp_training_loop_with_grad_scaler_and_clipping_matches_plain():
    """backward, flush, unscale, clip, step: the same parameters as plain autograd. A scaler
    step with the flush forgotten is refused (where no gradient exists yet at all, GradScaler
    itself stops first: "No inf checks were recorded")."""
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 2))
    patched, reference = patched_and_reference(model)
    for net, flush in ((patched, twobp.flush_weight_grads), (reference, lambda: None)):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        generator = torch.Generator().manual_seed(0)
        for _ in range(3):
            for _ in range(2):  # two micro-batches per step
                x = torch.randn(4, 6, generator=generator)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = net(x).float().pow(2).mean()
                scaler.scale(loss).backward()
            flush()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
    for (name, p), q in zip(patched.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=2e-2, atol=2e-3, msg=name)  # bf16 autocast

    partly_plain = twobp.patch(nn.Sequential(nn.Linear(6, 8), nn.PReLU(), nn.Linear(8, 2)))  # PReLU: plain
    optimizer = torch.optim.SGD(partly_plain.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(partly_plain(torch.randn(4, 6)).pow(2).mean()).backward()
    with pytest.raises(RuntimeError, match="flush_weight_grads"):
        scaler.step(optimizer)
    twobp.flush_weight_grads()


@pytest.mark.parametrize("what", ["saved-activation", "parameter"])
def test_in_place_change_between_backward_and_flush_is_refused(what):
    model = twobp.patch(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)))
    x = torch.randn(4, 3)
    hidden = model[0](x)
    model[1](hidden).sum().backward()
    with torch.no_grad():
        (hidden if what == "saved-activation" else model[1].weight).mul_(2)
    with pytest.raises(RuntimeError, match="modified in place"):
        twobp.flush_weight_grads()
    assert model[1].weight.grad is None  # refused before anything was accumulated
    assert twobp.pending().jobs == 2  # still queued: a step stays refused until it is dealt with
    with pytest.raises(RuntimeError, match="flush_weight_grads"):
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    current_queue().clear()


@pytest.mark.parametrize("conversion", ["float", "cpu"])
def test_a_conversion_swapping_tensors_between_backward_and_flush_keeps_the_gradients_as_plain(conversion, monkeypatch):
    """Under swap_module_params_on_conversion nn.Module._apply swaps every parameter's tensor and
    carries .grad over to the same Python object: plain keeps its gradients, and so does the
    flush (a check on the swapped tensors refused it)."""
    monkeypatch.setattr(torch.__future__, "_swap_module_params_on_conversion", True)
    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3)))
    x = torch.randn(5, 4)
    for model in (patched, reference):
        model(x).pow(2).sum().backward()
        getattr(model, conversion)()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


def test_flush_while_another_thread_is_in_backward_is_refused():
    model = twobp.patch(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)))
    queue = twobp.WeightGradQueue()
    reached, release = threading.Event(), threading.Event()
    errors = []

    def train():
        with twobp.use_queue(queue):
            hidden = model[0](torch.randn(2, 3))
            out = model[1](hidden)
        hidden.register_hook(lambda g: (reached.set(), release.wait(30), None)[2])
        out.sum().backward()  # blocks in the hook, after model[1] queued its job

    worker = threading.Thread(target=train)
    worker.start()
    assert reached.wait(30)
    try:
        queue.flush()
    except RuntimeError as error:
        errors.append(error)
    finally:
        release.set()
        worker.join()
    assert errors and "still running on another thread" in str(errors[0])
    queue.flush()
    assert model[0].weight.grad is not None and model[1].weight.grad is not None


def test_a_backward_that_raised_and_was_zeroed_does_not_block_another_threads_flush():
    """A tensor hook raised mid-backward (its end-of-task callback never ran); the step was
    dropped with zero_grad. The next step's flush from a worker thread was refused: "a backward
    pass that feeds this queue is still running on another thread"."""
    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
    optimizer = torch.optim.SGD(patched.parameters(), lr=0.1)

    def failing(grad):
        raise ValueError("a hook failed")

    hidden = patched[1](patched[0](torch.randn(5, 3)))
    hidden.register_hook(failing)
    with pytest.raises(ValueError, match="a hook failed"):
        patched[2](hidden).sum().backward()  # patched[2] queued its work first
    optimizer.zero_grad()
    x = torch.randn(5, 3)
    patched(x).sum().backward()
    reference(x).sum().backward()
    errors: list[BaseException] = []

    def flush() -> None:
        try:
            twobp.flush_weight_grads()
        except BaseException as error:
            errors.append(error)

    worker = threading.Thread(target=flush)
    worker.start()
    worker.join()
    assert not errors, errors
    assert_grads_match(patched, reference)


def _raise_in_backward(grad: torch.Tensor) -> None:
    raise ValueError("a hook failed")


def test_a_backward_that_raised_on_another_thread_does_not_block_the_flush():
    """A worker thread's backward raised after a patched layer had queued its work (its
    end-of-task callback never ran) and the worker left. On CUDA every backward runs on
    autograd's device thread, so this is any raised backward there: the trainer's flush was
    refused ("still running on another thread") until a discard. It now runs the queued work,
    as plain autograd leaves the gradients a raised backward had already accumulated."""
    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
    x = torch.randn(5, 3)
    errors: list[BaseException] = []

    def train(model: nn.Module) -> None:
        hidden = model[1](model[0](x))
        hidden.register_hook(_raise_in_backward)  # after model[2]'s backward
        try:
            model[2](hidden).sum().backward()
        except ValueError as error:
            errors.append(error)

    for model in (patched, reference):
        worker = threading.Thread(target=train, args=(model,))
        worker.start()
        worker.join()
    assert len(errors) == 2
    twobp.flush_weight_grads()
    assert patched[2].weight.grad is not None and patched[0].weight.grad is None
    assert_grads_match(patched, reference)


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))],
)
def test_a_flush_from_a_hook_inside_a_nested_backward_runs_on_a_cpu(device: str) -> None:
    """A hook in a reentrant checkpoint's region flushes during the region's inner backward,
    which the outer backward (same thread, its work queued) encloses: the enclosing backward is
    not one "running on another thread". On CUDA it cannot be told apart (README)."""
    from torch.utils.checkpoint import checkpoint

    def flush_hook(grad: torch.Tensor) -> torch.Tensor:
        twobp.flush_weight_grads()
        return grad

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor, hook: bool = False) -> torch.Tensor:
            def region(h: torch.Tensor) -> torch.Tensor:
                h = torch.tanh(h)
                if hook and h.requires_grad:
                    h.register_hook(flush_hook)
                return self.b(h)

            return self.c(torch.relu(checkpoint(region, self.a(x), use_reentrant=True)))

    patched, reference = patched_and_reference(Net().to(device))
    x = torch.randn(5, 3, requires_grad=True, device=device)
    reference(x).sum().backward()
    if device == "cuda":  # autograd's device thread interleaves every caller's backward: refused
        with pytest.raises(RuntimeError, match="flush after the backward instead"):
            patched(x, hook=True).sum().backward()
        twobp.discard_weight_grads()
        return
    patched(x, hook=True).sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


def test_a_discard_while_another_threads_backward_runs_keeps_refusing_the_flush():
    """discard_weight_grads() drops what that backward queued so far; the backward still runs and
    queues more, so a flush must still wait for it (it was let through)."""
    model = twobp.patch(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
    reached, release = threading.Event(), threading.Event()

    def train() -> None:
        hidden = model[1](model[0](torch.randn(5, 3)))
        hidden.register_hook(lambda g: (reached.set(), release.wait(30), None)[2])
        model[2](hidden).sum().backward()  # model[2] queues, the hook blocks, model[0] queues

    worker = threading.Thread(target=train)
    worker.start()
    try:
        assert reached.wait(30)
        twobp.discard_weight_grads()
        with pytest.raises(RuntimeError, match="still running on another thread"):
            twobp.flush_weight_grads()
    finally:
        release.set()
        worker.join()
    twobp.flush_weight_grads()
    assert model[0].weight.grad is not None and model[2].weight.grad is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_backward_that_raised_on_cuda_does_not_block_the_next_flush():
    """On CUDA a backward runs on autograd's device thread, which frees its graph task a moment
    after the caller has seen the exception: the flush right after must not take that backward
    for one still running (many rounds, to meet the race)."""
    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
    patched.cuda(), reference.cuda()
    for _ in range(200):
        x = torch.randn(5, 3, device="cuda")
        for model in (patched, reference):
            hidden = model[1](model[0](x))
            hidden.register_hook(_raise_in_backward)
            with pytest.raises(ValueError, match="a hook failed"):
                model[2](hidden).sum().backward()
        twobp.flush_weight_grads()
        patched(x).sum().backward()
        reference(x).sum().backward()
        twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


class _Release(threading.Event):
    flusher: threading.Thread


def _flush_held_on_another_thread(monkeypatch: pytest.MonkeyPatch) -> _Release:
    """A flush started on another thread, held inside its run of the jobs until the event
    returned is set (its ``flusher`` is the thread)."""
    flushing, release = threading.Event(), _Release()
    run_jobs = queue_module.run_jobs

    def slow_run_jobs(jobs, options, **kwargs):
        if threading.current_thread() is release.flusher:
            flushing.set()
            release.wait(30)
        return run_jobs(jobs, options, **kwargs)

    monkeypatch.setattr(queue_module, "run_jobs", slow_run_jobs)
    release.flusher = threading.Thread(target=twobp.flush_weight_grads)
    release.flusher.start()
    assert flushing.wait(30)
    return release


@pytest.mark.parametrize("action", ["flush", "step", "zero_grad", "clip", "tagged-flush", "clip-with-norm-read"])
def test_work_another_threads_flush_took_counts_until_it_lands(monkeypatch, action):
    """Two threads on the default queue: the first one's flush takes the second's work too.
    While those kernels run, the second thread's own flush, step, zero_grad and clipping wait
    for them, as if the work were still queued (they used to find the queue empty: its flush
    returned at once, and a step skipped the gradients still on their way). Clipping with a
    norm read before (``clip_grads_with_norm_``) is refused instead."""
    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
    x = torch.randn(5, 3)
    with current_queue().tagged("mine"):
        patched(x).pow(2).sum().backward()
    reference(x).pow(2).sum().backward()
    release = _flush_held_on_another_thread(monkeypatch)
    assert twobp.pending().jobs == 0  # taken: the other thread's flush runs it now
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (patched, reference)]
    threading.Timer(0.5, release.set).start()  # this thread is about to wait for that flush
    try:
        if action == "flush":
            twobp.flush_weight_grads()
        elif action == "tagged-flush":
            current_queue().flush(tags=["mine"])
        elif action == "step":
            optimizers[0].step()
        elif action == "clip":
            norm = nn.utils.clip_grad_norm_(patched.parameters(), 0.1)
        elif action == "clip-with-norm-read":
            grads = [p.grad for p in patched.parameters()]
            with pytest.raises(RuntimeError, match="still queued"):
                nn.utils.clip_grads_with_norm_(patched.parameters(), 0.1, torch.tensor(1.0))
            assert not release.is_set() and all(p.grad is g for p, g in zip(patched.parameters(), grads, strict=True))
            return
        else:
            patched.zero_grad()
        assert release.is_set(), f"{action} went on while the other thread's flush ran its work"
        release.flusher.join(30)
        if action in ("flush", "tagged-flush"):
            assert_grads_match(patched, reference)
        elif action == "step":
            optimizers[1].step()
            for p, q in zip(patched.parameters(), reference.parameters(), strict=True):
                torch.testing.assert_close(p, q)
        elif action == "clip":
            torch.testing.assert_close(norm, nn.utils.clip_grad_norm_(reference.parameters(), 0.1))
            assert_grads_match(patched, reference)
        else:
            assert all(p.grad is None for p in patched.parameters())
    finally:
        release.set()
        release.flusher.join(30)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_an_all_reduce_of_a_grad_waits_for_another_threads_flush_of_its_work(monkeypatch, one_rank_group):
    """The all_reduce guard asked only the queued jobs, not those another thread's flush ran: the
    average went through at once over the partial .grad, and the flush then added each rank's own
    micro-batch (2.58 off on two gloo ranks)."""
    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
    for x in (torch.randn(5, 3), torch.randn(5, 3)):
        patched(x).pow(2).sum().backward()
        reference(x).pow(2).sum().backward()
        if patched[0].weight.grad is None:
            twobp.flush_weight_grads()  # the first micro-batch's gradients in .grad, the second's queued
    release = _flush_held_on_another_thread(monkeypatch)
    try:
        threading.Timer(0.5, release.set).start()  # this thread is about to wait for that flush
        torch.distributed.all_reduce(patched[0].weight.grad)
        assert release.is_set(), "the all_reduce went on while the other thread's flush ran its work"
    finally:
        release.set()
        release.flusher.join(30)
    assert_grads_match(patched, reference)


def test_a_running_block_failing_after_its_jobs_ran_does_not_queue_them_again():
    """take() then running(): a block that raised after run_jobs had handed every gradient over
    (a collective timing out after it) put the jobs back, and the retried flush added them twice."""
    from twobp_autograd.flush import run_jobs

    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
    x = torch.randn(5, 3)
    queue = twobp.WeightGradQueue()
    with twobp.use_queue(queue):
        patched(x).pow(2).sum().backward()
    reference(x).pow(2).sum().backward()
    jobs = queue.take()
    with pytest.raises(TimeoutError), queue.running(jobs):
        run_jobs(jobs[:1], queue.flush_options)
        raise TimeoutError("the reduction after the flush timed out")
    assert queue.pending().jobs == len(jobs) - 1  # the job not run goes back
    queue.flush()
    assert_grads_match(patched, reference)


def test_a_capped_queues_bytes_follow_a_saved_storage_resized_before_the_flush():
    """The bytes a job held were taken off under the storage's key as it was then: after a saved
    input was resized in place (the flush refuses it) and the work dropped, pending() read -23880
    bytes with no job, and the cap was off by that much from then on."""
    queue = twobp.WeightGradQueue(max_pending_bytes=10**9)
    layer = twobp.patch(nn.Linear(3, 4))
    x = torch.randn(5, 3)
    with twobp.use_queue(queue):
        layer(x).sum().backward()
    x.resize_(1000, 3)
    with pytest.raises(RuntimeError, match="twobp: a tensor that a queued weight-gradient job needs"):
        queue.flush()
    layer.zero_grad()  # as the refusal advises
    assert queue.pending() == (0, 0)


def test_threads_training_their_own_models_on_the_default_queue_match_plain():
    """Three threads, each training its own model on the shared default queue beside a plain
    copy, with random steps: flush then step, step without a flush (refused while its work is
    queued, allowed once another thread's flush has delivered it), clipping, zero_grad. A flush
    refused while another thread's backward runs is retried. Every gradient, clipping norm and
    parameter must equal the plain copy's; a deadlock fails the test. (Before flights were
    waited for, 60 rounds of this gave about a hundred wrong gradients.)"""
    backward_lock = threading.Lock()
    failures: list[str] = []

    def train(seed: int) -> None:
        rng = random.Random(seed)
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 3)).double()
        reference = copy.deepcopy(model)
        twobp.patch(model)
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, reference)]
        try:
            for _ in range(5):
                for _ in range(rng.randint(1, 3)):
                    x = torch.randn(rng.randint(2, 64), 6, dtype=torch.float64)
                    with backward_lock:  # a flush refuses to run beside a backward feeding its queue
                        model(x).pow(2).mean().backward()
                    reference(x).pow(2).mean().backward()
                action = rng.choice(["flush", "flush", "step-without-flush", "clip", "zero_grad"])
                if action == "zero_grad":
                    for optimizer in optimizers:
                        optimizer.zero_grad()
                    continue
                if action == "step-without-flush":
                    try:
                        optimizers[0].step()
                    except RuntimeError as error:
                        assert "still queued" in str(error)
                    else:
                        optimizers[1].step()
                        for optimizer in optimizers:
                            optimizer.zero_grad()
                        continue
                while True:
                    try:
                        twobp.flush_weight_grads()
                        break
                    except RuntimeError as error:
                        assert "still running on another thread" in str(error)
                if action == "clip":
                    norms = [nn.utils.clip_grad_norm_(m.parameters(), 0.5) for m in (model, reference)]
                    torch.testing.assert_close(norms[0], norms[1])
                assert_grads_match(model, reference, torch.float64)
                for optimizer in optimizers:
                    optimizer.step()
                    optimizer.zero_grad()
            for p, q in zip(model.parameters(), reference.parameters(), strict=True):
                torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12)
        except Exception as error:  # reported by the main thread
            failures.append(f"seed {seed}: {error!r}")

    for round_ in range(20):
        threads = [threading.Thread(target=train, args=(3 * round_ + i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not any(thread.is_alive() for thread in threads), f"round {round_}: a thread hangs"
    assert not failures, failures[:3]


@pytest.mark.parametrize(
    "options, named",
    [
        (dict(strategy="fastest"), "strategy"),
        (dict(max_concat_bytes=-5), "max_concat_bytes"),
        (dict(delivery_bucket_bytes=0), "delivery_bucket_bytes"),
        (dict(weight_grad_streams=2.5), "weight_grad_streams"),
        (dict(max_pending_bytes=-1), "max_pending_bytes"),
        (dict(max_pending_bytes=1.5), "max_pending_bytes"),
    ],
    ids=lambda value: value if isinstance(value, str) else "-".join(map(str, value.values())),
)
def test_bad_queue_options_are_refused_naming_the_option(options, named):
    """-5, 0 and 2.5 were taken as they came (a float number of streams failed in range() at the
    first CUDA flush)."""
    with pytest.raises(ValueError, match=f"twobp: {named} must be"):
        twobp.WeightGradQueue(**options)


def test_byte_counts_may_be_numpy_integers_or_whole_floats():
    """25e6 and numpy's integers (what a config file or argparse gives) were refused for a day."""
    queue = twobp.WeightGradQueue(max_pending_bytes=np.int64(1 << 20), max_concat_bytes=1e9, delivery_bucket_bytes=25e6)
    layer = twobp.patch(nn.Linear(4, 4))
    with twobp.use_queue(queue):
        layer(torch.randn(2, 4)).sum().backward()
    queue.flush()
    assert layer.weight.grad is not None
    with pytest.raises(ValueError, match="twobp: weight_grad_streams must be an int"):
        twobp.WeightGradQueue(weight_grad_streams=2.0)


def test_use_queue_takes_a_queue():
    with pytest.raises(TypeError, match="WeightGradQueue"):
        with twobp.use_queue("queue"):
            pass


@pytest.mark.parametrize(
    "tags, says",
    [("mb0", "take a list of tags"), (b"mb0", "take a list of tags"), (0, "take a list of tags"),
     (torch.tensor([0]), "take a list of tags"), ([["mb0"]], "take a list of hashable tags")],
    ids=["str", "bytes", "int", "a-tensor", "a-list-in-the-list"],
)  # fmt: skip
def test_flush_and_take_refuse_a_single_tag_not_in_a_list(tags, says):
    """flush("mb0") flushed the tags 'm', 'b' and '0': nothing; a clear() after it then dropped
    that micro-batch's work, every .grad left None. flush(0) failed in set(), flush([["mb0"]]) too
    (unhashable); a tensor's elements, hashed by identity, matched no tag, and nothing was said."""
    queue = twobp.WeightGradQueue()
    layer = twobp.patch(nn.Linear(4, 4))
    with twobp.use_queue(queue), queue.tagged("mb0"):
        layer(torch.randn(2, 4)).sum().backward()
    for method in (queue.flush, queue.take):
        with pytest.raises(TypeError, match=rf"twobp: flush\(tags=...\) and take\(tags=...\) {says}"):
            method(tags)
    assert len(queue) == 1
    queue.flush(["mb0"])
    assert layer.weight.grad is not None and len(queue) == 0


def test_byte_accounting_follows_tags_shared_tensors_and_clear():
    queue = twobp.WeightGradQueue()
    model = twobp.patch(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)))
    x = torch.randn(3, 8)
    with twobp.use_queue(queue):
        for mb in range(2):
            with queue.tagged(mb):
                model(x).pow(2).sum().backward()
    block = 3 * 8 * 4  # one 3x8 fp32 tensor
    # Both micro-batches' model[0] jobs save views of the same x: one storage, counted once.
    # Per micro-batch: model[1]'s input, and each layer's output gradient.
    assert queue.pending() == (4, block + 2 * 3 * block)
    queue.flush(tags=[0])
    assert queue.pending() == (2, block + 3 * block)
    queue.clear()
    assert queue.pending() == (0, 0)


def test_max_pending_bytes_bounds_memory_and_keeps_gradients_exact():
    per_micro_batch = 4 * (4 * 16 + 4 * 16) * 4  # 4 linear layers, input rows + output grads, fp32
    queue = twobp.WeightGradQueue(max_pending_bytes=2 * per_micro_batch)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    patched, reference = patched_and_reference(model)
    peak = 0
    with twobp.use_queue(queue):
        for _ in range(6):
            x = torch.randn(4, 16)
            patched(x).pow(2).sum().backward()
            reference(x).pow(2).sum().backward()
            peak = max(peak, queue.pending().bytes)
            assert queue.pending().bytes <= queue.max_pending_bytes
    assert peak > per_micro_batch  # it did hold work, it was not flushing everything at once
    assert patched[0].weight.grad is not None  # the oldest work was flushed early
    queue.flush()
    assert_grads_match(patched, reference)
    with pytest.raises(ValueError, match="max_pending_bytes"):
        twobp.WeightGradQueue(max_pending_bytes=-1)


def _ignore(param: torch.Tensor) -> None:
    pass


@pytest.mark.parametrize("marked", [False, True], ids=["optimizer-in-backward-hook", "partial-gradients-hook"])
def test_a_capped_queue_keeps_the_work_of_parameters_whose_hook_wants_the_whole_gradient(marked, monkeypatch):
    """Work for a parameter with a post-accumulate-grad hook stays queued past the cap (one
    warning), for the flush the caller runs; a hook marked ``takes_partial_gradients`` (the
    data-parallel synchroniser's) lets it be flushed early like the rest."""
    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)))
    monkeypatch.setattr(warn_once, "given", set())  # it warns once per process
    hook = queue_module.takes_partial_gradients(_ignore) if marked else _ignore
    patched[0].weight.register_post_accumulate_grad_hook(hook)
    queue = twobp.WeightGradQueue(max_pending_bytes=1)
    with twobp.use_queue(queue), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            x = torch.randn(4, 16)
            patched(x).pow(2).sum().backward()
            reference(x).pow(2).sum().backward()
    kept_warning = [w for w in caught if "capped WeightGradQueue holds more" in str(w.message)]
    if marked:
        assert len(queue) == 0 and not kept_warning
    else:
        assert len(queue) == 3 and len(kept_warning) >= 1  # layer 0's three jobs
        assert patched[0].weight.grad is None and patched[1].weight.grad is not None
    queue.flush()
    assert_grads_match(patched, reference)


def test_cap_enforced_after_a_block_lets_work_pass_the_cap_until_it_ends():
    per_micro_batch = 2 * (4 * 16 + 4 * 16) * 4  # 2 linear layers, input rows + output grads, fp32
    queue = twobp.WeightGradQueue(max_pending_bytes=per_micro_batch)
    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)))
    with twobp.use_queue(queue):
        for _ in range(3):
            x = torch.randn(4, 16)
            with queue.cap_enforced_after():
                patched(x).pow(2).sum().backward()
                with queue.cap_enforced_after():  # nested: only the outer end flushes
                    patched(x).pow(2).sum().backward()
                assert queue.pending().bytes > queue.max_pending_bytes
            assert queue.pending().bytes <= queue.max_pending_bytes
            for _ in range(2):
                reference(x).pow(2).sum().backward()
        assert patched[0].weight.grad is not None  # the oldest work was flushed early
        queue.flush()
        assert_grads_match(patched, reference)

        with pytest.raises(RuntimeError, match="boom"):
            with queue.cap_enforced_after():
                for _ in range(2):
                    patched(torch.randn(4, 16)).pow(2).sum().backward()
                raise RuntimeError("boom")
    assert queue.pending().bytes > queue.max_pending_bytes  # an error leaves the work as it is
    queue.clear()


def test_flush_hands_large_gradients_over_without_copying_them():
    """An empty .grad takes a large flushed tensor as it is: no parameter-sized copy per step.
    Small ones are copied by the engine (cheaper than the hand-over node's Python)."""
    from torch.profiler import profile

    from twobp_autograd.flush import _COPY_BYTES

    model = twobp.patch(nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 1024)))
    assert model[1].weight.numel() * 4 > _COPY_BYTES >= model[0].weight.numel() * 4
    model(torch.randn(4, 32)).pow(2).sum().backward()  # (.sum() alone sends an expanded gradient)
    with profile(record_shapes=True) as prof:
        twobp.flush_weight_grads()
    copied = [e.input_shapes[0] for e in prof.events() if e.name in ("aten::copy_", "aten::clone")]
    assert all(math.prod(shape) * 4 <= _COPY_BYTES for shape in copied), copied
    assert model[0].weight.grad is not None and model[1].weight.grad is not None


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))],
)
@pytest.mark.parametrize("hook_raises", [False, True], ids=["hooks-return", "a-hook-raises"])
def test_a_flush_delivers_on_its_own_thread_and_leaves_autograd_threading_as_it_was(device, hook_raises):
    """The hand-over runs autograd's engine with multithreading off (on CUDA it would wake the
    device thread and sleep on it), so accumulator hooks run on the flushing thread; the
    thread-local setting is restored, also when a hook raises."""
    model = twobp.patch(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).to(device))
    threads = []

    def record(param):
        threads.append(threading.get_ident())
        if hook_raises and param.grad is not None:
            raise RuntimeError("hook failed")

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(record)
    model(torch.randn(3, 4, device=device)).sum().backward()
    threads.clear()
    if hook_raises:
        with pytest.raises(RuntimeError, match="hook failed"):
            twobp.flush_weight_grads()
        twobp.discard_weight_grads()
    else:
        twobp.flush_weight_grads()
        assert len(threads) == 4
    assert set(threads) == {threading.get_ident()}
    assert torch._C._is_multithreading_enabled()


_MOVES = [
    pytest.param(a, b, id=f"{a}-to-{b}", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))
    for a, b in (("cpu", "cuda"), ("cuda", "cpu"))
]


@pytest.mark.parametrize("strategy", ["concat", "loop"])
@pytest.mark.parametrize(("source", "target"), _MOVES)
def test_a_model_moved_to_another_device_before_the_flush_is_refused_keeping_its_work(source, target, strategy):
    """The queued work's tensors stay where backward made them; run there, each kernel handed
    gradients on the old device to parameters on the new one (or failed inside on mixed
    devices, with a message about kernels and shapes). Refused, naming the move; moved back,
    the flush gives plain's gradients."""
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(64, 8), nn.LayerNorm(8), nn.Linear(8, 2)
    ).double()
    patched, reference = patched_and_reference(model.to(source))
    queue = twobp.WeightGradQueue(strategy=strategy)
    for _ in range(2):
        x = torch.randn(3, 3, 6, 6, dtype=torch.float64, device=source)
        with twobp.use_queue(queue):
            patched(x).pow(2).sum().backward()
        reference(x).pow(2).sum().backward()
    jobs = queue.pending().jobs
    patched.to(target)
    with pytest.raises(RuntimeError, match=r"twobp: .*the model was moved .* between backward and flush"):
        queue.flush()
    assert queue.pending().jobs == jobs
    patched.to(source)
    queue.flush()
    assert_grads_match(patched, reference, torch.float64)


@pytest.mark.parametrize("bucket_bytes", [None, 1], ids=["at-the-end", "per-layer"])
def test_delivery_buckets_hand_gradients_over_while_the_flush_runs(bucket_bytes):
    queue = twobp.WeightGradQueue(delivery_bucket_bytes=bucket_bytes)
    patched, reference = patched_and_reference(
        nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 2))
    )
    deliveries = []

    def record(param):
        if param.grad is not None:
            deliveries.append(torch._C._current_graph_task_id())

    for p in patched.parameters():
        p.register_post_accumulate_grad_hook(record)
    x = torch.randn(3, 4)
    with twobp.use_queue(queue):
        patched(x).pow(2).sum().backward()
    reference(x).pow(2).sum().backward()
    deliveries.clear()  # backward-p1 calls the hooks with no gradient yet
    queue.flush()
    assert len(deliveries) == 6
    assert len(set(deliveries)) == (1 if bucket_bytes is None else 3)  # one handover per layer
    assert_grads_match(patched, reference)


class _TableThroughALayer(nn.Module):
    """An embedding whose table also goes through a patched Linear (``proj(emb.weight)``): the
    Linear's deferred work reads the table's memory."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.proj = nn.Embedding(10, 8), nn.Linear(8, 8)

    def forward(self, tokens: Tensor) -> Tensor:
        table = self.proj(self.emb.weight)
        return self.emb(tokens) @ table.t()  # the lookup's work queued first, the Linear's after


def test_a_bucket_hands_a_parameter_over_after_the_groups_reading_its_memory():
    """With delivery buckets, the table's gradient was handed over before the Linear's group ran,
    and its optimizer-in-backward hook stepped the table in place: the Linear's weight gradient was
    made from the stepped table (6474 off on a scale of 436). Plain's backward ran the Linear before
    the table's accumulation."""
    torch.manual_seed(0)
    patched, reference = patched_and_reference(_TableThroughALayer().double())
    for net in (patched, reference):
        for p in net.parameters():
            optimizer = torch.optim.SGD([p], lr=0.5)

            def step(p: Tensor, optimizer: torch.optim.Optimizer = optimizer) -> None:
                if not twobp.has_queued_work(p):
                    optimizer.step()
                    optimizer.zero_grad()

            p.register_post_accumulate_grad_hook(step)
    tokens = torch.randint(0, 10, (3, 5))
    queue = twobp.WeightGradQueue(delivery_bucket_bytes=1)
    with twobp.use_queue(queue):
        patched(tokens).square().sum().backward()
    queue.flush()
    reference(tokens).square().sum().backward()
    for p, q in zip(patched.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def _sparse_rows(rows: int, layout: str) -> Tensor:
    dense = torch.randn(rows, 5, dtype=torch.float64)
    dense[dense.abs() < 0.8] = 0
    return {"csr": dense.to_sparse_csr(), "coo": dense.to_sparse(), "dense": dense}[layout]


@pytest.mark.parametrize("layouts", [("csr", "csr"), ("coo", "dense"), ("csr", "dense")], ids="+".join)
def test_a_linear_on_sparse_inputs_flushes_as_plain_when_micro_batches_are_joined(layouts):
    """Joined on dim 0 (concat, and on a GPU the default), sparse rows failed torch.cat at the
    flush, with an error asking for a rule's concatenate=False the user never wrote."""
    torch.manual_seed(0)
    patched, reference = patched_and_reference(nn.Linear(5, 3).double())
    queue = twobp.WeightGradQueue("concat")
    for rows, layout in zip((4, 3), layouts, strict=True):
        x = _sparse_rows(rows, layout)
        reference(x).square().sum().backward()
        with twobp.use_queue(queue):
            patched(x).square().sum().backward()
    queue.flush()
    assert_grads_match(patched, reference, torch.float64)


def test_discarding_the_empty_current_queue_while_another_holds_work_is_refused():
    """The forwards ran under use_queue(queue), the discard went to the (empty) current queue:
    the micro-batch meant to be dropped reached .grad at the next flush (6.1 off). Refused."""
    layer = twobp.patch(nn.Linear(3, 3))
    queue = twobp.WeightGradQueue()
    with twobp.use_queue(queue):
        layer(torch.randn(2, 3)).sum().backward()
    with pytest.raises(RuntimeError, match=r"twobp: discard_weight_grads\(\) with the current queue empty.*\(queue\)"):
        twobp.discard_weight_grads()
    assert queue.pending().jobs == 1
    twobp.discard_weight_grads(queue)
    assert queue.pending().jobs == 0


def test_flushing_the_empty_current_queue_while_another_holds_work_says_so(monkeypatch):
    """The forwards ran under use_queue(queue), the flush went to the (empty) current queue and
    did nothing without a word: a read of .grad before the step saw none of the work."""
    monkeypatch.setattr(warn_once, "given", set())
    layer = twobp.patch(nn.Linear(3, 3))
    queue = twobp.WeightGradQueue()
    with twobp.use_queue(queue):
        layer(torch.randn(2, 3)).sum().backward()
    said = r"twobp: flush_weight_grads\(\) with the current queue empty.*nothing was flushed"
    with pytest.warns(UserWarning, match=said):
        twobp.flush_weight_grads()
    assert queue.pending().jobs == 1 and layer.weight.grad is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # inside the block the queue is the one meant
        with twobp.use_queue(twobp.WeightGradQueue()):
            twobp.flush_weight_grads()
    twobp.flush_weight_grads(queue)
    assert layer.weight.grad is not None


def test_a_discard_inside_use_queue_acts_on_that_queue_whatever_other_threads_hold():
    """A thread training under its own queue (as README advises for threads) discarded its empty
    queue and was refused whenever another thread's queue held work at that moment."""
    other_thread_queue, own = twobp.WeightGradQueue(), twobp.WeightGradQueue()
    layer = twobp.patch(nn.Linear(3, 3))
    with twobp.use_queue(other_thread_queue):
        layer(torch.randn(2, 3)).sum().backward()
    with twobp.use_queue(own):
        twobp.discard_weight_grads()
    assert other_thread_queue.pending().jobs == 1
    other_thread_queue.clear()


@pytest.mark.parametrize("function", ["flush_weight_grads", "discard_weight_grads", "pending"])
def test_the_module_functions_refuse_a_model_for_the_queue(function):
    """flush_weight_grads(model), as patch(model) reads, failed in nn.Module's __getattr__."""
    model = twobp.patch(nn.Linear(3, 3))
    with pytest.raises(TypeError, match=rf"twobp: {function}\(queue\) takes a WeightGradQueue.*not Linear"):
        getattr(twobp, function)(model)


@pytest.mark.parametrize("cap", [None, 0], ids=["uncapped", "capped"])
def test_an_unhashable_tag_is_refused_where_it_is_given_and_loses_no_work(cap):
    """tagged([stage, micro_batch]) failed later: at the flush, or in a capped queue's early flush
    inside backward, after it had taken the jobs off the queue (lost)."""
    queue = twobp.WeightGradQueue(max_pending_bytes=cap)
    layer = twobp.patch(nn.Linear(3, 3))
    with pytest.raises(TypeError, match=r"twobp: a queue's tag must be hashable.*tuple"):
        with queue.tagged([0, 1]):
            pass
    with twobp.use_queue(queue), queue.tagged((0, 1)):
        layer(torch.randn(2, 3)).sum().backward()
    queue.flush()
    assert layer.weight.grad is not None


def test_an_empty_queue_passed_explicitly_is_the_one_used():
    """An empty queue has len() 0; it must still be the queue acted on, not the default one."""
    empty = twobp.WeightGradQueue()
    layer = twobp.patch(nn.Linear(3, 3))
    layer(torch.randn(2, 3)).sum().backward()  # work in the default queue
    assert twobp.pending(empty) == (0, 0)
    twobp.flush_weight_grads(empty)
    assert twobp.pending().jobs == 1 and layer.weight.grad is None
    twobp.discard_weight_grads()
    assert twobp.pending() == (0, 0)


@pytest.mark.parametrize("strategy, joined", [("auto", False), ("concat", True), ("loop", False)])
def test_auto_joins_linear_micro_batches_only_off_the_cpu(strategy, joined):
    """On a CPU the joined GEMM costs what the separate ones cost, plus copies: auto loops."""
    from torch.profiler import profile

    queue = twobp.WeightGradQueue(strategy)
    layer = twobp.patch(nn.Linear(8, 4, bias=False))
    with twobp.use_queue(queue):
        for _ in range(3):
            layer(torch.randn(5, 8)).pow(2).sum().backward()
    with profile() as prof:
        queue.flush()
    names = [e.name for e in prof.events()]
    assert (names.count("aten::mm"), names.count("aten::cat")) == ((1, 2) if joined else (3, 0))  # rows, grads


@pytest.mark.parametrize("strategy", ["auto", "loop"])  # a batch-shaped bias cannot be joined
def test_sums_never_write_into_a_gradient_another_job_still_needs(strategy):
    """A recomputed ``x + bias`` returns the output gradient itself as the bias gradient, and
    autograd hands one gradient tensor to every branch of a sum: adding into it in place would
    change what the next job sees."""
    from twobp_autograd.ops import recompute

    class Shift(nn.Module):
        def __init__(self):
            super().__init__()
            self.bias = nn.Parameter(torch.zeros(4, 3))

        def forward(self, x):
            return x + self.bias

    twobp.register(Shift, recompute)
    patched, reference = patched_and_reference(Shift())
    xs = [torch.randn(4, 3) for _ in range(3)]
    with twobp.use_queue(twobp.WeightGradQueue(strategy)) as queue:
        (patched(xs[0]) + patched(xs[1]) + patched(xs[2])).pow(2).sum().backward()
    (reference(xs[0]) + reference(xs[1]) + reference(xs[2])).pow(2).sum().backward()
    queue.flush()
    assert_grads_match(patched, reference)


class _Interrupt(KeyboardInterrupt):
    """Ctrl-C, as a test raises it (a subclass, so that pytest does not take it for its own)."""


@pytest.mark.parametrize("where", ["in-a-hook", "between-buckets"])
def test_an_interrupt_after_part_of_a_flush_reached_grad_drops_the_rest(where, monkeypatch):
    """Ctrl-C (any BaseException) after some gradients were handed over: the flush's jobs went
    back in the queue, and the retry added the delivered ones twice (exactly 2x plain). It ends
    as PartlyDelivered does: the interrupt goes on, the rest of the work is dropped."""
    from twobp_autograd import flush as flush_module

    queue = twobp.WeightGradQueue(delivery_bucket_bytes=1 if where == "between-buckets" else None)
    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)))
    if where == "in-a-hook":

        def interrupt(param):
            if not twobp.has_queued_work(param):
                raise _Interrupt

        patched[2].weight.register_post_accumulate_grad_hook(interrupt)
    else:
        run_group, calls = flush_module._run_group, []

        def interrupted_second_group(group, options):
            calls.append(group)
            if len(calls) == 2:  # after the first layer's bucket was handed over
                raise _Interrupt
            return run_group(group, options)

        monkeypatch.setattr(flush_module, "_run_group", interrupted_second_group)
    x = torch.randn(8, 4)
    with twobp.use_queue(queue):
        patched(x).square().sum().backward()
    reference(x).square().sum().backward()
    with pytest.raises(_Interrupt) as interrupted:
        queue.flush()
    if sys.version_info >= (3, 11):  # notes on exceptions
        assert "twobp: the flush was interrupted" in "".join(interrupted.value.__notes__)
    assert queue.pending() == (0, 0)
    queue.flush()  # a retry adds nothing
    delivered = 0
    for (name, p), q in zip(patched.named_parameters(), reference.parameters(), strict=True):
        if p.grad is not None:  # each gradient there is whole, none twice
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
            delivered += 1
    assert delivered == (2 if where == "between-buckets" else 4)  # the first bucket; all before the hook


def test_zero_grad_of_part_of_a_layers_parameters_keeps_a_capped_queues_bytes_exact():
    """zero_grad over BatchNorm's weight only (its finished gradients are one job): the dropped
    gradient stayed counted, 256 bytes more each step, until every backward flushed early."""
    model = twobp.patch(nn.Sequential(nn.Linear(4, 64), nn.BatchNorm1d(64), nn.Linear(64, 2)))
    queue = twobp.WeightGradQueue(max_pending_bytes=5_000)
    x = torch.randn(8, 4)
    for _ in range(30):
        with twobp.use_queue(queue):
            model(x).sum().backward()
        assert len(queue) == 3  # no early flush
        torch.optim.SGD([model[1].weight], lr=0.1).zero_grad()
        held = [t.untyped_storage() for job in queue._jobs for t in job.tensors()]
        storages = {storage.data_ptr(): storage.nbytes() for storage in held}
        assert queue.pending().bytes == sum(storages.values())
        queue.flush()
        assert queue.pending() == (0, 0)
        model.zero_grad()


def test_a_backward_that_raised_after_queueing_work_warns_that_a_reused_parameter_differs(monkeypatch):
    """A block called twice: the backward raised between its two uses. Plain autograd's
    accumulator had not run (it runs once every use has reached it), so plain keeps none of that
    backward's gradient for the block; the split had queued the later use's. Without a warning
    a retry without zero_grad silently added it (0.8 off on the block's weight)."""
    monkeypatch.setattr(warn_once, "given", set())
    block, middle = nn.Linear(4, 4), nn.Linear(4, 4)
    patched_modules = twobp.patch(copy.deepcopy(nn.ModuleList([block, middle])))
    x = torch.randn(3, 4)

    def failing_step(modules: nn.ModuleList) -> None:
        hidden = modules[1](torch.tanh(modules[0](x)))
        hidden.register_hook(_raise_in_backward)  # after the second use's backward
        with pytest.raises(ValueError, match="a hook failed"):
            modules[0](torch.tanh(hidden)).sum().backward()

    failing_step(nn.ModuleList([block, middle]))
    assert block.weight.grad is None  # plain: the accumulator never ran
    with pytest.warns(RuntimeWarning, match="a parameter used more than once"):
        failing_step(patched_modules)
    assert twobp.pending().jobs == 1  # the later use's work, which plain does not have
    optimizer = torch.optim.SGD(patched_modules.parameters(), lr=0.1)
    optimizer.zero_grad()  # what the warning says: the queued work goes with the step's gradients
    assert twobp.pending().jobs == 0 and patched_modules[0].weight.grad is None


def test_a_backward_that_raised_before_queueing_work_does_not_warn(monkeypatch):
    monkeypatch.setattr(warn_once, "given", set())
    patched = twobp.patch(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))
    output = patched(torch.randn(5, 3))
    output.register_hook(_raise_in_backward)  # before any patched layer's backward
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="a hook failed"):
            output.sum().backward()
    assert twobp.pending().jobs == 0


def _in_forked_child(train: Callable[[], None]) -> int:
    """``train()`` in a forked child: its exit status (0: done, 1: raised, -SIGALRM: hung past
    20 s; an alarm, not faulthandler's watchdog, whose thread a child forked again lacks)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        signal.alarm(20)
        try:
            train()
            status = 0
        except BaseException:
            status = 1
        os._exit(status)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _trains_like_plain() -> None:
    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3)).double())
    x = torch.randn(5, 4, dtype=torch.float64)
    for model in (patched, reference):
        model(x).pow(2).sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_while_another_thread_holds_the_queue_trains_like_plain() -> None:
    """The child has the forking thread alone: the queue's lock another thread held at the fork
    stayed held there, and the child's first deferred backward hung on it."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with queue_module._default_queue._lock:
            held.set()
            release.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    try:
        assert _in_forked_child(_trains_like_plain) == 0
    finally:
        release.set()
        holder.join()


def _forked_during_another_threads_flush(
    in_child: Callable[[nn.Module], None],
    model: nn.Module | None = None,
    loss: Callable[[nn.Module], Tensor] | None = None,
) -> int:
    """``in_child(model)`` in a child forked while another thread flushes the model's queued work
    (taken out of the queue, its gradients not delivered yet): the child's exit status."""
    model = twobp.patch(model if model is not None else nn.Linear(4, 3).double())
    x = torch.randn(2, 4, dtype=torch.float64)
    (loss(model) if loss is not None else model(x).sum()).backward()
    queue = queue_module._default_queue
    started, release = threading.Event(), threading.Event()

    def flush_slowly() -> None:
        with queue._lock:
            jobs = queue._take_locked(None)
            flight = queue._take_off(jobs)
        started.set()
        release.wait()
        queue._run(jobs, flight)

    flusher = threading.Thread(target=flush_slowly)
    flusher.start()
    started.wait()
    try:
        return _in_forked_child(lambda: in_child(model))
    finally:
        release.set()
        flusher.join()
        assert any(p.grad is not None for p in model.parameters())  # the parent's flush went on


def _refuses_until_zeroed(model: nn.Module) -> None:
    with pytest.raises(RuntimeError, match="forked while another thread of its parent flushed"):
        twobp.flush_weight_grads()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="still queued"):
        optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())  # zeros, as plain's
    _trains_like_plain()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("forks_again", [False, True], ids=["child", "grandchild"])
def test_a_child_forked_during_another_threads_flush_refuses_until_zero_grad(forks_again: bool) -> None:
    """Which of that flush's gradients reached the child's .grad is unknown: its next flush
    refuses (it waited forever for the flush's thread, which the child does not have), and so do
    the optimizer step and clipping (they saw no work and ran on partial gradients), until
    zero_grad zeroes them (zeros with set_to_none=False, as plain's); then it trains like plain.
    A child that forks again passes that on (the grandchild's fork cut nothing of its own)."""

    def in_child(model: nn.Module) -> None:
        if forks_again:
            assert _in_forked_child(lambda: _refuses_until_zeroed(model)) == 0
        else:
            _refuses_until_zeroed(model)

    assert _forked_during_another_threads_flush(in_child) == 0


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(4, dtype=torch.float64))
        self.b = nn.Parameter(torch.randn(4, dtype=torch.float64))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x * self.a, x * self.b


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_discard_in_a_child_cut_mid_flush_then_zero_grad_leaves_zeros_as_plain():
    """discard_weight_grads drops the cut flush too; a zero_grad(set_to_none=False) after it
    leaves zeros where plain's backward gave a gradient (it left None, and a weight-decay step
    skipped the parameters that plain's moved)."""

    def in_child(model: nn.Module) -> None:
        twobp.discard_weight_grads()
        torch.optim.SGD(model.parameters(), lr=0.1).zero_grad(set_to_none=False)
        assert all(p.grad is not None and not p.grad.any() for p in model.parameters())

    assert _forked_during_another_threads_flush(in_child) == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_zero_grad_in_a_child_cut_mid_flush_zeroes_only_what_plain_backward_gave():
    """A kernel that may give a parameter nothing (the recompute rule's, one output unused):
    zero_grad(set_to_none=False) in the child zeroes a, which plain's backward gave a gradient,
    and leaves b None, as plain's (zeroed, a weight decay step moved it)."""
    twobp.register(TwoHeads, twobp.ops.recompute)

    def in_child(model: nn.Module) -> None:
        torch.optim.SGD(model.parameters(), lr=0.1).zero_grad(set_to_none=False)
        assert model.a.grad is not None and not model.a.grad.any() and model.b.grad is None

    x = torch.randn(3, 4, dtype=torch.float64)
    assert _forked_during_another_threads_flush(in_child, TwoHeads(), lambda m: m(x)[0].sum()) == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("child_trains", [False, True], ids=["child-refused", "child-zeroes-and-trains"])
def test_work_for_a_grad_in_shared_memory_is_cut_by_a_fork_on_both_sides(child_trains: bool) -> None:
    """Hogwild-style: ``share_memory()`` after a first backward puts ``.grad`` in memory that
    forked processes share. Work queued at the fork would reach it from each side's flush (the
    parent's flush after a child's doubled it; after a child zeroed and trained, it added the
    parent's gradient to the child's), where plain's backward put it there once, before the fork.
    Both sides refuse it until zero_grad; then they train like plain."""
    model = twobp.patch(nn.Linear(3, 2).double())
    x = torch.ones(4, 3, dtype=torch.float64)
    model(x).sum().backward()
    twobp.flush_weight_grads()
    model.share_memory()
    assert model.weight.grad is not None and model.weight.grad.is_shared()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.zero_grad(set_to_none=False)
    model(x).sum().backward()
    plain_weight_grad = torch.full((2, 3), 4.0, dtype=torch.float64)

    def in_child() -> None:
        with pytest.raises(RuntimeError, match="shared with another process"):
            twobp.flush_weight_grads()
        with pytest.raises(RuntimeError, match="still queued"):
            optimizer.step()
        if child_trains:
            optimizer.zero_grad(set_to_none=False)
            model(2 * x).sum().backward()
            twobp.flush_weight_grads()
            assert torch.equal(model.weight.grad, 2 * plain_weight_grad)

    assert _in_forked_child(in_child) == 0
    with pytest.raises(RuntimeError, match="shared with another process"):
        twobp.flush_weight_grads()
    with pytest.raises(RuntimeError, match="still queued"):
        optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    model(x).sum().backward()
    twobp.flush_weight_grads()
    assert torch.equal(model.weight.grad, plain_weight_grad)


class _LockTakenAfterAnotherThreadsEarlyFlush:
    """The queue's lock, reached after another thread's early flush brought the queue under its
    cap (between the cap check and the lock): simulated by flushing on entering it."""

    def __init__(self, queue: twobp.WeightGradQueue) -> None:
        self.queue, self.lock, self.entered = queue, queue._lock, False

    def __enter__(self) -> object:
        if not self.entered:
            self.entered = True
            self.queue._lock = self.lock
            self.queue.flush()
        return self.lock.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.lock.__exit__(*exc)


def test_a_capped_queue_whose_bytes_another_thread_flushed_meanwhile_stays_quiet():
    """Threads sharing a capped queue: one found it over its cap, another's early flush then
    freed the bytes before the first took the lock, which then flushed nothing and warned that
    the work was kept for post-accumulate-grad hooks (there were none; the warning, once per
    process, was then spent)."""
    model = twobp.patch(_mlp())
    queue = twobp.WeightGradQueue(max_pending_bytes=10**9)
    with twobp.use_queue(queue):
        model(torch.randn(4, 6)).pow(2).sum().backward()
    queue.max_pending_bytes = 1
    queue._lock = _LockTakenAfterAnotherThreadsEarlyFlush(queue)  # type: ignore[assignment]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        queue._enforce_cap()
    assert len(queue) == 0 and all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("cap", [None, 10**6], ids=["uncapped", "capped"])
def test_pending_bytes_count_the_local_tensors_inside_dtensors(one_rank_group: None, cap: int | None):
    """Work held as DTensors (a tensor-parallel plan): every DTensor's data_ptr() is 0, so all of
    them counted as one storage, sized as the global tensor; a capped queue held 88 jobs where the
    cap allowed 21."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    model = twobp.patch(nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 4)))
    parallelize_module(model, init_device_mesh("cpu", (1,)), {"0": ColwiseParallel(), "1": ColwiseParallel()})
    queue = twobp.WeightGradQueue(max_pending_bytes=cap)
    with twobp.use_queue(queue):
        for _ in range(2):
            model(torch.randn(5, 16)).pow(2).sum().backward()
    # Per micro-batch: each layer's saved input rows and output gradient, fp32.
    assert queue.pending() == (4, 2 * (5 * 16 + 5 * 8 + 5 * 8 + 5 * 4) * 4)
    queue.flush()


@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr], ids=["coo", "csr"])
@pytest.mark.parametrize("cap", [None, 1 << 20], ids=["uncapped", "capped"])
def test_a_sparse_input_is_counted_by_its_indices_and_values(layout, cap):
    """A Linear fed sparse features (bag-of-words, a graph's adjacency rows) saves the sparse input
    for its weight gradient: pending() and a capped queue's count read its storage, which a sparse
    tensor has none of (pending() raised; a capped queue's backward raised)."""
    patched, reference = patched_and_reference(nn.Linear(6, 3).double())
    queue = twobp.WeightGradQueue(max_pending_bytes=cap)
    for _ in range(2):
        dense = torch.randn(4, 6, dtype=torch.float64) * (torch.rand(4, 6) < 0.4)
        x = dense.to_sparse(layout=layout)
        with twobp.use_queue(queue):
            patched(x).pow(2).sum().backward()
        reference(x).pow(2).sum().backward()
    assert twobp.pending(queue).jobs == 2 and twobp.pending(queue).bytes > 0
    queue.flush()
    assert_grads_match(patched, reference)


def test_an_mkldnn_input_keeps_plain_autograd(monkeypatch):
    """``to_mkldnn()`` features: the weight kernel's product has no mkldnn kernel, so every flush
    raised and a capped queue's count failed in backward. Such a call keeps plain autograd."""
    monkeypatch.setattr(warn_once, "given", set())  # it warns once per process
    patched, reference = patched_and_reference(nn.Linear(6, 3))
    x = torch.randn(4, 6)
    with pytest.warns(UserWarning, match="mkldnn tensors"):
        patched(x.to_mkldnn()).to_dense().pow(2).sum().backward()
    reference(x.to_mkldnn()).to_dense().pow(2).sum().backward()
    assert twobp.pending().jobs == 0
    assert_grads_match(patched, reference)
