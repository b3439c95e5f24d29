#!/usr/bin/env python
"""The per-line work of a follower's pass, piece by piece: where the worker's CPU goes per line under R10.

    UGRO_BENCH_DB=ugro_bench_pass UGRO_BENCH_REDIS_DB=13 .venv/bin/python bench/pass_cost.py [--label L]

One rank's answer of R10's shape (`{"step": n, "loss": x, "t": "<time>"}` lines, 5,000 of them, zlib-packed
and base64-encoded as the node agent sends them) goes through the steps jobs/follow.py takes, each timed
alone in CPU time of this process (time.process_time: the channel layer's and PostgreSQL's own work is
not in it): decode the answer, split it into lines, parse them (metrics/ingest.py parse_lines), join the
metrics.jsonl lines, COPY the points in a transaction, and publish them as the follower does (1,000
lines an event, the text and the points, JSON-encoded once, through the channel layer to a group with
no viewer). Repeated REPEATS times after a warm-up round; the median microseconds a line per step.
What this leaves out is the per-pass cost (the pass's queries, node reads, events): R10 gives it as the
worker's CPU over its lines, minus these. Results: bench/results/pass_cost.json, one entry per --label.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import sys
import time
import zlib
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _dash_common import RESULTS, machine_info, make_tmp, setup, write_json  # noqa: E402

LINES = 5000
REPEATS = 7
SLICE = 1000  # lines an event, as jobs/follow.py PUBLISH_SLICE


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--label", default="current")
    args = ap.parse_args()
    tmp = make_tmp("ugro-bench-pass-")
    setup(tmp)
    from django.db import transaction

    from jobs.events import publish_job
    from jobs.follow import split_lines, tail_bytes, takeable
    from jobs.logs import display_text
    from jobs.models import Job
    from metrics.ingest import RankStream, parse_lines, save_points

    stamp = f"{time.time():.6f}"
    data = "".join(
        f'{{"step": {i}, "loss": {2.0 / (1.0 + i * 1e-3):.6f}, "t": "{stamp}"}}\n' for i in range(1, LINES + 1)
    ).encode()
    item = {"data": base64.b64encode(zlib.compress(data, 1)).decode("ascii"), "zlib": True}
    job = Job.objects.create(name="pass-cost", script="t.py")
    when = datetime.now(UTC)

    def one_round() -> dict[str, float]:
        took: dict[str, float] = {}
        t0 = time.process_time()
        raw = takeable(tail_bytes(item), False)
        t1 = time.process_time()
        lines = split_lines(raw)
        t2 = time.process_time()
        stream = RankStream()
        stream.configured = True  # the job's settings and the replay of its log: once per follower, not per pass
        points, jsonl = parse_lines(job.pk, 0, lines, stream, when)
        t3 = time.process_time()
        ("\n".join(jsonl) + "\n").encode()
        t4 = time.process_time()
        with transaction.atomic():
            save_points(points)
        t5 = time.process_time()
        shown = [display_text(line) for line in lines]
        for i in range(0, len(shown), SLICE):
            payload = {"rank": 0, "start": 0, "end": len(raw), "lines": shown[i : i + SLICE],
                       "points": [[p.rank, p.step, p.name, p.value] for p in points[i : i + SLICE]]}  # fmt: skip
            publish_job(job, "lines", payload)
        t6 = time.process_time()
        for step, a, b in (("decode_answer", t0, t1), ("split_lines", t1, t2), ("parse", t2, t3),
                           ("jsonl_join", t3, t4), ("copy", t4, t5), ("publish", t5, t6)):  # fmt: skip
            took[step] = b - a
        return took

    rounds = [one_round() for _ in range(REPEATS + 1)]  # the first warms up (the channel layer's connection)
    rounds = rounds[1:]
    per_line = {step: round(statistics.median(r[step] for r in rounds) / LINES * 1e6, 2) for step in rounds[0]}
    per_line["total"] = round(sum(per_line.values()), 2)
    entry = {
        "machine": machine_info(),
        "load_avg_1m_start": os.getloadavg()[0],
        "lines": LINES,
        "repeats": REPEATS,
        "us_per_line": per_line,
    }
    print(json.dumps(per_line, indent=2))
    path = RESULTS / "pass_cost.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results[args.label] = entry
    write_json(path, results)


if __name__ == "__main__":
    main()
