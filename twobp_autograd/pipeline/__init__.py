"""Pipeline parallelism with 2BP: schedules as pure functions, a torch.distributed runtime,
a simulator, metrics and traces, and the torch.distributed.pipelining adapter.

What a user calls is exported here; the modules hold the rest (:mod:`.actions` for writing a
schedule by hand, :mod:`.trace` for reading and drawing timelines).
"""

from .actions import Action, ActionKind
from .adapter import dw_builder
from .metrics import RankMetrics, StepReport
from .runtime import GradientSync, PipelineError, PipelineRuntime, init_distributed
from .schedules import (
    MULTI_STAGE_SCHEDULES,
    SCHEDULES,
    ScheduleError,
    default_num_micro_batches,
    placement,
    schedule,
    validate_schedule,
)
from .simulator import SimulationResult, StageCosts, fastest_max_pending, simulate
from .split import TiedGradients, agreed_block_costs, blocks_of, defer_norms, split_model
from .trace import plot_timeline, write_chrome_trace

__all__ = [
    "Action",
    "ActionKind",
    "SCHEDULES",
    "MULTI_STAGE_SCHEDULES",
    "placement",
    "ScheduleError",
    "schedule",
    "default_num_micro_batches",
    "validate_schedule",
    "split_model",
    "blocks_of",
    "agreed_block_costs",
    "defer_norms",
    "TiedGradients",
    "PipelineRuntime",
    "GradientSync",
    "PipelineError",
    "StepReport",
    "RankMetrics",
    "init_distributed",
    "StageCosts",
    "SimulationResult",
    "simulate",
    "fastest_max_pending",
    "write_chrome_trace",
    "plot_timeline",
    "dw_builder",
]
