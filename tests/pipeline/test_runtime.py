"""The runtime against one process: every schedule, 2BP on and off, two gloo ranks (and the
interleaved and V schedules on the model cut into two stages per rank).

Each scenario runs once in two spawned ranks (starting processes is the slow part) and writes
one result per setting; the parametrized tests below read them. A pipelined step must give the
loss, every parameter's gradient and every buffer of the same model run in one process on the
same micro-batches; a rank that dies or disagrees about shapes must end the other rank with an
error in bounded time.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import math
import os
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

from tests.ranks import gloo_rank_main, read_results, run_ranks
from tests.utils import TOLERANCES
from twobp_autograd import WeightGradQueue
from twobp_autograd.pipeline import PipelineError, PipelineRuntime, RankMetrics, StepReport, split_model
from twobp_autograd.pipeline.actions import B, Payload
from twobp_autograd.pipeline.actions import F as Forward
from twobp_autograd.pipeline.posting import posting_order
from twobp_autograd.pipeline.runtime import _METRICS_TAG, _SHAPE_TAG, _split_alike
from twobp_autograd.pipeline.schedules import (
    MULTI_STAGE_SCHEDULES,
    SCHEDULES,
    ScheduleError,
    default_num_micro_batches,
    placement,
    schedule,
)

WORLD = 2
BATCH_SIZES = (8, 8, 6)  # a repeated step shape (cached shapes), then a new one with uneven micro-batches
RUNTIME_TIMEOUT = 20.0
FAILURE_TIMEOUT = 8.0


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(),
        nn.Linear(16, 16), nn.LayerNorm(16), nn.GELU(),
        nn.Linear(16, 4),
    )  # fmt: skip


def conv_bn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3),
    )  # fmt: skip


class _ReentrantCheckpointed(nn.Module):
    """A block under reentrant checkpointing (older Hugging Face versions' default): its forward runs again
    inside the backward, so its weight work is queued there, not in the stage's forward."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.GELU())

    def forward(self, x: Tensor) -> Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=True)


def frozen_mlp() -> nn.Module:
    """Fine-tuning the head only: the first stage has no parameter that requires grad, so its
    output needs no gradient (and one process computes none for it)."""
    model = mlp()
    for layer in list(model)[:-1]:
        layer.requires_grad_(False)
    return model


def reentrant_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), *(_ReentrantCheckpointed(16) for _ in range(3)), nn.Linear(16, 4))


def _mse(output: Tensor, target: Tensor) -> Tensor:
    return F.mse_loss(output, target)


MakeBatch = Callable[[int, torch.Generator], Tensor]


def _features(width: int) -> MakeBatch:
    return lambda b, g: torch.randn(b, width, generator=g)


#: model, inputs, targets, loss
MODELS: dict[str, tuple[Callable[[], nn.Module], MakeBatch, MakeBatch, Callable]] = {
    "mlp": (mlp, _features(8), _features(4), _mse),
    "reentrant_mlp": (reentrant_mlp, _features(8), _features(4), _mse),
    "frozen_mlp": (frozen_mlp, _features(8), _features(4), _mse),
    "conv_bn": (
        conv_bn,
        lambda b, g: torch.randn(b, 3, 5, 5, generator=g),
        lambda b, g: torch.randint(0, 3, (b,), generator=g),
        F.cross_entropy,
    ),
}
SETTINGS = [
    (model, name, twobp)
    for model in ("mlp", "conv_bn")
    for name in SCHEDULES + MULTI_STAGE_SCHEDULES
    for twobp in (False, True)
] + [("reentrant_mlp", name, True) for name in ("gpipe", "1f1b-2")]
SETTINGS += [("frozen_mlp", name, twobp) for name in ("gpipe", "1f1b-1", "zbv") for twobp in (False, True)]
SETTING_IDS = [f"{model}-{name}-{'2bp' if twobp else 'plain'}" for model, name, twobp in SETTINGS]


# -- what each rank runs ---------------------------------------------------------------------


def _own(report: StepReport | RankMetrics, rank: int) -> RankMetrics:
    return report.ranks[rank] if isinstance(report, StepReport) else report


