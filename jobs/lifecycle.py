"""The job lifecycle: the one module that changes Job.state and Rank.state.

    QUEUED -> STARTING -> RUNNING -> SUCCEEDED
    QUEUED -> CANCELLED
    STARTING | RUNNING -> CANCELLING -> CANCELLED
    STARTING | RUNNING -> FAILING -> FAILED
    STARTING -> FAILED (nothing was started: unreachable node, pre-flight)
    FAILED | CANCELLED -> QUEUED (requeue: a resume or retry starts attempt N+1 of the same job)

Every transition is a conditional UPDATE from the states it may leave; a caller that loses the race
gets False and does nothing more. The final states release every node in the same transaction that
sets them. Side effects (alerts, websocket events, the next scheduling pass, the teardown of a
stopping job) run after commit and are safe to run again, so the reconciler (jobs/reconcile.py) can
repeat any of them after a crash at any point. docs/lifecycle.md draws the machine.
"""

from __future__ import annotations

import base64
import copy
import logging
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import Q
from django.utils import timezone

from cluster.alerts import job_ended_alerts, resolve_job_alerts
from cluster.fanout import node_request
from cluster.links import AgentRequestError, LinkError
from cluster.models import Node
from metrics import rollup
from metrics.models import MetricPoint
from ugro_site.celery import send_task

from . import locks
from .events import publish_job
from .failure import Failure, FailureKind, RankFacts, explain_now
from .logs import archive_logs, restore_logs, tail_lines
from .models import ATTEMPT_FIELDS, Allocation, Attempt, Checkpoint, Job, Rank
from .stop import stop_processes

log = logging.getLogger(__name__)

# STARTING may last the sync window plus this (connect, code sync, pre-flight) before it is a dead launch
STARTING_GRACE_S = 60.0
STOPPING_RETRY_S = 15.0  # a teardown not done by the kill grace plus this was lost with its worker: run it again

ERROR_FILE_MAX_BYTES = 256 * 1024
# TERM to KILL for the ranks left when a node was lost: they cannot save anything consistent without it
LOST_PEER_GRACE_S = 2.0
# A job whose failed ranks only saw a peer go away waits this long for the rank that went away to report its own
# end (the cause): a worker killed on one node is seen by its peers before its torchrun reports it.
FAILURE_SETTLE_S = 5.0


def _now() -> datetime:
    return timezone.now()


def _move(job: Job, sources: Iterable[str], target: str, **fields) -> bool:
    """The one way a job changes state: UPDATE ... WHERE state IN sources, and in the same transaction the
    fields given of its current attempt (tag, times, failure, ...) on that attempt's row. True if this call
    did it."""
    of_job = {"state": target, "state_changed_at": _now()}
    of_attempt = {}
    for key, value in fields.items():
        (of_attempt if key in ATTEMPT_FIELDS else of_job)[key] = value
    with transaction.atomic():
        updated = Job.objects.filter(pk=job.pk, state__in=list(sources)).update(**of_job)
        if updated and of_attempt:
            Attempt.objects.filter(pk=job.current_id).update(**of_attempt)
    if updated:
        for key, value in of_job.items():
            setattr(job, key, value)
        for key, value in of_attempt.items():
            setattr(job.current, key, value)
    else:
        job.refresh_from_db()
    return bool(updated)


def _release(job: Job) -> None:
    job.all_ranks.filter(active=True).update(active=False)
    job.allocations.filter(active=True).update(active=False)


# -- QUEUED -> STARTING ---------------------------------------------------------------------------


