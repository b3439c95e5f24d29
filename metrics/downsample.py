"""Reduce long metric series to a few points a chart can draw, keeping their shape.

Two reducers, both pure Python and written from the algorithms' descriptions:

* ``minmax_buckets``: per equal-width x bucket keep the lowest and the highest
  point, so a one-step loss spike always survives;
* ``lttb``: Largest-Triangle-Three-Buckets (Sveinn Steinarsson, "Downsampling
  Time Series for Visual Representation", 2013), which keeps a fixed number of
  visually important points.

Both expect xs sorted ascending, keep the first and last points and return new
lists (the inputs themselves when there is nothing to reduce, copied to lists).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence


def minmax_buckets(xs: Sequence[float], ys: Sequence[float], buckets: int) -> tuple[list[float], list[float]]:
    """Keep the min and max point of each of ``buckets`` equal-width x buckets, plus the ends.

    Points come out in x order (within a bucket, min and max in the order they
    occur), at most ``2 * buckets + 2`` of them.  Inputs of ``2 * buckets`` points
    or fewer are returned unchanged (as lists).  Ties keep the first occurrence.
    """
    _check_lengths(xs, ys)
    n = len(xs)
    if n <= 2 * buckets:
        return list(xs), list(ys)
    if buckets < 1:
        raise ValueError("buckets must be >= 1")
    xl = xs if isinstance(xs, list) else list(xs)
    yl = ys if isinstance(ys, list) else list(ys)
    x0, x1 = xl[0], xl[-1]
    width = (x1 - x0) / buckets
    # xs is sorted, so each bucket is one contiguous slice; bisect finds its edges.
    edges = [0]
    if width > 0:
        for k in range(1, buckets):
            edges.append(bisect_left(xl, x0 + k * width, lo=edges[-1]))
    edges.append(n)
    keep: list[int] = []
    for lo, hi in zip(edges, edges[1:], strict=False):
        if hi <= lo:
            continue
        chunk = yl[lo:hi]
        # min/max/index run in C: the loop is per bucket, not per point.
        i_min = lo + chunk.index(min(chunk))
        i_max = lo + chunk.index(max(chunk))
        keep.extend(sorted({i_min, i_max}))
    if keep[0] != 0:
        keep.insert(0, 0)
    if keep[-1] != n - 1:
        keep.append(n - 1)
    return [xl[i] for i in keep], [yl[i] for i in keep]


def lttb(xs: Sequence[float], ys: Sequence[float], threshold: int) -> tuple[list[float], list[float]]:
    """Largest-Triangle-Three-Buckets: exactly ``threshold`` points when there are more.

    The first and last points are always kept.  The points between are split
    into ``threshold - 2`` buckets of (nearly) equal count; from each bucket the
    point kept is the one forming the largest triangle with the point kept from
    the previous bucket and the average point of the next bucket.
    """
    _check_lengths(xs, ys)
    n = len(xs)
    if n <= threshold:
        return list(xs), list(ys)
    if threshold < 2:
        raise ValueError("threshold must be >= 2 to keep the first and last points")
    xl = xs if isinstance(xs, list) else list(xs)
    yl = ys if isinstance(ys, list) else list(ys)
    inner = n - 2  # points between the first and the last
    parts = threshold - 2  # buckets among them, each of inner/parts points (> 1)

    def edge(k: int) -> int:
        # Integer arithmetic: bucket k spans [edge(k), edge(k + 1)), edge(parts) is exactly n - 1.
        return 1 + k * inner // parts

    out_x = [xl[0]]
    out_y = [yl[0]]
    a = 0  # index of the point kept from the previous bucket
    for i in range(parts):
        start, end = edge(i), edge(i + 1)
        # The next bucket; for the last regular bucket it is just the final point.
        next_start, next_end = end, (edge(i + 2) if i + 2 <= parts else n)
        count = next_end - next_start
        cx = sum(xl[next_start:next_end]) / count
        cy = sum(yl[next_start:next_end]) / count
        ax, ay = xl[a], yl[a]
        # Twice the triangle's area is |(ax-cx)*(y-ay) - (ax-x)*(cy-ay)| = |p*y + q*x + r|.
        p = ax - cx
        q = cy - ay
        r = -p * ay - q * ax
        a = max(range(start, end), key=lambda j: abs(p * yl[j] + q * xl[j] + r))
        out_x.append(xl[a])
        out_y.append(yl[a])
    out_x.append(xl[-1])
    out_y.append(yl[-1])
    return out_x, out_y


def _check_lengths(xs: Sequence[float], ys: Sequence[float]) -> None:
    """Both reducers pair xs[i] with ys[i]; mismatched lengths are a caller bug."""
    if len(xs) != len(ys):
        raise ValueError(f"xs and ys differ in length ({len(xs)} != {len(ys)})")
