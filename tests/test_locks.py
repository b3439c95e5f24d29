"""Two workers never act on the same job at once, and never wait for each other over different jobs: each
loop takes its jobs one at a time under a lock of its own (kind: the loop, key: the job), one teardown of a
job runs at a time (PostgreSQL advisory locks held by the acting connection; jobs/locks.py)."""

from __future__ import annotations

import threading
from contextlib import ExitStack
from datetime import timedelta

import pytest
from django.db import connection, connections, transaction
from django.utils import timezone

from cluster.models import Node
from jobs import lifecycle, locks
from jobs.loops import orphans, retries, stopping
from jobs.models import Job, Rank
from jobs.reconcile import LOOPS, PASSES_AT_ONCE, reconcile

from .conftest import wait_for
from .fake_agent import FakeCluster

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


class Worker:
    """Runs one call on a thread of its own (another worker, with its own connection)."""

    def __init__(self, call, name: str = "other-worker") -> None:
        self.result, self.done = None, threading.Event()
        self.thread = threading.Thread(target=self._run, args=(call,), name=name)
        self.thread.start()

    def _run(self, call) -> None:
        try:
            self.result = call()
        finally:
            connections.close_all()
            self.done.set()

    def join(self) -> object:
        self.thread.join(10)
        assert self.done.is_set()
        return self.result


def node(name: str = "n1") -> Node:
    return Node.objects.get_or_create(name=name, defaults={"address": f"10.9.0.{name[-1]}", "role": "worker"})[0]


def ended_holding_its_node(name: str) -> Job:
    """An ended job that still holds its node (a crash between its end and the release)."""
    job = Job.objects.create(name=name, script="x.py", tag=f"{name}-tag", state=Job.State.SUCCEEDED)
    Rank.objects.create(job=job, node=node(), index=0, state=Rank.State.EXITED, active=True)
    return job


def stopping_for_long(name: str) -> Job:
    """A cancelling job whose teardown was lost (well past the kill grace and the retry time)."""
    long_ago = timezone.now() - timedelta(minutes=10)
    return Job.objects.create(name=name, script="x.py", tag=f"{name}-tag", state=Job.State.CANCELLING,
                              state_changed_at=long_ago)  # fmt: skip


@pytest.fixture
def slow_teardowns(monkeypatch):
    """Teardowns that record the job and end it; on the threads named in `blocked` each first waits until
    `go` is set (a kill grace on a stubborn node)."""

    class Slow:
        blocked: set[str] = set()
        go = threading.Event()
        started: list[str] = []
        entered = threading.Condition()

    def teardown(job: Job) -> bool:
        with Slow.entered:
            Slow.started.append(job.name)
            Slow.entered.notify_all()
        if threading.current_thread().name in Slow.blocked:
            assert Slow.go.wait(10)
        return bool(Job.objects.filter(pk=job.pk, state__in=Job.STOPPING_STATES).update(state=Job.State.CANCELLED))

    monkeypatch.setattr(lifecycle, "teardown", teardown)
    yield Slow
    Slow.go.set()


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


def test_a_teardown_waits_for_the_launch_still_starting_the_jobs_ranks_then_stops_them(monkeypatch):
    stopped = []
    monkeypatch.setattr(lifecycle, "stop_processes", lambda job, grace=None: stopped.append(job.name) or [])
    job = Job.objects.create(name="s1", script="x.py", state=Job.State.CANCELLING, tag="s1-abc")
    # given a launch of the job still starting its ranks (cancelled meanwhile): its processes are not all up
    with Holder(locks.LAUNCH, job.pk) as launcher:
        # when the teardown runs: it stops nothing, and ends nothing, while the launch holds the job
        teardown = Worker(lambda: lifecycle.teardown(job), name="teardown")
        assert not teardown.done.wait(0.5)
        assert stopped == [] and Job.objects.get(pk=job.pk).state == Job.State.CANCELLING
        # then once the launch lets go, it stops what was started and makes the end final
        launcher.release.set()
        assert teardown.join() is True
    assert stopped == ["s1"] and Job.objects.get(pk=job.pk).state == Job.State.CANCELLED


