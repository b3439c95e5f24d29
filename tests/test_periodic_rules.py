"""The default install's background loop: a rule that raises stops neither the pass nor the loop; the time
values that raw SQL reads are timezone-aware; exactly one worker's scheduler fires."""

from __future__ import annotations

import logging
import sys
from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone

from cluster.models import Alert, Node
from jobs import lifecycle, recovery
from jobs.follow import LISTED, _Listed, follow
from jobs.loops import running, starts
from jobs.models import Job, Rank
from jobs.reconcile import reconcile
from metrics import rollup
from metrics.ingest import Sample, save_points
from metrics.models import MetricRollup
from metrics.series import _rollup_rows

from .jobrows import update_jobs

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def box(tmp_path):
    return Node.objects.create(
        name="box", address="127.0.0.1", transport="local", role="master", workdir=str(tmp_path),
        agent_python=sys.executable,
    )  # fmt: skip


def job_with_rank(node: Node, name: str, job_state: str, **rank_fields) -> Job:
    job = Job.objects.create(name=name, script="train.py", tag=f"{name}-tag", state=job_state)
    Rank.objects.create(job=job, node=node, index=0, started_at=timezone.now(), last_contact=timezone.now(),
                        **rank_fields)  # fmt: skip
    return job


def points(job: Job, n: int = 20) -> None:
    start = timezone.now() - timedelta(minutes=5)
    with transaction.atomic():
        save_points([Sample(job.pk, 0, s, "loss", 1.0 / (s + 1), start + timedelta(seconds=s), 1) for s in range(n)])


# -- one failing rule ------------------------------------------------------------------------------


def test_a_rule_that_raises_is_logged_once_alerted_and_the_other_rules_still_run(box, monkeypatch, caplog):
    # given a running job, and an ended job that still holds its node (a crash between its end and the release)
    job_with_rank(box, "live", Job.State.RUNNING, state=Rank.State.RUNNING)
    job_with_rank(box, "ended", Job.State.SUCCEEDED, state=Rank.State.EXITED, active=True)

    # and the rule for running jobs raising, as check_hang did on every tick of a default install
    def broken(job):
        raise TypeError("can't subtract offset-naive and offset-aware datetimes")

    monkeypatch.setattr(running, "check_ranks", broken)
    # when the reconciler runs twice
    with caplog.at_level(logging.WARNING, logger="jobs.loops"):
        first = reconcile(orphans=False)
        second = reconcile(orphans=False)
    # then the rule after it ran: the ended job's node is free
    assert first.released == ["ended"] and second.released == []
    assert not Rank.objects.filter(job__name="ended", active=True).exists()
    # and the failure was logged with its traceback once, not on every tick
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 1 and "'running'" in tracebacks[0].getMessage()
    # and one alert says which rule fails and why
    alert = Alert.objects.get(key="rule:running", resolved_at__isnull=True)
    assert alert.node is None and "TypeError: can't subtract offset-naive" in alert.message
    # when the rule runs cleanly again, the alert is resolved
    monkeypatch.setattr(running, "check_ranks", lambda job: [])
    monkeypatch.setattr(lifecycle, "judge", lambda job: False)
    reconcile(orphans=False)
    assert not Alert.objects.filter(key="rule:running", resolved_at__isnull=True).exists()


def test_a_failing_rule_with_the_database_refusing_does_not_stop_the_pass(box, monkeypatch):
    # given a rule that breaks the statement it runs (an SQL error, not a Python one)
    job_with_rank(box, "ended", Job.State.FAILED, state=Rank.State.EXITED, active=True)

    def bad_sql(job_ids, *, wait):
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute("SELECT no_such_column FROM jobs_job")

    monkeypatch.setattr(starts, "fail_overdue_starts", bad_sql)
    # when the reconciler runs, then the rules after it still work on the database
    assert reconcile(orphans=False).released == ["ended"]
    assert Alert.objects.filter(key="rule:starting", resolved_at__isnull=True).exists()


