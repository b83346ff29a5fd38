"""Parameters that several stages hold (tied input and output embeddings, on the first and
the last stage): each holding rank gets only its own use's part of the gradient, so the parts
are summed over those ranks before the optimizer step, and every copy takes the same step.

Where one rank holds several stages (interleaved 1F1B's loop, ZB-V's V), the tie's stages may
share a rank: there both uses accumulate into the one parameter already, and only the distinct
ranks sum (none at all when a single rank holds every use, as the V's rank 0 does)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from .pipeline_model import PipelineModel

__all__ = ["Tie", "TiedGradients", "ties_of"]


@dataclass(frozen=True)
class Tie:
    """A parameter that several stages hold."""

    name: str  # its qualified name in the model
    parameter: nn.Parameter
    stages: tuple[int, ...]


def ties_of(model: nn.Module, stages: Sequence[nn.Module]) -> list[Tie]:
    """The parameters of ``model`` that more than one of ``stages`` holds."""
    holders: dict[int, list[int]] = {}
    for index, stage in enumerate(stages):
        for p in stage.parameters():
            holders.setdefault(id(p), []).append(index)
    return [
        Tie(name, p, tuple(holders[id(p)]))
        for name, p in model.named_parameters()
        if len(holders.get(id(p), ())) > 1
    ]


class TiedGradients:
    """Sums the gradients of tied parameters over the ranks whose stages hold them.

    Build it on every rank, in the same order as any other process groups (it creates one
    group per set of two or more owning ranks, which every rank must take part in), with the
    :class:`PipelineModel` that rank split; stage ``i`` runs on rank ``placement[i]`` of
    ``group`` (by default rank ``i``: one stage per rank; see
    :func:`~twobp_autograd.pipeline.schedules.placement`). Call :meth:`all_reduce` once per
    optimizer step, after the last weight-gradient flush of every step it accumulates, on
    gradients zeroed (or set to None) after the last step: it sums each rank's whole ``.grad``, so a
    second call on gradients already summed, or a gradient kept across optimizer steps, would add
    the other ranks' earlier parts again. A tie no holder's use gave a gradient keeps ``.grad`` None.
    """

    def __init__(
        self,
        pipeline: PipelineModel,
        *,
        group: dist.ProcessGroup | None = None,
        placement: Sequence[int] | None = None,
    ) -> None:
        owners = tuple(range(len(pipeline.stages)) if placement is None else placement)
        if len(owners) != len(pipeline.stages):
            raise ValueError(
                f"twobp: a placement of {len(owners)} stages for a pipeline of {len(pipeline.stages)}; "
                "pass the placement the schedule's stages run on (schedules.placement(name, world))"
            )
        rank = dist.get_rank(group)
        # Each tie's holding ranks, as ranks of the world; one rank holding every use of a tie
        # has its whole gradient already.
        held = [(tie, tuple(sorted({owners[s] for s in tie.stages}))) for tie in pipeline.ties]
        held = [(tie, holders) for tie, holders in held if len(holders) > 1]
        world_ranks = {holders: tuple(_world_rank(group, r) for r in holders) for _, holders in held}
        everyones = _groups_every_process_makes(set(world_ranks.values()), group)
        groups = {ranks: dist.new_group(list(ranks)) for ranks in everyones}
        self.reductions: list[tuple[nn.Parameter, Any]] = [
            (tie.parameter, groups[world_ranks[holders]]) for tie, holders in held if rank in holders
        ]

    def all_reduce(self) -> None:
        for parameter, group in self.reductions:
            # The holders agree first on whether the tie trains (one frozen it through its own
            # stage's requires_grad_(False): plain freezes the one parameter for every use, and a
            # holder skipping the sum alone paired the others' sums with its next tie's) and on
            # whether any use got a gradient: where none did (a branch no sample took, a tie
            # frozen for the step), plain autograd leaves .grad None, and an optimizer skips it.
            flags = [parameter.requires_grad, parameter.grad is not None]
            agreed = torch.tensor(flags, dtype=torch.int32, device=parameter.device)
            dist.all_reduce(agreed, group=group)
            training, reached = agreed.tolist()
            if training not in (0, dist.get_world_size(group)):
                raise RuntimeError(
                    "twobp: a tied parameter requires grad on some of the ranks that hold it and not on "
                    "others (frozen through one stage only?); plain autograd has one parameter for every "
                    "use: freeze or unfreeze it on every rank alike."
                )
            if not training or not reached:
                continue
            if parameter.grad is None:  # this rank's use of it got no gradient; the sum still needs it
                parameter.grad = torch.zeros_like(parameter)
            elif parameter.grad.is_sparse:  # a sparse embedding's: plain sums it with the dense uses'
                parameter.grad = parameter.grad.to_dense()
            dist.all_reduce(parameter.grad, group=group)


def _world_rank(group: dist.ProcessGroup | None, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _groups_every_process_makes(sets: set[tuple[int, ...]], group: dist.ProcessGroup | None) -> list[tuple[int, ...]]:
    """The sets of ranks to make groups of, the same on every process in the same order, as
    ``dist.new_group`` requires. Over a group smaller than the world (a data-parallel replica's
    pipeline ranks, a 2-D mesh's ``"pp"`` dimension) the other replicas need groups of other
    ranks: every process gathers them all (where each replica made only its own, processes of
    different replicas met under one group name: sums across replicas, or a hang)."""
    if group is not None and dist.get_world_size(group) != dist.get_world_size():
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sorted(sets))
        sets = {tuple(ranks) for replica in gathered for ranks in replica}
    return sorted(sets)
