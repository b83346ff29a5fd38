"""nn.Embedding against plain autograd: padding_idx (incl. negative), scale_grad_by_freq,
unbatched and scalar indices, int32 indices, tied weights, the max_norm / sparse fallbacks and
the module-level contract."""

from __future__ import annotations

import copy
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
def test_unsupported_options_keep_plain_autograd(option, reason):
    model = nn.Sequential(nn.Embedding(NUM, DIM, **option))
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
def test_unsupported_options_set_after_patch_keep_plain_autograd(option):
    """Set on the module after patch(): sparse gradients came out dense (SparseAdam then refused
    them), and max_norm's in-place renormalisation made the flush refuse the queued work."""
    model = nn.Embedding(NUM, DIM)
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
def test_plain_path_queues_nothing(mode):
    model = nn.Embedding(NUM, DIM)
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


def test_nothing_written_before_flush():
    model = nn.Embedding(NUM, DIM)
    twobp.patch(model)
    model(torch.randint(0, NUM, (2, 5))).sum().backward()
    assert_no_grads(model)
    assert twobp.pending().jobs == 1
    twobp.flush_weight_grads()
    assert model.weight.grad is not None
