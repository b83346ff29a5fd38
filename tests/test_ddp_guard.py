"""DistributedDataParallel over a patched model would step on unreduced gradients: refused, in
either order, with the replacement named; DDP on an unpatched (or unpatched-again) model works."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import twobp_autograd as twobp
from tests.ranks import run_scenario
from tests.utils import close_to_reference


@pytest.fixture
def one_rank_group(tmp_path) -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def test_ddp_over_a_patched_model_is_refused(one_rank_group: None) -> None:
    model = twobp.patch(_model())
    with pytest.raises(RuntimeError, match="GradientSynchroniser"):
        DistributedDataParallel(model)
    twobp.unpatch(model)
    DistributedDataParallel(model)(torch.randn(2, 3)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_patching_a_model_inside_ddp_is_refused(one_rank_group: None) -> None:
    twobp.patch(nn.Linear(2, 2))  # the guard on DDP's construction is installed by now
    wrapped = DistributedDataParallel(_model())  # an unpatched model: DDP as usual
    with pytest.raises(RuntimeError, match="GradientSynchroniser"):
        twobp.patch(wrapped)
    with pytest.raises(RuntimeError, match="GradientSynchroniser"):
        twobp.patch(nn.Sequential(wrapped))


def test_replicate_over_a_patched_model_is_refused_in_either_order(one_rank_group: None) -> None:
    """DDP's composable form builds its DDP at the first forward over a list of the module's
    parameters, which the check on DDP's module alone missed: the gradients came out unreduced."""
    from torch.distributed._composable import replicate

    patched_first = replicate(twobp.patch(_model()))
    with pytest.raises(RuntimeError, match="replicate.*GradientSynchroniser"):
        patched_first(torch.randn(2, 3))
    with pytest.raises(RuntimeError, match="replicate.*GradientSynchroniser"):
        twobp.patch(replicate(_model()))
    plain = replicate(_model())  # unpatched: DDP as usual
    plain(torch.randn(2, 3)).sum().backward()
    assert all(p.grad is not None for p in plain.parameters())


def test_replicate_built_on_fsdp2_reduces_after_the_flush(one_rank_group: None) -> None:
    from torch.distributed._composable.replicate_with_fsdp import replicate

    torch.manual_seed(0)
    reference = _model()
    patched = twobp.patch(copy.deepcopy(reference))
    x = torch.randn(5, 3)
    for model in (replicate(reference), replicate(patched)):
        model(x).pow(2).sum().backward()
    assert all(p.grad is None for p in patched.parameters())  # deferred
    twobp.flush_weight_grads()
    for (name, p), q in zip(patched.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad.full_tensor(), msg=name)


def _replicated_grads(rank: int) -> dict:
    from torch.distributed._composable.replicate_with_fsdp import replicate

    grads = {}
    for patched in (False, True):
        torch.manual_seed(0)
        model = replicate(twobp.patch(_model()) if patched else _model())
        for micro in range(2):  # each rank its own micro-batches
            model(torch.randn(4, 3, generator=torch.Generator().manual_seed(10 * rank + micro))).pow(2).sum().backward()
        twobp.flush_weight_grads()
        grads[patched] = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    return grads


def test_replicate_built_on_fsdp2_averages_the_flushed_gradients_over_two_ranks(tmp_path) -> None:
    for grads in run_scenario(_replicated_grads, 2, str(tmp_path)):
        for name, want in grads[False].items():
            assert close_to_reference(grads[True][name], want), name


@pytest.mark.filterwarnings("ignore:FSDP is switching to use")  # PyTorch's own, for a world of one
@pytest.mark.parametrize("order", ["patch_then_wrap", "wrap_then_patch"])
def test_fsdp1_over_a_patched_model_warns_that_nothing_is_deferred(
    one_rank_group: None, order: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FSDP1's layers compute with views of its flat parameters: plain's gradients, nothing queued."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from twobp_autograd import ddp_guard

    monkeypatch.setattr(ddp_guard, "_warned_fsdp1", False)  # one warning per process
    model = _model()
    with pytest.warns(UserWarning, match="FSDP1.*nothing is deferred.*fully_shard"):
        if order == "patch_then_wrap":
            wrapped = FullyShardedDataParallel(twobp.patch(model), device_id=torch.device("cpu"))
        else:
            wrapped = twobp.patch(FullyShardedDataParallel(model, device_id=torch.device("cpu")))
    wrapped(torch.randn(2, 3)).sum().backward()
    assert twobp.pending().jobs == 0
    assert all(p.grad is not None for p in wrapped.parameters())
