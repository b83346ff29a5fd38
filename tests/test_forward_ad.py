"""Forward-mode AD through patched modules in training mode: output tangents equal plain
autograd's (``forward_ad.dual_level`` and ``torch.func.jvp``) for every covered module type;
a training step beside it is unaffected; forward-over-reverse gives plain's input-gradient
tangents; what cannot be exact (tangents of weight gradients returned at once, a tangent's
own backward to the weights, a tangent on a parameter) is a "twobp:" error."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.autograd import forward_ad

import twobp_autograd as twobp
from tests.utils import TOLERANCES, assert_grads_match, assert_no_grads, patched_and_reference

DTYPE = torch.float64


class SelfAttention(nn.Module):
    """Self-attention with MultiheadAttention's default need_weights=True (its explicit softmax
    path: PyTorch has no forward derivative for the CPU SDPA kernel, plain autograd refuses it)."""

    def __init__(self, return_weights: bool = False) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(6, 2, batch_first=True)
        self.return_weights = return_weights

    def forward(self, x: Tensor) -> Tensor:
        output, weights = self.attention(x, x, x)
        return torch.cat([output.flatten(), weights.flatten()]) if self.return_weights else output


class CrossAttention(nn.Module):
    """Keys and values of other widths and without tangents: the in-projection's tap has
    three outputs, two of them with no tangent."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(6, 2, kdim=5, vdim=3, batch_first=True)
        self.register_buffer("key", torch.randn(2, 4, 5))
        self.register_buffer("value", torch.randn(2, 4, 3))

    def forward(self, x: Tensor) -> Tensor:
        return self.attention(x, self.key, self.value)[0]


