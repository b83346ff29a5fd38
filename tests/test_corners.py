"""Corners a user meets with every covered module, each against plain autograd on a deep copy:
empty batches, keyword calls, complex dtypes, nested (jagged) tensors, low-precision
parameters, non-contiguous / expanded / strided / channels_last inputs, unbatched inputs,
inputs that need no gradient or retain theirs, and an output modified in place by the next layer.

Wherever plain PyTorch raises, the patched module must raise the same kind of error; wherever
it does not, outputs, input gradients, ``.grad`` and buffers must match it, and no queue may
be left with work after the flush.
"""

from __future__ import annotations

import copy
import inspect
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import twobp_autograd as twobp
from tests.utils import TOLERANCES, assert_grads_match, assert_no_grads, patched_and_reference
from twobp_autograd import warn_once
from twobp_autograd.registry import rule_for

NUM_EMBEDDINGS = 10


@dataclass(frozen=True)
class Case:
    """One covered module type, called as its users call it."""

    id: str
    make: Callable[[], nn.Module]
    sample: tuple[int, ...]  # one sample's shape; the batch goes in front
    #: The names the module's forward gives the tensor it is called with (the same tensor for
    #: each: MultiheadAttention gets it as query, key and value).
    names: tuple[str, ...] = ("input",)

    @property
    def indices(self) -> bool:
        return isinstance(self.make(), (nn.Embedding, nn.EmbeddingBag))

    def module(self, dtype: torch.dtype = torch.float64) -> nn.Module:
        module = self.make()
        with torch.no_grad():  # away from ones and zeros, so every gradient depends on them
            for p in module.parameters():
                p.normal_(0.5, 0.5)
        return module.to(dtype)

    def input(self, shape: Sequence[int], dtype: torch.dtype = torch.float64, requires_grad: bool = True) -> Tensor:
        if self.indices:
            return torch.randint(0, NUM_EMBEDDINGS, tuple(shape))
        return torch.randn(tuple(shape), dtype=dtype).requires_grad_(requires_grad)

    def call(self, module: nn.Module, x: Tensor, by_keyword: bool = False) -> Tensor:
        """The module's main output (MultiheadAttention's first)."""
        out = module(**{name: x for name in self.names}) if by_keyword else module(*[x] * len(self.names))
        return out[0] if isinstance(out, tuple) else out


CASES = [
    Case("linear", lambda: nn.Linear(4, 3), (4,)),
    Case("linear-no-bias-sequences", lambda: nn.Linear(4, 3, bias=False), (2, 4)),
    # One feature: a 0-d input would pass as a row of one (plain refuses it).
    Case("linear-one-feature", lambda: nn.Linear(1, 3), (1,)),
    Case("conv1d", lambda: nn.Conv1d(3, 4, 3, padding=1), (3, 6)),
    Case("conv2d", lambda: nn.Conv2d(3, 4, 3, padding=1), (3, 5, 4)),
    Case("conv3d", lambda: nn.Conv3d(2, 3, 2), (2, 3, 4, 3)),
    Case("conv-transpose1d", lambda: nn.ConvTranspose1d(3, 4, 3, stride=2), (3, 5)),
    Case("conv-transpose2d", lambda: nn.ConvTranspose2d(3, 4, 3, stride=2), (3, 4, 3)),
    Case("conv-transpose3d", lambda: nn.ConvTranspose3d(2, 3, 2, stride=2), (2, 3, 2, 3)),
    Case("batch-norm1d", lambda: nn.BatchNorm1d(3), (3, 5)),
    Case("batch-norm2d", lambda: nn.BatchNorm2d(3), (3, 4, 5)),
    Case("batch-norm3d", lambda: nn.BatchNorm3d(2), (2, 3, 2, 4)),
    Case("layer-norm", lambda: nn.LayerNorm(4), (3, 4)),
    Case("group-norm", lambda: nn.GroupNorm(2, 4), (4, 3, 2)),
    Case("rms-norm", lambda: nn.RMSNorm(4), (3, 4), names=("x",)),
    Case(
        "multihead-attention", lambda: nn.MultiheadAttention(4, 2, batch_first=True), (3, 4), ("query", "key", "value")
    ),
    Case("embedding", lambda: nn.Embedding(NUM_EMBEDDINGS, 4, padding_idx=1), (3,)),
    Case("embedding-bag", lambda: nn.EmbeddingBag(NUM_EMBEDDINGS, 4, mode="max", padding_idx=1), (3,)),
]
CASE_BY_ID = {case.id: case for case in CASES}
cases = pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])


