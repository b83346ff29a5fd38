"""README contract points 2 and 3: patching changes nothing a user can see but the timing of
weight gradients, and every path where no weight gradient can be wanted stays plain."""

import contextlib
import copy
import functools
import gc
import inspect
import io
import os
import pickle
import subprocess
import sys
import textwrap
import types
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.utils.parametrize
import torch.nn.utils.prune
from torch import nn

import twobp_autograd
import twobp_autograd as twobp
from tests.utils import assert_grads_match, assert_no_grads, patched_and_reference
from twobp_autograd import warn_once
from twobp_autograd.ops import recompute


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))


def test_patch_keeps_class_parameters_state_dict_repr_and_optimizer():
    model = mlp()
    params = list(model.parameters())
    keys, text = list(model.state_dict()), repr(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    assert twobp.patch(model) is model
    assert type(model[0]) is nn.Linear
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    assert list(model.state_dict()) == keys and repr(model) == text
    before = [p.detach().clone() for p in params]
    model(torch.randn(3, 4)).sum().backward()
    twobp.flush_weight_grads()
    optimizer.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_patch_is_idempotent_and_reports():
    model = nn.Sequential(mlp(), nn.Bilinear(2, 2, 2))
    first = twobp.patch(model, report=True)
    forward = model[0][0].forward
    second = twobp.patch(model, report=True)
    assert model[0][0].forward is forward
    assert first.patched == second.patched == ["0.0", "0.2"]
    assert "Bilinear is not registered" in second.skipped["1"]
    assert "skipped 1" in str(second)


def test_include_and_exclude_by_type_and_name():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 3))
    assert twobp.patch(model, include=["1", "2"], exclude=["2"], report=True).patched == ["1"]
    assert twobp.patch(copy.deepcopy(twobp.unpatch(model)), exclude=[nn.Linear], report=True).patched == []


def test_one_selector_alone_is_one_selector_and_others_are_refused():
    """A bare string is one pattern, not a sequence of one-letter patterns ("1.*" iterated
    would exclude everything through its "*")."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)))
    assert twobp.patch(copy.deepcopy(model), exclude="1.*", report=True).patched == ["0"]
    assert twobp.patch(copy.deepcopy(model), include="1.0", report=True).patched == ["1.0"]
    assert twobp.patch(copy.deepcopy(model), exclude=nn.Linear, report=True).patched == []
    for include in ([3], 3):  # one selector alone, not iterable either: raised TypeError from list()
        with pytest.raises(TypeError, match="twobp: patch's include takes module types and qualified-name patterns"):
            twobp.patch(copy.deepcopy(model), include=include)


def test_register_refuses_an_empty_tuple_and_a_reason_that_is_no_callable():
    """register((), rule) registered nothing, silently; unsupported=42 was stored, and the next
    patch of such a module raised "'int' object is not callable" far from the mistake."""
    with pytest.raises(TypeError, match="got an empty tuple"):
        twobp.register((), recompute)
    with pytest.raises(TypeError, match="register's unsupported takes a callable"):
        twobp.register(_MyLinear, recompute, unsupported=42)  # type: ignore[arg-type]
    assert twobp_autograd.registry.rule_for(_MyLinear(2, 2)) is None


class _MyLinear(nn.Linear):
    pass


def test_subclass_keeps_plain_autograd_until_registered():
    model = nn.Sequential(_MyLinear(3, 3))
    with pytest.warns(UserWarning, match="twobp: patch.. found no layer it covers in this Sequential .*_MyLinear"):
        report = twobp.patch(model, report=True)
    assert report.patched == [] and "_MyLinear" in report.skipped["0"]
    model(torch.randn(2, 3)).sum().backward()
    assert model[0].weight.grad is not None and twobp.pending().jobs == 0


def test_a_subclass_sharded_by_fully_shard_is_reported_by_its_own_name(one_rank_group):
    """FSDP2 swaps in a generated subclass (FSDP_MyLinear), which no user can import or register:
    the report named it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(_MyLinear(3, 3), nn.Linear(3, 3))
    fully_shard(model[0], mesh=init_device_mesh("cpu", (1,)))
    report = twobp.patch(model, report=True)
    assert report.skipped["0"].startswith("tests.test_patching._MyLinear is not registered")
    assert "twobp.register(_MyLinear, twobp_autograd.ops.linear.linear)" in report.skipped["0"]


class _LinearOfItsOwn(nn.Linear):
    def forward(self, x):
        return super().forward(x).relu()


def test_a_subclass_is_reported_by_its_full_name_with_the_rule_that_fits_it():
    """A torch.ao QAT Linear was reported as "Linear is not registered", as if nn.Linear were not
    covered; a subclass that keeps its base's forward is told which rule to register it with."""
    model = nn.Sequential(_MyLinear(3, 3), _LinearOfItsOwn(3, 3))
    with pytest.warns(UserWarning, match="found no layer it covers"):
        report = twobp.patch(model, report=True)
    keeps, own = report.skipped["0"], report.skipped["1"]
    assert keeps.startswith("tests.test_patching._MyLinear is not registered")
    assert "twobp.register(_MyLinear, twobp_autograd.ops.linear.linear)" in keeps
    assert "with a forward of its own: register a rule for it" in own
    assert "twobp.register(_LinearOfItsOwn, twobp_autograd.ops.recompute)" in own  # Falcon's FalconLinear, say
    assert "called with positional tensors only" in own  # OPT's positional embedding is called with keywords
    twobp.register(_MyLinear, twobp_autograd.ops.linear.linear)  # as the report says
    assert twobp.patch(model, report=True).patched == ["0"]
    twobp.register(_LinearOfItsOwn, twobp_autograd.ops.recompute)
    assert twobp.patch(model, report=True).patched == ["0", "1"]


def test_a_lazy_module_is_told_to_run_a_forward_and_patch_again():
    """A lazy module becomes its covered class at its first forward; registering the lazy class
    with that class's rule (what the report told any subclass keeping its base's forward) would
    compute with an uninitialised weight."""
    model = nn.Sequential(nn.LazyLinear(3), nn.LazyBatchNorm1d(), nn.Linear(3, 2))
    skipped = twobp.patch(model, report=True).skipped
    assert "a lazy module: run one forward to make it a Linear" in skipped["0"]
    # A lazy norm does not derive from the class it becomes: it was reported as unregistered only.
    assert "a lazy module: run one forward to make it a BatchNorm1d" in skipped["1"]
    model(torch.randn(2, 5))
    assert twobp.patch(model, report=True).patched == ["0", "1", "2"]


def test_a_model_with_nothing_to_patch_warns_once_and_one_excluded_on_purpose_does_not():
    """Nothing deferred by a model whose layers are all of unregistered types (a stage traced by
    pipelining's pipeline() holds InterpreterModules): one warning per root type. A model whose
    covered layers were all excluded by the caller says nothing."""

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = _MyLinear(3, 3)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        twobp.patch(Stage())
        twobp.patch(Stage())
        twobp.patch(nn.Sequential(nn.Linear(3, 3)), exclude=[nn.Linear])
    assert [str(w.message)[:48] for w in caught] == ["twobp: patch() found no layer it covers in this "]


