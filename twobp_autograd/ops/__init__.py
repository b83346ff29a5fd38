"""Deferred forwards of the built-in op families; importing this registers them all (and has
``patch``'s report name the rules for Hugging Face's classes, which are registered by hand)."""

from collections.abc import Callable

from ..registry import suggest_rule
from . import (  # noqa: F401
    attention,
    batch_norm,
    conv,
    embedding,
    group_norm,
    instance_norm,
    layer_norm,
    linear,
    rms_norm,
)
from .hf_conv1d import computes_like_hf_conv1d, hf_conv1d
from .llama_rms_norm import computes_like_llama_rms_norm, llama_rms_norm
from .recompute import recompute, recompute_rowwise


def _from_hugging_face(judge: Callable[[type], bool]) -> Callable[[type], bool]:
    """``judge`` asked only of Hugging Face's classes (a judge imports transformers)."""
    def asked(module_type: type) -> bool:
        return str(getattr(module_type, "__module__", "")).startswith("transformers.") and judge(module_type)

    return asked


suggest_rule(_from_hugging_face(computes_like_hf_conv1d), "twobp_autograd.ops.hf_conv1d")
suggest_rule(_from_hugging_face(computes_like_llama_rms_norm), "twobp_autograd.ops.llama_rms_norm")

__all__ = [
    "recompute",
    "recompute_rowwise",
    "llama_rms_norm",
    "computes_like_llama_rms_norm",
    "hf_conv1d",
    "computes_like_hf_conv1d",
]