def claim_nodes(job: Job, nodes: list[Node], gpus: list[list[int]] | None = None) -> bool:
    """QUEUED -> STARTING on these nodes (in rank order); False, job untouched, if it lost a race.

    gpus[i]: the GPU indices taken on nodes[i]; None, or [] for a node, takes the node whole (all its
    GPUs; a node without GPUs as such). The database's one-active-allocation-per-GPU constraint
    refuses a GPU another scheduler took first.
    """
    tag = f"{job.name}-{uuid.uuid4().hex[:8]}"
    taken = [list(gpus[i]) if gpus and gpus[i] else list(range(node.gpu_count)) for i, node in enumerate(nodes)]
    held = sum(len(t) or 1 for t in taken)
    try:
        with transaction.atomic():
            if not _move(job, [Job.State.QUEUED], Job.State.STARTING, started_at=_now(), tag=tag, held_gpus=held):
                return False
            allocations = []
            for index, (node, indices) in enumerate(zip(nodes, taken, strict=True)):
                base = f"{node.workdir.rstrip('/') or '/'}/.ugro/jobs/{tag}/rank_{index}"
                Rank.objects.create(
                    job=job, attempt_id=job.current_id, node=node, index=index, remote_log=f"{base}.log",
                    remote_exit=f"{base}.exit", remote_error=f"{base}.error.json", start_record=f"{base}.start",
                    gpu_indices=indices,
                )  # fmt: skip
                allocations += [Allocation(job=job, node=node, gpu_index=g) for g in indices or [Allocation.WHOLE_NODE]]
            Allocation.objects.bulk_create(allocations)
    except IntegrityError:
        job.refresh_from_db()
        return False
    job.refresh_from_db()
    return True


# -- STARTING -> RUNNING --------------------------------------------------------------------------


@dataclass
class Started:
    """What a node said when it started a rank."""

    rank: Rank
    pid: int
    boot_id: str = ""


def shrink_starting(job: Job, kept: list[Rank]) -> bool:
    """A STARTING job that will run on fewer nodes than it was given (its scale probe measured them faster,
    jobs/scale_probe.py): its other ranks, which never started, are removed and their GPUs freed in one
    transaction. False, nothing changed, if the job left STARTING meanwhile."""
    keep = {r.pk for r in kept}
    with transaction.atomic():  # the job's row, then its attempt's, then its ranks'
        if not Job.objects.select_for_update().filter(pk=job.pk, state=Job.State.STARTING).exists():
            job.refresh_from_db()
            return False
        Attempt.objects.select_for_update().filter(pk=job.current_id).first()
        dropped = list(job.ranks.select_for_update().exclude(pk__in=keep).filter(state=Rank.State.PENDING))
        nodes = [r.node_id for r in dropped]
        job.allocations.filter(active=True, node_id__in=nodes).update(active=False)
        Rank.objects.filter(pk__in=[r.pk for r in dropped]).delete()
        held = job.allocations.filter(active=True).count()
        Attempt.objects.filter(pk=job.current_id).update(held_gpus=held)
        job.current.held_gpus = held
    log.warning("job %s: runs on %d nodes, %d freed by its scale probe", job.name, len(kept), len(dropped))
    transaction.on_commit(lambda: send_task("jobs.tasks.schedule_jobs"))  # the freed GPUs may start a queued job
    return True


def ranks_started(job: Job, started: list[Started], spread: float | None) -> bool:
    """Record the started ranks and move STARTING -> RUNNING; False if the job left STARTING meanwhile
    (cancelled, or timed out by the reconciler): whoever moved it stops the processes."""
    now = _now()
    with transaction.atomic():  # the job's row, then its attempt's, then its ranks': a follower's order too
        moved = _move(job, [Job.State.STARTING], Job.State.RUNNING, running_at=now, launch_spread_s=spread)
        _record_started(started, now)  # either way: whoever stops them needs their pids
    return moved


def ranks_started_partly(job: Job, started: list[Started], spread: float | None) -> None:
    """Record the ranks that did start of a launch that failed, so their output is still copied."""
    _record_started(started, _now())
    Attempt.objects.filter(pk=job.current_id).update(launch_spread_s=spread)