def test_a_patched_forward_has_the_signature_of_the_plain_one():
    layer = nn.Linear(4, 4)
    plain = inspect.signature(layer.forward)
    assert inspect.signature(twobp.patch(layer).forward) == plain


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
@pytest.mark.parametrize("root", ["model", "patched-layer"])
def test_torch_export_of_a_patched_model_records_the_plain_forward(strict, root):
    """Export traces the plain forward's ops (the deferred ones' custom Functions have no place
    in an exported program), with no warning and nothing queued."""
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.GELU(), nn.Linear(4, 2))
    if root == "patched-layer":  # export reads the root's forward's __code__ (it raised AttributeError)
        model = model[0]
    x = torch.randn(3, 4)
    plain_program = torch.export.export(copy.deepcopy(model), (x,), strict=strict)
    twobp.patch(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        program = torch.export.export(model, (x,), strict=strict)

    def ops(exported: torch.export.ExportedProgram) -> list[object]:
        return [node.target for node in exported.graph.nodes if node.op == "call_function"]

    assert ops(program) == ops(plain_program) and twobp.pending().jobs == 0
    torch.testing.assert_close(program.module()(x), plain_program.module()(x))


def test_torch_jit_trace_of_a_patched_model_in_training_records_the_plain_forward():
    """Traced in training, patched BatchNorm failed inside the JIT tracer ("unsupported argument
    type long"), Embedding on its in-place tap, GroupNorm on a traced bool; the others traced
    their custom Functions and failed the trace check. Traced as plain is: its graph runs plain
    autograd (correct gradients, nothing deferred)."""
    model = nn.Sequential(
        nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.GroupNorm(3, 3), nn.BatchNorm1d(3)
    ).double()
    reference = copy.deepcopy(model)
    twobp.patch(model)
    tokens = torch.randint(0, 10, (4, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)  # deprecated in this PyTorch
        traced = torch.jit.trace(model, (tokens,))
        traced_reference = torch.jit.trace(reference, (tokens,))
    assert twobp.pending().jobs == 0
    traced(tokens).pow(2).sum().backward()
    traced_reference(tokens).pow(2).sum().backward()
    assert twobp.pending().jobs == 0
    assert_grads_match(model, reference, dtype=torch.float64)


class _Gain(nn.Module):
    """A layer fx traces into (not one of torch.nn's leaf modules), with a rule of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def test_fx_symbolic_trace_of_a_patched_model_records_plains_ops_for_what_it_traces_into():
    """fx traces into a module with a user rule (its inputs are Proxies there): the rule ran on
    them and failed (a Proxy in control flow). It records the plain forward's ops, as export does;
    torch.nn's layers stay calls of the patched modules, which still defer."""

    @twobp.register(_Gain)
    def deferred(module, x):
        output = x * twobp.deferral.detached(module.weight)
        kernel = lambda saved, grad_outputs, needs: [(grad_outputs[0] * saved[0]).sum(0)]  # noqa: E731
        return twobp.deferral.defer_weight_grads(output, (module.weight,), (x.detach(),), kernel)

    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(4, 4), _Gain(), nn.Tanh(), nn.Linear(4, 2)))
    traced = torch.fx.symbolic_trace(patched)
    assert [node.target for node in traced.graph.nodes if node.op == "call_module"] == ["0", "2", "3"]
    x = torch.randn(3, 4)
    traced(x).square().sum().backward()
    reference(x).square().sum().backward()
    assert twobp.pending().jobs == 2 and patched[0].weight.grad is None
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


def test_unpatch_restores_plain_autograd():
    model = twobp.patch(mlp())
    assert "forward" in vars(model[0])
    twobp.unpatch(model)
    assert "forward" not in vars(model[0])
    model(torch.randn(3, 4)).sum().backward()
    assert twobp.pending().jobs == 0 and model[0].weight.grad is not None


def test_module_hooks_still_run_with_plain_values():
    patched, reference = patched_and_reference(mlp())
    seen = {}

    def record(tag):
        def pre_hook(module, args):
            seen[tag + "-pre"] = args[0].shape

        def backward_hook(module, grad_input, grad_output):
            seen[tag + "-bwd"] = (grad_input[0].clone(), grad_output[0].clone())

        return pre_hook, backward_hook

    for tag, model in (("patched", patched), ("reference", reference)):
        pre_hook, backward_hook = record(tag)
        model[2].register_forward_pre_hook(pre_hook)
        model[2].register_full_backward_hook(backward_hook)
    x = torch.randn(5, 4)
    patched(x).pow(2).sum().backward()
    reference(x).pow(2).sum().backward()
    assert seen["patched-pre"] == seen["reference-pre"]
    for a, b in zip(seen["patched-bwd"], seen["reference-bwd"], strict=True):
        torch.testing.assert_close(a, b)
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


def test_deepcopy_and_save_load_keep_the_patch():
    model = twobp.patch(mlp())
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for clone in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        assert clone[0].forward.module is clone[0]
        clone(torch.randn(2, 4)).sum().backward()
        assert_no_grads(clone)
        twobp.flush_weight_grads()
        assert clone[0].weight.grad is not None and model[0].weight.grad is None


def test_a_whole_patched_model_loads_with_weights_only_once_its_classes_are_allowed():
    """torch.load's default, weights_only=True, loads a whole model whose classes are allow-listed:
    a patched one needs only DeferredForwardCall beside them (a rule was pickled as an instance of a
    class of this package's, which needed allow-listing too)."""
    from twobp_autograd.patching import DeferredForwardCall

    model, reference = patched_and_reference(nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3)))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    with torch.serialization.safe_globals([nn.Sequential, nn.Linear, nn.LayerNorm, DeferredForwardCall]):
        loaded = torch.load(buffer)
    assert loaded[0].forward.deferred is model[0].forward.deferred
    x = torch.randn(2, 4)
    loaded(x).pow(2).sum().backward()
    assert_no_grads(loaded)
    twobp.flush_weight_grads()
    reference(x).pow(2).sum().backward()
    assert_grads_match(loaded, reference)


def test_a_model_saved_with_a_rule_name_of_the_earlier_class_loads(monkeypatch):
    """Earlier versions pickled a rule's name as a ``_RuleByName``: such a model loads, with
    weights_only=True too once that class is allow-listed (an alias of ``tuple`` in its place
    allow-listed ``tuple``, not the name the pickle holds)."""
    from twobp_autograd.patching import DeferredForwardCall, _RuleByName

    model = twobp.patch(nn.Sequential(nn.Linear(4, 3)))
    own_state = DeferredForwardCall.__getstate__

    def earlier_state(call: DeferredForwardCall) -> dict:
        state = own_state(call)
        return {**state, "deferred": _RuleByName(state["deferred"])}

    monkeypatch.setattr(DeferredForwardCall, "__getstate__", earlier_state)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    monkeypatch.undo()
    for weights_only in (False, True):
        buffer.seek(0)
        with torch.serialization.safe_globals([nn.Sequential, nn.Linear, DeferredForwardCall, _RuleByName]):
            loaded = torch.load(buffer, weights_only=weights_only)
        assert loaded[0].forward.deferred is model[0].forward.deferred


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "eval", "frozen"])
def test_paths_without_weight_gradients_queue_nothing(mode):
    patched, reference = patched_and_reference(mlp())
    x = torch.randn(3, 4, requires_grad=True)
    if mode == "no_grad":
        with torch.no_grad():
            out = patched(x)
        assert not out.requires_grad
    elif mode == "inference_mode":
        with torch.inference_mode():
            out = patched(x)
        assert out.is_inference()
    else:
        for model in (patched, reference):
            if mode == "eval":
                model.eval()
            else:
                model.requires_grad_(False)
        out = patched(x)
        assert out.grad_fn is not None and "WeightGradTap" not in type(out.grad_fn).__name__
        out.sum().backward()
        reference(x.detach().requires_grad_()).sum().backward()
        assert_grads_match(patched, reference)  # eval: computed at once; frozen: none at all
    assert twobp.pending().jobs == 0


def test_register_a_user_type_with_the_recompute_rule():
    class Scale(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(n))
            self.shift = nn.Parameter(torch.randn(n))

        def forward(self, x):
            return x * self.weight + self.shift.tanh()

    twobp.register(Scale, recompute)
    model = nn.Sequential(nn.Linear(3, 4), Scale(4), nn.Linear(4, 1))
    patched, reference = patched_and_reference(model)
    for batch in (2, 5):
        x = torch.randn(batch, 3)
        patched(x).pow(2).sum().backward()
        reference(x).pow(2).sum().backward()
    assert_no_grads(patched)
    assert twobp.pending().jobs == 6
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


