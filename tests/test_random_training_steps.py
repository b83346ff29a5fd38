"""Randomized training sequences against plain autograd, in fp64 (exact up to summation order).

A seeded generator builds a small model from the covered module families (reused, tied,
frozen, checkpointed, residual, beside unpatched layers) and trains it for a few optimizer
steps; each micro-batch calls backward in one of the ways a training step does (retained graph,
``autograd.grad`` first, ``zero_grad`` after it, a parameter frozen before it, ``inputs=``, a
hook on the output, an early flush of its tag, another queue, eval mode). After every flush,
every ``.grad`` and buffer must equal plain autograd's, and after every step every parameter.
A second family does the same with image models (every kind of convolution, BatchNorm,
GroupNorm and InstanceNorm, channels_last).

The hand-written tests pin each case down; this one looks for combinations nobody listed (it
found ``zero_grad(set_to_none=False)`` leaving ``None`` where plain leaves zeros).
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import twobp_autograd as twobp
from tests.utils import assert_close_to_reference, assert_grads_match
from twobp_autograd.queue import current_queue

WIDTH, LENGTH, VOCAB = 8, 5, 20

#: Layers taking (batch, channels, length): the model transposes around them.
CHANNELS_FIRST = ("group-norm", "batch-norm", "conv", "conv-same", "conv-transpose")


def _layer(kind: str, rng: random.Random) -> nn.Module:
    if kind in ("linear", "reused", "frozen", "residual", "tied"):
        return nn.Linear(WIDTH, WIDTH)
    makers = {
        "linear-no-bias": lambda: nn.Linear(WIDTH, WIDTH, bias=False),
        "layer-norm": lambda: nn.LayerNorm(WIDTH),
        "layer-norm-no-bias": lambda: nn.LayerNorm(WIDTH, bias=False),
        "rms-norm": lambda: nn.RMSNorm(WIDTH),
        "group-norm": lambda: nn.GroupNorm(2, WIDTH),
        "batch-norm": lambda: nn.BatchNorm1d(WIDTH),
        "conv": lambda: nn.Conv1d(WIDTH, WIDTH, 3, padding=1),
        "conv-same": lambda: nn.Conv1d(
            WIDTH, WIDTH, 2, padding="same", padding_mode=rng.choice(["zeros", "reflect", "circular"])
        ),
        "conv-transpose": lambda: nn.ConvTranspose1d(WIDTH, WIDTH, 3, padding=1),
        "attention": lambda: nn.MultiheadAttention(
            WIDTH, 2, batch_first=rng.random() < 0.5, bias=rng.random() < 0.7, add_bias_kv=rng.random() < 0.2
        ),
        "checkpointed": lambda: nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.LayerNorm(WIDTH)),
        "unpatched": lambda: nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()),
    }
    return makers[kind]()


LAYER_KINDS = (
    "linear", "linear-no-bias", "layer-norm", "layer-norm-no-bias", "rms-norm", "group-norm", "batch-norm",
    "conv", "conv-same", "conv-transpose", "attention", "reused", "tied", "frozen", "checkpointed", "residual",
    "unpatched",
)  # fmt: skip


def _call(kind: str, layer: nn.Module, x: Tensor) -> Tensor:
    """How both families call a layer of the kinds they share (reused, residual, checkpointed)."""
    if kind == "reused":
        return layer(torch.tanh(layer(x)))
    if kind == "residual":
        return x + layer(x)
    if kind == "checkpointed":
        return checkpoint(layer, x, use_reentrant=False)
    return layer(x)


class EmbeddingBagFront(nn.Module):
    """nn.EmbeddingBag as a sequence front: one bag per position, its indices given as a 2-D
    input (rows of equal length, ``padding_idx`` leaving some out) or 1-D with offsets (the
    model's own bag sizes, empty bags included, ``include_last_offset`` sometimes); in sum mode
    ``per_sample_weights`` sometimes, looked up from a learned nn.Embedding (their gradient
    reaches a compared parameter)."""

    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        mode = rng.choice(["sum", "sum", "mean", "max"])
        self.bag = nn.EmbeddingBag(
            VOCAB,
            WIDTH,
            mode=mode,
            padding_idx=0 if rng.random() < 0.3 else None,
            scale_grad_by_freq=mode != "max" and rng.random() < 0.2,
            include_last_offset=rng.random() < 0.5,
        )
        self.weights = nn.Embedding(VOCAB, 1) if mode == "sum" and rng.random() < 0.6 else None
        self.with_offsets = rng.random() < 0.5
        # Indices per position's bag, the same in every row (all alike for 2-D input), not all empty.
        self.sizes = [rng.randint(0, 3) for _ in range(LENGTH)] if self.with_offsets else [rng.randint(1, 3)] * LENGTH
        self.sizes[rng.randrange(LENGTH)] = max(self.sizes) or 1

    def sample(self, batch: int) -> Tensor:
        if self.with_offsets:
            return torch.randint(0, VOCAB, (batch, sum(self.sizes)))
        return torch.randint(0, VOCAB, (batch, LENGTH, self.sizes[0]))

    def forward(self, x: Tensor) -> Tensor:
        batch = x.shape[0]
        weights = None if self.weights is None else self.weights(x).squeeze(-1)
        if not self.with_offsets:
            flat = x.reshape(batch * LENGTH, -1)
            out = self.bag(flat, per_sample_weights=None if weights is None else weights.reshape(flat.shape))
            return out.reshape(batch, LENGTH, WIDTH)
        starts = torch.tensor([0, *self.sizes[:-1]]).cumsum(0)
        offsets = (starts + torch.arange(batch).unsqueeze(1) * sum(self.sizes)).reshape(-1)
        if self.bag.include_last_offset:
            offsets = torch.cat([offsets, torch.tensor([x.numel()])])
        flat = x.reshape(-1)
        out = self.bag(flat, offsets.to(x.device), None if weights is None else weights.reshape(-1))
        return out.reshape(batch, LENGTH, WIDTH)


class RandomNet(nn.Module):
    """An optional embedding or embedding bag, one to five random layers (tanh after each), a
    linear head."""

    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        front = rng.random()
        self.embedding = nn.Embedding(VOCAB, WIDTH) if front < 0.3 else None
        self.embedding_bag = EmbeddingBagFront(rng) if 0.3 <= front < 0.55 else None
        self.kinds = [rng.choice(LAYER_KINDS) for _ in range(rng.randint(1, 5))]
        self.layers = nn.ModuleList(_layer(kind, rng) for kind in self.kinds)
        first_linear = next((m for k, m in zip(self.kinds, self.layers, strict=True) if k == "linear"), None)
        for kind, layer in zip(self.kinds, self.layers, strict=True):
            if kind == "frozen":
                layer.requires_grad_(False)
            if kind == "tied" and first_linear is not None:
                layer.weight = first_linear.weight
        self.head = nn.Linear(WIDTH, 3)

    def sample(self, rng: random.Random, batch: int) -> Tensor:
        if self.embedding is not None:
            return torch.randint(0, VOCAB, (batch, LENGTH))
        if self.embedding_bag is not None:
            return self.embedding_bag.sample(batch)
        return torch.randn(batch, LENGTH, WIDTH, dtype=torch.float64, requires_grad=rng.random() < 0.5)

    def forward(self, x: Tensor) -> Tensor:
        if self.embedding is not None:
            x = self.embedding(x)
        if self.embedding_bag is not None:
            x = self.embedding_bag(x)
        for kind, layer in zip(self.kinds, self.layers, strict=True):
            if kind in CHANNELS_FIRST:
                x = layer(x.transpose(1, 2)).transpose(1, 2)
            elif kind == "attention":
                sequence_first = not layer.batch_first
                q = x.transpose(0, 1) if sequence_first else x
                out = layer(q, q, q, need_weights=False)[0]
                x = out.transpose(0, 1) if sequence_first else out
            else:
                x = _call(kind, layer, x)
            x = torch.tanh(x)
        return self.head(x)


CONV_KINDS = (
    "conv", "conv-stride-2", "conv-groups", "conv-dilated", "conv-1x1-no-bias", "batch-norm", "batch-norm-options",
    "group-norm", "instance-norm", "conv-transpose", "conv-transpose-stride-2", "layer-norm-channels-last", "reused",
    "residual", "checkpointed", "frozen-batch-norm",
)  # fmt: skip
CHANNELS = 4
PADDING_MODES = ("zeros", "reflect", "replicate", "circular")


def _conv_layer(kind: str, rng: random.Random) -> nn.Module:
    c = CHANNELS
    makers = {
        "conv": lambda: nn.Conv2d(c, c, 3, padding=1, padding_mode=rng.choice(PADDING_MODES)),
        "conv-stride-2": lambda: nn.Conv2d(c, c, 3, stride=2, padding=1),
        "conv-groups": lambda: nn.Conv2d(c, c, 3, padding=1, groups=2),
        "conv-dilated": lambda: nn.Conv2d(c, c, 3, padding=2, dilation=2),
        "conv-1x1-no-bias": lambda: nn.Conv2d(c, c, 1, bias=False),
        "batch-norm": lambda: nn.BatchNorm2d(c),
        "batch-norm-options": lambda: nn.BatchNorm2d(
            c, affine=rng.random() < 0.5, track_running_stats=rng.random() < 0.5, momentum=rng.choice([None, 0.1])
        ),
        "group-norm": lambda: nn.GroupNorm(2, c),
        "instance-norm": lambda: nn.InstanceNorm2d(c, affine=True, track_running_stats=rng.random() < 0.5),
        "conv-transpose": lambda: nn.ConvTranspose2d(c, c, 3, padding=1),
        "conv-transpose-stride-2": lambda: nn.ConvTranspose2d(c, c, 3, stride=2, padding=1, output_padding=1),
        "layer-norm-channels-last": lambda: nn.LayerNorm(c),
        "reused": lambda: nn.Conv2d(c, c, 3, padding=1),
        "residual": lambda: nn.Conv2d(c, c, 3, padding=1),
        "checkpointed": lambda: nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU()),
        "frozen-batch-norm": lambda: nn.BatchNorm2d(c).requires_grad_(False),
    }
    return makers[kind]()


class RandomConvNet(nn.Module):
    """One to four random image layers (tanh after each), global pooling, a linear head; its
    inputs sometimes channels_last, and the whole model sometimes too."""

    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        self.kinds = [rng.choice(CONV_KINDS) for _ in range(rng.randint(1, 4))]
        self.layers = nn.ModuleList(_conv_layer(kind, rng) for kind in self.kinds)
        self.head = nn.Linear(CHANNELS, 3)
        self.channels_last = rng.random() < 0.4

    def sample(self, rng: random.Random, batch: int) -> Tensor:
        size = rng.choice([6, 7])
        x = torch.randn(batch, CHANNELS, size, size, dtype=torch.float64)
        if rng.random() < 0.3:
            x = x.to(memory_format=torch.channels_last)
        return x.requires_grad_(rng.random() < 0.5)

    def forward(self, x: Tensor) -> Tensor:
        for kind, layer in zip(self.kinds, self.layers, strict=True):
            if kind == "layer-norm-channels-last":
                x = layer(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
            else:
                x = _call(kind, layer, x)
            x = torch.tanh(x)
        return self.head(x.mean((2, 3)))


#: How one micro-batch's backward is driven (the same on both models).
ACTIONS = (
    "backward", "retain-graph-twice", "autograd-grad-first", "zero-grad-after", "frozen-head",
    "inputs-subset", "output-hook", "eval-mode", "no-grad-forward-too", "scaled-loss", "default-queue",
    "flush-this-tag",
)  # fmt: skip


def _backward(model: nn.Module, loss: Tensor, action: str, set_to_none: bool) -> None:
    if action == "retain-graph-twice":
        loss.backward(retain_graph=True)
        loss.backward()
    elif action == "autograd-grad-first":
        torch.autograd.grad(loss, list(model.head.parameters()), retain_graph=True)
        loss.backward()
    elif action == "zero-grad-after":
        loss.backward()
        model.zero_grad(set_to_none=set_to_none)
    elif action == "frozen-head":  # frozen between forward and backward: no gradient
        model.head.weight.requires_grad_(False)
        loss.backward()
        model.head.weight.requires_grad_(True)
    elif action == "inputs-subset":
        loss.backward(inputs=[p for p in model.parameters() if p.requires_grad][::2])
    else:
        loss.backward()


def _train_and_compare(seed: int, family: type[RandomNet] | type[RandomConvNet], device: str = "cpu") -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model = family(rng).double().to(device)
    if getattr(model, "channels_last", False):
        model = model.to(memory_format=torch.channels_last)
    reference = copy.deepcopy(model)
    twobp.patch(model)
    queue = twobp.WeightGradQueue(
        rng.choice(["auto", "concat", "loop"]), max_pending_bytes=rng.choice([None, None, 0, 2000])
    )
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model, reference)]
    story: list[str] = []  # what happened, for the failure message
    for step in range(rng.randint(1, 3)):
        for micro_batch in range(rng.randint(1, 3)):
            action = rng.choice(ACTIONS)
            if action == "eval-mode" and "checkpointed" in model.kinds:
                action = "backward"  # forwarded in eval, recomputed in train: a limit (README)
            story.append(action)
            x = model.sample(rng, rng.choice([1, 2, 3])).to(device)
            set_to_none = rng.random() < 0.5
            target = current_queue() if action == "default-queue" else queue
            for net in (model, reference):
                net.train(action != "eval-mode")
                with twobp.use_queue(target), queue.tagged((step, micro_batch)):
                    y = net(x.detach().requires_grad_(x.requires_grad) if x.is_floating_point() else x)
                net.train()
                if action == "output-hook":
                    y.register_hook(lambda g: g * 2)
                if action == "no-grad-forward-too":
                    with torch.no_grad():
                        net(x)
                loss = y.pow(2).mean() + 0.1 * y.sum()
                _backward(net, loss * 1024.0 if action == "scaled-loss" else loss, action, set_to_none)
            if action == "flush-this-tag":
                queue.flush(tags=[(step, micro_batch)])
        queue.flush()
        twobp.flush_weight_grads()
        where = f"{family.__name__} seed {seed} on {device}, layers {model.kinds}, actions {story}"
        try:
            # fp64 rounding noise is relative to the gradients summed, not to the one that comes
            # out: a gradient zero in exact arithmetic (attention's key bias, a bias before a
            # norm) is noise of the others' size. Absolute part: rtol times the largest gradient.
            grads = [q.grad.abs().max().item() for q in reference.parameters() if q.grad is not None and q.grad.numel()]
            assert_grads_match(model, reference, torch.float64, scale=max(1.0, 100 * max(grads, default=0.0)))
            for (name, buffer), expected in zip(model.named_buffers(), reference.buffers(), strict=True):
                assert_close_to_reference(buffer, expected, torch.float64, msg=f"buffer {name}")
        except AssertionError as error:
            raise AssertionError(f"{where}: {error}") from None
        for optimizer in optimizers:
            optimizer.step()
        set_to_none = rng.random() < 0.5
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        # Scaled by the largest entry: a gradient that is zero in exact arithmetic (attention's key
        # bias, a convolution's bias before a norm) is rounding noise of the others' size, which
        # the steps carry into the parameter.
        assert_close_to_reference(p, q, torch.float64, msg=lambda m, name=name: f"{where}, {name}: {m}")


@pytest.mark.filterwarnings("ignore:Using padding=.same. with even kernel")  # PyTorch's own, plain warns too
@pytest.mark.parametrize("seed", range(160))
def test_random_training_sequences_match_plain_autograd(seed: int) -> None:
    _train_and_compare(seed, RandomNet)


@pytest.mark.parametrize("seed", range(100))
def test_random_image_models_match_plain_autograd(seed: int) -> None:
    """Convolutions of every kind, BatchNorm (its running statistics as well) and GroupNorm,
    channels_last models and inputs."""
    _train_and_compare(seed, RandomConvNet)


#: On CUDA every backward runs on autograd's device thread, not the caller's: the queue's
#: bookkeeping of running backwards, hooks and zero_grad meet that thread there.
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
@pytest.mark.filterwarnings("ignore:Using padding=.same. with even kernel")
@pytest.mark.parametrize("seed", range(40))
def test_random_training_sequences_on_cuda_match_plain_autograd(seed: int) -> None:
    _train_and_compare(seed, RandomNet, "cuda")


@needs_cuda
@pytest.mark.parametrize("seed", range(25))
def test_random_image_models_on_cuda_match_plain_autograd(seed: int) -> None:
    _train_and_compare(seed, RandomConvNet, "cuda")
