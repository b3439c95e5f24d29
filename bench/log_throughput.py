#!/usr/bin/env python
"""Sustained log throughput of one job, and whether anything is lost on the way.

    .venv/bin/python bench/log_throughput.py [--lines 300000] [--metric-every 10] [--rate 0] [--label NAME] [--keep]

One real sshd node on 127.0.3.2 runs one rank (bench_rank.py under the node env's torchrun, launched
by UGRO's scheduler) that writes `--lines` lines as fast as it can: every `--metric-every`-th a
metric line `{"step": i, "loss": ...}`, the others `BENCHLOG <i> iteration ...` (~80 bytes);
`--rate` paces it instead (absolute schedule, checked every 512 lines). A real
Celery worker (`-B -P threads`) follows the job; a websocket client (own process, session cookie)
on daphne's `/ws/jobs/<id>/` counts what it receives. Then, once the job has ended:

  in        lines in the rank's log on the node (what torchrun's child and torchrun itself wrote)
  db        sum of Rank.log_lines
  file      lines in the controller's copy, data/jobs/<job>/logs/rank_<n>.log (and byte-equal?)
  websocket lines received in `lines` events (their byte ranges contiguous, none twice)
  points    MetricPoints in the DB vs metric lines printed

Throughput: lines / (last line received by the websocket client - first line printed), and the
same up to the moment the DB had counted them all.
Results: bench/results/log_throughput.json, one entry per --label (others kept).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _dash_common import (  # noqa: E402
    RESULTS,
    cleanup,
    go,
    machine_info,
    make_tmp,
    session_cookie,
    setup,
    start_cluster,
    start_daphne,
    start_worker,
    start_wsclient,
    wait_for,
    write_json,
    write_rank_config,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--lines", type=int, default=300_000)
    ap.add_argument("--metric-every", type=int, default=10)
    ap.add_argument("--rate", type=float, default=0, help="pace the rank at this many lines/s (0: as fast as it can)")
    ap.add_argument("--label", default="current")
    ap.add_argument("--note", default="")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()

    tmp = make_tmp("ugro-bench3-tp-")
    cluster, procs = None, []
    t_start = time.monotonic()
    try:
        env = setup(tmp)
        info = machine_info()
        cluster = start_cluster(tmp, 1)
        daphne, base = start_daphne(env, tmp)
        worker = start_worker(env, tmp)
        procs += [daphne, worker]
        cookie = session_cookie()

        from jobs.launch import LaunchRequest, create_job
        from jobs.models import Job, Rank
        from jobs.scheduler import schedule
        from metrics.models import MetricPoint

        write_rank_config(
            cluster, {"mode": "throughput", "count": args.lines, "metric_every": args.metric_every, "rate": args.rate}
        )
        job = create_job(LaunchRequest(name="throughput", count=1, script="bench_rank.py"))
        schedule()
        job.refresh_from_db()
        if job.state != Job.State.RUNNING:
            raise RuntimeError(f"job did not start: {job.state} {job.failure_reason}")
        wait_for(lambda: Job.objects.filter(pk=job.pk).exclude(current__follower="").exists(), 30,
                 "the worker to claim the job", 0.1)  # fmt: skip
        ws, ws_out = start_wsclient(base, job.pk, cookie, tmp, args.timeout)
        procs.append(ws)
        rank = Rank.objects.get(job=job, index=0)
        remote_log = Path(rank.remote_log)  # the node is this machine
        go(cluster)
        done_file = cluster.nodes[0].workdir / "rank_done.json"
        wait_for(done_file.exists, args.timeout, "the rank to finish printing", 0.05)
        rank_done = json.loads(done_file.read_text())

        # When did the DB hold every line? (polled every 50 ms; the job ends once torchrun exits)
        def db_complete():
            in_lines = remote_log.read_bytes().count(b"\n") if remote_log.exists() else -1
            r = Rank.objects.get(pk=rank.pk)
            return r.state == Rank.State.EXITED and r.log_lines >= in_lines

        wait_for(db_complete, args.timeout, "the DB to count every line", 0.05)
        t_db_complete = time.time()
        ws.wait(timeout=args.timeout)
        records = json.loads(ws_out.read_text())
        job.refresh_from_db()
        rank.refresh_from_db()
        remote = remote_log.read_bytes()
        local = rank.local_log.read_bytes()
        points = MetricPoint.objects.filter(job=job).count()
        points_loss = MetricPoint.objects.filter(job=job, name="loss").count()
    finally:
        cleanup(cluster, procs, tmp, args.keep)

    lines_ev = [r for r in records if r["kind"] == "lines"]
    ws_lines = sum(r["n"] for r in lines_ev)
    ws_bench = sum(r["bench"] for r in lines_ev)
    # byte ranges: each commit's lines go out as one or more slices with the same (start, end)
    ranges = sorted({(r["start"], r["end"]) for r in lines_ev})
    contiguous = all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False)) and (
        not ranges or ranges[0][0] == 0
    )
    t_first = rank_done["t_first"]
    t_last_ws = max(r["t"] for r in lines_ev) if lines_ev else None
    in_lines = remote.count(b"\n")
    metric_lines = len(range(0, args.lines, args.metric_every))
    summary = {
        "rank_printed": rank_done["printed"],
        "rank_print_seconds": round(rank_done["t_last"] - rank_done["t_first"], 3),
        "rank_print_lines_per_s": round(rank_done["printed"] / max(1e-9, rank_done["t_last"] - t_first)),
        "in_node_log_lines": in_lines,
        "in_node_log_extra_lines_from_torchrun": in_lines - rank_done["printed"],
        "db_rank_log_lines": rank.log_lines,
        "central_file_lines": local.count(b"\n"),
        "central_file_byte_equal_to_node_log": local == remote,
        "ws_lines": ws_lines,
        "ws_rank_printed_lines": ws_bench,
        "ws_messages": len(lines_ev),
        "ws_byte_ranges_contiguous": contiguous,
        "ws_last_range_end": ranges[-1][1] if ranges else None,
        "ws_server_closes": [r["why"] for r in records if r["kind"] == "_closed"],
        "metric_lines_printed": metric_lines,
        "db_metric_points_loss": points_loss,
        "db_metric_points_all": points,
        "all_equal": len({in_lines, rank.log_lines, local.count(b"\n"), ws_lines}) == 1 and points_loss == metric_lines,
        "seconds_first_print_to_last_ws_receive": round(t_last_ws - t_first, 3) if t_last_ws else None,
        "pipeline_lines_per_s": round(in_lines / (t_last_ws - t_first)) if t_last_ws else None,
        "seconds_first_print_to_db_complete": round(t_db_complete - t_first, 3),
        "db_lines_per_s_upper_bound": round(in_lines / (t_db_complete - t_first)),
        "job_state": job.state,
        "bench_wall_s": round(time.monotonic() - t_start, 1),
    }
    print(json.dumps(summary, indent=2))
    path = RESULTS / "log_throughput.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data["method"] = __doc__.split("\n\n", 2)[2].strip()
    data.setdefault("runs", {})[args.label] = {
        "machine": info,
        "params": {"lines": args.lines, "metric_every": args.metric_every, "rate": args.rate},
        "note": args.note,
        "summary": summary,
        "ws_receive_timeline": [[round(r["t"] - t_first, 4), r["n"], r["np"]] for r in lines_ev],
    }
    write_json(path, data)
    print("wrote", path)


if __name__ == "__main__":
    main()
