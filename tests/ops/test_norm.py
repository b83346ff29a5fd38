"""BatchNorm1d/2d/3d, LayerNorm, GroupNorm and RMSNorm against plain autograd.

Besides the weight gradients, every setting checks what backward-p1 delivers at once (the
input gradient, which for BatchNorm passes through the micro-batch statistics), the output
bit for bit, and BatchNorm's running statistics after several micro-batches of different sizes.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor, nn

import twobp_autograd as twobp
from tests.utils import (
    TOLERANCES,
    assert_grads_match,
    assert_no_grads,
    check_against_autograd,
    patched_and_reference,
)
from twobp_autograd.ops import autocast


@dataclass(frozen=True)
class Setting:
    id: str
    make_module: Callable[[], nn.Module]
    #: One input shape per micro-batch (BatchNorm: different sizes, different statistics).
    shapes: tuple[tuple[int, ...], ...]
    channels_last: bool = False

    def module(self, dtype: torch.dtype) -> nn.Module:
        module = self.make_module().to(dtype)
        with torch.no_grad():  # away from ones/zeros, so the input gradient depends on them
            for name, p in module.named_parameters():
                p.normal_(1.0 if name == "weight" else 0.0, 0.5)
        return module

    def input(self, shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu") -> Tensor:
        x = torch.randn(shape, dtype=dtype, device=device) * 2 + 0.5
        if self.channels_last:
            x = x.to(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
        return x


def _sizes(*rest: int, batches: Sequence[int] = (4, 6, 3)) -> tuple[tuple[int, ...], ...]:
    return tuple((b, *rest) for b in batches)


BATCH_NORM = [
    Setting("bn1d-2d-input", lambda: nn.BatchNorm1d(4), _sizes(4)),
    Setting("bn1d-3d-input", lambda: nn.BatchNorm1d(4), _sizes(4, 5)),
    Setting("bn2d", lambda: nn.BatchNorm2d(3), _sizes(3, 4, 5)),
    Setting("bn2d-channels-last", lambda: nn.BatchNorm2d(3), _sizes(3, 4, 5), channels_last=True),
    Setting("bn3d", lambda: nn.BatchNorm3d(2), _sizes(2, 3, 2, 2)),
    Setting("bn3d-channels-last", lambda: nn.BatchNorm3d(2), _sizes(2, 3, 2, 2), channels_last=True),
    Setting("bn2d-momentum-none", lambda: nn.BatchNorm2d(3, momentum=None), _sizes(3, 4, 5)),
    Setting("bn2d-momentum-eps", lambda: nn.BatchNorm2d(3, eps=1e-2, momentum=0.3), _sizes(3, 4, 5)),
    Setting("bn2d-no-running-stats", lambda: nn.BatchNorm2d(3, track_running_stats=False), _sizes(3, 4, 5)),
    Setting("bn1d-no-bias", lambda: nn.BatchNorm1d(4, bias=False), _sizes(4, 5)),
]

LAYER_NORM = [
    Setting("ln", lambda: nn.LayerNorm(8), _sizes(3, 8)),
    Setting("ln-2d-input", lambda: nn.LayerNorm(8), _sizes(8)),
    Setting("ln-multi-dim-shape", lambda: nn.LayerNorm((3, 4)), _sizes(2, 3, 4)),
    Setting("ln-unbatched", lambda: nn.LayerNorm((3, 4)), ((3, 4),) * 3),
    Setting("ln-no-bias", lambda: nn.LayerNorm(8, bias=False), _sizes(3, 8)),
    Setting("ln-eps", lambda: nn.LayerNorm(8, eps=1e-2), _sizes(3, 8)),
]

GROUP_NORM = [
    Setting("gn-1-group", lambda: nn.GroupNorm(1, 6), _sizes(6, 3, 3)),
    Setting("gn-group-per-channel", lambda: nn.GroupNorm(6, 6), _sizes(6, 3, 3)),
    Setting("gn-3-groups", lambda: nn.GroupNorm(3, 6), _sizes(6, 3, 3)),
    Setting("gn-channels-last", lambda: nn.GroupNorm(3, 6), _sizes(6, 3, 3), channels_last=True),
    Setting("gn-2d-input", lambda: nn.GroupNorm(2, 6), _sizes(6)),
    Setting("gn-3d-input", lambda: nn.GroupNorm(2, 6), _sizes(6, 5)),
    Setting("gn-no-bias", lambda: nn.GroupNorm(3, 6, bias=False), _sizes(6, 3, 3)),
]

RMS_NORM = [
    Setting("rms-eps-none", lambda: nn.RMSNorm(8), _sizes(3, 8)),
    Setting("rms-eps", lambda: nn.RMSNorm(8, eps=1e-2), _sizes(3, 8)),
    Setting("rms-multi-dim-shape", lambda: nn.RMSNorm((3, 4)), _sizes(2, 3, 4)),
    Setting("rms-unbatched", lambda: nn.RMSNorm(8), ((8,),) * 3),
]

ALL = BATCH_NORM + LAYER_NORM + GROUP_NORM + RMS_NORM
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float64, id="fp64")]


def _ids(settings: Sequence[Setting]) -> list[str]:
    return [s.id for s in settings]


def cubic_loss(output: Tensor) -> Tensor:
    # Not sum(y^2): over a normalised output that is nearly constant, and so is its gradient.
    return (output.float() ** 3).sum() / output.numel()


def run_micro_batches(
    module: nn.Module,
    setting: Setting,
    *,
    dtype: torch.dtype,
    input_dtype: torch.dtype | None = None,
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    device: str = "cpu",
) -> None:
    """Patched ``module`` and a plain copy through the setting's micro-batches: equal outputs
    (values, dtype, strides), equal input gradients during backward-p1, one job per call and no
    ``.grad`` before the flush, equal ``.grad`` and buffers after it."""
    rtol, atol = TOLERANCES[dtype]
    patched, reference = patched_and_reference(module.to(device))
    for shape in setting.shapes:
        x = setting.input(shape, input_dtype or dtype, device)
        xp, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        with context():
            yp, yr = patched(xp), reference(xr)
        assert yp.dtype == yr.dtype and yp.stride() == yr.stride()
        if device == "cpu":
            assert torch.equal(yp, yr), "the deferred forward must compute exactly the module's output"
        else:  # plain BatchNorm may run cuDNN there, the deferred one the native kernel
            torch.testing.assert_close(yp, yr, rtol=rtol, atol=atol)
        cubic_loss(yp).backward()
        cubic_loss(yr).backward()
        assert xr.grad.abs().max() > 1e-3, "degenerate check: the input gradient is ~0"
        torch.testing.assert_close(xp.grad, xr.grad, rtol=rtol, atol=atol)
    assert_no_grads(patched)
    assert twobp.pending().jobs == len(setting.shapes), "each call must queue one weight-grad job"
    twobp.flush_weight_grads()
    assert twobp.pending() == (0, 0)
    assert_grads_match(patched, reference, dtype)
    for (name, b), (_, c) in zip(patched.named_buffers(), reference.named_buffers(), strict=True):
        torch.testing.assert_close(b, c, rtol=rtol, atol=atol, msg=lambda m, name=name: f"buffer {name}: {m}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("setting", ALL, ids=_ids(ALL))
def test_weight_grads_match_autograd(setting: Setting, dtype: torch.dtype) -> None:
    shapes = itertools.cycle(setting.shapes)
    check_against_autograd(
        setting.module(dtype),
        lambda: (setting.input(next(shapes), dtype),),
        micro_batches=len(setting.shapes),
        dtype=dtype,
        loss=cubic_loss,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("setting", ALL, ids=_ids(ALL))
def test_outputs_input_grads_and_buffers_match_autograd(setting: Setting, dtype: torch.dtype) -> None:
    run_micro_batches(setting.module(dtype), setting, dtype=dtype)


AUTOCAST = [BATCH_NORM[2], BATCH_NORM[3], LAYER_NORM[0], LAYER_NORM[2], GROUP_NORM[2], GROUP_NORM[3], RMS_NORM[0]]


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # plain rms_norm's own
@pytest.mark.parametrize(
    "input_dtype", [pytest.param(torch.float32, id="fp32-input"), pytest.param(torch.bfloat16, id="bf16-input")]
)
@pytest.mark.parametrize("setting", AUTOCAST, ids=_ids(AUTOCAST))
def test_cpu_autocast_bf16(setting: Setting, input_dtype: torch.dtype) -> None:
    # CPU autocast leaves the norms alone: a bf16 input meets fp32 parameters (mixed dtypes).
    def autocast() -> contextlib.AbstractContextManager:
        return torch.autocast("cpu", dtype=torch.bfloat16)

    run_micro_batches(
        setting.module(torch.float32), setting, dtype=torch.bfloat16, input_dtype=input_dtype, context=autocast
    )


@pytest.mark.parametrize(
    "norm", [nn.LayerNorm(8), nn.RMSNorm(8), nn.BatchNorm1d(3)], ids=["layer-norm", "rms-norm", "batch-norm"]
)
def test_cpu_autocast_after_linear(norm: nn.Module) -> None:
    model = nn.Sequential(nn.Linear(8, 8), norm)
    patched, reference = patched_and_reference(model)
    for batch in (4, 6, 3):
        x = torch.randn(batch, 3, 8)
        for m in (patched, reference):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = m(x.clone())
            assert y.dtype == torch.bfloat16
            cubic_loss(y).backward()
    assert_no_grads(patched)
    assert twobp.pending().jobs == 6
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.bfloat16)


FROZEN_WEIGHT = [BATCH_NORM[2], LAYER_NORM[0], GROUP_NORM[2]]


@pytest.mark.parametrize("setting", FROZEN_WEIGHT, ids=_ids(FROZEN_WEIGHT))
def test_frozen_weight_trainable_bias(setting: Setting) -> None:
    module = setting.module(torch.float32)
    module.weight.requires_grad_(False)
    run_micro_batches(module, setting, dtype=torch.float32)
    assert module.weight.grad is None and module.bias.grad is not None


AUTOGRAD_GRAD = [BATCH_NORM[2], LAYER_NORM[2], GROUP_NORM[2], RMS_NORM[2]]


@pytest.mark.parametrize("setting", AUTOGRAD_GRAD, ids=_ids(AUTOGRAD_GRAD))
def test_autograd_grad_gets_weight_grads_at_once(setting: Setting) -> None:
    """autograd.grad asking for one parameter runs the kernel at once for it alone."""
    patched, reference = patched_and_reference(setting.module(torch.float64))
    x = setting.input(setting.shapes[0], torch.float64)
    for name, param in patched.named_parameters():
        (got,) = torch.autograd.grad(cubic_loss(patched(x)), [param])
        (want,) = torch.autograd.grad(cubic_loss(reference(x)), [reference.get_parameter(name)])
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert twobp.pending().jobs == 0
    assert_no_grads(patched)


@pytest.mark.parametrize("setting", AUTOGRAD_GRAD, ids=_ids(AUTOGRAD_GRAD))
def test_create_graph_is_refused(setting: Setting) -> None:
    patched = twobp.patch(setting.module(torch.float64))
    x = setting.input(setting.shapes[0], torch.float64)
    with pytest.raises(RuntimeError, match="create_graph"):
        torch.autograd.grad(cubic_loss(patched(x)), list(patched.parameters()), create_graph=True)


def test_batch_norm_eval_takes_the_plain_path() -> None:
    module = BATCH_NORM[2].module(torch.float32)
    patched, reference = patched_and_reference(module)
    patched.eval(), reference.eval()
    x = torch.randn(2, 3, 4, 5)
    cubic_loss(patched(x)).backward()
    cubic_loss(reference(x)).backward()
    assert twobp.pending().jobs == 0
    assert patched.weight.grad is not None
    assert_grads_match(patched, reference)


def test_batch_norm_without_affine_is_never_deferred() -> None:
    patched, reference = patched_and_reference(nn.BatchNorm2d(3, affine=False, momentum=None))
    for batch in (4, 2):
        x = torch.randn(batch, 3, 4, 5)
        xp, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        cubic_loss(patched(xp)).backward()
        cubic_loss(reference(xr)).backward()
        torch.testing.assert_close(xp.grad, xr.grad)
    assert twobp.pending().jobs == 0
    for b, c in zip(patched.buffers(), reference.buffers(), strict=True):
        torch.testing.assert_close(b, c)


def test_batch_norm_keeps_its_errors() -> None:
    patched = twobp.patch(nn.BatchNorm1d(4))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        patched(torch.randn(1, 4))
    with pytest.raises(ValueError, match="expected 2D or 3D input"):
        patched(torch.randn(2, 4, 3, 3))
    assert twobp.pending().jobs == 0


@pytest.mark.parametrize(
    "track_running_stats, refused", [(True, "running_mean"), (False, "weight")], ids=["running-stats", "batch-stats"]
)
def test_batch_norm_refuses_the_wrong_number_of_channels(track_running_stats: bool, refused: str) -> None:
    """As plain does: the native op the patched forward calls checks nothing, and read (and
    wrote) past the end of the statistics, or returned a silently wrong output."""
    plain = nn.BatchNorm1d(3, track_running_stats=track_running_stats)
    patched = twobp.patch(copy.deepcopy(plain))
    x = torch.randn(4, 5, requires_grad=True)
    message = f"{refused} should contain 5 elements not 3"
    for module in (plain, patched):
        with pytest.raises(RuntimeError, match=message):
            module(x)
    assert twobp.pending().jobs == 0


UNPATCH = [BATCH_NORM[2], LAYER_NORM[0], GROUP_NORM[2], RMS_NORM[0]]


@pytest.mark.parametrize("setting", UNPATCH, ids=_ids(UNPATCH))
def test_unpatch_restores_plain_autograd(setting: Setting) -> None:
    module = setting.module(torch.float32)
    reference = copy.deepcopy(module)
    twobp.unpatch(twobp.patch(module))
    x = setting.input(setting.shapes[0], torch.float32)
    cubic_loss(module(x)).backward()
    cubic_loss(reference(x)).backward()
    assert twobp.pending().jobs == 0
    assert module.weight.grad is not None
    assert_grads_match(module, reference)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "fast_dtype", [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]
)
@pytest.mark.parametrize("setting", AUTOCAST, ids=_ids(AUTOCAST))
def test_cuda_autocast(setting: Setting, fast_dtype: torch.dtype) -> None:
    # CUDA autocast runs layer_norm and group_norm in float32: the deferred forward must too.
    def autocast() -> contextlib.AbstractContextManager:
        return torch.autocast("cuda", dtype=fast_dtype)

    run_micro_batches(
        setting.module(torch.float32),
        setting,
        dtype=torch.bfloat16,
        input_dtype=fast_dtype,
        context=autocast,
        device="cuda",
    )


def test_autocast_casts_follow_the_public_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """What autocast does to the public op is read off the op itself, so the native op the
    forward calls gets the same arguments on any device; CPU autocast leaves the norms alone."""
    target = autocast.autocast_target
    target.cache_clear()
    monkeypatch.setitem(autocast.AUTOCAST_PROBES, "fp32-listed", lambda x: x.float())
    monkeypatch.setitem(autocast.AUTOCAST_PROBES, "fast-listed", lambda x: x.to(torch.bfloat16))
    monkeypatch.setitem(autocast.AUTOCAST_PROBES, "unlisted", lambda x: x)
    assert target("fp32-listed", "cpu", torch.bfloat16) == torch.float32
    assert target("fast-listed", "cpu", torch.bfloat16) == torch.bfloat16
    assert target("unlisted", "cpu", torch.bfloat16) is None
    for op in ("batch_norm", "layer_norm", "group_norm", "rms_norm"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert target(op, "cpu", torch.bfloat16) is None, op
    target.cache_clear()

    x, w, i, d = torch.randn(2, 3), torch.randn(3), torch.arange(3), torch.randn(3, dtype=torch.float64)
    monkeypatch.setitem(autocast.AUTOCAST_PROBES, "layer_norm", lambda x: x.float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast_input, cast_params = autocast.as_autocast_casts("layer_norm", x.bfloat16(), w.bfloat16(), i, d, None)
    assert cast_input.dtype == torch.float32
    assert [t.dtype for t in cast_params[:3]] == [torch.float32, torch.int64, torch.float64]
    assert cast_params[3] is None
    assert autocast.as_autocast_casts("layer_norm", x.bfloat16())[0].dtype == torch.bfloat16  # autocast off
    target.cache_clear()


WEIGHT_NORM = [BATCH_NORM[2], LAYER_NORM[0], GROUP_NORM[2]]


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("setting", WEIGHT_NORM, ids=_ids(WEIGHT_NORM))
def test_weight_rebuilt_each_call_differentiates_at_once(setting: Setting) -> None:
    """Under weight_norm the weight is no leaf: its gradient flows into weight_g/weight_v at
    once, and only the bias (a leaf) is deferred."""
    module = setting.module(torch.float64)
    reference = nn.utils.weight_norm(copy.deepcopy(module), dim=None)  # no deepcopy after it
    patched = twobp.patch(nn.utils.weight_norm(module, dim=None))
    for shape in setting.shapes:
        x = setting.input(shape, torch.float64)
        cubic_loss(patched(x)).backward()
        cubic_loss(reference(x)).backward()
    assert patched.weight_g.grad is not None and patched.weight_v.grad is not None
    assert patched.bias.grad is None
    assert twobp.pending().jobs == len(setting.shapes)
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)


# -- BatchNorm: dgamma and dbeta finished in backward-p1 ---------------------------------------


def _batch_norm_twins(dtype: torch.dtype = torch.float64) -> tuple[nn.Module, nn.Module]:
    return patched_and_reference(BATCH_NORM[2].module(dtype))


def _batch_norm_input(batch: int = 4, dtype: torch.dtype = torch.float64) -> Tensor:
    return BATCH_NORM[2].input((batch, *BATCH_NORM[2].shapes[0][1:]), dtype).requires_grad_()


def test_batch_norm_queues_its_finished_grads_not_its_input() -> None:
    """A BatchNorm job holds dgamma and dbeta (2 x C numbers), not the input activation: the
    input may even change in place before the flush."""
    patched, reference = _batch_norm_twins(torch.float32)
    channels = patched.num_features
    inputs = [_batch_norm_input(batch, torch.float32) for batch in (4, 6, 3)]
    for x in inputs:
        cubic_loss(patched(x)).backward()
        cubic_loss(reference(x.detach().clone())).backward()
    per_job = 2 * channels * 4
    assert per_job < inputs[0].numel() * 4
    assert twobp.pending() == (3, 3 * per_job)
    assert_no_grads(patched)
    with torch.no_grad():
        for x in inputs:
            x.zero_()  # the queue holds no reference to it: no version error at the flush
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference)


def test_batch_norm_input_only_backward_queues_nothing() -> None:
    patched, reference = _batch_norm_twins()
    x = _batch_norm_input()
    x_ref = x.detach().clone().requires_grad_()
    (got,) = torch.autograd.grad(cubic_loss(patched(x)), [x])
    (want,) = torch.autograd.grad(cubic_loss(reference(x_ref)), [x_ref])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert twobp.pending().jobs == 0
    cubic_loss(patched(x)).backward(inputs=[x])
    cubic_loss(reference(x_ref)).backward(inputs=[x_ref])
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-10, atol=1e-12)
    assert twobp.pending().jobs == 0
    assert_no_grads(patched)
    twobp.flush_weight_grads()
    assert_no_grads(patched)


@pytest.mark.parametrize(
    "wanted", [["weight", "bias"], ["weight"], ["input", "bias"]], ids=["weight-and-bias", "weight", "input-and-bias"]
)
def test_batch_norm_autograd_grad_returns_what_it_asks_at_once(wanted: list[str]) -> None:
    patched, reference = _batch_norm_twins()
    x = _batch_norm_input()
    x_ref = x.detach().clone().requires_grad_()
    pick_p = {"input": x, "weight": patched.weight, "bias": patched.bias}
    pick_r = {"input": x_ref, "weight": reference.weight, "bias": reference.bias}
    got = torch.autograd.grad(cubic_loss(patched(x)), [pick_p[w] for w in wanted])
    want = torch.autograd.grad(cubic_loss(reference(x_ref)), [pick_r[w] for w in wanted])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    assert twobp.pending().jobs == 0
    assert_no_grads(patched)


def test_batch_norm_backward_with_weight_inputs_defers_that_weight_only() -> None:
    patched, reference = _batch_norm_twins()
    x = _batch_norm_input()
    cubic_loss(patched(x)).backward(inputs=[patched.weight])
    cubic_loss(reference(x.detach().clone())).backward(inputs=[reference.weight])
    assert x.grad is None and twobp.pending().jobs == 1
    assert twobp.pending().bytes == patched.num_features * 8  # dgamma alone
    assert_no_grads(patched)
    twobp.flush_weight_grads()
    assert patched.bias.grad is None
    assert_grads_match(patched, reference, torch.float64)


def test_batch_norm_retain_graph_backward_twice() -> None:
    patched, reference = _batch_norm_twins()
    x = _batch_norm_input()
    for model in (patched, reference):
        loss = cubic_loss(model(x.detach().clone()))
        loss.backward(retain_graph=True)
        loss.backward()
    assert twobp.pending().jobs == 2
    assert_no_grads(patched)
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)


def test_batch_norm_called_twice_in_one_forward() -> None:
    """Two calls, two sets of statistics, two jobs; the running statistics move twice."""
    patched, reference = _batch_norm_twins()
    x = _batch_norm_input()
    x_ref = x.detach().clone().requires_grad_()
    cubic_loss(patched(torch.tanh(patched(x)))).backward()
    cubic_loss(reference(torch.tanh(reference(x_ref)))).backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-10, atol=1e-12)
    assert twobp.pending().jobs == 2
    assert_no_grads(patched)
    twobp.flush_weight_grads()
    assert_grads_match(patched, reference, torch.float64)
    for b, c in zip(patched.buffers(), reference.buffers(), strict=True):
        torch.testing.assert_close(b, c, rtol=1e-10, atol=1e-12)
    assert int(patched.num_batches_tracked) == 2


def test_batch_norm_jobs_go_to_the_queue_and_tag_of_their_forward() -> None:
    patched, reference = _batch_norm_twins()
    queue = twobp.WeightGradQueue()
    xs = [_batch_norm_input(batch) for batch in (4, 5)]
    outputs = []
    with twobp.use_queue(queue):
        for mb, x in enumerate(xs):
            with queue.tagged(mb):
                outputs.append(patched(x))
    for out in outputs:  # backward outside any use_queue / tagged block
        cubic_loss(out).backward()
    assert (queue.tags(), twobp.pending().jobs) == ([0, 1], 0)
    queue.flush(tags=[1])
    cubic_loss(reference(xs[1].detach().clone())).backward()
    assert_grads_match(patched, reference, torch.float64)
    queue.flush(tags=[0])
    cubic_loss(reference(xs[0].detach().clone())).backward()
    assert_grads_match(patched, reference, torch.float64)
    assert queue.pending() == (0, 0)


@pytest.mark.parametrize("strategy", ["loop", "concat"])
def test_batch_norm_flush_leaves_the_finished_grads_untouched(strategy: str) -> None:
    """The kernel hands back tensors the job holds: summing them must not write into them."""
    from twobp_autograd.flush import FlushOptions, run_jobs
    from twobp_autograd.queue import current_queue

    patched, reference = _batch_norm_twins()
    for batch in (4, 6, 3):
        x = _batch_norm_input(batch)
        cubic_loss(patched(x)).backward()
        cubic_loss(reference(x.detach().clone())).backward()
    patched.weight.grad = torch.ones_like(patched.weight)  # .grad already there: accumulated into
    reference.weight.grad = reference.weight.grad + 1
    jobs = current_queue().take()
    before = [[t.clone() for t in job.saved] for job in jobs]
    run_jobs(jobs, FlushOptions(strategy))
    for job, kept in zip(jobs, before, strict=True):
        for t, k in zip(job.saved, kept, strict=True):
            assert torch.equal(t, k)
    assert_grads_match(patched, reference, torch.float64)


def test_batch_norm_create_graph_on_the_input_alone_is_refused() -> None:
    patched = twobp.patch(BATCH_NORM[2].module(torch.float64))
    x = _batch_norm_input()
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(cubic_loss(patched(x)), [x], create_graph=True)
    assert twobp.pending().jobs == 0
