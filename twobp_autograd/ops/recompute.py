"""A generic rule for a module of one's own (a scaling, a gate, a small block): the forward runs
with the parameters detached, and the flush re-runs it on the queued call's inputs, with the
parameters as leaves, to take their vector-Jacobian product. It costs one extra forward of the
module per call (:func:`recompute`), or per flush for a module whose forward treats the samples
of a batch independently (:func:`recompute_rowwise`: norms like Hugging Face's ``T5LayerNorm``,
per-sample MLPs), whose micro-batches the replay joins.

A forward that draws random numbers (dropout) cannot be replayed at the flush, which runs later:
such a call is run again on plain autograd from the same random state (so its output is plain's),
and the module keeps plain autograd from then on, with one warning.

The replay must see what the forward saw: the training flags of the module and its submodules
are put back as they were for it (an ``eval()`` before the flush changes nothing), its buffers
are the forward's tensors, and a buffer or parameter changed in place since the forward is
refused with an error rather than replayed with other values. A forward that changes its own
buffers (a counter, a running statistic) cannot be replayed either: it keeps plain autograd, as
one drawing random numbers does (its buffers are copied before each call to make that possible).
Plain Python attributes the forward reads are not seen, nor draws from a ``torch.Generator``
of the module's own (only the default generators are watched: torch's on every call, Python's
``random`` and NumPy's global one on the calls that run trials: a module's first ones, and the
first in each new mix of modes).

Its outputs are a tensor, or a tuple or list of them, returned in that container; a call that
returns anything else, or returns its own input, parameter or buffer (or a view of one, or two
views of one tensor), keeps plain autograd: the tap re-parents each output in place.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import itertools
import numbers
import random
import sys
import threading
import weakref
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn.modules import module as module_hooks
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils import checkpoint as torch_checkpoint
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack
from torch.utils.checkpoint import get_device_states, set_device_states
from torch.utils.weak import WeakIdKeyDictionary

from .. import fsdp_hooks
from ..checkpoint_paths import forget_since, recorded_so_far, replaying_deferred, took_plain
from ..deferral import defer_weight_grads, detached, untappable_view
from ..flush import may_change_in_backward
from ..job import leaves_some_grads_none
from ..registry import PATCHED_CALL
from .fallback import plain_forward, unsupported_tensors, warn_plain_call

__all__ = ["recompute", "recompute_rowwise"]


def _plain_forward(module: nn.Module, inputs: Sequence[Tensor], params: dict[str, Tensor]) -> Any:
    # tie_weights: a parameter reachable under two names (a tied decoder) is substituted under both.
    with _reparametrize_module(module, params, tie_weights=True):
        # The class's forward: a patched instance forward would come back here.
        return type(module).forward(module, *inputs)


def _as_tensors(output: Any) -> tuple[Tensor, ...]:
    return (output,) if isinstance(output, Tensor) else tuple(output)


def _unfit_outputs(output: Any, own: Sequence[Tensor]) -> str | None:
    """Why the tap cannot take ``output`` (it re-parents each output tensor in place onto its
    node), or None: it takes a tensor, or a tuple or list of distinct new tensors, none of
    them ``own`` (the inputs, parameters and buffers) or a view of one."""
    if isinstance(output, Tensor):
        output = (output,)
    elif not isinstance(output, (tuple, list)) or not all(isinstance(t, Tensor) for t in output):
        return _NOT_TENSORS
    roots = [id(t if t._base is None else t._base) for t in output]
    owned = {id(t if t._base is None else t._base) for t in own}
    if len(set(roots)) < len(roots) or owned.intersection(roots):
        return _ALIASES
    if len(output) > 1 and any(t._is_view() for t in output):
        # The tap re-parents its outputs in place, which autograd refuses for a view among several.
        return _VIEW_AMONG_SEVERAL
    if len(output) == 1 and output[0]._is_view():
        why = untappable_view(output[0])
        if why is not None:
            return f"an output that is {why}"
    return None


def _shaped_as(output: Any, tapped: Tensor | tuple[Tensor, ...]) -> Any:
    """The tapped tensors in the container the forward returned them in."""
    if isinstance(output, Tensor):
        return tapped
    tensors = (tapped,) if isinstance(tapped, Tensor) else tapped
    if hasattr(type(output), "_make"):  # a NamedTuple
        return type(output)._make(tensors)
    return type(output)(tensors)


def recompute_weight_grad(
    saved: Sequence[Tensor],
    grad_outputs: Sequence[Tensor],
    needs: Sequence[bool],
    *,
    module: nn.Module,
    state: _ForwardState,
) -> list[Tensor | None]:
    """The parameters replayed are those the forward computed with (``state.params``: under
    ``torch.func.functional_call`` other tensors than the module's own, which it holds again by
    the flush). The last saved tensor says which outputs each backward reached: with several,
    one no backward reached is left out, so a parameter only it reaches stays None; a single
    output no backward gave a gradient is replayed with none, as plain autograd runs the module's
    graph (its nodes give None, a custom Function's materialises zeros)."""
    with _lock_of(module):  # the replay puts stand-ins in the module's place, as the forward does
        return _replayed_weight_grad(saved, grad_outputs, needs, module, state)


def _replayed_weight_grad(
    saved: Sequence[Tensor],
    grad_outputs: Sequence[Tensor],
    needs: Sequence[bool],
    module: nn.Module,
    state: _ForwardState,
) -> list[Tensor | None]:
    state.check_unchanged(module)
    params = state.params.items()
    inputs, reached = saved[:-1], saved[-1].any(0).tolist()
    with torch.enable_grad(), state.as_its_forward_ran(module):
        # The values the forward computed with (``state.values``): a parameter whose storage was
        # swapped since (``p.data = t``: prune.remove, vector_to_parameters, model.half()) is
        # replayed as the forward saw it, as plain autograd's saved tensors are.
        leaves = {
            n: v.detach().requires_grad_(need)
            for (n, _), v, need in zip(params, state.values, needs, strict=True)
        }
        replayed = {**state.attributes, **leaves, **state.buffers()}
        outputs = _as_tensors(_plain_forward(module, [t.detach() for t in inputs], replayed))
        differentiable_at = [i for i, o in enumerate(outputs) if o.requires_grad]
        if len(differentiable_at) == 1 and not any(reached):  # given None: see recompute_weight_grad
            # (integer outputs beside it never carry a gradient: it is the only one reached)
            i = differentiable_at[0]
            outputs = (*outputs[:i], _GivesNoGradient.apply(outputs[i]), *outputs[i + 1 :])
            reached = [j == i for j in range(len(outputs))]
        # Outputs the parameters do not reach (a router's integer indices) have no gradient.
        differentiable = [
            (o, g)
            for i, (o, g) in enumerate(zip(outputs, grad_outputs, strict=False))
            if o.requires_grad and reached[i]
        ]
        wanted = [leaves[n] for (n, _), need in zip(params, needs, strict=True) if need]
        if not differentiable:
            return [None] * len(needs)
        tensors, grads_of_tensors = zip(*differentiable, strict=True)
        # On this thread, as the flush's hand-over (on CUDA: no wake-up of autograd's device thread).
        with torch.autograd.set_multithreading_enabled(False):
            try:
                grads = iter(torch.autograd.grad(tensors, wanted, grads_of_tensors, allow_unused=True))
            except RuntimeError as error:
                if "use_reentrant=True, torch.utils.checkpoint is incompatible with .grad()" not in str(error):
                    raise
                _unreplayable[module] = _REENTRANT_CHECKPOINT  # its later calls keep plain autograd
                raise RuntimeError(
                    f"twobp: {type(module).__name__}'s forward runs torch.utils.checkpoint with "
                    "use_reentrant=True, which the recompute rule's replay at the flush cannot "
                    "differentiate (torch.autograd.grad). Pass use_reentrant=False inside it, or exclude the "
                    "module from patch() (exclude=[...]); its later calls keep plain autograd. Drop this "
                    "step's work: optimizer.zero_grad() (or twobp.discard_weight_grads() for the queued work)."
                ) from error
    return [next(grads) if need else None for need in needs]


class _GivesNoGradient(torch.autograd.Function):
    """The identity, whose backward hands on no gradient (None, as an upstream node gave the
    module's output in the backward replayed)."""

    @staticmethod
    def forward(ctx: Any, output: Tensor) -> Tensor:
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> None:
        return None


def _owner(module: nn.Module, name: str) -> nn.Module | None:
    """The submodule holding the member ``name`` (dotted, from ``module``), None if it is gone."""
    try:
        return module.get_submodule(name.rpartition(".")[0])
    except AttributeError:
        return None


def _attribute(module: nn.Module, name: str) -> Any:
    owner = _owner(module, name)
    return None if owner is None else vars(owner).get(name.rpartition(".")[2])


def _same_value(now: object, then: object) -> bool:
    return now is then or (type(now) is type(then) and now == then)


def _same_bits(a: Tensor, b: Tensor) -> bool:
    """Equal contents, NaNs included (a buffer and the copy taken before a call)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.layout != torch.strided or a.is_meta:  # no aten::equal there: their versions tell
        return True
    if torch.equal(a, b):
        return True
    return a.is_floating_point() and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


class _ForwardState:
    """What a module's forward read besides its inputs and parameters, as the flush must
    replay it: the training flags of the module's submodules and its buffers (with their
    versions, so that a change in place after the forward is seen)."""

    __slots__ = (
        "flags", "named_buffers", "versions", "params", "param_versions", "values", "autocast", "attributes",
        "submodules", "attribute_objects", "attribute_versions", "scalars", "default_dtype", "default_device",
        "public_names", "parts",
    )

    def __init__(self, module: nn.Module, params: Mapping[str, Tensor]) -> None:
        self.flags = tuple([m.training for m in module.modules()])
        self.named_buffers = tuple(module.named_buffers())
        self.versions = tuple([b._version for _, b in self.named_buffers])
        self.params = params
        self.param_versions = tuple([p._version for p in params.values()])
        # Aliases of what the forward computed with (same storage and version counter): they keep
        # those values if a parameter's ``.data`` is swapped before the flush.
        self.values = tuple([p.detach() for p in params.values()])
        # The autocast the forward ran under (the flush runs under its backward's, or none).
        self.autocast = _autocast_now()
        # The factory defaults the forward ran under (a tensor it makes without dtype= or device=,
        # a ramp or a mask): the flush may run under others (inside `with torch.device("meta")`,
        # a set_default_dtype), which the replay would make its tensors with.
        self.default_dtype = torch.get_default_dtype()
        self.default_device = torch.get_default_device()
        # Tensors held as plain attributes (neither parameters nor buffers), which the forward
        # reads: what a forward pre-hook sets at each call (prune's masked ``weight``,
        # ``weight_norm``'s rebuilt one). The replay takes the forward's (aliases), as plain
        # autograd's backward uses the tensors its forward saved. A forward that changes or
        # rebinds one (a running statistic kept without register_buffer, a cache it grows) is
        # stateful, and a change in place before the flush is refused, as for buffers.
        self.submodules: tuple[tuple[str, int], ...] = ()  # set once the forward ran: see recompute
        # Each submodule's __dict__ with the public names in it once the forward ran (set then):
        # one set since (a schedule's value over a class default, or over getattr's) is hidden
        # from the replay, which reads the default the forward read.
        self.public_names: tuple[tuple[dict[str, Any], frozenset[str]], ...] = ()
        # Each submodule's parameter and buffer names, hooks and instance forward once the forward
        # ran (set then): the replay would run what is added or replaced since (a pruning's mask
        # and hook, accelerate's wrapper), which the forward did not.
        self.parts: tuple[_Parts, ...] = ()
        # Plain Python numbers, flags and strings held as public attributes (a temperature, a
        # scale a schedule sets) likewise: the replay runs with the values the forward read, and
        # calls that read other values are not joined.
        self.attribute_objects: dict[str, Tensor] = {}
        # Each scalar as (its owner's __dict__, its name there, its value), in the modules' order.
        self.scalars: list[tuple[dict[str, Any], str, object]] = []
        for prefix, m in module.named_modules():
            attrs = vars(m)
            for name, value in attrs.items():
                if isinstance(value, Tensor):
                    self.attribute_objects[f"{prefix}.{name}" if prefix else name] = value
                elif not name.startswith("_") and name != "training" and _is_scalar(value):
                    self.scalars.append((attrs, name, value))
        self.attributes = {n: v.detach() for n, v in self.attribute_objects.items()}
        self.attribute_versions = {n: v._version for n, v in self.attributes.items()}

    def keep_what_the_forward_left(self, module: nn.Module) -> None:
        """Once the forward ran: drop the Python values it changed itself (a call counter), which
        the replay reads as it finds them (README) and which do not keep calls apart; note the
        public names it left."""
        self.scalars = [(attrs, n, v) for attrs, n, v in self.scalars if _same_value(attrs.get(n, _MISSING), v)]
        self.public_names = tuple(
            [(vars(m), frozenset([n for n in vars(m) if not n.startswith("_")])) for m in module.modules()]
        )
        self.parts = tuple([_parts_of(m) for m in module.modules()])

    def key(self) -> Hashable:
        """Micro-batches concatenate into one replay only where they saw the same state."""
        storages = tuple([v.data_ptr() if type(v) is Tensor else None for v in self.values])
        attributes = tuple([(n, _tensor_key(v)) for n, v in self.attribute_objects.items()])
        return (
            self.flags, tuple(map(id, (b for _, b in self.named_buffers))), self.versions, storages, self.autocast,
            attributes, tuple([(n, v) for _, n, v in self.scalars]), self.default_dtype, self.default_device,
            # A call after which a public name was set reads it; one before reads what it shadows.
            tuple([names for _, names in self.public_names]),
        )

    def changed_in_place(self) -> list[str]:
        """Buffers and tensor attributes changed in place since this state was taken."""
        return self._buffers_changed_in_place() + self.attributes_changed_in_place()

    def _buffers_changed_in_place(self) -> list[str]:
        return [n for (n, b), v in zip(self.named_buffers, self.versions, strict=True) if b._version != v]

    def attributes_changed_in_place(self) -> list[str]:
        return [n for n, v in self.attribute_versions.items() if self.attributes[n]._version != v]

    def attribute_values(self) -> dict[str, Tensor]:
        """Copies of the tensor attributes' contents, to put back after a trial forward."""
        return {n: v.clone() for n, v in self.attributes.items()}

    def attributes_changed(self, module: nn.Module, values: Mapping[str, Tensor]) -> bool:
        """Rebound (a cache grown, a power iteration's vector), changed in place by the forward
        (by version, and by content where ``values`` holds their copies), or made by it (a cache
        made from the parameters: from the stand-ins, which require no grad, where plain's forward
        takes another path)."""
        return (
            any(_attribute(module, n) is not v for n, v in self.attribute_objects.items())
            or bool(self.attributes_changed_in_place())
            or any(not _same_bits(self.attributes[n], v) for n, v in values.items())
            or bool(self._added_attributes(module))
        )

    def _added_attributes(self, module: nn.Module) -> list[tuple[dict[str, Any], str]]:
        """``(owner's __dict__, name)`` of the tensor attributes added since this state was taken."""
        return [
            (attrs, name)
            for prefix, m in module.named_modules()
            for attrs in (vars(m),)
            for name, value in attrs.items()
            if isinstance(value, Tensor) and (f"{prefix}.{name}" if prefix else name) not in self.attribute_objects
        ]

    def restore_attributes(self, values: Mapping[str, Tensor]) -> None:
        """Contents changed in place go back (where ``values`` holds copies); a tensor the forward
        rebound stays rebound, as the plain Python state it goes with (a cache's length) cannot
        be put back."""
        for name, value in values.items():
            original = self.attribute_objects[name]
            if not _same_bits(original, value):
                with torch.no_grad():
                    if original.shape != value.shape:  # resized in place (as restore() does for buffers)
                        original.resize_(value.shape)
                    original.copy_(value)

    def parameters_changed_in_place(self) -> bool:
        return [p._version for p in self.params.values()] != list(self.param_versions)

    def parameters_changed(self, substitutes: Mapping[str, Tensor], values: Sequence[Tensor]) -> bool:
        """Whether the forward changed its parameters: a stand-in given other data (``.data =``,
        which the parameter never sees), in place (a version bumped through the stand-in, which
        shares the parameter's counter), or, where ``values`` holds copies, by a write through
        ``.data``, which bumps no version."""
        return (
            any(
                s is not p and s.layout == torch.strided and (s.data_ptr(), s.shape) != (p.data_ptr(), p.shape)
                for s, p in zip(substitutes.values(), self.params.values(), strict=True)
            )
            or self.parameters_changed_in_place()
            or any(not _same_bits(p, v) for p, v in zip(self.params.values(), values, strict=False))
        )

    def restore_parameters(self, values: Sequence[Tensor]) -> None:
        """The parameters' contents back (``values``, where copied), through ``.data``: the
        forward's change through ``.data`` bumped no version, and a restore must bump none."""
        for p, value in zip(self.params.values(), values, strict=False):
            if not _same_bits(p, value):
                p.data.copy_(value)

    def changed_by_forward(self, module: nn.Module, values: Sequence[Tensor]) -> bool:
        """In place (also by kernels that bump no version counter: ``torch.batch_norm``'s running
        statistics, a fused fake-quant's observer), or replaced, added or removed."""
        now = tuple(module.named_buffers())
        return (
            bool(self._buffers_changed_in_place())
            or [(n, id(b)) for n, b in now] != [(n, id(b)) for n, b in self.named_buffers]
            or any(not _same_bits(b, v) for (_, b), v in zip(self.named_buffers, values, strict=True))
        )

    def restore(self, module: nn.Module, values: Sequence[Tensor]) -> None:
        """The buffers as they were when this state was taken, ``values`` their contents then."""
        for name, _ in tuple(module.named_buffers()):  # added by the forward
            if name not in dict(self.named_buffers):
                owner, _, attribute = name.rpartition(".")
                del module.get_submodule(owner)._buffers[attribute]
        with torch.no_grad():
            for (name, b), value, version in zip(self.named_buffers, values, self.versions, strict=True):
                owner, _, attribute = name.rpartition(".")
                module.get_submodule(owner)._buffers[attribute] = b
                if b._version != version or not _same_bits(b, value):  # kernels may bump no version
                    if b.shape != value.shape:  # resized in place (an observer's first min/max)
                        b.resize_(value.shape)
                    b.copy_(value)

    def buffers(self) -> dict[str, Tensor]:
        return dict(self.named_buffers)

    def check_unchanged(self, module: nn.Module) -> None:
        gone = [n for n in self.params if _owner(module, n) is None]
        if gone or tuple([(n, id(m)) for n, m in module.named_modules()]) != self.submodules:
            gone = gone or ["(its submodules were replaced)"]
            raise RuntimeError(
                f"twobp: parameter(s) {gone} that the forward of a {type(module).__name__} computed with "
                "are no longer where they were (a parametrization removed, a submodule deleted) between "
                "its forward and the flush; the recompute rule re-runs that forward at the flush and cannot. "
                "Flush the weight gradients before changing the module's structure."
            )
        # (A name the replay finds in the instance's __dict__ first, a value it puts back, hides one added since.)
        restored = {(id(attrs), name) for attrs, name, _ in self.scalars}
        added = [
            name or "(the module itself)"
            for (name, m), then in zip(module.named_modules(), self.parts, strict=False)
            if _added_parts(m, then, submodule=m is not module, shadowed={n for i, n in restored if i == id(vars(m))})
        ]
        if added:
            raise RuntimeError(
                f"twobp: {added} of a {type(module).__name__} changed between its forward and the flush "
                "(parameters or buffers added or set where None, a class swapped, hooks registered on a submodule or "
                "its forward replaced or wrapped: a pruning, accelerate's hooks); the recompute rule re-runs that "
                "forward at the flush, where they would take part as they did not in the forward. Flush the weight "
                "gradients before changing them, or leave the module to plain autograd (patch(..., exclude=[...])). "
                "To drop the step: optimizer.zero_grad()."
            )
        changed = self.changed_in_place() + [
            n for (n, p), v in zip(self.params.items(), self.param_versions, strict=True) if p._version != v
        ]
        if changed:
            stepped = [n for n, p in self.params.items() if n in changed and _stepped_in_backward([p])]
            hint = (
                f" ({stepped} took their gradient in backward through a tensor hook registered after "
                "the forward, and a post-accumulate-grad hook changed them then: register the tensor "
                "hook before the forward, which keeps such calls on plain autograd.)"
                if stepped
                else ""
            )
            raise RuntimeError(
                f"twobp: buffer(s) or parameter(s) {changed} of a {type(module).__name__} changed in place "
                "between its forward and the flush; the recompute rule re-runs that forward at the flush "
                "and would read the new values. Flush the weight gradients before changing them, or leave "
                f"the module to plain autograd (patch(..., exclude=[...])).{hint}"
            )

    @contextmanager
    def as_its_forward_ran(self, module: nn.Module) -> Iterator[None]:
        """The training flags, the autocast state and the factory defaults the forward ran with."""
        with contextlib.ExitStack() as stack:
            for device, enabled, dtype in self.autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
            if torch.get_default_device() != self.default_device:
                stack.enter_context(torch.device(self.default_device))
            dtype_now = torch.get_default_dtype()
            if dtype_now != self.default_dtype:
                torch.set_default_dtype(self.default_dtype)
                stack.callback(torch.set_default_dtype, dtype_now)
            with self._flags_restored(module), self._scalars_restored(module):
                yield

    @contextmanager
    def _scalars_restored(self, module: nn.Module) -> Iterator[None]:
        # Set in the owners' __dict__ (check_unchanged saw the same submodules): as the forward
        # read them, even where a parameter or buffer of that name came since (nn.Module's
        # __setattr__ would refuse a number there), and each put back whatever happens.
        found: list[tuple[dict[str, Any], str, object]] = []
        try:
            for attrs, names in self.public_names:
                for name in [n for n in attrs if n not in names and not n.startswith("_")]:
                    found.append((attrs, name, attrs.pop(name)))
            for attrs, name, value in self.scalars:
                found.append((attrs, name, attrs.get(name, _MISSING)))
                attrs[name] = value
            yield
        finally:
            for attrs, name, value in reversed(found):
                if value is _MISSING:
                    attrs.pop(name, None)
                else:
                    attrs[name] = value

    @contextmanager
    def _flags_restored(self, module: nn.Module) -> Iterator[None]:
        submodules = list(module.modules())
        now = [m.training for m in submodules]
        for submodule, flag in zip(submodules, self.flags, strict=False):
            submodule.training = flag
        try:
            yield
        finally:
            for submodule, flag in zip(submodules, now, strict=True):
                submodule.training = flag


