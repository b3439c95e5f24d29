"""The job state machine: one owner of transitions, conditional updates, nodes freed with the final state.

These run against the database and a local-transport node (the real agent as a subprocess, no SSH):
the follower's lease, long lines and progress bars, bounded log tails, handlers that never ask nodes.
"""

from __future__ import annotations

import ast
import io
import json
import logging
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
from django.contrib.auth.models import Group
from django.core.management import CommandError, call_command
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from cluster.links import LinkError
from cluster.models import Alert, Node
from jobs import follow as follow_module
from jobs import lifecycle
from jobs.failure import Failure, FailureKind
from jobs.follow import JobFollower, LeaseLost, claim, follow
from jobs.logs import LINE_CUT, job_lines, rank_lines, tail_lines
from jobs.loops import running as running_loop
from jobs.models import Job, Rank
from metrics import rollup
from metrics.models import MetricPoint, MetricRollup, RollupMark
from metrics.series import series

from .conftest import REPO, wait_for
from .jobrows import update_jobs

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def local_node(tmp_path):
    return Node.objects.create(
        name="box", address="127.0.0.1", transport="local", role="master", workdir=str(tmp_path),
        agent_python=sys.executable,
    )  # fmt: skip


def running_job(node: Node, name: str = "j1") -> Job:
    """A RUNNING job with one rank whose node-side log and exit files live in the node's workdir."""
    job = Job.objects.create(name=name, script="train.py", tag=f"{name}-tag", state=Job.State.RUNNING)
    base = f"{node.workdir}/.ugro/jobs/{job.tag}/rank_0"
    Path(base).parent.mkdir(parents=True, exist_ok=True)
    Rank.objects.create(
        job=job, node=node, index=0, state=Rank.State.RUNNING, remote_log=f"{base}.log", remote_exit=f"{base}.exit",
        remote_error=f"{base}.error.json", start_record=f"{base}.start", started_at=timezone.now(),
        last_contact=timezone.now(),
    )  # fmt: skip
    return job


def write_log(job: Job, data: bytes, rc: int | None = None) -> Rank:
    rank = job.ranks.get()
    with open(rank.remote_log, "ab") as fh:
        fh.write(data)
    if rc is not None:
        Path(rank.remote_exit).write_text(json.dumps({"rc": rc, "ended": timezone.now().timestamp()}))
    return rank


def count_tails(monkeypatch) -> list[str]:
    """The follower's node reads ("tail" requests), one entry each, as they are made."""
    tails: list[str] = []
    real = follow_module.node_request

    def counting(node, op, /, **fields):
        if op == "tail":
            tails.append(op)
        return real(node, op, **fields)

    monkeypatch.setattr(follow_module, "node_request", counting)
    return tails


def printing_rank(job: Job, stop: threading.Event, lines: int, every: float) -> threading.Thread:
    """A thread appending a metric line to the job's rank log every `every` s until `lines` or `stop` (started;
    no database in it)."""
    log_path = job.ranks.get().remote_log

    def printing() -> None:
        for step in range(1, lines + 1):
            if stop.wait(every):
                return
            with open(log_path, "ab") as fh:
                fh.write(b'{"step": %d, "loss": 0.5}\n' % step)

    writer = threading.Thread(target=printing)
    writer.start()
    return writer


def failure(kind=FailureKind.SCRIPT_ERROR) -> Failure:
    return Failure(kind=kind, rank=0, node="box", exit_code=3, signal=None, line="ValueError: boom")


# -- transitions ---------------------------------------------------------------------------------


def test_cancel_of_a_queued_job_is_final_and_a_second_cancel_is_refused():
    job = Job.objects.create(name="q1", script="s.py")
    lifecycle.cancel(job)
    assert job.state == Job.State.CANCELLED and job.failure_kind == "CANCELLED"
    with pytest.raises(ValueError, match="already cancelled"):
        lifecycle.cancel(job)


def test_a_transition_from_the_wrong_state_does_nothing(local_node):
    # given a running job that is being cancelled
    job = running_job(local_node)
    Job.objects.filter(pk=job.pk).update(state=Job.State.CANCELLING)
    # when a failure and a success arrive late, then neither moves it
    assert not lifecycle.fail(job, failure())
    assert not lifecycle.succeed(job)
    job.refresh_from_db()
    assert job.state == Job.State.CANCELLING and job.failure_kind == ""


def test_the_final_state_frees_every_node_in_the_same_step(local_node):
    job = running_job(local_node)
    Job.objects.filter(pk=job.pk).update(state=Job.State.FAILING)
    job.refresh_from_db()
    assert job.ranks.filter(active=True).exists()
    assert lifecycle.finalize(job)
    assert job.state == Job.State.FAILED and not job.ranks.filter(active=True).exists()
    assert not lifecycle.finalize(job)  # safe to repeat


def test_a_job_failed_by_its_checks_leaves_its_name_free(local_node):
    from jobs.launch import LaunchError, LaunchRequest, create_job

    job = create_job(LaunchRequest(name="again"))
    Job.objects.filter(pk=job.pk).update(state=Job.State.STARTING)
    job.refresh_from_db()
    assert lifecycle.fail_unstarted(job, FailureKind.PREFLIGHT, "pre-flight failed: script missing")
    # when launched again under the same name, then it is accepted (the refused one never ran)
    again = create_job(LaunchRequest(name="again"))
    assert again.pk != job.pk and again.state == Job.State.QUEUED
    # but a name of a job that ran stays taken
    update_jobs(Job.objects.filter(pk=again.pk), state=Job.State.FAILED, running_at=timezone.now())
    with pytest.raises(LaunchError, match="already exists"):
        create_job(LaunchRequest(name="again"))