def _record_started(started: list[Started], now: datetime) -> None:
    """PENDING -> RUNNING for each rank a node started, with its pid and the node's boot id."""
    for s in started:
        Rank.objects.filter(pk=s.rank.pk, state=Rank.State.PENDING).update(
            pid=s.pid, boot_id=s.boot_id or "", state=Rank.State.RUNNING, started_at=now, last_contact=now
        )


def fail_unstarted(job: Job, kind: FailureKind, reason: str, node: str = "") -> bool:
    """STARTING -> FAILED when nothing was started (unreachable node, pre-flight): nodes freed at once.
    node: the (first) node that could not be reached, if that was why."""
    with transaction.atomic():
        done = _move(
            job, [Job.State.STARTING], Job.State.FAILED, finished_at=_now(), failure_node=node,
            failure_kind=kind.value, failure_reason=reason[:4000], recovery_note="", retry_at=None,
        )  # fmt: skip
        if done:
            _release(job)
    if done:
        transaction.on_commit(lambda: _announce_end(job))
    return done


# -- live -> stopping -> final --------------------------------------------------------------------


def fail(job: Job, failure: Failure) -> bool:
    """STARTING | RUNNING -> FAILING with the failure recorded; its processes are then stopped."""
    fields = {
        "failure_kind": failure.kind.value,
        "failure_rank": failure.rank,
        "failure_node": failure.node or "",
        "failure_exit_code": failure.exit_code,
        "failure_signal": failure.signal,
        "failure_line": (failure.line or "")[:2000],
        "failure_reason": failure.summary()[:4000],
        "recovery_note": "",  # the retry policy decides afresh for this failure
        "retry_at": None,
    }
    with transaction.atomic():
        done = _move(job, Job.LIVE_STATES, Job.State.FAILING, **fields)
    if done:
        log.warning("job %s failing: %s", job.name, job.failure_reason)
        _after_commit_stopping(job)
    return done


def cancel(job: Job, reason: str = "cancelled by user") -> Job:
    """Cancel a job: QUEUED -> CANCELLED, or live -> CANCELLING (its processes are then stopped).

    Raises ValueError for a job that already ended. Cancelling a job that is already stopping is a
    no-op that returns it as it is.
    """
    if job.is_ended:
        raise ValueError(f"job {job.name} already {job.state}")
    with transaction.atomic():
        if _move(
            job, [Job.State.QUEUED], Job.State.CANCELLED, finished_at=_now(),
            failure_kind=FailureKind.CANCELLED.value, failure_reason=reason[:4000],
        ):  # fmt: skip
            _release(job)
            transaction.on_commit(lambda: _announce_end(job))
            return job
        if _move(
            job, Job.LIVE_STATES, Job.State.CANCELLING,
            failure_kind=FailureKind.CANCELLED.value, failure_reason=reason[:4000],
        ):  # fmt: skip
            _after_commit_stopping(job)
            return job
    if job.is_ended:
        raise ValueError(f"job {job.name} already {job.state}")
    return job


def succeed(job: Job) -> bool:
    """RUNNING -> SUCCEEDED once every rank exited 0; the nodes are freed in the same transaction."""
    with transaction.atomic():
        done = _move(job, [Job.State.RUNNING], Job.State.SUCCEEDED, finished_at=_now())
        if done:
            _release(job)
    if done:
        transaction.on_commit(lambda: _announce_end(job))
    return done


def finalize(job: Job, unclean: list[str] | None = None) -> bool:
    """CANCELLING -> CANCELLED, FAILING -> FAILED, nodes released in the same transaction."""
    target = {Job.State.CANCELLING: Job.State.CANCELLED, Job.State.FAILING: Job.State.FAILED}.get(job.state)
    if target is None:
        return False
    fields = {"finished_at": _now()}
    if unclean:
        note = "; not confirmed stopped on " + "; ".join(unclean)
        fields["failure_reason"] = (job.failure_reason + note)[:4000]
    with transaction.atomic():
        done = _move(job, [job.state], target, **fields)
        if done:
            _release(job)
    if done:
        transaction.on_commit(lambda: _announce_end(job))
    return done


