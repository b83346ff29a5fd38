"""The FSDP2 internals twobp_autograd.fsdp_hooks relies on, checked one by one, so that a PyTorch
upgrade that moves any of them fails here with its name instead of giving wrong gradients.

The names are checked in this process; how they behave, on a real ``fully_shard`` model in one
spawned gloo rank (a world of one: FSDP2 runs its whole machinery but the collective)."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from tests.ranks import run_scenario
from twobp_autograd import fsdp_hooks


def test_the_private_names_exist() -> None:
    state_module = importlib.import_module(fsdp_hooks._STATE_MODULE)
    common = importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_common")
    group_module = importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_param_group")
    from torch.distributed._composable_state import _module_state_mapping

    assert hasattr(state_module, "FSDPState"), "FSDPState moved"
    assert {"FORWARD", "PRE_BACKWARD", "POST_BACKWARD", "IDLE"} <= set(common.TrainingState.__members__)
    for method in ("post_backward", "use_training_state"):
        assert callable(getattr(group_module.FSDPParamGroup, method, None)), f"FSDPParamGroup.{method} is gone"
    assert hasattr(_module_state_mapping, "values") and len(_module_state_mapping) >= 0  # fsdp_in_use asks its size


def test_a_release_whose_fsdp2_keeps_one_parameter_group_per_state_is_refused_by_name() -> None:
    """torch 2.11's FSDPState has ``_fsdp_param_group`` (one); what this module reads was built
    on the list of later releases: an AttributeError deep in a flush became this."""
    old_state = type("FSDPState", (), {"_fsdp_param_group": None})()
    with pytest.raises(RuntimeError, match=r"twobp: this PyTorch's FSDP2 .* Use torch 2.14 or later"):
        fsdp_hooks._param_groups(old_state)


def _behaviour(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 2))
    original = model[0].weight
    mesh = init_device_mesh("cpu", (1,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    found: dict = {
        "fsdp_in_use": fsdp_hooks.fsdp_in_use(),
        "class_before": fsdp_hooks.class_before_fully_shard(type(model[0])) is nn.Linear,
        "plain_class_kept": fsdp_hooks.class_before_fully_shard(nn.GELU) is nn.GELU,
        "is_fsdp_module": isinstance(model[0], FSDPModule),
        "original_marked": fsdp_hooks.replaced_by_fully_shard(original),
        "fresh_unmarked": not fsdp_hooks.replaced_by_fully_shard(nn.Parameter(torch.zeros(1))),
    }
    groups = fsdp_hooks.groups_of(model)
    found["groups"] = len(groups)
    # The root's group (first in module order) is reduced after the inner one, as FSDP2 does.
    order = fsdp_hooks.reduction_order()
    found["inner_reduced_before_root"] = [order.get(id(g)) for g in groups] == [1, 0]

    seen_in_backward: list[bool] = []
    computed_with: list[torch.Tensor] = []

    def record(module: nn.Module, args: object) -> None:
        computed_with.append(module.weight)  # after FSDP2's unshard: the unsharded parameter

    def watch_backward(module: nn.Module, args: object, output: torch.Tensor) -> None:
        output.register_hook(lambda grad: seen_in_backward.append(fsdp_hooks.in_backward(groups[1])))

    model[0].register_forward_pre_hook(record)
    model[0].register_forward_hook(watch_backward)
    x = torch.randn(3, 4)
    model(x).sum().backward()
    (unsharded,) = computed_with
    found["in_backward_during"] = seen_in_backward == [True]
    found["idle_after"] = not any(fsdp_hooks.in_backward(g) for g in groups)

    sharded = fsdp_hooks.sharded_params_of([unsharded, x])
    entry = sharded.get(id(unsharded))
    found["unsharded_found"] = entry is not None and len(sharded) == 1
    found["sharded_is_registered"] = entry is not None and entry.sharded is model[0].weight
    found["stand_in_found"] = [id(t) for t in fsdp_hooks.unsharded_params_of([model[0].weight])] == [id(unsharded)]
    # The flag FSDP2 reads to reduce a group's unused parameters too, as fsdp_hooks reads it.
    flagged_before = fsdp_hooks.reduces_unused_params([unsharded, x])
    model[0].set_reduce_scatter_unused_params(True, recurse=False)
    found["unused_params_flag_read"] = not flagged_before and fsdp_hooks.reduces_unused_params([unsharded, x])
    model[0].set_reduce_scatter_unused_params(False, recurse=False)

    # A gradient put on the unsharded parameter reaches the sharded .grad through reduce_group.
    before = model[0].weight.grad.to_local().clone()
    unsharded.grad = torch.ones_like(unsharded)
    state_before = groups[1]._training_state
    fsdp_hooks.reduce_group(groups[1])
    fsdp_hooks.wait_for_reductions([groups[1]])
    found["reduced_into_sharded"] = torch.equal(model[0].weight.grad.to_local(), before + 1)
    found["unsharded_grad_taken"] = unsharded.grad is None
    found["state_restored"] = groups[1]._training_state == state_before
    found["buffers_released"] = not groups[1].comm_ctx.reduce_scatter_states
    # A failed flush's leftovers dropped from the unsharded parameters (the next post-backward reads them).
    unsharded.grad = torch.ones_like(unsharded)
    fsdp_hooks.drop_unsharded_grads(groups[1], {id(unsharded)})
    accumulated = groups[1].fsdp_params[0].unsharded_accumulated_grad
    found["unsharded_grads_dropped"] = unsharded.grad is None and accumulated is None
    # What the HSDP partial-reduce check reads of a group and its parameters.
    fsdp_param = groups[1].fsdp_params[0]
    found["partial_reduce_names"] = (
        hasattr(groups[1], "_partial_reduce_output")
        and hasattr(groups[1], "all_reduce_grads")
        and hasattr(groups[1], "reduce_grads")
        and hasattr(fsdp_param, "unsharded_accumulated_grad")
        and fsdp_param._unsharded_param is unsharded
        and fsdp_param.sharded_param is model[0].weight
    )
    return found


@pytest.fixture(scope="module")
def behaviour(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_scenario(_behaviour, 1, str(tmp_path_factory.mktemp("fsdp_hooks")))[0]


@pytest.mark.parametrize(
    "what",
    [
        "fsdp_in_use",
        "class_before",
        "plain_class_kept",
        "is_fsdp_module",
        "original_marked",
        "fresh_unmarked",
        "in_backward_during",
        "idle_after",
        "unsharded_found",
        "sharded_is_registered",
        "stand_in_found",
        "unused_params_flag_read",
        "reduced_into_sharded",
        "unsharded_grad_taken",
        "state_restored",
        "buffers_released",
        "inner_reduced_before_root",
        "partial_reduce_names",
        "unsharded_grads_dropped",
    ],
)
def test_fsdp2_behaves_as_the_hooks_expect(behaviour: dict, what: str) -> None:
    assert behaviour[what], f"FSDP2 changed: fsdp_hooks' assumption {what!r} no longer holds ({behaviour})"


def test_groups_found_per_fully_shard_call(behaviour: dict) -> None:
    assert behaviour["groups"] == 2
