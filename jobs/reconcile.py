"""The reconciler: make the database agree with what the nodes say, for every job, every few seconds.

The pattern of SkyPilot's job-status reconciler and dstack's per-state timeouts. Beat runs the
reconciler on the worker every few seconds (the worker is the only executor of job work) as one task per
loop (LOOPS: starts, running, stopping, ended, retries), side by side, one pass of each at a time across
workers. Each rule is idempotent and bounded in time, so running it twice, or after a crash anywhere, is
safe:

- A live job past its time limit (the job's own, else the cluster default): FAILING with kind TIMEOUT;
  the teardown sends SIGTERM, then SIGKILL after the kill grace (time for a last checkpoint).
- A trial of a sweep with --median-stop doing worse than the median of the others: cancelled.
- STARTING past its window (sync window + STARTING_GRACE_S): the launcher died or hung -> FAILING
  (TIMEOUT), the teardown stops whatever it started.
- CANCELLING or FAILING past the kill grace + STOPPING_RETRY_S: the teardown was lost -> run it here.
- RUNNING: each running rank is checked on its node (`rank_status`): a rank whose wrapper is gone
  without an exit record, or whose node rebooted since it started, is LOST; a rank whose node has
  not answered for NODE_LOST_AFTER_S is LOST. Then the job is judged (lifecycle.judge).
- An ended job that still holds nodes (a crash between its end and the release): released.
- A lost rank of an ended job whose node answers again: the rest of its output is fetched.
- Processes on a node tagged with a job this controller knows has ended: killed, and an alert says so.
- RUNNING with no metric line for longer than its hang limit: HUNG (jobs/recovery.py).
- FAILED with a retry policy: the policy decides, and a due retry is requeued (jobs/recovery.py); one after
  a lost node (without --min-nodes) waits QUEUED for that node.
- QUEUED waiting for a lost node that answers again: the job's leftovers there are stopped, then it may
  start (jobs/recovery.py release_waits).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Exists, OuterRef, Q
from django.db.models.functions import Coalesce
from django.utils import timezone

from cluster.alerts import open_alert, record_event, resolve
from cluster.fanout import node_request, on_each, unreachable
from cluster.models import Alert, Node
from metrics import rollup
from metrics.models import MetricPoint

from . import lifecycle, locks, recovery
from .failure import Failure, FailureKind
from .follow import follower_id, recover_output
from .models import Attempt, Job, Rank
from .scheduler import stop_overdue
from .stop import stop_processes
from .sweeps import median_stop

log = logging.getLogger(__name__)

STATUS_TIMEOUT_S = 5.0
STARTING_GRACE_S = 60.0  # STARTING may last the sync window plus this (connect, pre-flight) before it is a dead launch
LOST_OUTPUT_DAYS = 7
LEFTOVERS_S = 3600  # how long after its end a job's unfolded points are still looked for


@dataclass
class Report:
    """What one reconcile pass did (for logs, tests and the CLI)."""

    timed_out: list[str] = field(default_factory=list)
    stopped_early: list[str] = field(default_factory=list)
    torn_down: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    judged: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    recovered: list[str] = field(default_factory=list)
    orphans_killed: list[str] = field(default_factory=list)
    hung: list[str] = field(default_factory=list)
    stragglers: list[str] = field(default_factory=list)
    retried: list[str] = field(default_factory=list)
    node_back: list[str] = field(default_factory=list)
    folded: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return any(getattr(self, f) for f in self.__dataclass_fields__)


# The reconciler's loops, one per concern, each a list of (rule name, rule). Each loop runs as a task of its
# own (jobs.tasks.reconcile_loop), so a slow one (a teardown waiting out a kill grace, a node that does not
# answer) never delays the others, and one pass of a loop runs at a time across all workers.
LOOPS = ("starts", "running", "stopping", "ended", "retries")


def _rules(loop: str, jobs, job_ids: list[int] | None, orphans: bool, report: Report, now) -> list:
    every_job = job_ids is None
    return {
        # starts and limits: a launch past its window, a job past its time limit, a sweep trial worse than the median
        "starts": [
            ("starting", lambda: report.timed_out.extend(_starting_overdue(jobs, now))),
            ("time-limits", lambda: report.timed_out.extend(stop_overdue(job_ids))),
            *([("median-stop", lambda: report.stopped_early.extend(median_stop()))] if every_job else []),
        ],
        # running jobs: ranks checked on their nodes (lost ones marked), then judged; hangs and stragglers
        "running": [("running", lambda: _running(jobs, report))],
        # stopping jobs whose teardown was lost: torn down again
        "stopping": [("teardowns", lambda: report.torn_down.extend(_lost_teardowns(jobs, now)))],
        # ended jobs: nodes still held released, lost output fetched, points folded, leftover processes killed
        "ended": [
            ("release", lambda: report.released.extend(_release_ended(jobs))),
            ("lost-output", lambda: report.recovered.extend(_recover_lost_output(jobs, now))),
            ("rollup", lambda: report.folded.extend(fold_leftovers(jobs, now))),
            *([("orphans", lambda: report.orphans_killed.extend(kill_orphans()))] if every_job and orphans else []),
        ],
        # the retry policy and jobs waiting for a lost node (jobs/recovery.py)
        "retries": [
            ("retries", lambda: report.retried.extend(recovery.retry_pass(job_ids))),
            ("node-back", lambda: report.node_back.extend(recovery.release_waits(job_ids))),
        ],
    }[loop]


def reconcile(job_ids: list[int] | None = None, *, orphans: bool = True, loops=LOOPS, wait: bool = True) -> Report:
    """One pass of each loop over every job (or the given ones); see the module docstring for the rules.

    Each rule runs on its own (run_rule): one that raises is logged and alerted, and the rules after it
    still run. One pass of a loop runs at a time across all workers (locks.RECONCILE, keyed by the loop):
    two workers never act on the same job for the same concern at once. wait=False (the periodic tasks): a
    pass of that loop already under way elsewhere is enough, and this one is skipped."""
    report = Report()
    jobs = Job.objects.all() if job_ids is None else Job.objects.filter(pk__in=job_ids)
    for loop in loops:
        with locks.held(locks.RECONCILE, LOOPS.index(loop), wait=wait) as mine:
            if not mine:
                continue
            for name, rule in _rules(loop, jobs, job_ids, orphans, report, timezone.now()):
                run_rule(name, rule)
    if report:
        log.warning("reconcile: %s", report)
    return report


RULE_LOG_EVERY_S = 600.0  # a rule that keeps failing: its traceback again at most this often
_rule_logged: dict[str, float] = {}


def run_rule(name: str, rule) -> bool:
    """Run one rule of a periodic pass so that its failure stops neither the pass nor the loop: the traceback
    is logged (once per RULE_LOG_EVERY_S for a rule that keeps failing) and an alert stays open until the
    rule runs cleanly again. True when it ran cleanly."""
    key = f"rule:{name}"
    try:
        rule()
    except Exception as exc:
        last = _rule_logged.get(name)
        if last is None or time.monotonic() - last >= RULE_LOG_EVERY_S:
            _rule_logged[name] = time.monotonic()
            log.exception("reconcile rule %r failed; the other rules still run", name)
        try:
            with transaction.atomic():
                open_alert(None, key, Alert.Severity.WARNING,
                           f"the reconciler's {name!r} rule fails: {type(exc).__name__}: {exc}")  # fmt: skip
        except Exception:  # the database itself is away: the log says it
            log.debug("could not open the alert for rule %s", name, exc_info=True)
        return False
    if _rule_logged.pop(name, None) is not None:
        resolve(Alert.objects.filter(node=None, key=key, resolved_at__isnull=True))
    return True


def _starting_overdue(jobs, now) -> list[str]:
    """STARTING past its window: the launcher died or hung."""
    failed = []
    for job in jobs.filter(state=Job.State.STARTING):
        since = job.state_changed_at or job.started_at or now
        limit = job.sync_window_s + STARTING_GRACE_S
        if (now - since).total_seconds() > limit:
            line = f"the launch did not finish within {limit:g}s (launcher {job.launcher or 'unknown'} gone?)"
            failure = Failure(kind=FailureKind.TIMEOUT, rank=None, node=None, exit_code=None, signal=None, line=line)
            if lifecycle.fail(job, failure):
                failed.append(job.name)
    return failed


def _lost_teardowns(jobs, now) -> list[str]:
    """CANCELLING or FAILING past the kill grace and the retry time: the teardown was lost."""
    retry_after = settings.UGRO["KILL_GRACE_S"] + lifecycle.STOPPING_RETRY_S
    done = []
    for job in jobs.filter(state__in=Job.STOPPING_STATES):
        since = job.state_changed_at or now
        if (now - since).total_seconds() > retry_after and lifecycle.teardown(job):
            done.append(job.name)
    return done


def _running(jobs, report: Report) -> None:
    """Each running job: its ranks checked on their nodes, then judged; else hang and straggler checks."""
    for job in jobs.filter(state=Job.State.RUNNING):
        report.lost += check_ranks(job)
        job.refresh_from_db()
        if lifecycle.judge(job):
            report.judged.append(job.name)
        elif recovery.check_hang(job):
            report.hung.append(job.name)
        else:
            report.stragglers += [f"{job.name}: {m}" for m in recovery.check_stragglers(job)]


def _release_ended(jobs) -> list[str]:
    """An ended job that still holds nodes (a crash between its end and the release): released."""
    released = []
    holding = Q(ranks__active=True) | Q(allocations__active=True)
    for job in jobs.filter(holding, state__in=Job.ENDED_STATES).distinct():
        job.ranks.filter(active=True).update(active=False)
        job.allocations.filter(active=True).update(active=False)
        released.append(job.name)
    return released


def _recover_lost_output(jobs, now) -> list[str]:
    """A lost rank of a recently ended job whose node answers again: the rest of its output is fetched."""
    cutoff = now - timedelta(days=LOST_OUTPUT_DAYS)
    lost_left = jobs.filter(state__in=Job.ENDED_STATES, finished_at__gt=cutoff)
    owner = follower_id() + ":reconcile"
    return [job.name for job in lost_left.filter(ranks__state=Rank.State.LOST, ranks__drained=False).distinct()
            if recover_output(job, owner)]  # fmt: skip


def fold_leftovers(jobs, now) -> list[str]:
    """Recently ended jobs with points past their rollup's mark, folded: a follower that was killed
    before its last fold leaves them, and an ended job is not followed again (the charts fold such
    points themselves meanwhile, at a cost on every read)."""
    recent = jobs.filter(state__in=Job.ENDED_STATES, finished_at__gt=now - timedelta(seconds=LEFTOVERS_S))
    behind = recent.annotate(upto=Coalesce("rollup_mark__upto", 0)).filter(
        Exists(MetricPoint.objects.filter(job=OuterRef("pk"), id__gt=OuterRef("upto")))
    )
    return [name for pk, name in behind.values_list("pk", "name") if rollup.catch_up(pk)]


def check_ranks(job: Job) -> list[str]:
    """Ask each node how the job's running ranks are; mark the ones that are gone LOST."""
    ranks = list(job.ranks.select_related("node", "job").filter(state=Rank.State.RUNNING))
    by_node: dict[int, list[Rank]] = {}
    for r in ranks:
        by_node.setdefault(r.node_id, []).append(r)

    def status(group: list[Rank]) -> dict:
        items = [
            {"key": r.start_key, "record": r.start_record, "exit_file": r.remote_exit, "tag": job.tag,
             "node": r.node.name}
            for r in group
        ]  # fmt: skip
        return node_request(group[0].node, "rank_status", timeout=STATUS_TIMEOUT_S, ranks=items)

    lost = []
    now = timezone.now()
    lost_after = settings.UGRO["NODE_LOST_AFTER_S"]
    for group, result, err in on_each(list(by_node.values()), status):
        for i, rank in enumerate(group):
            reason = None
            if err is not None:
                since = rank.last_contact or rank.started_at or now
                if unreachable(err) and (now - since).total_seconds() > lost_after:
                    reason = f"node {rank.node.name} stopped answering: {err}"
            else:
                reason = _gone_reason(rank, result["ranks"][i])
            if reason and lifecycle.rank_lost(rank, reason):
                lost.append(f"{job.name}/{rank.index}")
    return lost


