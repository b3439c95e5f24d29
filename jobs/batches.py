"""Uneven GPUs used well: each rank's share of the global batch, in proportion to its GPU's speed.

The global batch stays that of an even split (batch per GPU x GPUs); a GPU twice as fast gets twice the
samples, so no GPU waits for a slower one at every step. Each rank learns its share from
UGRO_LOCAL_BATCH (its samples per step, per GPU) and UGRO_BATCH_WEIGHT (that over the even share, the
factor its loss is scaled by so that DDP's averaging gives the global batch's mean gradient), and the
`{local_batch}` argument template. train/train_production.py shows the use; docs/uneven-gpus.md too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def split_batch(per_gpu: int, weights: Sequence[float], counts: Sequence[int] | None = None) -> list[int]:
    """Per-GPU local batches for groups of GPUs (a node's GPUs share one value) with these weights, summing
    to per_gpu x all GPUs exactly (largest remainder), each at least 1; the even split when no exact
    uneven split exists."""
    counts = list(counts or [1] * len(weights))
    total = per_gpu * sum(counts)
    mass = sum(w * c for w, c in zip(weights, counts, strict=True))
    ideal = [total * w / mass for w in weights]
    out = [max(1, math.floor(x)) for x in ideal]
    left = total - sum(b * c for b, c in zip(out, counts, strict=True))
    for i in sorted(range(len(out)), key=lambda i: ideal[i] - math.floor(ideal[i]), reverse=True):
        if 0 < counts[i] <= left:
            out[i] += 1
            left -= counts[i]
    if left != 0 or min(out) < 1:
        return [per_gpu] * len(weights)
    return out


def parse_weights(text: str) -> dict[str, float]:
    """--batch-weights node1=1.6,node2=1 -> {"node1": 1.6, "node2": 1.0}; ValueError otherwise."""
    out: dict[str, float] = {}
    for item in (text or "").split(","):
        name, sep, value = item.strip().partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = math.nan
        if not sep or not name or not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"batch weight {item.strip()!r}: write NODE=WEIGHT with a positive number")
        out[name.strip()] = weight
    return out
