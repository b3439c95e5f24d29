"""The queue: QUEUED jobs start on free GPUs in priority order, with backfill (jobs/placement.py).

One pass reads the cluster in a fixed number of queries (nodes, GPUs, allocations, queued jobs,
usage, sweeps), asks jobs/placement.py what starts, and claims the GPUs of each starting job under
the database's one-active-allocation-per-GPU constraint; a pass that loses a race to another
scheduler simply leaves that job for the next pass.
"""

from __future__ import annotations

import logging
import time

from django.db import transaction

from ugro_site.celery import send_task

from . import lifecycle, power
from .failure import Failure, FailureKind
from .launch import launch
from .models import Job
from .snapshot import Snapshot, queue
from .stop import stop_processes

log = logging.getLogger(__name__)


def queued_jobs() -> list[Job]:
    """Waiting jobs in the order the scheduler considers them (priority, fair share, age)."""
    return [entry.job for entry in queue()]


def place_queued(only: list[int] | None = None) -> list[Job]:
    """Claim GPUs for the queued jobs that can start now (backfill included); returns them, STARTING.

    only: start just these jobs (a command starting its own job); the others still keep their place
    and their reservations.
    """
    snap = Snapshot()
    decisions = snap.plan(estimates=False)
    power.wake_for_queue(snap, decisions)  # asleep nodes a waiting job fits only with are woken for it
    starting = [d for d in decisions if d.start and (only is None or d.job in only)]
    jobs = snap.jobs([d.job for d in starting])
    placed = []
    for decision in starting:
        job = jobs.get(decision.job)
        if job is None or job.state != Job.State.QUEUED:
            continue
        nodes = [snap.node_rows[node_id] for node_id, _ in decision.placement]
        gpus = [indices for _, indices in decision.placement]
        order = sorted(range(len(nodes)), key=lambda i: nodes[i].placement_key())  # the master hosts rank 0
        if lifecycle.claim_nodes(job, [nodes[i] for i in order], [gpus[i] for i in order]):
            placed.append(job)
        else:
            log.info("job %s lost its GPUs to another scheduler; the next pass places it", job.name)
    return placed


def place(job: Job) -> bool:
    """Start one queued job now if the queue lets it (it fits and delays no reservation)."""
    placed = bool(place_queued(only=[job.pk]))
    job.refresh_from_db()
    return placed


def schedule(only: list[int] | None = None) -> list[Job]:
    """Place and launch whatever can start now; returns the jobs launched here (the starts loop stops
    jobs past their time limit: jobs/loops/starts.py)."""
    launched = []
    for job in place_queued(only):
        try:
            launched.append(launch(job))
        except Exception as exc:  # a launch bug must not leave the job STARTING with its GPUs held
            log.exception("launch of %s crashed", job.name)
            stop_processes(job)
            lifecycle.fail(job, Failure(kind=FailureKind.UNKNOWN, rank=None, node=None, exit_code=None,
                                        signal=None, line=f"launch crashed: {type(exc).__name__}: {exc}"))  # fmt: skip
    return launched


def request_schedule() -> None:
    """After this transaction commits, ask the worker to start what can start (if a broker answers;
    without one, jobs wait QUEUED for beat's next tick)."""
    transaction.on_commit(lambda: send_task("jobs.tasks.schedule_jobs"))


def hand_to_worker(job: Job, handover_s: float = 5.0) -> Job:
    """Ask the worker to start what can start, and wait (bounded) for its answer about this job: placed
    and its ranks up, failed, or still queued (its nodes busy). The worker does the starting."""
    request_schedule()  # runs now: a command's connection is in autocommit
    deadline = time.monotonic() + handover_s
    while job.state == Job.State.QUEUED and time.monotonic() < deadline:
        time.sleep(0.02)
        job.refresh_from_db()
    deadline = time.monotonic() + job.sync_window_s + 60
    while job.state == Job.State.STARTING and time.monotonic() < deadline:
        time.sleep(0.05)
        job.refresh_from_db()
    return job