def _check_setting(rank: int, model_name: str, schedule_name: str, twobp: bool, world: int = WORLD) -> dict:
    make_model, make_inputs, make_targets, loss_fn = MODELS[model_name]
    torch.manual_seed(0)
    model = make_model()
    reference = copy.deepcopy(model)
    owners = placement(schedule_name, world)
    mine = [index for index, owner in enumerate(owners) if owner == rank]
    stages = {index: split_model(model, len(owners))[index] for index in mine}
    reference_stages = [split_model(reference, len(owners))[index] for index in mine]
    m = default_num_micro_batches(schedule_name, world)
    actions = schedule(schedule_name, world, m, twobp)[rank]
    runtime = PipelineRuntime(
        stages if len(stages) > 1 else stages[rank], actions, num_micro_batches=m, loss_fn=loss_fn, twobp=twobp,
        timeout=RUNTIME_TIMEOUT, placement=owners,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    result: dict = {"deferred_jobs": [], "peak_bytes": [], "losses": [], "reference_losses": [], "events": []}
    for batch in BATCH_SIZES:
        inputs, targets = make_inputs(batch, generator), make_targets(batch, generator)
        report = runtime.step(inputs if rank == 0 else None, targets if owners[-1] == rank else None)
        own = _own(report, rank)
        result["deferred_jobs"].append(own.deferred_jobs)
        result["peak_bytes"].append(own.peak_bytes)
        result["events"].append([e.action for e in own.events])
        reference_loss = 0.0
        for x, y in zip(inputs.tensor_split(m), targets.tensor_split(m), strict=True):
            # The mean over the batch: each micro-batch's mean weighted by its share (uneven at 6).
            loss = loss_fn(reference(x), y) * (len(x) / batch)
            loss.backward()
            reference_loss += loss.item()
        result["reference_losses"].append(reference_loss)
        if isinstance(report, StepReport):
            result["losses"].append(report.loss)
            result["bubble_ratio"] = report.bubble_ratio
            result["throughput"] = report.throughput
            result["ranks_reported"] = [r.rank for r in report.ranks]
    result["actions"] = actions
    result["trainable"] = any(p.requires_grad for stage in stages.values() for p in stage.parameters())
    result["mismatches"] = [
        found
        for index, reference_stage in zip(mine, reference_stages, strict=True)
        for found in _mismatches(stages[index], reference_stage)
    ]
    return result


def _mismatches(stage: nn.Module, reference: nn.Module) -> list[str]:
    rtol, atol = TOLERANCES[torch.float32]
    found = []
    for (name, p), (_, q) in zip(stage.named_parameters(), reference.named_parameters(), strict=True):
        if p.grad is None or q.grad is None:
            if (p.grad is None) != (q.grad is None):
                found.append(f"{name}: .grad is {p.grad is None and 'None' or 'set'}, plain autograd's is not")
        elif not torch.allclose(p.grad, q.grad, rtol=rtol, atol=atol):
            found.append(f"{name}.grad: max difference {(p.grad - q.grad).abs().max():.3g}")
    for (name, b), (_, c) in zip(stage.named_buffers(), reference.named_buffers(), strict=True):
        if not torch.allclose(b.float(), c.float(), rtol=rtol, atol=atol):
            found.append(f"buffer {name}: max difference {(b.float() - c.float()).abs().max():.3g}")
    return found


def _correctness(rank: int) -> dict:
    return {
        setting_id: _check_setting(rank, *setting) for setting_id, setting in zip(SETTING_IDS, SETTINGS, strict=True)
    }


def _three_ranks(rank: int) -> dict:
    """A middle rank both receives and sends, in each direction. Every schedule on gloo, and
    told it runs on NCCL (which pairs messages in the order they are posted; gloo by tag), with
    what each rank posts, as (``"send"`` or ``"receive"``, peer, tag), in order."""
    results = {}
    for setting_id, setting in zip(SETTING_IDS, SETTINGS, strict=True):
        if setting[0] == "mlp":
            results[setting_id] = _check_setting(rank, *setting, world=3)
            with _posts_logged(backend="nccl") as posted:
                results[f"{setting_id}-nccl"] = _check_setting(rank, *setting, world=3)
            results[f"{setting_id}-nccl"]["posted"] = posted
    return results


@contextlib.contextmanager
def _posts_logged(backend: str) -> Iterator[list[tuple[str, int, int]]]:
    """Log the posts, with ``dist.get_backend`` answering ``backend``."""
    dist = torch.distributed
    isend, irecv, get_backend = dist.isend, dist.irecv, dist.get_backend
    posted: list[tuple[str, int, int]] = []

    def logged_send(tensor: Tensor, **options: Any) -> Any:
        posted.append(("send", options["group_dst"], options["tag"]))
        return isend(tensor, **options)

    def logged_receive(tensor: Tensor, **options: Any) -> Any:
        posted.append(("receive", options["group_src"], options["tag"]))
        return irecv(tensor, **options)

    # this spawned rank's own module
    dist.isend, dist.irecv, dist.get_backend = logged_send, logged_receive, lambda group=None: backend
    try:
        yield posted
    finally:
        dist.isend, dist.irecv, dist.get_backend = isend, irecv, get_backend


class _DieOnArm(nn.Module):
    """Ends its process in the middle of a step once armed (a rank that crashes hard)."""

    armed = False

    def forward(self, x: Tensor) -> Tensor:
        if self.armed:
            os._exit(3)
        return x


class _StallOnArm(nn.Module):
    """Once armed, hangs (alive, connections open) for longer than the runtime's timeout."""

    armed = False

    def forward(self, x: Tensor) -> Tensor:
        if self.armed:
            time.sleep(FAILURE_TIMEOUT + 4)
        return x


class _ShrinkOnArm(nn.Module):
    """Once armed, returns a narrower output for the same input shape."""

    armed = False

    def forward(self, x: Tensor) -> Tensor:
        return x[..., :-1] if self.armed else x


def _failure(rank: int, culprit: nn.Module, culprit_rank: int) -> dict:
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(4, 4), culprit) if rank == culprit_rank else nn.Sequential(nn.Linear(4, 4))
    m = 2
    actions = schedule("gpipe", WORLD, m, True)[rank]
    runtime = PipelineRuntime(
        stage, actions, num_micro_batches=m, loss_fn=lambda o, t: o.sum(), timeout=FAILURE_TIMEOUT
    )
    inputs, targets = torch.randn(4, 4), torch.zeros(4)
    try:
        runtime.step(inputs[:1], targets[:1])  # fewer samples than micro-batches: refused on every rank
        too_few = None
    except ValueError as error:
        too_few = str(error)
    runtime.step(inputs, targets)  # a healthy first step fixes the shapes
    culprit.armed = True
    start = time.perf_counter()
    try:
        runtime.step(inputs, targets)
    except PipelineError as error:
        return {"error": str(error), "elapsed": time.perf_counter() - start, "too_few": too_few}
    return {"error": None, "elapsed": time.perf_counter() - start, "too_few": too_few}