# -- time values read by raw SQL -------------------------------------------------------------------


def test_the_hang_checks_newest_points_carry_aware_times(box):
    job = job_with_rank(box, "hang", Job.State.RUNNING, state=Rank.State.RUNNING)
    points(job)
    rows = recovery._newest_points(job)
    assert rows and all(t.tzinfo is not None for _, _, t in rows)
    # and the check that subtracts them from now runs
    assert recovery.check_hang(job) is False


def test_the_follow_listing_reads_an_aware_lease_time(box):
    job = job_with_rank(box, "leased", Job.State.RUNNING, state=Rank.State.RUNNING)
    update_jobs(
        Job.objects.filter(pk=job.pk), follower="someone-else", follower_until=timezone.now() + timedelta(minutes=1)
    )
    listing = Job.objects.filter(pk=job.pk).values_list(*LISTED).query.sql_with_params()
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(*listing)
        row = _Listed(*cursor.fetchone())
    assert row.follower_until.tzinfo is not None
    # and a follower compares it with now without raising (the watcher thread died of it on SQLite)
    follow(0.2, job_ids=[job.pk], owner="me", exit_when_idle=True)


def test_an_idle_follow_task_whose_job_ended_exits_and_lets_the_job_go(box, monkeypatch):
    import jobs.follow

    # given a follow task (exit_when_idle, as the worker runs it) following a running job
    job = job_with_rank(box, "short", Job.State.RUNNING, state=Rank.State.RUNNING)
    passes, rounds_after_end = [], []

    def one_pass(f, wait):  # its pass sees the rank end (the follower's own step needs a real node)
        passes.append(f.job.name)
        Rank.objects.filter(job=job).update(state=Rank.State.EXITED)
        return 0

    def stopping() -> bool:  # checked before every round: more than a few after the end means it never exits
        if passes:
            rounds_after_end.append(1)
        return len(rounds_after_end) > 5

    monkeypatch.setattr(jobs.follow, "_one_pass", one_pass)
    # when its job's last rank has ended
    follow(60, owner="task-1", exit_when_idle=True, max_jobs=2, stopping=stopping)
    # then the task returned on the next round (its thread free for the next task), and no lease is left
    assert passes == ["short"] and len(rounds_after_end) <= 2
    assert Job.objects.filter(pk=job.pk, current__follower="").exists()


def test_the_charts_rollup_times_are_aware(box):
    job = job_with_rank(box, "curve", Job.State.RUNNING, state=Rank.State.RUNNING)
    points(job, 300)
    rollup.catch_up(job.pk)
    level = MetricRollup.objects.filter(job=job).order_by("level").values_list("level", flat=True).first()
    rows = _rollup_rows(job.pk, ["loss"], None, level, True)["loss"]
    assert rows and all(r[-1].tzinfo is not None and r[-2].tzinfo is not None for r in rows)


# -- the schedule lives in the workers -------------------------------------------------------------


def no_scheduler_left() -> None:
    """The lock of a worker an earlier test killed outlives it by up to SCHEDULER_TTL_S: gone, as no worker runs."""
    from ugro_site import celery as ugro_celery

    ugro_celery._redis().delete(ugro_celery.SCHEDULER_KEY)


def test_of_two_workers_schedulers_exactly_one_fires_and_the_other_takes_over():
    from ugro_site import celery as ugro_celery

    def scheduler():
        return ugro_celery.LockedScheduler.__new__(ugro_celery.LockedScheduler)  # its lock, without an app's beat

    first, second = scheduler(), scheduler()
    no_scheduler_left()
    try:
        # given two workers' schedulers on one Redis: the first to tick holds the lock, the other stands by
        assert first._hold() is True
        assert second._hold() is False
        assert first._hold() is True  # renewed while held
        assert ugro_celery.scheduler_alive()
        # when the first worker stops (its scheduler releases the lock), the second fires from its next tick
        first._lock.release()
        first._lock = None
        assert second._hold() is True
        assert first._hold() is False
    finally:
        for s in (first, second):
            if s._lock is not None:
                s._lock.release()
    assert not ugro_celery.scheduler_alive()


