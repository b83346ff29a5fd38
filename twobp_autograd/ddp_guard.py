"""DistributedDataParallel over a patched model gives silently wrong gradients: DDP all-reduces
in backward, before the deferred weight gradients exist, and its hooks then see them arrive at
the flush, outside any reduction it planned (measured on 2 ranks: the deferred parameters'
`.grad` stays each rank's own, not the mean). So wrapping a patched model in DDP, or patching a
model inside DDP, is refused with the replacement named: ``GradientSynchroniser``. The same goes
for DDP's composable form, ``torch.distributed._composable.replicate``, which builds its DDP at
the first forward over a list of the module's parameters (not the module): that construction is
matched by parameters. (``replicate`` built on FSDP2, in ``replicate_with_fsdp``, reduces after
the flush like ``fully_shard`` and needs no refusal.)

FSDP1 (``FullyShardedDataParallel``) gives plain's gradients on a patched model but defers
nothing (its layers compute with views of its flat parameters, which autograd differentiates at
once): that gets one warning, in either order, naming FSDP2.

PyTorch has no hook on DDP's (or FSDP1's) construction, so its ``__init__`` is wrapped: DDP's
when this package is imported, to know the wrappers built since (and those alive then, found
once among the live objects), so that ``patch`` on the module inside one, as
``patch(accelerator.unwrap_model(model))`` after ``prepare`` does, is refused too; and
it refuses patched models once one is patched; FSDP1's the first time a model is patched."""

from __future__ import annotations

import functools
import gc
import sys
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch.distributed as dist
from torch import nn

from .warn_once import warn_once

__all__ = ["refuse_ddp_over_patched_models", "check_not_inside_ddp"]

_ADVICE = (
    "DistributedDataParallel all-reduces during backward, before a patched model's weight "
    "gradients exist, so its ranks would step on unreduced gradients. Use "
    "twobp_autograd.data_parallel.GradientSynchroniser(model) instead of the DDP wrapper (it "
    "flushes and all-reduces), or twobp.unpatch(model) to keep DDP."
)
_installed = False

#: The DDP wrappers built since this package was imported (``replicate``'s among them).
_ddp_wrappers: weakref.WeakSet[nn.Module] = weakref.WeakSet()

#: What DDP's construction checks first (the refusal, once a model is patched).
_ddp_checks: list[Callable[[nn.Module], None]] = []