def pick(*ids: str) -> Any:
    return pytest.mark.parametrize("case", [CASE_BY_ID[i] for i in ids], ids=list(ids))


def test_every_case_is_a_covered_type() -> None:
    for case in CASES:
        assert rule_for(case.make()) is not None, case.id


# -- the comparison ------------------------------------------------------------------------

Forward = Callable[[nn.Module, Tensor], Tensor]
Prepare = Callable[[Tensor], Tensor]


def _loss(output: Tensor) -> Tensor:
    # Cubic, not squared: over a normalised output sum(y^2) is nearly constant. Summed over
    # at least one element, so an empty output gives 0, not NaN.
    values = output.values() if output.is_nested else output
    if values.is_complex():
        values = torch.view_as_real(values)
    values = values.to(torch.promote_types(values.dtype, torch.float32))  # bf16/fp16 summed in fp32
    return (values**3).sum() / max(values.numel(), 1)


def _dense(t: Tensor) -> Tensor:
    return t.values() if t.is_nested else t


@dataclass
class Side:
    outputs: list[Tensor]
    input_grads: list[Tensor | None]
    error: type[BaseException] | None = None


def _run(
    model: nn.Module, leaves: list[Tensor], prepare: Prepare, forward: Forward, queue: twobp.WeightGradQueue
) -> Side:
    """Every micro-batch's forward and backward (no flush); the kind of error if one raised,
    else the outputs and the gradients of the leaves and of retained inputs."""
    side = Side([], [])
    try:
        with twobp.use_queue(queue):
            for leaf in leaves:
                x = prepare(leaf)
                output = forward(model, x)
                _loss(output).backward()
                side.outputs.append(output.detach())
                side.input_grads += [leaf.grad, x.grad if x.retains_grad else None]
    except Exception as error:  # the kind is what is compared
        side.error = type(error)
    return side


def assert_like_plain(
    model: nn.Module,
    make_leaves: Callable[[], list[Tensor]],
    *,
    forward: Forward,
    prepare: Prepare = lambda leaf: leaf,
    dtype: torch.dtype = torch.float64,
    deferred: bool = True,
) -> type[BaseException] | None:
    """Micro-batches through ``model`` patched and through a plain deep copy, with equal
    inputs (``make_leaves`` is called under the same seed for each). ``deferred``: the patched
    side must have queued weight work (else: it took the plain path and queued none).
    ``dtype``: the precision computed in, for the tolerance. Returns the kind of error plain raised,
    or None."""
    patched, reference = patched_and_reference(model)
    torch.manual_seed(1)
    plain = _run(reference, make_leaves(), prepare, forward, twobp.WeightGradQueue())
    queue = twobp.WeightGradQueue("concat")  # every kernel that can join micro-batches does
    torch.manual_seed(1)
    ours = _run(patched, make_leaves(), prepare, forward, queue)
    try:
        _assert_sides_agree(patched, reference, plain, ours, queue, dtype, deferred)
    finally:
        queue.clear()  # a failed check leaves no work behind
    return plain.error


