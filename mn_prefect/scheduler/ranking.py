"""Rankers: binpack (fullest node after placement first) and spread (emptiest first), vectorised.

The score follows Nomad's BestFit: from the free fractions f of CPU and memory (and GPUs when asked)
after placement, ``sum(10**f)`` is smallest on a full node. Scores are normalised to 0..1, 1 best.
"""

from __future__ import annotations

import numpy as np

# A request without devices keeps off device nodes: the CPU and memory it takes there are what the next GPU
# run needs, even while that node's GPUs are busy. Each tier is larger than any strategy score (0..1), so
# the tier decides first and the strategy ranks within it: CPU-only nodes, then device nodes whose devices
# are all held (nothing to strand now), then device nodes with free devices.
STRANDING_PENALTY = 1.0


def _free_fraction(free: np.ndarray, capacity: np.ndarray, ask: float | np.ndarray) -> np.ndarray:
    after = free - ask
    out = np.zeros_like(after)
    np.divide(after, capacity, out=out, where=capacity > 0)
    return np.clip(out, 0.0, 1.0)


def score_nodes(
    strategy: str,
    *,
    free_cpu: np.ndarray,
    cap_cpu: np.ndarray,
    free_mem: np.ndarray,
    cap_mem: np.ndarray,
    free_gpu: np.ndarray,
    cap_gpu: np.ndarray,
    cpu: float,
    mem: float,
    gpu: float | np.ndarray,
    wants_devices: bool,
) -> np.ndarray:
    """Scores for the given nodes (arrays already restricted to the candidates)."""
    total = np.power(10.0, _free_fraction(free_cpu, cap_cpu, cpu)) + np.power(10.0, _free_fraction(free_mem, cap_mem, mem))
    dims = 2
    if wants_devices:
        total = total + np.power(10.0, _free_fraction(free_gpu, cap_gpu, gpu))
        dims = 3
    scores: np.ndarray
    if strategy == "spread":
        scores = (total - dims) / (9.0 * dims)
    else:
        scores = (10.0 * dims - total) / (9.0 * dims)
    if not wants_devices:
        scores = scores - STRANDING_PENALTY * ((cap_gpu > 0).astype(float) + (free_gpu > 0))
    return scores
