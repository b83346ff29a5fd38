"""Pipeline stages for the models people train, left as their libraries ship them.

:func:`split_model` cuts torchvision's ResNets, VGGs and Vision Transformers and Hugging Face's
``LlamaForCausalLM``, ``BertForMaskedLM`` and ``MambaForCausalLM`` into one plain module per
rank, built from the model's own submodules (no parameter is copied). Every stage takes one
tensor and returns one, as :class:`~.runtime.PipelineRuntime` sends them: the first stage takes
the model's input (images, token ids), the last returns its logits, and the returned
``loss_fn(logits, targets)`` is the loss the model computes itself (Hugging Face's
``labels=`` loss, shifted for causal models).

A Hugging Face model does more in its forward than run its layers: it builds rotary position
embeddings and the attention mask once and hands them to every layer. Those never cross
stages; each stage rebuilds them from its input, with the library's own functions, as the
model would. Only what a single tensor can carry is supported: no padding ``attention_mask``,
no cache, no explicit ``position_ids``.

A parameter that two stages use (tied input and output embeddings, on the first and the last
rank) gets part of its gradient on each of them. :class:`TiedGradients` sums the parts over
the owning ranks after each step, so every copy takes the same optimizer step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from .. import register
from ..ops import recompute
from . import stages as _stages

__all__ = ["PipelineModel", "Tie", "TiedGradients", "blocks_of", "split_model", "loss_fn_of", "defer_norms"]

LossFn = Callable[[Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class Tie:
    """A parameter that several stages hold."""

    name: str  # its qualified name in the model
    parameter: nn.Parameter
    stages: tuple[int, ...]


@dataclass
class PipelineModel:
    """One module per stage, the loss the last stage's output goes into, and the ties."""

    stages: list[nn.Module]
    loss_fn: LossFn
    ties: list[Tie]


