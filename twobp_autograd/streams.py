"""Backward-p2 on several CUDA streams: the layers' weight-gradient kernels of one flush are
independent of each other, so they may run side by side (the paper's open question: do
small kernels that leave the GPU half idle gain from it?).

``WeightGradQueue(weight_grad_streams=k)``: the flush first launches every layer's kernel,
layer i on side stream i mod k (each side stream first waits for the flush's stream, where
the queued tensors were made); then, in layer order on the flush's stream, it waits for each
layer's event and sums and delivers its gradients as a one-stream flush does. Memory crossing
streams is marked with ``record_stream`` so the caching allocator does not hand it out while
another stream still reads it. Groups not on CUDA run at launch, in order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = ["LaunchedGroups"]

GroupGrads = Sequence["Tensor | None"]


class LaunchedGroups:
    """The kernels of ``groups`` launched on ``count`` side streams per device; :meth:`take`
    returns one group's gradients, usable on the current stream."""

    def __init__(
        self,
        groups: Sequence[tuple[torch.device, Sequence[Tensor]]],
        run_group: Callable[[int], GroupGrads],
        count: int,
    ) -> None:
        """``groups[i]``: the device of group ``i`` and the tensors it reads; ``run_group(i)``
        runs its kernels."""
        self._results: list[tuple[GroupGrads, torch.cuda.Event | None, torch.device] | None] = []
        started: set[torch.device] = set()
        for index, (device, tensors) in enumerate(groups):
            if device.type != "cuda":
                self._results.append((run_group(index), None, device))
                continue
            streams = _side_streams(device, count)
            if device not in started:
                started.add(device)
                for stream in streams:
                    stream.wait_stream(torch.cuda.current_stream(device))
            stream = streams[index % count]
            with torch.cuda.stream(stream):
                grads = run_group(index)
                done = torch.cuda.Event()
                done.record(stream)
            for tensor in tensors:
                if tensor.is_cuda:  # made on the flush's stream, read on this one
                    tensor.record_stream(stream)
            self._results.append((grads, done, device))

    def take(self, index: int) -> GroupGrads:
        result = self._results[index]
        assert result is not None, "each group's gradients are taken once"
        self._results[index] = None
        grads, done, device = result
        if done is not None:
            current = torch.cuda.current_stream(device)
            current.wait_event(done)
            for grad in grads:
                if grad is not None:
                    grad.record_stream(current)
        return grads


@functools.cache
def _side_streams(device: torch.device, count: int) -> tuple[torch.cuda.Stream, ...]:
    return tuple(torch.cuda.Stream(device) for _ in range(count))
