"""Activation checkpointing and saved-tensor hooks around patched modules: selective (SAC) with
the policies people train with, plain non-reentrant and reentrant, nested; save_on_cpu and
custom saved_tensors_hooks. Each run keeps the weight work deferred (jobs queued after every
backward, .grad untouched until the flush) and ends with plain autograd's gradients and
buffers (a deep copy run the same way), parameter by parameter, with no work left queued."""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import twobp_autograd as twobp
from tests.utils import (
    TOLERANCES,
    assert_grads_match,
    assert_no_grads,
    lossy_saved_tensors_hooks,
    patched_and_reference,
)

aten = torch.ops.aten
PRODUCTS = {aten.mm.default, aten.addmm.default, aten.convolution.default}
ATTENTION = {
    getattr(aten, name).default
    for name in (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(aten, name)
}


def save_products(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    """Keep the matmuls' and convolutions' outputs, recompute the cheap rest."""
    return CheckpointPolicy.MUST_SAVE if op in PRODUCTS else CheckpointPolicy.PREFER_RECOMPUTE


def save_nothing(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def save_all_but_attention(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE if op in ATTENTION else CheckpointPolicy.MUST_SAVE


Wrap = Callable[[nn.Module, Tensor], Tensor]


def selective(policy: Callable[..., CheckpointPolicy], allow_cache_entry_mutation: bool = False) -> Wrap:
    context_fn = functools.partial(create_selective_checkpoint_contexts, policy, allow_cache_entry_mutation)
    return functools.partial(_checkpointed, use_reentrant=False, context_fn=context_fn)


def _checkpointed(block: nn.Module, x: Tensor, **options: object) -> Tensor:
    return checkpoint(block, x, **options)  # type: ignore[arg-type]


def _nested(block: nn.Module, x: Tensor) -> Tensor:
    """A checkpoint whose region holds a checkpoint (of each half of the block's children)."""
    children = list(block.children())
    half = len(children) // 2

    def outer(y: Tensor) -> Tensor:
        y = checkpoint(nn.Sequential(*children[:half]), y, use_reentrant=False)
        return checkpoint(nn.Sequential(*children[half:]), y, use_reentrant=False)

    return checkpoint(outer, x, use_reentrant=False)


WRAPS: dict[str, Wrap] = {
    "sac-save-products": selective(save_products),
    "sac-save-nothing": selective(save_nothing),
    # Caching every op needs the cache's mutation check off in plain PyTorch too: RMSNorm's CPU
    # composite adds eps in place to a mean it caches, BatchNorm updates cached buffers.
    "sac-save-all-but-attention": selective(save_all_but_attention, allow_cache_entry_mutation=True),
    "non-reentrant": functools.partial(_checkpointed, use_reentrant=False),
    "reentrant": functools.partial(_checkpointed, use_reentrant=True),
}


class Attention(nn.Module):
    """Self-attention on F.scaled_dot_product_attention, projections by nn.Linear."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, length, dim))


class SelfAttention(nn.Module):
    """nn.MultiheadAttention as self-attention (its SDPA path)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.attention(x, x, x, need_weights=False)[0]


class Residual(nn.Module):
    def __init__(self, *layers: nn.Module) -> None:
        super().__init__()
        self.body = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.body(x)


def transformer_block(dim: int = 8, heads: int = 2) -> nn.Sequential:
    """Pre-norm: LayerNorm + MultiheadAttention, RMSNorm + SDPA attention, LayerNorm + MLP."""
    return nn.Sequential(
        Residual(nn.LayerNorm(dim), SelfAttention(dim, heads)),
        Residual(nn.RMSNorm(dim), Attention(dim, heads)),
        Residual(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim)),
    )


def conv_block(channels: int = 4, inplace: bool = False) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(channels, channels, 3, padding=1),
        nn.BatchNorm2d(channels),
        nn.ReLU(inplace=inplace),
        nn.Conv2d(channels, channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(channels),
        nn.ReLU(inplace=inplace),
    )


class Net(nn.Module):
    """Layers outside the checkpointed blocks on both sides, so a reentrant checkpoint gets an
    input that requires grad (as it needs) and the blocks' output gradients come from autograd."""

    def __init__(self, stem: nn.Module, blocks: list[nn.Module], head: nn.Module, wrap: Wrap) -> None:
        super().__init__()
        self.stem, self.blocks, self.head = stem, nn.ModuleList(blocks), head
        self.wrap = wrap

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = self.wrap(block, x)
        return self.head(x)


def transformer(wrap: Wrap) -> tuple[Net, Callable[[], Tensor]]:
    net = Net(nn.Embedding(16, 8), [transformer_block(), transformer_block()], nn.Linear(8, 16), wrap)
    return net, lambda: torch.randint(0, 16, (2, 5))


def convnet(wrap: Wrap, inplace: bool = False) -> tuple[Net, Callable[[], Tensor]]:
    head = nn.Sequential(nn.Flatten(), nn.Linear(4 * 5 * 5, 3))
    net = Net(nn.Conv2d(3, 4, 3, padding=1), [conv_block(inplace=inplace), conv_block(inplace=inplace)], head, wrap)
    return net, lambda: torch.randn(3, 3, 5, 5)


def loss_of(output: Tensor) -> Tensor:
    return output.pow(2).mean()


def jobs_per_micro_batch(patched: nn.Module, make_input: Callable[[], Tensor]) -> int:
    """What one backward of the model without checkpointing queues (on a copy)."""
    unwrapped = copy.deepcopy(patched)
    unwrapped.wrap = lambda block, x: block(x)
    queue = twobp.WeightGradQueue()
    with twobp.use_queue(queue):
        loss_of(unwrapped(make_input())).backward()
    jobs = twobp.pending(queue).jobs
    twobp.discard_weight_grads(queue)
    return jobs


def check_deferred_like_autograd(
    net: nn.Module,
    make_input: Callable[[], Tensor],
    micro_batches: int = 3,
    around: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> None:
    """``micro_batches`` backward calls on the patched model and on a plain deep copy, one
    flush; after each backward the patched one has queued one call's jobs per micro-batch and
    written no .grad; at the end gradients and buffers are plain autograd's, nothing queued."""
    patched, reference = patched_and_reference(net)
    per_micro_batch = jobs_per_micro_batch(patched, make_input)
    assert per_micro_batch > 0
    for done in range(1, micro_batches + 1):
        x = make_input()
        for model in (patched, reference):
            with around() if around is not None else contextlib.nullcontext():
                output = model(x)
            loss_of(output).backward()
        assert twobp.pending().jobs == done * per_micro_batch
        assert_no_grads(patched)
    twobp.flush_weight_grads()
    assert twobp.pending().jobs == 0
    assert_grads_match(patched, reference)
    rtol, atol = TOLERANCES[torch.float32]
    for (name, b), (_, c) in zip(patched.named_buffers(), reference.named_buffers(), strict=True):
        torch.testing.assert_close(b, c, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


def _same(t: Tensor) -> Tensor:
    return t


@pytest.mark.parametrize("wrap", list(WRAPS))
@pytest.mark.parametrize("model", [transformer, convnet], ids=["transformer", "conv-batchnorm"])
def test_checkpointed_blocks_defer_and_match_autograd(model, wrap):
    net, make_input = model(WRAPS[wrap])
    check_deferred_like_autograd(net, make_input)


def test_nested_checkpoints():
    net, make_input = transformer(_nested)
    check_deferred_like_autograd(net, make_input)


@pytest.mark.parametrize("wrap", ["sac-save-nothing", "non-reentrant", "reentrant"])
def test_in_place_consumer_inside_checkpoint(wrap):
    """ReLU(inplace=True) on a patched op's output inside the region: the tap re-parents the
    output without copying it, so the in-place op stays an in-place op. (A policy that caches
    that output refuses it in plain PyTorch too: "has been mutated".)"""
    net, make_input = convnet(WRAPS[wrap], inplace=True)
    check_deferred_like_autograd(net, make_input)


def test_sac_cache_mutation_is_refused_as_in_plain_pytorch():
    """An in-place op on an output that the policy caches is PyTorch's own error, raised on
    the plain model as on the patched one: the tap itself leaves the cached output unchanged."""
    for patch in (False, True):
        mlp = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
        if patch:
            twobp.patch(mlp)
        x = torch.randn(3, 4, requires_grad=True)
        with pytest.raises(RuntimeError, match="has been mutated"):
            loss_of(selective(save_products)(mlp, x)).backward()
    twobp.discard_weight_grads()


def test_save_on_cpu_around_patched_forward():
    net, make_input = transformer(lambda block, x: block(x))
    check_deferred_like_autograd(net, make_input, around=torch.autograd.graph.save_on_cpu)


def test_saved_tensors_hooks_see_what_the_tap_saves():
    """The tensors queued for the weight kernels pass through the user's pack/unpack hooks like
    any saved tensor: hooks that keep a copy and hand it back keep the gradients exact, every
    packed tensor is unpacked once, and the queued jobs hold the unpacked copies."""
    packed: list[Tensor] = []
    unpacked: list[int] = []

    def pack(t: Tensor) -> int:
        packed.append(t.clone())
        return len(packed) - 1

    def unpack(index: int) -> Tensor:
        unpacked.append(index)
        return packed[index]

    def hooks() -> contextlib.AbstractContextManager:
        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    net, make_input = convnet(lambda block, x: block(x))
    queue = twobp.WeightGradQueue()
    with twobp.use_queue(queue), hooks():
        output = twobp.patch(copy.deepcopy(net))(make_input())
    loss_of(output).backward()
    copies = {t.untyped_storage().data_ptr() for t in packed}
    # BatchNorm's jobs hold finished gradients (no output gradient), the others kernel inputs.
    kernel_inputs = [t for job in queue.take() if job.grad_outputs for t in job.saved]
    assert kernel_inputs and all(t.untyped_storage().data_ptr() in copies for t in kernel_inputs)
    packed.clear(), unpacked.clear()

    check_deferred_like_autograd(net, make_input, around=hooks)
    assert sorted(unpacked) == list(range(len(packed)))


@pytest.mark.parametrize("wrap", ["none", "non-reentrant", "sac-save-products"])
@pytest.mark.parametrize("make_net", [transformer, convnet], ids=["transformer", "convnet"])
def test_lossy_saved_tensors_hooks_change_the_gradients_as_they_change_plain(make_net, wrap):
    """Hooks that hand back other values (fp16 copies) than they were given, around the model or
    around its checkpoints: every rule saves the very tensors plain saves, so the gradients
    differ from exact ones as plain's do (the fp16 rounding, ~1e-3, is far above the
    tolerance). RMSNorm kept its input and 1/rms where plain keeps x_hat."""
    net, make_input = make_net(WRAPS[wrap] if wrap != "none" else lambda block, x: block(x))
    check_deferred_like_autograd(net, make_input, around=lossy_saved_tensors_hooks)


def test_backward_twice_through_a_checkpoint_then_one_flush():
    """retain_graph=True under a non-reentrant checkpoint: each backward recomputes the region
    and queues its own work; one flush sums both, as plain accumulates both."""
    net, make_input = transformer(WRAPS["non-reentrant"])
    patched, reference = patched_and_reference(net)
    per_micro_batch = jobs_per_micro_batch(patched, make_input)
    x = make_input()
    for model in (patched, reference):
        loss = loss_of(model(x))
        loss.backward(retain_graph=True)
        loss.backward()
    assert twobp.pending().jobs == 2 * per_micro_batch
    assert_no_grads(patched)
    twobp.flush_weight_grads()
    assert twobp.pending().jobs == 0
    assert_grads_match(patched, reference)


@pytest.mark.parametrize("wrap", ["sac-save-products", "non-reentrant"])
def test_input_only_backward_through_a_checkpoint_queues_nothing(wrap):
    """The recomputed taps keep autograd's scoping: backward(inputs=[x]) wants no weight."""
    block = transformer_block()
    patched, reference = patched_and_reference(block)
    x = torch.randn(2, 5, 8)
    gradients = []
    for model in (patched, reference):
        leaf = x.clone().requires_grad_()
        loss_of(WRAPS[wrap](model, leaf)).backward(inputs=[leaf])
        gradients.append(leaf.grad)
    torch.testing.assert_close(gradients[0], gradients[1])
    assert twobp.pending().jobs == 0
    assert_no_grads(patched)


@pytest.mark.parametrize("wrap", ["non-reentrant", "reentrant"])
def test_dropout_inside_a_checkpoint_replays_the_same_masks(wrap):
    """The recomputation restores the RNG state: attention dropout and nn.Dropout draw the
    masks of the forward again, in the patched model as in plain."""
    block = nn.Sequential(SelfAttention(8, 2), nn.Dropout(0.3))
    block[0].attention.dropout = 0.5
    patched, reference = patched_and_reference(block)
    x = torch.randn(2, 5, 8, requires_grad=True)
    for model in (patched, reference):
        torch.manual_seed(1)
        loss_of(WRAPS[wrap](model, x)).backward()
    assert twobp.pending().jobs == 2
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


def test_reentrant_checkpoint_binds_its_work_at_backward():
    """A reentrant checkpoint runs its region's forward under no_grad (plain) and again inside
    backward, where its patched calls bind to the queue current then. Backward inside the
    forward's use_queue block: all the work reaches that queue. Outside it: the region's work
    reaches the default queue, and optimizer.step() refuses to run over it, not without it."""
    net, make_input = transformer(WRAPS["reentrant"])
    patched = twobp.patch(net)
    per_micro_batch = jobs_per_micro_batch(patched, make_input)
    region_jobs = per_micro_batch - 2  # all but the embedding and the head
    queue = twobp.WeightGradQueue()
    with twobp.use_queue(queue):
        loss_of(patched(make_input())).backward()
    assert (queue.pending().jobs, twobp.pending().jobs) == (per_micro_batch, 0)
    queue.flush()

    with twobp.use_queue(queue):
        loss = loss_of(patched(make_input()))
    loss.backward()
    assert (queue.pending().jobs, twobp.pending().jobs) == (2, region_jobs)
    queue.flush()
    with pytest.raises(RuntimeError, match="twobp: optimizer.step"):
        torch.optim.SGD(patched.parameters(), lr=0.1).step()
    twobp.discard_weight_grads()


class _Gate(nn.Module):
    """A module of the user's own (an RMSNorm-like scale), covered by the recompute rule."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


@pytest.mark.parametrize("wrap", ["sac-save-products", "sac-save-all-but-attention"])
def test_selective_checkpoint_of_a_region_ending_in_a_tapped_op_under_autocast(wrap):
    """Under autocast a Linear takes the tap path; a non-reentrant checkpoint's recomputation stops
    early by raising from the pack hook of the region's last saved tensor, the tap's, after its
    re-parenting bumped the output's version. Under a selective policy that output is the
    forward's cached tensor, left bumped: the next layer's queued job read "modified in place" and
    the flush refused a step plain autograd trains."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
            self.head = nn.Linear(8, 4)

        def forward(self, x: Tensor) -> Tensor:
            return self.head(WRAPS[wrap](self.block, x))

    patched, reference = patched_and_reference(Net())
    for _ in range(2):
        x = torch.randn(4, 8)
        for model in (patched, reference):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                output = model(x)
            loss_of(output.float()).backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.bfloat16)


@pytest.mark.parametrize("wrap", ["sac-save-products", "sac-save-all-but-attention"])
def test_selective_checkpoint_of_recompute_rule_modules_on_their_first_call(wrap):
    """A recompute-rule module's first call runs trial forwards; inside a selective checkpoint its
    cache recorded their ops, and the recomputation in backward, which runs no trials, was handed
    the trials' outputs (one with two more rows): CheckpointError on the first step."""
    twobp.register(_Gate, twobp.ops.recompute)
    block = nn.Sequential(_Gate(), nn.Linear(8, 8), _Gate(), nn.Linear(8, 8))
    patched, reference = patched_and_reference(nn.Sequential(block, nn.Linear(8, 4)))
    for _ in range(2):
        x = torch.randn(2, 3, 8)
        for model in (patched, reference):
            loss_of(model[1](WRAPS[wrap](model[0], x))).backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


def _square_layers() -> nn.Module:
    """Square Linear layers: both paths save tensors of the same shapes, so the checkpoint's own
    shape check cannot tell one path's from the other's."""
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).double()


@pytest.mark.parametrize("backwards", [1, 2], ids=["one-backward", "retained-graph-twice"])
@pytest.mark.parametrize("early_stop", [True, False], ids=["early-stop", "full-recomputation"])
@pytest.mark.parametrize("forward_mode", ["eval", "train"])
def test_a_checkpoint_recomputed_after_a_mode_switch_takes_its_forwards_path(forward_mode, early_stop, backwards):
    """``eval(); y = checkpoint(model, x); train(); y.backward()``: the recomputation took the
    deferred path and handed its tensors to the plain path's nodes (x.grad 0.5 off, weights up
    to 1.7 off, no error where shapes coincide); and the other way round. Each patched call now
    takes the path its forward took."""
    patched, reference = patched_and_reference(_square_layers())
    x = torch.randn(3, 4, dtype=torch.float64)
    input_grads = []
    for model in (patched, reference):
        source = x.clone().requires_grad_()
        model.train(forward_mode == "train")
        with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
            output = checkpoint(model, source, use_reentrant=False)
        model.train(forward_mode != "train")
        for k in range(backwards):
            output.square().sum().backward(retain_graph=k + 1 < backwards)
        input_grads.append(source.grad)
    if forward_mode == "eval":  # plain's path, as plain: gradients at once
        assert twobp.pending().jobs == 0
    else:
        assert twobp.pending().jobs == 3 * backwards and patched[0].weight.grad is None
    twobp.flush_weight_grads()
    torch.testing.assert_close(input_grads[0], input_grads[1], rtol=1e-12, atol=1e-12)
    assert_grads_match(patched, reference)


class _AttentionBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2, dropout=0.5)

    def forward(self, x: Tensor) -> Tensor:
        return self.attention(x, x, x)[0]


MODE_DEPENDENT = {
    "batch-norm": (lambda: nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4)), (6, 4)),
    "attention-dropout": (_AttentionBlock, (3, 2, 8)),
}


