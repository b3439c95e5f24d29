#!/usr/bin/env python
"""What the metric rollup costs ingestion: save_points (COPY) alone vs COPY + rollup.add, side by side.

    UGRO_BENCH_DB=ugro_bench_ui_ingest UGRO_BENCH_REDIS_DB=14 .venv/bin/python bench/ingest_cost.py [--label L]

Batches shaped like a follower's passes, each stored in its own transaction as jobs/follow.py does, into
PostgreSQL (a fresh bench DB): `wide` 10 metrics x 50 steps of one rank (500 points), `long` 1 metric x
1000 steps (1000 points), `trickle` 3 metrics x 2 steps (6 points: a slow run, per-batch cost
dominates). Steps go on from batch to batch (a curve growing). The two variants alternate batch by
batch, each on its own job, so the machine's load hits both alike: `copy` is save_points with the
rollup switched off (what ingestion did before), `copy+rollup` is save_points as it is. Per variant:
median and p90 milliseconds per batch, microseconds per point, and rollup rows written per batch.
Results: bench/results/ingest_cost.json, one entry per --label.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _dash_common import RESULTS, machine_info, make_tmp, setup, write_json  # noqa: E402

SHAPES = {"wide": (10, 50, 100), "long": (1, 1000, 60), "trickle": (3, 2, 400)}  # metrics, steps, batches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--label", default="current")
    args = ap.parse_args()
    tmp = make_tmp("ugro-bench-ingest-")
    setup(tmp)
    from django.db import transaction

    from jobs.models import Job
    from metrics import ingest, rollup
    from metrics.ingest import Sample, save_points
    from metrics.models import MetricRollup

    real_add = rollup.add
    result: dict = {"machine": machine_info(), "load_avg_1m_start": os.getloadavg()[0], "shapes": {}}
    for shape, (metrics, steps, batches) in SHAPES.items():
        names = ["loss", "lr", "grad_norm", "tokens_per_sec", "train/a", "train/b", "eval/loss", "eval/acc",
                 "eval/ppl", "system/x"][:metrics]  # fmt: skip
        jobs = {v: Job.objects.create(name=f"{shape}-{v}", script="t.py") for v in ("copy", "copy+rollup")}
        times: dict[str, list[float]] = {v: [] for v in jobs}
        written: list[int] = []
        for b in range(batches):
            now = datetime.now(UTC)
            for variant, job in jobs.items():
                rows = [
                    Sample(job.pk, 0, b * steps + s, n, 1.0 / (1 + b * steps + s) + k, now)
                    for s in range(steps)
                    for k, n in enumerate(names)
                ]
                counted: list[int] = []

                def counting_add(points, counted=counted):
                    counted.append(real_add(points))
                    return counted[-1]

                ingest.rollup.add = counting_add if variant == "copy+rollup" else (lambda points: 0)
                t0 = time.perf_counter()
                with transaction.atomic():
                    save_points(rows)
                times[variant].append(time.perf_counter() - t0)
                written.extend(counted)
        ingest.rollup.add = real_add
        points = metrics * steps
        out = {"points_per_batch": points, "batches": batches}
        for variant, ts in times.items():
            ts = sorted(ts)
            out[variant] = {
                "median_ms": round(statistics.median(ts) * 1000, 2),
                "p90_ms": round(ts[int(0.9 * (len(ts) - 1))] * 1000, 2),
                "us_per_point": round(statistics.median(ts) / points * 1e6, 1),
            }
        out["rollup_rows_per_batch"] = statistics.median(written)
        out["rollup_rows_total"] = MetricRollup.objects.filter(job=jobs["copy+rollup"]).count()
        out["overhead_x"] = round(out["copy+rollup"]["median_ms"] / out["copy"]["median_ms"], 2)
        result["shapes"][shape] = out
        print(shape, json.dumps(out))
    result["load_avg_1m_end"] = os.getloadavg()[0]
    result["method"] = __doc__.split("\n\n", 2)[1].strip()
    path = RESULTS / "ingest_cost.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    old[args.label] = result
    write_json(path, old)
    print("wrote", path, "under", args.label)


if __name__ == "__main__":
    main()
