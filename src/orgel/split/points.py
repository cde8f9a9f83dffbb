"""Cut points of a sequence of blocks: where each stage of a linear split starts.

A linear split of ``n`` blocks into ``k`` stages is given by its *points*: the
first block of stages 1..k-1, strictly increasing in ``1..n-1``. The planner's
linear splits (:mod:`orgel.plan.splits`), the balanced assignments of
:mod:`orgel.split.assign` and the balanced chains of :mod:`orgel.plan.balanced`
all cut here.
"""

from __future__ import annotations

import numpy as np

Points = tuple[int, ...]


def balanced_points(weights: list[float] | np.ndarray, parts: int) -> Points:
    """Points that cut ``weights`` into ``parts`` pieces of nearly equal sum.

    Stage ``s`` ends where the running sum is closest to ``(s + 1) / parts`` of
    the total; points are then pushed apart so every stage has a block.
    """
    w = np.asarray(weights, dtype=np.float64)
    n = len(w)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot cut {n} blocks into {parts} stages: need 1 <= stages <= "
                         "blocks (coarsen less or use fewer stages)")
    if parts == 1:
        return ()
    if w.sum() <= 0:
        return uniform_points(n, parts)
    cum = np.cumsum(w)
    targets = cum[-1] * np.arange(1, parts) / parts
    after = np.searchsorted(cum, targets, side="left")  # first index with cum >= target
    points = []
    for t, i in zip(targets, after, strict=True):
        # Cut after block i (point i + 1) or before it (point i), whichever is closer.
        below = cum[i - 1] if i > 0 else 0.0
        points.append(int(i + 1) if cum[i] - t <= t - below else int(i))
    return _spread(points, n, parts)


def _spread(points: list[int], n: int, parts: int) -> Points:
    """Add points (splitting the largest parts) until there are ``parts - 1`` of them."""
    pts = sorted({p for p in points if 0 < p < n})
    while len(pts) < parts - 1:
        bounds = [0, *pts, n]
        sizes = [(bounds[i + 1] - bounds[i], i) for i in range(len(bounds) - 1)]
        size, i = max(sizes)
        pts.append(bounds[i] + size // 2)
        pts.sort()
    return tuple(pts[: parts - 1])


def uniform_points(n: int, parts: int) -> Points:
    """The same number of blocks per stage (first stages take the remainder)."""
    if not 1 <= parts <= n:
        raise ValueError(f"cannot cut {n} blocks into {parts} stages")
    return tuple(round(i * n / parts) for i in range(1, parts))


def valid_points(points: Points, n: int) -> bool:
    """Strictly increasing, inside ``1..n-1``."""
    prev = 0
    for p in points:
        if p <= prev:
            return False
        prev = p
    return prev < n or not points
