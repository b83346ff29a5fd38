"""The one entry point: a model in, one module per stage out, with the loss its last stage's
output goes into and the parameters that several stages share."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor, nn

from .families import LossFn, LossItems, family_of
from .measure import measure_block_costs, parameter_costs
from .partition import partition
from .ties import Tie, ties_of

__all__ = ["PipelineModel", "split_model"]


@dataclass
class PipelineModel:
    """One module per stage (``pipeline[rank]`` is rank's), the loss the last stage's output
    goes into, and the ties. ``loss_items``: for a loss that averages over items other than
    samples (a Hugging Face model's tokens whose label is not -100), what counts them in a
    micro-batch's targets (``PipelineRuntime(loss_items=...)``); None for a mean over samples."""

    stages: list[nn.Module]
    loss_fn: LossFn
    ties: list[Tie]
    loss_items: LossItems | None = None

    def __len__(self) -> int:
        return len(self.stages)

    def __getitem__(self, stage: int) -> nn.Module:
        return self.stages[stage]


def split_model(
    model: nn.Module,
    num_stages: int,
    *,
    costs: Sequence[float] | None = None,
    sample: Tensor | None = None,
) -> PipelineModel:
    """``num_stages`` stages of ``model`` (an ``nn.Sequential``, a torchvision ResNet, VGG or
    VisionTransformer, a Hugging Face ``LlamaForCausalLM``, ``BertForMaskedLM`` or
    ``MambaForCausalLM``), balanced by ``costs`` (one per :func:`.blocks_of` block), else by
    the time measured on ``sample`` in this process, else by parameter count. The stages hold
    the model's own submodules: no parameter is copied.

    Every rank of a pipeline must cut at the same blocks, so each must pass the same costs:
    ``costs=agreed_block_costs(blocks_of(model), sample)`` measures them on every rank and
    averages them.

    Nothing is registered: the per-token norm classes of Hugging Face Llama and Mamba
    (``LlamaRMSNorm``, ``MambaRMSNorm``) keep plain autograd in a patched stage until the
    caller registers them, globally, with :func:`.defer_norms` (or ``twobp.register``).
    """
    family = family_of(model)
    num_blocks = family.num_blocks(model)
    if costs is None:
        blocks = family.blocks(model)
        costs = measure_block_costs(blocks, sample) if sample is not None else parameter_costs(blocks)
    if len(costs) != num_blocks:
        raise ValueError(f"twobp: {len(costs)} costs for {num_blocks} blocks: give one per block (blocks_of(model))")
    stages = family.stages(model, partition(costs, num_stages))
    return PipelineModel(stages, family.loss(model), ties_of(model, stages), family.loss_items(model))
