"""nn.Embedding against plain autograd: padding_idx (incl. negative), scale_grad_by_freq,
unbatched and scalar indices, int32 indices, tied weights, the max_norm / sparse fallbacks and
the module-level contract; nn.EmbeddingBag's modes, per_sample_weights, offsets and empty bags,
and the same fallbacks and contract."""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor, nn

import twobp_autograd as twobp
from tests.utils import assert_grads_match, assert_no_grads, check_against_autograd

NUM, DIM, USED = 10, 4, 6  # indices are drawn below USED, so rows repeat and some rows stay unused
PAD = 3


def negative_padding_after_construction() -> nn.Embedding:
    """nn.Embedding turns a negative padding_idx positive; F.embedding accepts it as set later."""
    module = nn.Embedding(NUM, DIM, padding_idx=PAD)
    module.padding_idx = PAD - NUM
    return module


@dataclass(frozen=True)
class Setting:
    id: str
    make: Callable[[], nn.Module]
    index_shape: tuple[int, ...]
    index_dtype: torch.dtype = torch.long

    def make_module(self) -> nn.Module:
        module = self.make()
        with torch.no_grad():  # a non-zero padding row: its output gradient is non-zero too
            module.weight.normal_()
        return module

    def make_inputs(self) -> tuple[Tensor]:
        indices = torch.randint(0, USED, self.index_shape, dtype=self.index_dtype)
        indices.view(-1)[0] = PAD  # the padding row is always looked up
        return (indices,)


SETTINGS = [
    Setting("plain", lambda: nn.Embedding(NUM, DIM), (2, 5)),
    Setting("padding-idx", lambda: nn.Embedding(NUM, DIM, padding_idx=PAD), (2, 5)),
    Setting("padding-idx-zero", lambda: nn.Embedding(NUM, DIM, padding_idx=0), (2, 5)),
    Setting("padding-idx-negative", lambda: nn.Embedding(NUM, DIM, padding_idx=PAD - NUM), (2, 5)),
    Setting("padding-idx-negative-set-later", negative_padding_after_construction, (2, 5)),
    Setting("scale-grad-by-freq", lambda: nn.Embedding(NUM, DIM, scale_grad_by_freq=True), (2, 5)),
    Setting(
        "scale-grad-by-freq-padding", lambda: nn.Embedding(NUM, DIM, padding_idx=PAD, scale_grad_by_freq=True), (3, 4)
    ),
    Setting("unbatched", lambda: nn.Embedding(NUM, DIM, padding_idx=PAD), (7,)),
    Setting("scalar-index", lambda: nn.Embedding(NUM, DIM), ()),
    Setting("scalar-index-scale-grad-by-freq", lambda: nn.Embedding(NUM, DIM, scale_grad_by_freq=True), ()),
    Setting("three-dims", lambda: nn.Embedding(NUM, DIM), (2, 3, 2)),
    Setting("int32-indices", lambda: nn.Embedding(NUM, DIM, padding_idx=PAD), (2, 5), torch.int32),
]
DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
#: The checks that hold for nn.EmbeddingBag as for nn.Embedding (its 2-D input: one bag per row).
BOTH = pytest.mark.parametrize("module_type", [nn.Embedding, nn.EmbeddingBag], ids=["embedding", "embedding-bag"])


@pytest.mark.parametrize("setting", SETTINGS, ids=[s.id for s in SETTINGS])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_grads_match_plain_autograd(setting, dtype):
    check_against_autograd(setting.make_module().to(dtype), setting.make_inputs, micro_batches=3, dtype=dtype)


@pytest.mark.parametrize("setting", SETTINGS, ids=[s.id for s in SETTINGS])
def test_output_equals_plain(setting):
    model = setting.make_module()
    reference = copy.deepcopy(model)
    twobp.patch(model)
    (indices,) = setting.make_inputs()
    output = model(indices)
    assert output.requires_grad
    torch.testing.assert_close(output, reference(indices), rtol=0, atol=0)