def _is_scalar(value: object) -> bool:
    """A Python (or NumPy) number, flag, string, enum member or None: values a forward may read
    that its replay must see again (a temperature from a NumPy schedule is an np.float64)."""
    if type(value) in _SCALAR_TYPES or isinstance(value, (numbers.Number, str, enum.Enum)):
        return True
    numpy = sys.modules.get("numpy")  # np.bool_ is no numbers.Number (a flag drawn by np.random.rand() < p)
    return numpy is not None and isinstance(value, numpy.generic) and not isinstance(value, numpy.void)


class _Attributes:
    """Each submodule's attributes as a call found them, shallow (its Python values, and its
    submodules and parameters by name): put back where a trial or the attempt built parts of the
    module (a head sized by the input, with the flag that guards it, private or not), or changed
    its state under a flag (ActNorm's initialisation from the first batch), before the call runs
    on plain autograd, which does that once. Where trials run, the hook dicts' contents too: a
    hook a trial registered in place (under such a flag) would be registered twice."""

    __slots__ = ("saved", "hooks")

    def __init__(self, module: nn.Module, *, with_hooks: bool) -> None:
        self.saved = [(m, dict(vars(m)), dict(m._modules), dict(m._parameters)) for m in module.modules()]
        self.hooks: list[tuple[dict[Any, Any], dict[Any, Any]]] = (
            [
                (hooks, dict(hooks))
                for _, attributes, _, _ in self.saved
                for name, hooks in attributes.items()
                if name.endswith("hooks") and isinstance(hooks, dict)
            ]
            if with_hooks
            else []
        )

    def built_since(self) -> bool:
        """Whether submodules or parameters were added, removed or replaced since (a new
        submodule anywhere changes its parent's: the saved ones tell)."""
        for m, _, modules, params in self.saved:
            now_modules, now_params = m._modules, m._parameters
            if len(now_modules) != len(modules) or len(now_params) != len(params):
                return True
            if any(now_modules.get(k) is not v for k, v in modules.items()):
                return True
            if any(now_params.get(k) is not v for k, v in params.items()):
                return True
        return False

    def drop_tensors_added(self) -> None:
        """Tensor attributes set since where there was none (a cache made from the stand-ins, which
        require no grad) dropped, or put back to what they were (``None``)."""
        for m, attributes, _, _ in self.saved:
            now = vars(m)
            added = [n for n, v in now.items() if isinstance(v, Tensor) and not isinstance(attributes.get(n), Tensor)]
            for name in added:
                if name in attributes:
                    now[name] = attributes[name]
                else:
                    del now[name]

    def restore(self) -> None:
        for hooks, contents in self.hooks:
            hooks.clear()
            hooks.update(contents)
        for m, attributes, modules, params in self.saved:
            vars(m).clear()
            vars(m).update(attributes)
            m._modules.clear()
            m._modules.update(modules)
            m._parameters.clear()
            m._parameters.update(params)