def teardown(job: Job) -> bool:
    """Stop a stopping job's processes on every node, then make its end final. Safe to repeat.

    Nodes that could not be confirmed clean are named in the reason; the reconciler kills any
    process tagged with an ended job when such a node answers again. A teardown of the same job already
    under way on another worker (or thread) is left to finish: False here.
    """
    with locks.held(locks.TEARDOWN, job.pk) as mine:
        if not mine:  # another worker is tearing it down right now
            return False
        job.refresh_from_db()
        if not job.is_stopping:
            return False
        # a launch still starting ranks (a cancel during the start): its processes exist only once it is done
        if not locks.wait_free(locks.LAUNCH, job.pk, launch_limit_s(job)):
            log.warning("teardown of %s: its launch is still under way; stopping what it started so far", job.name)
        grace = None
        if job.failure_kind == FailureKind.NODE_LOST:
            # the others are stuck in a collective with the lost node's ranks: nothing to wait for
            grace = min(settings.UGRO["KILL_GRACE_S"], LOST_PEER_GRACE_S)
        unclean = stop_processes(job, grace=grace)
        return finalize(job, unclean)


def launch_limit_s(job: Job) -> float:
    """How long a launch may take before it is taken for dead (its launcher gone or hung)."""
    return job.sync_window_s + STARTING_GRACE_S


def _after_commit_stopping(job: Job) -> None:
    def go() -> None:
        publish_job(job, "state", {"state": job.state, "reason": job.failure_reason})
        dispatch_teardown(job)

    transaction.on_commit(go)


def dispatch_teardown(job: Job) -> None:
    """Hand the teardown to the worker. Not queued (the broker away): the reconciler tears a stopping job
    down again after STOPPING_RETRY_S, so nothing is lost but time."""
    if not send_task("jobs.tasks.teardown_job", job.pk):
        log.warning("teardown of %s not queued (no broker); the reconciler repeats it", job.name)


def wait_final(job: Job) -> Job:
    """Wait (bounded: the kill grace and a margin) for the worker to bring a stopping job to its final
    state; returns the job as it then is."""
    deadline = time.monotonic() + settings.UGRO["KILL_GRACE_S"] + STOPPING_RETRY_S
    while job.is_stopping and time.monotonic() < deadline:
        time.sleep(0.1)
        job.refresh_from_db()
    return job


def _announce_end(job: Job) -> None:
    """After a final state commits: tell the pages and people, and let queued jobs start."""
    job.refresh_from_db()
    publish_job(job, "state", {"state": job.state, "reason": job.failure_reason})
    try:
        job_ended_alerts(job)
    except Exception:  # an alert must never keep a job from ending
        log.exception("alerts for the end of %s failed", job.name)
    send_task("jobs.tasks.schedule_jobs")


# -- FAILED | CANCELLED -> QUEUED: the next attempt ---------------------------------------------


RESUMABLE_STATES = (Job.State.FAILED, Job.State.CANCELLED)


@dataclass
class NextAttempt:
    """What the next attempt of an ended job starts from and where it may run."""

    reason: str  # why (a person's resume, or the retry policy and the failure kind)
    checkpoint: Checkpoint | None = None
    resume_path: str = ""  # the checkpoint as rank 0 names it ("" = from scratch)
    nodes: list[str] | None = None  # node names (None: as the job asked before)
    count: int | None = None  # a node count instead of names
    batch: dict | None = None  # new batch values for the job's batch template
    retry_at: datetime | None = None  # not before (backoff); None: at once
    wait_nodes: list[str] | None = None  # lost nodes it waits for, QUEUED, before it may start