def test_a_teardown_does_not_wait_for_a_launch_past_its_limit(monkeypatch):
    stopped = []
    monkeypatch.setattr(lifecycle, "stop_processes", lambda job, grace=None: stopped.append(job.name) or [])
    monkeypatch.setattr(lifecycle, "STARTING_GRACE_S", 0.0)
    job = Job.objects.create(name="s2", script="x.py", state=Job.State.CANCELLING, tag="s2-abc", sync_window_s=0.3)
    # given a launch that holds the job past the time a launch may take (a launcher hung on a node)
    with Holder(locks.LAUNCH, job.pk):
        # then the teardown stops what is there without it (the launch stops what it starts after)
        assert lifecycle.teardown(job) is True
    assert stopped == ["s2"] and Job.objects.get(pk=job.pk).state == Job.State.CANCELLED


def test_a_followers_lease_renewal_and_a_job_changing_state_at_once_do_not_deadlock():
    from jobs.follow import claim, renew

    job = Job.objects.create(name="f1", script="x.py", tag="f1-abc", state=Job.State.RUNNING)
    assert claim(job.pk, "follower-a", any_state=True)
    locked, waiting = threading.Event(), threading.Event()

    def change_state() -> bool:
        # a lifecycle move as requeue makes it: the job's row locked first, then its attempt's row written
        with transaction.atomic():
            Job.objects.select_for_update().get(pk=job.pk)
            locked.set()
            waiting.wait(10)  # the follower's renewal is waiting for the job's row now
            return lifecycle._move(job, [Job.State.RUNNING], Job.State.FAILING, failure_reason="lost")

    def renewal() -> int:
        with transaction.atomic():
            return renew(job.pk, "follower-a", grow=10, relaxed=True)

    # given a job changing state (its row locked) while its follower renews the lease in a pass
    mover = Worker(change_state, name="mover")
    assert locked.wait(10)
    follower = Worker(renewal, name="follower")
    wait_for(lambda: blocked_backends() >= 1, timeout=10, what="the renewal to wait for the job's row")
    waiting.set()
    # then both go through, one after the other (the other lock order made PostgreSQL kill one as a deadlock)
    assert mover.join() is True and follower.join() == 0
    job.refresh_from_db()
    assert job.state == Job.State.FAILING and job.failure_reason == "lost" and job.metrics_bytes == 10