def test_unsupported_option_warns_once_and_stays_plain():
    class Gate(nn.Linear):
        pass

    twobp.register(Gate, recompute, unsupported=lambda m: "out_features > 2" if m.out_features > 2 else None)
    model = nn.Sequential(Gate(2, 3), Gate(3, 4), Gate(4, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = twobp.patch(model, report=True)
    assert len([w for w in caught if "out_features > 2" in str(w.message)]) == 1
    assert report.patched == ["2"] and set(report.skipped) == {"0", "1"}


def test_register_rejects_what_is_not_a_module_type():
    with pytest.raises(TypeError, match="nn.Module subclass"):
        twobp.register(int)
    with pytest.raises(TypeError, match="callable"):
        twobp.register(nn.Linear, "not a function")
    with pytest.raises(TypeError, match="nn.Module"):
        twobp.patch(object())


def test_register_takes_a_tuple_of_types_and_scopes_and_unregisters():
    from twobp_autograd.ops import recompute
    from twobp_autograd.registry import rule_for, rules_restored_after, unregister

    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.weight

    class Shift(Scale):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.weight

    with rules_restored_after():
        twobp.register((Scale, Shift), recompute)
        assert rule_for(Scale()) is not None and rule_for(Shift()) is not None
        unregister(Shift)
        assert rule_for(Shift()) is None and rule_for(Scale()) is not None
    assert rule_for(Scale()) is None, "the registration outlived its block"
    assert rule_for(nn.Linear(2, 2)) is not None, "a built-in rule was lost"
    with pytest.raises(TypeError, match="tuple of them"):
        twobp.register((Scale, int), recompute)


def test_torch_func_transforms_take_the_plain_path():
    """torch.func differentiates on its own (no autograd graph to split): a patched model
    gives torch.func's own per-sample gradients and queues nothing."""
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 2))
    patched, reference = patched_and_reference(model)
    x = torch.randn(5, 4)

    def per_sample_grads(net: nn.Module) -> dict[str, torch.Tensor]:
        params = {name: p.detach() for name, p in net.named_parameters()}

        def loss(p: dict[str, torch.Tensor], sample: torch.Tensor) -> torch.Tensor:
            return torch.func.functional_call(net, p, (sample.unsqueeze(0),)).pow(2).sum()

        return torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)

    got, expected = per_sample_grads(patched), per_sample_grads(reference)
    assert twobp.pending().jobs == 0
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], msg=name)


def test_the_package_exports_exactly_its_public_api() -> None:
    """README's API table: the functions, the queue, and the types public calls return."""
    expected = {
        "patch", "unpatch", "flush_weight_grads", "discard_weight_grads", "pending", "has_queued_work", "register",
        "WeightGradQueue", "use_queue", "PatchReport", "PendingWork",
    }  # fmt: skip
    assert set(twobp.__all__) == expected
    assert all(hasattr(twobp, name) for name in expected)
    assert isinstance(twobp.patch(nn.Linear(2, 2), report=True), twobp.PatchReport)
    assert isinstance(twobp.pending(), twobp.PendingWork)


def _doubling_wrapper(module: nn.Module) -> None:
    """A wrapper on the instance, as accelerate's hooks or a user's monkey-patch install."""
    inner = module.forward
    module.forward = lambda x: inner(x) * 2


def test_a_module_with_its_own_instance_forward_keeps_plain_autograd(fresh_warnings):
    """The deferred forward computes what the class's forward does: a wrapper installed on the
    instance before patch() would be bypassed in training (other outputs and gradients, silently).
    Such a module is left unpatched, with one warning; the rest of the model still defers."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    reference = copy.deepcopy(model)
    _doubling_wrapper(model[0])
    _doubling_wrapper(reference[0])
    with pytest.warns(UserWarning, match="twobp: Linear with an instance-level forward of its own"):
        report = twobp.patch(model, report=True)
    assert report.patched == ["2"] and "instance-level forward" in report.skipped["0"]
    x = torch.randn(3, 4)
    for m in (model, reference):
        m(x).pow(2).sum().backward()
    assert twobp.pending().jobs == 1
    twobp.flush_weight_grads()
    assert_grads_match(model, reference)


def _scaled_by(scale: torch.Tensor, kind: type) -> type[nn.Module]:
    """A class whose forward takes no module (a staticmethod or classmethod): it reaches its
    parameter through a closure."""

    def forward(*args: torch.Tensor) -> torch.Tensor:
        return torch.tanh(args[-1]) * scale

    return type("Scaled", (nn.Module,), {"forward": kind(forward)})


@pytest.mark.parametrize("kind", [staticmethod, classmethod])
def test_a_module_whose_forward_is_a_staticmethod_keeps_plain_autograd(kind, fresh_warnings):
    """Plain PyTorch calls ``self.forward(x)``; patched, every call (deferred, eval or no_grad)
    crashed calling ``type(m).forward(m, x)``. Such a module is left unpatched, with one warning."""
    scale = nn.Parameter(torch.tensor(2.0, dtype=torch.float64))
    reference_scale = nn.Parameter(scale.detach().clone())
    scaled = _scaled_by(scale, kind)
    twobp.register(scaled, recompute)
    model = nn.Sequential(nn.Linear(4, 4), scaled()).double()
    reference = nn.Sequential(copy.deepcopy(model[0]), _scaled_by(reference_scale, kind)())
    with pytest.warns(UserWarning, match="a forward that is a staticmethod or classmethod"):
        report = twobp.patch(model, report=True)
    assert report.patched == ["0"] and "staticmethod" in report.skipped["1"]
    x = torch.randn(3, 4, dtype=torch.float64)
    for m in (model, reference):
        m(x).pow(2).sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(model, reference, torch.float64)
    torch.testing.assert_close(scale.grad, reference_scale.grad, rtol=1e-12, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), reference.eval()(x), rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:twobp")
@pytest.mark.parametrize("kind", [staticmethod, classmethod])
def test_a_class_forward_made_a_staticmethod_after_patch_runs_as_plain_calls_it(kind):
    """The patched call's plain paths (the class's forward replaced since patch; eval, no_grad)
    passed the module to it as a first argument: a TypeError where plain runs."""
    scale = nn.Parameter(torch.tensor(2.0))

    class Doubled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return x * self.weight

    twobp.register(Doubled, recompute)
    model = twobp.patch(Doubled())
    forward = (lambda x: x * scale) if kind is staticmethod else (lambda cls, x: x * scale)
    Doubled.forward = kind(forward)  # type: ignore[assignment,method-assign]
    x = torch.randn(3)
    model(x).sum().backward()
    assert scale.grad == x.sum() and model.weight.grad is None
    with torch.no_grad():
        assert torch.equal(model(x), x * scale) and torch.equal(model.eval()(x), x * scale)


class _SavedLinear(nn.Linear):
    pass


def test_a_model_patched_with_a_rule_pickle_cannot_name_saves_and_loads(fresh_warnings):
    """A rule defined inside a function (or a lambda) made torch.save of the patched model fail
    (the rule was pickled by name). The loaded copy takes the rule registered for its class, or
    without one keeps plain autograd, with a warning."""

    def rule(module, x):
        return twobp.ops.linear.linear(module, x)

    twobp.register(_SavedLinear, rule)
    model = twobp.patch(nn.Sequential(_SavedLinear(3, 2)).double())
    buffer = io.BytesIO()
    torch.save(model, buffer)
    x = torch.randn(4, 3, dtype=torch.float64)
    for registered in (True, False):
        if not registered:
            twobp_autograd.registry.unregister(_SavedLinear)
        buffer.seek(0)
        with pytest.warns(UserWarning, match="rule pickle cannot name.*keeps plain autograd") if not registered else (
            contextlib.nullcontext()
        ):
            loaded = torch.load(buffer, weights_only=False)
        loaded(x).pow(3).sum().backward()
        assert twobp.pending().jobs == (1 if registered else 0)
        twobp.flush_weight_grads()
        reference = twobp.unpatch(copy.deepcopy(model))
        reference(x).pow(3).sum().backward()
        assert_grads_match(loaded, reference, torch.float64)


def test_a_wrapper_added_after_patch_runs_around_the_deferred_forward_and_unpatch_reaches_it():
    """Wrapping a patched module's forward (accelerate's add_hook_to_module does it) keeps both:
    the wrapper runs, the weight work is deferred, the module still counts as patched; unpatch
    then turns the deferred forward the wrapper calls into the plain one."""
    model = twobp.patch(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)))
    reference = copy.deepcopy(twobp.unpatch(copy.deepcopy(model)))
    _doubling_wrapper(model[0])
    _doubling_wrapper(reference[0])
    assert twobp.patch(model, report=True).patched == ["0", "2"]  # patched before, wrapper or not
    x = torch.randn(3, 4)
    for m in (model, reference):
        m(x).pow(2).sum().backward()
    assert twobp.pending().jobs == 2
    twobp.flush_weight_grads()
    assert_grads_match(model, reference)
    twobp.unpatch(model)
    model(x).pow(2).sum().backward()
    assert twobp.pending().jobs == 0 and model[0].weight.grad is not None


def _forward_through(module: nn.Module, *args: torch.Tensor) -> torch.Tensor:
    return module._old_forward(*args)


def test_a_model_with_a_picklable_wrapper_added_after_patch_saves_and_loads(tmp_path):
    """functools.update_wrapper (accelerate's add_hook_to_module uses it) copies the wrapped
    forward's __dict__ into the wrapper: it copied the patched call's weak reference to its
    module, and torch.save failed ("cannot pickle 'weakref.ReferenceType'") where plain saves."""
    model = twobp.patch(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)))
    reference = twobp.unpatch(copy.deepcopy(model))
    model[0]._old_forward = model[0].forward
    model[0].forward = functools.update_wrapper(functools.partial(_forward_through, model[0]), model[0]._old_forward)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    x = torch.randn(3, 4)
    for m in (loaded, reference):
        m(x).pow(2).sum().backward()
    assert twobp.pending().jobs == 2
    twobp.flush_weight_grads()
    assert_grads_match(loaded, reference)


@pytest.fixture
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """patch() warns once per process and reason: each test starts from none given."""
    monkeypatch.setattr(warn_once, "given", set())


LAST_OPS = {  # a patched module as a parent's last op, one per kind of patched node
    "linear": (lambda: nn.Linear(4, 3), (5, 4)),
    "conv1d": (lambda: nn.Conv1d(4, 3, 1), (5, 2, 4)),
    "layer-norm": (lambda: nn.LayerNorm(4), (5, 4)),
    "batch-norm": (lambda: nn.BatchNorm1d(4), (5, 4)),
    "rms-norm": (lambda: nn.RMSNorm(4), (5, 4)),
}


class Transposed(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)


@pytest.mark.parametrize("hooked", ["parent-non-full-hook", "output-grad-fn-post-hook"])
@pytest.mark.parametrize("last", list(LAST_OPS))
def test_a_hook_on_a_patched_outputs_node_sees_its_weight_gradients(last, hooked, fresh_warnings):
    """A post-hook on the node that makes a patched module's output (registered by hand, or by a
    deprecated non-full backward hook on a parent whose last op it is) gets that node's gradients,
    plain's weight gradients among them, and may change them: deferred, the weights missed the
    change (1.8 off, silently). That node's parameters take their gradient now."""
    make, shape = LAST_OPS[last]
    first = nn.Linear(4, 4) if len(shape) == 2 else nn.Sequential(nn.Linear(4, 4), Transposed())
    patched, reference = patched_and_reference(nn.Sequential(first, make()))

    def triple(*args: tuple) -> tuple:  # (module,) grad_input, grad_output
        return tuple(None if g is None else g * 3 for g in args[-2])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # PyTorch's deprecation of non-full hooks
        if hooked == "parent-non-full-hook":
            for m in (patched, reference):
                m.register_backward_hook(triple)
        with pytest.warns(UserWarning, match="twobp: a hook registered on the autograd node"):
            for _ in range(2):
                x = torch.randn(shape)
                for m in (patched, reference):
                    out = m(x)
                    if hooked == "output-grad-fn-post-hook":
                        out.grad_fn.register_hook(triple)
                    out.pow(3).sum().backward()
    assert twobp.pending().jobs == 2, "the first Linear still defers"
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