def _watch_ddp_constructions() -> None:
    from torch.nn.parallel import DistributedDataParallel

    original = vars(DistributedDataParallel)["__init__"]

    @functools.wraps(original)
    def watched_init(self: nn.Module, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        for check in _ddp_checks:
            check(module)
        original(self, module, *args, **kwargs)
        _ddp_wrappers.add(self)

    setattr(DistributedDataParallel, "__init__", watched_init)  # noqa: B010  (mypy refuses a direct assignment)
    # A DDP deep-copied, or loaded with torch.load, is built by __setstate__ (with a reducer of
    # its own), not __init__: it reduces its module's parameters in backward all the same.
    original_setstate = vars(DistributedDataParallel)["__setstate__"]

    @functools.wraps(original_setstate)
    def watched_setstate(self: nn.Module, state: Any) -> None:
        original_setstate(self, state)
        _ddp_wrappers.add(self)

    setattr(DistributedDataParallel, "__setstate__", watched_setstate)  # noqa: B010
    # Wrappers built before this package was imported (lazily, by a plugin or a Trainer
    # callback): found once among the live objects. A DDP needs a process group, so without
    # one there is none to find.
    if dist.is_available() and dist.is_initialized():
        _ddp_wrappers.update(o for o in gc.get_objects() if isinstance(o, DistributedDataParallel))


_watch_ddp_constructions()


def refuse_ddp_over_patched_models(
    is_patched: Callable[[nn.Module], bool], patched_modules: Callable[[], Iterable[nn.Module]]
) -> None:
    """Make ``DistributedDataParallel(model)`` raise when ``model`` holds a patched module, or
    holds parameters of one (``replicate``'s list of parameters)."""
    global _installed
    if _installed:
        return

    def refuse(module: nn.Module) -> None:
        wrapped = {id(p) for p in module.parameters()}
        if any(is_patched(m) for m in module.modules()) or any(
            id(p) in wrapped for m in patched_modules() for p in m.parameters()
        ):
            raise RuntimeError(
                "twobp: DistributedDataParallel (or replicate(), which builds one at its first forward) "
                f"over a patched model. {_ADVICE}"
            )

    def warn(module: nn.Module) -> None:
        if any(is_patched(m) for m in module.modules()):
            _warn_fsdp1()

    _ddp_checks.append(refuse)
    fsdp1 = _fsdp1_class()
    if fsdp1 is not None:
        _check_before_init(fsdp1, warn)
    _installed = True


def _check_before_init(wrapper: type, check: Callable[[nn.Module], None]) -> None:
    """Make ``wrapper(module, ...)`` call ``check(module)`` first."""
    original = vars(wrapper)["__init__"]

    @functools.wraps(original)
    def checked_init(self: nn.Module, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        check(module)
        original(self, module, *args, **kwargs)

    setattr(wrapper, "__init__", checked_init)  # noqa: B010  (mypy refuses a direct assignment)


_FSDP1_MODULE = "torch.distributed.fsdp.fully_sharded_data_parallel"
def _warn_fsdp1() -> None:
    warn_once(
        "FSDP1",
        "twobp: FullyShardedDataParallel (FSDP1) over a patched model: its layers compute with "
        "views of its flat parameters, which autograd differentiates at once, so the gradients "
        "are right but nothing is deferred. Shard with fully_shard (FSDP2) to defer them.",
        stacklevel=4,
    )


def _fsdp1_class(*, load: bool = True) -> type | None:
    """``FullyShardedDataParallel``, loading its module if asked (None without torch.distributed)."""
    if load and _FSDP1_MODULE not in sys.modules:
        try:
            import torch.distributed.fsdp as _  # noqa: F401  (loads FSDP1's module)
        except ImportError:
            return None
    wrapper = getattr(sys.modules.get(_FSDP1_MODULE), "FullyShardedDataParallel", None)
    return wrapper if isinstance(wrapper, type) else None


def check_not_inside_ddp(model: nn.Module) -> None:
    """``patch`` refuses a model that is, or holds, a DDP wrapper."""
    from torch.nn.parallel import DistributedDataParallel

    if any(isinstance(m, DistributedDataParallel) for m in model.modules()):
        raise RuntimeError(f"twobp: patch() on a model wrapped in DistributedDataParallel. {_ADVICE}")
    fsdp1 = _fsdp1_class(load=False)
    if fsdp1 is not None and any(isinstance(m, fsdp1) for m in model.modules()):
        _warn_fsdp1()
    # Loaded by whoever called replicate(); its marker class is private (a rename fails
    # tests/test_ddp_guard.py, not patch()).
    replicate = sys.modules.get("torch.distributed._composable.replicate")
    marker = getattr(replicate, "DDP", None)
    if isinstance(marker, type) and any(isinstance(m, marker) for m in model.modules()):
        raise RuntimeError(f"twobp: patch() on a model under replicate() (DDP's composable form). {_ADVICE}")
    if _reduced_by_a_ddp(model):
        gc.collect()  # a dropped wrapper (DDP's references are cyclic) counts until collected
    if _reduced_by_a_ddp(model):
        raise RuntimeError(
            "twobp: patch() on a model whose parameters a DistributedDataParallel built earlier "
            "reduces (the model inside it, as accelerate's prepare or Trainer wrap it, or under "
            f"replicate()). {_ADVICE}"
        )


def _reduced_by_a_ddp(model: nn.Module) -> bool:
    """Whether a live DDP wrapper holds one of ``model``'s parameters."""
    if not _ddp_wrappers:
        return False
    params = {id(p) for p in model.parameters()}
    return any(id(p) in params for wrapper in list(_ddp_wrappers) for p in wrapper.parameters())