@pytest.mark.parametrize("layer", MODE_DEPENDENT)
def test_a_layer_that_computes_otherwise_in_eval_recomputed_after_a_switch_to_eval_is_refused(layer):
    """``train(); y = checkpoint(model, x); eval(); y.backward()`` over a BatchNorm with running
    statistics, or attention with dropout: plain's recomputation computes in eval and its checkpoint
    refuses (CheckpointError). The rules compute training's op whatever the mode: the replay gave
    the forward's gradients and updated BatchNorm's running statistics a second time, in eval."""
    make, shape = MODE_DEPENDENT[layer]
    patched, reference = patched_and_reference(make().double())
    x = torch.randn(shape, dtype=torch.float64)
    for model in (patched, reference):
        model.train()
        output = checkpoint(model, x, use_reentrant=False)
        buffers = [b.clone() for b in model.buffers()]
        model.eval()
        with pytest.raises(torch.utils.checkpoint.CheckpointError):
            output.square().sum().backward()
        assert all(torch.equal(a, b) for a, b in zip(buffers, model.buffers(), strict=True))
    twobp.discard_weight_grads()


def test_a_batch_norm_without_running_statistics_recomputed_after_a_switch_to_eval_counts_no_batch() -> None:
    """Running statistics set to None by hand (a BatchNorm that normalises by each batch in eval
    too): its recomputation in eval is the forward, as plain's is, but the rule counted the batch in
    ``num_batches_tracked`` again, which plain's forward does only in training."""
    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).double())
    x = torch.randn(6, 4, dtype=torch.float64)
    for model in (patched, reference):
        model[1].running_mean = model[1].running_var = None
        output = checkpoint(model, x, use_reentrant=False)
        model.eval()
        output.square().sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)
    assert patched[1].num_batches_tracked.item() == reference[1].num_batches_tracked.item() == 1


