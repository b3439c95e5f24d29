"""Scheduler simulation: a 500-job trace on 8 nodes x 2 GPUs (8/12/24 GB), replayed with a simulated clock
through UGRO's real planner (jobs/placement.py `plan`, the function jobs/scheduler.py calls every pass),
under four policies side by side; then the time of one scheduling pass with 1,000 queued jobs, both the
planner alone and the real database pass (jobs/scheduler.py `place_queued` on a throwaway SQLite DB).

    .venv/bin/python bench/scheduler_sim.py [--jobs 500] [--seed 11] [--load 0.95] [--pass-jobs 1000] [--keep]

Policies (the same planner, the same trace):
- easy: UGRO's default: priority order, backfill, one reservation (Slurm's EASY backfill)
- conservative: every waiting job holds a reservation (no job is ever delayed by a later one)
- no_reservation: backfill with no reservation at all (greedy: large jobs can starve)
- fifo: the old scheduler: priority order, first in first out, nothing overtakes (no backfill)

Writes bench/results/scheduler_sim.json and prints a table.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import random
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench._common import RESULTS, make_tmp, setup_django  # noqa: E402
from jobs.placement import Demand, Limits, NodeView, Running, Slot, decayed_usage, plan  # noqa: E402

# 8 nodes x 2 GPUs: three with 8 GB cards, three with 12 GB, two with 24 GB
NODE_VRAM_GB = [8, 8, 8, 12, 12, 12, 24, 24]
GPUS_PER_NODE = 2
TOTAL_GPUS = len(NODE_VRAM_GB) * GPUS_PER_NODE
USERS = 6
HALF_LIFE_S = 24 * 3600.0
POLICIES = {
    "easy": (Limits(reservations=1), False),
    "conservative": (Limits(reservations=10**6), False),
    "no_reservation": (Limits(reservations=0), False),
    "fifo": (Limits(reservations=0), True),
}


@dataclass
class TraceJob:
    id: int
    submit: float
    duration: float  # how long it really runs (it is stopped at its time limit if longer)
    demand: Demand


def make_trace(n: int, seed: int, load: float) -> list[TraceJob]:
    """n jobs: sizes 1-8 GPUs (mostly small), log-normal durations (median 30 min), time limits 1.1-3x the
    real duration rounded up to 10 min (5 % of jobs run past theirs), VRAM needs, priorities and users
    mixed; Poisson arrivals at `load` x the cluster's GPU capacity."""
    rng = random.Random(seed)
    sizes = [1] * 40 + [2] * 25 + [3] * 5 + [4] * 20 + [8] * 10
    raw = []
    for i in range(n):
        size = rng.choice(sizes)
        duration = min(12 * 3600.0, rng.lognormvariate(math.log(1800), 1.0))
        over = rng.random() < 0.05
        limit = duration * (rng.uniform(0.5, 0.95) if over else rng.uniform(1.1, 3.0))
        limit = math.ceil(limit / 600) * 600
        vram = None
        r = rng.random()
        if r < 0.15 and size <= 4:
            vram = 20 * 1024.0  # 24 GB cards only
        elif r < 0.40:
            vram = 10 * 1024.0  # 12 or 24 GB cards
        if rng.random() < 0.3 and size in (2, 4, 8):  # a gang: nodes x GPUs per node
            demand = Demand(job=i, gpus=None, nodes=size // 2, per_node=2)
        else:
            demand = Demand(job=i, gpus=size)
        demand.min_vram_mb = vram
        demand.time_limit = float(limit)
        demand.priority = rng.choices([0, 10, 50], weights=[70, 20, 10])[0]
        demand.owner = min(int(rng.paretovariate(1.2)), USERS)
        raw.append((size, duration, demand))
    mean_work = statistics.fmean(size * min(d, dem.time_limit) for size, d, dem in raw)
    gap = mean_work / (TOTAL_GPUS * load)
    t, out = 0.0, []
    for i, (_, duration, demand) in enumerate(raw):
        t += rng.expovariate(1 / gap)
        demand.submitted = t
        out.append(TraceJob(i, t, duration, demand))
    return out


def cluster() -> list[NodeView]:
    return [
        NodeView(i + 1, f"n{i + 1}", True, [Slot(i + 1, g, gb * 1024.0) for g in range(GPUS_PER_NODE)])
        for i, gb in enumerate(NODE_VRAM_GB)
    ]


def simulate(trace: list[TraceJob], limits: Limits, fifo: bool) -> dict:
    """Replay the trace: at every arrival and every end, one planner pass starts what it says."""
    nodes = cluster()
    by_id = {j.id: j for j in trace}
    events: list[tuple[float, int, int]] = [(j.submit, 1, j.id) for j in trace]  # (time, 0 end / 1 arrival, job)
    heapq.heapify(events)
    queued: dict[int, Demand] = {}
    running: dict[int, Running] = {}
    started: dict[int, float] = {}
    history: list[tuple[int | None, float, float, float]] = []
    waiting_gpu_s = idle_while_waiting_gpu_s = usable_idle_gpu_s = busy_gpu_s = 0.0
    vram = {(s.node, s.index): s.vram_mb for n in nodes for s in n.slots}
    passes, pass_s = 0, 0.0
    now = 0.0
    while events:
        t = events[0][0]
        busy = sum(len(r.slots) for r in running.values())
        if queued:
            waiting_gpu_s += TOTAL_GPUS * (t - now)
            idle_while_waiting_gpu_s += (TOTAL_GPUS - busy) * (t - now)
            # idle GPUs that some waiting job could use (its VRAM need fits the card)
            need = min(d.min_vram_mb or 0.0 for d in queued.values())
            held = {key for r in running.values() for key in r.slots}
            usable_idle_gpu_s += sum(1 for key, mb in vram.items() if key not in held and mb >= need) * (t - now)
        busy_gpu_s += busy * (t - now)
        now = t
        while events and events[0][0] == now:
            _, kind, jid = heapq.heappop(events)
            if kind == 1:
                queued[jid] = by_id[jid].demand
            else:
                r = running.pop(jid)
                history.append((r.owner, started[jid], now, float(len(r.slots))))
        if not queued:
            continue
        usage = decayed_usage(
            history + [(r.owner, started[j], now, float(len(r.slots))) for j, r in running.items()], now, HALF_LIFE_S
        )
        t0 = time.perf_counter()
        decisions = plan(now, nodes, list(running.values()), list(queued.values()), usage, limits)
        pass_s += time.perf_counter() - t0
        passes += 1
        for d in decisions:
            if not d.start:
                if fifo:
                    break  # nothing overtakes the first job that must wait
                continue
            job = by_id[d.job]
            slots = [(node, gpu) for node, gpus in d.placement for gpu in gpus]
            end = now + min(job.duration, job.demand.time_limit)
            running[d.job] = Running(d.job, slots, now + job.demand.time_limit, job.demand.owner)
            started[d.job] = now
            del queued[d.job]
            heapq.heappush(events, (end, 0, d.job))
    waits = [started[j.id] - j.submit for j in trace]
    big = [started[j.id] - j.submit for j in trace if _size(j.demand) >= 8]
    small = [started[j.id] - j.submit for j in trace if _size(j.demand) == 1]
    makespan = now - trace[0].submit
    return {
        "idle_while_waiting_pct": round(100 * idle_while_waiting_gpu_s / waiting_gpu_s, 2) if waiting_gpu_s else 0.0,
        "usable_idle_while_waiting_pct": round(100 * usable_idle_gpu_s / waiting_gpu_s, 2) if waiting_gpu_s else 0.0,
        "utilization_pct": round(100 * busy_gpu_s / (TOTAL_GPUS * makespan), 2),
        "wait_mean_min": round(statistics.fmean(waits) / 60, 1),
        "wait_p95_min": round(_pct(waits, 95) / 60, 1),
        "wait_max_min": round(max(waits) / 60, 1),
        "wait_mean_8gpu_min": round(statistics.fmean(big) / 60, 1) if big else None,
        "wait_max_8gpu_min": round(max(big) / 60, 1) if big else None,
        "wait_mean_1gpu_min": round(statistics.fmean(small) / 60, 1) if small else None,
        "makespan_h": round(makespan / 3600, 2),
        "passes": passes,
        "plan_ms_mean": round(1000 * pass_s / passes, 3) if passes else None,
    }


def _size(d: Demand) -> int:
    return d.gpus if d.gpus is not None else (d.nodes or 1) * (d.per_node or GPUS_PER_NODE)


def _pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))]


