#!/usr/bin/env python
"""Delivery latency: a rank prints a metric line -> a logged-in websocket client receives it.

    .venv/bin/python bench/delivery_latency.py [--count 1000] [--rate 50] [--label NAME] [--keep]

One real sshd node on 127.0.3.2 runs the rank under the node env's torchrun, launched by UGRO
(create_job + schedule, the scheduler's own code); a real Celery worker (`-B -P threads`, beat
firing `follow_jobs` as in production) follows it; daphne serves `/ws/jobs/<id>/` and a websocket
client in a process of its own, logged in with a session cookie, records when each line arrives.
The rank waits until the worker has claimed the job and the client is connected, then prints
`{"step": i, "loss": ..., "t_print": time.time()}` at `rate` lines/s (absolute schedule).
Latency = receive time - t_print (one machine, one clock). Before GO, the worker's CPU and the
machine's are sampled for 5 s while the job runs silent (the cost of following an idle job).

Results: bench/results/delivery_latency.json, one entry per --label (others kept).
"""

from __future__ import annotations

import argparse
import json
import os
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
    pct,
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


def group_cpu(pgid: int) -> float:
    """CPU seconds (user+sys) of every live process in a process group."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fields = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # field 5 (pgrp), counted after the ')'
            total += int(fields[11]) + int(fields[12])
    return total / tick


def agent_cpu(address: str) -> float:
    """CPU seconds of the UGRO agents serving SSH sessions to `address` (the node's side)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if b"__ugro_agent__" not in Path(f"/proc/{name}/cmdline").read_bytes():
                continue
            env = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
            if not any(e.startswith(b"SSH_CONNECTION=") and f" {address} ".encode() in e for e in env):
                continue
            fields = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / tick


def machine_busy() -> tuple[int, int]:
    with open("/proc/stat") as fh:
        f = [int(x) for x in fh.readline().split()[1:]]
    return sum(f), f[3] + f[4]


def idle_cost(worker_pid: int, address: str, seconds: float = 5.0) -> dict:
    a0, c0, (t0, i0), w0 = agent_cpu(address), group_cpu(worker_pid), machine_busy(), time.monotonic()
    time.sleep(seconds)
    a1, c1, (t1, i1), w1 = agent_cpu(address), group_cpu(worker_pid), machine_busy(), time.monotonic()
    return {
        "seconds": round(w1 - w0, 2),
        "worker_cpu_percent": round(100 * (c1 - c0) / (w1 - w0), 1),
        "node_agent_cpu_percent": round(100 * (a1 - a0) / (w1 - w0), 1),
        "machine_busy_percent_of_all_cpus": round(100 * (1 - (i1 - i0) / max(1, t1 - t0)), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--rate", type=float, default=50.0)
    ap.add_argument("--label", default="current")
    ap.add_argument("--note", default="")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    run_seconds = args.count / args.rate

    tmp = make_tmp("ugro-bench3-lat-")
    cluster, procs = None, []
    t_start = time.monotonic()
    try:
        env = setup(tmp)
        info = machine_info()
        cluster = start_cluster(tmp, 1)
        daphne, base = start_daphne(env, tmp)
        procs.append(daphne)
        worker = start_worker(env, tmp)
        procs.append(worker)
        cookie = session_cookie()

        from jobs.launch import LaunchRequest, create_job
        from jobs.models import Job, Rank
        from jobs.scheduler import schedule

        write_rank_config(cluster, {"mode": "latency", "count": args.count, "rate": args.rate})
        job = create_job(LaunchRequest(name="latency", count=1, script="bench_rank.py"))
        schedule()
        job.refresh_from_db()
        if job.state != Job.State.RUNNING:
            raise RuntimeError(f"job did not start: {job.state} {job.failure_reason}")
        ws, ws_out = start_wsclient(base, job.pk, cookie, tmp, run_seconds + 120)
        procs.append(ws)
        wait_for(lambda: Job.objects.filter(pk=job.pk).exclude(current__follower="").exists(), 30,
                 "the worker to claim the job", 0.1)  # fmt: skip
        idle = idle_cost(worker.pid, cluster.nodes[0].address)
        print("idle (job running, rank silent):", idle)
        t_go = go(cluster)
        ws.wait(timeout=run_seconds + 150)
        records = json.loads(ws_out.read_text())
        job.refresh_from_db()
        rank = Rank.objects.get(job=job, index=0)
    finally:
        cleanup(cluster, procs, tmp, args.keep)

    received: dict[int, tuple[float, float]] = {}
    messages = 0
    for rec in records:
        if rec["kind"] != "lines":
            continue
        messages += 1
        for step, t_print in rec["tp"]:
            received.setdefault(step, (t_print, rec["t"]))
    lat_ms = [(received[s][1] - received[s][0]) * 1000 for s in sorted(received)]
    summary = {
        "lines_printed": args.count,
        "lines_received": len(received),
        "missing": args.count - len(received),
        "ws_line_messages": messages,
        "lines_per_message": round(len(received) / max(1, messages), 2),
        "p50_ms": round(pct(lat_ms, 50), 1),
        "p90_ms": round(pct(lat_ms, 90), 1),
        "p99_ms": round(pct(lat_ms, 99), 1),
        "max_ms": round(max(lat_ms), 1),
        "min_ms": round(min(lat_ms), 1),
        "mean_ms": round(sum(lat_ms) / len(lat_ms), 1),
        "ws_server_closes": [r["why"] for r in records if r["kind"] == "_closed"],
        "idle_follow_cost": idle,
        "job_state": job.state,
        "rank_log_lines": rank.log_lines,
        "bench_wall_s": round(time.monotonic() - t_start, 1),
    }
    print(json.dumps(summary, indent=2))
    path = RESULTS / "delivery_latency.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data.setdefault("method", (
        "1 sshd node on 127.0.3.2; rank = bench_rank.py under the node env's torchrun, launched by UGRO's scheduler; "
        "follower = a real `celery -A ugro_site worker -B -P threads -c 4` subprocess (beat fires follow_jobs); "
        "client = `websockets` in its own process, logged in by session cookie, on daphne's /ws/jobs/<id>/; "
        "latency = client receive time - the t_print the rank put in the line (same machine clock). "
        "PostgreSQL + Redis channel layer."
    ))  # fmt: skip
    data.setdefault("runs", {})[args.label] = {
        "machine": info,
        "params": {"count": args.count, "rate_per_s": args.rate, "go_at": t_go},
        "note": args.note,
        "summary": summary,
        "latency_ms_samples": [round(x, 2) for x in lat_ms],
    }
    write_json(path, data)
    print("wrote", path)


if __name__ == "__main__":
    main()