def test_a_bias_free_linear_on_sequences_ends_in_plains_own_node(fresh_warnings):
    """Without a bias, aten::linear on a >2-D input ends in matmul's _unsafe_view, and so must the
    patched one: a non-full hook on a parent (or a post-hook on the output's node) sees that
    node's one gradient, whatever it does with it (here: scales it, the input's gradient and,
    through it, the weight's). Ending in the patched node instead, the hook saw (input, weight)
    gradients and scaled only the first: the weight's gradient came out half of plain's."""
    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(8, 6, bias=False)))

    def double_first(module: nn.Module, grad_input: tuple, grad_output: tuple) -> tuple:
        return (grad_input[0] * 2, *grad_input[1:])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # PyTorch's deprecation of non-full hooks
        for m in (patched, reference):
            m.register_backward_hook(double_first)
        x = torch.randn(2, 3, 8)
        outputs = [m(x) for m in (patched, reference)]
    assert type(outputs[0].grad_fn) is type(outputs[1].grad_fn)
    for out in outputs:
        out.pow(3).sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


@pytest.mark.parametrize("where", ["module", "global"])
def test_a_deprecated_non_full_backward_hook_keeps_plain_autograd(where, fresh_warnings):
    """register_backward_hook (non-full) sees the gradients of the module's last autograd node,
    a Linear's weight gradients among them, and may change them: deferred, the hook would see
    other gradients and the weights would miss its change. Such modules run plain autograd."""
    patched, reference = patched_and_reference(nn.Sequential(nn.Linear(4, 3), nn.Tanh()))

    def triple(module: nn.Module, grad_input: tuple, grad_output: tuple) -> tuple:
        return tuple(None if g is None else g * 3 for g in grad_input)

    handles = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # PyTorch's deprecation of non-full hooks
        if where == "module":
            handles = [m[0].register_backward_hook(triple) for m in (patched, reference)]
        else:
            handles = [torch.nn.modules.module.register_module_backward_hook(triple)]
        try:
            with pytest.warns(UserWarning, match="twobp: Linear with a non-full backward hook"):
                for _ in range(2):
                    x = torch.randn(5, 4)
                    for m in (patched, reference):
                        m(x).pow(3).sum().backward()
        finally:
            for handle in handles:
                handle.remove()
    assert twobp.pending().jobs == 0
    assert_grads_match(patched, reference)


class _ClampedLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).clamp(-0.1, 0.1)


@pytest.mark.parametrize("change", ["class-swapped", "class-forward-replaced"])
def test_a_module_whose_class_changed_since_patch_runs_its_new_forward(change, monkeypatch, fresh_warnings):
    """The rule was chosen for the class's forward: a class swapped to a subclass with its own
    forward, or the class's forward replaced, ran the old rule in training (the clamp ignored,
    outputs 1.0 off) while no_grad ran the new forward. Plain autograd now, with one warning;
    patch() again chooses by the new class."""
    model = nn.Sequential(nn.Linear(4, 3))
    reference = copy.deepcopy(model)
    twobp.patch(model)
    if change == "class-swapped":
        for m in (model, reference):
            m[0].__class__ = _ClampedLinear
    else:
        plain_forward = nn.Linear.forward
        monkeypatch.setattr(nn.Linear, "forward", lambda self, x: plain_forward(self, x).clamp(-0.1, 0.1))
    x = torch.randn(5, 4) * 10
    with pytest.warns(UserWarning, match="class or its forward changed since patch"):
        out = model(x)
    torch.testing.assert_close(out, reference(x))
    out.sum().backward()
    reference(x).sum().backward()
    assert twobp.pending().jobs == 0
    assert_grads_match(model, reference)
    report = twobp.patch(model, report=True)  # chosen again: no rule stands for the new forward
    assert report.patched == []
    assert "is not registered" in report.skipped["0"] or "class forward replaced" in report.skipped["0"]


@pytest.mark.parametrize("copied_by", ["deepcopy", "torch-save"])
def test_a_copy_made_after_the_class_forward_changed_runs_it_too(copied_by, monkeypatch, tmp_path, fresh_warnings):
    """A copy (deepcopy, torch.save/load) of a patched model whose class's forward was replaced
    since kept the old rule, silently (outputs 1.4 off)."""
    model = twobp.patch(nn.Sequential(nn.Linear(4, 3)))
    plain_forward = nn.Linear.forward
    monkeypatch.setattr(nn.Linear, "forward", lambda self, x: 2 * plain_forward(self, x))
    if copied_by == "deepcopy":
        copied = copy.deepcopy(model)
    else:
        torch.save(model, tmp_path / "model.pt")
        copied = torch.load(tmp_path / "model.pt", weights_only=False)
    x = torch.randn(5, 4)
    with pytest.warns(UserWarning, match="class or its forward changed since patch"):
        out = copied(x)
    torch.testing.assert_close(out, 2 * plain_forward(copied[0], x))
    out.sum().backward()
    assert twobp.pending().jobs == 0
    assert twobp.patch(copied, report=True).patched == []


def _clone(module: nn.Module) -> nn.Module:
    """learn2learn's clone_module: a new instance sharing a copy of the module's __dict__, its
    parameters replaced by differentiable copies (non-leaf tensors the inner loop updates)."""
    clone = module.__new__(type(module))
    clone.__dict__ = module.__dict__.copy()
    clone._parameters = {name: p.clone() if p is not None else None for name, p in module._parameters.items()}
    clone._modules = {name: _clone(child) for name, child in module._modules.items()}
    return clone