def _gone_reason(rank: Rank, st: dict) -> str | None:
    """Why a running rank is gone by its node's account (the agent's rank_status), or None while it may
    still run."""
    if st.get("exit") is not None:
        return None  # it ended and said so: the follower takes its last lines and exit code
    if st.get("rebooted") or (rank.boot_id and st.get("boot_id") and st["boot_id"] != rank.boot_id):
        return f"node {rank.node.name} rebooted since rank {rank.index} started"
    if not st.get("record"):
        return f"node {rank.node.name} has no record of starting rank {rank.index}"
    if not st.get("wrapper_alive") and not st.get("torchrun_alive"):
        return f"rank {rank.index}'s process on {rank.node.name} is gone without recording an exit code"
    return None


def kill_orphans() -> list[str]:
    """Kill processes tagged with a job that has ended (this controller's jobs only) and say so."""
    nodes = list(Node.objects.filter(enabled=True).exclude(status=Node.Status.DOWN))
    answers = on_each(nodes, lambda n: node_request(n, "tagged", timeout=STATUS_TIMEOUT_S, node=n.name))
    killed = []
    for node, result, err in answers:
        if err is not None or not result:
            continue
        tags = result.get("tags") or {}
        if not tags:
            continue
        ended = Job.objects.filter(tag__in=list(tags), state__in=Job.ENDED_STATES)
        for job in ended:
            rank = job.ranks.filter(node=node).select_related("node").first()
            if rank is None:
                continue
            unclean = stop_processes(job, [rank])
            pids = tags.get(job.tag) or []
            message = (
                f"{len(pids)} process(es) of ended job {job.name} ({job.state}) were still running on "
                f"{node.name}: {'killed' if not unclean else 'could not be confirmed killed'}"
            )
            record_event(node, f"orphans:{job.name}", message, job_name=job.name, severity=Alert.Severity.WARNING)
            killed.append(f"{node.name}:{job.name}")
        # an earlier attempt's processes (its tag is no longer the job's): e.g. on a node that was cut off
        for attempt in Attempt.objects.filter(tag__in=list(tags)).select_related("job"):
            ghost = Job(pk=attempt.job.pk, name=attempt.job.name, tag=attempt.tag)
            unclean = stop_processes(ghost, [Rank(job=ghost, node=node, index=0)], grace=0)
            pids = tags.get(attempt.tag) or []
            message = (
                f"{len(pids)} process(es) of attempt {attempt.number} of job {attempt.job.name} were still running "
                f"on {node.name}: {'killed' if not unclean else 'could not be confirmed killed'}"
            )
            record_event(node, f"orphans:{attempt.job.name}", message, job_name=attempt.job.name,
                         severity=Alert.Severity.WARNING)  # fmt: skip
            killed.append(f"{node.name}:{attempt.job.name}#{attempt.number}")
    return killed
