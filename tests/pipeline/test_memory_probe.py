"""The runtime's peak memory on a CPU: the heap in use over the step's start, and what it falls
back to without glibc's mallinfo2."""

from __future__ import annotations

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
