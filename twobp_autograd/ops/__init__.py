"""Deferred forwards of the built-in op families; importing this registers them all."""

from . import linear  # noqa: F401
from .recompute import recompute

__all__ = ["recompute"]