def time_planner(queued_n: int, seed: int, repeat: int = 21) -> dict:
    """One planner pass with queued_n jobs waiting on a full cluster (every job gets a decision)."""
    trace = make_trace(queued_n + 8, seed, 1.0)
    nodes = cluster()
    running = [Running(10_000 + i, [(i + 1, 0), (i + 1, 1)], 3600.0 * (i + 1), i % USERS) for i in range(8)]
    demands = [j.demand for j in trace[:queued_n]]
    usage = {u: float(u) * 1000 for u in range(USERS + 1)}
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        decisions = plan(0.0, nodes, running, demands, usage, Limits(reservations=1))
        times.append(time.perf_counter() - t0)
    assert len(decisions) == queued_n
    return {"queued": queued_n, "median_ms": round(1000 * statistics.median(times), 2),
            "min_ms": round(1000 * min(times), 2), "max_ms": round(1000 * max(times), 2), "repeat": repeat}  # fmt: skip


def time_db_pass(queued_n: int, keep: bool, repeat: int = 7) -> dict:
    """The real pass (jobs/scheduler.py place_queued: snapshot queries + planner + claims) and the queue
    listing, with queued_n jobs in a throwaway SQLite database on 8 nodes x 2 GPUs, all GPUs held."""
    tmp = make_tmp("ugro-schedsim-")
    try:
        setup_django(tmp)
        from django.db import connection
        from django.test.utils import CaptureQueriesContext

        from cluster.models import GPU, Node
        from jobs.launch import LaunchRequest, create_job
        from jobs.models import Job
        from jobs.scheduler import place_queued
        from jobs.snapshot import queue

        for i, gb in enumerate(NODE_VRAM_GB):
            Node.objects.create(name=f"n{i + 1}", address=f"10.7.0.{i + 1}", order=i, gpu_count=GPUS_PER_NODE,
                                gpu_vram_gb=gb, role="master" if i == 0 else "worker")  # fmt: skip
        assert GPU.objects.count() == TOTAL_GPUS
        for i in range(8):
            create_job(LaunchRequest(name=f"hold{i}", gpus=2, script="s.py", time_limit_s=3600 * (i + 1)))
        assert len(place_queued()) == 8
        rng = random.Random(5)
        Job.objects.bulk_create(
            Job(name=f"q{i}", script="s.py", gpus=rng.choice([1, 1, 2, 4, 8]), priority=rng.choice([0, 0, 10, 50]),
                time_limit_s=rng.choice([600, 3600, 7200]))
            for i in range(queued_n)
        )  # fmt: skip
        passes, listings = [], []
        for _ in range(repeat):
            with CaptureQueriesContext(connection) as q:
                t0 = time.perf_counter()
                placed = place_queued()
                passes.append(time.perf_counter() - t0)
            assert placed == []
            t0 = time.perf_counter()
            entries = queue()
            listings.append(time.perf_counter() - t0)
            assert len(entries) == queued_n
        return {
            "queued": queued_n,
            "database": "sqlite (throwaway)",
            "place_queued_median_ms": round(1000 * statistics.median(passes), 1),
            "place_queued_min_ms": round(1000 * min(passes), 1),
            "queries_per_pass": len(q.captured_queries),
            "queue_listing_median_ms": round(1000 * statistics.median(listings), 1),
            "repeat": repeat,
        }
    finally:
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=500)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--load", type=float, default=0.95, help="offered load as a fraction of GPU capacity")
    ap.add_argument("--pass-jobs", type=int, default=1000)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()

    trace = make_trace(args.jobs, args.seed, args.load)
    results = {}
    for name, (limits, fifo) in POLICIES.items():
        results[name] = simulate(trace, limits, fifo)
    load_before = os.getloadavg()[0]
    planner = time_planner(args.pass_jobs, args.seed)
    db_pass = time_db_pass(args.pass_jobs, args.keep)
    out = {
        "benchmark": "scheduler_sim",
        "args": vars(args),
        "cluster": {"nodes": len(NODE_VRAM_GB), "gpus_per_node": GPUS_PER_NODE, "vram_gb": NODE_VRAM_GB},
        "trace": {
            "jobs": len(trace),
            "gpu_sizes": {str(s): sum(1 for j in trace if _size(j.demand) == s) for s in (1, 2, 3, 4, 8)},
            "gangs": sum(1 for j in trace if j.demand.per_node),
            "vram_10g": sum(1 for j in trace if j.demand.min_vram_mb == 10240),
            "vram_20g": sum(1 for j in trace if j.demand.min_vram_mb == 20480),
            "median_duration_min": round(statistics.median(j.duration for j in trace) / 60, 1),
            "past_time_limit": sum(1 for j in trace if j.duration > j.demand.time_limit),
        },
        "policies": results,
        "one_pass_planner": planner,
        "one_pass_database": db_pass,
        "load1_before_timing": round(load_before, 2),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "scheduler_sim.json").write_text(json.dumps(out, indent=2) + "\n")
    cols = ["idle_while_waiting_pct", "usable_idle_while_waiting_pct", "utilization_pct", "wait_mean_min",
            "wait_p95_min", "wait_max_min",
            "wait_mean_8gpu_min", "wait_max_8gpu_min", "wait_mean_1gpu_min", "makespan_h"]  # fmt: skip
    print(f"{'policy':16}" + "".join(f"{c:>31}" for c in cols))  # noqa: T201
    for name, r in results.items():
        print(f"{name:16}" + "".join(f"{r[c]!s:>31}" for c in cols))  # noqa: T201
    print(f"one planner pass, {planner['queued']} queued: median {planner['median_ms']} ms, "  # noqa: T201
          f"min {planner['min_ms']} ms (1-min load {load_before:.1f} on {os.cpu_count()} CPUs)")  # fmt: skip
    print(f"one database pass, {db_pass['queued']} queued: median {db_pass['place_queued_median_ms']} ms, "  # noqa: T201
          f"min {db_pass['place_queued_min_ms']} ms, "
          f"{db_pass['queries_per_pass']} queries; queue listing {db_pass['queue_listing_median_ms']} ms")  # fmt: skip


if __name__ == "__main__":
    main()