@pytest.mark.parametrize("copied_by", ["copy.copy", "clone_module"])
def test_a_shallow_copy_computes_with_its_own_parameters(copied_by):
    """A shallow copy shares the patched module's call through its copied __dict__: it computed
    with the original's parameters and training flag (first-order MAML's meta-gradients 0.6
    off, silently)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    reference = copy.deepcopy(model)
    twobp.patch(model)
    x = torch.randn(5, 4, dtype=torch.float64)
    if copied_by == "copy.copy":
        copies = [copy.copy(model[0]), copy.copy(reference[0])]
        for c in copies:
            c._parameters = {"weight": torch.nn.Parameter(torch.zeros(8, 4, dtype=torch.float64)), "bias": None}
        outputs = [c(x) for c in copies]
        assert torch.equal(outputs[0], outputs[1]) and not outputs[0].any()
        copies[0].eval()
        assert model[0].training  # the copy's flag, not the original's
        return
    adapted = []
    for net in (model, reference):  # one inner step of first-order MAML, then the outer backward
        clone = _clone(net)
        inner = clone(x).pow(2).mean()
        grads = torch.autograd.grad(inner, list(clone.parameters()))
        for (name, p), g in zip(list(clone.named_parameters()), grads, strict=True):
            owner, attribute = clone.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
            owner._parameters[attribute] = p - 0.5 * g.detach()
        adapted.append(clone(x).pow(2).mean())
        adapted[-1].backward()
    twobp.flush_weight_grads()
    torch.testing.assert_close(adapted[0], adapted[1], rtol=0, atol=0)
    assert_grads_match(model, reference, torch.float64)


_CLONE_CASES = [
    "original-unpatched",
    "original-forward-wrapped",
    "original-hooked-before-cloning",
    "global-forward-hook",
    "clone-forward-wrapped",
    "clone-traced-by-jit",
]


@pytest.mark.parametrize("then", _CLONE_CASES)
def test_a_clone_is_found_however_it_is_called(then):
    """A clone (learn2learn's clone_module) shares its original's patched call until it is
    called, and computes with its own parameters from its first call: found from the frame of
    ``nn.Module.__call__``'s hooks closure (a hook shared with the original, a global one), past a
    wrapper of its forward (accelerate's hooks), or from ``_slow_forward`` under jit tracing, where
    it computed with the original's parameters (2.2 off, its own .grad None, silently); and looked
    for whatever has become of the original's own references to the call (unpatched, wrapped)."""
    torch.manual_seed(0)
    original = twobp.patch(nn.Linear(3, 2).double())
    if then == "original-hooked-before-cloning":
        original.register_forward_pre_hook(lambda *_: None)
    clone = _leaf_clone(original)
    reference = twobp.unpatch(copy.deepcopy(clone))
    if then == "original-unpatched":
        twobp.unpatch(original)
    elif then == "original-forward-wrapped":
        wrapped = original.forward
        original.forward = lambda *args: wrapped(*args)  # as accelerate's hooks wrap it
    elif then == "clone-forward-wrapped":
        for module in (clone, reference):
            inner = module.forward
            module.forward = functools.partial(lambda forward, *args: forward(*args), inner)
    x = torch.randn(4, 3, dtype=torch.float64)
    with contextlib.ExitStack() as stack:
        if then == "global-forward-hook":
            stack.enter_context(_global_forward_hook())
        if then == "clone-traced-by-jit":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the tracer's own warnings, alike for both
                outputs = [torch.jit.trace(m, x)(x) for m in (clone, reference)]
        else:
            outputs = [clone(x), reference(x)]
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)
    for output in outputs:
        output.pow(2).sum().backward()
    twobp.flush_weight_grads()
    assert original.weight.grad is None
    assert_grads_match(clone, reference, torch.float64)


@pytest.mark.parametrize("wrapper", ["accelerate-like", "lambda", "partial"])
def test_a_clone_of_a_module_wrapped_before_cloning_computes_as_plains_does(wrapper):
    """A wrapper made on the original before the copy holds the original's forward, which plain
    binds to the original: the copy computes with the original's parameters there, and did here
    until finding the calling module past wrappers took the copy (4x off, silently); past a
    ``functools.partial``, which leaves no frame, it took the copy still."""

    def wrap(module: nn.Module) -> None:
        inner = module.forward
        if wrapper == "lambda":
            module.forward = lambda *args: inner(*args)
            return
        if wrapper == "partial":
            module.forward = functools.partial(inner)
            return
        module._old_forward = inner  # accelerate's add_hook_to_module, without its hook object

        def new_forward(module, *args):
            return module._old_forward(*args)

        module.forward = functools.update_wrapper(functools.partial(new_forward, module), inner)

    torch.manual_seed(0)
    original = nn.Linear(3, 2).double()
    plain = copy.deepcopy(original)
    twobp.patch(original)
    x = torch.randn(4, 3, dtype=torch.float64)
    outputs = []
    for model in (original, plain):
        wrap(model)
        clone = model.__new__(nn.Linear)
        clone.__dict__ = model.__dict__.copy()
        clone._parameters = {name: p * 2.0 for name, p in model._parameters.items()}  # adapted, differentiable
        outputs.append(clone(x))
        outputs[-1].pow(2).sum().backward()
    twobp.flush_weight_grads()
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)
    assert_grads_match(original, plain, torch.float64)


def test_a_patched_call_looks_for_its_caller_only_while_a_shallow_copy_shares_it(monkeypatch):
    """The look for a copy's frame runs only where a copied __dict__ shares the call, or a copy
    that has a call of its own keeps a wrapper of this one as its forward; holding the forward
    (a wrapper, a hook, a debugger's view) costs no look."""
    looked = []
    look = twobp_autograd.patching._called_module
    monkeypatch.setattr(twobp_autograd.patching, "_called_module", lambda caller: looked.append(1) or look(caller))
    layer = twobp.patch(nn.Linear(3, 2))
    x = torch.randn(4, 3)
    held = layer.forward
    layer(x)
    assert not looked
    clone = _clone(layer)
    layer(x)
    assert looked, "a copied __dict__ makes the call look"
    clone(x)  # adopts a call of its own: the original's no longer shared
    looked.clear()
    layer(x)
    assert not looked
    wrapped = _clone(layer)
    wrapped.forward = functools.partial(wrapped.forward)  # around the call it shares
    wrapped(x)  # adopts a call of its own, and keeps the wrapper, which calls the original's
    looked.clear()
    layer(x)
    assert looked
    del held


def _hand_made_copy(model: nn.Module, wrap: Callable[[Any], Any]) -> nn.Module:
    """learn2learn's clone_module, its parameters doubled, and its forward then wrapped."""
    clone = model.__new__(type(model))
    clone.__dict__ = model.__dict__.copy()
    clone._parameters = {name: nn.Parameter(p.detach() * 2) for name, p in model._parameters.items()}
    clone.forward = wrap(clone.forward)
    return clone


@pytest.mark.parametrize("wrapper", ["function", "partial"])
def test_a_hand_made_copy_with_a_wrapped_forward_computes_with_its_own_parameters_every_call(wrapper):
    """A copy whose forward a wrapper replaces after the copy: plain's wrapper holds the copy's
    bound forward; here it holds the original's call, so each call must find the copy. From its
    second call on the original computed it (the copy had a call of its own by then, which the
    wrapper does not call: 20.7 off, silently); a ``functools.partial`` (no frame of its own)
    balanced the reference count the look was gated on (every call off)."""
    wrap = (lambda forward: lambda *args: forward(*args)) if wrapper == "function" else functools.partial
    torch.manual_seed(0)
    original = nn.Linear(4, 3).double()
    plain = copy.deepcopy(original)
    twobp.patch(original)
    x = torch.randn(5, 4, dtype=torch.float64)
    clones = [_hand_made_copy(original, wrap), _hand_made_copy(plain, wrap)]
    for model, clone in zip((original, plain), clones, strict=True):
        for _ in range(3):
            (model(x).sum() + clone(x).pow(2).sum()).backward()
    twobp.flush_weight_grads()
    assert_grads_match(original, plain, torch.float64)
    assert_grads_match(clones[0], clones[1], torch.float64)


