"""Deferred forwards of the built-in op families; importing this registers them all."""

from . import attention, batch_norm, conv, embedding, group_norm, layer_norm, linear, rms_norm  # noqa: F401
from .recompute import recompute

__all__ = ["recompute"]