def test_job_alerts_resolve_when_it_ends_and_a_failure_stays_open_on_its_node(local_node):
    from cluster.alerts import open_alert

    job = running_job(local_node, "alerting")
    open_alert(local_node, "rank_died:alerting", Alert.Severity.CRITICAL, "rank 0 died", job_name="alerting")
    assert lifecycle.fail(job, failure())
    job.refresh_from_db()
    lifecycle.finalize(job)
    assert not Alert.objects.filter(key="rank_died:alerting", resolved_at__isnull=True).exists()
    failed = Alert.objects.get(key="job_failed:alerting", resolved_at__isnull=True)
    assert failed.node == local_node and failed.job_name == "alerting"
    assert "SCRIPT_ERROR" in failed.message or "ValueError: boom" in failed.message


# A rank on another node that only saw its peer go away (gloo, through the DDP hook's callback), and the torchrun
# of the rank whose worker was killed (its Root Cause table), as real torchrun 2.13 runs printed them.
PEER_GONE = (
    b'error on rank 2:\nTraceback (most recent call last):\n  File "train.py", line 9, in train\n'
    b"RuntimeError: Got the following error when running the callback: RuntimeError: [/x/gloo/transport/tcp/"
    b"pair.cc:553] Connection closed by peer [127.0.0.1]:57497. This is typically caused by a remote worker crashing.\n"
)
KILLED_WORKER = (
    b"Root Cause (first observed failure):\n[0]:\n  time      : 2026-11-25_18:42:17\n  host      : node2\n"
    b"  rank      : 1 (local_rank: 0)\n  exitcode  : -9 (pid: 26491)\n  error_file: <N/A>\n"
    b"  traceback : Signal 9 (SIGKILL) received by PID 26491\n"
)


def two_rank_job(node: Node, name: str) -> tuple[Job, Rank, Rank]:
    """A RUNNING job with rank 1 on the node and rank 2 on a second local node (logs and exit files in the
    node's workdir)."""
    job = running_job(node, name)
    first = job.ranks.get()
    base = first.remote_log.removesuffix("rank_0.log")
    Rank.objects.filter(pk=first.pk).update(index=1, remote_log=f"{base}rank_1.log", remote_exit=f"{base}rank_1.exit")
    other = Node.objects.create(
        name="box2", address="127.0.0.1", transport="local", role="worker", workdir=node.workdir,
        agent_python=node.agent_python,
    )  # fmt: skip
    Rank.objects.create(
        job=job, node=other, index=2, state=Rank.State.RUNNING, remote_log=f"{base}rank_2.log",
        remote_exit=f"{base}rank_2.exit", remote_error=f"{base}rank_2.error.json", start_record=f"{base}rank_2.start",
        started_at=timezone.now(), last_contact=timezone.now(),
    )  # fmt: skip
    return job, job.ranks.get(index=1), job.ranks.get(index=2)


def end_rank(rank: Rank, output: bytes, rc: int) -> None:
    with open(rank.remote_log, "ab") as fh:
        fh.write(output)
    Path(rank.remote_exit).write_text(json.dumps({"rc": rc, "ended": timezone.now().timestamp()}))


def end_as_the_worker_would(job: Job) -> Job:
    """A failing job's teardown, as the worker's teardown task runs it (no worker runs here); the job after it."""
    wait_for(lambda: Job.objects.get(pk=job.pk).state != Job.State.RUNNING, timeout=20, what="the job to be judged")
    lifecycle.teardown(Job.objects.get(pk=job.pk))
    return Job.objects.get(pk=job.pk)


def test_a_failure_seen_first_as_a_peer_going_away_waits_for_the_rank_that_went_away(local_node, fast_settings):
    # given a job whose rank 2 failed only because its peer went away, while rank 1 has not reported yet
    job, rank1, rank2 = two_rank_job(local_node, "settle")
    end_rank(rank2, PEER_GONE, 1)
    follow(1.0, job_ids=[job.pk])
    # then the job is not failed on that consequence at once
    job.refresh_from_db()
    assert job.state == Job.State.RUNNING
    assert job.ranks.get(index=2).state == Rank.State.EXITED
    # when rank 1's torchrun reports its worker killed (SIGKILL) a moment later
    end_rank(rank1, KILLED_WORKER, 1)
    follow(10.0, job_ids=[job.pk])
    job = end_as_the_worker_would(job)
    # then the failure names the cause, rank 1's kill, not the peer that saw it
    assert job.state == Job.State.FAILED
    assert (job.failure_kind, job.failure_rank, job.failure_signal) == ("KILLED", 1, 9), job.failure_reason


def test_a_failure_that_is_only_a_consequence_fails_the_job_after_the_settle_time(
    local_node, fast_settings, monkeypatch
):
    monkeypatch.setattr(lifecycle, "FAILURE_SETTLE_S", 0.5)
    # given rank 2 failed because its peer went away, and rank 1 never reports (its node is slow to say)
    job, _, rank2 = two_rank_job(local_node, "settled")
    end_rank(rank2, PEER_GONE, 1)
    # when the follower goes on past the settle time, with nothing else changing
    follow(3.0, job_ids=[job.pk])
    job = end_as_the_worker_would(job)
    # then the job fails on what it knows, naming the consequence for what it is
    assert job.state == Job.State.FAILED
    assert job.failure_rank == 2 and "Connection closed by peer" in job.failure_reason


