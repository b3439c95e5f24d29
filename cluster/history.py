"""System metrics history (GPU utilisation, memory, temperature, power; CPU and RAM) from health samples,
downsampled into equal time buckets for charts.

Raw samples (kept 24 h) carry per-GPU readings; older windows fall back on the 1-minute aggregates, which
carry node-wide values only (their line is "<node> GPUs"). Shape (JSON-ready)::

    {"since": t0, "until": t1, "metrics": [
        {"name": "gpu_util", "title": "GPU utilisation", "unit": "%",
         "lines": {"node1 GPU 0": {"t": [unix s...], "y": [...]}, ...}}, ...]}
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime
from typing import Any

from .models import HealthSample, Node

# (name, title, unit, per-GPU reading, node-wide HealthSample field)
GPU_METRICS = (
    ("gpu_util", "GPU utilisation", "%", "util_percent", "gpu_util_percent"),
    ("gpu_mem", "GPU memory used", "MB", "mem_used_mb", "gpu_mem_used_mb"),
    ("gpu_temp", "GPU temperature", "°C", "temp_c", "gpu_temp_c"),
    ("gpu_power", "GPU power", "W", "power_w", "gpu_power_w"),
)
NODE_METRICS = (("cpu", "CPU", "%", "cpu_percent"), ("ram", "RAM", "%", "ram_percent"))
MAX_BUCKETS = 2000


def history(
    nodes: list[Node],
    since: datetime,
    until: datetime,
    *,
    buckets: int = 400,
    gpus: dict[int, set[int]] | None = None,
) -> dict[str, Any]:
    """Each metric of ``nodes`` between ``since`` and ``until``, one line per GPU (per node for CPU and
    RAM), averaged into at most ``buckets`` equal time buckets. ``gpus`` (node id -> GPU indexes) limits
    the GPU lines, e.g. to the GPUs a job used."""
    if not 1 <= buckets <= MAX_BUCKETS:
        raise ValueError(f"buckets must be between 1 and {MAX_BUCKETS}")
    if until <= since:
        raise ValueError("the window must end after it starts")
    names = {n.pk: n.name for n in nodes}
    lo, hi = since.timestamp(), until.timestamp()
    width = (hi - lo) / buckets
    # per metric, per line, per bucket: [sum, count]
    acc: dict[str, dict[str, dict[int, list[float]]]] = defaultdict(lambda: defaultdict(dict))

    def put(metric: str, line: str, t: float, value: Any) -> None:
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            return
        b = min(buckets - 1, int((t - lo) / width))
        cell = acc[metric][line].setdefault(b, [0.0, 0])
        cell[0] += value
        cell[1] += 1

    window = HealthSample.objects.filter(node__in=list(names), ok=True, time__gte=since, time__lte=until)
    raw = window.filter(kind=HealthSample.Kind.RAW)
    kind = HealthSample.Kind.RAW if raw.exists() else HealthSample.Kind.MINUTE
    fields = ["node_id", "time", "gpus"] + [m[4] for m in GPU_METRICS] + [m[3] for m in NODE_METRICS]
    for row in window.filter(kind=kind).order_by("time").values(*fields).iterator(chunk_size=2000):
        node, t = names[row["node_id"]], row["time"].timestamp()
        for metric, _, _, field in NODE_METRICS:
            put(metric, node, t, row[field])
        readings = [g for g in row["gpus"] or [] if isinstance(g, dict)]
        wanted = gpus.get(row["node_id"]) if gpus is not None else None
        if readings:
            for i, gpu in enumerate(readings):
                index = gpu.get("index", i)
                if wanted is not None and index not in wanted:
                    continue
                for metric, _, _, key, _ in GPU_METRICS:
                    put(metric, f"{node} GPU {index}", t, gpu.get(key))
        else:
            for metric, _, _, _, field in GPU_METRICS:
                put(metric, f"{node} GPUs", t, row[field])

    metrics = []
    for metric, title, unit, *_ in (*GPU_METRICS, *NODE_METRICS):
        lines = {}
        for line in sorted(acc[metric]):
            cells = acc[metric][line]
            order = sorted(cells)
            lines[line] = {
                "t": [round(lo + (b + 0.5) * width, 3) for b in order],
                "y": [round(cells[b][0] / cells[b][1], 3) for b in order],
            }
        metrics.append({"name": metric, "title": title, "unit": unit, "lines": lines})
    return {"since": lo, "until": hi, "kind": kind, "metrics": metrics}