def test_scale_grad_by_freq_counts_within_each_call():
    """Row 1 appears 3 times in one call and once in another: plain autograd scales by 3 and
    by 1, where one count over the concatenation would scale both by 4."""
    model = nn.Embedding(NUM, DIM, scale_grad_by_freq=True)
    reference = copy.deepcopy(model)
    twobp.patch(model)
    for indices in (torch.tensor([1, 1, 1, 2]), torch.tensor([1, 5])):
        for m in (model, reference):
            (m(indices) * torch.arange(1.0, DIM + 1)).sum().backward()
    assert twobp.pending().jobs == 2
    twobp.flush_weight_grads()
    assert_grads_match(model, reference)


def test_tied_with_an_output_head():
    class TiedLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(NUM, DIM, padding_idx=PAD)
            self.head = nn.Linear(DIM, NUM, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, indices: Tensor) -> Tensor:
            return self.head(torch.tanh(self.embed(indices)))

    check_against_autograd(TiedLM(), lambda: (torch.randint(0, NUM, (2, 5)),))


@pytest.mark.parametrize(
    "option, reason",
    [(dict(max_norm=1.0), "max_norm"), (dict(max_norm=0.5, norm_type=1.0), "max_norm"), (dict(sparse=True), "sparse")],
    ids=["max-norm", "max-norm-l1", "sparse"],
)
@BOTH
def test_unsupported_options_keep_plain_autograd(option, reason, module_type):
    model = nn.Sequential(module_type(NUM, DIM, **option))
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():  # warned once per process: the report is what is asserted
        warnings.simplefilter("ignore")
        report = twobp.patch(model, report=True)
    assert report.patched == [] and reason in report.skipped["0"]
    for _ in range(2):
        indices = torch.randint(0, NUM, (2, 5))
        for m in (model, reference):
            m(indices).pow(2).sum().backward()
    assert twobp.pending().jobs == 0
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert p.grad.layout == q.grad.layout
        torch.testing.assert_close(p.grad.to_dense(), q.grad.to_dense())
        torch.testing.assert_close(p, q)  # max_norm renormalised both the same way