def _assert_sides_agree(
    patched: nn.Module, reference: nn.Module, plain: Side, ours: Side, queue: twobp.WeightGradQueue,
    dtype: torch.dtype, deferred: bool,
) -> None:
    if plain.error is not None:
        if ours.error is None:
            queue.flush()  # an error the flush raises counts as the patched module's
        assert ours.error is plain.error, f"plain raised {plain.error.__name__}, patched {ours.error}"
        return
    assert ours.error is None, f"plain autograd ran, the patched module raised {ours.error}"
    rtol, atol = _tolerance(dtype)
    for got, want in zip(ours.outputs + ours.input_grads, plain.outputs + plain.input_grads, strict=True):
        assert (got is None) == (want is None)
        if want is not None:
            assert got.is_nested == want.is_nested
            got, want = _dense(got), _dense(want)
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol * _scale([want], dtype))  # dtype, shape too
    if deferred:
        assert_no_grads(patched)
        assert queue.pending().jobs > 0, "nothing was queued: the call took the plain path"
    else:
        assert queue.pending().jobs == 0, "a call that should keep plain autograd queued work"
    queue.flush()
    assert queue.pending().jobs == 0 and twobp.pending().jobs == 0
    grads = [p.grad for p in reference.parameters() if p.grad is not None]
    assert_grads_match(patched, reference, _tolerance_dtype(dtype), scale=_scale(grads, dtype))
    for (name, b), (_, c) in zip(patched.named_buffers(), reference.named_buffers(), strict=True):
        torch.testing.assert_close(b, c, rtol=rtol, atol=atol, msg=lambda m, name=name: f"buffer {name}: {m}")


def _tolerance_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of tests.utils.TOLERANCES that fits: a complex dtype's real one; fp16 (more
    mantissa bits than bf16) the bf16 one."""
    real = dtype.to_real()
    return torch.bfloat16 if real == torch.float16 else real


def _tolerance(dtype: torch.dtype) -> tuple[float, float]:
    return TOLERANCES[_tolerance_dtype(dtype)]


def _scale(expected: Sequence[Tensor], dtype: torch.dtype) -> float:
    """What the absolute tolerance scales with below fp64: the largest expected entry. Entries
    that are sums cancelling to about zero (attention's key bias gradient, zero in exact
    arithmetic) keep the rounding of their largest terms, and in bf16 one rounding of a large
    entry is already past a fixed absolute tolerance."""
    if dtype.to_real() == torch.float64:
        return 1.0
    largest = max((t.detach().abs().max().item() for t in expected if t.numel()), default=0.0)
    return max(1.0, largest)


def _calls(case: Case, by_keyword: bool = False) -> Forward:
    return lambda module, x: case.call(module, x, by_keyword)


# -- empty batches -------------------------------------------------------------------------

EMPTY_SEQUENCES = {"empty": (0,), "empty-between-others": (3, 0, 2)}


@pytest.mark.parametrize("batches", EMPTY_SEQUENCES.values(), ids=EMPTY_SEQUENCES.keys())
@cases
def test_empty_batch(case: Case, batches: tuple[int, ...]) -> None:
    """Plain PyTorch accepts a batch of 0 (zero gradients; BatchNorm counts it in
    num_batches_tracked); joined with non-empty micro-batches the flush stays right."""
    assert_like_plain(
        case.module(), lambda: [case.input((b, *case.sample)) for b in batches], forward=_calls(case)
    )


@dataclass(frozen=True)
class Empty:
    id: str
    make: Callable[[], nn.Module]
    shape: tuple[int, ...]
    forward: Forward = lambda module, x: module(x)

    def leaves(self) -> list[Tensor]:
        if isinstance(self.make(), nn.Embedding):
            return [torch.zeros(self.shape, dtype=torch.long)]
        return [torch.randn(self.shape, requires_grad=True)]


def _attend(module: nn.Module, x: Tensor) -> Tensor:
    return module(x, x, x)[0]


def _attend_by_sdpa(module: nn.Module, x: Tensor) -> Tensor:
    return module(x, x, x, need_weights=False)[0]


def _batch_first_attention() -> nn.Module:
    return nn.MultiheadAttention(4, 2, batch_first=True)


def _attend_across(module: nn.Module, x: Tensor) -> Tensor:
    """Cross-attention: keys and values of their own length (5), from x's batch."""
    memory = torch.linspace(-1.0, 1.0, x.shape[0] * 5 * x.shape[-1]).reshape(x.shape[0], 5, x.shape[-1])
    return module(x, memory, memory)[0]


