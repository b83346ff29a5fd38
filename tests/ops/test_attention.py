"""nn.MultiheadAttention against plain autograd: self/encoder-decoder/distinct inputs, packed and
separate projections, batch_first, unbatched, every mask kind, is_causal, dropout, add_bias_kv,
add_zero_attn, need_weights both ways, and the module-level contract."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import twobp_autograd as twobp
from tests.utils import TOLERANCES, assert_grads_match, assert_no_grads, check_against_autograd

BATCH, TGT, SRC, EMBED, HEADS = 2, 3, 4, 8, 2


class Attend(nn.Module):
    """Calls the attention with the inputs ``kind`` says and fixed keyword arguments. Each call
    re-seeds the RNG from a per-copy counter, so a plain deep copy draws the same dropout masks."""

    def __init__(self, attention: nn.MultiheadAttention, kind: str, call_kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.attention = attention
        self.kind = kind
        self.call_kwargs = call_kwargs
        self.calls = 0

    def forward(self, query: Tensor, memory: Tensor, value: Tensor) -> tuple[Tensor, Tensor | None]:
        torch.manual_seed(1000 + self.calls)
        self.calls += 1
        if self.kind == "self":
            return self.attention(query, query, query, **self.call_kwargs)
        if self.kind == "memory":
            return self.attention(query, memory, memory, **self.call_kwargs)
        return self.attention(query, memory, value, **self.call_kwargs)


# -- masks: never a fully masked row (key 0 stays visible), so no NaN on either side ----------


def _visible_first_key(mask: Tensor) -> Tensor:
    mask[..., 0] = False
    return mask


def _as_float(mask: Tensor, dtype: torch.dtype) -> Tensor:
    return (0.5 * torch.randn(mask.shape, dtype=dtype)).masked_fill(mask, float("-inf"))


def key_padding(tgt: int, src: int, batched: bool) -> Tensor:
    mask = torch.zeros(BATCH, src, dtype=torch.bool)
    mask[0, -1] = True
    mask[1, 1] = True
    return mask if batched else mask[0]


def attn_2d(tgt: int, src: int, batched: bool) -> Tensor:
    mask = torch.zeros(tgt, src, dtype=torch.bool)
    mask[0, 1] = True
    mask[-1, -1] = True
    return mask


def attn_3d(tgt: int, src: int, batched: bool) -> Tensor:
    return _visible_first_key(torch.rand((BATCH if batched else 1) * HEADS, tgt, src) > 0.6)


def causal(tgt: int, src: int, batched: bool) -> Tensor:
    return torch.ones(tgt, src, dtype=torch.bool).triu(1)


MaskMaker = Callable[[int, int, bool], Tensor]


@dataclass(frozen=True)
class Setting:
    id: str
    module_kwargs: dict[str, Any] = field(default_factory=dict)
    kind: str = "self"  # "self": q is k is v; "memory": k is v; "distinct": three tensors
    batched: bool = True
    key_padding_mask: MaskMaker | None = None
    attn_mask: MaskMaker | None = None
    float_masks: bool = False
    is_causal: bool = False

    def make_module(self, dtype: torch.dtype) -> nn.MultiheadAttention:
        return nn.MultiheadAttention(EMBED, HEADS, **self.module_kwargs).to(dtype)

    def call_kwargs(self, dtype: torch.dtype, need: dict[str, bool]) -> dict[str, Any]:
        src = TGT if self.kind == "self" else SRC
        kwargs: dict[str, Any] = dict(need, is_causal=self.is_causal)
        for name in ("key_padding_mask", "attn_mask"):
            maker = getattr(self, name)
            if maker is not None:
                mask = maker(TGT, src, self.batched)
                kwargs[name] = _as_float(mask, dtype) if self.float_masks else mask
        return kwargs

    def make_inputs(self, module: nn.MultiheadAttention, dtype: torch.dtype) -> Callable[[], tuple[Tensor, ...]]:
        src = TGT if self.kind == "self" else SRC

        def shaped(seq: int, features: int, requires_grad: bool) -> Tensor:
            if not self.batched:
                shape: tuple[int, ...] = (seq, features)
            else:
                shape = (BATCH, seq, features) if module.batch_first else (seq, BATCH, features)
            return torch.randn(shape, dtype=dtype, requires_grad=requires_grad)

        def make() -> tuple[Tensor, ...]:
            return (
                shaped(TGT, EMBED, True),
                shaped(src, module.kdim, self.kind != "self"),
                shaped(src, module.vdim, self.kind == "distinct"),
            )

        return make


SETTINGS = [
    Setting("self"),
    Setting("self-batch-first", dict(batch_first=True)),
    Setting("memory", kind="memory"),
    Setting("memory-batch-first", dict(batch_first=True), kind="memory"),
    Setting("distinct", kind="distinct"),
    Setting("distinct-batch-first", dict(batch_first=True), kind="distinct"),
    Setting("kdim-vdim", dict(kdim=5, vdim=6), kind="distinct"),
    Setting("kdim-vdim-batch-first", dict(kdim=5, vdim=6, batch_first=True), kind="distinct"),
    Setting("kdim-equals-vdim-memory", dict(kdim=5, vdim=5), kind="memory"),
    Setting("no-bias", dict(bias=False)),
    Setting("no-bias-memory", dict(bias=False), kind="memory"),
    Setting("no-bias-kdim-vdim", dict(bias=False, kdim=5, vdim=6), kind="distinct"),
    Setting("unbatched-self", batched=False),
    Setting("unbatched-memory-masks", kind="memory", batched=False, key_padding_mask=key_padding, attn_mask=attn_3d),
    Setting("unbatched-kdim-vdim", dict(kdim=5, vdim=6), kind="distinct", batched=False, key_padding_mask=key_padding),
    Setting("key-padding-bool", kind="memory", key_padding_mask=key_padding),
    Setting("key-padding-float", kind="memory", key_padding_mask=key_padding, float_masks=True),
    Setting("attn-mask-2d-bool", kind="memory", attn_mask=attn_2d),
    Setting("attn-mask-2d-float", kind="memory", attn_mask=attn_2d, float_masks=True),
    Setting("attn-mask-3d-bool", attn_mask=attn_3d),
    Setting("attn-mask-3d-float", dict(batch_first=True), attn_mask=attn_3d, float_masks=True),
    Setting("both-masks-bool", kind="distinct", key_padding_mask=key_padding, attn_mask=attn_2d),
    Setting("both-masks-float", kind="distinct", key_padding_mask=key_padding, attn_mask=attn_3d, float_masks=True),
    Setting("causal", attn_mask=causal, is_causal=True),
    Setting("causal-batch-first-float", dict(batch_first=True), attn_mask=causal, float_masks=True, is_causal=True),
    Setting("causal-key-padding", attn_mask=causal, key_padding_mask=key_padding, is_causal=True),
    Setting("dropout", dict(dropout=0.3)),
    Setting(
        "dropout-memory-masks", dict(dropout=0.3, batch_first=True), kind="memory",
        key_padding_mask=key_padding, attn_mask=attn_2d,
    ),
    Setting("bias-kv", dict(add_bias_kv=True)),
    Setting("zero-attn", dict(add_zero_attn=True)),
    Setting(
        "bias-kv-zero-attn-masks", dict(add_bias_kv=True, add_zero_attn=True), kind="memory",
        key_padding_mask=key_padding, attn_mask=attn_3d,
    ),
    Setting("bias-kv-kdim-vdim-batch-first", dict(add_bias_kv=True, kdim=5, vdim=6, batch_first=True), kind="distinct"),
    Setting("bias-kv-unbatched", dict(add_bias_kv=True, add_zero_attn=True), batched=False, attn_mask=attn_2d),
]

WEIGHTS = {
    "sdpa": dict(need_weights=False),
    "weights-averaged": dict(need_weights=True),
    "weights-per-head": dict(need_weights=True, average_attn_weights=False),
}
DTYPES = {"fp32": torch.float32, "fp64": torch.float64}

settings = pytest.mark.parametrize("setting", SETTINGS, ids=[s.id for s in SETTINGS])
weights = pytest.mark.parametrize("need", WEIGHTS.values(), ids=WEIGHTS.keys())
# Averaging over heads only changes what plain autograd does to the returned weights.
weights_for_grads = pytest.mark.parametrize(
    "need", [WEIGHTS["sdpa"], WEIGHTS["weights-averaged"]], ids=["sdpa", "weights"]
)
dtypes = pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())


def attend(
    setting: Setting, dtype: torch.dtype, need: dict[str, bool]
) -> tuple[Attend, Callable[[], tuple[Tensor, ...]]]:
    attention = setting.make_module(dtype)
    for name in ("in_proj_bias", "bias_k", "bias_v"):  # non-zero, so a mixed-up slice shows
        param = getattr(attention, name)
        if param is not None:
            nn.init.normal_(param)
    if attention.out_proj.bias is not None:
        nn.init.normal_(attention.out_proj.bias)
    model = Attend(attention, setting.kind, setting.call_kwargs(dtype, need))
    return model, setting.make_inputs(attention, dtype)


@settings
@weights_for_grads
@dtypes
def test_grads_match_plain_autograd(setting, need, dtype):
    model, make_inputs = attend(setting, dtype, need)
    check_against_autograd(model, make_inputs, micro_batches=3, dtype=dtype)


@settings
@weights
@dtypes
def test_outputs_weights_and_input_grads_match(setting, need, dtype):
    model, make_inputs = attend(setting, dtype, need)
    reference = copy.deepcopy(model)
    twobp.patch(model)
    inputs = make_inputs()
    twin = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    output, attn_weights = model(*inputs)
    expected, expected_weights = reference(*twin)
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(output, expected, rtol=rtol, atol=atol)
    if need["need_weights"]:
        torch.testing.assert_close(attn_weights, expected_weights, rtol=rtol, atol=atol)
    else:
        assert attn_weights is None and expected_weights is None
    torch.autograd.backward((output.sum(),), inputs=[t for t in inputs if t.requires_grad])
    torch.autograd.backward((expected.sum(),), inputs=[t for t in twin if t.requires_grad])
    for got, want in zip(inputs, twin, strict=True):
        if want.requires_grad:
            torch.testing.assert_close(got.grad, want.grad, rtol=rtol, atol=atol)
    assert twobp.pending().jobs == 0, "backward(inputs=...) not asking for weights queued work"


def test_dropout_draws_the_same_masks_as_plain():
    """Guards the dropout settings above: different seeds give different outputs, so equal
    outputs there mean the patched forward drew the same random numbers as plain."""
    attention = nn.MultiheadAttention(EMBED, HEADS, dropout=0.5)
    twobp.patch(attention)
    x = torch.randn(TGT, BATCH, EMBED)
    outputs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        outputs.append(attention(x, x, x, need_weights=False)[0])
    torch.testing.assert_close(outputs[0], outputs[1])
    assert not torch.allclose(outputs[0], outputs[2])


def test_micro_batches_of_different_shapes():
    """Rows of different batch sizes and sequence lengths concatenate in one flush."""
    model = nn.MultiheadAttention(EMBED, HEADS, kdim=5, vdim=6, add_bias_kv=True, batch_first=True)
    reference = copy.deepcopy(model)
    twobp.patch(model)
    for batch, tgt, src in [(2, 3, 4), (3, 5, 2), (1, 1, 6)]:
        q, k, v = torch.randn(batch, tgt, EMBED), torch.randn(batch, src, 5), torch.randn(batch, src, 6)
        for m in (model, reference):
            m(q, k, v)[0].pow(2).mean().backward()
    assert_no_grads(model)
    twobp.flush_weight_grads()
    assert_grads_match(model, reference)


UNREACHED_V = {
    "separate-projections": dict(kdim=5, vdim=6),
    "bias_kv": dict(add_bias_kv=True),
    "separate-projections-bias_kv": dict(kdim=5, vdim=6, add_bias_kv=True),
    "packed-cross-attention": dict(kdim=EMBED, vdim=EMBED),
}


@pytest.mark.parametrize("strategy", ["auto", "concat", "loop"])
@pytest.mark.parametrize("outputs_used", ["weights-only", "weights-then-both"])
@pytest.mark.parametrize("options", UNREACHED_V.values(), ids=UNREACHED_V.keys())
def test_a_value_path_no_backward_reaches_keeps_its_parameters_none(options, outputs_used, strategy):
    """A loss on the attention weights alone never reaches v: plain leaves v's own parameters
    (v_proj_weight, bias_v) None; the kernels were handed zeros for v and made zeros of them."""
    model = nn.MultiheadAttention(EMBED, HEADS, **options)
    reference = copy.deepcopy(model)
    twobp.patch(model)
    queue = twobp.WeightGradQueue(strategy)
    kdim = options.get("kdim", EMBED)
    losses = [lambda out, weights: weights.pow(2).sum()]
    if outputs_used == "weights-then-both":
        losses.append(lambda out, weights: out.pow(2).mean() + weights.sum())
    for loss in losses:
        q, k = torch.randn(TGT, BATCH, EMBED), torch.randn(SRC, BATCH, kdim)
        v = torch.randn(SRC, BATCH, options.get("vdim", EMBED)) if "vdim" in options else k
        for m in (model, reference):
            with twobp.use_queue(queue):
                loss(*m(q, k, v)).backward()
    queue.flush()
    assert_grads_match(model, reference)


def test_frozen_projection_keeps_no_grad():
    model = nn.MultiheadAttention(EMBED, HEADS, kdim=5, vdim=6)
    model.k_proj_weight.requires_grad_(False)
    model.out_proj.bias.requires_grad_(False)
    reference = copy.deepcopy(model)
    twobp.patch(model)
    q, k, v = torch.randn(TGT, BATCH, EMBED), torch.randn(SRC, BATCH, 5), torch.randn(SRC, BATCH, 6)
    for m in (model, reference):
        m(q, k, v)[0].pow(2).mean().backward()
    assert twobp.pending().jobs > 0
    twobp.flush_weight_grads()
    assert model.k_proj_weight.grad is None and model.out_proj.bias.grad is None
    assert_grads_match(model, reference)


AUTOCAST = [
    pytest.param("cpu", torch.bfloat16, id="cpu-bf16"),
    pytest.param(
        "cuda", torch.float16, id="cuda-fp16",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    ),
]


@pytest.mark.parametrize("device, autocast_dtype", AUTOCAST)
@pytest.mark.parametrize("need", [WEIGHTS["sdpa"], WEIGHTS["weights-averaged"]], ids=["sdpa", "weights"])
def test_autocast(device, autocast_dtype, need):
    model = nn.MultiheadAttention(EMBED, HEADS, batch_first=True, device=device)
    reference = copy.deepcopy(model)
    twobp.patch(model)
    x = torch.randn(BATCH, TGT, EMBED, device=device)
    memory = torch.randn(BATCH, SRC, EMBED, device=device)
    for m in (model, reference):
        with torch.autocast(device, dtype=autocast_dtype):
            outputs = m(x, x, x, **need) + m(x, memory, memory, **need)
        sum(t.float().pow(2).mean() for t in outputs if t is not None).backward()
    assert_no_grads(model)
    twobp.flush_weight_grads()
    assert_grads_match(model, reference, torch.bfloat16)  # the loosest tolerance: fp16 is tighter


@pytest.mark.parametrize("mode", ["eval", "no_grad", "unpatched"])
def test_plain_path_queues_nothing(mode):
    model = nn.MultiheadAttention(EMBED, HEADS)
    twobp.patch(model)
    if mode == "eval":
        model.eval()
    if mode == "unpatched":
        twobp.unpatch(model)
        assert "forward" not in vars(model) and "forward" not in vars(model.out_proj)
    x = torch.randn(TGT, BATCH, EMBED, requires_grad=True)
    if mode == "no_grad":
        with torch.no_grad():
            model(x, x, x)
        assert twobp.pending().jobs == 0
        return
    model(x, x, x)[0].sum().backward()
    assert twobp.pending().jobs == 0
    assert model.in_proj_weight.grad is not None and model.out_proj.weight.grad is not None


def test_patch_reports_attention_and_its_out_proj():
    model = nn.Sequential(nn.MultiheadAttention(EMBED, HEADS, add_bias_kv=True))
    report = twobp.patch(model, report=True)
    assert report.patched == ["0", "0.out_proj"] and report.skipped == {}


def test_out_proj_called_directly_is_a_linear():
    model = nn.MultiheadAttention(EMBED, HEADS).out_proj
    check_against_autograd(model, lambda: (torch.randn(5, EMBED),))


class Reseeded(nn.Module):
    """Re-seeds before each call from a per-copy counter (dropout layers draw alike in a copy)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, *inputs: Tensor) -> Tensor:
        torch.manual_seed(2000 + self.calls)
        self.calls += 1
        return self.inner(*inputs)


