"""End to end on real sshd nodes and real torchrun: launch, follow, fail, cancel."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from jobs.follow import follow
from jobs.models import Allocation, Job, Rank
from metrics.models import MetricPoint

from .conftest import FAST_TRAIN, SLOW_TRAIN, cluster_yaml, job_pids, ranks_logged, wait_for

pytestmark = pytest.mark.e2e


def launch(*args: str) -> str:
    out = io.StringIO()
    call_command("launch", *args, stdout=out)
    return out.getvalue()


def node_log(rank: Rank) -> bytes:
    return Path(rank.remote_log).read_bytes()


HOSTILE = ["$(touch /tmp/ugro_pwned_1)", "`touch /tmp/ugro_pwned_2`", "x; touch /tmp/ugro_pwned_3",
           "a'b\"c", "line1\ntouch /tmp/ugro_pwned_4", "|| touch /tmp/ugro_pwned_5 &"]  # fmt: skip


def test_a_launch_on_a_fourth_node_added_by_yaml_reimport_trains_to_success_and_runs_no_hostile_value(lab):
    """Covers: the attached launch on four sshd nodes (the fourth added by re-importing cluster.yaml) with real
    torchrun: a multi-host rendezvous, every rank's log copied byte for byte, metrics ingested, the finished alert;
    hostile model, dataset and script arguments carried through SSH, the agent and torchrun as literal argv items,
    nothing run on the nodes. The loops' rules are tests/test_loops.py's, the import alone
    tests/test_cluster_config.py's.
    """
    from cluster.config_yaml import import_cluster
    from cluster.models import Alert, Node

    for i in range(1, 6):
        Path(f"/tmp/ugro_pwned_{i}").unlink(missing_ok=True)
    # given the lab grows by one machine in cluster.yaml, re-imported
    summary = import_cluster(cluster_yaml(lab, 4))
    assert summary.created == ["node4"] and len(summary.updated) == 3
    assert Node.objects.count() == 4
    # a hostile job name is refused before anything exists
    for bad in ("$(touch /tmp/ugro_pwned_1)", "a;b", "x`y`", "a b", "new\nline", "'q'"):
        with pytest.raises(CommandError, match="job name"):
            launch("--name", bad, "--", *FAST_TRAIN)
    assert not Job.objects.exists()
    # when a job is launched on every node (the default), with hostile model, dataset and extra arguments
    out = launch("--name", "exp1", "--model", HOSTILE[0], "--dataset", HOSTILE[1], "--", *FAST_TRAIN, "--job-id",
                 HOSTILE[2], "--note", HOSTILE[3], "--note2", HOSTILE[4], "--note3", HOSTILE[5])  # fmt: skip
    job = Job.objects.get(name="exp1")
    # then it succeeds on all four, every rank's log is copied byte for byte, and metrics were ingested
    assert job.state == Job.State.SUCCEEDED, job.failure_reason
    assert "exp1 succeeded" in out
    ranks = list(job.ranks.select_related("node").order_by("index"))
    assert [r.node.name for r in ranks] == ["node1", "node2", "node3", "node4"]
    for r in ranks:
        assert r.exit_code == 0 and r.active is False
        assert r.local_log.read_bytes() == node_log(r)
        assert r.log_lines == len(node_log(r).splitlines())
        assert b'"loss"' in node_log(r)
    assert job.launch_spread_s is not None and job.launch_spread_s < job.sync_window_s
    assert (job.job_dir / "config.json").exists()
    assert (job.job_dir / "metrics.jsonl").exists()
    losses = MetricPoint.objects.filter(job=job, name="loss")
    assert set(losses.values_list("rank", flat=True)) == {0, 1, 2, 3}
    # the rendezvous really was multi-host: each rank bound its own address
    cfg = (job.job_dir / "config.json").read_text()
    for r in ranks:
        assert f"--local-addr={r.node.address}" in cfg
    assert job_pids(job.tag) == []
    # the hostile values travelled as literal argv items: nothing of them ran on a node
    for i in range(1, 6):
        assert not Path(f"/tmp/ugro_pwned_{i}").exists()
    assert HOSTILE[0] in job.script_args and HOSTILE[4] in job.script_args
    # and people hear that it finished
    info = Alert.objects.get(key="job_finished:exp1")
    assert info.severity == Alert.Severity.INFO and "exp1 succeeded" in info.message


def _running_with_lines(job_name: str, lines: int = 3) -> Job:
    def ready():
        follow(1.0, job_ids=[Job.objects.get(name=job_name).pk])
        job = Job.objects.get(name=job_name)
        return job if job.is_live and ranks_logged(job, lines) else None

    return wait_for(ready, timeout=90, what=f"{job_name} to print {lines} lines on every rank")


@pytest.mark.parametrize("during", ["pre-flight", "the starts"])
def test_a_cancel_while_the_job_starts_ends_it_only_once_what_its_launch_started_is_stopped(lab, monkeypatch, during):
    """Covers: a cancel racing a real launch held in its pre-flight or between its rank starts: the job ends only once
    what the launch started on the nodes is stopped.
    """
    import threading
    import time

    from django.db import connection

    from jobs import launch as launching

    entered = threading.Event()
    starts: list[tuple[str, float]] = []  # (node, when its start was answered)

    def cancel_gets_as_far_as_it_can(job_id: int) -> None:
        """Hold the launch until the job is being cancelled, and then until the cancel has gone as far as it
        goes without this launch (the job final: what the launch starts now is left running; or 3 s)."""
        entered.set()
        try:
            wait_for(lambda: Job.objects.get(pk=job_id).state != Job.State.STARTING, timeout=30, interval=0.05,
                     what="the cancel")  # fmt: skip
            deadline = time.monotonic() + 3
            while not Job.objects.get(pk=job_id).is_ended and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            connection.close()  # this thread's own

    # given a launch held up in its pre-flight checks, or in the middle of starting its ranks (node2's rank
    # is started only then; node1's and node3's are up)
    checks, request = launching.run_preflight, launching.node_request

    def preflight(job, ranks, bases):
        if during == "pre-flight":
            cancel_gets_as_far_as_it_can(job.pk)
        return checks(job, ranks, bases)

    def node_request(node, op, /, **fields):
        if op == "start" and during == "the starts" and node.name == "node2":
            cancel_gets_as_far_as_it_can(Rank.objects.get(start_record=fields["record"]).job_id)
        answer = request(node, op, **fields)
        if op == "start":
            starts.append((node.name, time.time()))
        return answer

    monkeypatch.setattr(launching, "run_preflight", preflight)
    monkeypatch.setattr(launching, "node_request", node_request)
    launched = threading.Event()

    def launch_job(job):
        try:
            return launching.launch(job)
        finally:
            launched.set()

    monkeypatch.setattr("jobs.scheduler.launch", launch_job)

    def launching_command() -> None:  # it waits while the job starts: in a terminal of its own
        try:
            launch("--name", "racer", "--detach", "--", *SLOW_TRAIN)
        except CommandError:
            pass  # it says the job was cancelled
        finally:
            connection.close()

    command = threading.Thread(target=launching_command)
    command.start()
    assert entered.wait(60)
    # when it is cancelled then
    out = io.StringIO()
    call_command("cancel", "racer", stdout=out)
    job = Job.objects.get(name="racer")
    # then the command says no process is left, and none is
    assert "no process of it remains" in out.getvalue()
    assert job.state == Job.State.CANCELLED and job_pids(job.tag) == []
    # because the job was ended only after its launch was done: no rank started after (to be left running)
    assert launched.wait(30)
    if during == "pre-flight":
        assert starts == []  # and a launch cancelled before its starts started nothing
    else:
        assert sorted(node for node, _ in starts) == ["node1", "node2", "node3"]
        assert max(when for _, when in starts) < job.finished_at.timestamp()
    assert not Rank.objects.filter(job=job, active=True).exists()
    command.join(30)


def test_unreachable_node_fails_the_launch_fast_and_starts_nothing(lab):
    """Covers: a launch to an address where no sshd answers: the link's real connect error fails it before any rank
    starts.
    """
    from cluster.models import Node

    Node.objects.filter(name="node3").update(address="127.0.0.250")
    with pytest.raises(CommandError, match="cannot reach node node3"):
        launch("--name", "unreach", "--", *FAST_TRAIN)
    job = Job.objects.get(name="unreach")
    assert job.state == Job.State.FAILED and job.failure_node == "node3"  # a node-lost retry waits for it
    assert "Nothing was started" in job.failure_reason
    assert not Rank.objects.filter(job=job, active=True).exists()
    assert not Rank.objects.filter(job=job).exclude(state=Rank.State.PENDING).exists()


def test_a_rank_that_cannot_start_fails_the_launch_and_stops_those_that_did(lab, monkeypatch):
    """Covers: a rank whose torchrun is missing on its node, past pre-flight: its real start fails and the ranks already
    started on the other nodes are stopped.
    """
    from cluster.models import Node

    # pre-flight would catch this node; skip it to reach the start itself (say the env vanished since)
    monkeypatch.setattr("jobs.launch.run_preflight", lambda job, ranks, base=None: [])
    Node.objects.filter(name="node3").update(torchrun_command="/nonexistent/bin/torchrun")
    with pytest.raises(CommandError):
        launch("--name", "halfstart", "--", *SLOW_TRAIN)
    job = Job.objects.get(name="halfstart")
    assert job.state == Job.State.FAILED
    assert "rank 2 on node3 did not start" in job.failure_reason and "/nonexistent/bin/torchrun" in job.failure_reason
    assert job_pids(job.tag) == []
    assert not Rank.objects.filter(job=job, active=True).exists()


def test_the_reconciler_frees_an_ended_job_that_holds_nodes_and_kills_its_processes(lab):
    """Covers: the reconciler killing a cancelled job's live torchrun processes on real nodes and freeing them; the rule
    alone is tests/test_loops.py's.
    """
    from cluster.models import Alert
    from jobs.reconcile import reconcile

    # given a running job whose canceller died after marking it (processes alive, nodes held)
    launch("--name", "orphan", "--detach", "--", *SLOW_TRAIN)
    job = _running_with_lines("orphan", lines=1)
    Job.objects.filter(pk=job.pk).update(state=Job.State.CANCELLED)
    assert job_pids(job.tag)
    # when the worker's reconciler runs: its nodes are freed, nothing of it is left, and people are told
    # processes were killed
    warned = Alert.objects.filter(key="orphans:orphan", severity=Alert.Severity.WARNING)
    wait_for(lambda: warned.count() >= 3 and not job_pids(job.tag), timeout=30, what="the orphan's cleanup")
    assert not Rank.objects.filter(job=job, active=True).exists()
    assert not Allocation.objects.filter(job=job, active=True).exists()
    assert not reconcile()