def _tensor_attributes(module: nn.Module) -> list[Tensor]:
    return [value for m in module.modules() for value in vars(m).values() if isinstance(value, Tensor)]


_SCALAR_TYPES = (int, float, bool, str, type(None))


_MISSING = object()

_AUTOCAST_DEVICES = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


def _autocast_now() -> tuple[tuple[str, bool, torch.dtype], ...]:
    return tuple([(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES])


_RANDOM = "dropout or other random draws in its forward (the flush's recomputation cannot replay them)"
_STATEFUL = "a forward that changes the module's buffers (the flush's recomputation cannot replay that)"
_STATEFUL_ATTRIBUTES = (
    "a forward that changes, rebinds or adds tensors kept as plain attributes (the flush's recomputation "
    "cannot replay that; keep a tensor the forward only writes, such as a stashed attention map, "
    "out of the module's attributes, and make a constant it builds lazily in __init__ or keep it with "
    "register_buffer(..., persistent=False), to keep the module deferred)"
)
_NOT_TENSORS = "outputs other than a tensor or a tuple or list of tensors"
_ALIASES = "outputs that are its inputs, parameters or buffers, views of them, or views of one another"
_VIEW_AMONG_SEVERAL = "several outputs, one of them a view (return a copy, or the tensor it views)"
_FAILS_WITHOUT_GRAPH = (
    "a forward that fails run without a graph or on detached parameters (a tensor hook registered on "
    "an intermediate): the recompute rule's trial and deferred forward run it so"
)
_BUILDS_PARTS = "a forward that builds parts of the module (submodules or parameters) on more than one call"
_CHANGES_PARAMETERS = (
    "a forward that changes its parameters (a max-norm constraint applied through .data or under "
    "no_grad): the recompute rule runs it on stand-ins, which such a change would not reach"
)
_INFERENCE_STATE = (
    "buffers or tensor attributes made under torch.inference_mode (no version counter to check the "
    "replay's state by)"
)
_CHANGES_INPUTS = "a forward that changes its inputs in place (the flush's recomputation would see the changed values)"
_REENTRANT_CHECKPOINT = (
    "a forward that runs a reentrant torch.utils.checkpoint (the flush's recomputation cannot differentiate it)"
)


#: Modules whose forward was seen drawing random numbers or changing a buffer, and why: they
#: keep plain autograd.
_unreplayable: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()

_SHARDED = (
    "parameters sharded by FSDP2 (fully_shard frees their unsharded storage after backward; the "
    "flush's recomputation would read it)"
)

#: module -> (its parameters' ids, whether FSDP2 shards them), asked on every call once FSDP2 is used.
_fsdp_verdicts: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[int, ...], bool]] = weakref.WeakKeyDictionary()