def _late_failure(rank: int) -> dict:
    """Rank 0 fails in its step's last flush (a hook raising, say out of memory), after its last
    message, and stays alive: rank 1 waited for its metrics in ``gather_object`` up to the process
    group's own timeout, past the runtime's, then failed with gloo's error."""
    torch.manual_seed(0)
    stage = nn.Linear(4, 4)
    runtime = PipelineRuntime(
        stage, schedule("gpipe", WORLD, 2, True)[rank], num_micro_batches=2, loss_fn=lambda o, t: o.sum(),
        timeout=FAILURE_TIMEOUT,
    )  # fmt: skip
    inputs, targets = torch.randn(4, 4), torch.zeros(4)
    runtime.step(inputs, targets)
    start = time.perf_counter()
    if rank == 0:

        def fail(param: Tensor) -> None:
            raise RuntimeError("out of memory (simulated)")

        stage.weight.register_post_accumulate_grad_hook(fail)
        try:
            runtime.step(inputs, targets)
        except RuntimeError as error:
            time.sleep(FAILURE_TIMEOUT + 4)
            return {"error": str(error), "elapsed": time.perf_counter() - start}
        return {"error": None}
    try:
        runtime.step(inputs, targets)
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}", "elapsed": time.perf_counter() - start}
    return {"error": None}


def _loss_per_sample(rank: int) -> dict:
    """A loss_fn left unreduced: torch's "grad can be implicitly created only for scalar outputs"
    named neither the loss nor the fix."""
    stage = nn.Linear(4, 4)
    runtime = PipelineRuntime(
        stage, schedule("gpipe", WORLD, 2, True)[rank], num_micro_batches=2,
        loss_fn=lambda o, t: F.mse_loss(o, t, reduction="none").sum(1), timeout=FAILURE_TIMEOUT,
    )  # fmt: skip
    try:
        runtime.step(torch.randn(4, 4), torch.zeros(4, 4))
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}
    return {"error": None}


class _NextToken(nn.Module):
    """A first stage that hands token ids on: an integer activation, which gets no gradient back."""

    def forward(self, x: Tensor) -> Tensor:
        return (x + 1) % 10


def _integer_activations(rank: int) -> dict:
    """The rank after an integer activation sends no gradient for it, and the rank before must not
    wait for one (it did, until the timeout, then said its peer had died)."""
    results = {}
    for name, twobp_on, backend in itertools.product(("gpipe", "1f1b-1"), (False, True), ("gloo", "nccl")):
        with _posts_logged(backend):  # on "nccl", posted in the one order, where no gradient is one message less
            torch.manual_seed(0)
            model = nn.Sequential(_NextToken(), nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 4)))
            reference = copy.deepcopy(model)
            m = 2
            runtime = PipelineRuntime(
                model[rank], schedule(name, WORLD, m, twobp_on)[rank], num_micro_batches=m, loss_fn=_mse,
                twobp=twobp_on, timeout=RUNTIME_TIMEOUT,
            )  # fmt: skip
            tokens, targets = torch.randint(0, 10, (4, 3)), torch.randn(4, 3, 4)
            runtime.step(tokens if rank == 0 else None, targets if rank == 1 else None)
            for x, y in zip(tokens.tensor_split(m), targets.tensor_split(m), strict=True):
                (_mse(reference(x), y) / m).backward()
            results[f"{name}-{twobp_on}-{backend}"] = _mismatches(model[rank], reference[rank])
    return results