# -- the public functions ----------------------------------------------------------------------


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The model as a list of runnable blocks (one tensor in, one out) whose composition is its
    forward up to the logits: what :func:`split_model` balances and cuts between."""
    family = _family_of(model)
    if family is None:
        return _stages.blocks_of(model)
    return [family.stage(model, range(i, i + 1)) for i in range(family.num_units(model))]


def split_model(
    model: nn.Module,
    num_stages: int,
    *,
    costs: "Sequence[float] | None" = None,
    sample: "Tensor | None" = None,
    norms: bool = True,
) -> PipelineModel:
    """``num_stages`` stages of ``model``, balanced by ``costs`` (one per :func:`blocks_of`
    block), else by the time measured on ``sample``, else by parameter count.

    With ``norms`` (the default), the model's own norm classes (``LlamaRMSNorm``,
    ``MambaRMSNorm``) are registered for 2BP first (see :func:`defer_norms`).
    """
    if norms:
        defer_norms(model)
    family = _family_of(model)
    blocks = blocks_of(model)
    if costs is None:
        costs = _stages.measure_block_costs(blocks, sample) if sample is not None else _stages.parameter_costs(blocks)
    if len(costs) != len(blocks):
        raise ValueError(f"{len(costs)} costs for {len(blocks)} blocks")
    parts = _stages.partition(costs, num_stages)
    if family is None:
        stages: list[nn.Module] = [nn.Sequential(*(blocks[i] for i in part)) for part in parts]
    else:
        stages = [family.stage(model, part) for part in parts]
    return PipelineModel(stages, loss_fn_of(model), _ties(model, stages))


def loss_fn_of(model: nn.Module) -> LossFn:
    """``loss_fn(logits, targets)``: the loss a Hugging Face model computes from ``labels=``;
    cross-entropy for a classifier."""
    family = _family_of(model)
    return F.cross_entropy if family is None else family.loss(model)


def defer_norms(model: nn.Module) -> list[type]:
    """Register the model's own per-token norm classes for 2BP (their forward re-run at flush,
    :func:`twobp_autograd.ops.recompute`), so their weight gradients are deferred too; a
    registration is global, like any ``twobp.register``. Returns the classes registered."""
    family = _family_of(model)
    found = [] if family is None else family.norm_types()
    for norm in found:
        register(norm, recompute)
    return found


class TiedGradients:
    """Sums the gradients of tied parameters over the ranks whose stages hold them.

    Build it on every rank, in the same order as any other process groups (it creates one
    group per set of owning ranks, which every rank must take part in), with the
    :class:`PipelineModel` that rank split; stage ``i`` runs on rank ``i`` of ``group``. Call
    :meth:`all_reduce` after each step's last weight-gradient flush, before the optimizer step.
    """

    def __init__(self, pipeline: PipelineModel, *, group: "dist.ProcessGroup | None" = None) -> None:
        rank = dist.get_rank(group)
        groups: dict[tuple[int, ...], Any] = {}
        self.reductions: list[tuple[nn.Parameter, Any]] = []
        for tie in pipeline.ties:
            if tie.stages not in groups:
                ranks = [s if group is None else dist.get_global_rank(group, s) for s in tie.stages]
                groups[tie.stages] = dist.new_group(ranks)
            if rank in tie.stages:
                self.reductions.append((tie.parameter, groups[tie.stages]))

    def all_reduce(self) -> None:
        for parameter, group in self.reductions:
            if parameter.grad is None:  # this rank's use of it got no gradient; the sum still needs it
                parameter.grad = torch.zeros_like(parameter)
            dist.all_reduce(parameter.grad, group=group)


def _ties(model: nn.Module, stages: Sequence[nn.Module]) -> list[Tie]:
    holders: dict[int, list[int]] = {}
    for index, stage in enumerate(stages):
        for p in stage.parameters():
            holders.setdefault(id(p), []).append(index)
    return [
        Tie(name, p, tuple(holders[id(p)]))
        for name, p in model.named_parameters()
        if len(holders.get(id(p), ())) > 1
    ]


# -- model families ---------------------------------------------------------------------------
#
# A family cuts a model into units: [what comes before the first layer, each layer, what
# comes after the last]; a stage is a contiguous range of units.


class _Family:
    def num_units(self, model: nn.Module) -> int:
        raise NotImplementedError

    def stage(self, model: nn.Module, units: range) -> nn.Module:
        raise NotImplementedError

    def loss(self, model: nn.Module) -> LossFn:
        return F.cross_entropy

    def norm_types(self) -> list[type]:
        return []


def _layers_of(units: range, num_layers: int) -> range:
    """The layer indices among ``units`` (unit 0 is the embedding, the last the head)."""
    return range(max(units.start, 1) - 1, min(units.stop, num_layers + 1) - 1)


class _SequentialFamily(_Family):
    """Models whose blocks compose by plain calls."""

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        raise NotImplementedError

    def num_units(self, model: nn.Module) -> int:
        return len(self.blocks(model))

    def stage(self, model: nn.Module, units: range) -> nn.Module:
        blocks = self.blocks(model)
        return nn.Sequential(*(blocks[i] for i in units))


class _VGG(_SequentialFamily):
    def blocks(self, model: nn.Module) -> list[nn.Module]:
        layers = [*model.features, model.avgpool, nn.Flatten(1), *model.classifier]
        return _group_after_weighted(layers)


def _group_after_weighted(layers: Sequence[nn.Module]) -> list[nn.Module]:
    """One block per weighted layer with the layers that follow it up to the next: a stage
    never starts with an in-place ReLU, which would write into the activations it received
    (a leaf that requires grad)."""
    groups: list[list[nn.Module]] = []
    for layer in layers:
        if not groups or any(True for _ in layer.parameters(recurse=False)):
            groups.append([layer])
        else:
            groups[-1].append(layer)
    return [nn.Sequential(*group) for group in groups]


class _ViTStem(nn.Module):
    """Patches, class token and position embedding: VisionTransformer.forward up to its
    encoder's layers."""

    def __init__(self, vit: nn.Module) -> None:
        super().__init__()
        self.conv_proj = vit.conv_proj
        self.class_token = vit.class_token
        self.pos_embedding = vit.encoder.pos_embedding
        self.dropout = vit.encoder.dropout
        self.process_input = vit._process_input  # the model's own patchify (reads conv_proj)

    def forward(self, x: Tensor) -> Tensor:
        x = self.process_input(x)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.dropout(x + self.pos_embedding)


class _ViTHead(nn.Module):
    def __init__(self, vit: nn.Module) -> None:
        super().__init__()
        self.ln, self.heads = vit.encoder.ln, vit.heads

    def forward(self, x: Tensor) -> Tensor:
        return self.heads(self.ln(x)[:, 0])


class _ViT(_SequentialFamily):
    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return [_ViTStem(model), *model.encoder.layers, _ViTHead(model)]


class _HFStage(nn.Module):
    """A contiguous part of a Hugging Face model: its embedding (first stage), some of its
    layers, and its final norm and head (last stage). Subclasses say how the model calls its
    layers."""

    def __init__(self, config: Any, embed: "nn.Module | None", layers: Sequence[nn.Module], head: "nn.Module | None") -> None:
        super().__init__()
        self.config = config
        self.embed = embed
        self.layers = nn.ModuleList(layers)
        self.head = head

    def forward(self, x: Tensor) -> Tensor:
        if self.embed is not None:
            x = self.embed(x)
        if len(self.layers):
            context = self.layer_arguments(x)
            for layer in self.layers:
                x = layer(x, **context)
        if self.head is not None:
            x = self.head(x)
        return x

    def layer_arguments(self, hidden: Tensor) -> dict[str, Any]:
        raise NotImplementedError


