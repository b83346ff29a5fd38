"""Rules for classes defined outside PyTorch (Hugging Face's) stand for what such a class
computes, so a class qualifies by what its forward is, never by its name: the same code as the
installed reference class's forward, which itself must compute exactly what the rule computes
(checked bit for bit once per process). A verdict is kept per class with the forward's code it
judged, so a forward replaced since is judged again. A class that fails keeps its plain forward.
"""

from __future__ import annotations

from collections.abc import Callable
from types import CodeType

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["Verdicts", "judged_once", "same_forward_code"]

#: module type -> (the forward's code judged, the verdict).
Verdicts = dict[type, tuple[CodeType | None, bool]]


def judged_once(module_type: type, verdicts: Verdicts, judge: Callable[[type], bool]) -> bool:
    """``judge(module_type)``, kept in ``verdicts`` while the class's forward keeps its code
    (asked on every call)."""
    judged = verdicts.get(module_type)
    if judged is not None and judged[0] is _code_of(module_type):
        return judged[1]
    verdict = _judge(judge, module_type)
    verdicts[module_type] = (_code_of(module_type), verdict)
    return verdict


@torch.compiler.disable  # a first call traced by torch.compile: its fake tensors compare as nothing
def _judge(judge: Callable[[type], bool], module_type: type) -> bool:
    # A judge builds the reference class (Conv1D's __init__ draws its weight from the global RNG)
    # and compares real values: keep the caller's RNG stream as plain's, and leave any dispatch
    # mode the first call runs under (FakeTensorMode, FlopCounterMode) out of the check.
    with torch.random.fork_rng(devices=[]), _disable_current_modes():
        return judge(module_type)


def same_forward_code(module_type: type, reference: type) -> bool:
    code, expected = _code_of(module_type), _code_of(reference)
    if code is None or expected is None:
        return False
    return (code.co_code, code.co_consts, code.co_names) == (expected.co_code, expected.co_consts, expected.co_names)


def _code_of(module_type: type) -> CodeType | None:
    return getattr(getattr(module_type, "forward", None), "__code__", None)
