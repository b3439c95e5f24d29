"""Scheduler simulation: a 500-job trace on 8 nodes x 2 GPUs (8/12/24 GB), replayed with a simulated clock
through UGRO's real planner (jobs/placement.py `plan`, the function jobs/scheduler.py calls every pass),
under several policies side by side; then the time of one scheduling pass with 1,000 queued jobs: the
planner alone, and the real database pass (jobs/scheduler.py `place_queued`) on a throwaway PostgreSQL
database.

    .venv/bin/python bench/scheduler_sim.py [--jobs 500] [--seed 11] [--load 0.95] [--pass-jobs 1000] [--keep]
        [--checkpoint-min 10] [--grace-s 30] [--restart-s 60]

Policies (the same planner, the same trace):
- easy: UGRO's default: priority order, backfill, one reservation (Slurm's EASY backfill)
- easy_preempt: easy, plus loans: a later job may start on reserved GPUs past the reservation and is
  requeued (resuming from its last checkpoint; the work since, the grace and a reload are counted lost)
  when the reserved job could start (Limits.preempt; not wired into the real scheduler)
- easy_exact_runtimes, easy_preempt_exact_runtimes: the same, planned with every job's real run time
  instead of its time limit (an oracle: the most any runtime estimate could give)
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
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench._common import RESULTS, make_tmp, setup_django  # noqa: E402
from bench._db import throwaway_database  # noqa: E402
from jobs.placement import Demand, Limits, NodeView, Running, Slot, choose, decayed_usage, plan  # noqa: E402

# 8 nodes x 2 GPUs: three with 8 GB cards, three with 12 GB, two with 24 GB
NODE_VRAM_GB = [8, 8, 8, 12, 12, 12, 24, 24]
GPUS_PER_NODE = 2
TOTAL_GPUS = len(NODE_VRAM_GB) * GPUS_PER_NODE
USERS = 6
HALF_LIFE_S = 24 * 3600.0
POLICIES = {
    "easy": (Limits(reservations=1), False),
    "easy_preempt": (Limits(reservations=1, preempt=True), False),
    "easy_exact_runtimes": (Limits(reservations=1), False),
    "easy_preempt_exact_runtimes": (Limits(reservations=1, preempt=True), False),
    "conservative": (Limits(reservations=10**6), False),
    "no_reservation": (Limits(reservations=0), False),
    "fifo": (Limits(reservations=0), True),
}
EXACT = {"easy_exact_runtimes", "easy_preempt_exact_runtimes"}  # an oracle: every estimate is the real run time


@dataclass
class Costs:
    """What a preemption costs (simulated): work since the last checkpoint is lost, the stop takes the
    kill grace, and the next attempt spends restart_s reloading before it makes progress again."""

    checkpoint_s: float = 600.0
    grace_s: float = 30.0
    restart_s: float = 60.0


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


def simulate(
    trace: list[TraceJob], limits: Limits, fifo: bool, exact: bool = False, costs: Costs | None = None
) -> dict:
    """Replay the trace: at every arrival and every end, one planner pass starts what it says.

    exact: plan with the real run times instead of the time limits (an oracle: the best any runtime
    estimate could do). With limits.preempt, the jobs a decision preempts stop after the grace and go
    back to the queue; their next attempt resumes from their last checkpoint (costs).
    """
    costs = costs or Costs()
    nodes = cluster()
    by_id = {j.id: j for j in trace}
    demands = {j.id: replace(j.demand, time_limit=min(j.duration, j.demand.time_limit)) if exact else j.demand
               for j in trace}  # fmt: skip
    # (time, 0 end / 1 arrival / 2 preempted, job, attempt): an end of an earlier attempt is stale
    events: list[tuple[float, int, int, int]] = [(j.submit, 1, j.id, 0) for j in trace]
    heapq.heapify(events)
    queued: dict[int, Demand] = {}
    running: dict[int, Running] = {}
    started: dict[int, float] = {}
    attempt: dict[int, int] = {j.id: 0 for j in trace}
    left = {j.id: j.duration for j in trace}  # work still to do (after the last checkpoint kept)
    preemptions, lost_gpu_s, loans = 0, 0.0, 0
    queued_at: dict[int, float] = {}
    waited: dict[int, float] = {}  # time in the queue, over all its attempts
    history: list[tuple[int | None, float, float, float]] = []
    waiting_gpu_s = idle_while_waiting_gpu_s = usable_idle_gpu_s = busy_gpu_s = reserved_idle_gpu_s = 0.0
    reserved_now: set[tuple[int, int]] = set()  # GPUs the last pass reserved for a waiting job
    fits_free = False  # after the last pass, some waiting job fits the free GPUs if reservations are ignored
    blocked_idle_gpu_s = 0.0
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
            usable = {key for key, mb in vram.items() if key not in held and mb >= need}
            usable_idle_gpu_s += len(usable) * (t - now)
            reserved_idle_gpu_s += len(usable & reserved_now) * (t - now)
            if fits_free:
                blocked_idle_gpu_s += len(usable - reserved_now) * (t - now)
        busy_gpu_s += busy * (t - now)
        now = t
        while events and events[0][0] == now:
            _, kind, jid, n = heapq.heappop(events)
            if kind == 1:
                queued[jid], queued_at[jid] = demands[jid], now
            elif n == attempt[jid]:
                r = running.pop(jid)
                history.append((r.owner, started[jid], now, float(len(r.slots))))
                attempt[jid] += 1  # any later event of this attempt is stale
                if kind == 2:  # preempted: back in the queue, same priority and submission time
                    queued[jid], queued_at[jid] = demands[jid], now
        if not queued:
            continue
        usage = decayed_usage(
            history + [(r.owner, started[j], now, float(len(r.slots))) for j, r in running.items()], now, HALF_LIFE_S
        )
        t0 = time.perf_counter()
        decisions = plan(now, nodes, list(running.values()), list(queued.values()), usage, limits)
        pass_s += time.perf_counter() - t0
        passes += 1
        reserved_now = {(node, g) for d in decisions if d.reserved for node, gpus in d.placement for g in gpus}
        for d in decisions:
            for victim in d.preempt:
                r = running[victim]
                # progress this attempt made (its reload, if resumed, was counted lost by the preemption before)
                ran = max(0.0, now - started[victim] - (costs.restart_s if attempt[victim] else 0.0))
                kept = math.floor(ran / costs.checkpoint_s) * costs.checkpoint_s
                left[victim] -= kept
                # lost: the work since the last checkpoint, the grace, and the next attempt's reload
                lost_gpu_s += len(r.slots) * (ran - kept + costs.grace_s + costs.restart_s)
                preemptions += 1
                r.loan, r.ends_at = False, now + costs.grace_s
                heapq.heappush(events, (now + costs.grace_s, 2, victim, attempt[victim]))
            if not d.start:
                if fifo:
                    break  # nothing overtakes the first job that must wait
                continue
            job = by_id[d.job]
            slots = [(node, gpu) for node, gpus in d.placement for gpu in gpus]
            run_for = left[d.job] + (costs.restart_s if attempt[d.job] else 0.0)
            waited[d.job] = waited.get(d.job, 0.0) + now - queued_at[d.job]
            end = now + min(run_for, job.demand.time_limit)
            planned = min(run_for, job.demand.time_limit) if exact else job.demand.time_limit
            running[d.job] = Running(d.job, slots, now + planned, job.demand.owner, priority=job.demand.priority,
                                     submitted=job.demand.submitted, loan=d.loan)  # fmt: skip
            loans += d.loan
            started[d.job] = now
            del queued[d.job]
            heapq.heappush(events, (end, 0, d.job, attempt[d.job]))
        # would a job still waiting fit the GPUs free now (what the policy actually started), reservations aside?
        held_now = {key for r in running.values() for key in r.slots}
        shapes = {(q.gpus, q.nodes, q.per_node, q.named, q.min_vram_mb): q for q in queued.values()}
        fits_free = any(
            choose(q, nodes, lambda s, held_now=held_now: (s.node, s.index) not in held_now) for q in shapes.values()
        )
    waits = [waited[j.id] for j in trace]
    big = [waited[j.id] for j in trace if _size(j.demand) >= 8]
    small = [waited[j.id] for j in trace if _size(j.demand) == 1]
    makespan = now - trace[0].submit
    return {
        "idle_while_waiting_pct": round(100 * idle_while_waiting_gpu_s / waiting_gpu_s, 2) if waiting_gpu_s else 0.0,
        "usable_idle_while_waiting_pct": round(100 * usable_idle_gpu_s / waiting_gpu_s, 2) if waiting_gpu_s else 0.0,
        # of the usable idle: GPUs held empty for a reservation; the other usable idle GPUs while some waiting
        # job would fit the free GPUs but for a reservation (blocked); the rest is fragmentation (no waiting
        # job's size, shape and VRAM fits the free GPUs at all)
        "reserved_idle_while_waiting_pct": round(100 * reserved_idle_gpu_s / waiting_gpu_s, 2)
        if waiting_gpu_s
        else 0.0,
        "blocked_idle_while_waiting_pct": round(100 * blocked_idle_gpu_s / waiting_gpu_s, 2) if waiting_gpu_s else 0.0,
        "utilization_pct": round(100 * busy_gpu_s / (TOTAL_GPUS * makespan), 2),
        "wait_mean_min": round(statistics.fmean(waits) / 60, 1),
        "wait_p95_min": round(_pct(waits, 95) / 60, 1),
        "wait_max_min": round(max(waits) / 60, 1),
        "wait_mean_8gpu_min": round(statistics.fmean(big) / 60, 1) if big else None,
        "wait_max_8gpu_min": round(max(big) / 60, 1) if big else None,
        "wait_mean_1gpu_min": round(statistics.fmean(small) / 60, 1) if small else None,
        "makespan_h": round(makespan / 3600, 2),
        "loans": loans,
        "preemptions": preemptions,
        "lost_work_gpu_h": round(lost_gpu_s / 3600, 1),
        "lost_work_pct_of_busy": round(100 * lost_gpu_s / busy_gpu_s, 2) if busy_gpu_s else 0.0,
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


def time_db_pass(queued_n: int, keep: bool, repeat: int = 15, profile: bool = False) -> dict:
    """The real pass (jobs/scheduler.py place_queued: snapshot queries + planner + claims) and the queue
    listing, with queued_n jobs in a throwaway PostgreSQL database (created and dropped here) on 8 nodes
    x 2 GPUs, all GPUs held. Django binds its database once per process: main() runs this in a child."""
    tmp = make_tmp("ugro-schedsim-")
    try:
        with throwaway_database(keep=keep) as database_url:
            setup_django(tmp, database_url)
            try:
                return _db_pass(queued_n, repeat, profile)
            finally:
                from django.db import connections

                connections.close_all()
    finally:
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)


def _db_pass(queued_n: int, repeat: int, profile: bool) -> dict:
    """time_db_pass's measurement, Django set up on the throwaway database."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from cluster.models import GPU, Node
    from jobs.launch import LaunchRequest, create_job
    from jobs.models import Job
    from jobs.scheduler import place_queued
    from jobs.snapshot import Snapshot, queue

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
    passes, cpu, old_passes, listings = [], [], [], []
    if profile:  # where the time of one pass goes (printed, not saved)
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.runcall(place_queued)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    for _ in range(repeat):
        with CaptureQueriesContext(connection) as q:
            t0, c0 = time.perf_counter(), time.process_time()
            placed = place_queued()
            passes.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        assert placed == []
        # the same pass as before this change: every waiting job's estimate computed too
        t0 = time.perf_counter()
        assert not any(d.start for d in Snapshot().plan())
        old_passes.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        entries = queue()
        listings.append(time.perf_counter() - t0)
        assert len(entries) == queued_n
    snapshots, planner_in_pass, planner_estimates = [], [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        snap = Snapshot()
        t1 = time.perf_counter()
        snap.plan(estimates=False)
        t2 = time.perf_counter()
        snap.plan()
        t3 = time.perf_counter()
        snapshots.append(t1 - t0)
        planner_in_pass.append(t2 - t1)
        planner_estimates.append(t3 - t2)
    return {
        "queued": queued_n,
        "database": "postgres (throwaway)",
        "snapshot_median_ms": round(1000 * statistics.median(snapshots), 1),
        "pass_planner_median_ms": round(1000 * statistics.median(planner_in_pass), 1),
        "planner_with_estimates_median_ms": round(1000 * statistics.median(planner_estimates), 1),
        "place_queued_median_ms": round(1000 * statistics.median(passes), 1),
        "place_queued_min_ms": round(1000 * min(passes), 1),
        "place_queued_cpu_median_ms": round(1000 * statistics.median(cpu), 1),
        "pass_with_every_estimate_median_ms": round(1000 * statistics.median(old_passes), 1),
        "pass_with_every_estimate_min_ms": round(1000 * min(old_passes), 1),
        "load1": round(os.getloadavg()[0], 2),
        "queries_per_pass": len(q.captured_queries),
        "queue_listing_median_ms": round(1000 * statistics.median(listings), 1),
        "repeat": repeat,
    }


def db_pass_in_child(queued_n: int, keep: bool) -> dict:
    """time_db_pass in a fresh process (Django binds one database per process)."""
    args = [sys.executable, __file__, "--db-pass-only", "--pass-jobs", str(queued_n)] + (["--keep"] * keep)
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=500)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--load", type=float, default=0.95, help="offered load as a fraction of GPU capacity")
    ap.add_argument("--pass-jobs", type=int, default=1000)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--seeds", help="only the simulations, for these seeds (11,12,...): scheduler_sim_seeds.json")
    ap.add_argument("--db-pass-only", action="store_true", help="only time the database pass (a child)")
    ap.add_argument("--profile", action="store_true", help="with --db-pass-only: cProfile one pass first")
    ap.add_argument("--checkpoint-min", type=float, default=10.0, help="checkpoint interval of preempted jobs")
    ap.add_argument("--grace-s", type=float, default=30.0, help="SIGTERM to SIGKILL of a preempted job")
    ap.add_argument("--restart-s", type=float, default=60.0, help="a resumed attempt's reload before progress")
    args = ap.parse_args()
    if args.db_pass_only:
        result = time_db_pass(args.pass_jobs, args.keep, profile=args.profile)
        print(json.dumps(result))  # noqa: T201
        return

    costs = Costs(args.checkpoint_min * 60, args.grace_s, args.restart_s)
    if args.seeds:
        compare_seeds([int(x) for x in args.seeds.split(",")], args, costs)
        return
    trace = make_trace(args.jobs, args.seed, args.load)
    results = {}
    for name, (limits, fifo) in POLICIES.items():
        results[name] = simulate(trace, limits, fifo, exact=name in EXACT, costs=costs)
    load_before = os.getloadavg()[0]
    planner = time_planner(args.pass_jobs, args.seed)
    db_pass = {"postgres": db_pass_in_child(args.pass_jobs, args.keep)}
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
    cols = ["idle_while_waiting_pct", "usable_idle_while_waiting_pct", "reserved_idle_while_waiting_pct",
            "blocked_idle_while_waiting_pct",
            "utilization_pct", "wait_mean_min", "wait_p95_min", "wait_max_min", "wait_mean_8gpu_min",
            "wait_mean_1gpu_min", "preemptions", "lost_work_pct_of_busy"]  # fmt: skip
    print(f"{'policy':28}" + "".join(f"{c.removesuffix('_while_waiting_pct'):>16.16}" for c in cols))  # noqa: T201
    for name, r in results.items():
        print(f"{name:28}" + "".join(f"{r[c]!s:>16}" for c in cols))  # noqa: T201
    print(f"one planner pass, {planner['queued']} queued: median {planner['median_ms']} ms, "  # noqa: T201
          f"min {planner['min_ms']} ms (1-min load {load_before:.1f} on {os.cpu_count()} CPUs)")  # fmt: skip
    for db, r in db_pass.items():
        print(f"one database pass on {db}, {r['queued']} queued: median {r['place_queued_median_ms']} ms, "  # noqa: T201
              f"min {r['place_queued_min_ms']} ms (snapshot {r['snapshot_median_ms']} ms, planner "
              f"{r['pass_planner_median_ms']} ms; with every estimate {r['planner_with_estimates_median_ms']} ms), "
              f"{r['queries_per_pass']} queries; queue listing {r['queue_listing_median_ms']} ms")  # fmt: skip