def _sharded_by_fsdp(module: nn.Module, params: Mapping[str, Tensor]) -> bool:
    if not fsdp_hooks.fsdp_in_use():
        return False
    key = tuple(id(p) for p in params.values())
    known = _fsdp_verdicts.get(module)
    if known is not None and known[0] == key:
        return known[1]
    sharded = bool(fsdp_hooks.sharded_params_of(list(params.values())))
    _fsdp_verdicts[module] = (key, sharded)
    return sharded


#: Modules whose forward, run on copies of its inputs once, left them unchanged.
_leaves_inputs: weakref.WeakSet[nn.Module] = weakref.WeakSet()

#: Whether a module's forward, tried once on a batch, treats the rows of dim 0 apart (the flush
#: may then join its calls' rows).
_rows_apart: weakref.WeakKeyDictionary[nn.Module, dict[Hashable, bool]] = weakref.WeakKeyDictionary()
_MAX_VERDICTS = 8  # per module
#: A serial number per tensor a key names (a buffer, a tensor attribute's base): an id()
#: or a data pointer is reused once its tensor is freed (a mode buffer assigned anew each step).
_serials: WeakIdKeyDictionary = WeakIdKeyDictionary()
_next_serial = itertools.count()


def _serial(t: Tensor) -> int:
    serial = _serials.get(t)
    if serial is None:
        serial = _serials[t] = next(_next_serial)
    return serial


def _tensor_key(t: Tensor) -> Hashable:
    """A held tensor in a key (a verdict's, a group's): its base's serial and version, and the view
    of it (``table[:1]`` and ``table[:2]`` of one table hold other values)."""
    base = t if t._base is None else t._base
    offset = t.storage_offset() if t.layout == torch.strided else 0
    return (_serial(base), t._version, t.shape, t.stride() if t.layout == torch.strided else (), offset, t.dtype)


#: Modules that built parts of themselves in a call (see _deferred_forward): the second time,
#: they keep plain autograd.
_grown: weakref.WeakSet[nn.Module] = weakref.WeakSet()

#: The public scalars a module's forward was seen changing (a call counter): no verdict key.
_scalars_it_changes: weakref.WeakKeyDictionary[nn.Module, frozenset[tuple[int, str]]] = weakref.WeakKeyDictionary()


_HOOKED_SUBMODULES = (
    "forward or backward hooks on its submodules (what a forward hook takes out, such as Hugging Face's "
    "captured router logits, would carry no graph to the parameters, and the hooks would fire again at the replay)"
)


_Parts = tuple[type, frozenset[str], frozenset[str], frozenset[int], object]


def _parts_of(module: nn.Module) -> _Parts:
    """Its class, the names of its parameters and buffers (those set: one registered as None and
    set since counts as added), its hooks' ids and its own instance forward (None for a patched
    one's, which computes as the class's)."""
    attributes = vars(module)
    forward = attributes.get("forward")
    if forward is not None and forward is attributes.get(PATCHED_CALL):
        forward = None  # patched, or patched again since (unpatch and patch between backward and flush)
    return (
        type(module),
        frozenset([n for n, p in module._parameters.items() if p is not None]),
        frozenset([n for n, b in module._buffers.items() if b is not None]),
        _hook_ids(module),
        forward,
    )


def _added_parts(module: nn.Module, then: _Parts, *, submodule: bool, shadowed: set[str]) -> bool:
    """Parameters or buffers added to ``module`` since ``then`` (:func:`_parts_of`) but those
    ``shadowed``, or its class swapped; for a submodule (the replay calls it, not the registered
    module's own hooks or instance forward) also hooks registered or its forward replaced."""
    cls, params, buffers, hooks, forward = then
    cls_now, params_now, buffers_now, hooks_now, forward_now = _parts_of(module)
    return (
        cls_now is not cls
        or not (params | shadowed).issuperset(params_now)
        or not (buffers | shadowed).issuperset(buffers_now)
        or (submodule and (not hooks.issuperset(hooks_now) or forward_now is not forward))
    )


def _hook_dicts(module: nn.Module) -> tuple[dict[int, Any], ...]:
    return module._forward_hooks, module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks


def _hook_ids(module: nn.Module) -> frozenset[int]:
    return frozenset().union(*_hook_dicts(module))


def _submodule_hooked(module: nn.Module) -> bool:
    return any(_hook_dicts(module))


def _has_hooked_submodules(module: nn.Module) -> bool:
    """Module hooks that fire inside the module's forward or its replay: global ones, or its
    submodules' (its own run around the rule, on the tapped output, and never at the replay)."""
    if (
        module_hooks._global_forward_hooks
        or module_hooks._global_forward_pre_hooks
        or (module._modules and (module_hooks._global_backward_hooks or module_hooks._global_backward_pre_hooks))
    ):
        return True
    if not module._modules:
        return False
    # Backward hooks too: the replay calls the submodules again, and their hooks would fire
    # once more at the flush, on the replay's (joined) gradients.
    return any(_submodule_hooked(m) for m in module.modules() if m is not module)