def test_with_no_scheduler_running_every_page_the_api_and_health_say_so(client, os_account):
    import io

    from django.core.management import call_command

    from ugro_site import celery as ugro_celery

    client.force_login(os_account)
    no_scheduler_left()
    # given no worker, so no scheduler: every page says nothing would start or follow a job
    page = client.get("/").content.decode()
    assert "no scheduler running" in page and 'id="controller-problem"' in page
    answer = client.get("/api/v1/controller").json()
    assert answer["scheduler_alive"] is False and answer["problem"] == ugro_celery.NO_SCHEDULER
    out = io.StringIO()
    call_command("health", stdout=out)
    assert out.getvalue().splitlines()[-1] == f"✗ {ugro_celery.NO_SCHEDULER}"
    # when a worker's scheduler holds the lock, the banner and the line are gone
    holder = ugro_celery.LockedScheduler.__new__(ugro_celery.LockedScheduler)
    assert holder._hold()
    try:
        assert 'id="controller-problem"' not in client.get("/").content.decode()
        assert client.get("/api/v1/controller").json()["scheduler_alive"] is True
        out = io.StringIO()
        call_command("health", stdout=out)
        assert "no scheduler running" not in out.getvalue()
    finally:
        holder._lock.release()


def test_a_worker_thread_keeps_its_database_connection_between_tasks_until_it_is_old_or_broken():
    """Celery's fixup closed each task's connection (a new PostgreSQL backend for every task the beat sends); the
    worker keeps it, checked around each task as a web request's is."""
    import threading
    import time
    from types import SimpleNamespace

    from django.db import connection, connections

    from ugro_site.celery import _db_connections_checked, keep_db_connections

    def backend() -> int:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            return cursor.fetchone()[0]

    task = SimpleNamespace(request=SimpleNamespace(is_eager=False))
    seen: dict[str, object] = {}

    def worker_thread() -> None:
        try:
            first = backend()
            _db_connections_checked(sender=task)  # a task's end
            _db_connections_checked(sender=task)  # the next one's start
            seen["kept"] = backend() == first
            with connection.cursor() as cursor:  # the server ends it while idle (a restart, an admin)
                cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")
        except Exception as exc:  # the terminate cuts the answer to the query that asked for it
            seen["cut"] = type(exc).__name__
        try:
            _db_connections_checked(sender=task)
            seen["after_break"] = backend() != first  # a new connection, no error in the task
            connection.close_at = time.monotonic() - 1  # older than WORKER_DB_MAX_AGE_S
            _db_connections_checked(sender=task)
            seen["old_closed"] = connection.connection is None
        finally:
            connection.close()

    replaced = keep_db_connections()
    try:
        thread = threading.Thread(target=worker_thread)
        thread.start()
        thread.join(timeout=30)
    finally:
        for alias, conf in replaced.items():
            connections.settings[alias].update(conf)
    assert seen == {"kept": True, "cut": "OperationalError", "after_break": True, "old_closed": True}, seen


def test_with_connections_not_kept_each_task_closes_its_own_but_never_its_eager_callers():
    import threading
    from types import SimpleNamespace

    from django.db import connection

    from ugro_site.celery import _db_connections_checked

    closed = {}

    def worker_thread() -> None:
        connection.ensure_connection()
        _db_connections_checked(sender=SimpleNamespace(request=SimpleNamespace(is_eager=True)))
        closed["eager"] = connection.connection is None
        _db_connections_checked(sender=SimpleNamespace(request=SimpleNamespace(is_eager=False)))
        closed["task"] = connection.connection is None

    thread = threading.Thread(target=worker_thread)
    thread.start()
    thread.join(timeout=30)
    assert closed == {"eager": False, "task": True}
