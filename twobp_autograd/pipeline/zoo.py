"""The models the pipeline benchmarks run, each built from a seed and a few size options,
with its batches and its loss: kept apart from any one benchmark so that all of them
(``bench pipeline``, and the scripts in benchmarks/) measure the same models.

Nothing is downloaded: torchvision's ResNet-152 and the Hugging Face models are built from
their configurations.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .split import loss_fn_of

__all__ = ["MODELS", "DEFAULT_BATCH", "ModelSpec", "add_model_arguments", "build_model", "LlamaLikeBlock"]

MODELS = ("resnet152", "transformer", "mlp", "llama", "bert", "mamba")
#: Samples per step when the command line names none.
DEFAULT_BATCH = {"mlp": 32, "transformer": 16, "resnet152": 16, "llama": 16, "bert": 16, "mamba": 16}


def add_model_arguments(
    parser: argparse.ArgumentParser, *, batch_size: int | None, batch_help: str | None = None
) -> None:
    """The options :func:`build_model` reads, and the batch size."""
    parser.add_argument("--model", choices=MODELS, default="mlp")
    parser.add_argument("--batch-size", type=int, default=batch_size, help=batch_help)
    parser.add_argument("--width", type=int, default=None, help="hidden size (all but resnet152)")
    parser.add_argument("--depth", type=int, default=None, help="number of blocks / layers (all but resnet152)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sample (all but resnet152)")
    parser.add_argument("--image-size", type=int, default=64, help="resnet152 input resolution")


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary position embeddings and Linear projections."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = (proj(x).view(b, t, self.heads, d // self.heads).transpose(1, 2) for proj in (self.q, self.k, self.v))
        q, k = _rotate(q), _rotate(k)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, t, d))


def _rotate(x: Tensor) -> Tensor:
    """Rotary position embedding on the last dimension (pairs of halves)."""
    t, half = x.shape[-2], x.shape[-1] // 2
    frequencies = 10000.0 ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = torch.arange(t, device=x.device, dtype=torch.float32)[:, None] * frequencies
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x[..., :half], x[..., half:]
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaLikeBlock(nn.Module):
    """Pre-norm residual block: RMSNorm, attention, RMSNorm, SwiGLU MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(dim), Attention(dim, heads)
        self.mlp_norm, self.mlp = nn.RMSNorm(dim), SwiGLU(dim, 8 * dim // 3)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


def _token_cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """Cross-entropy over every token: logits (batch, time, vocab), targets (batch, time). Targets
    keep their batch dim, so that a step splits them where it splits the inputs, at any batch size."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


ModelSpec = tuple[
    nn.Module, Callable[[int, torch.Generator], tuple[Tensor, Tensor]], Callable[[Tensor, Tensor], Tensor]
]


def build_model(name: str, args: argparse.Namespace, *, seed: int = 0) -> ModelSpec:
    """The model, built from ``seed`` (the same weights on every rank) in training mode;
    ``make_batch(batch_size, generator) -> (inputs, targets)``; and the loss."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    torch.manual_seed(seed)
    hugging_face = name in ("llama", "bert", "mamba")
    model, make_batch, loss_fn = _hugging_face_model(name, args) if hugging_face else _BUILDERS[name](args)
    return model.train(), make_batch, loss_fn


def _mlp(args: argparse.Namespace) -> ModelSpec:
    """By default 8 blocks of Linear 512->2048, GELU, Linear 2048->512, LayerNorm."""
    width, seq = args.width or 512, args.seq_len or 64
    model = nn.Sequential(
        *(
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.LayerNorm(width))
            for _ in range(args.depth or 8)
        )
    )

    def make_batch(b: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
        return torch.randn(b, seq, width, generator=g), torch.randn(b, seq, width, generator=g)

    return model, make_batch, F.mse_loss


def _transformer(args: argparse.Namespace) -> ModelSpec:
    width, seq, vocab = args.width or 256, args.seq_len or 64, 1000
    model = nn.Sequential(
        nn.Embedding(vocab, width),
        *(LlamaLikeBlock(width, heads=max(1, width // 64)) for _ in range(args.depth or 8)),
        nn.Sequential(nn.RMSNorm(width), nn.Linear(width, vocab, bias=False)),
    )

    def make_batch(b: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
        tokens = torch.randint(0, vocab, (b, seq + 1), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    return model, make_batch, _token_cross_entropy


def _resnet152(args: argparse.Namespace) -> ModelSpec:
    import torchvision

    size, classes = args.image_size, 100
    model = torchvision.models.resnet152(num_classes=classes)

    def make_batch(b: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
        return torch.randn(b, 3, size, size, generator=g), torch.randint(0, classes, (b,), generator=g)

    return model, make_batch, F.cross_entropy


_BUILDERS = {"mlp": _mlp, "transformer": _transformer, "resnet152": _resnet152}


def _hugging_face_model(name: str, args: argparse.Namespace) -> ModelSpec:
    """A Hugging Face model built from a config (nothing downloaded), tied embeddings, sized
    by --width/--depth/--seq-len like the transformer; BERT with 15% of positions labelled."""
    import transformers

    width, depth, seq, vocab = args.width or 256, args.depth or 8, args.seq_len or 64, 1000
    heads = max(1, width // 64)
    # PretrainedConfig takes attn_implementation through its **kwargs, which the config classes'
    # typed signatures leave out; passed the same way here.
    sdpa: dict[str, Any] = {"attn_implementation": "sdpa"}
    if name == "llama":
        model: nn.Module = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                vocab_size=vocab, hidden_size=width, intermediate_size=8 * width // 3, num_hidden_layers=depth,
                num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=seq,
                tie_word_embeddings=True, **sdpa,
            )
        )  # fmt: skip
    elif name == "bert":
        model = transformers.BertForMaskedLM(
            transformers.BertConfig(
                vocab_size=vocab, hidden_size=width, intermediate_size=4 * width, num_hidden_layers=depth,
                num_attention_heads=heads, max_position_embeddings=seq, **sdpa,
            )
        )  # fmt: skip
    else:
        model = transformers.MambaForCausalLM(
            transformers.MambaConfig(
                vocab_size=vocab, hidden_size=width, num_hidden_layers=depth, state_size=16, expand=2
            )
        )

    def make_batch(b: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
        ids = torch.randint(0, vocab, (b, seq), generator=g)
        if name != "bert":
            return ids, ids.clone()  # causal models shift their labels themselves
        return ids, ids.masked_fill(torch.rand(ids.shape, generator=g) >= 0.15, -100)

    return model, make_batch, loss_fn_of(model)