def _in_place_first_op(rank: int) -> dict:
    """A stage whose first op changes its input in place cannot run on a received activation (a
    leaf that requires grad): that rank says so, instead of autograd's leaf error alone."""
    stages = [nn.Linear(4, 4), nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 2))]
    runtime = PipelineRuntime(
        stages[rank], schedule("gpipe", WORLD, 2, True)[rank], num_micro_batches=2, loss_fn=_mse,
        timeout=FAILURE_TIMEOUT,
    )  # fmt: skip
    try:
        runtime.step(torch.randn(4, 4) if rank == 0 else None, torch.randn(4, 2) if rank == 1 else None)
    except PipelineError as error:
        return {"error": str(error)}
    return {"error": None}


class _Prefix(nn.Module):
    """A learned prefix that ignores its input: no gradient reaches the stage before."""

    def __init__(self) -> None:
        super().__init__()
        self.prefix = nn.Parameter(torch.randn(1, 4))

    def forward(self, x: Tensor) -> Tensor:
        return self.prefix.expand(x.shape[0], 4)


class _FromBytes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: Tensor) -> Tensor:
        return x.double() / 255 * self.scale


def _mean_over_labelled(output: Tensor, labels: Tensor) -> Tensor:
    """Cross-entropy averaged over the labels that are not -100, written out as sum / count."""
    labelled = labels != -100
    losses = F.cross_entropy(output, labels.clamp(min=0), reduction="none")
    return (losses * labelled).sum() / labelled.sum()


