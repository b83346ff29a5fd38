"""Every use of FSDP2's private internals, in one place, so that a PyTorch upgrade breaks here
(and in tests/test_fsdp_hooks.py) rather than silently elsewhere.

FSDP2 (``torch.distributed.fsdp.fully_shard``) reduce-scatters a parameter group's gradients
in the group's post-backward hook, which runs before any deferred weight gradient exists.
Its public API has no "reduce this group now": the flush therefore calls the group's own
post-backward itself (:func:`reduce_group`), so the reduction is FSDP2's own: its reduce dtype,
divide factor and ``set_requires_gradient_sync`` (HSDP too, on a 2-D mesh; CPU offload takes the
same path, untested). What that needs: the live FSDP2 states (to find the group owning an
unsharded parameter), each group's training state, and the events and buffers FSDP2 itself
waits on at the end of a backward.

Nothing here imports FSDP2 before the program does: a process that never shards pays nothing.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Collection, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

__all__ = [
    "ShardedParam",
    "class_before_fully_shard",
    "fsdp_in_use",
    "groups_of",
    "in_backward",
    "reduce_group",
    "reduces_unused_params",
    "reduction_order",
    "refuse_split_partial_all_reduce",
    "replaced_by_fully_shard",
    "shares_unsharded_storage",
    "sharded_params_of",
    "unsharded_params_of",
    "wait_for_reductions",
]

_STATE_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_state"


class ShardedParam(NamedTuple):
    """An unsharded parameter as FSDP2 knows it: its group and its sharded parameter."""

    group: Any  # FSDPParamGroup
    sharded: nn.Parameter


def fsdp_in_use() -> bool:
    """Whether a module sharded by FSDP2 may exist: its module is loaded and some composable
    state is registered. (Loaded alone says little: importing Dynamo loads it. This runs at
    every flush.)"""
    global _state_mapping
    mapping = _state_mapping
    if mapping is None:
        if _STATE_MODULE not in sys.modules:
            return False
        # Once loaded, kept: an import statement per flush costs more than the rest of this
        # check (importing Dynamo, which this package's deferral does, loads FSDP2's state).
        from torch.distributed._composable_state import _module_state_mapping

        mapping = _state_mapping = _module_state_mapping
    return len(mapping) > 0


#: ``torch.distributed._composable_state._module_state_mapping`` once FSDP2's state module is
#: loaded (a module global that is only ever mutated, never rebound).
_state_mapping: Any = None


def class_before_fully_shard(cls: type) -> type:
    """The class ``fully_shard`` generated ``cls`` from (it builds ``FSDP<Name>`` with bases
    ``(FSDPModule, Name)`` and swaps the module's class), else ``cls`` itself."""
    if not fsdp_in_use():
        return cls
    from torch.distributed.fsdp import FSDPModule

    bases = cls.__bases__
    if len(bases) == 2 and bases[0] is FSDPModule:
        return bases[1]
    return cls


def _states() -> Iterator[Any]:
    """Every live FSDP2 state, once each (grouped ``fully_shard([a, b])`` shares one)."""
    from torch.distributed._composable_state import _module_state_mapping

    state_class = sys.modules[_STATE_MODULE].FSDPState
    seen: set[int] = set()
    for reference in list(_module_state_mapping.values()):
        state = reference()
        if isinstance(state, state_class) and id(state) not in seen:
            seen.add(id(state))
            yield state


def _param_groups(state: Any) -> list[Any]:
    """A state's parameter groups: a list since the per-parameter meshes of recent releases
    (torch 2.11 kept one group, ``_fsdp_param_group``, and other internals this module reads
    differ there too: refused rather than half supported)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        raise RuntimeError(
            f"twobp: this PyTorch's FSDP2 (torch {torch.__version__}) keeps its parameter groups where the release "
            "2BP's FSDP2 support is built and tested on does not (torch 2.14: FSDPState._fsdp_param_groups). Use "
            "torch 2.14 or later with fully_shard, or twobp.unpatch(model) on the sharded model."
        )
    return groups


def _fsdp_params() -> Iterator[tuple[Any, Any]]:
    """``(group, FSDPParam)`` of every live FSDP2 parameter group."""
    for state in _states():
        for group in _param_groups(state):
            for fsdp_param in group.fsdp_params:
                yield group, fsdp_param


def sharded_params_of(params: list[Tensor]) -> dict[int, ShardedParam]:
    """``id(param) -> ShardedParam`` for those of ``params`` that are FSDP2 unsharded
    parameters (the tensors a sharded module computes with between unshard and reshard)."""
    if not fsdp_in_use():
        return {}
    wanted = {id(p) for p in params}
    found: dict[int, ShardedParam] = {}
    for group, fsdp_param in _fsdp_params():
        unsharded = getattr(fsdp_param, "_unsharded_param", None)  # absent before the first unshard
        if unsharded is not None and id(unsharded) in wanted:
            found[id(unsharded)] = ShardedParam(group, fsdp_param.sharded_param)
    return found


def shares_unsharded_storage(tensor: Tensor) -> bool:
    """Whether ``tensor`` lies in an FSDP2 unsharded parameter's storage, which the group's
    reshard frees after backward: the parameter itself, or a frozen one's, a ``.detach()`` or
    ``.data`` alias of one (a stop-gradient codebook), a view of any of them."""
    if not fsdp_in_use() or type(tensor) not in (Tensor, nn.Parameter) or tensor.layout != torch.strided:
        return False
    return tensor.untyped_storage()._cdata in _unsharded_storages()


def _unsharded_storages() -> frozenset[int]:
    """The unsharded parameters' storages (kept by FSDP2 across unshards, resized to nothing at
    each reshard), found once per backward: each patched call's saved tensors are asked about."""
    global _storages_found
    task = torch._C._current_graph_task_id()
    if task >= 0 and _storages_found is not None and _storages_found[0] == task:
        return _storages_found[1]
    unsharded = [getattr(fsdp_param, "_unsharded_param", None) for _, fsdp_param in _fsdp_params()]
    storages = frozenset([p.untyped_storage()._cdata for p in unsharded if p is not None])
    _storages_found = (task, storages)
    return storages