class ScaledEmbedding(nn.Module):
    """An embedding has integer inputs, so no tangent of its own: it meets one downstream."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 6)
        self.register_buffer("indices", torch.randint(0, 10, (3, 4)))

    def forward(self, x: Tensor) -> Tensor:
        return self.embedding(self.indices) * x


#: name -> (module factory, input shape)
MODULES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "Linear": (lambda: nn.Linear(6, 5), (3, 4, 6)),
    "Conv1d": (lambda: nn.Conv1d(3, 4, 3, padding=1), (2, 3, 7)),
    "Conv2d": (lambda: nn.Conv2d(3, 4, 3, stride=2), (2, 3, 7, 7)),
    "Conv3d": (lambda: nn.Conv3d(2, 3, 2), (2, 2, 4, 4, 4)),
    "ConvTranspose1d": (lambda: nn.ConvTranspose1d(3, 4, 3, stride=2), (2, 3, 5)),
    "ConvTranspose2d": (lambda: nn.ConvTranspose2d(3, 2, 3, padding=1), (2, 3, 4, 4)),
    "ConvTranspose3d": (lambda: nn.ConvTranspose3d(2, 2, 2, stride=2), (2, 2, 3, 3, 3)),
    "BatchNorm1d": (lambda: nn.BatchNorm1d(3), (5, 3, 4)),
    "BatchNorm2d": (lambda: nn.BatchNorm2d(3), (4, 3, 3, 3)),
    "BatchNorm3d": (lambda: nn.BatchNorm3d(2, affine=False), (3, 2, 2, 2, 2)),
    "LayerNorm": (lambda: nn.LayerNorm(6), (3, 4, 6)),
    "GroupNorm": (lambda: nn.GroupNorm(2, 4), (3, 4, 5)),
    "InstanceNorm2d": (lambda: nn.InstanceNorm2d(3, affine=True, track_running_stats=True), (2, 3, 4, 4)),
    "RMSNorm": (lambda: nn.RMSNorm(6), (3, 4, 6)),
    "MultiheadAttention": (SelfAttention, (2, 5, 6)),
    "MultiheadAttention-weights": (lambda: SelfAttention(return_weights=True), (2, 5, 6)),
    "MultiheadAttention-cross": (CrossAttention, (2, 5, 6)),
    "Embedding": (ScaledEmbedding, (3, 4, 6)),
}


def model_and_input(name: str) -> tuple[nn.Module, Tensor]:
    make, shape = MODULES[name]
    # BatchNorm3d without affine parameters: a trainable layer in front makes it patched.
    model = nn.Sequential(nn.Conv3d(2, 2, 1), make()) if name == "BatchNorm3d" else make()
    return model.to(DTYPE), torch.randn(shape, dtype=DTYPE)


def assert_close(actual: Tensor, expected: Tensor) -> None:
    rtol, atol = TOLERANCES[DTYPE]
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def dual_output(model: nn.Module, x: Tensor, tangent: Tensor) -> tuple[Tensor, Tensor]:
    with forward_ad.dual_level():
        primal, output_tangent = forward_ad.unpack_dual(model(forward_ad.make_dual(x, tangent)))
    assert output_tangent is not None
    return primal, output_tangent


@pytest.mark.parametrize("name", list(MODULES))
def test_dual_level_tangent_matches_plain(name):
    model, x = model_and_input(name)
    patched, reference = patched_and_reference(model)
    tangent = torch.randn_like(x)
    for got, want in zip(dual_output(patched, x, tangent), dual_output(reference, x, tangent), strict=True):
        assert_close(got, want)
    for (buffer_name, got), (_, want) in zip(patched.named_buffers(), reference.named_buffers(), strict=True):
        assert torch.equal(got, want), buffer_name  # BatchNorm's running statistics, updated once
    assert twobp.pending().jobs == 0


@pytest.mark.parametrize("name", list(MODULES))
def test_func_jvp_matches_plain(name):
    """Inside torch.func transforms patched modules take their plain forward."""
    model, x = model_and_input(name)
    patched, reference = patched_and_reference(model)
    for m in (patched, reference):
        torch.func.replace_all_batch_norm_modules_(m)  # torch.func cannot update running stats
    tangent = torch.randn_like(x)
    expected = torch.func.jvp(reference, (x,), (tangent,))
    for got, want in zip(torch.func.jvp(patched, (x,), (tangent,)), expected, strict=True):
        assert_close(got, want)


def net(group_norm: bool = True) -> nn.Module:
    """Every covered family in one model: conv, BatchNorm, linear, attention, norms."""
    return nn.Sequential(
        nn.Conv2d(2, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(inplace=True),
        nn.Flatten(2),  # (batch, 4 positions, 9 features)
        nn.Linear(9, 6),
        SelfAttention(),
        nn.LayerNorm(6),
        nn.GroupNorm(2, 4) if group_norm else nn.Identity(),
        nn.RMSNorm(6),
        nn.Linear(6, 2),
    ).to(DTYPE)


def net_input() -> Tensor:
    return torch.randn(3, 2, 5, 5, dtype=DTYPE)


@pytest.mark.parametrize("where", ["after-the-dual-level", "inside-the-dual-level"])
def test_training_step_without_dual_tensors_is_unaffected(where):
    """A forward-mode evaluation (a Jacobian-vector product for a metric) beside a training
    step with no dual tensors: the step queues its work and ends with plain's gradients."""
    patched, reference = patched_and_reference(net())
    x, tangent = net_input(), net_input()
    for model in (patched, reference):
        with forward_ad.dual_level():
            model(forward_ad.make_dual(x, tangent))
            if where == "inside-the-dual-level":
                model(x).pow(2).sum().backward()
        if where == "after-the-dual-level":
            model(x).pow(2).sum().backward()
    assert twobp.pending().jobs > 0
    assert_no_grads(patched)
    twobp.flush_weight_grads()
    assert twobp.pending().jobs == 0
    assert_grads_match(patched, reference, DTYPE)