class _DropoutBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(4))
        self.dropout = nn.Dropout(0.5)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(x * self.scale)


@pytest.mark.parametrize("rule", ["recompute", "recompute_rowwise"])
def test_a_recompute_rule_module_that_draws_on_its_first_call_inside_a_checkpoint(rule):
    """A dropout block under the recompute rule, first called inside a non-reentrant checkpoint:
    the rule told its draw from an attempt on the deferred path, abandoned for plain's forward,
    whose saved tensors the checkpoint had counted too: its recomputation, plain's forward alone,
    saved fewer (CheckpointError on the first step, where plain trains)."""
    twobp.register(_DropoutBlock, getattr(twobp.ops, rule))
    model = nn.Sequential(nn.Linear(4, 4), _DropoutBlock(), nn.Linear(4, 4))
    patched, reference = patched_and_reference(model.double())
    x = torch.randn(6, 4, dtype=torch.float64)
    for model in (patched, reference):
        torch.manual_seed(0)
        checkpoint(model, x, use_reentrant=False).square().sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


def test_nested_checkpoints_recomputed_after_a_mode_switch_take_their_forwards_paths():
    inner = _square_layers()
    outer = nn.Sequential(nn.Linear(4, 4).double(), inner)
    patched, reference = patched_and_reference(outer)
    x = torch.randn(3, 4, dtype=torch.float64)
    for model in (patched, reference):
        model[1].eval()

        def region(t, model=model):
            return checkpoint(model[1], model[0](t), use_reentrant=False)

        output = checkpoint(region, x, use_reentrant=False)
        model.train()
        output.square().sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


