"""Cutting a model into pipeline stages, in three separate steps: the model's family breaks
it into blocks (:mod:`.families`), each block gets a cost (:mod:`.measure`), and a pure
function turns the costs into stage boundaries (:mod:`.partition`). :func:`split_model` does
all three."""

from .families import blocks_of, defer_norms, loss_fn_of
from .measure import agreed_block_costs, measure_block_costs, parameter_costs
from .partition import partition
from .pipeline_model import PipelineModel, split_model
from .ties import Tie, TiedGradients

__all__ = [
    "split_model",
    "PipelineModel",
    "Tie",
    "TiedGradients",
    "blocks_of",
    "loss_fn_of",
    "defer_norms",
    "partition",
    "parameter_costs",
    "measure_block_costs",
    "agreed_block_costs",
]
