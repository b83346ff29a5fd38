"""Where to cut: block costs in, stage boundaries out.

Kept apart from the models and from any timing so that the cut is a pure function of the
costs: every rank that is handed the same costs cuts the model at the same blocks, and the
result can be asserted exactly.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

__all__ = ["partition"]


def partition(costs: Sequence[float], num_stages: int) -> list[range]:
    """Contiguous ranges of block indices, one per stage, minimising the costliest stage."""
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"twobp: cannot cut {n} blocks into {num_stages} non-empty stages")
    if not all(math.isfinite(c) and c >= 0 for c in costs):  # inf or NaN compare as no cut at all
        raise ValueError(f"twobp: block costs must be finite and non-negative, got {list(costs)}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[s][i]: the lowest maximum stage cost of the first i blocks cut into s stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    bounds = [n]
    for s in range(num_stages, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    bounds.reverse()
    return [range(a, b) for a, b in itertools.pairwise(bounds)]
