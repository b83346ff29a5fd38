"""Deferred forwards of the built-in op families; importing this registers them all."""

from . import attention, batch_norm, conv, embedding, group_norm, layer_norm, linear, rms_norm  # noqa: F401
from .hf_conv1d import computes_like_hf_conv1d, hf_conv1d
from .llama_rms_norm import computes_like_llama_rms_norm, llama_rms_norm
from .recompute import recompute

__all__ = ["recompute", "llama_rms_norm", "computes_like_llama_rms_norm", "hf_conv1d", "computes_like_hf_conv1d"]
