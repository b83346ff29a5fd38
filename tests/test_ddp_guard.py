"""DistributedDataParallel over a patched model would step on unreduced gradients: refused, in
either order, with the replacement named; DDP on an unpatched (or unpatched-again) model works."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import twobp_autograd as twobp
from tests.ranks import run_scenario
from tests.utils import close_to_reference


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


def test_patching_the_model_inside_a_ddp_built_earlier_is_refused(one_rank_group: None) -> None:
    """``patch(accelerator.unwrap_model(model))`` after ``prepare`` (or a Trainer callback):
    the wrapper is not inside what is patched, and each rank stepped on its own gradients
    (0.2 off DDP in 3 steps). Refused; a dropped wrapper does not count."""
    from torch.distributed._composable import replicate

    inner = _model()
    wrapped = DistributedDataParallel(inner)
    with pytest.raises(RuntimeError, match="built earlier.*GradientSynchroniser"):
        twobp.patch(inner)
    with pytest.raises(RuntimeError, match="built earlier.*GradientSynchroniser"):
        twobp.patch(inner[2])
    assert not any(twobp.patching._is_patched(m) for m in inner.modules()), "refused before patching anything"
    del wrapped
    twobp.patch(inner)  # the wrapper is gone: nothing reduces these parameters

    replicated = _model()
    replicate(replicated)(torch.randn(2, 3))  # builds its DDP at the first forward
    with pytest.raises(RuntimeError, match="built earlier.*GradientSynchroniser"):
        twobp.patch(replicated[0])


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


@pytest.mark.parametrize("copied_by", ["deepcopy", "torch.save-and-load"])
def test_ddp_and_replicate_over_a_copy_of_a_patched_model_are_refused(copied_by, one_rank_group, tmp_path) -> None:
    """A copy of a patched model defers as the original does: replicate() matched the parameters
    it wraps against the patched modules patch() had made, not copies (each rank kept its own
    gradients, 0.06 off)."""
    from torch.distributed._composable import replicate

    original = twobp.patch(_model())
    if copied_by == "deepcopy":
        copies = [copy.deepcopy(original) for _ in range(2)]
    else:
        torch.save(original, tmp_path / "model.pt")
        copies = [torch.load(tmp_path / "model.pt", weights_only=False) for _ in range(2)]
    with pytest.raises(RuntimeError, match="replicate.*GradientSynchroniser"):
        replicate(copies[0])(torch.randn(2, 3))
    with pytest.raises(RuntimeError, match="GradientSynchroniser"):
        DistributedDataParallel(copies[1])


@pytest.mark.parametrize("copied_by", ["deepcopy", "torch.save-and-load"])
def test_patching_the_model_inside_a_copy_of_a_ddp_is_refused(copied_by, one_rank_group, tmp_path) -> None:
    """A DDP deep-copied or loaded is built by ``__setstate__``, not ``__init__``, with a reducer
    of its own: patching its module went through, and each rank stepped on its own gradients
    (1.53 off DDP's mean on two ranks)."""
    twobp.patch(nn.Linear(2, 2))  # the guard on DDP's construction is installed by now
    wrapped = DistributedDataParallel(_model())
    if copied_by == "deepcopy":
        copied = copy.deepcopy(wrapped)
    else:
        torch.save(wrapped, tmp_path / "ddp.pt")
        copied = torch.load(tmp_path / "ddp.pt", weights_only=False)
    del wrapped
    with pytest.raises(RuntimeError, match="built earlier.*GradientSynchroniser"):
        twobp.patch(copied.module)


_FRESH_PROCESS = """
import sys, torch
model = torch.load(sys.argv[1], weights_only=False)  # no patch() in this process
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
torch.manual_seed(0)
x = torch.randn(2, 3)
model(x).pow(2).sum().backward()
optimizer.zero_grad()  # drops this micro-batch's queued work, as plain drops its gradients
model(x).pow(2).sum().backward()
try:
    optimizer.step()
    print("stepped")
except RuntimeError as error:
    print("refused" if "twobp:" in str(error) else "other-error")
import twobp_autograd as twobp
twobp.flush_weight_grads()
torch.save([p.grad for p in model.parameters()], sys.argv[2])
"""


def _one_micro_batch_grads(model: nn.Module) -> list[torch.Tensor]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(0)
    x = torch.randn(2, 3)
    for _ in range(2):
        optimizer.zero_grad()
        model(x).pow(2).sum().backward()
    return [p.grad for p in model.parameters()]


def test_a_patched_model_loaded_in_a_fresh_process_brings_its_guards(tmp_path) -> None:
    """Unpickled where patch() never ran (torch.load, a spawned worker), a patched model still
    defers, so the guards install with it: the step before the flush is refused, and zero_grad
    drops the queued micro-batch (without its guard that work came back at the flush: twice
    plain's gradient)."""
    import subprocess
    import sys

    model = _model()
    torch.save(twobp.patch(copy.deepcopy(model)), tmp_path / "model.pt")
    script = tmp_path / "fresh.py"
    script.write_text(_FRESH_PROCESS)
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "model.pt"), str(tmp_path / "grads.pt")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["refused"], result.stdout
    for got, want in zip(torch.load(tmp_path / "grads.pt"), _one_micro_batch_grads(model), strict=True):
        torch.testing.assert_close(got, want)


_DDP_BEFORE_IMPORT = """
import sys, torch, torch.distributed as dist
from torch import nn
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
inner = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
wrapped = torch.nn.parallel.DistributedDataParallel(inner)
import twobp_autograd as twobp  # late: a plugin, or a Trainer callback
try:
    twobp.patch(inner)
    print("patched")
except RuntimeError as error:
    print("refused" if "built earlier" in str(error) else "other-error")
dist.destroy_process_group()
"""


def test_patching_inside_a_ddp_built_before_the_package_was_imported_is_refused(tmp_path) -> None:
    """A DDP built before this package was imported escaped the wrapped constructor: patching
    its module went through, and each rank stepped on its own gradients (0.2-0.6 off DDP's)."""
    import subprocess
    import sys

    script = tmp_path / "late_import.py"
    script.write_text(_DDP_BEFORE_IMPORT)
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "store")], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["refused"], result.stdout


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

    from twobp_autograd import warn_once

    monkeypatch.setattr(warn_once, "given", set())  # one warning per process
    model = _model()
    with pytest.warns(UserWarning, match="FSDP1.*nothing is deferred.*fully_shard"):
        if order == "patch_then_wrap":
            wrapped = FullyShardedDataParallel(twobp.patch(model), device_id=torch.device("cpu"))
        else:
            wrapped = twobp.patch(FullyShardedDataParallel(model, device_id=torch.device("cpu")))
    wrapped(torch.randn(2, 3)).sum().backward()
    assert twobp.pending().jobs == 0
    assert all(p.grad is not None for p in wrapped.parameters())