def blocked_backends() -> int:
    """Sessions of this database waiting for a row lock."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                       " AND wait_event_type = 'Lock'")  # fmt: skip
        return cursor.fetchone()[0]


def test_two_workers_run_the_same_loop_side_by_side_on_different_jobs(slow_teardowns):
    # given two stopping jobs, and another worker whose teardown of the one it took first waits out a long
    # kill grace
    stopping_for_long("first"), stopping_for_long("second")
    slow_teardowns.blocked.add("other-worker")
    other = Worker(lambda: stopping.tear_down_lost(wait=False))
    with slow_teardowns.entered:
        assert slow_teardowns.entered.wait_for(lambda: slow_teardowns.started, timeout=10)
    taken = slow_teardowns.started[0]
    # when this worker's periodic pass of the same loop runs meanwhile
    mine = stopping.tear_down_lost(wait=False)
    # then it tears down the other job now, and leaves the one taken to the worker that holds it
    assert mine == [n for n in ("first", "second") if n != taken]
    slow_teardowns.go.set()
    assert other.join() == [taken]
    # and each job was torn down once: the other worker found the second job done when it came to it
    assert sorted(slow_teardowns.started) == ["first", "second"]
    assert not Job.objects.exclude(state=Job.State.CANCELLED).exists()


def test_two_workers_on_the_same_job_only_one_acts_and_a_direct_pass_waits_for_it(slow_teardowns):
    job = stopping_for_long("only")
    slow_teardowns.blocked.add("other-worker")
    # given another worker tearing the job down (its pass holds the job in the stopping loop)
    other = Worker(lambda: stopping.tear_down_lost(wait=False))
    with slow_teardowns.entered:
        assert slow_teardowns.entered.wait_for(lambda: slow_teardowns.started == ["only"], timeout=10)
    # when this worker's periodic pass runs at the same time: it does nothing to that job
    assert stopping.tear_down_lost(wait=False) == []
    # and a direct pass (a command, a test) waits for the job to be let go, then finds it torn down
    direct = Worker(lambda: stopping.tear_down_lost([job.pk], wait=True), name="direct")
    assert not direct.done.wait(0.3)
    slow_teardowns.go.set()
    assert other.join() == ["only"] and direct.join() == []
    assert slow_teardowns.started == ["only"] and Job.objects.get(pk=job.pk).state == Job.State.CANCELLED


def test_a_job_another_worker_holds_is_skipped_by_a_periodic_pass_and_waited_for_by_a_direct_one():
    held, free = ended_holding_its_node("held"), ended_holding_its_node("free")
    with Holder(locks.ENDED, held.pk) as other:
        # the periodic task's pass (wait=False) acts on every job but the one held elsewhere
        assert reconcile(loops=["ended"], wait=False).released == ["free"]
        assert Rank.objects.filter(job=held, active=True).exists()
        # a direct pass waits for the held job to be let go, then releases it
        direct = Worker(lambda: reconcile([held.pk], loops=["ended"]).released)
        assert not direct.done.wait(0.3)
        other.release.set()
        assert direct.join() == ["held"]
    assert not Rank.objects.filter(job__in=[held, free], active=True).exists()


def test_a_job_held_in_one_loop_holds_up_neither_the_other_loops_nor_other_jobs(slow_teardowns):
    # given another worker busy with a job in the 'stopping' loop (a teardown waiting out a kill grace, say)
    busy, waiting = stopping_for_long("busy"), stopping_for_long("waiting")
    ended = ended_holding_its_node("ended")
    with Holder(locks.STOPPING, busy.pk):
        # when the periodic tasks run every loop: every loop runs now, the stopping one on the other job
        report = reconcile(orphans=False, wait=False)
    assert report.released == [ended.name] and report.torn_down == [waiting.name]
    assert slow_teardowns.started == ["waiting"]


def test_periodic_passes_of_a_loop_are_bounded_and_a_direct_one_is_not():
    job = ended_holding_its_node("ended")
    first = list(LOOPS).index("ended") * PASSES_AT_ONCE
    # given as many periodic passes of the loop under way elsewhere as may run at once, less one: this one runs
    with ExitStack() as others:
        for slot in range(first, first + PASSES_AT_ONCE - 1):
            others.enter_context(Holder(locks.PASS, slot))
        assert reconcile(loops=["ended"], wait=False).released == ["ended"]
    Rank.objects.filter(job=job).update(active=True)
    # given all of them: a periodic pass is skipped (the next tick comes), a direct one runs
    with ExitStack() as others:
        for slot in range(first, first + PASSES_AT_ONCE):
            others.enter_context(Holder(locks.PASS, slot))
        assert not reconcile(loops=["ended"], wait=False)
        assert Rank.objects.filter(job=job, active=True).exists()
        assert reconcile(loops=["ended"]).released == ["ended"]


def test_a_node_one_worker_scans_for_orphans_is_left_to_it_and_the_others_are_scanned(monkeypatch):
    nodes = FakeCluster("n1", "n2").install(monkeypatch)
    n1, _ = node("n1"), node("n2")
    with Holder(locks.ORPHANS, n1.pk):
        assert orphans.kill_orphans(wait=False) == []
    # only the node nobody held was asked
    assert [op for op, _ in nodes["n1"].requests] == [] and [op for op, _ in nodes["n2"].requests] == ["tagged"]


def test_a_queued_job_waiting_for_a_node_another_worker_holds_is_left_to_it(monkeypatch):
    FakeCluster("n1").install(monkeypatch)
    node("n1")
    job = Job.objects.create(name="w", script="x.py", tag="w-tag", state=Job.State.QUEUED, wait_nodes=["n1"])
    with Holder(locks.RETRIES, job.pk):
        assert retries.release_waits(wait=False) == []
        assert Job.objects.get(pk=job.pk).wait_nodes == ["n1"]
    # once let go, the next pass finds the node answering and the job no longer waits
    assert retries.release_waits(wait=False) == ["w:n1"]
    assert Job.objects.get(pk=job.pk).wait_nodes == []
