"""Exact contiguous partition of layers over a pipeline's stages (min over max stage cost)."""

from __future__ import annotations

from collections.abc import Sequence


def partition(costs: Sequence[float], k: int) -> list[tuple[int, int]]:
    """Splits layers into k non-empty contiguous ranges [b, e) minimising the largest range cost.

    Dynamic programming over (layers used, stages used); ties prefer earlier cuts, so the
    result is deterministic.
    """
    n = len(costs)
    if not 1 <= k <= n:
        raise ValueError(f"cannot split {n} layers into {k} non-empty stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[j][i]: min max-cost of splitting the first i layers into j stages; cut[j][i]: last cut.
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            for b in range(j - 1, i):
                value = max(best[j - 1][b], prefix[i] - prefix[b])
                if value < best[j][i]:
                    best[j][i], cut[j][i] = value, b
    ranges: list[tuple[int, int]] = []
    end = n
    for j in range(k, 0, -1):
        begin = cut[j][end]
        ranges.append((begin, end))
        end = begin
    return ranges[::-1]
