#!/usr/bin/env python
"""What the metric rollup costs ingestion: COPY alone, COPY + the rollup's upsert in the same transaction
(the follower until now), COPY + catch_up about once a second (the follower now), side by side.

    UGRO_BENCH_DB=ugro_bench_ui_ingest UGRO_BENCH_REDIS_DB=14 .venv/bin/python bench/ingest_cost.py [--label L]

Batches shaped like a follower's passes, each stored in its own transaction as jobs/follow.py does, into
PostgreSQL (a fresh bench DB): `wide` 10 metrics x 50 steps of one rank (500 points), `long` 1 metric x
1000 steps (1000 points), `trickle` 3 metrics x 2 steps (6 points: a slow run, per-batch cost
dominates). Steps go on from batch to batch (a curve growing). The variants alternate batch by batch,
each on its own job, so the machine's load hits them alike: `copy` is save_points alone, the
transaction that holds the job's row lock now; `copy+rollup` is save_points plus the rollup's fold and
upsert of that batch in the same transaction (ingestion before the rollup moved out of it);
`copy+catch_up` is save_points, and after every `fold_every` batches of its job (a second's worth at
R10's rate: 3 ranks x 1,000 lines/s per job, so 6 wide and 3 long batches; a slow run's follower passes
about 4 times a second) rollup.catch_up in a transaction of its own. Per variant: median and p90
and mean milliseconds per batch in the transaction that holds the job's row lock; for copy+catch_up
also the catch_up's own, and the mean milliseconds per batch of both together (the catch_ups spread
over the batches). Rollup rows written per batch; both rollups are checked equal at the end.
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

SHAPES = {
    "wide": (10, 50, 100, 6),
    "long": (1, 1000, 60, 3),
    "trickle": (3, 2, 400, 4),
}  # metrics, steps, batches, fold_every
VARIANTS = ("copy", "copy+rollup", "copy+catch_up")


def stats_ms(ts: list[float], per: int | None = None) -> dict:
    ts = sorted(ts)
    out = {
        "median_ms": round(statistics.median(ts) * 1000, 2),
        "p90_ms": round(ts[int(0.9 * (len(ts) - 1))] * 1000, 2),
        "mean_ms": round(statistics.fmean(ts) * 1000, 2),
    }
    if per:
        out["us_per_point"] = round(statistics.median(ts) / per * 1e6, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--label", default="current")
    args = ap.parse_args()
    tmp = make_tmp("ugro-bench-ingest-")
    setup(tmp)
    from django.db import transaction

    from jobs.models import Job
    from metrics import rollup
    from metrics.ingest import Sample, save_points
    from metrics.models import MetricRollup

    def table(job: Job) -> list[tuple]:
        fields = ("name", "level", "rank", "bucket", "n", "v_min", "v_max", "v_sum", "first_step", "last_step",
                  "last_value", "t_min", "t_max")  # fmt: skip
        rows = MetricRollup.objects.filter(job=job).order_by("name", "level", "rank", "bucket").values_list(*fields)
        return [(*r[:7], round(r[7], 6), *r[8:]) for r in rows]

    result: dict = {"machine": machine_info(), "load_avg_1m_start": os.getloadavg()[0], "shapes": {}}
    for shape, (metrics, steps, batches, fold_every) in SHAPES.items():
        names = ["loss", "lr", "grad_norm", "tokens_per_sec", "train/a", "train/b", "eval/loss", "eval/acc",
                 "eval/ppl", "system/x"][:metrics]  # fmt: skip
        jobs = {v: Job.objects.create(name=f"{shape}-{v}", script="t.py") for v in VARIANTS}
        times: dict[str, list[float]] = {v: [] for v in jobs}
        folds: list[float] = []
        written: list[int] = []
        for b in range(batches):
            now = datetime.now(UTC)
            for variant, job in jobs.items():
                rows = [
                    Sample(job.pk, 0, b * steps + s, n, 1.0 / (1 + b * steps + s) + k, now)
                    for s in range(steps)
                    for k, n in enumerate(names)
                ]
                t0 = time.perf_counter()
                with transaction.atomic():
                    save_points(rows)
                    if variant == "copy+rollup":
                        written.append(rollup.upsert(rollup.fold_into_levels(rows)))
                times[variant].append(time.perf_counter() - t0)
                if variant == "copy+catch_up" and ((b + 1) % fold_every == 0 or b + 1 == batches):
                    t0 = time.perf_counter()
                    rollup.catch_up(job.pk)
                    folds.append(time.perf_counter() - t0)
        points = metrics * steps
        out: dict = {"points_per_batch": points, "batches": batches, "fold_every": fold_every}
        for variant, ts in times.items():
            out[variant] = stats_ms(ts, points)
        new = out["copy+catch_up"]
        new["catch_up"] = {**stats_ms(folds), "calls": len(folds)}
        new["mean_ms_with_catch_up"] = round((sum(times["copy+catch_up"]) + sum(folds)) / batches * 1000, 2)
        out["rollup_rows_per_batch"] = statistics.median(written)
        out["rollup_rows_total"] = MetricRollup.objects.filter(job=jobs["copy+rollup"]).count()
        out["same_rollup"] = table(jobs["copy+rollup"]) == table(jobs["copy+catch_up"])
        out["overhead_x"] = round(out["copy+rollup"]["median_ms"] / out["copy"]["median_ms"], 2)
        out["lock_held_x_new"] = round(new["median_ms"] / out["copy"]["median_ms"], 2)
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
