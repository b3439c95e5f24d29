"""Two workers never act on the same job at once: one reconcile pass at a time, one teardown of a job at a
time (PostgreSQL advisory locks held by the acting connection; jobs/locks.py)."""

from __future__ import annotations

import threading

import pytest
from django.db import connections

from jobs import lifecycle, locks, reconcile
from jobs.models import Job

pytestmark = pytest.mark.django_db(transaction=True)


class Holder:
    """Holds a lock on a thread of its own (another worker's connection) until released."""

    def __init__(self, kind: int, key: int = 0) -> None:
        self.taken, self.release = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, args=(kind, key))

    def _run(self, kind: int, key: int) -> None:
        try:
            with locks.held(kind, key) as got:
                assert got
                self.taken.set()
                self.release.wait(10)
        finally:
            connections.close_all()

    def __enter__(self) -> Holder:
        self.thread.start()
        assert self.taken.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.thread.join(10)


def test_a_teardown_under_way_elsewhere_is_left_to_finish_and_one_after_it_runs(monkeypatch):
    stopped = []
    monkeypatch.setattr(lifecycle, "stop_processes", lambda job, grace=None: stopped.append(job.name) or [])
    job = Job.objects.create(name="t1", script="x.py", state=Job.State.CANCELLING, tag="t1-abc")
    # given another worker tearing the job down; when this one is asked to as well: it does nothing
    with Holder(locks.TEARDOWN, job.pk):
        assert lifecycle.teardown(job) is False
        assert stopped == [] and Job.objects.get(pk=job.pk).state == Job.State.CANCELLING
    # once that one let go (here: without finishing), a teardown runs and makes the end final
    assert lifecycle.teardown(job) is True
    assert stopped == ["t1"] and Job.objects.get(pk=job.pk).state == Job.State.CANCELLED


def test_a_periodic_pass_of_a_loop_is_skipped_while_another_worker_runs_it_and_a_direct_one_waits(monkeypatch):
    ran = []
    monkeypatch.setattr(reconcile, "_release_ended", lambda jobs: ran.append("release") or [])
    with Holder(locks.RECONCILE, reconcile.LOOPS.index("ended")) as other:
        # the periodic task's pass of the loop (wait=False) finds one under way and runs no rule of it
        assert not reconcile.reconcile(loops=["ended"], wait=False) and ran == []
        # a direct pass waits for the other to end, then runs the loop's rules
        done = threading.Event()

        def direct() -> None:
            try:
                reconcile.reconcile(loops=["ended"])
                done.set()
            finally:
                connections.close_all()

        waiter = threading.Thread(target=direct)
        waiter.start()
        assert not done.wait(0.5) and ran == []
        other.release.set()
        waiter.join(10)
    assert done.is_set() and ran == ["release"]


def test_a_slow_loop_holds_up_neither_the_other_loops_nor_another_pass_of_them(monkeypatch):
    # given another worker busy in the 'stopping' loop (a teardown waiting out a kill grace, say)
    ran = []
    monkeypatch.setattr(reconcile, "_release_ended", lambda jobs: ran.append("release") or [])
    monkeypatch.setattr(reconcile, "_lost_teardowns", lambda jobs, now: ran.append("teardowns") or [])
    with Holder(locks.RECONCILE, reconcile.LOOPS.index("stopping")):
        # when the periodic tasks run every loop: all but that one run now, and that one is left to its pass
        reconcile.reconcile(wait=False)
    assert ran == ["release"]