def _next_attempt(job: Job, nxt: NextAttempt, moved) -> None:
    """Inside requeue's transaction: the ended attempt closed (how it ended, its last step, where its logs
    went; its ranks stay its own), the next one added as the job's current, the curve cut, the job QUEUED."""
    ended = job.current
    last_step = (
        MetricPoint.objects.filter(job=job, attempt=ended.number, step__isnull=False)
        .order_by("-step")
        .values_list("step", flat=True)
        .first()
    )
    Attempt.objects.filter(pk=ended.pk).update(
        state=job.state, last_step=last_step, logs_dir=str(moved) if moved else "", next_reason=nxt.reason[:300],
        follower="", follower_until=None,
    )  # fmt: skip
    from_step = nxt.checkpoint.step if nxt.checkpoint is not None else None
    where = {"requested_nodes": ended.requested_nodes, "requested_count": ended.requested_count}
    if nxt.nodes is not None:
        where = {"requested_nodes": list(nxt.nodes), "requested_count": None}
    elif nxt.count is not None:
        where = {"requested_nodes": [], "requested_count": nxt.count}
    following = Attempt.objects.create(
        job=job, number=ended.number + 1, resume_checkpoint=nxt.checkpoint, resume_path=nxt.resume_path,
        from_step=from_step, retry_at=nxt.retry_at, recovery_note=nxt.reason[:2000],
        wait_nodes=list(nxt.wait_nodes or []), batch=nxt.batch if nxt.batch is not None else ended.batch, **where,
    )  # fmt: skip
    if not _move(job, [job.state], Job.State.QUEUED, current=following):
        raise RuntimeError(f"job {job.name} left {job.state} while its row was locked")
    cut = MetricPoint.objects.filter(job=job, superseded=False)
    (cut.filter(step__gt=from_step) if from_step is not None else cut).update(superseded=True)
    rollup.cut(job.pk, from_step)  # the charts' rollup leaves them too


def requeue(job: Job, nxt: NextAttempt) -> bool:
    """FAILED | CANCELLED -> QUEUED as attempt N+1 of the same job (same name, same curve).

    The next attempt is a new Attempt row, the job's current; the ended one keeps its row and its ranks, and
    its central logs move to logs/attempt_<N>/; its metric points past the step the new attempt starts from
    leave the curve (superseded, not deleted). False if the job is not in a resumable state (another resume
    won the race, or it is still live).
    """
    with transaction.atomic():
        # the row lock makes a second resume wait, then see the job QUEUED: it moves no log file
        locked = Job.objects.select_for_update().filter(pk=job.pk).first()
        if locked is None or locked.state not in RESUMABLE_STATES:
            job.refresh_from_db()
            return False
        job.refresh_from_db()
        number = job.attempt
        moved = archive_logs(job, number)  # the next attempt must never write over them
        try:
            _next_attempt(job, nxt, moved)
        except Exception:
            if moved:
                restore_logs(job, number)
            raise
    log.warning("job %s: attempt %d queued (%s)", job.name, job.attempt, nxt.reason)

    def go() -> None:
        publish_job(job, "state", {"state": job.state, "reason": nxt.reason, "attempt": job.attempt})
        resolve_job_alerts(job.name)  # the failure is being dealt with
        send_task("jobs.tasks.schedule_jobs")

    transaction.on_commit(go)
    return True


def node_back(job: Job, node_name: str) -> bool:
    """A lost node a QUEUED attempt waits for answers again (and holds nothing of the job any more): the
    attempt stops waiting for it, and may start once it waits for none. False if the job moved meanwhile."""
    with transaction.atomic():
        locked = Job.objects.select_for_update().filter(pk=job.pk, state=Job.State.QUEUED).first()
        if locked is None or node_name not in locked.wait_nodes:
            job.refresh_from_db()
            return False
        left = [n for n in locked.wait_nodes if n != node_name]
        Attempt.objects.filter(pk=locked.current_id).update(wait_nodes=left)
    job.refresh_from_db()
    log.warning("job %s: node %s is back%s", job.name, node_name, "" if left else "; it may start")
    if not left:
        transaction.on_commit(lambda: send_task("jobs.tasks.schedule_jobs"))
    return True


# -- ranks ----------------------------------------------------------------------------------------