_STEPPED_IN_BACKWARD = (
    "a parameter that has both a tensor hook (register_hook: its gradient is taken in backward) and "
    "a post-accumulate-grad hook (an optimizer stepped in backward would change it in place while "
    "the forward's own backward nodes, which saved it, and the flush's replay still read it)"
)


def _stepped_in_backward(params: Iterable[Tensor]) -> bool:
    """Whether a leaf parameter takes its gradient in backward (a tensor hook makes it 'now', see
    deferral) and may be changed in place as soon as that gradient is accumulated (a
    post-accumulate-grad hook, such as an optimizer stepped in backward). Plain autograd
    accumulates a leaf only after all its uses' nodes ran; the rule's node hands the gradient on
    before the forward's own nodes (on the detached stand-in, which shares the parameter's storage
    and version) run, and the flush replays the forward with the parameter's values."""
    return any(p.is_leaf and p._backward_hooks and may_change_in_backward(p) for p in params)


#: A lock per module: the rule's forward (and the flush's replay) runs a module with detached
#: stand-ins put in place of its parameters and puts its buffers back after trial runs. Two
#: threads running one module at once read each other's stand-ins (a gradient lost, a stand-in
#: left in place for good). One lock for all modules would deadlock a forward that waits for
#: other threads running other such modules (a thread pool over its branches). (A shallow copy
#: shares its original's parameter dict but not its lock: README.)
_locks: WeakIdKeyDictionary = WeakIdKeyDictionary()
_locks_made = threading.Lock()


def _lock_of(module: nn.Module) -> threading.RLock:
    lock = _locks.get(module)
    if lock is None:
        with _locks_made:
            lock = _locks.setdefault(module, threading.RLock())
    return lock


#: Thread -> calls of the rule running on it. A call tells a forward that draws random numbers by
#: the default generators' state before and after it, and rewinds them after trial runs and before
#: running plain autograd again: while another thread runs the rule, its draws move that state
#: and a rewind would hide them (a dropout module then taken for deterministic, its replay drawing
#: another mask). So a rewind is made only where this thread's calls run the rule alone: others
#: err on the safe side (a module taken for random keeps plain autograd).
_rule_threads: dict[int, int] = {}
_rule_threads_lock = threading.Lock()


@contextmanager
def _running_the_rule() -> Iterator[None]:
    me = threading.get_ident()
    with _rule_threads_lock:
        _rule_threads[me] = _rule_threads.get(me, 0) + 1
    try:
        yield
    finally:
        with _rule_threads_lock:
            if _rule_threads[me] == 1:
                del _rule_threads[me]
            else:
                _rule_threads[me] -= 1


def _rewind_random_state(
    cpu_state: Tensor, devices: list[int], device_states: list[Tensor], host: _HostRandomState | None
) -> bool:
    """The default generators back to ``cpu_state`` and ``device_states`` (and ``host``'s, where
    taken), where no other thread runs the rule (see :data:`_rule_threads`); whether they went back."""
    with _rule_threads_lock:
        if len(_rule_threads) != 1:
            return False
        torch.set_rng_state(cpu_state)
        set_device_states(devices, device_states)
        if host is not None:
            host.restore()
        return True


class _HostRandomState:
    """The states of Python's ``random`` and NumPy's global generator (where NumPy is loaded)
    when taken: a forward that draws from them (fairseq's LayerDrop, ``np.random.uniform``) takes
    another branch at the flush's replay."""

    __slots__ = ("python", "numpy")

    def __init__(self) -> None:
        self.python = random.getstate()
        self.numpy = _numpy_random_state()

    def restore(self) -> None:
        random.setstate(self.python)
        if self.numpy is not None:
            sys.modules["numpy"].random.set_state(self.numpy)

    def moved(self) -> bool:
        """Whether either generator drew since (NumPy loaded since counts as drawn)."""
        return random.getstate() != self.python or not _same_state(_numpy_random_state(), self.numpy)


def _numpy_random_state() -> dict[str, Any] | None:
    """NumPy's global generator's state (any bit generator), or None where NumPy is not loaded."""
    numpy = sys.modules.get("numpy")
    return None if numpy is None else numpy.random.get_state(legacy=False)