@pytest.mark.parametrize("option", ["max_norm", "sparse"])
@BOTH
def test_unsupported_options_set_after_patch_keep_plain_autograd(option, module_type):
    """Set on the module after patch(): sparse gradients came out dense (SparseAdam then refused
    them), and max_norm's in-place renormalisation made the flush refuse the queued work."""
    model = module_type(NUM, DIM)
    twobp.patch(model)
    reference = copy.deepcopy(model)
    for m in (model, reference):
        setattr(m, option, 1.0 if option == "max_norm" else True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            indices = torch.randint(0, NUM, (2, 5))
            for m in (model, reference):
                m(indices).pow(2).sum().backward()
    assert twobp.pending().jobs == 0
    assert model.weight.grad.layout == reference.weight.grad.layout
    torch.testing.assert_close(model.weight.grad.to_dense(), reference.weight.grad.to_dense())
    torch.testing.assert_close(model.weight, reference.weight)


def test_a_layer_tied_to_a_max_norm_embedding_is_refused_naming_the_cause():
    """The embedding (plain autograd) renormalises the shared weight in place in each forward:
    the tied head's work queued before is refused, and the error says which forward did it."""
    embed, head = nn.Embedding(NUM, DIM, max_norm=1.0), nn.Linear(DIM, NUM, bias=False)
    head.weight = embed.weight
    model = nn.Sequential(embed, head)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        twobp.patch(model)
        for _ in range(2):
            model(torch.randint(0, NUM, (2, 5))).pow(2).sum().backward()
    with pytest.raises(RuntimeError, match="modified in place.*nn.Embedding with max_norm"):
        twobp.flush_weight_grads()
    twobp.discard_weight_grads()


@pytest.mark.parametrize("mode", ["eval", "no_grad", "frozen", "unpatched"])
@BOTH
def test_plain_path_queues_nothing(mode, module_type):
    model = module_type(NUM, DIM)
    twobp.patch(model)
    indices = torch.randint(0, NUM, (2, 5))
    if mode == "eval":
        model.eval()
    if mode == "frozen":
        model.weight.requires_grad_(False)
    if mode == "unpatched":
        twobp.unpatch(model)
        assert "forward" not in vars(model)
    if mode == "no_grad":
        with torch.no_grad():
            assert not model(indices).requires_grad
    elif mode == "frozen":
        assert not model(indices).requires_grad
    else:
        model(indices).sum().backward()
        assert model.weight.grad is not None
    assert twobp.pending().jobs == 0


@BOTH
def test_nothing_written_before_flush(module_type):
    model = module_type(NUM, DIM)
    twobp.patch(model)
    model(torch.randint(0, NUM, (2, 5))).sum().backward()
    assert_no_grads(model)
    assert twobp.pending().jobs == 1
    twobp.flush_weight_grads()
    assert model.weight.grad is not None


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_indices_changed_in_place_before_backward_raise_as_in_plain(layout):
    """Plain autograd saves the indices for the weight's gradient, and refuses them changed;
    transposed ones were saved as a flattened copy, which did not see the change."""
    model = nn.Embedding(NUM, DIM)
    reference = copy.deepcopy(model)
    twobp.patch(model)
    for m in (reference, model):
        base = torch.randint(0, NUM, (5, 2))
        indices = base.t() if layout == "transposed" else base
        output = m(indices)
        base[0, 0] = (base[0, 0] + 1) % NUM
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            output.sum().backward()
    assert twobp.pending().jobs == 0


@BOTH
def test_indices_made_in_inference_mode_are_refused_with_plain_error(module_type):
    """Token ids made under torch.inference_mode(): plain's op refuses to save them for
    backward; so does the deferred one, with plain's advice (it read their version counter,
    which inference tensors lack, and said only that)."""
    with torch.inference_mode():
        indices = torch.randint(0, NUM, (2, 5))
    for model in (module_type(NUM, DIM), twobp.patch(module_type(NUM, DIM))):
        with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
            model(indices)
    assert twobp.pending().jobs == 0


# nn.EmbeddingBag. Nine indices in four bags by default: bag 0 only padding where there is a
# padding row, bag 1 empty, bag 2 padding and others, bag 3 three indices.
OFFSETS = (0, 2, 2, 6)
BAG_INDICES = 9


@dataclass(frozen=True)
class BagSetting:
    id: str
    make: Callable[[], nn.EmbeddingBag]
    #: None: a 2-D input of (bags, indices per bag), one bag per row.
    offsets: tuple[int, ...] | None = OFFSETS
    per_sample_weights: bool = False
    index_dtype: torch.dtype = torch.long
    offset_dtype: torch.dtype = torch.long
    strided: bool = False  # indices read every other element of a longer tensor

    def make_module(self, dtype: torch.dtype = torch.float32) -> nn.EmbeddingBag:
        module = self.make().to(dtype)
        with torch.no_grad():  # a non-zero padding row: its output gradient is non-zero too
            module.weight.normal_()
        return module

    def make_inputs(self, dtype: torch.dtype = torch.float32) -> tuple[Tensor | None, ...]:
        shape = (3, 4) if self.offsets is None else (BAG_INDICES,)
        indices = torch.randint(0, USED, shape, dtype=self.index_dtype)
        indices.view(-1)[:3] = PAD  # the padding row always looked up (1-D: in a bag of its own too)
        if self.strided:
            spaced = indices.new_zeros(*shape[:-1], 2 * shape[-1])
            spaced[..., ::2] = indices
            indices = spaced[..., ::2]
        offsets = None if self.offsets is None else torch.tensor(self.offsets, dtype=self.offset_dtype)
        inputs: tuple[Tensor | None, ...] = (indices, offsets)
        if self.per_sample_weights:
            inputs += (torch.rand(shape, dtype=dtype) + 0.5,)
        return inputs


def bag(mode: str, **options: object) -> Callable[[], nn.EmbeddingBag]:
    return lambda: nn.EmbeddingBag(NUM, DIM, mode=mode, **options)  # type: ignore[arg-type]


def negative_bag_padding_after_construction() -> nn.EmbeddingBag:
    """As for nn.Embedding: set later, a negative padding_idx stays negative."""
    module = nn.EmbeddingBag(NUM, DIM, mode="mean", padding_idx=PAD)
    module.padding_idx = PAD - NUM
    return module


LAST = (*OFFSETS, BAG_INDICES)  # include_last_offset: the end of the last bag too
BAG_SETTINGS = [
    *(BagSetting(f"{mode}", bag(mode)) for mode in ("sum", "mean", "max")),
    *(BagSetting(f"{mode}-2d-input", bag(mode), offsets=None) for mode in ("sum", "mean", "max")),
    *(BagSetting(f"{mode}-padding-idx", bag(mode, padding_idx=PAD)) for mode in ("sum", "mean", "max")),
    *(BagSetting(f"{mode}-include-last-offset", bag(mode, include_last_offset=True), LAST) for mode in ("sum", "max")),
    BagSetting("mean-include-last-offset-padding", bag("mean", include_last_offset=True, padding_idx=PAD), LAST),
    BagSetting("sum-per-sample-weights", bag("sum"), per_sample_weights=True),
    BagSetting("sum-per-sample-weights-2d-input", bag("sum"), offsets=None, per_sample_weights=True),
    BagSetting("sum-per-sample-weights-padding", bag("sum", padding_idx=PAD), per_sample_weights=True),
    BagSetting("mean-padding-idx-negative", bag("mean", padding_idx=PAD - NUM)),
    BagSetting("mean-padding-idx-negative-set-later", negative_bag_padding_after_construction),
    BagSetting("sum-scale-grad-by-freq", bag("sum", scale_grad_by_freq=True)),
    BagSetting("mean-scale-grad-by-freq-padding", bag("mean", scale_grad_by_freq=True, padding_idx=PAD)),
    BagSetting(
        "sum-scale-grad-by-freq-per-sample-weights", bag("sum", scale_grad_by_freq=True), per_sample_weights=True
    ),
    BagSetting("mean-empty-bags-first-and-last", bag("mean"), offsets=(0, 0, 4, BAG_INDICES)),
    BagSetting("max-empty-bags-first-and-last", bag("max"), offsets=(0, 0, 4, BAG_INDICES)),
    BagSetting("mean-int32", bag("mean", padding_idx=PAD), index_dtype=torch.int32, offset_dtype=torch.int32),
    BagSetting("sum-int32-indices-int64-offsets", bag("sum"), index_dtype=torch.int32),
    BagSetting("max-strided-indices", bag("max"), strided=True),
    BagSetting("mean-strided-2d-input", bag("mean"), offsets=None, strided=True),
]


@pytest.mark.parametrize("setting", BAG_SETTINGS, ids=[s.id for s in BAG_SETTINGS])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_bag_grads_match_plain_autograd(setting, dtype):
    check_against_autograd(setting.make_module(dtype), lambda: setting.make_inputs(dtype), dtype=dtype)


@pytest.mark.parametrize("setting", BAG_SETTINGS, ids=[s.id for s in BAG_SETTINGS])
def test_bag_output_and_per_sample_weights_grad_equal_plain(setting):
    """Computed by the op plain autograd runs: the output, and the gradient backward-p1 delivers
    at once (per_sample_weights'), bit for bit."""
    model = setting.make_module()
    reference = copy.deepcopy(model)
    twobp.patch(model)
    inputs = setting.make_inputs()
    copies = [None if t is None else t.clone() for t in inputs]
    if setting.per_sample_weights:
        for weights in (inputs[-1], copies[-1]):
            weights.requires_grad_()  # type: ignore[union-attr]  # present: asked for
    output, expected = model(*inputs), reference(*copies)
    torch.testing.assert_close(output, expected, rtol=0, atol=0)
    grad = torch.randn_like(output)
    output.backward(grad)
    expected.backward(grad)
    assert twobp.pending().jobs == 1
    if setting.per_sample_weights:
        torch.testing.assert_close(inputs[-1].grad, copies[-1].grad, rtol=0, atol=0)  # type: ignore[union-attr]
    twobp.flush_weight_grads()
    assert_grads_match(model, reference)


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "bf16-under-autocast"])
def test_bag_bf16(autocast):
    """CPU autocast leaves embedding_bag alone (a bf16 weight computes in bf16 either way): one
    kernel call per micro-batch, as plain autograd's."""
    setting = BagSetting("mean-padding-idx", bag("mean", padding_idx=PAD))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        check_against_autograd(setting.make_module(torch.bfloat16), setting.make_inputs, dtype=torch.bfloat16)