#: ``(backward, storages)``: :func:`_unsharded_storages` as that backward found them.
_storages_found: tuple[int, frozenset[int]] | None = None


def reduces_unused_params(params: Sequence[Tensor | None]) -> bool:
    """Whether one of ``params`` is an unsharded parameter of a group under
    ``set_reduce_scatter_unused_params(True)``: FSDP2 reduces every such group on every rank, with
    zeros where a rank's backward gave a parameter none (ranks that route to other layers), where a
    flush reduces only the groups its own rank deferred work for, pairing ranks' different groups.
    Their gradients are computed in backward instead. Asked in every backward of a patched layer
    once FSDP2 is used: the group is looked up once per parameter."""
    if not fsdp_in_use():
        return False
    global _groups_seen_with
    if len(_state_mapping) != _groups_seen_with:  # fully_shard ran since: unsharded params are new
        _group_of_unsharded.clear()
        _groups_seen_with = len(_state_mapping)
    for param in params:
        if param is None:
            continue
        group_ref = _group_of_unsharded.get(param)
        if group_ref is None:
            for group, fsdp_param in _fsdp_params():
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None:
                    _group_of_unsharded[unsharded] = weakref.ref(group)
            group_ref = _group_of_unsharded.setdefault(param, _NO_GROUP)
        group = group_ref()
        if group is not None and group.reduce_scatter_unused_params:
            return True
    return False


def _no_group() -> None:
    return None


_NO_GROUP = _no_group  # what a parameter of no FSDP2 group is looked up as
#: unsharded parameter -> its group (weakly), filled on a miss; and the states' count it was filled at.
_group_of_unsharded: WeakIdKeyDictionary = WeakIdKeyDictionary()
_groups_seen_with = 0


def unsharded_params_of(params: list[Tensor]) -> list[Tensor]:
    """The unsharded parameters standing in for those of ``params`` that are FSDP2-sharded."""
    if not fsdp_in_use():
        return []
    wanted = {id(p) for p in params}
    return [
        fsdp_param._unsharded_param
        for _, fsdp_param in _fsdp_params()
        if id(fsdp_param.sharded_param) in wanted and hasattr(fsdp_param, "_unsharded_param")
    ]


def replaced_by_fully_shard(param: Tensor) -> bool:
    """Whether ``fully_shard`` took ``param`` over (and put a sharded parameter in its place):
    it marks each original parameter with a uid."""
    return hasattr(param, "_fsdp_orig_uid")


def groups_of(module: nn.Module) -> list[Any]:
    """The FSDP2 parameter groups of ``module`` and its submodules, in module order."""
    from torch.distributed.fsdp import FSDPModule

    groups: list[Any] = []
    for submodule in module.modules():
        if isinstance(submodule, FSDPModule):
            groups.extend(g for g in _param_groups(submodule._get_fsdp_state()) if g not in groups)
    return groups


def reduction_order() -> dict[int, int]:
    """``id(group) -> place`` in one order of every live FSDP2 parameter group that all ranks
    share, whatever order their flushes make the gradients in: the reverse of a depth-first walk
    of the sharded modules (the order FSDP2's own backward reduces a model whose modules run in
    their registration order: the last block first, an enclosing root last). It is built from
    the modules alone: ranks whose micro-batches differ in shape group their queued work apart
    and finish the groups in other orders, and collectives issued in those orders pair one
    rank's group with another's."""
    states = list(_states())
    owner = {id(module): state for state in states for module in state._modules}
    inner = {
        id(owner[id(sub)])
        for state in states
        for module in state._modules
        for sub in module.modules()
        if sub is not module and id(sub) in owner and owner[id(sub)] is not state
    }
    walked: list[Any] = []
    seen: set[int] = set()
    for state in states:  # outermost first, in the order fully_shard registered them
        if id(state) in inner:
            continue
        for module in state._modules:
            for sub in module.modules():
                found = owner.get(id(sub))
                if found is not None and id(found) not in seen:
                    seen.add(id(found))
                    walked.extend(_param_groups(found))
    return {id(group): place for place, group in enumerate(reversed(walked))}