#: Empty tensors other than a batch of 0: plain accepts some, refuses others.
EMPTY_ELSEWHERE = [
    Empty("conv2d-empty-spatial", lambda: nn.Conv2d(3, 4, 3), (2, 3, 0, 0)),
    Empty("conv2d-padded-empty-spatial", lambda: nn.Conv2d(3, 4, 3, padding=1), (2, 3, 0, 4)),
    Empty("conv2d-empty-batch-too-small", lambda: nn.Conv2d(3, 4, 3), (0, 3, 2, 2)),
    Empty("conv2d-unbatched-no-channels", lambda: nn.Conv2d(3, 4, 3), (0, 5, 5)),
    Empty("conv-transpose2d-empty-spatial", lambda: nn.ConvTranspose2d(3, 4, 3), (2, 3, 0, 4)),
    Empty("batch-norm1d-1d", lambda: nn.BatchNorm1d(3), (0,)),
    Empty("batch-norm2d-empty-spatial", lambda: nn.BatchNorm2d(3), (2, 3, 0, 4)),
    Empty("layer-norm-no-features", lambda: nn.LayerNorm(4), (2, 0)),
    Empty("group-norm-empty-spatial", lambda: nn.GroupNorm(2, 4), (2, 4, 0)),
    Empty("linear-no-in-features", lambda: nn.Linear(0, 3), (2, 0)),
    Empty("linear-no-out-features", lambda: nn.Linear(4, 0), (2, 4)),
    Empty("embedding-empty-sequences", lambda: nn.Embedding(NUM_EMBEDDINGS, 4), (2, 0)),
    Empty("embedding-no-features", lambda: nn.Embedding(NUM_EMBEDDINGS, 0), (2, 3)),
    Empty(
        "multihead-attention-empty-sequence", lambda: nn.MultiheadAttention(4, 2, batch_first=True), (2, 0, 4), _attend
    ),
    # Kernels told which outputs each backward reached: no rows must still read "reached"
    # (plain gives zeros; None made a weight-decay step skip the parameters).
    *(
        Empty(f"multihead-attention-cross-{what}", _batch_first_attention, shape, _attend_across)
        for what, shape in (("empty-batch", (0, 3, 4)), ("empty-query", (2, 0, 4)))
    ),
    Empty(
        "multihead-attention-bias-kv-empty-batch",
        lambda: nn.MultiheadAttention(4, 2, batch_first=True, add_bias_kv=True),
        (0, 3, 4),
        _attend,
    ),
    Empty(
        "multihead-attention-sdpa-empty-batch",
        lambda: nn.MultiheadAttention(4, 2, batch_first=True),
        (0, 3, 4),
        _attend_by_sdpa,
    ),
]


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
@pytest.mark.parametrize("empty", EMPTY_ELSEWHERE, ids=[e.id for e in EMPTY_ELSEWHERE])
def test_empty_tensor(empty: Empty) -> None:
    assert_like_plain(empty.make(), empty.leaves, forward=empty.forward)


# -- keyword calls -------------------------------------------------------------------------


def _micro_batches(case: Case, batches: Sequence[int] = (2, 3), **kwargs: Any) -> Callable[[], list[Tensor]]:
    return lambda: [case.input((b, *case.sample), **kwargs) for b in batches]


@cases
def test_called_with_keywords(case: Case) -> None:
    assert_like_plain(case.module(), _micro_batches(case), forward=_calls(case, by_keyword=True))