@pytest.mark.parametrize("batch_first", [False, True], ids=["seq-first", "batch-first"])
def test_inside_a_transformer_decoder_layer(batch_first):
    """Self-attention with a causal mask and encoder-decoder attention over a memory, with
    dropout everywhere, as nn.TransformerDecoderLayer calls them."""
    model = Reseeded(nn.TransformerDecoderLayer(EMBED, HEADS, dim_feedforward=16, dropout=0.2, batch_first=batch_first))
    reference = copy.deepcopy(model)
    report = twobp.patch(model, report=True)
    assert sum(name.endswith("attn") for name in report.patched) == 2
    mask = nn.Transformer.generate_square_subsequent_mask(TGT)
    for _ in range(3):
        shape = (BATCH, TGT, EMBED) if batch_first else (TGT, BATCH, EMBED)
        memory_shape = (BATCH, SRC, EMBED) if batch_first else (SRC, BATCH, EMBED)
        target, memory = torch.randn(shape), torch.randn(memory_shape)
        for m in (model, reference):
            m(target, memory, mask).pow(2).mean().backward()
    assert model.inner.self_attn.in_proj_weight.grad is None
    assert model.inner.multihead_attn.in_proj_weight.grad is None
    twobp.flush_weight_grads()
    assert_grads_match(model, reference)