# -- the follower ----------------------------------------------------------------------------------


def test_a_follower_that_lost_its_lease_writes_nothing(local_node, fast_settings):
    job = running_job(local_node)
    write_log(job, b"one\n")
    a = JobFollower(job, "follower-a")
    assert claim(job.pk, "follower-a")
    assert a.step() == 4
    # when another follower takes the job over (A's lease ran out while it was slow)
    update_jobs(
        Job.objects.filter(pk=job.pk), follower="follower-b", follower_until=timezone.now() + timedelta(seconds=60)
    )
    write_log(job, b"two\n")
    # then A's next pass raises and writes nothing: the central log and the offset stay as they were
    with pytest.raises(LeaseLost):
        a.step()
    rank = job.ranks.get()
    assert rank.log_offset == 4 and rank.local_log.read_bytes() == b"one\n"


def test_a_ranks_exit_commits_only_after_its_metric_files_last_rows_are_in(local_node, fast_settings, monkeypatch):
    from metrics.models import JobMetrics

    # given a running job whose metrics.csv (named at launch) got its last rows as the rank exited
    job = running_job(local_node)
    JobMetrics.objects.create(job=job, files=["logs_{job}"])
    csv_file = Path(local_node.workdir) / "logs_j1" / "version_0" / "metrics.csv"
    csv_file.parent.mkdir(parents=True)
    csv_file.write_bytes(b"epoch,step,train_loss\n0,4,0.75\n0,9,0.5\n")
    write_log(job, b"done\n", rc=0)
    at_exit = []
    progress = lifecycle.ranks_progress

    def ranks_progress(moves):
        if any(exit_info is not None for *_, exit_info in moves):
            steps = MetricPoint.objects.filter(job=job, name="train_loss").values_list("step", flat=True)
            at_exit.append(sorted(steps))
        return progress(moves)

    monkeypatch.setattr(lifecycle, "ranks_progress", ranks_progress)
    # when the follower's pass takes the exit (the moment the job may be judged ended)
    assert claim(job.pk, "f")
    JobFollower(job, "f").step()
    # then the file's rows were stored before it: a job that ended has all of its curve
    assert at_exit == [[4, 9]]
    assert job.ranks.get().state == Rank.State.EXITED and lifecycle.judge(Job.objects.get(pk=job.pk))


def test_the_follower_folds_the_rollup_outside_its_lease_at_most_every_interval_and_after_the_end(
    local_node, fast_settings, monkeypatch
):
    """The rollup's upserts no longer hold the job's row lock while points are stored: the follower folds
    them in a transaction of its own, at most every ROLLUP_INTERVAL_S, and at once after the last lines."""
    monkeypatch.setattr(follow_module, "ROLLUP_INTERVAL_S", 3600.0)
    job = running_job(local_node)
    folds, batches = [], []
    real_catch_up, real_save_points = rollup.catch_up, follow_module.save_points

    def catch_up(job_id: int) -> int:
        folds.append((connection.in_atomic_block, Job.objects.get(pk=job_id).state))
        return real_catch_up(job_id)

    def save_points(points) -> None:
        batches.append(len(points))
        real_save_points(points)

    monkeypatch.setattr(rollup, "catch_up", catch_up)
    monkeypatch.setattr(follow_module, "save_points", save_points)
    # given a rank logging a point per pass, the follower folding after each pass as follow() does
    f = JobFollower(job, "f")
    assert claim(job.pk, "f")
    for step in range(5):
        write_log(job, b'{"step": %d, "loss": %d.5}\n' % (step, step))
        assert f.step() > 0
        f.fold()
    # then five batches were stored and folded once (the first pass), outside any transaction
    assert batches == [1] * 5 and folds == [(False, Job.State.RUNNING)]
    # and the chart shows every point all the same, the four not folded yet included
    assert RollupMark.objects.get(job=job).upto < MetricPoint.objects.filter(job=job).latest("id").id
    assert series(job.pk, "loss")["ranks"]["0"]["y"] == [0.5, 1.5, 2.5, 3.5, 4.5]
    f.fold(now=True)
    assert len(folds) == 2
    assert RollupMark.objects.get(job=job).upto == MetricPoint.objects.filter(job=job).latest("id").id


def test_a_new_follower_goes_on_from_the_step_the_last_one_recorded_without_reading_the_points(
    local_node, fast_settings
):
    job = running_job(local_node)
    assert claim(job.pk, "a")
    # given a follower that took 12,000 lines with no step of their own (steps 1..12000; more than a new
    # follower replays of the copied log to rebuild its parser)
    write_log(job, b'UGRO_METRIC {"loss": 0.5}\n' * 12_000)
    assert JobFollower(job, "a").step() > 0
    rank = job.ranks.get()
    assert rank.metric_step == 12_000
    # when a new follower takes the next line
    write_log(job, b'UGRO_METRIC {"loss": 0.25}\n')
    with CaptureQueriesContext(connection) as queries:
        assert JobFollower(job, "a").step() > 0
    # then its step goes on from the recorded one, and it read no metric point to know it
    assert MetricPoint.objects.filter(job=job).order_by("-id").values_list("step", "value").first() == (12_001, 0.25)
    assert not [q for q in queries.captured_queries if q["sql"].startswith("SELECT") and "metricpoint" in q["sql"]]


