"""The worker's loops, rule by rule, against an in-memory node agent (tests/fake_agent.py): fast, and each
rule alone. The same rules run end to end on real sshd and torchrun in tests/test_*_e2e.py."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from cluster.models import Alert, Node
from jobs import lifecycle
from jobs.models import Allocation, Attempt, Job, Rank
from jobs.reconcile import reconcile

from .fake_agent import FakeCluster
from .jobrows import update_jobs

pytestmark = pytest.mark.django_db


@pytest.fixture
def nodes(monkeypatch, settings):
    settings.UGRO = {**settings.UGRO, "KILL_GRACE_S": 0.2, "NODE_LOST_AFTER_S": 5.0}
    monkeypatch.setattr(lifecycle, "send_task", lambda *a: True)  # the teardown task: these tests call the rules
    for i in (1, 2):
        Node.objects.create(name=f"n{i}", address=f"10.9.0.{i}", role="master" if i == 1 else "worker", order=i)
    return FakeCluster("n1", "n2").install(monkeypatch)


def running(name: str, cluster: FakeCluster, started_s_ago: float = 30.0) -> Job:
    """A RUNNING job with a rank on n1 and n2, both started on their nodes."""
    since = timezone.now() - timedelta(seconds=started_s_ago)
    job = Job.objects.create(name=name, script="t.py", tag=f"{name}-tag", state=Job.State.RUNNING,
                             started_at=since, running_at=since, state_changed_at=since)  # fmt: skip
    for i, node in enumerate(Node.objects.order_by("order")):
        rank = Rank.objects.create(job=job, node=node, index=i, state=Rank.State.RUNNING, active=True, started_at=since,
                                   last_contact=since, remote_exit=f"/w/{name}/rank_{i}.exit")  # fmt: skip
        cluster.run(node.name, job.tag, rank.start_key)
    return job


def test_a_rank_whose_processes_vanished_without_an_exit_record_is_lost_and_the_job_fails(nodes):
    job = running("vanish", nodes)
    # when n2's processes of it are gone and nothing recorded an exit
    nodes["n2"].tags.pop(job.tag)
    report = reconcile([job.pk])
    # then that rank is LOST with the reason, the job fails on it, and its teardown stops the rest
    assert report.lost == ["vanish/1"] and report.judged == ["vanish"]
    job.refresh_from_db()
    assert job.state == Job.State.FAILING and "gone without recording an exit code" in job.failure_reason
    assert job.failure_rank == 1
    lost = Rank.objects.get(job=job, index=1)
    assert lost.state == Rank.State.LOST and "without recording an exit code" in lost.lost_reason
    assert lifecycle.teardown(job) and Job.objects.get(pk=job.pk).state == Job.State.FAILED
    assert nodes["n1"].tags == {} and not Rank.objects.filter(job=job, active=True).exists()


def test_a_rank_on_a_node_silent_longer_than_node_lost_after_is_lost_but_not_sooner(nodes):
    job = running("quiet", nodes, started_s_ago=2.0)
    nodes["n2"].silent = True
    # a node silent for less than NODE_LOST_AFTER_S: its rank is still given the benefit of the doubt
    assert reconcile([job.pk]).lost == []
    # once its last contact is older than that, the rank is lost and named with its node
    Rank.objects.filter(job=job).update(last_contact=timezone.now() - timedelta(seconds=6))
    assert reconcile([job.pk]).lost == ["quiet/1"]
    assert "node n2 stopped answering" in Rank.objects.get(job=job, index=1).lost_reason


def test_a_launch_that_outlived_its_window_fails_as_a_timeout(nodes):
    long_ago = timezone.now() - timedelta(seconds=600)
    job = Job.objects.create(name="stuck", script="t.py", tag="stuck-tag", state=Job.State.STARTING,
                             sync_window_s=30, started_at=long_ago, state_changed_at=long_ago)  # fmt: skip
    assert reconcile([job.pk]).timed_out == ["stuck"]
    job.refresh_from_db()
    assert (
        job.state == Job.State.FAILING
        and job.failure_kind == "TIMEOUT"
        and "did not finish within 90s" in (job.failure_reason)
    )


def test_a_lost_teardown_is_run_again_and_kills_what_ignores_sigterm(nodes):
    job = running("stubborn", nodes)
    nodes["n1"].stubborn.add(job.tag)
    lifecycle.cancel(job)
    # given the teardown was lost with its worker (CANCELLING well past the kill grace and the retry time)
    Job.objects.filter(pk=job.pk).update(state_changed_at=timezone.now() - timedelta(seconds=60))
    report = reconcile([job.pk])
    # then the reconciler runs it: TERM, then KILL for what ignored it, and the end is final
    assert report.torn_down == ["stubborn"]
    assert Job.objects.get(pk=job.pk).state == Job.State.CANCELLED
    kills = [f["signal"] for op, f in nodes["n1"].requests if op == "kill"]
    assert kills == [15, 9] and nodes["n1"].tags == {} and nodes["n2"].tags == {}


def test_an_ended_job_still_holding_nodes_is_released(nodes):
    job = running("ended", nodes)
    Allocation.objects.create(job=job, node=Node.objects.get(name="n1"), gpu_index=0, active=True)
    update_jobs(Job.objects.filter(pk=job.pk), state=Job.State.SUCCEEDED, finished_at=timezone.now())
    assert reconcile([job.pk]).released == ["ended"]
    assert not Rank.objects.filter(job=job, active=True).exists()
    assert not Allocation.objects.filter(job=job, active=True).exists()


def test_processes_of_an_ended_job_are_killed_and_people_told_on_each_node(nodes):
    job = running("left", nodes)
    update_jobs(Job.objects.filter(pk=job.pk), state=Job.State.CANCELLED, finished_at=timezone.now())
    report = reconcile()
    assert sorted(report.orphans_killed) == ["n1:left", "n2:left"]
    assert nodes["n1"].tags == {} and nodes["n2"].tags == {}
    assert Alert.objects.filter(key="orphans:left", severity=Alert.Severity.WARNING).count() == 2
    # and a pass later there is nothing left to do
    assert not reconcile().orphans_killed


def test_a_rule_that_raises_stops_neither_the_pass_nor_the_other_rules(nodes, monkeypatch):
    from jobs.loops import starts

    job = running("ok", nodes)
    update_jobs(Job.objects.filter(pk=job.pk), state=Job.State.SUCCEEDED, finished_at=timezone.now())

    def broken(job_ids, *, wait):
        raise RuntimeError("boom")

    monkeypatch.setattr(starts, "fail_overdue_starts", broken)
    report = reconcile([job.pk])
    # the starting rule failed, and the release rule after it still ran; the failure is an open alert
    assert report.released == ["ok"]
    assert Alert.objects.get(key="rule:starting", resolved_at__isnull=True).message.endswith("RuntimeError: boom")


def test_a_rule_that_raises_on_one_job_still_acts_on_the_others(nodes, monkeypatch):
    from jobs.loops import running as running_loop

    first, second = running("first", nodes), running("second", nodes)
    for job in (first, second):  # both jobs' ranks vanished without an exit record
        nodes["n2"].tags.pop(job.tag)
    real, seen = running_loop.check_job, []

    def broken_on_the_first_it_meets(job, report):
        seen.append(job.name)
        if len(seen) == 1:
            raise RuntimeError(f"boom on {job.name}")
        return real(job, report)

    monkeypatch.setattr(running_loop, "check_job", broken_on_the_first_it_meets)
    # when the running loop's rule raises on the first job of its batch
    report = reconcile([first.pk, second.pk])
    # then the other job is still judged, and the failure is an open alert
    broken, other = seen
    assert report.judged == [other] and Job.objects.get(name=other).state == Job.State.FAILING
    assert Alert.objects.get(key="rule:running", resolved_at__isnull=True).message.endswith(f"boom on {broken}")


def test_a_lost_rank_of_an_earlier_attempt_gives_the_rest_of_its_output_once_its_node_answers(nodes, settings,
                                                                                               tmp_path):  # fmt: skip
    settings.JOBS_DIR = tmp_path / "jobs"
    # given attempt 1 ended with n2's rank lost (its node cut off) after its first line was copied, and the job
    # running on as attempt 2 (its attempt-1 logs archived where jobs/logs.py moves them)
    job = running("requeued", nodes)
    first = job.current
    lost = Rank.objects.get(job=job, index=1)
    Rank.objects.filter(pk=lost.pk).update(state=Rank.State.LOST, active=False, remote_log="/w/requeued/rank_1.log",
                                           log_offset=len(b"step 10 loss 2.1\n"), log_lines=1)  # fmt: skip
    Attempt.objects.filter(pk=first.pk).update(state="failed", finished_at=timezone.now())
    second = Attempt.objects.create(job=job, number=2, tag="requeued-tag-2", started_at=timezone.now())
    Job.objects.filter(pk=job.pk).update(current=second)
    lost = Rank.objects.select_related("job", "attempt").get(pk=lost.pk)
    archived = lost.local_log
    assert archived.parent.name == "attempt_1"
    archived.parent.mkdir(parents=True)
    archived.write_bytes(b"step 10 loss 2.1\n")
    said = b"step 10 loss 2.1\nstep 11 loss 2.0\nRuntimeError: Connection reset by peer (gloo)\n"
    nodes["n2"].logs["/w/requeued/rank_1.log"] = said
    nodes["n2"].exit_files[lost.remote_exit] = {"code": 1}
    # when the loops pass while n2 is still away: nothing is taken, nothing is drained
    nodes["n2"].silent = True
    assert reconcile([job.pk]).recovered == []
    assert archived.read_bytes() == b"step 10 loss 2.1\n" and not Rank.objects.get(pk=lost.pk).drained
    # and once its probes call it DOWN, it is not even asked (its next good probe says when it is back)
    Node.objects.filter(name="n2").update(status=Node.Status.DOWN)
    nodes["n2"].silent, nodes["n2"].requests = False, []
    assert reconcile([job.pk]).recovered == [] and not [op for op, _ in nodes["n2"].requests if op == "tail"]
    # when it answers again: the rest of its output reaches attempt 1's log, and the rank is drained
    Node.objects.filter(name="n2").update(status=Node.Status.HEALTHY)
    assert reconcile([job.pk]).recovered == ["requeued"]
    assert archived.read_bytes() == said
    lost.refresh_from_db()
    assert lost.drained and lost.log_offset == len(said) and lost.log_lines == 3
    # and nothing of it went to the running attempt's logs; a later pass takes nothing twice
    assert not (job.logs_dir / "rank_1.log").exists()
    assert reconcile([job.pk]).recovered == [] and archived.read_bytes() == said
