"""The test process as the UGRO worker: the worker is the only executor of job work, so tests that launch
need one. This is a real Celery worker (the threads pool, as bin/worker runs it) on a thread of the test
process, consuming this run's Redis, with the worker's own heartbeat; a small beat sends the periodic job
tasks more often than the shipped schedule (tests wait for their outcomes). The health poll is not sent:
tests that need it drive it. Tests that run bin/worker, drive the loops themselves or check life without a
worker are marked `no_test_worker`.

Tasks run in the test process, so they see the test's settings (fast_settings) and its database.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

BEAT_TASKS = ("jobs.tasks.schedule_jobs", "jobs.tasks.follow_jobs", "jobs.tasks.reconcile_jobs")
BEAT_EVERY_S = 1.0
# the orphan scan asks every node (a /proc walk on each): every few ticks, as it ships less often than the rest
ORPHAN_SCAN_EVERY_TICKS = 5
HEARTBEAT_WAIT_S = 30.0
SHUTDOWN_TIMEOUT_S = 60.0  # a task in flight finishes (a teardown waits out the kill grace)


_tasks = {"running": 0}
_tasks_changed = threading.Condition()


def _task_started(**_kwargs) -> None:
    with _tasks_changed:
        _tasks["running"] += 1


_kept: dict[int, object] = {}  # the connections the worker's threads keep between tasks, closed when it stops


def _task_ended(**_kwargs) -> None:
    """Each task's thread keeps its database connection for its next task, as bin/worker's do
    (ugro_site.celery.keep_db_connections), noted here so the worker's stop closes it (the test's flush, and
    the test database's drop at the end of the run, find none left open by a worker thread); says it is done."""
    from django.db import connections

    for conn in connections.all(initialized_only=True):
        if conn.connection is not None:
            _kept[id(conn.connection)] = conn.connection
    with _tasks_changed:
        _tasks["running"] -= 1
        _tasks_changed.notify_all()


def _wait_for_tasks(timeout: float) -> None:
    """Until no task of this process runs (the pool may let one finish after the worker stopped): none
    may act on the next test's jobs."""
    with _tasks_changed:
        _tasks_changed.wait_for(lambda: _tasks["running"] <= 0, timeout=timeout)


@contextmanager
def worker_here():
    from celery.contrib.testing.worker import start_worker
    from celery.signals import task_postrun, task_prerun

    import jobs.tasks
    from ugro_site.celery import _start_heartbeat, _stop_heartbeat, app, keep_db_connections, send_task, worker_alive

    from .conftest import wait_for

    app.control.purge()  # tasks an earlier test queued and nobody took
    replaced = keep_db_connections()
    task_prerun.connect(_task_started, weak=False)
    task_postrun.connect(_task_ended, weak=False)
    stop = threading.Event()

    def beat() -> None:
        ticks = 0
        while not stop.wait(BEAT_EVERY_S):
            ticks += 1
            for name in BEAT_TASKS:
                send_task(name)
            if ticks % ORPHAN_SCAN_EVERY_TICKS == 0:
                send_task("jobs.tasks.scan_orphans")

    ticker = threading.Thread(target=beat, name="test-beat", daemon=True)
    try:
        with start_worker(app, concurrency=16, pool="threads", perform_ping_check=False,
                          shutdown_timeout=SHUTDOWN_TIMEOUT_S, loglevel="WARNING") as worker:  # fmt: skip
            _start_heartbeat()
            # commands refuse while no heartbeat is seen: its first write, on a thread, may come late on a loaded
            # machine (a whole CI run once launched before it: "no UGRO worker is running")
            wait_for(worker_alive, timeout=HEARTBEAT_WAIT_S, interval=0.05, what="the worker's heartbeat")
            ticker.start()
            try:
                yield worker
            finally:
                stop.set()
                ticker.join()
                _stop_heartbeat()
                jobs.tasks._shutting_down.set()  # follow tasks hand their jobs back within a pass
        _wait_for_tasks(SHUTDOWN_TIMEOUT_S)
        app.control.purge()
    finally:
        jobs.tasks._shutting_down.clear()
        task_prerun.disconnect(_task_started)
        task_postrun.disconnect(_task_ended)
        _close_kept(replaced)


def _close_kept(replaced: dict) -> None:
    """The kept connections closed (from this thread: their own threads may be gone or idle in the pool, and no
    task runs now), and the settings keep_db_connections replaced put back."""
    from django.db import connections

    while _kept:
        _, raw = _kept.popitem()
        try:
            raw.close()
        except Exception:  # closed already, or its server gone
            pass
    for alias, conf in replaced.items():
        connections.settings[alias].update(conf)