def test_backward_of_dual_outputs_defers_and_matches_plain():
    """backward() inside the dual level on tensors that carry tangents: the weight gradients
    are deferred and equal plain's (autograd's .grad keeps no tangent either). (GroupNorm's
    backward has no forward derivative in PyTorch: plain refuses it.)"""
    patched, reference = patched_and_reference(net(group_norm=False))
    for _ in range(2):
        x, tangent = net_input(), net_input()
        for model in (patched, reference):
            with forward_ad.dual_level():
                model(forward_ad.make_dual(x, tangent)).pow(3).sum().backward()
    assert_no_grads(patched)
    twobp.flush_weight_grads()
    assert twobp.pending().jobs == 0
    assert_grads_match(patched, reference, DTYPE)
    for p in reference.parameters():
        assert forward_ad.unpack_dual(p.grad).tangent is None


def test_backward_of_dual_outputs_to_a_hooked_weight_is_refused_naming_the_hook():
    """A tensor-hooked weight (wandb.watch's kind) inside a dual level: its gradient goes into
    .grad, where the tangent is dropped, but the hook is handed it on the way, and a tangent made
    from the saved activations alone is wrong (1.05 off where the refusal was lifted). Refused,
    naming the hook, where the refusal said to call backward(), which had been called."""
    model = twobp.patch(net(group_norm=False))
    model[0].weight.register_hook(lambda g: g * 2)
    with forward_ad.dual_level(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the hooked weight is not deferred: warned
        output = model(forward_ad.make_dual(net_input(), net_input()))
        with pytest.raises(RuntimeError, match="twobp: a backward inside a forward-mode dual level reaches a weight"):
            output.pow(3).sum().backward()
    twobp.discard_weight_grads()


def input_gradient(model: nn.Module, x: Tensor, tangent: Tensor) -> tuple[Tensor, Tensor]:
    """Forward-over-reverse: the input gradient of a cubic loss and its tangent (a
    Hessian-vector product)."""
    leaf = x.clone().requires_grad_()
    with forward_ad.dual_level():
        output = model(forward_ad.make_dual(leaf, tangent))
        (gradient,) = torch.autograd.grad(output.pow(3).sum(), leaf)
        primal, gradient_tangent = forward_ad.unpack_dual(gradient)
    assert gradient_tangent is not None
    return primal, gradient_tangent


#: PyTorch has no forward derivative for native_group_norm_backward: plain autograd refuses too.
FORWARD_OVER_REVERSE = [name for name in MODULES if name not in ("GroupNorm",)]


@pytest.mark.parametrize("name", FORWARD_OVER_REVERSE)
def test_forward_over_reverse_input_gradient_matches_plain(name):
    model, x = model_and_input(name)
    patched, reference = patched_and_reference(model)
    tangent = torch.randn_like(x)
    for got, want in zip(input_gradient(patched, x, tangent), input_gradient(reference, x, tangent), strict=True):
        assert_close(got, want)
    assert twobp.pending().jobs == 0


def weight_gradients(
    model: nn.Module, x: Tensor, tangent: Tensor, weights: list[Tensor]
) -> list[tuple[Tensor, Tensor]]:
    with forward_ad.dual_level():
        output = model(forward_ad.make_dual(x, tangent))
        gradients = torch.autograd.grad(output.pow(3).sum(), weights)
        return [tuple(forward_ad.unpack_dual(g)) for g in gradients]


def test_forward_over_reverse_batch_norm_weight_gradient_matches_plain():
    """BatchNorm's weight gradients come out of backward-p1's own call, which recomputes the
    batch statistics with their tangents for it."""
    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).to(DTYPE))
    x = torch.randn(5, 3, dtype=DTYPE)
    tangent = torch.randn_like(x)
    got = weight_gradients(patched, x, tangent, [patched[1].weight, patched[1].bias])
    want = weight_gradients(reference, x, tangent, [reference[1].weight, reference[1].bias])
    for (primal, gradient_tangent), (want_primal, want_tangent) in zip(got, want, strict=True):
        assert_close(primal, want_primal)
        assert_close(gradient_tangent, want_tangent)


