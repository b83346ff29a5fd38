"""Pending weight-gradient work parked in pinned host memory while it waits for the flush.

Between backward-p1 and backward-p2 a queued job holds a layer's input activation and output
gradient: with many micro-batches in flight that is what makes 2BP's peak memory grow (the
paper measured up to 2.67x). With ``WeightGradQueue(offload_to_host=True)`` each CUDA tensor
of a job is copied, as the job is queued, into pinned host memory on a side stream (so the
copy overlaps the rest of backward-p1), and the device tensor is let go; the flush copies it
back just before the layer's kernel runs. Tensors on other devices stay where they are.

Ordering, the part a CUDA user must be able to trust:
- the copy starts after the work that produced the tensor (the side stream waits for the
  stream that queued it); the device memory is not reused before the copy has read it
  (``record_stream``), nor written in place: the device tensors stay referenced until their copy
  is done (or the backward has ended, below), so autograd does not accumulate another gradient
  into an output gradient it finds no other holder of (``s = layer(x) + z``, ``z`` used twice),
  and a change in place meanwhile (a hook's) refuses the job at the flush, as a version check
  does where nothing is parked;
- when the backward that queued the job ends, its stream waits for the copies, so anything
  the caller does afterwards (an in-place write into a reused input buffer, say) cannot race
  them; the values parked are those of backward-p1, as plain autograd would have used;
- the flush's copy back waits for the copy out (an event), on the stream the kernel runs on.

A tensor several layers saved (the input of the q/k/v or gate/up projections) is parked once:
copies are shared while the device storage they came from is alive and unmodified.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["ParkedTensors", "HostOffload"]


class ParkedTensors:
    """A job's tensors as parked: host copies (or the tensors themselves where not moved)."""

    __slots__ = ("tensors", "devices", "ready", "sources", "source_versions", "changed_while_copied")

    def __init__(
        self,
        tensors: tuple[Tensor, ...],
        devices: tuple[torch.device | None, ...],
        ready: Any,
        sources: tuple[Tensor, ...],
    ) -> None:
        self.tensors = tensors
        self.devices = devices  # where each tensor goes back to; None: it never left
        self.ready = ready  # CUDA event recorded after the copies out
        # The device tensors copied, held while their copies may run (see HostOffload._release_copied).
        self.sources = sources
        self.source_versions = [t._version for t in sources]
        # A device tensor changed in place while its copy ran: the copy may hold either values.
        self.changed_while_copied = False

    def changed(self) -> bool:
        """Whether a device tensor was changed in place while its copy may have been running."""
        return self.changed_while_copied or [t._version for t in self.sources] != self.source_versions

    def release(self) -> None:
        """Let go of the device tensors, their copies done (or ordered before anything later)."""
        self.changed_while_copied = self.changed()
        self.sources, self.source_versions = (), []

    def restore(self) -> tuple[Tensor, ...]:
        """Device copies of the parked tensors, ordered after the copy out on the current
        stream (the stream the kernel that reads them runs on)."""
        restored = []
        for tensor, device in zip(self.tensors, self.devices, strict=True):
            if device is None:
                restored.append(tensor)
                continue
            torch.cuda.current_stream(device).wait_event(self.ready)
            restored.append(tensor.to(device, non_blocking=True))
        return tuple(restored)


_CacheKey = tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype, torch.device, int]


class HostOffload:
    """Parks the CUDA tensors of queued jobs in pinned host memory (see the module docstring)."""

    def __init__(self) -> None:
        # device tensor -> its host copy, while both live: one copy for tensors saved twice
        self._copies: dict[_CacheKey, tuple[StorageWeakRef, weakref.ref[Tensor]]] = {}
        self._joins: set[tuple[int, torch.cuda.Stream]] = set()  # (backward, stream) joined at its end
        # (backward, stream) of each park whose copies may still run; a lock, as _release_copied says.
        self._in_flight: list[tuple[tuple[int, torch.cuda.Stream], ParkedTensors]] = []
        self._lock = threading.Lock()

    def park(self, tensors: Sequence[Tensor]) -> ParkedTensors | None:
        """Start copying ``tensors``' CUDA members to host memory; None if none is on CUDA."""
        devices = tuple(t.device if t.is_cuda else None for t in tensors)
        on_cuda = [t for t in tensors if t.is_cuda]
        if not on_cuda:
            return None
        device = on_cuda[0].device
        producer = torch.cuda.current_stream(device)
        copier = _copy_stream(device)
        copier.wait_stream(producer)
        self._forget_dead_copies()
        parked = []
        with torch.cuda.stream(copier):
            for tensor in tensors:
                parked.append(self._host_copy(tensor, copier) if tensor.is_cuda else tensor)
        ready = torch.cuda.Event()
        ready.record(copier)
        record = ParkedTensors(tuple(parked), devices, ready, tuple(on_cuda))
        key = (torch._C._current_graph_task_id(), producer)
        with self._lock:
            self._release_copied()
            self._in_flight.append((key, record))
        self._join_after_backward(key, copier)
        return record

    def _release_copied(self, joined: tuple[int, torch.cuda.Stream] | None = None) -> None:
        """Let go of the device tensors whose copies are done, or ordered before anything the
        stream that queued them does from now on (``joined``: that backward and stream, which now
        waits for the copies). A backward that raised never joins: its parks go as their copies
        end. Called under ``_lock``: a join runs on the thread that ran its backward, a park on
        whichever thread runs one into the same queue."""
        in_flight = []
        for key, record in self._in_flight:
            if key == joined or record.ready.query():
                record.release()
            else:
                in_flight.append((key, record))
        self._in_flight = in_flight

    def _join_after_backward(self, key: tuple[int, torch.cuda.Stream], copier: torch.cuda.Stream) -> None:
        """Make the stream that queued a park wait for the copies once the running backward
        ends (at once when called outside one); one wait per backward and stream."""
        task, producer = key

        def join() -> None:
            producer.wait_stream(copier)
            with self._lock:
                self._joins.discard(key)
                self._release_copied(joined=key)

        if task < 0:
            join()
            return
        with self._lock:
            if key in self._joins:
                return
            self._joins.add(key)
        torch.autograd.Variable._execution_engine.queue_callback(join)

    def _host_copy(self, tensor: Tensor, copier: torch.cuda.Stream) -> Tensor:
        key = (
            tensor.data_ptr(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.dtype,
            tensor.device,
            tensor._version,
        )
        known = self._copies.get(key)
        if known is not None and not known[0].expired():
            host = known[1]()
            if host is not None:
                return host
        host = torch.empty_like(tensor, device="cpu", pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        tensor.record_stream(copier)  # its memory is not reused before the copy has read it
        self._copies[key] = (StorageWeakRef(tensor.untyped_storage()), weakref.ref(host))
        return host

    def _forget_dead_copies(self) -> None:
        if len(self._copies) > 64:
            self._copies = {
                key: entry for key, entry in self._copies.items() if not entry[0].expired() and entry[1]() is not None
            }


@functools.cache
def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)
