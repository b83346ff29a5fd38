"""PyTorch's own pipeline schedules (``torch.distributed.pipelining``) on our stages: the
baseline our schedules are measured against, on the same modules (same parameters), the same
micro-batches and the same placement of stages on ranks.

A PyTorch run uses the stage modules unpatched (plain autograd, PyTorch's own split of I and
W for its zero-bubble schedules), or, given ``dw_builder`` per stage, our deferred W. The
stage shapes are given up front (the micro-batch through the model in this process), so the
first step exchanges nothing extra.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .. import patch, unpatch

__all__ = ["TORCH_SCHEDULES", "TorchPipeline", "torch_placement", "timed", "stage_examples"]

#: our name for each PyTorch schedule -> (its class name, the placement it uses)
TORCH_SCHEDULES: dict[str, tuple[str, str]] = {
    "torch-gpipe": ("ScheduleGPipe", "one"),
    "torch-1f1b": ("Schedule1F1B", "one"),
    "torch-interleaved-1f1b": ("ScheduleInterleaved1F1B", "loop"),
    "torch-interleaved-zb": ("ScheduleInterleavedZeroBubble", "loop"),
    "torch-zbv": ("ScheduleZBVZeroBubble", "v"),
}


def torch_placement(name: str, num_ranks: int) -> tuple[int, ...]:
    """The rank of each stage of PyTorch schedule ``name``: one per rank, the loop or the V."""
    kind = TORCH_SCHEDULES[name][1]
    if kind == "one":
        return tuple(range(num_ranks))
    if kind == "loop":
        return tuple(stage % num_ranks for stage in range(2 * num_ranks))
    return tuple(stage if stage < num_ranks else 2 * num_ranks - 1 - stage for stage in range(2 * num_ranks))


@dataclass
class TorchPipeline:
    """One PyTorch schedule over this rank's stage modules (``modules[stage]``)."""

    name: str
    modules: dict[int, nn.Module]
    schedule: Any
    num_stages: int
    deferred: bool  # our deferred W as dw_builder: the modules stay patched

    @classmethod
    def build(
        cls,
        name: str,
        modules: Mapping[int, nn.Module],
        stage_shapes: Mapping[int, tuple[Tensor, Tensor]],
        num_micro_batches: int,
        loss_fn: Callable[[Tensor, Tensor], Tensor],
        device: torch.device,
        *,
        dw_builders: Mapping[int, Callable[[], Callable[[], None]]] | None = None,
    ) -> TorchPipeline:
        """``stage_shapes[stage]``: an example (input, output) of one micro-batch;
        ``dw_builders[stage]``: :func:`.dw_builder` of the patched module, to run our W."""
        from torch.distributed import pipelining

        num_stages = len(torch_placement(name, dist.get_world_size()))
        stages = []
        for index in sorted(modules):
            example_in, example_out = stage_shapes[index]
            input_grad = index > 0 and example_in.is_floating_point()
            extra: dict[str, Any] = {} if dw_builders is None else {"dw_builder": dw_builders[index]}
            stages.append(
                pipelining.PipelineStage(
                    modules[index], index, num_stages, device,
                    input_args=torch.empty_like(example_in).requires_grad_(input_grad),
                    output_args=torch.empty_like(example_out).requires_grad_(True), **extra,
                )
            )  # fmt: skip
        schedule_class = getattr(pipelining, TORCH_SCHEDULES[name][0])
        schedule = schedule_class(
            stages if len(stages) > 1 else stages[0], n_microbatches=num_micro_batches, loss_fn=loss_fn
        )
        return cls(name, dict(modules), schedule, num_stages, dw_builders is not None)

    def step(self, inputs: Tensor | None, targets: Tensor | None) -> None:
        """One step; ``inputs`` on the rank of stage 0, ``targets`` on the last stage's."""
        for module in self.modules.values():
            (patch if self.deferred else unpatch)(module)
        args = (inputs,) if 0 in self.modules else ()
        target = targets if self.num_stages - 1 in self.modules else None
        self.schedule.step(*args, target=target)


def timed(step: Callable[[], Any]) -> float:
    """Seconds of ``step`` on the slowest rank: between two barriers."""
    dist.barrier()
    start = time.perf_counter()
    step()
    dist.barrier()
    return time.perf_counter() - start


def stage_examples(stages: list[nn.Module], micro_batch: Tensor) -> dict[int, tuple[Tensor, Tensor]]:
    """Each stage's input and output on ``micro_batch``, run through the stages in this process."""
    examples = {}
    x = micro_batch
    with torch.no_grad():
        for index, stage in enumerate(stages):
            out = stage(x)
            examples[index] = (x, out)
            x = out
    return examples