@cases
def test_signature_is_the_modules(case: Case) -> None:
    """A patched module accepts exactly the calls its class's forward accepts: same names,
    kinds and defaults (the rule's first parameter is the module)."""
    module = case.make()

    def described(function: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
        parameters = list(inspect.signature(function).parameters.values())[1:]
        return [(p.name, p.kind, p.default) for p in parameters]

    assert described(rule_for(module).forward) == described(type(module).forward)


@cases
def test_unknown_keyword_raises_as_plain(case: Case) -> None:
    assert_like_plain(case.module(), _micro_batches(case), forward=lambda module, x: module(inputs=x))


def test_multihead_attention_every_keyword() -> None:
    batch, seq = 2, 3
    padding = torch.zeros(batch, seq, dtype=torch.bool)
    padding[1, -1] = True
    causal = torch.ones(seq, seq, dtype=torch.bool).triu(1)

    def forward(module: nn.Module, x: Tensor) -> Tensor:
        output, weights = module(
            query=x, key=x, value=x, key_padding_mask=padding, need_weights=True, attn_mask=causal,
            average_attn_weights=False, is_causal=True,
        )
        return output + weights.sum()

    case = CASE_BY_ID["multihead-attention"]
    assert_like_plain(case.module(), _micro_batches(case, (batch, batch)), forward=forward)


@pick("conv-transpose1d", "conv-transpose2d", "conv-transpose3d")
def test_conv_transpose_output_size_keyword(case: Case) -> None:
    """``output_size`` by name: one more than the default on each spatial dim (stride 2)."""
    module = case.module()
    assert all(s == 2 for s in module.stride) and module.padding == (0,) * len(module.stride)
    output_size = [(n - 1) * 2 + k + 1 for n, k in zip(case.sample[1:], module.kernel_size, strict=True)]
    assert_like_plain(module, _micro_batches(case), forward=lambda m, x: m(input=x, output_size=output_size))


# -- complex and nested tensors: plain autograd, with one warning ----------------------------


@pytest.fixture
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback warns once per process: each test starts from none given."""
    monkeypatch.setattr(warn_once, "given", set())


def _assert_warned_once(caught: list[warnings.WarningMessage], module_type: type, reason: str) -> None:
    ours = [w for w in caught if str(w.message).startswith("twobp: ")]
    assert len(ours) == 1, [str(w.message) for w in ours]
    assert module_type.__name__ in str(ours[0].message) and reason in str(ours[0].message)


COMPLEX = [
    pytest.param(case, only_input, id=f"{case.id}-{'complex-input' if only_input else 'complex-module'}")
    for case in CASES
    for only_input in (False, True)
    if not (case.indices and only_input)  # indices cannot be complex
]


@pytest.mark.filterwarnings("ignore:Complex modules are a new feature")  # PyTorch's own, on .to(complex)
@pytest.mark.parametrize("case, complex_input_only", COMPLEX)
def test_complex_keeps_plain_autograd(case: Case, complex_input_only: bool, fresh_warnings: None) -> None:
    """Modules that compute in complex take the plain path (their gradients need conjugates
    the kernels do not take). Where plain refuses complex (the norms but RMSNorm, attention's
    softmax, embedding's backward), the patched module refuses it too."""
    module = case.module() if complex_input_only else case.module(torch.complex128)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain_error = assert_like_plain(
            module, _micro_batches(case, dtype=torch.complex128), forward=_calls(case), deferred=False,
        )
    if plain_error is None:  # two calls, one warning
        _assert_warned_once(caught, type(module), "complex tensors")


@pytest.mark.filterwarnings("ignore:Complex modules are a new feature")
def test_fallback_warns_once_per_module_type(fresh_warnings: None) -> None:
    calls = [(nn.Linear(4, 4), (2, 4)), (nn.Linear(4, 4), (2, 4))] + [(nn.Conv1d(4, 4, 1), (2, 4, 3))] * 2
    for module, _ in calls:
        twobp.patch(module.to(torch.complex64))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for module, shape in calls * 2:
            module(torch.randn(shape, dtype=torch.complex64)).abs().sum().backward()
    ours = [str(w.message) for w in caught if str(w.message).startswith("twobp: ")]
    assert len(ours) == 2 and "Linear" in ours[0] and "Conv1d" in ours[1], ours
    assert twobp.pending().jobs == 0


class Scale(nn.Module):
    """A user type under the recompute rule."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight


@pytest.mark.filterwarnings("ignore:Complex modules are a new feature")
@pytest.mark.parametrize("call", ["complex", "keyword"])
def test_recompute_rule_keeps_plain_autograd_for_what_it_cannot_defer(call: str, fresh_warnings: None) -> None:
    twobp.register(Scale, twobp.ops.recompute)
    dtype = torch.complex128 if call == "complex" else torch.float64
    module = Scale().to(dtype)

    def forward(m: nn.Module, x: Tensor) -> Tensor:
        return m(x=x) if call == "keyword" else m(x)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_like_plain(
            module, lambda: [torch.randn(b, 4, dtype=dtype) for b in (2, 3)], forward=forward, deferred=False
        )
    _assert_warned_once(caught, Scale, "complex tensors" if call == "complex" else "keyword")


def _nested(case: Case, lengths: Sequence[int], dtype: torch.dtype = torch.float64) -> Tensor:
    """A jagged batch of samples of the case's shape, each with a leading ragged dim."""
    samples = [case.input((n, *case.sample), dtype, requires_grad=False) for n in lengths]
    return torch.nested.nested_tensor(samples, layout=torch.jagged, requires_grad=not case.indices)


@cases
def test_nested_jagged_input_keeps_plain_autograd(case: Case, fresh_warnings: None) -> None:
    """Where plain PyTorch takes a jagged batch (Linear, LayerNorm, RMSNorm, Embedding), the
    patched module takes it the plain way with one warning; elsewhere it refuses it as plain does."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain_error = assert_like_plain(
            case.module(), lambda: [_nested(case, (2, 3)), _nested(case, (1, 4))], forward=_calls(case), deferred=False
        )
    if plain_error is None:
        _assert_warned_once(caught, type(case.make()), "nested tensors")



class Tagged(Tensor):
    """A tensor subclass with the default ``__torch_function__``: ops return Tagged tensors."""


@cases
def test_tensor_subclass_input_keeps_plain_autograd(case: Case, fresh_warnings: None) -> None:
    def leaves() -> list[Tensor]:
        return [
            case.input((b, *case.sample), requires_grad=False).as_subclass(Tagged).requires_grad_(not case.indices)
            for b in (2, 3)
        ]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_like_plain(case.module(), leaves, forward=_calls(case), deferred=False)
    _assert_warned_once(caught, type(case.make()), "tensor subclasses")


# -- dtypes, layouts and shapes a user meets ---------------------------------------------------


def _identity(x: Tensor) -> Tensor:
    return x


def _retained(leaf: Tensor) -> Tensor:
    x = leaf * 1
    x.retain_grad()
    return x


def _reversed_dims(x: Tensor) -> Tensor:
    return x.permute(*reversed(range(x.dim())))


def _channels_last(x: Tensor) -> Tensor:
    return x.contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)


def _relu_in_place_after(case: Case) -> Forward:
    return lambda module, x: torch.relu_(case.call(module, x))


def _hooked_then_relu_in_place(case: Case) -> Forward:
    """A hook on the output, then an in-place op on it: plain autograd calls the hook unless the
    output is a view (the in-place op then rebases it); the patched output must be a view
    exactly where plain's is, or the gradient (doubled by the hook) differs."""

    def forward(module: nn.Module, x: Tensor) -> Tensor:
        output = case.call(module, x)
        output.register_hook(lambda grad: grad * 2)
        return torch.relu_(output)

    return forward


def _input_modified_after(case: Case) -> Forward:
    """The input changed in place after the forward: plain autograd, which saved it, refuses
    the backward; so must the patched module, which saved it for the weight kernel."""

    def forward(module: nn.Module, x: Tensor) -> Tensor:
        output = case.call(module, x)
        with torch.no_grad():
            x.add_(1)
        return output

    return forward


def _parameters_modified_after(case: Case) -> Forward:
    """The parameters changed in place between forward and backward (an EMA of the weights, a
    step before a delayed backward): plain autograd refuses where it saved them, and where it
    did not (a Linear whose input needs no gradient) computes the weight gradient from the
    input and output gradient, which never needed them."""

    def forward(module: nn.Module, x: Tensor) -> Tensor:
        output = case.call(module, x)
        with torch.no_grad():
            for param in module.parameters():
                param.mul_(0.5)
        return output

    return forward


def _under_fp16_autocast(case: Case) -> Forward:
    def forward(module: nn.Module, x: Tensor) -> Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            return case.call(module, x)

    return forward


def _inference_tensor(leaf: Tensor) -> Tensor:
    """Made in inference mode: autograd cannot save it for backward."""
    with torch.inference_mode():
        return leaf.clone()


@dataclass(frozen=True)
class Variant:
    id: str
    #: The micro-batches' leaf shapes, from one sample's shape.
    shapes: Callable[[tuple[int, ...]], list[tuple[int, ...]]] = lambda sample: [(2, *sample), (3, *sample)]
    prepare: Prepare = _identity  # leaf -> what the module gets
    forward: Callable[[Case], Forward] = _calls
    dtype: torch.dtype = torch.float64  # of the module
    input_dtype: torch.dtype | None = None  # None: the module's
    compute_dtype: torch.dtype | None = None  # for the tolerance; None: the coarser of the two
    requires_grad: bool = True
    applies: Callable[[Case], bool] = lambda case: True

    def tolerance_dtype(self) -> torch.dtype:
        if self.compute_dtype is not None:
            return self.compute_dtype
        return max(self.dtype, self.input_dtype or self.dtype, key=lambda d: torch.finfo(d).eps)


VARIANTS = [
    Variant("fp32", dtype=torch.float32),
    Variant("fp16-parameters", dtype=torch.float16),
    Variant("bf16-parameters", dtype=torch.bfloat16),
    Variant("input-needs-no-grad", requires_grad=False),
    Variant("retained-input-grad", prepare=_retained, applies=lambda case: not case.indices),
    Variant("transposed-input", lambda s: [(2, *s)[::-1], (3, *s)[::-1]], prepare=_reversed_dims),
    Variant("expanded-batch", lambda s: [(1, *s)], prepare=lambda x: x.expand(3, *x.shape[1:])),
    Variant("strided-batch", lambda s: [(6, *s), (4, *s)], prepare=lambda x: x[::2]),
    Variant("channels-last", prepare=_channels_last, applies=lambda case: len(case.sample) in (3, 4)),
    Variant("batch-of-one", lambda s: [(1, *s), (1, *s)]),
    Variant("unbatched", lambda s: [s, s]),
    Variant("0-d-input", lambda s: [(), ()]),
    Variant("leading-singleton-dims", lambda s: [(1, 1, 2, *s), (1, 1, 3, *s)]),
    Variant("output-relu-in-place", forward=_relu_in_place_after),
    Variant("hooked-output-relu-in-place", forward=_hooked_then_relu_in_place),
    Variant("input-modified-in-place-after-forward", forward=_input_modified_after),
    Variant(  # one micro-batch: a change after a backward that queued work is refused at the flush
        "parameters-modified-in-place-after-forward", lambda s: [(3, *s)], forward=_parameters_modified_after,
        requires_grad=False, applies=lambda case: case.id != "group-norm",  # plain saves the weight, we need not
    ),
    Variant("inference-tensor-input", prepare=_inference_tensor),
    Variant("fp16-cpu-autocast", forward=_under_fp16_autocast, dtype=torch.float32, compute_dtype=torch.float16),
    Variant("bf16-input-fp32-module", dtype=torch.float32, input_dtype=torch.bfloat16),
    Variant("fp64-input-fp32-module", dtype=torch.float32, input_dtype=torch.float64),
]


#: A known difference: batch_first attention in plain PyTorch projects a transposed input, which
#: the GEMM copies, so plain saves a copy; the patched forward projects rows of the input as
#: given and saves a view of it (no copy), so autograd refuses an input changed in place after
#: the forward, or made in inference mode, where plain accepts it.
SAVES_A_VIEW_WHERE_PLAIN_COPIES = {
    ("multihead-attention", "input-modified-in-place-after-forward"),
    ("multihead-attention", "inference-tensor-input"),
}


def _variant_param(case: Case, variant: Variant) -> Any:
    marks = []
    if (case.id, variant.id) in SAVES_A_VIEW_WHERE_PLAIN_COPIES:
        marks.append(pytest.mark.xfail(strict=True, reason="the input is saved as a view; plain copies it"))
    return pytest.param(case, variant, id=f"{case.id}-{variant.id}", marks=marks)


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # plain rms_norm's own
@pytest.mark.parametrize("case, variant", [_variant_param(c, v) for v in VARIANTS for c in CASES if v.applies(c)])
def test_variant(case: Case, variant: Variant) -> None:
    def leaves() -> list[Tensor]:
        dtype = variant.input_dtype or variant.dtype
        return [case.input(shape, dtype, variant.requires_grad) for shape in variant.shapes(case.sample)]

    assert_like_plain(
        case.module(variant.dtype), leaves, prepare=variant.prepare, forward=variant.forward(case),
        dtype=variant.tolerance_dtype(),
    )


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("shape", [(4,), (3, 4), (2, 3, 4), (2, 1, 3, 4)], ids=["1d", "2d", "3d", "4d"])
def test_linear_output_is_a_view_where_plain_is(shape: tuple[int, ...], bias: bool) -> None:
    module = nn.Linear(4, 3, bias=bias).double()
    hooked = _hooked_then_relu_in_place(CASE_BY_ID["linear"])
    assert_like_plain(module, lambda: [torch.randn(shape, dtype=torch.float64, requires_grad=True)], forward=hooked)
    patched = twobp.patch(copy.deepcopy(module))
    x = torch.randn(shape, dtype=torch.float64)
    assert patched(x)._is_view() == module(x)._is_view()


def test_per_sample_gradients_through_expanded_weights_keep_plain_autograd(monkeypatch: pytest.MonkeyPatch) -> None:
    """PyTorch's call_for_per_sample_grads (Opacus' "ew" mode) puts ExpandedWeights in as the
    parameters, a subclass whose __torch_function__ refuses even attribute reads: the patched
    forward read requires_grad and is_nested on them and crashed with ExpandedWeights' error
    instead of falling back to plain autograd."""
    from torch.nn.utils._per_sample_grad import call_for_per_sample_grads

    monkeypatch.setattr(warn_once, "given", set())
    base = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 3)).double()
    patched, reference = twobp.patch(copy.deepcopy(base)), copy.deepcopy(base)
    x = torch.randn(5, 4, dtype=torch.float64)
    call_for_per_sample_grads(reference)(x).pow(2).sum().backward()
    with pytest.warns(UserWarning, match="tensor subclasses that override __torch_function__"):
        call_for_per_sample_grads(patched)(x).pow(2).sum().backward()
    assert twobp.pending().jobs == 0
    for (name, ours), plain in zip(patched.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours.grad_sample, plain.grad_sample, rtol=0, atol=0, msg=name)