def _nothing_saved() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    return create_selective_checkpoint_contexts([])


class _NormsInside(nn.Module):
    """A Linear, a checkpoint of an RMSNorm and a MultiheadAttention, a Linear: the nested
    region's patched calls save other tensors on each path, and the outer region runs on past it."""

    def __init__(self, inner: str) -> None:
        super().__init__()
        self.inner = inner
        self.first, self.last = nn.Linear(8, 8), nn.Linear(8, 8)
        self.norm, self.attention = nn.RMSNorm(8), nn.MultiheadAttention(8, 2, batch_first=True)

    def region(self, t: Tensor) -> Tensor:
        h = self.norm(t)
        return self.attention(h, h, h, need_weights=False)[0]

    def forward(self, x: Tensor) -> Tensor:
        context = {"selective": {"context_fn": _nothing_saved}, "non-reentrant": {}}[self.inner]
        return self.last(checkpoint(self.region, self.first(x), use_reentrant=False, **context))


@pytest.mark.parametrize("forward_mode", ["eval", "train"])
@pytest.mark.parametrize("inner", ["non-reentrant", "selective"])
def test_a_checkpoint_nested_in_a_selective_one_made_again_after_a_mode_switch_takes_its_forwards_path(
    inner, forward_mode
):
    """The outer (selective) checkpoint's recomputation makes the nested checkpoint anew, whose
    calls took the path the new mode says: the selective checkpoint, which checks every op of its
    recomputation against its forward's, failed with "aten.view.default encountered during
    backward but not found in storage" (plain runs). The new frame now takes the paths its
    forward's twin recorded."""
    patched, reference = patched_and_reference(_NormsInside(inner).double())
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    for model in (patched, reference):
        model.train(forward_mode == "train")
        output = checkpoint(model, x, use_reentrant=False, context_fn=_nothing_saved)
        model.train(forward_mode != "train")
        output.square().sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