def test_events_a_follower_could_not_send_are_followed_by_a_resync(local_node, fast_settings, monkeypatch):
    job = running_job(local_node)
    sent: list[tuple[str, dict]] = []
    down = {"now": True}

    def publish_job(job, kind, payload):  # the channel layer, down until told otherwise
        if down["now"]:
            return False
        sent.append((kind, payload))
        return True

    monkeypatch.setattr(follow_module, "publish_job", publish_job)
    f = JobFollower(job, "f")
    assert claim(job.pk, "f")
    # given a pass whose lines could not be sent
    write_log(job, b'{"step": 1, "loss": 1.5}\n')
    assert f.step() > 0 and sent == []
    # when the next pass's can be
    down["now"] = False
    write_log(job, b'{"step": 2, "loss": 2.5}\n')
    assert f.step() > 0
    # then a resync goes first (the page reloads what it missed from the database), then the new lines
    assert [kind for kind, _ in sent] == ["resync", "batch"]
    assert [part["lines"] for part in sent[1][1]["parts"]] == [['{"step": 2, "loss": 2.5}']]
    # and once resynced, lines go alone
    write_log(job, b'{"step": 3, "loss": 3.5}\n')
    f.step()
    assert [kind for kind, _ in sent] == ["resync", "batch", "batch"]


def test_the_follower_folds_a_jobs_rollup_right_after_its_last_pass(local_node, fast_settings, tmp_path, monkeypatch):
    monkeypatch.setattr(follow_module, "ROLLUP_INTERVAL_S", 3600.0)
    other = Node.objects.create(
        name="box2", address="127.0.0.1", transport="local", role="worker", workdir=str(tmp_path / "n2"),
        agent_python=sys.executable,
    )  # fmt: skip
    ending, quiet = running_job(local_node, "ending"), running_job(other, "quiet")  # quiet: followed on and on
    write_log(quiet, b"")
    write_log(ending, b'{"step": 0, "loss": 0.5}\n')
    events = []
    real_step, real_catch_up = JobFollower.step, rollup.catch_up

    def step(self, wait: float = 0.0) -> int:
        taken = real_step(self, wait)
        events.append(("pass", self.job.name))
        return taken

    def catch_up(job_id: int) -> int:
        events.append(("fold", Job.objects.get(pk=job_id).name))
        return real_catch_up(job_id)

    monkeypatch.setattr(JobFollower, "step", step)
    monkeypatch.setattr(rollup, "catch_up", catch_up)
    # given a follower following both jobs (its first passes fold at once)
    following = threading.Thread(target=lambda: (follow(8.0), connection.close()))
    following.start()
    wait_for(lambda: ("fold", "ending") in events and ("pass", "quiet") in events, what="the first passes")
    # when the ending job's rank prints its last point and exits
    write_log(ending, b'{"step": 1, "loss": 1.5}\n', rc=0)
    wait_for(lambda: Job.objects.get(pk=ending.pk).state == Job.State.SUCCEEDED, what="the job's end")
    following.join(30)
    # then its rollup was folded right after its last pass, not when the follower stopped following the other
    last_pass = max(i for i, e in enumerate(events) if e == ("pass", "ending"))
    # (the other job's passes run on a lane of their own: one may come in between)
    assert [e for e in events[last_pass + 1 :] if e[1] == "ending"][:1] == [("fold", "ending")]
    folded = events.index(("fold", "ending"), last_pass)
    assert folded < max(i for i, e in enumerate(events) if e == ("pass", "quiet"))  # while still following it
    assert RollupMark.objects.get(job=ending).upto == MetricPoint.objects.filter(job=ending).latest("id").id
    assert MetricRollup.objects.get(job=ending, level=rollup.TOP).n == 2


def test_a_quiet_rank_whose_node_answered_is_not_lost_on_the_next_failed_read(local_node, fast_settings, monkeypatch):
    """The follower keeps its ranks' rows between passes: a pass whose node answered with nothing new must move
    the kept row's last contact too, or the next read that fails counts silence from long before."""
    job = running_job(local_node)
    job.ranks.update(last_contact=timezone.now() - timedelta(seconds=60))  # past NODE_LOST_AFTER_S (5 s)
    assert claim(job.pk, "f")
    f = JobFollower(job, "f")
    # given a pass whose node answered, with no new line
    assert f.step() == 0

    # when the next read cannot reach the node
    def unreachable(node, op, /, timeout=30.0, **fields):
        raise LinkError("box: cannot connect: [Errno 111] Connection refused", delivered=False)

    monkeypatch.setattr(follow_module, "node_request", unreachable)
    f.step()
    # then the rank is not lost: its node answered a moment ago
    assert job.ranks.get().state == Rank.State.RUNNING


@pytest.mark.parametrize("where", ["follower", "reconciler"])
def test_a_late_answer_is_not_silence_but_a_node_that_cannot_be_reached_is(
    local_node, fast_settings, monkeypatch, where
):
    """A controller too busy to read a node's answer in time must not call its ranks lost (R10 at 10 jobs:
    4 jobs failed NODE_LOST on healthy nodes); a node that cannot be connected to, past the limit, is lost."""
    job = running_job(local_node)
    job.ranks.update(last_contact=timezone.now() - timedelta(seconds=60))  # past NODE_LOST_AFTER_S (20 s)
    assert claim(job.pk, "f")
    errors = {
        "late": LinkError("box: tail was sent, then no answer in time (timeout 7.5s)", delivered=True),
        "unreachable": LinkError("box: cannot connect: [Errno 111] Connection refused", delivered=False),
    }

    def fail_with(kind):
        def request(node, op, /, timeout=30.0, **fields):
            raise errors[kind]

        monkeypatch.setattr(follow_module, "node_request", request)
        monkeypatch.setattr(running_loop, "node_request", request)
        if where == "follower":
            JobFollower(job, "f").step()
        else:
            running_loop.check_ranks(job)

    fail_with("late")
    assert job.ranks.get().state == Rank.State.RUNNING
    fail_with("unreachable")
    rank = job.ranks.get()
    assert rank.state == Rank.State.LOST and "Connection refused" in rank.lost_reason