SUM = {"mode": "sum"}


@pytest.mark.parametrize(
    "options, call",
    [
        (SUM, lambda m: m(torch.zeros(2, 3, dtype=torch.long), torch.tensor([0, 1]))),
        (SUM, lambda m: m(torch.zeros(6, dtype=torch.long))),
        (SUM, lambda m: m(torch.zeros(6, dtype=torch.long), torch.tensor([[0, 2]]))),
        (SUM, lambda m: m(torch.zeros(1, 2, 3, dtype=torch.long))),
        (SUM, lambda m: m(torch.zeros(2, 3, dtype=torch.long), None, torch.ones(6))),
        (SUM, lambda m: m(torch.zeros(6, dtype=torch.long), torch.tensor([0, 2]), torch.ones(5))),
        ({}, lambda m: m(torch.zeros(2, 3, dtype=torch.long), None, torch.ones(2, 3))),  # mode="mean"
        ({"mode": "max", "scale_grad_by_freq": True}, lambda m: m(torch.zeros(2, 3, dtype=torch.long))),
        (SUM, lambda m: m(torch.zeros(2, 0, dtype=torch.long))),
    ],
    ids=[
        "2d-with-offsets",
        "1d-without-offsets",
        "2d-offsets",
        "3d-input",
        "weights-shape-2d",
        "weights-shape-1d",
        "weights-mean-mode",
        "max-scale-grad-by-freq",
        "2d-rows-without-indices",
    ],
)
def test_bag_calls_plain_refuses_raise_its_error(options, call):
    model = nn.EmbeddingBag(NUM, DIM, **options)
    reference = copy.deepcopy(model)
    twobp.patch(model)
    with pytest.raises((ValueError, NotImplementedError, RuntimeError)) as expected:
        call(reference)
    with pytest.raises(expected.type, match=re.escape(str(expected.value))):
        call(model)
    assert twobp.pending().jobs == 0


