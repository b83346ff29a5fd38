"""DistributedDataParallel over a patched model would step on unreduced gradients: refused, in
either order, with the replacement named; DDP on an unpatched (or unpatched-again) model works."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import twobp_autograd as twobp


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