SEED_POLICIES = ("easy", "easy_preempt", "easy_exact_runtimes", "easy_preempt_exact_runtimes", "fifo")
SEED_FIGURES = ("idle_while_waiting_pct", "usable_idle_while_waiting_pct", "reserved_idle_while_waiting_pct",
                "blocked_idle_while_waiting_pct",
                "utilization_pct", "wait_mean_min", "wait_p95_min", "wait_mean_8gpu_min", "wait_mean_1gpu_min",
                "preemptions", "lost_work_pct_of_busy")  # fmt: skip


def compare_seeds(seeds: list[int], args: argparse.Namespace, costs: Costs) -> None:
    """The policies that matter for the idle target on several traces, and their mean per figure."""
    runs: dict[str, dict[str, dict]] = {name: {} for name in SEED_POLICIES}
    for seed in seeds:
        trace = make_trace(args.jobs, seed, args.load)
        for name in SEED_POLICIES:
            limits, fifo = POLICIES[name]
            runs[name][str(seed)] = simulate(trace, limits, fifo, exact=name in EXACT, costs=costs)
    means = {
        name: {f: round(statistics.fmean(r[f] for r in by_seed.values()), 2) for f in SEED_FIGURES}
        for name, by_seed in runs.items()
    }
    out = {"benchmark": "scheduler_sim_seeds", "args": vars(args), "costs": vars(costs), "mean": means, "runs": runs,
           "measured_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "scheduler_sim_seeds.json").write_text(json.dumps(out, indent=2) + "\n")
    print(
        f"{'mean of seeds ' + args.seeds:28}"
        + "".join(f"{c.removesuffix('_while_waiting_pct'):>16.16}" for c in SEED_FIGURES)
    )  # noqa: T201
    for name, m in means.items():
        print(f"{name:28}" + "".join(f"{m[c]!s:>16}" for c in SEED_FIGURES))  # noqa: T201


if __name__ == "__main__":
    main()
