"""Hugging Face's Conv1D (GPT-2's projections) under ``twobp.ops.hf_conv1d``: weight and bias
gradients against plain autograd (fp64, frozen parts, several micro-batches, bf16 autocast),
a whole GPT-2 deferred and equal, and classes with another forward kept on plain autograd."""

from __future__ import annotations

import copy
import importlib
import warnings

import pytest
import torch
from torch import nn

import twobp_autograd as twobp
from tests.utils import assert_grads_match, check_against_autograd, patched_and_reference
from twobp_autograd.ops import computes_like_hf_conv1d, hf_conv1d

pytorch_utils = pytest.importorskip("transformers.pytorch_utils")
Conv1D = pytorch_utils.Conv1D


@pytest.fixture(autouse=True)
def registered() -> None:
    twobp.register(Conv1D, hf_conv1d)  # undone by conftest's scoped_registrations


SETTINGS = {
    "rows": ((6, 5),),
    "sequences": ((2, 7, 5), (3, 4, 5)),
    "one-row": ((1, 5),),
}


@pytest.mark.parametrize("frozen", [None, "weight", "bias"])
@pytest.mark.parametrize("shapes", SETTINGS.values(), ids=SETTINGS.keys())
def test_weight_grads_match_autograd(shapes: tuple[tuple[int, ...], ...], frozen: str | None) -> None:
    layer = Conv1D(3, 5).double()
    if frozen is not None:
        getattr(layer, frozen).requires_grad_(False)
    inputs = iter(shapes * 2)
    check_against_autograd(
        layer,
        lambda: (torch.randn(next(inputs), dtype=torch.float64, requires_grad=True),),
        micro_batches=len(shapes) * 2,
        dtype=torch.float64,
    )


def test_bf16_autocast_is_no_further_from_fp64_than_plain() -> None:
    layer = Conv1D(16, 32)
    exact = copy.deepcopy(layer).double()
    patched, reference = patched_and_reference(layer)
    for _ in range(4):
        x = torch.randn(8, 6, 32)
        for model in (patched, reference):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(x).float().pow(2).sum().backward()
        exact(x.double()).pow(2).sum().backward()
    twobp.flush_weight_grads()
    for p, q, e in zip(patched.parameters(), reference.parameters(), exact.parameters(), strict=True):
        assert p.grad.dtype == q.grad.dtype == torch.float32
        ours, plain = (p.grad.double() - e.grad).norm(), (q.grad.double() - e.grad).norm()
        assert ours <= 1.5 * plain, (ours, plain)


def test_a_whole_gpt2_defers_every_projection_and_matches_plain() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, vocab_size=100, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config).double()
    reference = copy.deepcopy(model)
    report = twobp.patch(model, report=True)
    assert report.skipped == {}, str(report)
    for _ in range(3):
        ids = torch.randint(0, 100, (2, 8))
        for net in (model, reference):
            net(input_ids=ids, labels=ids).loss.backward()
    assert model.transformer.h[0].attn.c_attn.weight.grad is None  # deferred
    twobp.flush_weight_grads()
    assert_grads_match(model, reference, torch.float64)


def test_a_non_contiguous_input_fails_as_in_plain() -> None:
    patched, reference = patched_and_reference(Conv1D(3, 5))
    x = torch.randn(5, 3, 4).permute(2, 1, 0)  # (4, 3, 5), not viewable as rows
    for model in (patched, reference):
        with pytest.raises(RuntimeError, match="view"):
            model(x)


class ScaledConv1D(Conv1D):
    """Another forward: twice the product."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


def test_a_class_with_another_forward_keeps_plain_autograd_and_its_gradients() -> None:
    assert computes_like_hf_conv1d(Conv1D) and not computes_like_hf_conv1d(ScaledConv1D)
    twobp.register(ScaledConv1D, hf_conv1d)
    patched, reference = patched_and_reference(ScaledConv1D(3, 5))
    x = torch.randn(4, 5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        patched(x).sum().backward()
    reference(x).sum().backward()
    assert any("a forward other than Hugging Face's Conv1D's" in str(w.message) for w in caught)
    assert twobp.pending().jobs == 0
    assert_grads_match(patched, reference)


def test_unregistered_it_stays_on_plain_autograd() -> None:
    twobp.registry.unregister(Conv1D)
    report = twobp.patch(nn.Sequential(Conv1D(3, 5)), report=True)
    assert "0" in report.skipped


def test_the_first_call_leaves_the_random_stream_as_plain_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-time check builds a Conv1D, whose __init__ draws from the global generator: it
    shifted every later draw (GPT-2's dropout masks, 28 gradients apart from plain's)."""
    monkeypatch.setattr(importlib.import_module("twobp_autograd.ops.hf_conv1d"), "_verdicts", {})
    layer = twobp.patch(Conv1D(3, 5))
    state = torch.random.get_rng_state()
    layer(torch.ones(2, 5))
    assert torch.equal(torch.random.get_rng_state(), state)
    twobp.discard_weight_grads()


def test_a_first_call_under_fake_tensors_is_judged_on_real_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """A shape estimate under FakeTensorMode: the check's torch.equal raised on fake tensors, on
    every call (no verdict was kept)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(importlib.import_module("twobp_autograd.ops.hf_conv1d"), "_verdicts", {})
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        layer = twobp.patch(Conv1D(3, 5))
        out = layer(mode.from_tensor(torch.ones(2, 4, 5)))
    assert out.shape == (2, 4, 3) and computes_like_hf_conv1d(Conv1D)
    twobp.discard_weight_grads()


def test_a_stale_nf_fails_as_in_plain() -> None:
    """Conv1D shapes its output by nf: a weight replaced by one of another width fails there."""
    patched, reference = patched_and_reference(Conv1D(3, 5))
    for model in (patched, reference):
        model.weight, model.bias = nn.Parameter(torch.randn(5, 4)), nn.Parameter(torch.zeros(4))
        with pytest.raises(RuntimeError, match="is invalid"):
            model(torch.randn(2, 4, 5))


def test_patchs_report_names_the_rule_for_an_unregistered_conv1d() -> None:
    """GPT-2 patched without the registration: its projections were reported only as "not
    registered", where a subclass of a covered type is told its rule."""
    with twobp.registry.rules_restored_after():
        twobp.registry.unregister(Conv1D)
        report = twobp.patch(nn.Sequential(Conv1D(3, 4)), report=True)
    assert report.skipped["0"].endswith("twobp.register(Conv1D, twobp_autograd.ops.hf_conv1d)")


def test_a_suggestion_whose_judge_fails_leaves_patch_alone(monkeypatch) -> None:
    """The judge builds the reference class; where that raises, patch raised it (it asks for
    every unregistered class, report or not)."""

    def failing_init(self, *args, **kwargs):
        raise RuntimeError("a reference class that cannot be built")

    twobp.registry.unregister(Conv1D)
    layer = Conv1D(3, 4)
    monkeypatch.setattr(pytorch_utils.Conv1D, "__init__", failing_init)
    monkeypatch.setattr(importlib.import_module("twobp_autograd.ops.hf_conv1d"), "_verdicts", {})  # judged again
    report = twobp.patch(nn.Sequential(layer), report=True)
    assert report.skipped["0"].endswith("is not registered (plain autograd)")