def _pipelined_step(
    rank: int, name: str, twobp_on: bool, x: Tensor, y: Any, loss_fn: Callable, out_features: int = 2, **options: Any
) -> tuple[list[str], tuple[float, float] | None]:
    """One step of a 2-stage pipeline against one process on the whole batch: this rank's
    gradient mismatches, and on rank 0 (its report) the step's loss and one process's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Tanh()), nn.Linear(4, out_features)).double()
    reference = copy.deepcopy(model)
    runtime = PipelineRuntime(
        model[rank], schedule(name, WORLD, 4, twobp_on)[rank], num_micro_batches=4, loss_fn=loss_fn,
        twobp=twobp_on, timeout=RUNTIME_TIMEOUT, **options,
    )  # fmt: skip
    report = runtime.step(x if rank == 0 else None, y if rank == 1 else None)
    expected = loss_fn(reference(x), y)
    expected.backward()
    loss = (report.loss, expected.item()) if isinstance(report, StepReport) else None
    return _mismatches(model[rank], reference[rank]), loss


def _batches_and_losses(rank: int) -> dict:
    """One process's full-batch loss, whatever the batch and loss: a batch that does not divide
    into the micro-batches (their means were averaged alike: 0.27 off), a reduction="sum" loss
    (1/m of one process's gradients), targets in a dict; a training step under no_grad refused."""
    results: dict[str, object] = {}
    cases = {
        "uneven-mean": (6, "mean", lambda out, y: _mse(out, y), lambda y: y),
        "sum": (8, "sum", lambda out, y: F.mse_loss(out, y, reduction="sum"), lambda y: y),
        "dict-targets": (7, "mean", lambda out, y: _mse(out, y["value"]), lambda y: {"value": y}),
        "loss-of-shape-1": (8, "mean", lambda out, y: _mse(out, y).reshape(1), lambda y: y),
    }
    for case, (batch, reduction, loss_fn, wrap) in cases.items():
        torch.manual_seed(1)  # the same batch on both ranks
        x, y = torch.randn(batch, 4, dtype=torch.float64), torch.randn(batch, 2, dtype=torch.float64)
        for name in ("gpipe", "1f1b-2"):
            for twobp_on in (False, True):
                found, _ = _pipelined_step(rank, name, twobp_on, x, wrap(y), loss_fn, loss_reduction=reduction)
                results[f"{case}-{name}-{twobp_on}"] = found
    # A micro-batch without an item to average over (every label ignored, a prompt-only sample):
    # its 0 / 0 mean made the step's loss NaN, and a mean written out as sum / count every .grad.
    torch.manual_seed(1)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.tensor([0, 1, -100, -100, 2, -100, 1, 0])
    for name in ("gpipe", "1f1b-2"):
        for twobp_on in (False, True):
            found, loss = _pipelined_step(
                rank, name, twobp_on, x, y, _mean_over_labelled, out_features=3,
                loss_items=lambda y: int((y != -100).sum()),
            )  # fmt: skip
            if loss is not None and not math.isclose(loss[0], loss[1], rel_tol=1e-9):
                found.append(f"loss {loss[0]} against {loss[1]}")
            results[f"no-items-{name}-{twobp_on}"] = found
    # Bytes in (images as uint8): only the step's shape header crosses, and it refused the dtype.
    torch.manual_seed(0)
    model = nn.Sequential(_FromBytes(), nn.Linear(4, 2)).double()
    reference = copy.deepcopy(model)
    runtime = PipelineRuntime(
        model[rank], schedule("gpipe", WORLD, 2, True)[rank], num_micro_batches=2, loss_fn=_mse,
        timeout=RUNTIME_TIMEOUT,
    )  # fmt: skip
    x, y = torch.randint(0, 256, (4, 4), dtype=torch.uint8), torch.randn(4, 2, dtype=torch.float64)
    runtime.step(x if rank == 0 else None, y if rank == 1 else None)
    for half in range(2):
        (_mse(reference(x[2 * half : 2 * half + 2]), y[2 * half : 2 * half + 2]) / 2).backward()
    results["uint8-inputs"] = _mismatches(model[rank], reference[rank])
    with torch.no_grad():
        try:
            runtime.step(x if rank == 0 else None, y if rank == 1 else None)
            results["no_grad"] = None
        except RuntimeError as error:
            results["no_grad"] = str(error)
    # Inputs as a Hugging Face user passes them: rank 0 failed alone, the other waited out its
    # timeout; so did rank 0 for targets missing on rank 1, or of a non-tensor type. Targets of
    # another batch than the inputs' were split apart from them (a loss broadcast one target row
    # over two outputs, weighted 1/3 and 2/3), where one process's loss refuses them.
    misgiven = {
        "dict_inputs": ({"input_ids": x, "attention_mask": x}, y),
        "no_targets": (x, None),
        "list_of_numbers_as_targets": (x, [1.0, 2.0, 3.0, 4.0]),
        "targets_of_another_batch": (x, y[:3]),
        # Two rows per sample (flattened tokens) split 5 / 5 where the inputs split 3 / 2.
        "two_rows_per_sample_split_unevenly": (torch.randn(5, 4), torch.randn(10, 2)),
        "a_count_beside_the_targets": (x, {"value": y, "items": torch.tensor(37)}),
    }
    for case, (given_inputs, given_targets) in misgiven.items():
        start = time.monotonic()
        try:
            runtime.step(given_inputs if rank == 0 else None, given_targets if rank == 1 else None)
            results[case] = None
        except (TypeError, ValueError, PipelineError) as error:
            results[case] = (str(error), time.monotonic() - start)
    # A step under autocast, then one without, on the same shapes: the activations' dtypes were
    # cached per input shape, so the second step's fp32 output met the first's bf16 record.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    reference = copy.deepcopy(model)
    runtime = PipelineRuntime(
        model[rank], schedule("gpipe", WORLD, 2, True)[rank], num_micro_batches=2, loss_fn=_mse,
        timeout=RUNTIME_TIMEOUT,
    )  # fmt: skip
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        runtime.step(x if rank == 0 else None, y if rank == 1 else None)
    model.zero_grad(set_to_none=True)
    runtime.step(x if rank == 0 else None, y if rank == 1 else None)
    for half in range(2):
        (_mse(reference(x[2 * half : 2 * half + 2]), y[2 * half : 2 * half + 2]) / 2).backward()
    results["autocast-then-not"] = _mismatches(model[rank], reference[rank])
    # Rank 0 under autocast, rank 1 not: rank 1 refused at once, rank 0 waited out its timeout.
    start = time.monotonic()
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=rank == 0):
            runtime.step(x if rank == 0 else None, y if rank == 1 else None)
        results["autocast_on_one_rank"] = None
    except PipelineError as error:
        results["autocast_on_one_rank"] = (str(error), time.monotonic() - start)
    stages = [nn.Linear(4, 4), _Prefix()]
    runtime = PipelineRuntime(
        stages[rank], schedule("gpipe", WORLD, 2, True)[rank], num_micro_batches=2, loss_fn=_mse,
        timeout=RUNTIME_TIMEOUT,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runtime.step(torch.randn(4, 4) if rank == 0 else None, torch.randn(4, 4) if rank == 1 else None)
    results["warnings"] = [str(w.message) for w in caught]
    return results


def _failed_construction(rank: int) -> dict:
    """Rank 1 holds the last stage but passes no loss_fn: its constructor raises, before the
    all-gather of every rank's actions that rank 0's waits in."""
    start = time.monotonic()
    try:
        loss_fn = _mse if rank == 0 else None
        PipelineRuntime(nn.Linear(4, 4), schedule("gpipe", WORLD, 2)[rank], num_micro_batches=2, loss_fn=loss_fn,
                        timeout=FAILURE_TIMEOUT)  # fmt: skip
    except (PipelineError, ValueError) as error:
        return {"error": f"{type(error).__name__}: {error}", "elapsed": time.monotonic() - start}
    return {"error": None, "elapsed": time.monotonic() - start}


def _mismatched_lists(rank: int) -> dict:
    """Rank 1 sends its gradients back in another order than rank 0 takes them: both would
    wait for a message the other sends later."""
    backwards_reversed = [Forward(0), Forward(1), Forward(2), Forward(3), B(3), B(2), B(1), B(0)]
    mine = schedule("gpipe", WORLD, 4, False)[0] if rank == 0 else backwards_reversed
    try:
        PipelineRuntime(nn.Linear(4, 4), mine, num_micro_batches=4, loss_fn=_mse, timeout=FAILURE_TIMEOUT)
    except ScheduleError as error:
        return {"error": str(error)}
    return {"error": None}


#: scenario -> (what each rank runs, number of ranks)
SCENARIOS: dict[str, tuple[Callable[[int], dict], int]] = {
    "correctness": (_correctness, WORLD),
    "three_ranks": (_three_ranks, 3),
    "killed": (functools.partial(_failure, culprit=_DieOnArm(), culprit_rank=1), WORLD),
    "stalled": (functools.partial(_failure, culprit=_StallOnArm(), culprit_rank=1), WORLD),
    "shape_mismatch": (functools.partial(_failure, culprit=_ShrinkOnArm(), culprit_rank=0), WORLD),
    "late_failure": (_late_failure, WORLD),
    "loss_per_sample": (_loss_per_sample, WORLD),
    "integer_activations": (_integer_activations, WORLD),
    "in_place_first_op": (_in_place_first_op, WORLD),
    "batches_and_losses": (_batches_and_losses, WORLD),
    "mismatched_lists": (_mismatched_lists, WORLD),
    "failed_construction": (_failed_construction, WORLD),
}


def launch(scenario: str, directory: str, deadline: float = 150.0) -> list[dict | None]:
    """Run ``scenario`` on its spawned ranks; each rank's result, None if it wrote none."""
    run, world = SCENARIOS[scenario]
    store, results = os.path.join(directory, f"{scenario}.store"), os.path.join(directory, f"{scenario}.result")
    run_ranks(gloo_rank_main, world, (world, run, store, results), deadline, ": the pipeline hung")
    return read_results(results, world, required=False)


# -- the tests -------------------------------------------------------------------------------


def _launch_healthy(scenario: str, factory: pytest.TempPathFactory) -> list[dict]:
    results = launch(scenario, str(factory.mktemp(scenario)))
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} wrote no result"
        assert "crash" not in result, f"rank {rank} crashed:\n{result['crash']}"
    return results  # type: ignore[return-value]