def _same_state(a: object, b: object) -> bool:
    """Equal states: nested dicts of numbers and arrays (a Mersenne Twister's key)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(a, numpy.ndarray):
        return isinstance(b, numpy.ndarray) and numpy.array_equal(a, b)
    return type(a) is type(b) and a == b


def recompute(module: nn.Module, *inputs: Any, **kwargs: Any) -> Any:
    """Deferred forward for ``register(MyModule, recompute)``: positional tensor inputs. Other
    calls keep plain autograd (with one warning per module type). The flush replays each call on
    its own, so a forward may mix the rows of its inputs (a time-major attention, a statistic
    over the batch); for one that treats them apart, :func:`recompute_rowwise` joins them. One
    thread at a time runs a module under this rule (see :data:`_locks`)."""
    with _lock_of(module), _running_the_rule():
        return _deferred_forward(module, inputs, kwargs, rowwise=False)


def recompute_rowwise(module: nn.Module, *inputs: Any, **kwargs: Any) -> Any:
    """:func:`recompute` for a module whose forward treats the rows of dim 0 apart, each sample
    on its own (a per-token norm, a per-sample MLP): where joining pays (off the CPU, or the
    ``concat`` strategy) the flush replays its micro-batches joined on dim 0, one forward and
    backward for all. Its first calls try the claim (:func:`_treats_rows_apart`) and a call found
    mixing rows is replayed on its own, but a trial cannot see every mix: register a module with
    this rule only where its rows are apart by construction."""
    with _lock_of(module), _running_the_rule():
        return _deferred_forward(module, inputs, kwargs, rowwise=True)


# The patched call takes the lock before it asks whether the module's parameters require grad.
recompute.runs_alone = recompute_rowwise.runs_alone = _lock_of  # type: ignore[attr-defined]


def _deferred_forward(module: nn.Module, inputs: tuple[Any, ...], kwargs: dict[str, Any], *, rowwise: bool) -> Any:
    params = dict(module.named_parameters())
    if kwargs or not inputs or not all(isinstance(t, Tensor) and t.dim() > 0 for t in inputs):
        reason: str | None = "keyword, non-tensor or 0-d arguments (recompute replays positional tensors only)"
    elif any(t.is_inference() for t in inputs):
        reason = "inputs made under torch.inference_mode (no version counter to check the replay's input by)"
    else:
        unreplayable = None if replaying_deferred(module) else _unreplayable.get(module)
        reason = unreplayable or unsupported_tensors(*inputs, *params.values())
        if reason is None and _has_hooked_submodules(module):
            reason = _HOOKED_SUBMODULES
        if reason is None and _stepped_in_backward(params.values()):
            reason = _STEPPED_IN_BACKWARD
        if reason is None and _sharded_by_fsdp(module, params):
            reason = _SHARDED
    if reason is not None:
        return plain_forward(module, reason, *inputs, **kwargs)
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None or any(
        isinstance(t, FakeTensor) for t in inputs
    ):
        # Under FakeTensorMode (a shape or memory estimate) no value can be compared or replayed:
        # the module's own forward, with no trials and no verdict kept for real calls.
        return type(module).forward(module, *inputs)
    tensors = (*inputs, *params.values())
    cpu_state, (devices, device_states) = torch.get_rng_state(), _device_random_states(tensors)
    try:
        state = _ForwardState(module, params)
    except RuntimeError:  # a buffer or tensor attribute made under inference_mode
        if not any(t.is_inference() for t in (*module.buffers(), *_tensor_attributes(module))):
            raise
        return plain_forward(module, _INFERENCE_STATE, *inputs)
    values = [b.clone() for _, b in state.named_buffers]  # none for most such modules
    verdicts = _rows_apart.setdefault(module, {})
    # A verdict holds for calls alike: the training flags of its submodules, the buffers and
    # tensor attributes it reads and the public scalars (a switch or a mode a schedule sets), the
    # inputs' ranks (a time-major call after batch-major ones).
    changing = _scalars_it_changes.get(module, ())  # a call counter: left out (the replay reads it as it is)
    alike = (
        state.flags,
        # A mode kept in a buffer or a tensor attribute (README's advice for state) may switch the
        # forward between row-wise and mixing as a public number does.
        tuple([_tensor_key(b) for _, b in state.named_buffers]),
        tuple([(n, _tensor_key(v)) for n, v in state.attribute_objects.items()]),
        tuple([(n, v) for a, n, v in state.scalars if (id(a), n) not in changing]),
        tuple([t.dim() for t in inputs]),
    )
    # Past a few verdicts no new one is sought (a temperature set at every call would make a
    # verdict, and two trial forwards, per call): such calls are not joined (calls that saw other
    # values are not joined anyway, state.key()).
    judged = alike in verdicts or len(verdicts) >= _MAX_VERDICTS
    trials = module not in _leaves_inputs or not judged
    # Copies only where trials will run (a module's first calls), which must be rewound; later
    # calls see a change in place by its version (a cache held in an attribute is not copied).
    attribute_values = state.attribute_values() if trials else {}
    # Python's and NumPy's generators too (LayerDrop written as `random.random() < p`), only
    # where trials run (a module's first calls, and the first in each new mix of modes): a copy of
    # theirs costs a tenth of a small module's forward.
    host_random = _HostRandomState() if trials else None
    param_values = [p.detach().clone() for p in params.values()] if trials else []
    # Leaves detached, so their gradients wait for the flush; others (functional_call's computed
    # substitutes) keep their graph and are differentiated at once, as plain autograd does.
    substitutes = {n: detached(p) for n, p in params.items()}

    attributes = _Attributes(module, with_hooks=trials)

    def rewind() -> bool:
        """Random state, buffers and parameters' contents back to where this call found them;
        whether the random state went back (not while another thread runs the rule)."""
        rewound = _rewind_random_state(cpu_state, devices, device_states, host_random)
        state.restore(module, values)
        state.restore_attributes(attribute_values)
        state.restore_parameters(param_values)
        return rewound

    def undo(built: bool) -> None:
        """What the trials or the attempt added (a part built, a cache made from the stand-ins) or
        set (public scalars: a rebound tensor stays, as the Python state it goes with)."""
        if built:
            attributes.restore()
            return
        attributes.drop_tensors_added()
        for attrs, name, value in state.scalars:
            attrs[name] = value

    trial_output = None
    if module not in _leaves_inputs:
        try:
            with _outside_selective_checkpointing():
                changes_inputs, trial_output = _changes_its_inputs(module, inputs, substitutes)
        except Exception as error:  # needs a graph (a tensor hook on an intermediate): plain's forward decides
            built = attributes.built_since()
            rewind()
            undo(built)  # what the trial built or cached before it failed too
            # Plain's own error first (a bad input shape): no warning, and the module stays deferred.
            output = type(module).forward(module, *inputs)
            # The trial's own error said too: a forward that failed once for another reason (a
            # transient one) is not taken for one that needs a graph without a word.
            failed = f"{_FAILS_WITHOUT_GRAPH}; the trial raised {type(error).__name__}: {str(error)[:200]}"
            _unreplayable[module] = failed
            warn_plain_call(module, failed)
            took_plain(module)
            return output
        # A trial that changed the module's state (ActNorm's data-dependent initialisation of its
        # parameters, a buffer or a cache), maybe under a flag it set: the rewind puts the state
        # back, and the attempt, the flag set, would skip the change plain makes. Such a module
        # keeps plain autograd, its attributes put back first (a private flag too).
        changed_state = (
            _CHANGES_PARAMETERS if state.parameters_changed(substitutes, param_values)
            else _STATEFUL if state.changed_by_forward(module, values)
            else _STATEFUL_ATTRIBUTES if state.attributes_changed(module, attribute_values)
            else None
        )  # fmt: skip
        after_trial = _state_of(module, substitutes) if changed_state else {}
        # Told here, not after the attempt below: an attempt abandoned for its draws leaves what it
        # saved counted by an activation checkpoint around the module, whose recomputation, plain's
        # forward alone, then saves fewer tensors (CheckpointError on a dropout block's first call).
        drew_in_trial = _random_numbers_drawn(cpu_state, device_states, tensors) or (
            host_random is not None and host_random.moved()
        )
        random_state_rewound = rewind()  # the trial's draws and buffer changes
        if changed_state and not attributes.built_since():
            undo(True)
            _unreplayable[module] = changed_state
            output = plain_forward(module, changed_state, *inputs)
            if random_state_rewound:  # else the plain run may draw other numbers (a buffer of noise)
                _check_made_again(module, after_trial)
            return output
        if attributes.built_since():
            undo(True)
            return _built_parts(module, inputs)
        if changes_inputs:  # its replay at the flush would see the changed values
            _unreplayable[module] = _CHANGES_INPUTS
            return plain_forward(module, _CHANGES_INPUTS, *inputs)
        if drew_in_trial:
            _unreplayable[module] = _RANDOM
            return plain_forward(module, _RANDOM, *inputs)
    if not judged and not rowwise:
        # No rows-apart verdict to seek; the key still marks the calls whose trials watch the host's
        # generators (a LayerDrop whose switch a schedule turns on after the first calls).
        verdicts[alike] = False
    elif not judged and _batched_alike(inputs) and inputs[0].shape[0] > 0:
        with _outside_selective_checkpointing():
            verdict = _treats_rows_apart(module, inputs, substitutes, trial_output)
        if verdict is not None:  # None: no verdict from this call (replayed on its own)
            verdicts[alike] = verdict
        rewind()
    versions = [t._version for t in inputs]
    mark = recorded_so_far()
    try:
        with _no_saved_tensors_hooks_pushed():
            output = _plain_forward(module, inputs, substitutes)
    except RuntimeError as error:
        if str(error) != _SAVES_THROUGH_HOOKS:
            raise
        _unreplayable[module] = _SAVES_THROUGH_HOOKS
        rewind()
        return plain_forward(module, _SAVES_THROUGH_HOOKS, *inputs)
    if [t._version for t in inputs] != versions:
        _unreplayable[module] = _CHANGES_INPUTS
        raise RuntimeError(
            f"twobp: {type(module).__name__}'s forward changed its input in place, which its first "
            "call did not: the recompute rule replays the forward on its input at the flush, which "
            "would hold the changed values, so its weight gradients would be wrong. This call is "
            "refused (its input is changed already); the module keeps plain autograd from its next "
            "call on. Exclude it from patch() (exclude=[...]) to train it as before."
        )
    drew = _random_numbers_drawn(cpu_state, device_states, tensors) or (
        host_random is not None and host_random.moved()
    )
    if not attribute_values and state.attributes_changed_in_place():
        _unreplayable[module] = _STATEFUL_ATTRIBUTES
        raise RuntimeError(
            f"twobp: {type(module).__name__}'s forward changed a tensor kept as a plain attribute in "
            "place, which its first calls did not: the recompute rule cannot replay that at the flush, "
            "nor undo it to run the forward again on plain autograd. This call is refused (the change "
            "is made already); the module keeps plain autograd from its next call on. Register the "
            "tensor as a buffer, or exclude the module from patch() (exclude=[...])."
        )
    parameters_changed = state.parameters_changed(substitutes, param_values)
    if parameters_changed and not param_values and state.parameters_changed_in_place():
        _unreplayable[module] = _CHANGES_PARAMETERS
        raise RuntimeError(
            f"twobp: {type(module).__name__}'s forward changed one of its parameters in place, which "
            "its first calls did not: the recompute rule cannot replay that at the flush, nor undo it "
            "to run the forward again on plain autograd. This call is refused (the change is made "
            "already); the module keeps plain autograd from its next call on. Apply such a "
            "constraint after optimizer.step(), or exclude the module from patch() (exclude=[...])."
        )
    why = (
        _CHANGES_PARAMETERS if parameters_changed
        else _RANDOM if drew
        else _STATEFUL if state.changed_by_forward(module, values)
        else _STATEFUL_ATTRIBUTES if state.attributes_changed(module, attribute_values)
        else _unfit_outputs(
            output, [*tensors, *substitutes.values(), *state.buffers().values(), *state.attribute_objects.values()]
        )
    )  # fmt: skip
    built = attributes.built_since()
    if why is not None or built:
        # Run again on plain autograd from the same random state, attributes and buffers, so that
        # the output is plain's and generators, buffers and parts built end where one plain
        # forward leaves them (a cache the trials or this forward made from the stand-ins dropped).
        rewind()
        undo(built)
        forget_since(mark)  # the attempt's patched calls: the recomputation runs only the plain forward
        if built or why is None:  # the parts' initialisation may be what drew random numbers
            return _built_parts(module, inputs)
        _unreplayable[module] = why
        return plain_forward(module, why, *inputs)
    values.clear()  # the buffers' copies are not needed past here
    attribute_values.clear()
    # The structure the replay will run with: what the forward built (heads made on a first call)
    # is part of it; a change after it is what the flush refuses.
    state.submodules = tuple([(n, id(m)) for n, m in module.named_modules()])
    before = {(id(a), n) for a, n, _ in state.scalars}
    state.keep_what_the_forward_left(module)
    changed = before - {(id(a), n) for a, n, _ in state.scalars}
    if changed:
        _scalars_it_changes[module] = _scalars_it_changes.get(module, frozenset()) | changed
    _leaves_inputs.add(module)
    outputs = _as_tensors(output)
    kernel = functools.partial(recompute_weight_grad, module=module, state=state)
    leaves_some_grads_none(kernel)
    joinable = rowwise and verdicts.get(alike, False) and _batched_alike([*inputs, *outputs])
    # Grouped per module and state (the flush groups per parameter tensors too): the partial
    # holds tensors, which must not be compared as a group key.
    group = (recompute_weight_grad, module, state.key(), joinable)
    tapped = defer_weight_grads(
        outputs,
        tuple(params.values()),
        inputs,
        kernel,
        concatenate=None if joinable else False,
        group=group,
        saves_reached=True,
    )
    return _shaped_as(output, tapped)


def _state_of(module: nn.Module, substitutes: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Copies of the parameters' (as the forward saw them: the stand-ins) and buffers' values."""
    values = {name: t.detach().clone() for name, t in substitutes.items()}
    values.update((name, b.detach().clone()) for name, b in module.named_buffers())
    return values


