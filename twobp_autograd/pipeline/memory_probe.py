"""Peak memory of one rank over one pipeline step, comparable between 2BP off and on.

On CUDA the allocator keeps its own peak. On a CPU nothing does, so the probe samples the
heap in use after every action (glibc's ``mallinfo2``: tensors, autograd's saved activations
and queued weight-gradient work alike) and keeps the most over the step's start. Transients
inside an action are not seen. Without ``mallinfo2`` (not glibc, or older than 2.33) it falls
back to what it can count: queued work plus the stage inputs and outputs held for backward.

The peak resident set is the process's peak since it started, or, asked for (``reset_rss``,
which ``bench pipeline`` asks for), the step's, where Linux lets the process reset its
high-water mark (``/proc/self/clear_refs``): a process-wide reset, which ``getrusage``'s
``ru_maxrss`` reads too, so a library leaves it to the process's owner.
"""

from __future__ import annotations

import ctypes
import functools
import resource
import sys
from collections.abc import Callable, Iterable
from typing import Protocol

import torch
from torch import Tensor

from ..queue import PendingWork

__all__ = ["MemoryProbe", "PendingSource", "heap_in_use", "peak_rss", "reset_peak_rss", "step_peak_rss"]


class PendingSource(Protocol):
    """What the probe reads queued work from: a :class:`~twobp_autograd.WeightGradQueue`, or
    several stages' queues counted as one."""

    def pending(self) -> PendingWork: ...


class MemoryProbe:
    """Created at a step's start; :meth:`sample` after each action."""

    def __init__(self, device: torch.device, queue: PendingSource, *, reset_rss: bool = False) -> None:
        self.device = device
        self.queue = queue
        self.deferred_jobs = 0  # most weight-gradient jobs queued at once
        self.peak_pending_bytes = 0  # most bytes those jobs kept alive
        self._peak_bytes = 0
        self._heap_at_start = heap_in_use() if device.type == "cpu" else None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        self._rss_reset = reset_rss and reset_peak_rss()

    def sample(self, held: Iterable[Tensor], *, queued_more: bool = True) -> None:
        """``held``: the tensors the step keeps for later actions (read only without ``mallinfo2``).
        ``queued_more``: whether the action may have queued weight-gradient work (a backward).
        Only then is the queue read, where its peak can be: counting a stage's queued tensors
        takes about 1 µs a job, 0.1 ms an action on a stage of a few dozen layers."""
        counted = self.device.type == "cpu" and self._heap_at_start is None  # no mallinfo2
        pending = self.queue.pending() if queued_more or counted else None
        if pending is not None:
            self.deferred_jobs = max(self.deferred_jobs, pending.jobs)
            self.peak_pending_bytes = max(self.peak_pending_bytes, pending.bytes)
        if self.device.type == "cuda":
            return
        if pending is not None and counted:
            self._peak_bytes = max(self._peak_bytes, pending.bytes + sum(t.numel() * t.element_size() for t in held))
        else:
            self._peak_bytes = max(self._peak_bytes, (heap_in_use() or 0) - (self._heap_at_start or 0))

    def peak_bytes(self) -> int:
        """CUDA: ``max_memory_allocated`` since the step began; CPU: the sampled peak."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return self._peak_bytes

    def peak_rss(self) -> tuple[int, str]:
        """The peak resident set in bytes and its scope: ``"step"`` (since the probe was created)
        where the high-water mark could be reset, else ``"process"`` (since the process began)."""
        return step_peak_rss() if self._rss_reset else (peak_rss(), "process")


def peak_rss() -> int:
    """The process's peak resident set since it started, in bytes."""
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024  # bytes on macOS, KiB elsewhere


_CLEAR_REFS = "/proc/self/clear_refs"


def reset_peak_rss() -> bool:
    """Start the resident set's high-water mark (``VmHWM``) over at the current resident set
    (Linux 4.0 and later: "5" to ``/proc/self/clear_refs``). False where that is not possible
    (not Linux, no permission): :func:`step_peak_rss` then reports the process's peak."""
    try:
        with open(_CLEAR_REFS, "w", encoding="ascii") as file:
            file.write("5")
    except OSError:
        return False
    return _vm_hwm() is not None


def step_peak_rss() -> tuple[int, str]:
    """The peak resident set since :func:`reset_peak_rss` (``"step"``), or the process's peak
    where ``/proc/self/status`` has no ``VmHWM`` (``"process"``); in bytes."""
    hwm = _vm_hwm()
    return (hwm, "step") if hwm is not None else (peak_rss(), "process")


def _vm_hwm() -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as file:
            for line in file:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


@functools.cache
def _mallinfo2() -> Callable[[], _MallInfo2] | None:
    try:
        function = ctypes.CDLL("libc.so.6").mallinfo2  # glibc 2.33 and later
    except (OSError, AttributeError):
        return None
    function.restype = _MallInfo2
    return function


def heap_in_use() -> int | None:
    """Bytes the process has malloc'ed and not freed (every arena and mmap), or None without
    glibc's ``mallinfo2``. About 10 µs a call."""
    mallinfo2 = _mallinfo2()
    if mallinfo2 is None:
        return None
    info = mallinfo2()
    return info.uordblks + info.hblkhd
