"""Pipeline parallelism with 2BP: schedules as pure functions, a torch.distributed runtime,
metrics and traces, and the torch.distributed.pipelining adapter."""

from .adapter import dw_builder

__all__ = ["dw_builder"]