def _same_values(a: Tensor, b: Tensor) -> bool:
    """Equal up to the rounding of other kernels: the trial runs a submodule on what the module
    hands it, the run again on plain autograd may take another path (a patched Linear computes a
    strided 3-D input as 2-D rows: a BatchNorm's running mean after it 4e-18 off in fp64). Each
    entry within the square root of its dtype's resolution of the tensor's largest (1.5e-8 in fp64,
    3.5e-4 in fp32; 1e-2 in 16 bits), so a small entry's change beside a large one still shows."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.layout != torch.strided or a.is_meta:  # no values to compare: their versions tell
        return True
    if not (a.is_floating_point() or a.is_complex()):
        return torch.equal(a, b)
    if not b.numel():
        return True
    rtol = 1e-2 if torch.finfo(a.dtype).bits <= 16 else torch.finfo(a.dtype).eps ** 0.5
    magnitude = b.abs()
    largest = float(magnitude.where(magnitude.isfinite(), 0).amax())
    return bool(torch.isclose(a, b, rtol=rtol, atol=rtol * largest, equal_nan=True).all())


def _check_made_again(module: nn.Module, after_trial: Mapping[str, Tensor]) -> None:
    """The call run again on plain autograd must leave the parameters and buffers as the trial
    did: where it does not, the change hung on a flag the rule could not put back (kept in a
    dict, on another object, the class or a global), and plain skipped it."""
    now = {name: t.detach() for name, t in (*module.named_parameters(), *module.named_buffers())}
    if all(name in now and _same_values(now[name], value) for name, value in after_trial.items()):
        return
    raise RuntimeError(
        f"twobp: {type(module).__name__}'s first call changed its parameters or buffers (an "
        "initialisation from the first batch) under a condition the recompute rule could not put "
        "back after its trial run (a flag kept in a dict, on another object, on the class or in a "
        "global), and the call run again on plain autograd skipped that change: the module was not "
        "changed as plain's first call changes it. Keep such a flag in a Python attribute of the "
        "module, or exclude the module from patch() (exclude=[...]) and rebuild it."
    )


def _built_parts(module: nn.Module, inputs: Sequence[Tensor]) -> Any:
    """A call that built parts of the module (a head sized by its input), its attempt undone, on
    plain autograd: the random numbers their initialisation draws are drawn once, as plain draws
    them (rewound after a trial, the forward drawing none after them, the generators ended where
    plain's began). A module that builds parts again (a head per new size) keeps plain autograd."""
    if module in _grown:
        _unreplayable[module] = _BUILDS_PARTS
        return plain_forward(module, _BUILDS_PARTS, *inputs)
    _grown.add(module)
    took_plain(module)
    return type(module).forward(module, *inputs)


_SAVES_THROUGH_HOOKS = (
    "saved-tensor hooks pushed inside its forward (a non-reentrant activation checkpoint): its "
    "recomputation in backward would read the parameters, not the forward's detached stand-ins, and "
    "unpack other tensors than the forward saved"
)


def _no_saved_tensors_hooks_pushed() -> contextlib.AbstractContextManager[None]:
    """Pushing saved-tensor hooks inside raises (:data:`_SAVES_THROUGH_HOOKS`). Where hooks are
    active already (``save_on_cpu`` around the model, a checkpoint around this module), disabling
    would refuse their own packing too: such a call is not checked (README)."""
    if torch.compiler.is_compiling() or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        # Traced, disable_saved_tensors_hooks becomes a lone side-effect node that inductor cannot compile.
        return contextlib.nullcontext()
    return torch.autograd.graph.disable_saved_tensors_hooks(_SAVES_THROUGH_HOOKS)


def _outside_selective_checkpointing() -> contextlib.AbstractContextManager[Any]:
    """The first call's trial forwards run without selective activation checkpointing's dispatch
    modes: they would record the trials' op outputs in its cache, and the region's recomputation
    in backward, which runs no trials, would be handed them in place of the real ones (a trial's
    output with two more rows: CheckpointError, or another op's values)."""
    if any(isinstance(mode, _SELECTIVE_CHECKPOINT_MODES) for mode in _get_current_dispatch_mode_stack()):
        return _disable_current_modes()
    return contextlib.nullcontext()


_SELECTIVE_CHECKPOINT_MODES = (torch_checkpoint._CachingTorchDispatchMode, torch_checkpoint._CachedTorchDispatchMode)


def _batched_alike(tensors: Sequence[Tensor]) -> bool:
    """Whether the flush may join this call's inputs (and output gradients) with other calls' on
    dim 0: each holds a batch there, as far as shapes can tell (two dims or more, one size of
    dim 0). A side input or output without a batch dim (a temperature or an auxiliary loss of
    shape (1,)) or an unbatched 1-D call, joined, would be broadcast or normalised across
    micro-batches, or fail: such calls are replayed one at a time."""
    first = tensors[0].shape[0]
    return all(t.dim() > 1 and t.shape[0] == first for t in tensors)


def _treats_rows_apart(
    module: nn.Module, inputs: Sequence[Tensor], substitutes: dict[str, Tensor], short: Any = None
) -> bool | None:
    """Whether the forward treats the rows of dim 0 apart, as the flush's joined replay assumes
    (shapes alone cannot tell: a time-major RNN's steps look like a batch): by :func:`_apart_at`
    at the parameters' values and at other values (:func:`_other_values`: a gate initialised at
    zero, ReZero, or at LayerScale's 1e-5, hid a time-major attention's mixing at the first call,
    and the verdict outlived the optimizer's opening it). None (no verdict yet) for a batch of one
    row with an index input: rows put around it are copies, and it has no halves."""
    if inputs[0].shape[0] < 2 and not all(t.is_floating_point() for t in inputs):
        return None
    apart = _apart_at(module, inputs, substitutes, short)
    if not apart:
        return apart
    return _apart_at(module, inputs, _other_values(substitutes), None, finite=True)


def _apart_at(
    module: nn.Module, inputs: Sequence[Tensor], substitutes: dict[str, Tensor], short: Any, *, finite: bool = False
) -> bool | None:
    """The forward without a graph on the inputs (``short``: that run's output, if made already)
    must give its outputs again with rows of other values around the batch (float inputs:
    :func:`_apart_around`) and on the batch's halves run apart (two rows or more:
    :func:`_split_trial`). ``finite``: a NaN in its outputs (which would hide any mix) gives no
    rows-apart verdict."""
    if short is None:
        try:
            with torch.no_grad():
                short = _plain_forward(module, [t.detach().clone() for t in inputs], substitutes)
        except Exception:  # it takes no such call (or values): never joined
            return False
    if _unfit_outputs(short, ()) == _NOT_TENSORS:
        return False  # such a call keeps plain autograd anyway
    if _without_data([*inputs, *_as_tensors(short)]):
        return None  # meta or fake tensors (a shape estimate): no values to compare
    if finite and any(t.is_floating_point() and bool(t.isnan().any()) for t in _as_tensors(short)):
        return False
    apart: bool | None = True
    if any(t.is_floating_point() for t in inputs):
        apart = _apart_around(module, inputs, substitutes, short)
    if apart and inputs[0].shape[0] > 1:
        apart = _split_trial(module, inputs, substitutes, short)
    return apart


def _apart_around(module: nn.Module, inputs: Sequence[Tensor], substitutes: dict[str, Tensor], short: Any) -> bool:
    """The inputs with a row of other values before and two after: every output must come back as
    ``short`` (the inputs' own) between them (a recurrence carries the row before into the batch, a
    hidden state of (layers, N, H) does not grow, batch statistics move). Rows put around evenly
    hid a mix symmetric about the middle (``x.flip(0)``, the centre frame)."""
    with torch.no_grad():
        try:
            # Rows of other values: a duplicate row cannot move a max, nor the mean of one row,
            # nor a causal mix of one step, but another row moves them.
            around = [torch.cat([_other_row(t, 0), t, _other_row(t, 1), _other_row(t, 2)]) for t in inputs]
            long = _plain_forward(module, around, substitutes)
        except Exception:  # a forward that takes no other batch size: never joined
            return False
    if _unfit_outputs(long, ()) == _NOT_TENSORS:
        return False
    shorter, longer = _as_tensors(short), _as_tensors(long)
    return len(shorter) == len(longer) and all(
        s.dim() > 0
        and extended.shape == (s.shape[0] + 3, *s.shape[1:])
        and _close(extended[1:-2], s)
        for s, extended in zip(shorter, longer, strict=True)
    )


def _other_values(substitutes: dict[str, Tensor]) -> dict[str, Tensor]:
    """The parameters' stand-ins moved to other values, drawn from a generator of this rule's own
    (the default ones stay where the forward found them, and two tensors alike are moved apart):
    each entry away from zero, keeping its sign (a variance under a square root, a scale under a
    log stay valid), by up to a few times its tensor's largest finite magnitude and at least 0.1,
    so that a zero or tiny gate opens. A tensor that cannot be drawn for (a frozen float8 weight,
    a sparse one) stays as it is."""
    generators: dict[torch.device, torch.Generator] = {}
    moved = {}
    for name, p in substitutes.items():
        moved[name] = p
        if not (p.is_floating_point() or p.is_complex()) or not p.numel() or _without_data([p]):
            continue
        generator = generators.get(p.device)
        if generator is None:
            generator = generators[p.device] = torch.Generator(device=p.device).manual_seed(0)
        try:
            with torch.no_grad():
                noise = torch.randn(p.shape, generator=generator, dtype=p.dtype, device=p.device)
                magnitude = p.abs()
                scale = magnitude.where(magnitude.isfinite(), 0).amax().clamp(min=0.1)
                moved[name] = p + torch.where(p == 0, noise, noise.abs() * p.sgn()) * scale
        except (RuntimeError, NotImplementedError):
            continue
    return moved


def _split_trial(
    module: nn.Module, inputs: Sequence[Tensor], substitutes: dict[str, Tensor], whole: Any
) -> bool:
    """The batch's halves run apart must give the whole batch's outputs (``whole``): a copy of a
    row put around the batch moves no max, nor the mean of one row (index inputs have no rows of
    other values), and rows put around at both ends cannot see a mix with the row a fixed way
    along the batch. Two rows or more."""
    n = inputs[0].shape[0]
    k = n // 2
    with torch.no_grad():
        try:
            first = _plain_forward(module, [t[:k] for t in inputs], substitutes)
            second = _plain_forward(module, [t[k:] for t in inputs], substitutes)
        except Exception:
            return False
    if any(_unfit_outputs(o, ()) == _NOT_TENSORS for o in (first, second)):
        return False
    parts = zip(_as_tensors(whole), _as_tensors(first), _as_tensors(second), strict=False)
    return len({len(_as_tensors(o)) for o in (whole, first, second)}) == 1 and all(
        w.dim() > 0
        and w.shape[0] == n
        and f.shape == w[:k].shape
        and s2.shape == w[k:].shape
        and _close(w[:k], f)
        and _close(w[k:], s2)
        for w, f, s2 in parts
    )


def _without_data(tensors: Sequence[Tensor]) -> bool:
    """Whether any of ``tensors`` holds no values to compare: on the meta device, or fake
    (``FakeTensorMode``, which refuses to read a value)."""
    return any(t.is_meta or isinstance(t, FakeTensor) for t in tensors)


def _other_row(t: Tensor, which: int) -> Tensor:
    """A row of ``t``'s shape whose values differ from its rows' and from the other such rows'
    (an index row: a copy of one of them)."""
    from_last, scale, shift = _OTHER_ROWS[which]
    row = t[-1:] if from_last else t[:1]
    if not t.is_floating_point():
        return row
    return row * scale + shift


#: Each row put around a batch by a first call's trial: (made from the batch's last row, not its
#: first), a scale, a shift.
_OTHER_ROWS = ((False, 2.0, 1.0), (True, -1.5, 0.5), (False, -0.5, -2.0))


def _close(a: Tensor, b: Tensor) -> bool:
    """Equal up to the rounding a kernel's other batch size may bring (not a state carried over)."""
    if not a.is_floating_point():
        return torch.equal(a, b)
    # 16 bits: 1% (a row's reduction rounded otherwise at another batch size may move bf16 outputs
    # by 2 ulps, 1.6% at the bottom of a binade, so such a module may not join; a looser bound let
    # a normalisation over a few hundred rows pass as rows apart).
    rtol = 1e-2 if torch.finfo(a.dtype).bits <= 16 else 1e-4
    if not b.numel():
        return a.shape == b.shape
    # Each position's scale over the batch, from finite values only: one large or infinite
    # entry (a masked logit at -inf or finfo.min) must not hide the others' mixing.
    magnitude = b.abs().where(b.isfinite(), 0)
    scale = magnitude.amax(0, keepdim=True) if b.dim() > 0 else magnitude
    near = torch.isclose(a, b, rtol=rtol, atol=0.0, equal_nan=True).logical_or_((a - b).abs() <= rtol * scale)
    return bool(near.all())


def _changes_its_inputs(
    module: nn.Module, inputs: Sequence[Tensor], substitutes: dict[str, Tensor]
) -> tuple[bool, Any]:
    """A module's first call runs once more, on copies of its inputs and without recording a
    graph (nothing saved, so an activation checkpoint around it counts what plain saves): does
    its forward change them in place (``x.mul_(2)``, an in-place ReLU)? And that run's output."""
    copies = tuple(t.detach().clone() for t in inputs)
    versions = [t._version for t in copies]
    with torch.no_grad():
        output = _plain_forward(module, copies, substitutes)
    return [t._version for t in copies] != versions, output


def _device_random_states(tensors: Sequence[Tensor]) -> tuple[list[int], list[Tensor]]:
    """``get_device_states`` (the generators of the devices ``tensors`` live on, as checkpointing
    saves them), without its walk over the arguments where all of them are on the CPU: a third of
    a small module's patched forward."""
    if all(t.device.type in ("cpu", "meta") for t in tensors):
        return [], []
    return get_device_states(*tensors)


def _random_numbers_drawn(cpu_state: Tensor, device_states: list[Tensor], tensors: Sequence[Tensor]) -> bool:
    """Whether the CPU generator, or that of a device ``tensors`` live on, moved since those states."""
    if not torch.equal(torch.get_rng_state(), cpu_state):
        return True
    _, now = _device_random_states(tensors)
    return any(not torch.equal(a, b) for a, b in zip(now, device_states, strict=True))