@pytest.fixture(scope="module")
def correctness(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _launch_healthy("correctness", tmp_path_factory)


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _launch_healthy("three_ranks", tmp_path_factory)


@pytest.mark.parametrize("setting", SETTING_IDS)
def test_pipelined_step_matches_one_process(correctness: list[dict], setting: str) -> None:
    _assert_matches(correctness, setting)


THREE_RANK_IDS = [i for i, s in zip(SETTING_IDS, SETTINGS, strict=True) if s[0] == "mlp"]


@pytest.mark.parametrize("setting", THREE_RANK_IDS + [f"{i}-nccl" for i in THREE_RANK_IDS])
def test_three_ranks_match_one_process(three_ranks: list[dict], setting: str) -> None:
    _assert_matches(three_ranks, setting)


@pytest.mark.parametrize("setting", THREE_RANK_IDS)
def test_on_nccl_every_rank_posts_in_the_one_posting_order(three_ranks: list[dict], setting: str) -> None:
    """What NCCL needs (tests/pipeline/test_posting.py replays the order under its rules): each
    rank posts its sends and receives in the posting order, an activation's shape before it on
    each step with a new input shape (the 1st and 3rd of BATCH_SIZES)."""
    _, name, twobp = SETTINGS[SETTING_IDS.index(setting)]
    world, m = 3, default_num_micro_batches(name, 3)
    ranks = schedule(name, world, m, twobp)
    num_stages = len(placement(name, world))
    owners = placement(name, world)
    for rank, result in enumerate(three_ranks):
        expected = []
        for new_shape in (True, False, True):
            for message, sends in posting_order(ranks, rank):
                peer = owners[message.receiver] if sends else owners[message.sender]
                tag = 2 * (message.micro_batch * num_stages + message.sender) + (message.payload is Payload.GRADIENTS)
                kind = "send" if sends else "receive"
                if new_shape and message.payload is Payload.ACTIVATIONS:
                    expected.append((kind, peer, _SHAPE_TAG + tag))
                expected.append((kind, peer, tag))
        posted = [tuple(post) for post in result[f"{setting}-nccl"]["posted"] if post[2] < _METRICS_TAG]
        assert posted == expected, rank


def _assert_matches(ranks: list[dict], setting: str) -> None:
    twobp = "-2bp" in setting
    for rank, results in enumerate(ranks):
        result = results[setting]
        assert not result["mismatches"], f"rank {rank}: {result['mismatches']}"
        assert all(kinds == result["actions"] for kinds in result["events"]), "events are not the schedule's actions"
        # The heap over a step's start: the few KiB a tiny plain step holds can fall under what
        # the allocator frees meanwhile, so one step may read 0; every step reading 0 would not.
        assert max(result["peak_bytes"]) > 0, f"rank {rank}: no step held memory {result['peak_bytes']}"
        if twobp:
            assert any(a.kind == "I" for a in result["actions"]) and any(a.kind == "W" for a in result["actions"])
        else:
            assert all(a.kind in "FB" for a in result["actions"])
        if twobp and result["trainable"]:  # a stage that silently fell back to plain autograd would queue nothing
            assert all(jobs > 0 for jobs in result["deferred_jobs"]), f"rank {rank}: nothing was deferred"
        else:  # nothing to defer: 2BP off, or only frozen parameters on this rank
            assert result["deferred_jobs"] == [0] * len(BATCH_SIZES)
    first = ranks[0][setting]
    torch.testing.assert_close(first["losses"], first["reference_losses"], rtol=1e-5, atol=1e-6)
    assert first["ranks_reported"] == list(range(len(ranks)))
    assert 0.0 <= first["bubble_ratio"] < 1.0 and first["throughput"] > 0.0


def test_a_killed_rank_ends_the_others_with_an_error(tmp_path) -> None:
    survivor, culprit = launch("killed", str(tmp_path), deadline=90.0)
    assert culprit is None, "the killed rank should have died before writing a result"
    assert survivor is not None and "crash" not in survivor, survivor
    assert survivor["error"] is not None and "rank 1" in survivor["error"]
    assert survivor["elapsed"] < 60.0


def test_a_hung_rank_makes_the_others_time_out(tmp_path) -> None:
    survivor, _ = launch("stalled", str(tmp_path), deadline=90.0)
    assert survivor is not None and survivor["error"] is not None, survivor
    assert "rank 1" in survivor["error"] and f"timeout {FAILURE_TIMEOUT:g} s" in survivor["error"]
    assert FAILURE_TIMEOUT - 1 < survivor["elapsed"] < FAILURE_TIMEOUT + 10


def test_a_rank_failing_after_its_last_message_ends_the_others_within_the_timeout(tmp_path) -> None:
    culprit, survivor = launch("late_failure", str(tmp_path), deadline=90.0)
    assert culprit is not None and "out of memory (simulated)" in culprit["error"], culprit
    assert survivor is not None and survivor["error"] is not None, survivor
    assert "PipelineError" in survivor["error"] and "metrics" in survivor["error"], survivor
    assert survivor["elapsed"] < FAILURE_TIMEOUT + 3, survivor


def test_a_loss_left_unreduced_is_refused_naming_the_fix(tmp_path) -> None:
    first, last = launch("loss_per_sample", str(tmp_path), deadline=90.0)
    expected = "ValueError: twobp: rank 1: loss_fn returned a tensor of shape (2,)"
    assert last is not None and expected in last["error"], last
    assert first is not None and first["error"].startswith("PipelineError: twobp: rank 0"), first


def test_a_shape_mismatch_ends_every_rank_with_an_error(tmp_path) -> None:
    sender, receiver = launch("shape_mismatch", str(tmp_path), deadline=90.0)
    assert sender is not None and receiver is not None
    for result in (sender, receiver):  # and before it, a batch of 1 for 2 micro-batches, on both ranks
        assert result["too_few"] and "at least num_micro_batches=2 samples" in result["too_few"], result
    assert sender.get("error") and "exchanged for this input shape" in sender["error"], sender
    assert receiver.get("error") and "rank 0" in receiver["error"], receiver
    assert sender["elapsed"] < 60.0 and receiver["elapsed"] < 60.0


def test_an_integer_activation_between_stages_needs_no_gradient(tmp_path) -> None:
    ranks = launch("integer_activations", str(tmp_path), deadline=90.0)
    for rank, result in enumerate(ranks):
        assert result is not None and "crash" not in result, result
        assert len(result) == 8 and all(not mismatches for mismatches in result.values()), (rank, result)


def test_a_stage_changing_its_received_input_in_place_says_so(tmp_path) -> None:
    first, second = launch("in_place_first_op", str(tmp_path), deadline=90.0)
    assert second is not None and second["error"] and "changes its input in place" in second["error"], second
    assert first is not None and first["error"] and "rank 1" in first["error"], first


def test_a_rank_failing_to_build_its_runtime_ends_the_others_within_the_timeout(tmp_path) -> None:
    survivor, culprit = launch("failed_construction", str(tmp_path), deadline=60.0)
    assert culprit is not None and "the last stage needs a loss_fn" in culprit["error"], culprit
    assert survivor is not None and survivor["error"].startswith("PipelineError: twobp: rank 0"), survivor
    assert "every rank's action list" in survivor["error"], survivor
    assert survivor["elapsed"] < FAILURE_TIMEOUT + 5, survivor


def test_ranks_given_lists_that_make_no_schedule_all_refuse_before_any_step(tmp_path) -> None:
    for rank, result in enumerate(launch("mismatched_lists", str(tmp_path), deadline=60.0)):
        assert result is not None and result["error"], (rank, result)
        assert result["error"].startswith(f"twobp: rank {rank}: the ranks' action lists do not make one schedule")
        assert "exchange gradients in different orders" in result["error"], result["error"]


def test_uneven_batches_sum_losses_and_dict_targets_match_one_process(tmp_path) -> None:
    ranks = launch("batches_and_losses", str(tmp_path), deadline=120.0)
    for rank, result in enumerate(ranks):
        assert result is not None and "crash" not in result, result
        misgiven = {
            "dict_inputs": (0, "must be one tensor"),
            "no_targets": (1, "the last rank needs the targets"),
            "list_of_numbers_as_targets": (1, "targets must be a tensor, or a dict"),
            "targets_of_another_batch": (None, "targets hold 3 samples on dim 0 and its inputs 4"),
            "two_rows_per_sample_split_unevenly": (None, "targets hold 10 samples on dim 0 and its inputs 5"),
            "a_count_beside_the_targets": (1, "targets hold a 0-d tensor"),
        }
        refusals = ("no_grad", "warnings", "autocast_on_one_rank", *misgiven)
        assert all(not found for case, found in result.items() if case not in refusals), (rank, result)
        assert result["no_grad"] and "twobp: PipelineRuntime.step() trains" in result["no_grad"], result
        for case, (culprit, reason) in misgiven.items():  # every rank refuses, at once
            assert result[case], (rank, case, result)
            message, elapsed = result[case]
            said = reason if culprit in (None, rank) else f"rank {culprit} refused this step's inputs or targets"
            assert message.startswith("twobp:") and said in message, (rank, case, message)
            assert elapsed < RUNTIME_TIMEOUT / 2, (rank, case, elapsed)
        assert result["autocast_on_one_rank"], (rank, result)
        message, elapsed = result["autocast_on_one_rank"]
        assert message.startswith(f"twobp: rank {rank}: the ranks' steps run under different autocasts"), message
        assert elapsed < RUNTIME_TIMEOUT / 2, (rank, elapsed)
    assert any("stage 1's output does not depend on its input" in w for w in ranks[1]["warnings"]), ranks[1]


def test_targets_split_alike_with_the_inputs_hold_as_many_rows_per_sample_in_every_micro_batch() -> None:
    assert _split_alike(8, 8, 3)  # one row per sample: 3 / 3 / 2 both
    assert _split_alike(32, 8, 4)  # four flattened tokens per sample, 8 / 8 / 8 / 8 against 2 / 2 / 2 / 2
    assert _split_alike(15, 5, 5)
    assert not _split_alike(10, 5, 2)  # 5 / 5 rows against 3 / 2 samples
    assert not _split_alike(12, 8, 4)  # no whole number of rows per sample
    assert not _split_alike(7, 8, 2)


@pytest.mark.parametrize("queues", [[0], [0, 1, 2]], ids=["a-stage-left-out", "a-stage-not-held"])
def test_queues_that_are_not_one_per_held_stage_are_refused(one_rank_group: None, queues: list[int]) -> None:
    """A mapping leaving out one of the rank's stages failed with a bare KeyError."""
    with pytest.raises(ValueError, match=r"twobp: rank 0 holds stages \[0, 1\] .* one queue per stage it holds"):
        PipelineRuntime(
            {0: nn.Linear(4, 4), 1: nn.Linear(4, 4)},
            [],
            num_micro_batches=2,
            loss_fn=_mse,
            queue={index: WeightGradQueue() for index in queues},
        )


def test_a_placement_naming_more_stages_than_the_schedule_runs_is_refused(one_rank_group: None) -> None:
    """placement=(0, 1, 1) over a two-stage schedule: no rank held the last stage, the last rank
    handed its output over to a stage no rank runs, and failed in step() with a bare KeyError."""
    with pytest.raises(ValueError, match=r"twobp: rank 0: placement=\(0, 0\) .* runs its 1 stages on ranks \(0,\)"):
        PipelineRuntime(
            nn.Linear(4, 4), schedule("gpipe", 1, 2)[0], num_micro_batches=2, loss_fn=_mse, placement=(0, 0)
        )
