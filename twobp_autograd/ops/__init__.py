"""Deferred forwards of the built-in op families; importing this registers them all."""

from . import attention, conv, embedding, linear, norm  # noqa: F401
from .recompute import recompute

__all__ = ["recompute"]