class _DropConnect(nn.Module):
    """A parametrization drawing a fresh mask at every read."""

    def forward(self, weight: Tensor) -> Tensor:
        return weight * (torch.rand_like(weight) > 0.3)


@pytest.mark.filterwarnings("ignore:twobp. MultiheadAttention called with a parametrized weight")
@pytest.mark.parametrize("which", ["spectral-norm-in-proj", "drop-connect-in-proj", "drop-connect-out-proj"])
def test_a_parametrized_weight_read_as_often_as_plain_reads_it(which: str) -> None:
    """Plain's forward reads in_proj_weight three times in training (its fast-path checks), and
    a parametrization runs at each read: spectral_norm's power iteration moved its buffers on
    three times, a random mask drew three times. The deferred forward read it once: outputs,
    gradients (1e-4 to 2 off) and buffers apart, silently. Such a module keeps plain's forward."""
    torch.manual_seed(0)
    reference = nn.MultiheadAttention(8, 2, batch_first=True).double()
    patched = twobp.patch(copy.deepcopy(reference))
    for module in (patched, reference):
        torch.manual_seed(2)  # spectral_norm starts its power iteration from random vectors
        if which == "spectral-norm-in-proj":
            nn.utils.parametrizations.spectral_norm(module, "in_proj_weight")
        else:
            target = module.out_proj if which == "drop-connect-out-proj" else module
            name = "weight" if which == "drop-connect-out-proj" else "in_proj_weight"
            nn.utils.parametrize.register_parametrization(target, name, _DropConnect())
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    outputs = []
    for module in (patched, reference):
        torch.manual_seed(1)
        out = module(x, x, x)[0]
        out.pow(2).sum().backward()
        outputs.append(out)
    twobp.flush_weight_grads()
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)
    assert_grads_match(patched, reference, torch.float64)
    for (name, buffer), expected in zip(patched.named_buffers(), reference.buffers(), strict=True):
        torch.testing.assert_close(buffer, expected, rtol=0, atol=0, msg=name)