def test_a_follower_with_a_job_cap_asks_for_another_follower_for_the_rest(local_node, fast_settings, tmp_path):
    """Jobs are spread over follow tasks (each job's pass then waits only for its own nodes and writes)."""
    other = Node.objects.create(
        name="box2", address="127.0.0.1", transport="local", role="worker", workdir=str(tmp_path / "n2"),
        agent_python=sys.executable,
    )  # fmt: skip
    jobs = [running_job(local_node, "j1"), running_job(other, "j2")]
    for job in jobs:
        write_log(job, b"hello\n")
    asked = []
    follow(1.0, max_jobs=1, more_wanted=lambda: asked.append(1))
    copied = [job.ranks.get().log_offset for job in jobs]
    # then exactly one job was followed and another follower was asked for
    assert sorted(copied) == [0, 6] and asked
    # and when every left-over job has a follower already, nobody else is asked for
    left = jobs[copied.index(0)]
    update_jobs(Job.objects.filter(pk=left.pk), follower="other", follower_until=timezone.now() + timedelta(seconds=60))
    asked.clear()
    follow(1.0, max_jobs=1, more_wanted=lambda: asked.append(1))
    assert not asked


def test_a_busy_followed_job_is_claimed_once_and_each_pass_costs_a_bounded_number_of_queries(
    local_node, fast_settings, monkeypatch
):
    """NetBox-style guard on the follower's hot path (R10: every pass of every job): a job it already holds is
    not claimed again each pass, and its metric-file settings are read once, not per pass."""
    job = running_job(local_node)
    tails = count_tails(monkeypatch)
    stop = threading.Event()
    writer = printing_rank(job, stop, lines=999, every=0.05)  # a busy rank
    try:
        with CaptureQueriesContext(connection) as queries:
            follow(2.0, job_ids=[job.pk], idle_sleep=0.1)
    finally:
        stop.set()
        writer.join()
    sql = [q["sql"] for q in queries.captured_queries]
    claims = [q for q in sql if q.startswith("UPDATE") and 'SET "follower" =' in q and "SET \"follower\" = ''" not in q]
    settings_reads = [q for q in sql if q.startswith("SELECT") and "metrics_jobmetrics" in q]
    assert len(tails) >= 10 and MetricPoint.objects.filter(job=job).count() >= 10
    assert len(claims) == 1, claims
    assert len(settings_reads) <= 2, settings_reads  # the follower's, and the new rank stream's parser settings
    assert len(sql) <= 8 * len(tails), (len(sql), len(tails))  # about 7 now (10 before: see the test below)


def more_ranks(job: Job, count: int) -> list[Rank]:
    """The job's rank 0 and `count` more, each on a local node of its own (sharing rank 0's workdir)."""
    first = job.ranks.get()
    for index in range(1, count + 1):
        node = Node.objects.create(
            name=f"{first.node.name}-{index}", address="127.0.0.1", transport="local", role="worker",
            workdir=first.node.workdir, agent_python=sys.executable,
        )  # fmt: skip
        base = first.remote_log.replace("rank_0", f"rank_{index}")[: -len(".log")]
        Rank.objects.create(
            job=job, node=node, index=index, state=Rank.State.RUNNING, remote_log=f"{base}.log",
            remote_exit=f"{base}.exit", started_at=timezone.now(), last_contact=timezone.now(),
        )  # fmt: skip
    return list(job.ranks.order_by("index"))