def test_checkpoints_nested_three_deep_made_again_after_a_mode_switch_take_their_forwards_paths():
    """Inside a frame made again (the middle checkpoint, by the outer's recomputation), the
    innermost checkpoint is linked to the one its forward made inside the middle's first frame."""
    patched, reference = patched_and_reference(_NormsInside("non-reentrant").double())
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    for model in (patched, reference):
        model.eval()

        def middle(t, model=model):
            return model.last(checkpoint(model.region, t, use_reentrant=False))

        def outer(t, model=model):
            return checkpoint(middle, model.first(t), use_reentrant=False).tanh()

        output = checkpoint(outer, x, use_reentrant=False, context_fn=_nothing_saved)
        model.train()
        output.square().sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


def test_a_checkpoint_made_in_another_ones_recomputation_is_linked_to_its_forwards(monkeypatch):
    """torch.utils.checkpoint's hook is made once per frame while the enclosing checkpoint's hooks
    are on top (private): if PyTorch changes that, this fails before a nested region goes unseen."""
    from twobp_autograd import checkpoint_paths

    twobp.patch(nn.Linear(2, 2))  # the link is installed with a patched module's guards
    frames: list[object] = []

    def inner(t):
        found = checkpoint_paths._innermost_frame()
        assert found is not None
        frames.append(found[0])
        return t.sin()

    def outer(t):
        return checkpoint(inner, t.cos(), use_reentrant=False).exp()

    checkpoint(outer, torch.randn(3, requires_grad=True), use_reentrant=False).sum().backward()
    # The inner region ran in the forward, again in the outer's recomputation (a new frame),
    # and once more in its forward frame's own recomputation.
    forward_frame, made_again, recomputed = frames
    assert made_again is not forward_frame and checkpoint_paths._twins.get(made_again) is forward_frame
    assert recomputed is forward_frame