def in_backward(group: Any) -> bool:
    """Whether ``group`` is between its pre-backward and post-backward: FSDP2's own
    post-backward will reduce whatever gradient its unsharded parameters hold then."""
    state = sys.modules["torch.distributed.fsdp._fully_shard._fsdp_common"].TrainingState
    return group._training_state in (state.FORWARD, state.PRE_BACKWARD)


def reduce_group(group: Any) -> None:
    """Run ``group``'s post-backward now: it accumulates or reduce-scatters (as
    ``set_requires_gradient_sync`` says) the gradients its unsharded parameters hold into the
    sharded ``.grad``, and reshards if ``reshard_after_backward``. The group's training state
    is left as it was (it sets POST_BACKWARD)."""
    partial = refuse_split_partial_all_reduce(group)
    with group.use_training_state(group._training_state):
        group.post_backward()
    if partial:
        _remember_partial(group)


def drop_unsharded_grads(group: Any, among: Collection[int]) -> None:
    """Drop the gradients ``group``'s unsharded parameters (those whose id is in ``among``) hold
    for its next post-backward, which would reduce them into the next step's ``.grad``."""
    for fsdp_param in group.fsdp_params:
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        if unsharded is not None and id(unsharded) in among:
            unsharded.grad = None
            fsdp_param.unsharded_accumulated_grad = None


# group -> (FSDP2's partial-reduce buffer a flush left pending, its version then). Weak both ways:
# a group going, or FSDP2 dropping the buffer, ends the entry's meaning.
_left_by_flush: weakref.WeakKeyDictionary[Any, tuple[weakref.ref[Tensor], int]] = weakref.WeakKeyDictionary()


def refuse_split_partial_all_reduce(group: Any, flushing: Collection[int] = ()) -> bool:
    """HSDP under ``set_requires_all_reduce(False)``: FSDP2 keeps one flat partial-reduce buffer
    per group (``_partial_reduce_output``) laid out by the parameters reduced in that call, and
    adds the next call's output to it element by element. Where backward reduces some of the
    group's parameters and the flush others, two layouts meet in one buffer, added across
    parameters (silently wrong where the sizes agree). Allowed: a reduction of every parameter
    of the group that needs a gradient (the flush's ``flushing``, ids of unsharded parameters,
    or a gradient held now) into no buffer or one only such flushes wrote (backward then reduces
    none of the group: one layout). Returns whether the call may write that buffer."""
    common = sys.modules["torch.distributed.fsdp._fully_shard._fsdp_common"]
    if not isinstance(group.mesh_info, common.DDPMeshInfo) or not group.reduce_grads:
        return False
    pending = getattr(group, "_partial_reduce_output", None)
    if group.all_reduce_grads and pending is None:
        return False
    if getattr(group, "reduce_scatter_unused_params", False):
        return True  # every call reduces every parameter that needs a gradient (zeros if none)
    left = _left_by_flush.get(group)
    ours = pending is None or (left is not None and left[1] == pending._version and left[0]() is pending)
    if ours and all(_reduced(fsdp_param, flushing) for fsdp_param in group.fsdp_params):
        return True
    raise RuntimeError(
        "twobp: a flush would reduce an HSDP group under set_requires_all_reduce(False) (or with "
        "a partial reduction of that setting still pending) whose parameters do not all get their "
        "gradients from flushes: FSDP2 accumulates such reductions in one flat buffer per group, "
        "and the flush reduces other parameters than backward did. Accumulate with "
        "set_requires_gradient_sync(False) instead, or flush only after the micro-batch that has "
        "set_requires_all_reduce(True)."
    )


def _reduced(fsdp_param: Any, flushing: Collection[int]) -> bool:
    """Whether a reduction of its group now (or after a flush delivering ``flushing``) takes
    ``fsdp_param`` in, as FSDP2's post-backward picks them; one needing no gradient counts."""
    if not fsdp_param.sharded_param.requires_grad or fsdp_param.unsharded_accumulated_grad is not None:
        return True
    unsharded = getattr(fsdp_param, "_unsharded_param", None)
    return unsharded is not None and (id(unsharded) in flushing or unsharded.grad is not None)


def _remember_partial(group: Any) -> None:
    pending = getattr(group, "_partial_reduce_output", None)
    if pending is None:
        _left_by_flush.pop(group, None)
    else:
        _left_by_flush[group] = (weakref.ref(pending), pending._version)


def wait_for_reductions(groups: list[Any]) -> None:
    """Make the current stream wait for the reductions ``groups`` launched, and release their
    reduce-scatter input buffers, as FSDP2 does at the end of a backward (no-ops on a CPU)."""
    if not groups:
        return
    stream = groups[0].device_handle.current_stream()
    for context in {id(g.comm_ctx): g.comm_ctx for g in groups}.values():
        for event in context._last_post_reduce_events.values():
            stream.wait_event(event)
        context._last_post_reduce_events = {}
        for reduce_scatter in context.reduce_scatter_states:
            if reduce_scatter.event is not None:
                stream.wait_event(reduce_scatter.event)
        context.reduce_scatter_states.clear()
