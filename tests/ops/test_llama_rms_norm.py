"""Hugging Face's LlamaRMSNorm (and the classes that copy its forward) under
``twobp.ops.llama_rms_norm``: mixed precision against plain autograd, the rule ``defer_norms``
picks, and classes that only look alike kept on plain autograd. The norm settings' checks
(tests/ops/test_norm.py) run it too."""

from __future__ import annotations

import copy
import importlib
import types

import pytest
import torch
from torch import nn

import twobp_autograd as twobp
from tests.ops.norm_settings import HUGGING_FACE_RMS_NORM, cubic_loss
from tests.utils import TOLERANCES, assert_grads_match, patched_and_reference
from twobp_autograd import warn_once
from twobp_autograd.ops import computes_like_llama_rms_norm, llama_rms_norm

llama = pytest.importorskip("transformers.models.llama.modeling_llama")
mamba = pytest.importorskip("transformers.models.mamba.modeling_mamba")
LlamaRMSNorm, MambaRMSNorm = llama.LlamaRMSNorm, mamba.MambaRMSNorm


@pytest.fixture(autouse=True)
def registered() -> None:
    twobp.register((LlamaRMSNorm, MambaRMSNorm), llama_rms_norm)  # undone by conftest's scoped_registrations


@pytest.mark.parametrize("strategy", ["concat", "loop"])
def test_bf16_input_fp32_weight_as_in_a_mixed_precision_llama(strategy: str) -> None:
    """A bf16 activation meets the fp32 weight (the product is fp32); the flush's sum is no
    further from an fp64 reference than plain autograd's."""
    module = HUGGING_FACE_RMS_NORM[0].module(torch.float32)
    exact = copy.deepcopy(module).double()
    patched, reference = patched_and_reference(module)
    queue = twobp.WeightGradQueue(strategy)
    for batch in (16, 16, 16, 16):
        x = torch.randn(batch, 7, 8).to(torch.bfloat16)
        with twobp.use_queue(queue):
            out = patched(x)
        plain = reference(x)
        assert out.dtype == plain.dtype == torch.float32 and torch.equal(out, plain)
        grad = torch.randn_like(out)
        out.backward(grad)
        plain.backward(grad)
        exact(x.double()).backward(grad.double())
    queue.flush()
    ours = (patched.weight.grad.double() - exact.weight.grad).abs().max()
    theirs = (reference.weight.grad.double() - exact.weight.grad).abs().max()
    assert ours <= 1.5 * theirs + TOLERANCES[torch.float32][1], (ours, theirs)


def test_defer_norms_picks_this_rule_for_llama_and_mamba() -> None:
    from twobp_autograd.pipeline.split import defer_norms
    from twobp_autograd.registry import rule_for, unregister

    unregister((LlamaRMSNorm, MambaRMSNorm))
    config = llama.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    model = llama.LlamaForCausalLM(config)
    assert defer_norms(model) == [LlamaRMSNorm]
    rule = rule_for(LlamaRMSNorm(8))
    assert rule is not None and rule.forward is llama_rms_norm


class LookAlikeRMSNorm(nn.Module):
    """Named and shaped like Llama's, but scaling by 1 + weight (as Gemma's does)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.variance_epsilon = 1e-6

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        upcast = hidden_states.float()
        normed = upcast * torch.rsqrt(upcast.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (1 + self.weight) * normed.type_as(hidden_states)


def test_a_class_with_another_forward_keeps_plain_autograd_and_its_gradients() -> None:
    assert computes_like_llama_rms_norm(LlamaRMSNorm) and computes_like_llama_rms_norm(MambaRMSNorm)
    assert not computes_like_llama_rms_norm(LookAlikeRMSNorm)
    assert not computes_like_llama_rms_norm(nn.RMSNorm)
    twobp.register(LookAlikeRMSNorm, llama_rms_norm)
    _assert_kept_on_plain_autograd(LookAlikeRMSNorm(8))


def _assert_kept_on_plain_autograd(module: nn.Module) -> None:
    """Patched, ``module`` warns, computes its own forward and takes its gradient in backward."""
    with torch.no_grad():
        module.weight.uniform_(0.5, 1.5)  # away from 0: 1 + w and w tell apart
    patched, reference = patched_and_reference(module)
    x = torch.randn(3, 5, 8)
    with pytest.warns(UserWarning, match="other than LlamaRMSNorm's"):
        out = patched(x)
    torch.testing.assert_close(out, reference(x), rtol=0, atol=0)
    cubic_loss(out).backward()
    cubic_loss(reference(x)).backward()
    assert twobp.pending().jobs == 0, "nothing deferred: plain autograd took the weight gradient"
    assert_grads_match(patched, reference, torch.float32)


def test_a_class_whose_forward_is_replaced_after_its_verdict_is_judged_again() -> None:
    """The verdict was kept per class: a class judged Llama-like whose forward was then replaced
    by a Gemma-style one, and registered again, was computed as Llama's (13 off, silently)."""

    class CopiedRMSNorm(LookAlikeRMSNorm):
        forward = LlamaRMSNorm.forward  # Llama's code: this rule applies

    twobp.register(CopiedRMSNorm, llama_rms_norm)
    assert computes_like_llama_rms_norm(CopiedRMSNorm)
    CopiedRMSNorm.forward = LookAlikeRMSNorm.forward  # type: ignore[method-assign]
    twobp.register(CopiedRMSNorm, llama_rms_norm)
    assert not computes_like_llama_rms_norm(CopiedRMSNorm)
    _assert_kept_on_plain_autograd(CopiedRMSNorm(8))