def test_a_pass_over_three_busy_ranks_sends_one_event_and_advances_them_in_one_statement(
    local_node, fast_settings, monkeypatch
):
    """R10 (30 ranks in 10 jobs): a pass made an event per rank (each a message for the channel layer and
    every viewer's web process) and an UPDATE per rank; now one of each, however many ranks had lines."""
    job = running_job(local_node)
    ranks = more_ranks(job, 2)
    sent: list[tuple[str, dict]] = []
    monkeypatch.setattr(follow_module, "publish_job", lambda job, kind, payload: sent.append((kind, payload)) or True)

    def print_steps(first: int, last: int) -> None:
        for rank in ranks:
            with open(rank.remote_log, "ab") as fh:
                fh.write(b"".join(b'{"step": %d, "loss": %d.5}\n' % (i, rank.index) for i in range(first, last + 1)))

    f = JobFollower(job, "f")
    assert claim(job.pk, "f")
    print_steps(1, 1)
    assert f.step() > 0  # the first pass also reads each rank's parser settings and lists its checkpoints
    sent.clear()
    offsets = dict(job.ranks.values_list("index", "log_offset"))
    # when each rank has printed three more lines
    print_steps(2, 4)
    with CaptureQueriesContext(connection) as queries:
        assert f.step() > 0
    # then one event holds every rank's lines and points, each part with its byte range
    assert [kind for kind, _ in sent] == ["batch"]
    parts = sent[0][1]["parts"]
    assert [(p["rank"], p["start"], len(p["lines"]), len(p["points"])) for p in parts] == [
        (index, offsets[index], 3, 3) for index in range(3)
    ]
    assert [p["end"] for p in parts] == list(job.ranks.order_by("index").values_list("log_offset", flat=True))
    # and the pass took five statements: the ranks read, and a transaction that renewed the lease with
    # metrics.jsonl's size and moved the three ranks' offsets (the points' COPY is not captured here)
    sql = [q["sql"] for q in queries.captured_queries]
    assert len(sql) == 5 and sql[1:2] == ["BEGIN"] and sql[-1] == "COMMIT", "\n".join(q[:120] for q in sql)
    assert sql[0].startswith('SELECT id FROM "jobs_rank"')  # which ranks run: their rows are not read again
    assert (
        sql[2].startswith('SET LOCAL synchronous_commit TO OFF; WITH bump AS (UPDATE "jobs_job"')
        and "RETURNING" in sql[2]
    )
    assert sql[3].startswith('UPDATE "jobs_rank"')
    assert Job.objects.get(pk=job.pk).metrics_bytes == (job.job_dir / "metrics.jsonl").stat().st_size > 0
    assert MetricPoint.objects.filter(job=job).count() == 12
    # and a rank that stops running (here: lost, by the reconciler) is left out of the next pass
    assert lifecycle.rank_lost(Rank.objects.get(job=job, index=2), "node went away")
    sent.clear()
    print_steps(5, 5)
    assert f.step() > 0
    assert [p["rank"] for p in sent[0][1]["parts"]] == [0, 1]


def test_a_pass_with_many_lines_sends_events_of_bounded_size_and_every_line_once(
    local_node, fast_settings, monkeypatch
):
    job = running_job(local_node)
    ranks = more_ranks(job, 2)
    sent: list[dict] = []
    monkeypatch.setattr(follow_module, "publish_job", lambda job, kind, payload: sent.append(payload) or True)
    counts = {0: 2500, 1: 400, 2: 400}
    for rank in ranks:
        with open(rank.remote_log, "ab") as fh:
            fh.write(b"".join(b"r%d line %d\n" % (rank.index, i) for i in range(counts[rank.index])))
    f = JobFollower(job, "f")
    assert claim(job.pk, "f")
    f.step()
    # then no event holds more than EVENT_LINES lines nor a part more than PUBLISH_SLICE, and each rank's
    # lines arrive once, in order
    assert len(sent) == 2
    assert all(sum(len(p["lines"]) for p in event["parts"]) <= follow_module.EVENT_LINES for event in sent)
    parts = [p for event in sent for p in event["parts"]]
    assert all(len(p["lines"]) <= follow_module.PUBLISH_SLICE for p in parts)
    for index, count in counts.items():
        got = [ln for p in parts if p["rank"] == index for ln in p["lines"]]
        assert got == [f"r{index} line {i}" for i in range(count)]


def test_ranks_progress_moves_no_rank_if_one_was_advanced_by_someone_else(local_node, fast_settings):
    job = running_job(local_node)
    ranks = more_ranks(job, 2)
    Rank.objects.filter(pk=ranks[1].pk).update(log_offset=7)  # another follower's commit
    now = timezone.now()
    moves = [(r, 0, {"log_offset": 10, "log_lines": 1, "last_contact": now}, None) for r in ranks]
    # when a pass tries to move all three from offset 0 inside its transaction (it rolls back on False)
    with pytest.raises(LeaseLost), transaction.atomic():
        if not lifecycle.ranks_progress(moves):
            raise LeaseLost("stale")
    # then none moved
    assert list(job.ranks.order_by("index").values_list("log_offset", flat=True)) == [0, 7, 0]
    # and with every offset as expected, all three move at once, the rank objects too
    moves[1] = (ranks[1], 7, {"log_offset": 10, "log_lines": 1, "last_contact": now, "metric_step": 3}, None)
    assert lifecycle.ranks_progress(moves)
    assert list(job.ranks.order_by("index").values_list("log_offset", "metric_step")) == [(10, None), (10, 3),
                                                                                          (10, None)]  # fmt: skip
    assert [r.log_offset for r in ranks] == [10, 10, 10]


def test_a_follower_with_room_does_not_try_to_claim_jobs_others_hold(local_node, fast_settings, monkeypatch):
    """With 10 jobs and two per follower, a follower with room tried to claim every job another one held,
    every round (an UPDATE each): the rows it just read say whose they are."""
    mine, theirs = running_job(local_node, "mine"), running_job(local_node, "theirs")
    update_jobs(
        Job.objects.filter(pk=theirs.pk), follower="other", follower_until=timezone.now() + timedelta(seconds=60)
    )
    tried: list[int] = []
    real_claim = follow_module.claim
    monkeypatch.setattr(
        follow_module, "claim", lambda job_id, owner, **kw: tried.append(job_id) or real_claim(job_id, owner, **kw)
    )
    follow(0.6, job_ids=[mine.pk, theirs.pk], idle_sleep=0.1, max_jobs=2)
    assert tried and set(tried) == {mine.pk}
    assert Job.objects.get(pk=theirs.pk).follower == "other"


