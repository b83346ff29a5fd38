"""What ``twobp_autograd.pipeline`` offers a user, and that every module says what it exports."""

from __future__ import annotations

import importlib

import pytest

import twobp_autograd.pipeline as pipeline


def test_the_readme_names_import_from_the_package() -> None:
    from twobp_autograd.pipeline import (  # noqa: F401
        GradientSync,
        PipelineRuntime,
        TiedGradients,
        agreed_block_costs,
        blocks_of,
        defer_norms,
        dw_builder,
        schedule,
        simulate,
        split_model,
        validate_schedule,
    )

    public = {"schedule", "validate_schedule", "PipelineRuntime", "split_model", "simulate", "dw_builder"}
    public |= {"TiedGradients", "agreed_block_costs", "blocks_of", "defer_norms", "GradientSync"}  # README, Stages
    assert public <= set(pipeline.__all__)


def test_everything_in_all_exists() -> None:
    assert all(hasattr(pipeline, name) for name in pipeline.__all__)


@pytest.mark.parametrize(
    "module", ["actions", "schedules", "simulator", "runtime", "metrics", "memory_probe", "trace", "adapter"]
)
def test_each_module_lists_its_public_names(module: str) -> None:
    loaded = importlib.import_module(f"twobp_autograd.pipeline.{module}")
    assert all(hasattr(loaded, name) for name in loaded.__all__)
    defined_here = {
        name
        for name, value in vars(loaded).items()
        if not name.startswith("_") and getattr(value, "__module__", None) == loaded.__name__ and callable(value)
    }
    missing = sorted(defined_here - set(loaded.__all__))
    assert not missing, f"public but not in __all__: {missing}"