def test_bag_frozen_weight_with_per_sample_weights_keeps_their_gradient():
    model = nn.EmbeddingBag(NUM, DIM, mode="sum")
    model.weight.requires_grad_(False)
    reference = copy.deepcopy(model)
    twobp.patch(model)
    indices, offsets, weights = BagSetting("", bag("sum"), per_sample_weights=True).make_inputs()
    grads = []
    for m in (model, reference):
        sample_weights = weights.clone().requires_grad_()
        m(indices, offsets, sample_weights).pow(2).sum().backward()
        grads.append(sample_weights.grad)
    assert twobp.pending().jobs == 0 and model.weight.grad is None
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


def test_bag_autograd_grad_gets_the_weight_gradient_at_once():
    model = nn.EmbeddingBag(NUM, DIM, mode="max")
    reference = copy.deepcopy(model)
    twobp.patch(model)
    indices, offsets = BagSetting("", bag("max")).make_inputs()
    (got,) = torch.autograd.grad(model(indices, offsets).pow(2).sum(), [model.weight])
    (want,) = torch.autograd.grad(reference(indices, offsets).pow(2).sum(), [reference.weight])
    assert twobp.pending().jobs == 0
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("changed", ["indices", "offsets", "per_sample_weights"])
def test_bag_inputs_changed_in_place_before_backward_raise_as_in_plain(changed):
    """Plain autograd saves all three for the weight's gradient, and refuses them changed."""
    model = nn.EmbeddingBag(NUM, DIM, mode="sum")
    reference = copy.deepcopy(model)
    twobp.patch(model)
    for m in (reference, model):
        indices, offsets, weights = BagSetting("", bag("sum"), per_sample_weights=True).make_inputs()
        output = m(indices, offsets, weights)
        {"indices": indices, "offsets": offsets, "per_sample_weights": weights}[changed].add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            output.sum().backward()
    assert twobp.pending().jobs == 0
