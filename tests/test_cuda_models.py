"""Whole models on a GPU, as users train them there: torchvision's ResNet-50 (contiguous and
channels-last) and a tiny Hugging Face Llama, in fp32 and under bf16 autocast, over several
micro-batches and one flush. Each side's gradients are measured against the same model run in
fp64, so that the bound is the hardware's own rounding on these gradients (plain autograd's
error), not a guess. The per-op files check each layer on CUDA; these check that nothing
between the layers (cuDNN's algorithm choice per batch size, the autocast casts of a weight,
memory formats) breaks the contract.

Skipped without CUDA.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import twobp_autograd as twobp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
torchvision = pytest.importorskip("torchvision")
transformers = pytest.importorskip("transformers")

from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402

from tests import tiny_models  # noqa: E402

MICRO_BATCHES = 3
#: Each side's gradient is compared with the same model's in fp64, norm-wise per parameter
#: (||g - g64|| / ||g64||): 2BP's error may be at most FACTOR times plain autograd's own, or
#: FLOOR, whichever is larger. Plain autograd's error is the hardware's rounding on this very
#: gradient (cuDNN picks its algorithm per batch size, bf16 autocast rounds each product), so
#: the bound follows the machine instead of guessing it. One micro-batch of three lost is an
#: error near 0.3, far over both.
FACTOR = 3.0
FLOOR = {None: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def no_tf32(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """fp32 as fp32: TF32 rounds each operand to 10 bits and would hide a small error."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(precision)


def _relative_error(grad: Tensor, exact: Tensor) -> float:
    return ((grad.double() - exact).norm() / exact.norm().clamp_min(1e-300)).item()


def _assert_grads_close(model: nn.Module, reference: nn.Module, exact: nn.Module, dtype: torch.dtype | None) -> None:
    """2BP's gradients against fp64's no worse than plain autograd's (see FACTOR)."""
    for (name, p), q, e in zip(model.named_parameters(), reference.parameters(), exact.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), f"{name}: .grad {p.grad is None=} but {q.grad is None=}"
        if q.grad is None:
            continue
        assert p.grad.dtype == q.grad.dtype and p.grad.shape == q.grad.shape, name
        ours, plain = _relative_error(p.grad, e.grad), _relative_error(q.grad, e.grad)
        bound = max(FACTOR * plain, FLOOR[dtype])
        assert ours <= bound, f"{name}: 2BP's error against fp64 {ours:.1e}, plain autograd's {plain:.1e}"


def _train_all(
    model: nn.Module,
    reference: nn.Module,
    exact: nn.Module,
    make_batch: Callable[[], tuple[Tensor, Tensor]],
    dtype: torch.dtype | None,
) -> None:
    """MICRO_BATCHES forward/backward calls on each (``exact`` in fp64, the others under
    autocast to ``dtype`` if given); .grad untouched on the patched side until the flush."""
    for _ in range(MICRO_BATCHES):
        x, y = make_batch()
        for net in (model, reference, exact):
            fp64 = net is exact
            with torch.autocast("cuda", dtype=dtype or torch.float16, enabled=dtype is not None and not fp64):
                out = net(x.double() if fp64 and x.is_floating_point() else x)
                loss = F.cross_entropy(out.flatten(0, -2).double() if fp64 else out.flatten(0, -2).float(), y.flatten())
            (loss / MICRO_BATCHES).backward()
    assert all(p.grad is None for p in model.parameters()), "a deferred .grad written in backward-p1"
    assert twobp.pending().jobs > 0
    twobp.flush_weight_grads()
    assert twobp.pending() == (0, 0)


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_resnet50_on_cuda_matches_plain_autograd(memory_format: torch.memory_format, dtype: torch.dtype | None) -> None:
    model = torchvision.models.resnet50(num_classes=10, zero_init_residual=True).cuda().to(memory_format=memory_format)
    reference, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    report = twobp.patch(model, report=True)
    assert report.skipped == {}

    def batch() -> tuple[Tensor, Tensor]:
        x = torch.randn(4, 3, 64, 64, device="cuda").to(memory_format=memory_format)
        return x, torch.randint(0, 10, (4,), device="cuda")

    _train_all(model, reference, exact, batch, dtype)
    _assert_grads_close(model, reference, exact, dtype)


@pytest.mark.parametrize("norm_rule", [twobp.ops.llama_rms_norm, twobp.ops.recompute], ids=["llama-rule", "recompute"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_llama_on_cuda_matches_plain_autograd(dtype: torch.dtype | None, norm_rule: Callable[..., Tensor]) -> None:
    vocab, sequence = 96, 16
    model = tiny_models.llama(vocab, hidden=64, layers=2, sequence=sequence).cuda()
    reference, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    twobp.register(LlamaRMSNorm, norm_rule)
    report = twobp.patch(model, report=True)
    assert report.skipped == {}, str(report)

    def batch() -> tuple[Tensor, Tensor]:
        ids = torch.randint(0, vocab, (2, sequence), device="cuda")
        return ids, ids.roll(-1, dims=1)

    class Logits(nn.Module):
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net

        def forward(self, ids: Tensor) -> Tensor:
            return self.net(input_ids=ids).logits

    _train_all(Logits(model), Logits(reference), Logits(exact), batch, dtype)
    _assert_grads_close(model, reference, exact, dtype)