def rank_progress(rank: Rank, old_offset: int, fields: dict, exit_info: dict | None = None) -> bool:
    """Advance a rank's offset from old_offset (compare-and-set); with exit_info it becomes EXITED."""
    if exit_info is not None:
        ended = exit_info.get("ended")
        fields = {
            **fields,
            "state": Rank.State.LOST if rank.state == Rank.State.LOST else Rank.State.EXITED,
            "exit_code": int(exit_info["rc"]),
            "ended_at": datetime.fromtimestamp(ended, tz=UTC) if ended else _now(),
            "drained": True,
        }
    updated = Rank.objects.filter(pk=rank.pk, log_offset=old_offset).update(**fields)
    if updated:
        for key, value in fields.items():
            setattr(rank, key, value)
    return bool(updated)


def as_exited(rank: Rank) -> Rank:
    """The rank as it will be once rank_progress() takes its exit (EXITED), for what reads it just before: a
    copy in memory; its row is not touched."""
    view = copy.copy(rank)
    view.state = Rank.State.EXITED
    return view


# the fields a follower's pass advances on a running rank: what ranks_progress() writes in one statement
_PASS_FIELDS = frozenset({"log_offset", "log_lines", "last_contact", "metric_step"})


def ranks_progress(moves: list[tuple[Rank, int, dict, dict | None]]) -> bool:
    """rank_progress() for each (rank, old_offset, fields, exit_info) of one pass; True if every rank was
    still at its old offset. The ranks that only advance go in one UPDATE (a statement per rank was a
    round trip each, every pass); a rank that exits goes through rank_progress() alone."""
    plain = [(rank, old, fields) for rank, old, fields, exit_info in moves if exit_info is None]
    for rank, old, fields, exit_info in moves:
        if exit_info is not None and not rank_progress(rank, old, fields, exit_info):
            return False
    contact = {fields.get("last_contact") for _, _, fields in plain}
    if len(plain) < 2 or len(contact) != 1 or any(
        set(fields) - _PASS_FIELDS or "log_offset" not in fields or "log_lines" not in fields
        for _, _, fields in plain
    ):  # fmt: skip
        return all(rank_progress(rank, old, fields) for rank, old, fields in plain)
    table = connection.ops.quote_name(Rank._meta.db_table)
    rows = ", ".join(["(%s::bigint, %s::bigint, %s::bigint, %s::bigint, %s::bigint)"] * len(plain))
    params: list = [contact.pop()]
    for rank, old, fields in plain:
        params += [rank.pk, old, fields["log_offset"], fields["log_lines"], fields.get("metric_step")]
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {table} AS r SET log_offset = v.new_offset, log_lines = v.lines, last_contact = %s,"
            " metric_step = COALESCE(v.step, r.metric_step)"
            f" FROM (VALUES {rows}) AS v(id, old, new_offset, lines, step)"
            " WHERE r.id = v.id AND r.log_offset = v.old",
            params,
        )
        updated = cursor.rowcount
    if updated != len(plain):
        return False
    for rank, _, fields in plain:
        for key, value in fields.items():
            setattr(rank, key, value)
    return True


def rank_lost(rank: Rank, reason: str) -> bool:
    """PENDING | RUNNING -> LOST: its node stopped answering, rebooted, or its wrapper died."""
    updated = Rank.objects.filter(pk=rank.pk, state__in=[Rank.State.PENDING, Rank.State.RUNNING]).update(
        state=Rank.State.LOST, lost_reason=reason[:2000]
    )
    if updated:
        rank.state, rank.lost_reason = Rank.State.LOST, reason
        log.warning("%s lost: %s", rank, reason)
    return bool(updated)


def rank_drained(rank: Rank) -> None:
    Rank.objects.filter(pk=rank.pk).update(drained=True)
    rank.drained = True


# -- judging a running job ------------------------------------------------------------------------


