"""Warnings this package gives once per process and cause (a module type and reason, a kind of
misuse): they explain a fallback or a refusal that would otherwise repeat on every call."""

from __future__ import annotations

import warnings
from collections.abc import Hashable

__all__ = ["warn_once"]

#: The causes warned about so far (tests that expect a warning start from an empty set).
given: set[Hashable] = set()


def warn_once(cause: Hashable, message: str, category: type[Warning] = UserWarning, stacklevel: int = 2) -> None:
    """``warnings.warn(message, category)`` the first time ``cause`` is seen; ``stacklevel`` as
    the caller would pass it to ``warnings.warn``."""
    if cause not in given:
        given.add(cause)
        warnings.warn(message, category, stacklevel=stacklevel + 1)
