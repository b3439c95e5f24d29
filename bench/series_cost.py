#!/usr/bin/env python
"""One series answer of issue 13's job (10 metrics x 3 ranks x 100k steps): from the rollup vs grouped
from the raw points, side by side.

    UGRO_BENCH_DB=ugro_bench_ui_series UGRO_BENCH_REDIS_DB=14 .venv/bin/python bench/series_cost.py [--label L]

The job's 3,000,000 points are inserted as bench/page_load.py does (one INSERT ... SELECT, VACUUM
ANALYZE) and its rollup rebuilt. Then, `--rounds` times, each of the 10 metrics is asked as the job page
asks it (600 buckets) two ways, alternating so the machine's load hits both alike: `rollup` is
metrics.series.series() as it is (the whole series: the rollup); `raw` is the same call with
step_min=0, a window covering everything, which groups the 300,000 raw points of the metric in SQL
(what every answer did before the rollup). Per way: median and p90 milliseconds, and points returned.
Results: bench/results/series_cost.json, one entry per --label.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _dash_common import RESULTS, machine_info, make_tmp, setup, write_json  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--label", default="current")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100_000)
    args = ap.parse_args()
    setup(make_tmp("ugro-bench-series-"))
    import page_load

    from jobs.models import Job
    from metrics import rollup
    from metrics.series import series

    job = Job.objects.create(name="ten-panels", script="t.py", state=Job.State.SUCCEEDED)
    names = page_load.PANEL_NAMES[:10]
    insert_s = page_load.insert_points(job.pk, 3, args.steps, names)
    t0 = time.monotonic()
    rollup.rebuild(job.pk)
    rebuild_s = time.monotonic() - t0
    result: dict = {"machine": machine_info(), "insert_s": round(insert_s, 1), "rollup_rebuild_s": round(rebuild_s, 1)}
    result["load_avg_1m_start"] = os.getloadavg()[0]
    times: dict[str, list[float]] = {"rollup": [], "raw": []}
    sizes: dict[str, int] = {}
    for _ in range(args.rounds):
        for name in names:
            for way, extra in (("rollup", {}), ("raw", {"step_min": 0})):
                t = time.perf_counter()
                answer = series(job.pk, name, buckets=page_load_buckets(), **extra)
                times[way].append(time.perf_counter() - t)
                sizes[way] = sum(len(xy["x"]) for xy in answer["ranks"].values())
    result["load_avg_1m_end"] = os.getloadavg()[0]
    for way, ts in times.items():
        ts = sorted(ts)
        result[way] = {
            "median_ms": round(statistics.median(ts) * 1000, 1),
            "p90_ms": round(ts[int(0.9 * (len(ts) - 1))] * 1000, 1),
            "points_returned": sizes[way],
            "answers": len(ts),
        }
    result["method"] = __doc__.split("\n\n", 2)[2].strip()
    print(json.dumps({k: v for k, v in result.items() if k != "method"}))
    path = RESULTS / "series_cost.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    old[args.label] = result
    write_json(path, old)
    print("wrote", path, "under", args.label)


def page_load_buckets() -> int:
    """What the job page asks each panel for first (jobs/views.py FIRST_BUCKETS)."""
    from jobs.views import FIRST_BUCKETS

    return FIRST_BUCKETS


if __name__ == "__main__":
    main()