def _error_file(rank: Rank) -> str | None:
    if not rank.remote_error:
        return None
    try:
        item = node_request(
            rank.node, "tail", timeout=5,
            files=[{"key": rank.pk, "path": rank.remote_error, "offset": 0, "max_bytes": ERROR_FILE_MAX_BYTES}],
        )["files"][0]  # fmt: skip
    except (LinkError, AgentRequestError, OSError, KeyError, IndexError):
        return None
    if item.get("size") is None:
        return None
    return base64.b64decode(item["data"]).decode("utf-8", "replace")


def rank_facts(rank: Rank) -> RankFacts:
    """What jobs/failure.py needs of a rank; the error file is read from its node only for a failed exit."""
    rc = rank.exit_code
    error_file = _error_file(rank) if rank.state == Rank.State.EXITED and rc else None
    return RankFacts(
        index=rank.index,
        node=rank.node.name,
        state=str(rank.state),
        torchrun_rc=rc if rc is None or rc >= 0 else None,
        signal=-rc if rc is not None and rc < 0 else None,
        error_file=error_file,
        log_tail=tail_lines(rank, 200),
        lost_reason=rank.lost_reason or None,
    )


def judge(job: Job) -> bool:
    """End a RUNNING job when its ranks say how it ended: True if this call moved it."""
    ranks = list(job.ranks.select_related("node").order_by("index"))
    if not ranks or job.state != Job.State.RUNNING:
        return False
    failed = [r for r in ranks if _rank_failed(r)]
    if failed:
        failure, settled = explain_now([rank_facts(r) for r in ranks])
        if not settled and not _settle_over(failed):
            return False  # only consequences so far: the rank they saw go away may yet report why
        if failure is None:  # cannot happen with a bad rank, but never leave the job running on it
            failure = Failure(kind=FailureKind.UNKNOWN, rank=None, node=None, exit_code=None, signal=None, line="")
        return fail(job, failure)
    if all(r.state == Rank.State.EXITED for r in ranks):
        return succeed(job)
    return False


def _rank_failed(rank: Rank) -> bool:
    return rank.state == Rank.State.LOST or (rank.state == Rank.State.EXITED and rank.exit_code != 0)


def failure_settling(job: Job) -> bool:
    """Whether judge() left this job running although a rank of it failed: it waits (FAILURE_SETTLE_S) for the
    cause of a failure that is only a consequence. One light query, no log read."""
    if job.state != Job.State.RUNNING:
        return False
    return any(_rank_failed(r) for r in job.ranks.only("state", "exit_code"))


def _settle_over(failed: list[Rank]) -> bool:
    """Whether FAILURE_SETTLE_S passed since the first of these ranks' ends was taken (this controller's clock:
    a rank's last contact, not its node's time of exit)."""
    seen = [r.last_contact for r in failed if r.last_contact is not None]
    if not seen:
        return True
    return (_now() - min(seen)).total_seconds() >= FAILURE_SETTLE_S


def followable() -> Q:
    """Jobs with output still to copy: a rank that runs (or ran, and its exit is not yet seen)."""
    return Q(current__ranks__state=Rank.State.RUNNING)


HEARTBEAT_S = 10.0  # how often a launch that is still preparing says so


class StillStarting:
    """While a launch prepares its nodes (the code, --data, the environment, a checkpoint copy: minutes for tens of
    GB or a CUDA torch), the STARTING job's state_changed_at moves on every HEARTBEAT_S: the starts loop
    (jobs/loops/starts.py) takes a launch for dead after the sync window and a grace since then, and this one's
    launcher is alive. A launcher that dies stops moving it, and the loop fails the job as before."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="ugro-still-starting", daemon=True)

    def _run(self) -> None:
        try:
            while not self.stop.wait(HEARTBEAT_S):
                Job.objects.filter(pk=self.job.pk, state=Job.State.STARTING).update(state_changed_at=timezone.now())
        finally:
            connection.close()

    def __enter__(self) -> StillStarting:
        if self.job.pk is not None:
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=10)