def test_a_forward_whose_code_is_swapped_in_place_is_judged_again() -> None:
    """The same function object, another body (``forward.__code__ = ...``)."""
    llama_forward = types.FunctionType(LlamaRMSNorm.forward.__code__, LlamaRMSNorm.forward.__globals__)

    class SwappedRMSNorm(LookAlikeRMSNorm):
        forward = llama_forward

    twobp.register(SwappedRMSNorm, llama_rms_norm)
    assert computes_like_llama_rms_norm(SwappedRMSNorm)
    llama_forward.__code__ = LookAlikeRMSNorm.forward.__code__
    assert not computes_like_llama_rms_norm(SwappedRMSNorm)
    _assert_kept_on_plain_autograd(SwappedRMSNorm(8))


def test_defer_norms_finds_the_rms_norms_of_any_model() -> None:
    """Outside the families this package splits (Qwen2, Mistral, Gemma, T5, a model of one's own):
    each unregistered class named *RMSNorm or *LayerNorm, by the Llama rule where it computes as Llama's does,
    else by the recompute rule; no family needed, and the gradients are plain's."""
    from twobp_autograd.pipeline.split import defer_norms
    from twobp_autograd.registry import rule_for

    qwen2 = pytest.importorskip("transformers.models.qwen2.modeling_qwen2")
    config = qwen2.Qwen2Config(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    assert defer_norms(qwen2.Qwen2Model(config)) == [qwen2.Qwen2RMSNorm]
    rule = rule_for(qwen2.Qwen2RMSNorm(8))
    assert rule is not None and rule.forward is llama_rms_norm

    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")  # an RMS norm named T5LayerNorm
    config = t5.T5Config(vocab_size=16, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2, dropout_rate=0.0)
    encoder = t5.T5EncoderModel(config).double()
    assert defer_norms(encoder) == [t5.T5LayerNorm]
    rule = rule_for(t5.T5LayerNorm(8))
    assert rule is not None and rule.forward is twobp.ops.recompute_rowwise
    patched, reference = patched_and_reference(encoder)
    ids = torch.randint(0, 16, (2, 5))
    for m in (patched, reference):
        cubic_loss(m(input_ids=ids).last_hidden_state).backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)

    model = nn.Sequential(nn.Linear(8, 8), LookAlikeRMSNorm(8), nn.Linear(8, 2)).double()
    assert defer_norms(model) == [LookAlikeRMSNorm]
    rule = rule_for(model[1])
    assert rule is not None and rule.forward is twobp.ops.recompute_rowwise
    patched, reference = patched_and_reference(model)
    for _ in range(2):
        x = torch.randn(3, 5, 8, dtype=torch.float64)
        for m in (patched, reference):
            cubic_loss(m(x)).backward()
    assert twobp.pending().jobs == 6
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)


def test_a_first_call_under_a_meta_default_device_is_judged_on_the_cpu(monkeypatch) -> None:
    """A shape estimate on a meta-built model made the process's first call: the check built
    its reference and inputs on meta, where torch.equal has no kernel (NotImplementedError)."""
    monkeypatch.setattr(importlib.import_module("twobp_autograd.ops.llama_rms_norm"), "_verdicts", {})
    with torch.device("meta"):
        norm = twobp.patch(LlamaRMSNorm(8))
        output = norm(torch.randn(2, 3, 8, requires_grad=True))
        output.sum().backward()
    assert output.device.type == "meta" and twobp.pending().jobs == 1
    twobp.discard_weight_grads()


@pytest.mark.parametrize("weight_shape", [(1, 8), (1, 1, 8), (1,)], ids=str)
def test_a_weight_that_broadcasts_keeps_plain_autograd_and_its_gradients(
    weight_shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A weight of shape (1, H) (or one value for all features) broadcasts in Llama's forward:
    the kernel summed the rows to (H,), which the flush refused for the weight's shape."""
    monkeypatch.setattr(warn_once, "given", set())  # each reason warns once per process
    module = LlamaRMSNorm(8).double()
    module.weight = nn.Parameter(torch.rand(weight_shape, dtype=torch.float64) + 0.5)
    patched, reference = patched_and_reference(module)
    inputs = [torch.randn(3, 5, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)]
    with pytest.warns(UserWarning, match="a weight other than one value per feature"):
        outputs = [patched(x) for x in inputs]
    for x, out in zip(inputs, outputs, strict=True):
        plain = reference(x)
        torch.testing.assert_close(out, plain, rtol=0, atol=0)
        cubic_loss(out).backward()
        cubic_loss(plain).backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)