def test_the_checkpoint_frame_is_found_through_pytorchs_hooks():
    """torch.utils.checkpoint's pack hooks (private) lead to its frame, in the forward and in the
    recomputation: if PyTorch changes them, this fails before a mode switch goes unseen."""
    from twobp_autograd.checkpoint_paths import checkpoint_frame

    seen = []

    def region(t):
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
        assert hooks is not None and getattr(hooks[0], "_checkpoint_internal", False)
        seen.append(checkpoint_frame(hooks[0]))
        return t.sin()

    checkpoint(region, torch.randn(3, requires_grad=True), use_reentrant=False).sum().backward()
    (forward_frame, forward_backward), (recomputed_frame, recomputing) = seen
    assert forward_frame is recomputed_frame and forward_backward is None and recomputing is not None


class _DropsInside(nn.Module):
    """Patched children around a dropout: under the recompute rule its first call is tried on
    detached parameters, found to draw random numbers, and run again on plain autograd."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.drop, self.b = nn.Linear(4, 4), nn.Dropout(0.3), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.drop(self.a(x))))


@pytest.mark.parametrize("early_stop", [True, False], ids=["early-stop", "full-recomputation"])
def test_a_recompute_rule_modules_discarded_first_attempt_inside_a_checkpoint_is_forgotten(early_stop):
    """The discarded attempt's patched children recorded their paths on the checkpoint's frame
    too, and the recomputation (no first call any more) read those: the children's weights
    1.7-3.4 off."""
    twobp.register(_DropsInside, twobp.ops.recompute)
    patched, reference = patched_and_reference(nn.Sequential(_DropsInside()).double())
    x = torch.randn(3, 4, dtype=torch.float64)
    for model in (patched, reference):
        torch.manual_seed(1)
        with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            output = checkpoint(model, x, use_reentrant=False)
        output.square().sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


def test_an_old_style_backward_hook_added_before_a_checkpoints_backward_leaves_plains_gradients():
    """The hook attaches only to the recomputed graph, which the checkpoint discards: plain's
    gradients are the hook-free ones. The recomputation took plain's path because of the hook
    and handed its tensors to the deferred path's nodes (0.96 off, silently on square layers)."""
    patched, reference = patched_and_reference(_square_layers())
    x = torch.randn(3, 4, dtype=torch.float64)
    input_grads = []
    for model in (patched, reference):
        source = x.clone().requires_grad_()
        output = checkpoint(model, source, use_reentrant=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # register_backward_hook is deprecated
            model[2].register_backward_hook(lambda module, grad_input, grad_output: None)
        output.square().sum().backward()
        input_grads.append(source.grad)
    twobp.flush_weight_grads()
    torch.testing.assert_close(input_grads[0], input_grads[1], rtol=1e-12, atol=1e-12)
    assert_grads_match(patched, reference)


class _GainBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner, self.gain = nn.Linear(4, 4), nn.Parameter(torch.ones(4))

    def forward(self, x):
        return self.gain * torch.tanh(self.inner(x))


def test_a_checkpoints_recomputation_that_cannot_take_its_forwards_path_is_refused():
    """A global forward hook added between the checkpointed forward and its backward: the
    recompute rule keeps plain autograd while hooks exist, so the recomputation took plain's
    path where the forward deferred (3.66 off, silently). Refused, naming the cause."""
    twobp.register(_GainBlock, twobp.ops.recompute)
    model = twobp.patch(nn.Sequential(nn.Linear(4, 4), _GainBlock()).double())
    output = checkpoint(model, torch.randn(3, 4, dtype=torch.float64, requires_grad=True), use_reentrant=False)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
    try:
        with pytest.raises(RuntimeError, match="twobp: an activation checkpoint's recomputation found a patched"):
            output.square().sum().backward()
    finally:
        handle.remove()
    twobp.discard_weight_grads()


def test_patching_between_a_checkpointed_forward_and_its_backward_is_refused():
    """The forward ran unpatched; the recomputation's patched calls took the deferred path
    (0.9-7.3 off, silently on square layers)."""
    model = _square_layers()
    output = checkpoint(model, torch.randn(3, 4, dtype=torch.float64, requires_grad=True), use_reentrant=False)
    twobp.patch(model)
    with pytest.raises(RuntimeError, match="twobp: an activation checkpoint's recomputation runs other patched calls"):
        output.square().sum().backward()
    twobp.discard_weight_grads()


@pytest.mark.parametrize("what", ["model", "last-layer"])
def test_unpatching_between_a_checkpointed_forward_and_its_backward_is_refused(what):
    """The recomputation of an unpatched model makes no patched call to compare with the
    forward's record: plain's saved tensors went to the deferred nodes (4.7 off on square
    layers, silently). Refused until that backward has run; then unpatching works."""
    patched, reference = patched_and_reference(_square_layers())
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    output = checkpoint(patched, x, use_reentrant=False)
    target = patched if what == "model" else patched[-1]
    with pytest.raises(RuntimeError, match=r"twobp: unpatch\(\) between an activation checkpoint's forward"):
        twobp.unpatch(target)
    output.square().sum().backward()
    checkpoint(reference, x, use_reentrant=False).square().sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)
    twobp.unpatch(target)