@pytest.mark.parametrize("then", ["forward-called-directly", "copied-again", "copied-again-by-hand", "unpatched"])
def test_a_wrapped_hand_made_copy_that_cannot_be_told_from_its_original_is_refused(then):
    """The wrapper holds the original's call; only a call of the copy (its ``__call__`` frame)
    tells which module computes. Its forward called directly, a copy of it (whose forward is that
    wrapper, bound to the first copy in plain) or the copy unpatched computed with the original's
    parameters or the wrong copy's (20.7 off, silently)."""
    original = twobp.patch(nn.Linear(4, 3).double())
    clone = _hand_made_copy(original, functools.partial)
    x = torch.randn(5, 4, dtype=torch.float64)
    clone(x)  # found, and given a call of its own: its wrapper still calls the original's
    if then == "forward-called-directly":
        call = clone.forward
    elif then == "copied-again":
        call = copy.copy(clone)
    elif then == "copied-again-by-hand":
        call = _hand_made_copy(clone, lambda forward: forward)
    else:
        twobp.unpatch(clone)
        call = clone
    with pytest.raises(RuntimeError, match="no call of that copy to tell them apart"):
        call(x)


def test_a_deep_copy_of_an_original_and_its_wrapped_copy_trains_like_plain():
    """An EMA or a checkpoint of a container holding both: the copied copy's call lost the link
    to the shared call its wrapper calls, and the copied original computed for it (20.7 off, its
    .grad None, silently)."""
    torch.manual_seed(0)
    pair = nn.ModuleList([nn.Linear(4, 3).double()])
    plain = copy.deepcopy(pair)
    twobp.patch(pair)
    x = torch.randn(5, 4, dtype=torch.float64)
    for model in (pair, plain):
        model.append(_hand_made_copy(model[0], functools.partial))
        model[1](x)
    copied, plain_copied = copy.deepcopy(pair), copy.deepcopy(plain)
    for model in (copied, plain_copied):
        (model[0](x).sum() + model[1](x).pow(2).sum()).backward()
    twobp.flush_weight_grads()
    assert_grads_match(copied, plain_copied, torch.float64)


@pytest.mark.parametrize("how", ["copy.copy", "replica"])
def test_a_checkpoint_of_an_original_wrapped_before_it_was_copied_is_not_refused(how):
    """A wrapper made on the original before its copies (accelerate's hooks, then a replica) is
    bound to the original, in plain and here: the copies took it for one of their own and every
    checkpoint recomputation of the original's forward was refused."""
    torch.manual_seed(0)
    original = nn.Linear(4, 3).double()
    plain = copy.deepcopy(original)
    twobp.patch(original)
    inner = original.forward
    original.forward = functools.partial(lambda forward, *args: forward(*args), inner)
    replica = copy.copy(original) if how == "copy.copy" else original._replicate_for_data_parallel()
    replica(torch.randn(2, 4, dtype=torch.float64))
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    for model in (original, plain):
        torch.utils.checkpoint.checkpoint(model.forward, x, use_reentrant=False).sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(original, plain, torch.float64)
    del replica


@pytest.mark.parametrize("kept", ["the-wrapper", "a-copy-of-the-copy"])
def test_a_wrapped_copys_wrapper_outliving_the_copy_is_refused(kept):
    """The wrapper keeps the copy alive in plain, which computes; here it keeps the original's
    call, and tracking the copies themselves let the original compute once they were freed (its
    .grad given where plain leaves None, silently)."""
    original = twobp.patch(nn.Linear(4, 3).double())
    clone = _hand_made_copy(original, functools.partial)
    x = torch.randn(5, 4, dtype=torch.float64)
    clone(x)
    call = clone.forward if kept == "the-wrapper" else _hand_made_copy(clone, lambda forward: forward)
    del clone
    gc.collect()
    with pytest.raises(RuntimeError, match="no call of that copy to tell them apart"):
        call(x)


@pytest.mark.parametrize("how", ["copy.copy", "by-hand-then-patch", "by-hand"])
def test_a_copy_taking_its_originals_wrapper_refuses_once_the_original_is_freed(how):
    """The wrapper made on the original before the copy keeps the original alive in plain, which
    computes; here the original was freed (its call holds it weakly) and the copy computed (2x
    the output, its .grad given where plain leaves None, silently). A hand copy never called
    cannot tell its wrapper's origin: refused as well."""
    original = twobp.patch(nn.Linear(4, 3).double())
    original.forward = functools.partial(original.forward)
    if how == "copy.copy":
        clone = copy.copy(original)
    else:
        clone = _hand_made_copy(original, lambda forward: forward)
        if how == "by-hand-then-patch":
            twobp.patch(clone)
    del original
    gc.collect()
    with pytest.raises(RuntimeError, match="of a module since freed" if how == "by-hand" else "the original was freed"):
        clone(torch.randn(5, 4, dtype=torch.float64))


@pytest.mark.parametrize("then", ["original-freed", "original-wrapped-again"])
def test_a_copy_made_by_copy_copy_of_a_hand_copy_holding_an_older_wrapper_is_refused(then):
    """``copy.copy`` of a hand copy whose forward is the original's earlier wrapper, once the
    original was freed or wrapped again: the wrapper is bound to the original in plain, but the
    copy took it for its own and computed (6x the output, silently)."""
    original = twobp.patch(nn.Linear(4, 3).double())
    original.forward = functools.partial(original.forward)
    hand = _hand_made_copy(original, lambda forward: forward)
    if then == "original-freed":
        del original
        gc.collect()
    else:
        original.forward = functools.partial(original.forward)
    clone = copy.copy(hand)
    with pytest.raises(RuntimeError, match="no call of that copy to tell them apart"):
        clone(torch.randn(5, 4, dtype=torch.float64))


def test_a_copy_of_an_uncalled_wrapped_copy_computes_as_plain_or_is_refused():
    """A wrapper made on a copy never called, then that copy copied: plain's wrapper computes the
    first copy; the second took it for its own and computed (3x against 2x, silently)."""
    original = twobp.patch(nn.Linear(4, 3).double())
    clone = _hand_made_copy(original, functools.partial)
    second = _hand_made_copy(clone, lambda forward: forward)
    with pytest.raises(RuntimeError, match="no call of that copy to tell them apart"):
        second(torch.randn(5, 4, dtype=torch.float64))
    del clone


def test_unpatching_a_copy_that_shares_the_originals_wrapper_computes_the_original():
    """The copy's forward is the wrapper made on the original (bound to it in plain): unpatching
    the copy took it for one made on the copy, and the original's calls were refused."""
    torch.manual_seed(0)
    original = nn.Linear(4, 3).double()
    plain = copy.deepcopy(original)
    twobp.patch(original)
    x = torch.randn(5, 4, dtype=torch.float64)
    for model in (original, plain):
        model.forward = functools.partial(model.forward)
        clone = _hand_made_copy(model, lambda forward: forward)
        if model is original:
            twobp.unpatch(clone)
        clone(x).sum().backward()
    twobp.flush_weight_grads()
    assert_grads_match(original, plain, torch.float64)


def test_pickling_a_copy_leaves_its_original_out():
    """A copy's call kept the call it was adopted from in its pickle, and that call its module:
    torch.save of a copy wrote the original's parameters too (twice the bytes)."""
    original = twobp.patch(nn.Linear(64, 64))
    clone = copy.copy(original)
    clone._parameters = {name: nn.Parameter(p.detach().clone()) for name, p in original._parameters.items()}
    plain = copy.copy(twobp.unpatch(copy.deepcopy(original)))
    assert len(pickle.dumps(clone)) < 1.2 * len(pickle.dumps(plain))


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_hand_made_copy_with_its_forward_checkpointed_is_refused_at_the_recomputation(use_reentrant):
    """The checkpoint's four frames were past the look's reach (the forward computed the
    original's), and its recomputation runs inside backward, under no module call at all: the
    reentrant one recomputed the original's (the copy's gradients None, silently). The forward
    now finds the copy; the recomputation, which cannot, is refused; twobp.patch(copy) before
    wrapping, as the message says, trains like plain."""
    torch.manual_seed(0)
    original = nn.Linear(4, 3).double()
    plain = copy.deepcopy(original)
    twobp.patch(original)
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)

    def wrap(forward):
        return functools.partial(torch.utils.checkpoint.checkpoint, forward, use_reentrant=use_reentrant)

    clone, plain_clone = _hand_made_copy(original, wrap), _hand_made_copy(plain, wrap)
    out = clone(x)
    torch.testing.assert_close(out, plain_clone(x), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="no call of that copy to tell them apart"):
        out.sum().backward()
    twobp.discard_weight_grads()
    clone = original.__new__(nn.Linear)
    clone.__dict__ = original.__dict__.copy()
    clone._parameters = dict(plain_clone._parameters)
    twobp.patch(clone)
    clone.forward = wrap(clone.forward)
    clone(x).sum().backward()
    twobp.flush_weight_grads()
    plain_clone(x).sum().backward()
    assert_grads_match(clone, plain_clone, torch.float64)