def test_lines_that_come_in_a_stream_are_taken_a_round_at_a_time(local_node, fast_settings, monkeypatch):
    """A rank printing every 5 ms got a pass (a round trip, a commit, an event) per line or two: rounds that
    take lines begin at most every FOLLOW_MIN_ROUND_S, and every line is still taken."""
    monkeypatch.setattr(follow_module, "FOLLOW_MIN_ROUND_S", 0.1)
    job = running_job(local_node)
    tails = count_tails(monkeypatch)
    stop = threading.Event()
    writer = printing_rank(job, stop, lines=200, every=0.005)  # 200 lines a second for a second
    try:
        follow(1.6, job_ids=[job.pk], idle_sleep=0.1)
    finally:
        stop.set()
        writer.join()
    # then about one read per 0.1 s (16 in 1.6 s; a busier machine makes fewer), and no line was left behind
    assert len(tails) <= 18, len(tails)
    follow(0.3, job_ids=[job.pk], idle_sleep=0.1)
    assert MetricPoint.objects.filter(job=job).count() == 200


def test_a_quiet_job_is_polled_less_often_and_its_next_line_is_still_taken(local_node, fast_settings, monkeypatch):
    """An idle followed job cost about 4 % of a CPU in empty passes: while rounds take nothing, the follower
    waits longer between them (up to QUIET_MAX_FACTOR x idle_sleep); a line resets it."""
    job = running_job(local_node)
    write_log(job, b"first\n")
    tails = count_tails(monkeypatch)
    # a line comes after a second and a half of quiet (the rounds have backed off by then)
    log_path = job.ranks.get().remote_log

    def second_line() -> None:  # no database in this thread
        with open(log_path, "ab") as fh:
            fh.write(b"second\n")

    later = threading.Timer(1.5, second_line)
    later.start()
    try:
        follow(3.0, job_ids=[job.pk], idle_sleep=0.25)
    finally:
        later.cancel()
    # then both lines were taken, in fewer rounds than one per idle_sleep (12 in 3 s; a busier machine
    # makes fewer, never more)
    assert job.ranks.get().log_offset == len(b"first\nsecond\n")
    assert len(tails) <= 8, tails


def test_a_line_without_a_newline_is_taken_in_pieces_and_following_goes_on(local_node, fast_settings):
    # given a rank that prints 5 MiB with no newline (a binary dump), then a line, then exits
    job = running_job(local_node)
    blob = b"x" * (5 * 1024 * 1024)
    write_log(job, blob)

    def followed() -> int:
        follow(1.0, job_ids=[job.pk])  # passes until the time is up (a loaded machine takes more of them)
        return job.ranks.get().log_offset

    # then whole LINE_CUT pieces are taken while it runs (the follower is not stuck)
    wait_for(lambda: followed() >= 5 * LINE_CUT, timeout=60, what="the five pieces to be taken")
    rank = job.ranks.get()
    assert rank.log_offset == 5 * LINE_CUT and rank.state == Rank.State.RUNNING
    write_log(job, b"\nlast line\n", rc=0)
    follow(5.0, job_ids=[job.pk])
    rank.refresh_from_db()
    job.refresh_from_db()
    # and the job ends, its central log byte for byte the node's, shown in bounded pieces
    assert job.state == Job.State.SUCCEEDED and rank.state == Rank.State.EXITED
    assert rank.local_log.read_bytes() == Path(rank.remote_log).read_bytes()
    lines = job_lines(job, 0)
    assert max(len(ln.text) for ln in lines) <= LINE_CUT and lines[-1].text == "last line"
    # five 1 MiB pieces, the newline that ended the dump, the last line: the count the view shows too
    assert rank.log_lines == len(lines) == 7