def test_unpatching_after_a_checkpointed_forward_raised_waits_for_its_traceback():
    """A forward that raised keeps its checkpoint frame alive through the traceback, and a tensor
    it made may have escaped: a backward through it recomputes up to that tensor (3.4 off after an
    unpatch, silently). Refused while the exception lives, allowed once it is dropped."""
    model = twobp.patch(_square_layers())
    escaped: list[torch.Tensor] = []

    def fails(x: torch.Tensor) -> torch.Tensor:
        escaped.append(model(x))
        raise MemoryError("simulated")

    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    with pytest.raises(MemoryError) as raised:
        checkpoint(fails, x, use_reentrant=False)
    with pytest.raises(RuntimeError, match=r"twobp: unpatch\(\) between an activation checkpoint's forward"):
        twobp.unpatch(model)
    del raised
    escaped.clear()
    gc.collect()
    twobp.unpatch(model)


def test_a_rules_fallback_to_plain_in_a_checkpointed_forward_is_what_its_recomputation_replays():
    """A global forward hook during the forward only (a FLOP counter): the recompute rule kept
    plain autograd there, but the call was recorded as deferred, and the recomputation (hooks
    gone) deferred: CheckpointError where plain trains."""
    twobp.register(_GainBlock, twobp.ops.recompute)
    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(4, 4), _GainBlock()).double())
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    for model in (patched, reference):
        handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            output = checkpoint(model, x, use_reentrant=False)
        handle.remove()
        output.square().sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


class _CopiesItsLayer(nn.Module):
    """Calls a shallow copy of a patched layer, made anew at each run of the checkpointed forward."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x):
        return copy.copy(self.layer)(torch.tanh(self.layer(x)))


class _GradientInside(nn.Module):
    """Takes an input gradient inside its forward: autograd recomputes the checkpoint's region
    while its forward still runs."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        y = torch.tanh(self.first(x))
        (g,) = torch.autograd.grad(y.sum(), x, retain_graph=True)
        return self.second(y) * g