@contextlib.contextmanager
def _global_forward_hook():
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *_: None)
    try:
        yield
    finally:
        handle.remove()


def test_a_patched_call_counts_its_copies_on_this_interpreter():
    """The count that spares a call the look at its caller was measured here."""
    assert twobp_autograd.patching._UNSHARED_COPIES > 1


@pytest.mark.parametrize("under", ["cProfile", "a global module hook keeping the first __dict__ it sees"])
def test_importing_under_a_profiler_or_a_global_hook_counts_nothing_and_trains_clones_right(under):
    """Imported under cProfile (a profiler implemented in C, which sys.setprofile could not put
    back: the import raised TypeError) or with a global hook that keeps each module's __dict__
    (which made an earlier count, the call's own, 2 too high, so a clone's call skipped the look:
    2.2 off, silently): clones compute with their own parameters."""
    script = textwrap.dedent(
        """
        import cProfile, copy, sys, torch
        from torch import nn
        kept = []
        if sys.argv[1] == "cProfile":
            profiler = cProfile.Profile()
            profiler.enable()
        else:
            handle = nn.modules.module.register_module_forward_pre_hook(
                lambda module, args: kept or kept.append(copy.copy(module.__dict__)))  # the first one's
        import twobp_autograd as twobp
        if sys.argv[1] == "cProfile":
            profiler.disable()
        else:
            handle.remove()
        original = twobp.patch(nn.Linear(3, 2).double())
        clone = original.__new__(nn.Linear)
        clone.__dict__ = original.__dict__.copy()
        clone._parameters = {n: nn.Parameter(p.detach() * 2) for n, p in original._parameters.items()}
        x = torch.randn(4, 3, dtype=torch.float64)
        torch.testing.assert_close(clone(x), nn.functional.linear(x, clone.weight, clone.bias), rtol=0, atol=0)
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, "cProfile" if under == "cProfile" else "hook"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_REPOSITORY, os.environ.get("PYTHONPATH")]))},
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


_REPOSITORY = str(Path(__file__).resolve().parents[1])


def test_a_module_given_a_patched_modules_forward_computes_that_module():
    """``X.forward = Y.forward`` with Y patched: plain computes Y (a bound forward), and so does
    the patched call; it took the calling module X's parameters instead."""
    torch.manual_seed(0)
    source, borrower = nn.Linear(3, 2).double(), nn.Linear(3, 2).double()
    reference = copy.deepcopy(source)
    twobp.patch(source)
    borrower.forward = source.forward
    x = torch.randn(4, 3, dtype=torch.float64)
    out = borrower(x)
    torch.testing.assert_close(out, reference(x), rtol=0, atol=0)
    out.sum().backward()
    reference(x).sum().backward()
    twobp.flush_weight_grads()
    assert borrower.weight.grad is None
    assert_grads_match(source, reference, torch.float64)


def test_shallow_copies_get_calls_of_their_own():
    """A copy called once through module(x) has its own call from then on (its forward called
    directly computes with its own parameters); unpatching a copy leaves the original patched;
    a patched module whose forward attribute was deleted is patched again by patch()."""
    torch.manual_seed(0)
    original = twobp.patch(nn.Linear(3, 2).double())
    clone = _clone(original)
    x = torch.randn(4, 3, dtype=torch.float64)
    clone(x)
    torch.testing.assert_close(clone.forward(x), nn.functional.linear(x, clone.weight, clone.bias), rtol=0, atol=0)
    twobp.unpatch(copy.copy(original))
    original(x).sum().backward()
    assert twobp.pending().jobs == 1, "the original still defers"
    twobp.discard_weight_grads()
    del original.forward
    assert twobp.patch(original, report=True).patched == [""]
    original(x).sum().backward()
    assert twobp.pending().jobs == 1
    twobp.discard_weight_grads()


def test_patch_again_with_exclude_reports_modules_it_leaves_patched():
    """patch(model, exclude=[...]) after patch(model): the excluded LayerNorm kept deferring while
    the report listed it nowhere. Patching adds, it does not unpatch: reported and warned."""
    model = twobp.patch(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2)))
    with pytest.warns(UserWarning, match="1: left out by include/exclude but patched by an earlier patch"):
        report = twobp.patch(model, exclude=[nn.LayerNorm], report=True)
    assert report.patched == ["0", "2"] and "twobp.unpatch(module)" in report.skipped["1"]


@pytest.mark.parametrize("how", ["context", "set_default_device"])
def test_a_default_device_keeps_modules_deferred(how):
    """torch.set_default_device / with torch.device(...) push a torch-function mode: every patched
    call took it for a tensor subclass and kept plain autograd (nothing deferred, a warning
    blaming subclasses). Only the factory functions' device changes."""
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.MultiheadAttention(4, 2, batch_first=True))
    patched, reference = patched_and_reference(nn.Sequential(model[0], model[1]))
    attention, attention_reference = patched_and_reference(model[2])
    x = torch.randn(2, 3, 4)
    with contextlib.ExitStack() as stack:
        if how == "context":
            stack.enter_context(torch.device("cpu"))
        else:
            torch.set_default_device("cpu")
            stack.callback(torch.set_default_device, None)
        hidden = patched(x)
        attention(hidden, hidden, hidden, need_weights=False)[0].sum().backward()
        assert twobp.pending().jobs == 4  # the Linear, the LayerNorm, attention's two projections
    twobp.flush_weight_grads()
    hidden = reference(x)
    attention_reference(hidden, hidden, hidden, need_weights=False)[0].sum().backward()
    assert_grads_match(patched, reference)
    assert_grads_match(attention, attention_reference)


class _ScaledConv(nn.Conv2d):
    """Keeps Conv2d's forward, overrides what it calls."""

    def _conv_forward(self, input, weight, bias):
        return 2 * super()._conv_forward(input, weight, bias)


def test_a_class_swapped_to_a_subclass_overriding_what_its_forward_calls_keeps_plain_autograd():
    """``module.__class__ = ScaledConv`` after patch: the forward is Conv2d's, so the swap went
    unseen and the conv rule computed the convolution itself, bypassing ``_conv_forward`` (output
    0.54 off, every gradient off); patch() again kept it. One warning, plain autograd; patch()
    again leaves it unpatched (not registered)."""
    patched, reference = patched_and_reference(nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Conv2d(3, 2, 3)))
    for model in (patched, reference):
        model[0].__class__ = _ScaledConv
    x = torch.randn(2, 2, 8, 8)
    with pytest.warns(UserWarning, match="class or its forward changed since patch"):
        output = patched(x)
    torch.testing.assert_close(output, reference(x))
    output.pow(2).sum().backward()
    twobp.flush_weight_grads()
    reference(x).pow(2).sum().backward()
    assert_grads_match(patched, reference)
    report = twobp.patch(patched, report=True)
    assert "0" not in report.patched and "not registered" in report.skipped["0"]


def test_a_dropped_patched_model_is_freed_without_the_cyclic_collector():
    """Module and patched forward referred to each other: a dropped model's parameters and
    .grad (on a GPU, its memory) lived until a full collection, not until its last reference."""
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        model = twobp.patch(nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3)))
        model(torch.randn(2, 3)).sum().backward()
        twobp.flush_weight_grads()
        weight, grad = weakref.ref(model[0].weight), weakref.ref(model[0].weight.grad)
        del model
        assert weight() is None and grad() is None
    finally:
        if gc_was_enabled:
            gc.enable()


def test_a_forward_kept_without_its_module_says_so():
    forward = twobp.patch(nn.Linear(3, 3)).forward
    gc.collect()
    with pytest.raises(RuntimeError, match="twobp: this patched forward's module was garbage collected"):
        forward(torch.randn(2, 3))


