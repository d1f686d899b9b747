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


def score_rows(
    strategy: str, free: np.ndarray, cap: np.ndarray, *, cpu: float, mem: float, gpu: float | np.ndarray,
    wants_devices: bool,
) -> np.ndarray:
    """Scores of k nodes from ``free`` and ``cap``, each 3 x k (rows: CPU cores, memory MB, GPUs); ``gpu`` is what
    the ask takes of GPUs, per node or for all. A handful of array operations, whatever k is."""
    dims = 3 if wants_devices else 2  # the GPU row counts only when the ask wants devices
    after = free[:dims] - np.array([[cpu], [mem], [0.0]][:dims])
    if wants_devices:
        after[2] -= gpu
    fraction = np.zeros_like(after)
    np.divide(after, cap[:dims], out=fraction, where=cap[:dims] > 0)
    np.clip(fraction, 0.0, 1.0, out=fraction)
    powers = np.power(10.0, fraction)
    total = powers[0] + powers[1]
    if wants_devices:
        total = total + powers[2]
    scores: np.ndarray
    if strategy == "spread":
        scores = (total - dims) / (9.0 * dims)
    else:
        scores = (10.0 * dims - total) / (9.0 * dims)
    if not wants_devices:
        scores = scores - STRANDING_PENALTY * ((cap[2] > 0).astype(float) + (free[2] > 0))
    return scores


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
    return score_rows(strategy, np.stack((free_cpu, free_mem, free_gpu)), np.stack((cap_cpu, cap_mem, cap_gpu)),
                      cpu=cpu, mem=mem, gpu=gpu, wants_devices=wants_devices)


def score_few(
    strategy: str, free: list[list[float]], cap: list[list[float]], *, cpu: float, mem: float, gpu: list[int],
    wants_devices: bool,
) -> list[float]:
    """``score_rows`` for a handful of nodes (``free`` and ``cap`` as 3 lists of k floats, ``gpu`` per node) in
    plain floats: the same IEEE operations in the same order, and the same ``np.power``, so the scores are
    bit-identical; one array call where ``score_rows`` makes a dozen, which dominate for a few nodes."""
    fractions: list[float] = []
    for j in range(len(gpu)):
        for after, total in ((free[0][j] - cpu, cap[0][j]), (free[1][j] - mem, cap[1][j]),
                             ((free[2][j] - 0.0) - gpu[j], cap[2][j])):
            fraction = after / total if total > 0 else 0.0
            fractions.append(0.0 if fraction < 0.0 else 1.0 if fraction > 1.0 else fraction)
    powers: list[float] = np.power(10.0, fractions).tolist()
    dims = 3 if wants_devices else 2
    spread = strategy == "spread"
    scores: list[float] = []
    for j in range(len(gpu)):
        total = powers[3 * j] + powers[3 * j + 1]
        if wants_devices:
            total = total + powers[3 * j + 2]
        score = (total - dims) / (9.0 * dims) if spread else (10.0 * dims - total) / (9.0 * dims)
        if not wants_devices:
            score = score - STRANDING_PENALTY * (float(cap[2][j] > 0) + float(free[2][j] > 0))
        scores.append(score)
    return scores
