"""How each kind of model breaks into blocks, and how a run of blocks becomes one stage.

A pipeline stage is a contiguous run of blocks, each taking one tensor and returning one, whose
composition is the model's forward up to its output. ``nn.Sequential`` and torchvision's
ResNets, VGGs and Vision Transformers are chains of such blocks (a stage is an
``nn.Sequential`` of them); Hugging Face models need more (:mod:`.hugging_face`). Families
match a model's *exact* type: a subclass may have changed its forward, and the blocks would
then not compose to it. A model of another shape is split by hand: one module per rank.

The blocks and stages hold the model's own submodules: no parameter is copied.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ... import register
from ...ops import computes_like_llama_rms_norm, llama_rms_norm, recompute_rowwise
from ...registry import rule_for

__all__ = ["Family", "LossFn", "LossItems", "LibraryModel", "family_of", "blocks_of", "loss_fn_of", "defer_norms"]

LossFn = Callable[[Tensor, Tensor], Tensor]
#: How many items a loss that averages over them (not over samples) counts in a target.
LossItems = Callable[[Tensor], int]

#: A library's model (torchvision, Hugging Face, nn.Sequential), read by the attribute names of
#: its layout (``model.layer1``, ``model.model.layers``): nn.Module's attributes are untyped.
LibraryModel = Any


class Family:
    """One kind of model: its blocks, its stages, its loss, its own norm classes."""

    def num_blocks(self, model: nn.Module) -> int:
        raise NotImplementedError

    def stages(self, model: nn.Module, parts: Sequence[range]) -> list[nn.Module]:
        """One module per part, each part a contiguous range of block indices."""
        raise NotImplementedError

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return self.stages(model, [range(i, i + 1) for i in range(self.num_blocks(model))])

    def loss(self, model: nn.Module) -> LossFn:
        return F.cross_entropy

    def loss_items(self, model: nn.Module) -> LossItems | None:
        """None where :meth:`loss` averages over samples."""
        return None

    def norm_types(self) -> list[type]:
        """Per-token norm classes of the model's library that 2BP can defer once registered."""
        return []


def family_of(model: nn.Module) -> Family:
    """The family of ``model``; libraries not imported yet are not looked for (a model of
    theirs cannot exist)."""
    # A subclass with a forward of its own (a residual around its layers) is no chain.
    if isinstance(model, nn.Sequential) and type(model).forward is nn.Sequential.forward:
        return _Sequential()
    kind = type(model)
    if "torchvision" in sys.modules:
        from torchvision.models import VGG, ResNet, VisionTransformer

        chains: dict[type, type[Family]] = {ResNet: _ResNet, VGG: _VGG, VisionTransformer: _ViT}
        if kind in chains:
            return chains[kind]()
    if "transformers" in sys.modules:
        from .hugging_face import hugging_face_family

        family = hugging_face_family(model)
        if family is not None:
            return family
    raise TypeError(
        f"twobp: cannot split a {kind.__name__} into stages: pass an nn.Sequential (not a subclass with a "
        "forward of its own), a torchvision ResNet, VGG "
        "or VisionTransformer, a Hugging Face LlamaForCausalLM, BertForMaskedLM or MambaForCausalLM, "
        "or build one module per rank yourself and hand it to the runtime"
    )


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The model as a list of blocks (one tensor in, one out) whose composition is its forward
    up to its output: what a split balances and cuts between."""
    return family_of(model).blocks(model)


def loss_fn_of(model: nn.Module) -> LossFn:
    """``loss_fn(output, targets)``: the loss a Hugging Face model computes from ``labels=``;
    cross-entropy for any other model."""
    return family_of(model).loss(model)


_NORM_NAMES = ("RMSNorm", "LayerNorm", "LayerNorm2d")


def defer_norms(model: nn.Module) -> list[type]:
    """Register the model's own per-token norm classes for 2BP, so that their weight gradients
    are deferred too: its family's (``LlamaRMSNorm``, ``MambaRMSNorm``) and, in any model, each
    not yet registered class named ``*RMSNorm`` or ``*LayerNorm`` with parameters (Hugging Face's
    Qwen2, Mistral, Gemma, ... name theirs so, T5 its RMS norm ``T5LayerNorm``, torchvision
    ConvNeXt's ``LayerNorm2d``; a layer or RMS norm treats each sample on its own). By
    :func:`twobp_autograd.ops.llama_rms_norm` where a class computes as Llama's does, else with its
    forward re-run at the flush, its micro-batches joined
    (:func:`twobp_autograd.ops.recompute_rowwise`). The registration is global, like any
    ``twobp.register``. Returns the classes registered."""
    try:
        found = family_of(model).norm_types()
    except TypeError:  # a model this package cannot split has norms all the same
        found = []
    for module in model.modules():
        kind = type(module)
        named_so = kind.__name__.endswith(_NORM_NAMES) and any(True for _ in module.parameters(recurse=False))
        if named_so and kind not in found and rule_for(module) is None:
            found.append(kind)
    for norm in found:
        register(norm, llama_rms_norm if computes_like_llama_rms_norm(norm) else recompute_rowwise)
    return found


class _Chain(Family):
    """Models whose blocks compose by plain calls: a stage is an ``nn.Sequential`` of them."""

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        raise NotImplementedError

    def num_blocks(self, model: nn.Module) -> int:
        return len(self.blocks(model))

    def stages(self, model: nn.Module, parts: Sequence[range]) -> list[nn.Module]:
        blocks = self.blocks(model)
        return [nn.Sequential(*(blocks[i] for i in part)) for part in parts]


class _Sequential(_Chain):
    def blocks(self, model: LibraryModel) -> list[nn.Module]:
        """Its modules, one block each, but an in-place one (``ReLU(inplace=True)``) joined to
        the block before it: a stage starting with it would write into the activation it
        received, a leaf that requires grad."""
        groups: list[list[nn.Module]] = []
        for module in model:
            if groups and getattr(module, "inplace", False) is True:
                groups[-1].append(module)
            else:
                groups.append([module])
        return [group[0] if len(group) == 1 else nn.Sequential(*group) for group in groups]


class _ResNet(_Chain):
    """Stem, each residual block, pooled head."""

    def blocks(self, model: LibraryModel) -> list[nn.Module]:
        stem = nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool)
        body = [block for layer in (model.layer1, model.layer2, model.layer3, model.layer4) for block in layer]
        head = nn.Sequential(model.avgpool, nn.Flatten(1), model.fc)
        return [stem, *body, head]


class _VGG(_Chain):
    def blocks(self, model: LibraryModel) -> list[nn.Module]:
        return _group_after_weighted([*model.features, model.avgpool, nn.Flatten(1), *model.classifier])


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

    def __init__(self, vit: LibraryModel) -> None:
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
    def __init__(self, vit: LibraryModel) -> None:
        super().__init__()
        self.ln, self.heads = vit.encoder.ln, vit.heads

    def forward(self, x: Tensor) -> Tensor:
        return self.heads(self.ln(x)[:, 0])


class _ViT(_Chain):
    def blocks(self, model: LibraryModel) -> list[nn.Module]:
        return [_ViTStem(model), *model.encoder.layers, _ViTHead(model)]