class _LlamaStage(_HFStage):
    def __init__(self, rotary_emb: nn.Module, *args: Any) -> None:
        super().__init__(*args)
        self.rotary_emb = rotary_emb

    def layer_arguments(self, hidden: Tensor) -> dict[str, Any]:
        from transformers.masking_utils import create_causal_mask

        # As LlamaModel.forward does without a cache or explicit positions.
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = create_causal_mask(
            config=self.config, inputs_embeds=hidden, attention_mask=None, past_key_values=None, position_ids=position_ids
        )
        return {
            "attention_mask": mask,
            "position_embeddings": self.rotary_emb(hidden, position_ids=position_ids),
            "position_ids": position_ids,
            "past_key_values": None,
            "use_cache": False,
        }


class _BertStage(_HFStage):
    def layer_arguments(self, hidden: Tensor) -> dict[str, Any]:
        from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

        # As BertModel._create_attention_masks does without a padding mask or a cache.
        if self.config.is_decoder:
            mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None, past_key_values=None)
        else:
            mask = create_bidirectional_mask(config=self.config, inputs_embeds=hidden, attention_mask=None)
        return {"attention_mask": mask, "past_key_values": None}


class _MambaStage(_HFStage):
    def layer_arguments(self, hidden: Tensor) -> dict[str, Any]:
        return {"cache_params": None, "attention_mask": None}


class _MambaHead(nn.Module):
    """MambaModel's final norm and MambaForCausalLM's head, as its forward runs them."""

    def __init__(self, norm_f: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm_f, self.lm_head = norm_f, lm_head

    def forward(self, hidden: Tensor) -> Tensor:
        return self.lm_head(self.norm_f(hidden).to(self.lm_head.weight.dtype)).float()


def _masked_lm_loss(logits: Tensor, labels: Tensor, *, vocab_size: int) -> Tensor:
    """BertForMaskedLM's loss: cross-entropy over all positions, -100 ignored."""
    return F.cross_entropy(logits.view(-1, vocab_size), labels.view(-1))


class _Llama(_Family):
    def num_units(self, model: nn.Module) -> int:
        return model.config.num_hidden_layers + 2

    def stage(self, model: nn.Module, units: range) -> nn.Module:
        inner, n = model.model, model.config.num_hidden_layers
        layers = [inner.layers[i] for i in _layers_of(units, n)]
        embed = inner.embed_tokens if units.start == 0 else None
        head = nn.Sequential(inner.norm, model.lm_head) if units.stop == n + 2 else None
        return _LlamaStage(inner.rotary_emb, model.config, embed, layers, head)

    def loss(self, model: nn.Module) -> LossFn:
        return functools.partial(model.loss_function, vocab_size=model.config.vocab_size)

    def norm_types(self) -> list[type]:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        return [LlamaRMSNorm]


class _Bert(_Family):
    def num_units(self, model: nn.Module) -> int:
        return len(model.bert.encoder.layer) + 2

    def stage(self, model: nn.Module, units: range) -> nn.Module:
        n = len(model.bert.encoder.layer)
        layers = [model.bert.encoder.layer[i] for i in _layers_of(units, n)]
        embed = model.bert.embeddings if units.start == 0 else None
        head = model.cls if units.stop == n + 2 else None
        return _BertStage(model.config, embed, layers, head)

    def loss(self, model: nn.Module) -> LossFn:
        return functools.partial(_masked_lm_loss, vocab_size=model.config.vocab_size)


class _Mamba(_Family):
    def num_units(self, model: nn.Module) -> int:
        return len(model.backbone.layers) + 2

    def stage(self, model: nn.Module, units: range) -> nn.Module:
        backbone, n = model.backbone, len(model.backbone.layers)
        layers = [backbone.layers[i] for i in _layers_of(units, n)]
        embed = backbone.embeddings if units.start == 0 else None
        head = _MambaHead(backbone.norm_f, model.lm_head) if units.stop == n + 2 else None
        return _MambaStage(model.config, embed, layers, head)

    def loss(self, model: nn.Module) -> LossFn:
        return functools.partial(model.loss_function, vocab_size=model.config.vocab_size)

    def norm_types(self) -> list[type]:
        from transformers.models.mamba.modeling_mamba import MambaRMSNorm

        return [MambaRMSNorm]


def _family_of(model: nn.Module) -> "_Family | None":
    """The family of ``model``'s exact type (a subclass may have changed its forward), or None
    for what :func:`stages.blocks_of` handles. Libraries not installed are not looked for."""
    import sys

    kind = type(model)
    if "torchvision" in sys.modules:
        from torchvision.models import VGG, VisionTransformer

        if kind is VGG:
            return _VGG()
        if kind is VisionTransformer:
            return _ViT()
    if "transformers" in sys.modules:
        from transformers import BertForMaskedLM, LlamaForCausalLM, MambaForCausalLM

        if kind is LlamaForCausalLM:
            return _Llama()
        if kind is BertForMaskedLM:
            return _Bert()
        if kind is MambaForCausalLM:
            return _Mamba()
    return None
