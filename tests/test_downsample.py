"""Tests of metrics.downsample: min/max buckets and Largest-Triangle-Three-Buckets."""

from __future__ import annotations

import math
import random

import pytest

from metrics.downsample import lttb, minmax_buckets


def noisy_curve(n: int, seed: int = 1) -> tuple[list[float], list[float]]:
    """A decaying loss-like curve with noise."""
    rng = random.Random(seed)
    xs = [float(i) for i in range(n)]
    ys = [2.0 + 3.0 * math.exp(-i / (n / 5)) + rng.uniform(-0.1, 0.1) for i in range(n)]
    return xs, ys


def is_non_decreasing(values: list[float]) -> bool:
    return all(a <= b for a, b in zip(values, values[1:], strict=False))


def is_subsequence(xs: list[float], ys: list[float], out_x: list[float], out_y: list[float]) -> bool:
    """Every output point is an input point, in input order."""
    pairs = iter(zip(xs, ys, strict=True))
    return all(any(p == q for q in pairs) for p in zip(out_x, out_y, strict=True))


# --- minmax_buckets ---------------------------------------------------------------------------


def test_minmax_hand_checked() -> None:
    xs = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    ys = [5, 1, 9, 3, 4, 8, 2, 7, 6, 0]
    # Two buckets over [0, 9]: width 4.5 -> x 0..4 and x 5..9.
    # Bucket 1: min 1 @x1, max 9 @x2.  Bucket 2: min 0 @x9, max 8 @x5.  Plus first point x0.
    assert minmax_buckets(xs, ys, 2) == ([0, 1, 2, 5, 9], [5, 1, 9, 8, 0])


def test_minmax_keeps_first_and_last() -> None:
    xs = [0, 1, 2, 3, 4, 5, 6, 7]
    ys = [5, 0, 9, 5, 5, 0, 9, 5]
    out_x, out_y = minmax_buckets(xs, ys, 2)
    assert out_x == [0, 1, 2, 5, 6, 7]
    assert out_y == [5, 0, 9, 0, 9, 5]


def test_minmax_small_input_unchanged() -> None:
    xs = (1.0, 2.0, 3.0, 4.0)
    ys = (4.0, 3.0, 2.0, 1.0)
    assert minmax_buckets(xs, ys, 2) == ([1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0])
    assert minmax_buckets([], [], 10) == ([], [])


def test_minmax_spike_survives() -> None:
    xs, ys = noisy_curve(100_000)
    ys[54_321] = 1000.0
    ys[77_777] = -1000.0
    out_x, out_y = minmax_buckets(xs, ys, 50)
    assert (54_321.0, 1000.0) in zip(out_x, out_y, strict=True)
    assert (77_777.0, -1000.0) in zip(out_x, out_y, strict=True)
    assert max(out_y) == 1000.0
    assert min(out_y) == -1000.0


@pytest.mark.parametrize("buckets", [1, 2, 7, 100, 1000])
def test_minmax_bounds_and_order(buckets: int) -> None:
    xs, ys = noisy_curve(20_000, seed=buckets)
    out_x, out_y = minmax_buckets(xs, ys, buckets)
    assert len(out_x) == len(out_y) <= 2 * buckets + 2
    assert out_x[0] == xs[0] and out_x[-1] == xs[-1]
    assert out_y[0] == ys[0] and out_y[-1] == ys[-1]
    assert is_non_decreasing(out_x)
    assert is_subsequence(xs, ys, out_x, out_y)
    assert max(out_y) == max(ys) and min(out_y) == min(ys)


def test_minmax_uneven_x_and_empty_buckets() -> None:
    # Steps with a long gap (e.g. a resumed run): buckets in the gap are empty.
    xs = [float(x) for x in list(range(0, 50)) + list(range(10_000, 10_050))]
    ys = [float(i % 7) for i in range(len(xs))]
    out_x, out_y = minmax_buckets(xs, ys, 10)
    assert len(out_x) <= 22
    assert is_non_decreasing(out_x)
    assert out_x[0] == 0.0 and out_x[-1] == 10_049.0
    assert is_subsequence(xs, ys, out_x, out_y)


def test_minmax_all_same_x() -> None:
    xs = [5.0] * 10
    ys = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0, 5.0, 3.0]
    assert minmax_buckets(xs, ys, 3) == ([5.0] * 4, [3.0, 1.0, 9.0, 3.0])


def test_minmax_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        minmax_buckets([1.0, 2.0], [1.0], 5)
    with pytest.raises(ValueError):
        minmax_buckets([1.0, 2.0], [1.0, 2.0], 0)


# --- lttb -------------------------------------------------------------------------------------


def test_lttb_hand_checked() -> None:
    # 6 points, threshold 4: inner points 1..4 form buckets [1, 2] and [3, 4].
    xs = [0, 1, 2, 3, 4, 5]
    ys = [0, 5, 0, 0, -3, 0]
    # Bucket [1, 2] against a=(0,0) and the next bucket's mean (3.5, -1.5): x1 (area 9.5) beats x2 (area 1.5).
    # Bucket [3, 4] against a=(1,5) and the last point (5,0): x4 (area 8.5) beats x3 (area 5).
    assert lttb(xs, ys, 4) == ([0, 1, 4, 5], [0, 5, -3, 0])


def test_lttb_threshold_two_keeps_ends() -> None:
    assert lttb([0, 1, 2, 3], [1, 9, 9, 2], 2) == ([0, 3], [1, 2])


def test_lttb_small_input_unchanged() -> None:
    assert lttb((0.0, 1.0, 2.0), (3.0, 1.0, 2.0), 3) == ([0.0, 1.0, 2.0], [3.0, 1.0, 2.0])
    assert lttb([0.0], [1.0], 100) == ([0.0], [1.0])


def test_lttb_keeps_a_spike() -> None:
    xs, ys = noisy_curve(10_000)
    ys[4_321] = 50.0
    out_x, out_y = lttb(xs, ys, 200)
    assert (4_321.0, 50.0) in zip(out_x, out_y, strict=True)


@pytest.mark.parametrize("threshold", [3, 10, 333, 1000, 19_999])
def test_lttb_exact_length_and_order(threshold: int) -> None:
    xs, ys = noisy_curve(20_000, seed=threshold)
    out_x, out_y = lttb(xs, ys, threshold)
    assert len(out_x) == len(out_y) == threshold
    assert out_x[0] == xs[0] and out_x[-1] == xs[-1]
    assert is_non_decreasing(out_x)
    assert len(set(out_x)) == threshold
    assert is_subsequence(xs, ys, out_x, out_y)


def test_lttb_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        lttb([1.0, 2.0, 3.0], [1.0, 2.0], 2)
    with pytest.raises(ValueError):
        lttb([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], 1)


# --- a million points -------------------------------------------------------------------------


def test_one_million_points() -> None:
    xs, ys = noisy_curve(1_000_000)
    mx, my = minmax_buckets(xs, ys, 1000)
    assert len(mx) == len(my) <= 2002
    lx, ly = lttb(xs, ys, 2000)
    assert len(lx) == len(ly) == 2000