def test_forward_over_reverse_weight_gradient_of_a_tap_is_refused():
    model = twobp.patch(nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2)).to(DTYPE))
    x = torch.randn(5, 3, dtype=DTYPE)
    with pytest.raises(RuntimeError, match="twobp: forward-over-reverse"):
        weight_gradients(model, x, torch.randn_like(x), [model[0].weight])
    assert twobp.pending().jobs == 0


@pytest.mark.parametrize("name", ["Linear", "BatchNorm2d", "MultiheadAttention"])
def test_backward_through_a_tangent_to_the_weights_is_refused(name):
    """Reverse-over-forward (a loss on a Jacobian-vector product): the tangent was computed
    from detached weights, so the weights' share of its gradient would be missing."""
    model, x = model_and_input(name)
    patched = twobp.patch(model)
    _, output_tangent = dual_output(patched, x, torch.randn_like(x))
    with pytest.raises(RuntimeError, match="twobp: backward through a forward-mode AD tangent"):
        output_tangent.pow(2).sum().backward()


def test_backward_through_a_tangent_to_the_input_only_matches_plain():
    """The same loss differentiated for the input alone needs no weight: plain's gradient."""
    patched, reference = patched_and_reference(
        nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.LayerNorm(6), nn.Linear(6, 3)).to(DTYPE)
    )
    x = torch.randn(4, 6, dtype=DTYPE)
    tangent = torch.randn_like(x)
    gradients = []
    for model in (patched, reference):
        leaf = x.clone().requires_grad_()
        _, output_tangent = dual_output(model, leaf, tangent)
        gradients.append(torch.autograd.grad(output_tangent.pow(2).sum(), leaf)[0])
    assert_close(*gradients)
    assert twobp.pending().jobs == 0


def test_backward_through_a_batch_norm_tangent_to_the_input_is_refused():
    """BatchNorm's tangent is taken on detached copies of its input as well: the input's share
    of a gradient through it would be missing too."""
    model = twobp.patch(nn.BatchNorm1d(3).to(DTYPE))
    leaf = torch.randn(5, 3, dtype=DTYPE, requires_grad=True)
    _, output_tangent = dual_output(model, leaf, torch.randn(5, 3, dtype=DTYPE))
    with pytest.raises(RuntimeError, match="twobp: backward through a forward-mode AD tangent"):
        torch.autograd.grad(output_tangent.pow(2).sum(), leaf)


def test_tangent_on_a_deferred_parameter_is_refused():
    """A dual tensor as a parameter (functional_call outside torch.func): the op runs on the
    detached parameter, which would drop its tangent."""
    model = twobp.patch(nn.Linear(3, 2).to(DTYPE))
    with forward_ad.dual_level():
        weight = forward_ad.make_dual(model.weight.detach(), torch.randn(2, 3, dtype=DTYPE))
        with pytest.raises(RuntimeError, match="twobp: a forward-mode AD tangent on a parameter"):
            torch.func.functional_call(model, {"weight": weight}, (torch.randn(4, 3, dtype=DTYPE),))


def test_tangent_on_a_batch_norm_parameter_matches_plain():
    """BatchNorm's own Function takes its parameters as inputs: their tangents count."""
    patched, reference = patched_and_reference(nn.BatchNorm1d(3).to(DTYPE))
    x = torch.randn(5, 3, dtype=DTYPE)
    weight_tangent = torch.randn(3, dtype=DTYPE)
    results = []
    for model in (patched, reference):
        with forward_ad.dual_level():
            weight = forward_ad.make_dual(model.weight.detach(), weight_tangent)
            output = torch.func.functional_call(model, {"weight": weight}, (x,))
            results.append(forward_ad.unpack_dual(output))
    for got, want in zip(*results, strict=True):
        assert_close(got, want)
