"""twobp_autograd: 2-stage backpropagation for unchanged PyTorch models.

``patch(model)`` makes backward compute input gradients only (backward-p1) and queue the
weight-gradient work; ``flush_weight_grads()`` runs it (backward-p2), one concatenated kernel
call per layer over all queued micro-batches.
"""

from . import fsdp  # noqa: F401  (flushes reduce-scatter FSDP2-sharded gradients)
from .grad_guard import has_queued_work
from .patching import PatchReport, patch, unpatch
from .queue import PendingWork, WeightGradQueue, discard_weight_grads, flush_weight_grads, pending, use_queue
from .registry import register

__all__ = [
    "patch",
    "unpatch",
    "flush_weight_grads",
    "discard_weight_grads",
    "pending",
    "has_queued_work",
    "register",
    "WeightGradQueue",
    "use_queue",
    "PatchReport",
    "PendingWork",
]
