"""split_model on chains of blocks (nn.Sequential, torchvision's ResNet): blocks that compose
to the model, stages that share its parameters; models it cannot cut are refused with advice.
Torchvision's VGG and ViT and the Hugging Face models are in
tests/pipeline/test_split_library_models.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from twobp_autograd.pipeline.split import PipelineModel, blocks_of, split_model

torchvision = pytest.importorskip("torchvision")


def small_net() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(4, 32), nn.BatchNorm1d(32), nn.ReLU(),
        nn.Linear(32, 8), nn.ReLU(), nn.Linear(8, 2),
    )  # fmt: skip


def run_through(stages, x: torch.Tensor) -> torch.Tensor:
    for stage in stages:
        x = stage(x)
    return x


def test_sequential_blocks_are_its_children() -> None:
    model = small_net()
    assert all(a is b for a, b in zip(blocks_of(model), model, strict=True))


def test_an_in_place_module_stays_with_the_block_before_it() -> None:
    """A stage starting with ReLU(inplace=True) would write into the activation it received (a
    leaf that requires grad): the runtime failed. The in-place module joins the block before it."""
    model = nn.Sequential(
        nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 2)
    )
    blocks = blocks_of(model)
    assert [list(b) if isinstance(b, nn.Sequential) else b for b in blocks] == [
        [model[0], model[1]], [model[2], model[3]], model[4]
    ]  # fmt: skip
    for stage in split_model(model, 3).stages[1:]:
        received = torch.randn(3, 8, requires_grad=True)  # a leaf, as the runtime hands it over
        stage(received).sum().backward()


def test_resnet_blocks_compose_to_its_forward() -> None:
    model = torchvision.models.resnet18(num_classes=5).eval()
    blocks = blocks_of(model)
    assert len(blocks) == 1 + 8 + 1  # stem, the residual blocks, pooled head
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(run_through(blocks, x), model(x), rtol=0, atol=0)


def test_other_models_are_refused_with_advice() -> None:
    class Custom(nn.Module):
        def forward(self, x):
            return x

    with pytest.raises(TypeError, match="twobp: cannot split a Custom.*one module per rank"):
        blocks_of(Custom())
    with pytest.raises(TypeError, match="twobp: cannot split a Custom"):
        split_model(Custom(), 2)


def test_a_sequential_with_a_forward_of_its_own_is_refused() -> None:
    """A residual written as an nn.Sequential subclass was cut as a plain chain: the stages
    computed its body alone and dropped the residual (output 1.46 off), with no word."""

    class Residual(nn.Sequential):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + super().forward(x)

    with pytest.raises(TypeError, match="twobp: cannot split a Residual.*not a subclass with a forward of its own"):
        split_model(Residual(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)), 2)

    class Named(nn.Sequential):  # a subclass that keeps the chain's forward is one
        pass

    assert len(split_model(Named(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)), 2).stages) == 2


@pytest.mark.parametrize("by", ["parameters", "measured", "given"])
def test_split_shares_parameters_and_composes(by: str) -> None:
    model = small_net().eval()
    x = torch.randn(6, 4)
    kwargs = {"parameters": {}, "measured": {"sample": x}, "given": {"costs": [1, 1, 1, 1, 1, 1]}}[by]
    pipeline = split_model(model, 3, **kwargs)
    assert len(pipeline) == 3 and all(len(stage) > 0 for stage in pipeline.stages)
    assert [id(p) for s in pipeline.stages for p in s.parameters()] == [id(p) for p in model.parameters()]
    assert pipeline.ties == []
    with torch.no_grad():
        torch.testing.assert_close(run_through(pipeline.stages, x), model(x), rtol=0, atol=0)


def test_a_rank_takes_its_stage_by_index() -> None:
    model = small_net()
    pipeline: PipelineModel = split_model(model, 2, costs=[1, 1, 1, 1, 1, 1])
    assert pipeline[1] is pipeline.stages[1] and list(pipeline[1]) == list(model)[3:]
    with pytest.raises(ValueError, match="twobp: 2 costs for 6 blocks"):
        split_model(model, 2, costs=[1, 1])


def test_resnet_splits_into_stages_that_compose() -> None:
    model = torchvision.models.resnet18(num_classes=5).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(run_through(split_model(model, 3).stages, x), model(x), rtol=0, atol=0)

