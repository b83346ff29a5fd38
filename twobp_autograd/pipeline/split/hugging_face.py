"""Hugging Face's ``LlamaForCausalLM``, ``BertForMaskedLM`` and ``MambaForCausalLM`` as
pipeline stages, left as the library ships them.

Their blocks are the embedding, each layer, and the final norm with the head. The first stage
takes token ids, the last returns logits, and the family's loss is the one the model computes
itself from ``labels=`` (shifted for causal models). A Hugging Face model does more in its
forward than run its layers: it builds rotary position embeddings and the attention mask once
and hands them to every layer. Those never cross stages; each stage rebuilds them from its
input, with the library's own functions, as the model would. Only what a single tensor can
carry is supported: no padding ``attention_mask``, no cache, no explicit ``position_ids``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .families import Family, LibraryModel, LossFn, LossItems

__all__ = ["hugging_face_family"]


def hugging_face_family(model: nn.Module) -> Family | None:
    """The family of ``model``'s exact type, or None."""
    from transformers import BertForMaskedLM, LlamaForCausalLM, MambaForCausalLM

    families: dict[type, type[Family]] = {LlamaForCausalLM: _Llama, BertForMaskedLM: _Bert, MambaForCausalLM: _Mamba}
    family = families.get(type(model))
    return None if family is None else family()


class _HFStage(nn.Module):
    """A contiguous part of a Hugging Face model: its embedding (first stage), some of its
    layers, and its final norm and head (last stage). Subclasses say how the model calls its
    layers."""

    def __init__(
        self, config: Any, embed: nn.Module | None, layers: Sequence[nn.Module], head: nn.Module | None
    ) -> None:
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
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=None,
            position_ids=position_ids,
            **_no_cache(create_causal_mask),
        )
        return {
            "attention_mask": mask,
            "position_embeddings": self.rotary_emb(hidden, position_ids=position_ids),
            "position_ids": position_ids,
            "use_cache": False,
        }


class _BertStage(_HFStage):
    def layer_arguments(self, hidden: Tensor) -> dict[str, Any]:
        from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

        # As BertModel._create_attention_masks does without a padding mask or a cache.
        if self.config.is_decoder:
            mask = create_causal_mask(
                config=self.config, inputs_embeds=hidden, attention_mask=None, **_no_cache(create_causal_mask)
            )
        else:
            mask = create_bidirectional_mask(config=self.config, inputs_embeds=hidden, attention_mask=None)
        return {"attention_mask": mask}


@functools.cache
def _no_cache(mask_function: Any) -> dict[str, None]:
    """No cache, in the keyword the installed release names it (``cache`` since transformers 5.24,
    which warns that ``past_key_values`` goes in 5.40). The layers take either as a default."""
    parameters = inspect.signature(mask_function).parameters
    return {"cache": None} if "cache" in parameters else {"past_key_values": None}


class _MambaStage(_HFStage):
    def layer_arguments(self, hidden: Tensor) -> dict[str, Any]:
        return {"attention_mask": None}


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


def _labels(labels: Tensor) -> int:
    """The positions a masked LM's loss averages over: those whose label is not -100."""
    return int((labels != -100).sum())


def _next_token_labels(labels: Tensor) -> int:
    """Those a causal LM's loss averages over: each position's next label, where not -100."""
    return int((labels[..., 1:] != -100).sum())


class _HuggingFace(Family):
    """Blocks: the embedding, each of the model's ``layers``, the final norm with the head."""

    def layers(self, model: nn.Module) -> nn.ModuleList:
        raise NotImplementedError

    def stage(self, model: nn.Module, layers: list[nn.Module], *, first: bool, last: bool) -> nn.Module:
        raise NotImplementedError

    def num_blocks(self, model: nn.Module) -> int:
        return len(self.layers(model)) + 2

    def stages(self, model: nn.Module, parts: Sequence[range]) -> list[nn.Module]:
        layers = self.layers(model)
        n = len(layers)
        return [
            self.stage(
                model, [layers[i - 1] for i in part if 1 <= i <= n], first=part.start == 0, last=part.stop == n + 2
            )
            for part in parts
        ]

    def loss(self, model: LibraryModel) -> LossFn:
        return functools.partial(model.loss_function, vocab_size=model.config.vocab_size)

    def loss_items(self, model: LibraryModel) -> LossItems | None:
        """A causal LM's loss averages over the next tokens whose label is not -100."""
        return _next_token_labels


class _Llama(_HuggingFace):
    def layers(self, model: LibraryModel) -> nn.ModuleList:
        return model.model.layers

    def stage(self, model: LibraryModel, layers: list[nn.Module], *, first: bool, last: bool) -> nn.Module:
        inner = model.model
        embed = inner.embed_tokens if first else None
        head = nn.Sequential(inner.norm, model.lm_head) if last else None
        return _LlamaStage(inner.rotary_emb, model.config, embed, layers, head)

    def norm_types(self) -> list[type]:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        return [LlamaRMSNorm]


class _Bert(_HuggingFace):
    def layers(self, model: LibraryModel) -> nn.ModuleList:
        return model.bert.encoder.layer

    def stage(self, model: LibraryModel, layers: list[nn.Module], *, first: bool, last: bool) -> nn.Module:
        return _BertStage(model.config, model.bert.embeddings if first else None, layers, model.cls if last else None)

    def loss(self, model: LibraryModel) -> LossFn:
        return functools.partial(_masked_lm_loss, vocab_size=model.config.vocab_size)

    def loss_items(self, model: LibraryModel) -> LossItems | None:
        return _labels


class _Mamba(_HuggingFace):
    def layers(self, model: LibraryModel) -> nn.ModuleList:
        return model.backbone.layers

    def stage(self, model: LibraryModel, layers: list[nn.Module], *, first: bool, last: bool) -> nn.Module:
        backbone = model.backbone
        head = _MambaHead(backbone.norm_f, model.lm_head) if last else None
        return _MambaStage(model.config, backbone.embeddings if first else None, layers, head)

    def norm_types(self) -> list[type]:
        from transformers.models.mamba.modeling_mamba import MambaRMSNorm

        return [MambaRMSNorm]