def test_a_progress_bar_redrawn_100k_times_shows_its_last_state(local_node, fast_settings):
    job = running_job(local_node)
    bar = b"".join(b"\r%3d%%|%s| %d/100000" % (i * 100 // 99999, b"#" * (i * 20 // 99999), i) for i in range(100000))
    write_log(job, b"start\n" + bar + b"\ndone\n", rc=0)
    follow(10.0, job_ids=[job.pk])
    job.refresh_from_db()
    assert job.state == Job.State.SUCCEEDED
    shown = [ln.text for ln in job_lines(job, 0)]
    # the bar (several MiB) is a handful of pieces, each showing its last state; the last one is 100 %
    assert shown[0] == "start" and shown[-1] == "done"
    assert len(shown) <= 2 + len(bar) // LINE_CUT + 1
    assert shown[-2] == "100%|" + "#" * 20 + "| 99999/100000"


def test_the_log_tail_reads_from_the_end_of_the_file(local_node, fast_settings, monkeypatch):
    job = running_job(local_node)
    write_log(job, b"".join(b"line %d\n" % i for i in range(200000)), rc=0)
    follow(10.0, job_ids=[job.pk])
    rank = job.ranks.get()
    assert rank.log_lines == 200000
    starts = []
    real_rank_lines = rank_lines

    def recording_rank_lines(rank, start=0, end=None):
        starts.append(start)
        return real_rank_lines(rank, start, end)

    # when the last 5 lines are asked for, then they come from reading near the end of the 2 MB log only
    monkeypatch.setattr("jobs.logs.rank_lines", recording_rank_lines)
    assert [ln.text for ln in job_lines(job, 0, tail=5)] == [f"line {i}" for i in range(199995, 200000)]
    assert starts == [rank.log_offset - len(b"".join(b"line %d\n" % i for i in range(199995, 200000)))]
    assert tail_lines(rank, 3) == ["line 199997", "line 199998", "line 199999"]


# -- handlers only read or enqueue -------------------------------------------------------------------


def test_checkpoints_and_logs_pages_never_ask_a_node(local_node, client, django_user_model, monkeypatch,
                                                     django_assert_max_num_queries):  # fmt: skip
    from jobs.models import Checkpoint

    job = running_job(local_node)
    Checkpoint.objects.create(job=job, node=local_node, path="/w/outputs/j1/checkpoint_step6.pt", size=10, mtime=0)
    client.force_login(django_user_model.objects.create_user("alice", password="x" * 12))

    def no_ssh(*args, **kwargs):
        raise AssertionError("a request handler asked a node")

    monkeypatch.setattr("cluster.links.NodeLink.request", no_ssh)
    with django_assert_max_num_queries(6):
        body = client.get(f"/api/jobs/{job.pk}/checkpoints").json()
    assert body["checkpoints"] == [["box", "/w/outputs/j1/checkpoint_step6.pt", 10]]
    assert client.get(f"/api/jobs/{job.pk}/logs?tail=10").status_code == 200


def test_cancel_from_the_page_returns_at_once_with_the_job_cancelling(local_node, client, django_user_model,
                                                                      monkeypatch):  # fmt: skip
    job = running_job(local_node)
    torn = []
    monkeypatch.setattr("jobs.lifecycle.dispatch_teardown", lambda j: torn.append(j.pk))
    alice = django_user_model.objects.create_user("alice", password="x" * 12)
    alice.groups.add(Group.objects.get(name="operator"))  # the job is not hers: an operator's cancel
    client.force_login(alice)
    client.post(f"/jobs/{job.pk}/cancel/")
    job.refresh_from_db()
    assert job.state == Job.State.CANCELLING and torn == [job.pk]


# -- commands --------------------------------------------------------------------------------------


def test_status_exits_0_for_a_cancelled_job_and_reports_states_with_exit_code():
    Job.objects.create(name="c1", script="s.py", state=Job.State.CANCELLED)
    Job.objects.create(name="f1", script="s.py", state=Job.State.FAILED, failure_reason="OOM on rank 1")
    call_command("status", "c1", stdout=io.StringIO())
    with pytest.raises(CommandError, match="OOM on rank 1") as failed:
        call_command("status", "f1", stdout=io.StringIO())
    assert failed.value.returncode == 1
    with pytest.raises(CommandError) as cancelled:
        call_command("status", "c1", "--exit-code", stdout=io.StringIO())
    assert cancelled.value.returncode == 2


# -- Redis away ------------------------------------------------------------------------------------


def test_with_the_broker_down_tasks_are_not_queued_and_nothing_raises(settings, caplog):
    from celery.beat import ScheduleEntry

    from ugro_site import celery as ugro_celery

    settings.CELERY_BROKER_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1
    assert ugro_celery.send_task("jobs.tasks.follow_jobs") is False
    from jobs.tasks import follow_jobs

    follow_jobs.run()  # a follow task that ends while Redis is away does not die queueing its successor

    sched = ugro_celery.LockedScheduler.__new__(ugro_celery.LockedScheduler)
    entry = ScheduleEntry(name="follow-jobs", task="jobs.tasks.follow_jobs", schedule=5.0, app=ugro_celery.app)
    with caplog.at_level(logging.WARNING, logger="ugro.beat"):
        for _ in range(5):
            sched.apply_entry(entry)
    # one line for the outage, not a traceback per tick
    assert [r.getMessage() for r in caplog.records] == ["broker unreachable: scheduled tasks wait until it is back"]
    assert not any(r.exc_info for r in caplog.records)


# -- the code's shape ------------------------------------------------------------------------------


def _jobs_modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text()) for p in (REPO / "jobs").glob("*.py")}


def test_only_the_lifecycle_module_writes_job_or_rank_state():
    offenders = []
    for path in [*REPO.glob("jobs/**/*.py"), *REPO.glob("cluster/**/*.py"), *REPO.glob("metrics/**/*.py")]:
        if path.name == "lifecycle.py" or "migrations" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                "update", "create", "update_or_create", "bulk_update",
            ):  # fmt: skip
                if any(kw.arg == "state" for kw in node.keywords):
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Attribute) and target.attr == "state" and path.parts[-2] == "jobs":
                        offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert offenders == []


def test_jobs_modules_import_each_other_top_down_without_a_loop():
    graph: dict[str, set[str]] = {}
    inner = []
    for name, tree in _jobs_modules().items():
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                deps |= {node.module} if node.module else {a.name for a in node.names}
        graph[name] = deps
        if name == "apps":
            continue  # ready() is where Django lets an app import its own modules
        for func in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)):
            for node in ast.walk(func):
                if isinstance(node, ast.ImportFrom) and (node.level == 1 or (node.module or "").startswith("jobs")):
                    inner.append(f"jobs/{name}.py:{node.lineno}")
    assert inner == [], "imports inside functions hide a loop"
    seen, stack = set(), []

    def visit(mod: str) -> None:
        if mod in stack:
            raise AssertionError(" -> ".join([*stack[stack.index(mod) :], mod]))
        if mod in seen:
            return
        stack.append(mod)
        for dep in graph.get(mod, ()):
            visit(dep)
        stack.pop()
        seen.add(mod)

    for mod in graph:
        visit(mod)


def test_a_health_alert_on_a_node_names_the_job_holding_it(local_node):
    from cluster.alerts import open_alert, payload

    running_job(local_node, "busy")
    alert = open_alert(local_node, "ram", Alert.Severity.WARNING, "RAM 93% used")
    body = payload(alert)
    assert body["alert"]["node"] == "box" and body["alert"]["job"] == "busy"
    assert "(job busy)" in body["title"]
