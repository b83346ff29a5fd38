"""The runtime's peak memory on a CPU: the heap in use over the step's start, and what it falls
back to without glibc's mallinfo2."""

from __future__ import annotations

import mmap

import pytest
import torch

from twobp_autograd import WeightGradQueue
from twobp_autograd.pipeline import memory_probe
from twobp_autograd.pipeline.memory_probe import MemoryProbe, heap_in_use, peak_rss

MIB = 2**20


@pytest.mark.skipif(heap_in_use() is None, reason="needs glibc's mallinfo2")
def test_heap_probe_sees_a_tensor_held_between_actions() -> None:
    probe = MemoryProbe(torch.device("cpu"), WeightGradQueue())
    held = torch.ones(8 * MIB, dtype=torch.uint8)
    probe.sample([])
    del held
    probe.sample([])
    assert 8 * MIB <= probe.peak_bytes() < 16 * MIB
    assert probe.deferred_jobs == 0 and probe.peak_pending_bytes == 0
    assert peak_rss() > 0


class _CountedQueue(WeightGradQueue):
    reads = 0

    def pending(self):
        self.reads += 1
        return super().pending()


@pytest.mark.skipif(heap_in_use() is None, reason="needs glibc's mallinfo2")
def test_the_queue_is_read_only_after_actions_that_may_queue_work() -> None:
    queue = _CountedQueue()
    probe = MemoryProbe(torch.device("cpu"), queue)
    probe.sample([], queued_more=False)
    assert queue.reads == 0
    probe.sample([])
    assert queue.reads == 1


def test_without_mallinfo2_it_counts_the_held_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory_probe, "heap_in_use", lambda: None)
    probe = MemoryProbe(torch.device("cpu"), WeightGradQueue())
    probe.sample([torch.zeros(256), torch.zeros(2, 8, dtype=torch.float64)])
    assert probe.peak_bytes() == 256 * 4 + 16 * 8


def _touch_and_free(size: int) -> int:
    """Map, touch and free ``size`` bytes; the resident set's high-water mark just after."""
    block = torch.ones(size, dtype=torch.uint8)  # ones: every page is written, hence resident
    block.add_(1)
    high = memory_probe.step_peak_rss()[0]
    del block
    return high


def _two_steps_around_a_transient(rank: int) -> dict:
    """One rank's runtime: a step, 200 MiB touched and freed, then a step that allocates nothing
    new. Spawned, so that the process's high-water mark is this scenario's alone."""
    import torch.nn.functional as F
    from torch import nn

    from twobp_autograd.pipeline import PipelineRuntime, split_model
    from twobp_autograd.pipeline.schedules import schedule

    torch.manual_seed(0)
    stage = split_model(nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4)), 1)[0]
    runtime = PipelineRuntime(stage, schedule("gpipe", 1, 2, True)[0], num_micro_batches=2, loss_fn=F.mse_loss)
    inputs, targets = torch.randn(4, 8), torch.randn(4, 4)
    by_default = runtime.step(inputs, targets, gather=False)  # leaves the process's mark alone
    untouched_high = _touch_and_free(200 * MIB)
    untouched = runtime.step(inputs, targets, gather=False)
    runtime.step_peak_rss = True
    first = runtime.step(inputs, targets, gather=False)
    high = _touch_and_free(200 * MIB)
    second = runtime.step(inputs, targets, gather=False)
    return {
        "by_default": by_default, "untouched": untouched, "untouched_high": untouched_high,
        "first": first, "second": second, "high": high,
    }  # fmt: skip


@pytest.mark.skipif(not memory_probe.reset_peak_rss(), reason="needs Linux's /proc/self/clear_refs (peak RSS reset)")
def test_each_step_reports_its_own_peak_rss(tmp_path) -> None:
    """getrusage's ru_maxrss is the process's peak since it started: every step after the
    transient reported it, so 2BP on and off (runs taking turns) showed the same figure. Asked
    for (``step_peak_rss``, as ``bench pipeline`` asks), each step resets the mark; by default
    the runtime leaves the process's mark alone."""
    from tests.ranks import run_scenario

    (result,) = run_scenario(_two_steps_around_a_transient, 1, str(tmp_path))
    # By default the process's peak, as getrusage reads it: the transient stays in it.
    assert result["by_default"].peak_rss_scope == result["untouched"].peak_rss_scope == "process"
    assert result["untouched"].peak_rss >= result["untouched_high"] - MIB  # VmHWM and ru_maxrss: pages apart
    first, second = result["first"], result["second"]
    assert first.peak_rss_scope == second.peak_rss_scope == "step"
    assert 0 < second.peak_rss < result["high"] - 100 * MIB
    assert second.peak_rss < first.peak_rss + 64 * MIB


@pytest.mark.skipif(not memory_probe.reset_peak_rss(), reason="needs Linux's /proc/self/clear_refs (peak RSS reset)")
def test_the_step_peak_rss_sees_what_the_step_touched() -> None:
    """Freshly mapped pages (an anonymous ``mmap``: a tensor may reuse pages already resident)
    touched and unmapped inside the step stay in its peak. Read against the resident set around
    them, not the step's start: the kernel may reclaim file pages (the libraries' code) meanwhile."""
    probe = MemoryProbe(torch.device("cpu"), WeightGradQueue(), reset_rss=True)
    block = mmap.mmap(-1, 64 * MIB)
    for offset in range(0, 64 * MIB, mmap.PAGESIZE):
        block[offset] = 1
    while_mapped = _resident()
    block.close()
    after = _resident()
    peak, scope = probe.peak_rss()
    assert scope == "step"
    assert while_mapped >= after + 48 * MIB  # the pages were resident, then given back
    assert peak >= while_mapped - 4 * MIB


def _resident() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        (line,) = (line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def test_without_a_resettable_peak_rss_it_says_the_process_peak(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(memory_probe, "_CLEAR_REFS", str(tmp_path / "absent" / "clear_refs"))
    probe = MemoryProbe(torch.device("cpu"), WeightGradQueue(), reset_rss=True)
    peak, scope = probe.peak_rss()
    assert scope == "process" and peak == peak_rss() > 0