@pytest.mark.parametrize("early_stop", [True, False], ids=["early-stop", "full-recomputation"])
@pytest.mark.parametrize("make", [_CopiesItsLayer, _GradientInside], ids=["shallow-copy-inside", "grad-inside"])
def test_checkpointed_regions_whose_calls_are_theirs_are_not_refused(make, early_stop):
    """The check that a recomputation runs the forward's calls refused a shallow copy made anew
    inside the region (another object each run) and the calls a recomputation from inside the
    forward reaches past where the forward stands (autograd.grad, no early stop)."""
    patched, reference = patched_and_reference(make().double())
    x = torch.randn(3, 4, dtype=torch.float64)
    for model in (patched, reference):
        source = x.clone().requires_grad_()
        with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
            output = checkpoint(model, source, use_reentrant=False)
        output.square().sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


class _ExtraInTraining(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.extra = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, t: Tensor) -> Tensor:
        h = torch.tanh(self.a(t))
        if self.training:  # a call only training makes (an auxiliary head), after the region's saves
            h = h + 0.0 * self.extra(h).detach()
        return h


def test_a_nested_checkpoint_made_again_with_more_calls_than_its_forwards_twin_runs_as_plain():
    """eval(), forward, train(), backward: the outer recomputation makes the nested region anew,
    now with one more patched call than its forward twin recorded (plain runs: the nested
    recomputation stops early before it); it was refused as 'other patched calls'."""
    model = nn.Sequential(nn.Linear(8, 8), _ExtraInTraining(), nn.Linear(8, 8)).double()
    patched, reference = patched_and_reference(model)
    x = torch.randn(4, 8, dtype=torch.float64)
    for m in (patched, reference):
        m.eval()

        def outer(t, m=m):
            return m[2](checkpoint(m[1], m[0](t), use_reentrant=False))

        output = checkpoint(outer, x, use_reentrant=False)
        m.train()
        output.square().sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


@pytest.mark.parametrize(
    "wrap",
    [
        functools.partial(_checkpointed, use_reentrant=False),
        functools.partial(_checkpointed, use_reentrant=True),
        selective(save_all_but_attention),
    ],
    ids=["non-reentrant", "reentrant", "sac-save-all"],
)
@pytest.mark.parametrize("norm_last", [True, False], ids=["norm-last", "layer-after"])
def test_checkpointed_instance_norm_updates_its_running_statistics_as_plain(wrap, norm_last):
    """torch.instance_norm copies the running statistics back after batch_norm saved its
    tensors, so a non-reentrant recomputation that stops at those (the region's last) leaves them
    updated once. Updated before the tap saved its own, they were updated a second time there
    (silently one momentum step off); with a layer after the norm both recompute it whole. A
    policy caching every op refused its cached running statistics as mutated where plain's
    recomputation never reached them (with a layer after the norm plain's reaches them too, and
    refuses as ours does)."""
    layers = [nn.Conv1d(3, 3, 1), nn.InstanceNorm1d(3, affine=True, track_running_stats=True)]
    region = nn.Sequential(*layers, *([] if norm_last else [nn.Conv1d(3, 3, 1)])).double()
    patched, reference = patched_and_reference(region)
    if wrap.keywords.get("context_fn") is not None and not norm_last:
        for model in (patched, reference):
            x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
            with pytest.raises(RuntimeError, match="cached during selective activation checkpoint has been mutated"):
                loss_of(wrap(model, x)).backward()
        twobp.discard_weight_grads()
        return
    for _ in range(3):
        x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
        for model in (patched, reference):
            loss_of(wrap(model, x)).backward()
        twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)
    for (name, ours), plain in zip(patched.named_buffers(), reference.buffers(), strict=True):
        torch.testing.assert_close(ours, plain, rtol=1e-12, atol=1e-12, msg=name)


class _NoisyWhenAsked(nn.Module):
    """A module for the recompute rule that adds noise where its public ``noise`` says so."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
        self.noise = 0.0

    def forward(self, x: Tensor) -> Tensor:
        y = torch.tanh(x @ self.weight)
        return y + self.noise * torch.randn_like(y) if self.noise > 0 else y


def test_a_checkpointed_call_that_deferred_recomputes_so_after_another_call_drew_random_numbers():
    """GPipe's order: micro-batch 1's forward under a checkpoint deferred; micro-batch 2's, outside
    it, drew noise, and the rule sent the module to plain autograd; micro-batch 1's recomputation
    then took that verdict for itself and was refused, where plain trains."""
    twobp.register(_NoisyWhenAsked, twobp.ops.recompute)
    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(4, 4), _NoisyWhenAsked()).double())
    first, second = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the draw sends the module to plain autograd, warned
        for net in (patched, reference):
            torch.manual_seed(0)
            out_first = checkpoint(net, first, use_reentrant=False)
            net[1].noise = 0.1
            out_second = net(second)
            net[1].noise = 0.0
            out_second.square().sum().backward()
            out_first.square().sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)
