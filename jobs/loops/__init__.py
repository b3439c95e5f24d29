"""The worker's loops, one module per concern, each naming at its top the rules it enforces:

- starts.py: a launch past its window, a job past its time limit, a sweep trial worse than the median
- running.py: running ranks checked on their nodes (lost ones marked), the job judged; hangs, stragglers;
  checkpoints beyond --keep deleted
- stopping.py: a stopping job whose teardown was lost, torn down again
- ended.py: an ended job's nodes released, its lost output fetched, its points folded, its checkpoints trimmed
- retries.py: the retry policy; queued attempts waiting for a lost node that answers again
- orphans.py: processes of ended jobs still running on a node, killed (every node, less often)

Each loop's `run(job_ids, report, wait=...)` takes its batch job by job under an advisory lock of its own
(jobs/locks.py: the kind names the loop, the key the job): two workers run a loop side by side on different
jobs and never on the same one, and a job one of them holds is skipped by the other (wait=False, the
periodic tasks) or waited for (wait=True, a direct call). A lock is held by the connection, not by an open
transaction, so a loop may wait on a node while it holds one. Each rule is idempotent and bounded in time,
and runs on its own (run_rule): one that raises is alerted, and the rules after it still run.
jobs/reconcile.py runs the loops; jobs/tasks.py queues them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from django.db import transaction
from django.db.models import Model, QuerySet

from cluster.alerts import open_alert, resolve
from cluster.models import Alert

from .. import locks, retention
from ..models import Job

log = logging.getLogger(__name__)


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
    freed: list[str] = field(default_factory=list)  # checkpoints retention deleted (jobs/retention.py)

    def __bool__(self) -> bool:
        return any(getattr(self, f) for f in self.__dataclass_fields__)


def scope(job_ids: list[int] | None) -> QuerySet[Job]:
    """Every job (a periodic pass), or the given ones (a direct call)."""
    return Job.objects.all() if job_ids is None else Job.objects.filter(pk__in=job_ids)


def each_claimed[M: Model, T](lock: int, rows: QuerySet[M], act: Callable[[M], T], *, wait: bool) -> list[T]:
    """A loop's batch, one row at a time: for each row of `rows` whose (lock, pk) advisory lock this
    connection takes, the row read again under the lock (skipped when it no longer matches `rows`: another
    worker moved it on meanwhile), then act(row), then the lock let go. wait=False skips a row another worker
    holds; wait=True waits for it. Returns act's truthy results.

    One row whose act raises holds up none of the rows after it: they are still acted on, and the first
    error is raised once the batch is done (run_rule logs it and keeps its alert open)."""
    done, failed = [], None
    for pk in list(rows.values_list("pk", flat=True)):
        with locks.held(lock, pk, wait=wait) as mine:
            if not mine:
                continue
            row = rows.filter(pk=pk).first()
            try:
                if row is not None and (out := act(row)):
                    done.append(out)
            except Exception as exc:
                if failed is not None:  # the first is raised; the others are logged here, or no one sees them
                    log.exception("the same rule failed on another row (%s %s) too", type(row).__name__, pk)
                failed = failed or exc
    if failed is not None:
        raise failed
    return done


RULE_LOG_EVERY_S = 600.0  # a rule that keeps failing: its traceback again at most this often
_rule_logged: dict[str, float] = {}


def run_rule(name: str, rule: Callable[[], object]) -> bool:
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


def run_retention(jobs: QuerySet[Job], *, wait: bool) -> list[str]:
    """Checkpoint retention over the given jobs that have work left (jobs/retention.py), each under the job's
    RETENTION lock; `job: freed N` for each that freed something."""
    return each_claimed(locks.RETENTION, retention.pending(jobs), retention.act, wait=wait)