def _leaf_clone(module: nn.Module) -> nn.Module:
    """_clone with new leaf parameters (a clone trained on its own)."""
    clone = module.__new__(type(module))
    clone.__dict__ = module.__dict__.copy()
    clone._parameters = {n: nn.Parameter(p.detach().clone()) for n, p in module._parameters.items() if p is not None}
    clone._modules = {name: _leaf_clone(child) for name, child in module._modules.items()}
    return clone


@pytest.mark.parametrize("then", ["called", "deep-copied", "saved-and-loaded"])
def test_a_shallow_clone_whose_original_is_gone_trains_as_plain(then):
    """A function patching a model and returning a clone of it: before its first call the clone
    shares the original's patched forward, which holds the original weakly. Once that was freed
    the clone's call raised "module was garbage collected", and a deep copy or a save of such a
    clone failed on a call not yet unpickled."""

    def make() -> nn.Module:
        return _leaf_clone(twobp.patch(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))))

    clone = make()
    gc.collect()
    if then == "deep-copied":
        clone = copy.deepcopy(clone)
    elif then == "saved-and-loaded":
        buffer = io.BytesIO()
        torch.save(clone, buffer)
        buffer.seek(0)
        clone = torch.load(buffer, weights_only=False)
    reference = twobp.unpatch(copy.deepcopy(clone))
    x = torch.randn(5, 4)
    clone(x).square().sum().backward()
    assert twobp.pending().jobs > 0, "the clone defers"
    twobp.flush_weight_grads()
    reference(x).square().sum().backward()
    assert_grads_match(clone, reference)


def test_a_data_parallel_replica_called_through_its_forward_computes_with_its_own_parameters():
    """nn.DataParallel's replicas copy the module's __dict__, sharing its patched forward until a
    call through __call__ adopts it: a replica's forward called directly sent its weight
    gradients to the original's parameters (the replica's stayed None), silently."""
    original = twobp.patch(nn.Linear(3, 2))
    replica = original._replicate_for_data_parallel()
    replica._parameters = {name: nn.Parameter(p.detach().clone() * 2) for name, p in original._parameters.items()}
    reference = twobp.unpatch(copy.deepcopy(replica))
    x = torch.randn(4, 3)
    replica.forward(x).sum().backward()
    twobp.flush_weight_grads()
    reference(x).sum().backward()
    assert original.weight.grad is None
    assert_grads_match(replica, reference)


class _OwnGetattr(nn.Linear):
    """Scales its weight on reads once ``scaled`` (not before: initialisation writes through reads)."""

    def __getattr__(self, name: str) -> object:
        value = super().__getattr__(name)
        return value * 3 if name == "weight" and self.__dict__.get("scaled") else value


def _own_getattr() -> nn.Module:
    module = _OwnGetattr(3, 2)
    module.scaled = True
    return module


def _parametrized() -> nn.Module:
    module = nn.Linear(3, 2)
    torch.nn.utils.parametrize.register_parametrization(module, "weight", nn.Tanh())
    return module


def _pruned() -> nn.Module:
    module = nn.Linear(3, 2)
    torch.nn.utils.prune.l1_unstructured(module, "weight", amount=0.5)
    return module


def _weight_property() -> nn.Module:
    """A class attribute named ``weight`` (a property, as a parametrization's class has): reads get it."""
    module = nn.Linear(3, 2)
    module.__class__ = type(
        "WithProperty", (nn.Linear,), {"weight": property(lambda self: self._parameters["weight"] * 2)}
    )
    return module


def _shadowed() -> nn.Module:
    module = nn.Linear(3, 2)
    object.__setattr__(module, "bias", torch.ones(2))  # beside _parameters' bias, found first
    return module


@pytest.mark.parametrize(
    "build",
    [
        lambda: nn.Linear(3, 2),
        lambda: nn.Linear(3, 2, bias=False),
        _parametrized,
        _pruned,
        _shadowed,
        _weight_property,
        _own_getattr,
    ],
    ids=["plain", "no-bias", "parametrized", "pruned", "bias-in-instance-dict", "class-property", "own-getattr"],
)
def test_weight_and_bias_reads_what_attribute_reads_read(build):
    """The rules' fast read of a module's weight and bias gives what ``module.weight`` and
    ``module.bias`` give, wherever something other than ``_parameters`` answers them."""
    module = build()
    expected = (module.weight, module.bias)
    for read, want in zip(twobp_autograd.registry.weight_and_bias(module), expected, strict=True):
        if isinstance(want, torch.Tensor) and not want.is_leaf:  # rebuilt per read
            torch.testing.assert_close(read, want, rtol=0, atol=0)
        else:
            assert read is want


class _CallableRule:
    def __call__(self, module, x):
        return twobp.ops.linear.linear(module, x)


def _helped(helper, module, x):
    return twobp.ops.linear.linear(module, x)


class _NetWithItsRule(nn.Sequential):
    def rule(self, module, x):
        return twobp.ops.linear.linear(module, x)


def test_a_deepcopy_keeps_a_local_rule_and_a_saved_rule_is_found_by_name():
    """deepcopy kept a local rule before it was left out of pickles: it keeps it, whatever the
    registry holds now; a rule function is saved by name and found leniently; a rule reaching the
    model (a bound method of it) saves and deep-copies."""
    calls = []

    def rule(module, x):
        calls.append(module)
        return twobp.ops.linear.linear(module, x)

    with twobp_autograd.registry.rules_restored_after():
        twobp.register(_SavedLinear, rule)
        model = twobp.patch(nn.Sequential(_SavedLinear(3, 2)).double())
    copied = copy.deepcopy(model)
    copied(torch.randn(4, 3, dtype=torch.float64)).sum().backward()
    assert calls == [copied[0]] and twobp.pending().jobs == 1
    twobp.flush_weight_grads()

    # A rule defined at the top of the saving script (here a module that is gone by the load):
    # pickled by name, the load failed on it, where plain torch.load of the model works.
    script = types.ModuleType("_twobp_saving_script")
    source = "import twobp_autograd\ndef rule(module, x):\n    return twobp_autograd.ops.linear.linear(module, x)"
    exec(source, vars(script))
    sys.modules[script.__name__] = script
    try:
        with twobp_autograd.registry.rules_restored_after():
            twobp.register(_SavedLinear, script.rule)
            buffer = io.BytesIO()
            torch.save(twobp.patch(nn.Sequential(_SavedLinear(3, 2))), buffer)
    finally:
        del sys.modules[script.__name__]
    twobp.register(_SavedLinear, twobp.ops.linear.linear)
    buffer.seek(0)
    torch.load(buffer, weights_only=False)(torch.randn(4, 3)).sum().backward()
    assert twobp.pending().jobs == 1  # the rule registered for the class where it is loaded
    twobp.flush_weight_grads()

    # Rules that are no function and pickle cannot write: found again where loaded.
    class LocalRule:
        def __call__(self, module, x):
            return twobp.ops.linear.linear(module, x)

    class LocalHelper(nn.Module):  # reached by a rule: pickle cannot write it either
        pass

    unpicklables = (
        functools.partial(lambda module, x: twobp.ops.linear.linear(module, x)),
        LocalRule(),
        functools.partial(_helped, LocalHelper()),
    )
    later = _CallableRule()  # saved once as it pickles, then given what pickle cannot write
    later.callback = None  # type: ignore[attr-defined]
    with twobp_autograd.registry.rules_restored_after():
        twobp.register(_SavedLinear, later)
        changed = twobp.patch(nn.Sequential(_SavedLinear(3, 2)))
        torch.save(changed, io.BytesIO())
    later.callback = lambda: None  # type: ignore[attr-defined]
    torch.save(changed, io.BytesIO())  # the rule is probed again, left out, found again where loaded
    for unpicklable in unpicklables:
        with twobp_autograd.registry.rules_restored_after():
            twobp.register(_SavedLinear, unpicklable)
            buffer = io.BytesIO()
            torch.save(twobp.patch(nn.Sequential(_SavedLinear(3, 2))), buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=False)(torch.randn(4, 3)).sum().backward()
        assert twobp.pending().jobs == 1
        twobp.flush_weight_grads()

    net = _NetWithItsRule(*[_SavedLinear(4, 4) for _ in range(4)])
    with twobp_autograd.registry.rules_restored_after():
        twobp.register(_SavedLinear, net.rule)
        twobp.patch(net)
        buffer = io.BytesIO()
        torch.save(net, buffer)
        copy.deepcopy(net)
