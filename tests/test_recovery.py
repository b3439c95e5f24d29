"""Recovery's rules against the database (no training): names of checkpoints, the requeue edge, the retry
policy's decisions, the hang limit and straggler scores. The end-to-end proof is tests/test_recovery_e2e.py."""

from __future__ import annotations

import io
import json
import re
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from cluster import links
from cluster.models import Node
from jobs import checkpoints, lifecycle, recovery
from jobs.loops import retries
from jobs.models import Attempt, Checkpoint, Job, Rank
from metrics.ingest import Sample, save_points
from metrics.models import MetricPoint

from .jobrows import update_jobs

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def node(tmp_path, settings):
    settings.JOBS_DIR = tmp_path / "jobs"
    return Node.objects.create(
        name="box", address="127.0.0.1", transport="local", role="master", workdir=str(tmp_path / "wd"),
        agent_python=sys.executable, gpu_vram_gb=8,
    )  # fmt: skip


def failed_job(node: Node, name: str = "f1", kind: str = "SCRIPT_ERROR", **fields) -> Job:
    job = Job.objects.create(
        name=name, script="train.py", tag=f"{name}-t1", state=Job.State.FAILED, failure_kind=kind,
        failure_node=node.name, finished_at=timezone.now(), **fields,
    )  # fmt: skip
    Rank.objects.create(job=job, node=node, index=0, state=Rank.State.EXITED, exit_code=1, active=False,
                        log_offset=6, log_lines=1)  # fmt: skip
    job.logs_dir.mkdir(parents=True, exist_ok=True)
    (job.logs_dir / "rank_0.log").write_bytes(b"hello\n")
    return job


def points(job: Job, attempt: int, steps, name: str = "loss", rank: int = 0, start=None, gap: float = 1.0) -> None:
    start = start or timezone.now() - timedelta(seconds=gap * len(list(steps)))
    MetricPoint.objects.bulk_create(
        MetricPoint(job=job, rank=rank, step=s, name=name, value=1.0 / s, attempt=attempt,
                    time=start + timedelta(seconds=gap * i))
        for i, s in enumerate(steps)
    )  # fmt: skip


def ckpt(job: Job, node: Node, step: int, ready: bool = True) -> Checkpoint:
    path = f"{node.workdir}/outputs/{job.name}/checkpoint_step{step}.pt"
    return Checkpoint.objects.create(job=job, node=node, path=path, size=10, mtime=0, step=step, ready=ready)


def test_steps_come_from_names_and_temporary_names_are_never_checkpoints():
    assert checkpoints.step_of("checkpoint_step50.pt") == 50
    assert checkpoints.step_of("checkpoint-500") == 500
    assert checkpoints.step_of("epoch=1-step=1200.ckpt") == 1200
    assert checkpoints.step_of("iter_0001000") == 1000
    assert checkpoints.step_of("model.safetensors") is None
    for name in (".checkpoint_step50.pt.tmp.123", "checkpoint_step50.pt.part", "tmp-checkpoint-3", "x.ugro-part"):
        assert checkpoints.is_temporary(name), name
    assert not checkpoints.is_temporary("checkpoint_step50.pt")


def test_resume_and_batch_arguments_come_from_the_jobs_templates(node):
    job = failed_job(node, resume_path="outputs/f1/checkpoint-30",
                     resume_template="--resume_from_checkpoint {checkpoint}",
                     batch_template="--per_device_train_batch_size {batch} --gradient_accumulation_steps {accum}",
                     batch={"batch": 4, "accum": 2})  # fmt: skip
    assert checkpoints.resume_args(job) == ["--resume_from_checkpoint", "outputs/f1/checkpoint-30"]
    assert checkpoints.batch_args(job) == ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2"]
    c = ckpt(job, node, 30)
    assert checkpoints.path_for_rank0(c) == "outputs/f1/checkpoint_step30.pt"  # relative: valid on any node


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--retry", "node-lost,meteor"], "unknown failure kind 'meteor'"),
        (["--resume-template=--resume"], "must contain {checkpoint}"),
        (["--batch-template=--bs 8"], "must contain {batch}"),
        (["--batch-template=--bs {batch}"], "needs --batch N"),
        (["--max-attempts", "0"], "--max-attempts must be between 1 and 100"),
        (["--min-nodes", "3"], "--min-nodes must be between 1 and the job's 1 nodes"),
        (["--checkpoint-glob", "../../etc/*"], "without '..'"),
        (["--hang-after", "-1"], "--hang-after must be a positive number"),
    ],
)
def test_bad_recovery_options_are_one_line_errors_and_create_nothing(node, args, message):
    with pytest.raises(CommandError, match=re.escape(message)):
        call_command("launch", "--name", "bad", "--nodes", "1", "--script", "t.py", *args, stdout=io.StringIO())
    assert not Job.objects.exists()


def test_requeue_makes_the_next_attempt_once_and_keeps_the_last_ones_logs_and_curve(node):
    job = failed_job(node)
    points(job, 1, range(10, 70, 10))
    c = ckpt(job, node, 50)
    nxt = lifecycle.NextAttempt(reason="test", checkpoint=c, resume_path="outputs/f1/checkpoint_step50.pt")
    # when it is requeued twice (two clicks, or a person and the policy)
    assert lifecycle.requeue(job, nxt) is True
    assert lifecycle.requeue(Job.objects.get(pk=job.pk), nxt) is False
    job.refresh_from_db()
    # then there is one new attempt: QUEUED, attempt 2 from step 50, no ranks, the failure cleared
    assert (job.state, job.attempt, job.resume_step, job.failure_kind, job.tag) == ("queued", 2, 50, "", "")
    assert not job.ranks.exists()
    # a row of its own, the job's current: attempt 1's row is kept as it was, with its rank, not reset
    assert list(job.attempts.values_list("number", flat=True)) == [1, 2] and job.current.number == 2
    a = Attempt.objects.get(job=job, number=1)
    assert (a.number, a.state, a.last_step, a.tag, a.nodes) == (1, "failed", 60, "f1-t1", ["box"])
    assert (a.failure_kind, a.failure_node, a.finished_at is not None) == ("SCRIPT_ERROR", "box", True)
    assert [(r.index, r.exit_code, r.log_offset) for r in a.ranks.all()] == [(0, 1, 6)]
    # attempt 1's log moved (not copied) where `logs --attempt 1` reads it; nothing is left to write over
    assert (job.logs_dir / "attempt_1" / "rank_0.log").read_bytes() == b"hello\n"
    assert not (job.logs_dir / "rank_0.log").exists()
    out = io.StringIO()
    call_command("logs", "f1", "--attempt", "1", stdout=out)
    assert out.getvalue().strip() == "[rank 0] hello"
    # steps past 50 leave the curve, nothing is deleted
    assert list(MetricPoint.objects.filter(job=job, superseded=True).values_list("step", flat=True)) == [60]
    assert MetricPoint.objects.filter(job=job).count() == 6
    # a live job is not requeued
    live = Job.objects.create(name="live", script="t.py", state=Job.State.RUNNING)
    assert lifecycle.requeue(live, nxt) is False and live.attempt == 1


def test_the_policy_retries_listed_kinds_with_backoff_and_stops_on_a_crash_loop(node):
    assert [recovery.backoff_s(n) for n in (1, 2, 3, 8)] == [10.0, 20.0, 40.0, 600.0]
    job = failed_job(node, retry_on=["SCRIPT_ERROR"], max_attempts=4)
    points(job, 1, [10, 20, 30])
    ckpt(job, node, 20)
    ckpt(job, node, 30, ready=False)  # still being written: never offered
    nxt, note = recovery.decide(job)
    assert nxt.checkpoint.step == 20 and "attempt 2 of 4 from step 20" in note and "after 10s" in note
    # attempt 2 fails at the same step as attempt 1: a crash loop
    assert lifecycle.requeue(job, nxt)
    job.refresh_from_db()
    points(job, 2, [30])
    job.ranks.all().delete()
    update_jobs(Job.objects.filter(pk=job.pk), state=Job.State.FAILED, failure_kind="SCRIPT_ERROR", failure_node="box")
    job.refresh_from_db()
    nxt, note = recovery.decide(job)
    assert nxt is None and "crash loop, attempts 1 and 2 both failed at step 30" in note
    assert "ugro resume f1" in note
    # the last attempt allowed failed: the policy gives up
    Job.objects.filter(pk=job.pk).update(max_attempts=2)
    job.refresh_from_db()
    Attempt.objects.filter(job=job, number=1).update(last_step=10)  # not a crash loop
    nxt, note = recovery.decide(job)
    assert nxt is None and "gave up after 2 attempts (SCRIPT_ERROR on box)" in note
    # a kind not in the list is proposed, not retried
    other = failed_job(node, name="f2", kind="NCCL", retry_on=["OOM"])
    nxt, note = recovery.decide(other)
    assert nxt is None and "NCCL is not in the job's retry list" in note


def test_an_oom_without_a_batch_template_is_proposed_with_its_line_and_the_nodes_vram(node):
    job = failed_job(node, kind="OOM", retry_on=["OOM"], failure_line="torch.OutOfMemoryError: CUDA out of memory.")
    ckpt(job, node, 40)
    nxt, note = recovery.decide(job)
    assert nxt is None
    assert "OOM on box (8 GB VRAM): torch.OutOfMemoryError: CUDA out of memory." in note
    assert "set --batch-template" in note and "to resume from step 40: ugro resume f1" in note
    # with a template: half the batch, twice the accumulation
    Job.objects.filter(pk=job.pk).update(batch_template="--bs {batch} --ga {accum}", batch={"batch": 8, "accum": 1})
    Attempt.objects.filter(pk=job.current_id).update(batch={"batch": 8, "accum": 1})  # the failed attempt's batch
    job.refresh_from_db()
    nxt, note = recovery.decide(job)
    assert nxt.batch == {"batch": 4, "accum": 2} and "batch 4 x accum 2" in note


def test_the_hang_limit_is_five_median_intervals_or_the_floor(node):
    job = Job.objects.create(name="h", script="t.py", state=Job.State.RUNNING)
    points(job, 1, range(1, 30), gap=20.0)
    assert recovery.hang_limit(job) == (100.0, 20.0)
    job.hang_after_s = 150
    assert recovery.hang_limit(job)[0] == 150.0
    quick = Job.objects.create(name="q", script="t.py", state=Job.State.RUNNING)
    points(quick, 1, range(1, 30), gap=0.5)
    assert recovery.hang_limit(quick)[0] == 60.0


def _metricpoint_rows_read(sql: str) -> int:
    """Rows a query read from the metric points' table (scanned, kept or filtered out), by EXPLAIN ANALYZE."""
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql)
        plan = cursor.fetchone()[0]
    plan = json.loads(plan) if isinstance(plan, str) else plan

    def walk(node: dict) -> int:
        own = 0
        if node.get("Relation Name") == MetricPoint._meta.db_table:
            own = (node["Actual Rows"] + node.get("Rows Removed by Filter", 0)) * node["Actual Loops"]
        return own + sum(walk(child) for child in node.get("Plans", []))

    return walk(plan[0]["Plan"])


def test_the_hang_check_reads_a_bounded_number_of_points_however_long_the_job_ran(node):
    # given a running job with 60,000 points (3 ranks x 2 metrics) of its second attempt, and its first's
    job = Job.objects.create(name="long", script="t.py", state=Job.State.RUNNING, attempt=2,
                             running_at=timezone.now() - timedelta(hours=1))  # fmt: skip
    Rank.objects.create(job=job, node=node, index=0, state=Rank.State.RUNNING, last_contact=timezone.now())
    start = timezone.now() - timedelta(seconds=10_000)
    for attempt in (1, 2):
        save_points([Sample(job.pk, rank, step, name, 1.0 / step, start + timedelta(seconds=step), attempt)
                     for step in range(1, 10_001) for rank in range(3) for name in ("loss", "lr")])  # fmt: skip
    # when the reconciler checks it for a hang (before any ANALYZE: a growing table's statistics lag)
    with CaptureQueriesContext(connection) as queries:
        assert recovery.check_hang(job) is False
    # then it read a few hundred points at most, not every point of the job
    reads = [q["sql"] for q in queries.captured_queries if MetricPoint._meta.db_table in q["sql"]]
    assert reads and all(_metricpoint_rows_read(sql) <= 500 for sql in reads), [
        (_metricpoint_rows_read(sql), sql[:120]) for sql in reads
    ]
    # and still judged the interval on the series it logs most often (a point a second)
    assert recovery.hang_limit(job) == (60.0, 1.0)


def test_a_rank_above_the_ratio_for_three_windows_is_a_straggler(node):
    job = Job.objects.create(name="s", script="t.py", state=Job.State.RUNNING)
    for rank, value in ((0, 0.10), (1, 0.11), (2, 0.15)):
        MetricPoint.objects.bulk_create(
            MetricPoint(job=job, rank=rank, step=s, name="compute_s", value=value, time=timezone.now())
            for s in (5, 10, 15)
        )  # fmt: skip
    found = recovery.stragglers(job)
    assert [s["rank"] for s in found] == [2] and found[0]["ratio"] == pytest.approx(0.15 / 0.11)
    # two windows are not enough; one window back under the ratio clears it
    MetricPoint.objects.filter(job=job, rank=2, step=15).update(value=0.12)
    assert recovery.stragglers(job) == []


def test_resume_needs_a_complete_checkpoint_unless_from_scratch(node):
    job = failed_job(node, name="r1")
    ckpt(job, node, 30, ready=False)
    with pytest.raises(recovery.RecoveryError, match=r"no complete checkpoint to resume from \(1 still being"):
        recovery.resume(job)
    job.refresh_from_db()
    assert job.state == "failed" and job.attempt == 1 and (job.logs_dir / "rank_0.log").exists()
    recovery.resume(job, "scratch")
    job.refresh_from_db()
    assert job.attempt == 2 and job.resume_path == "" and job.resume_step is None
    assert Path(job.logs_dir / "attempt_1" / "rank_0.log").exists()


def test_the_policy_leaves_jobs_without_one_alone(node):
    from cluster.models import Alert

    plain = failed_job(node, name="plain")
    ruled = failed_job(node, name="ruled", kind="NCCL", retry_on=["OOM"])
    retries.retry_pass()
    plain.refresh_from_db()
    ruled.refresh_from_db()
    assert plain.recovery_note == "" and not Alert.objects.filter(job_name="plain").exists()
    assert "not in the job's retry list" in ruled.recovery_note
    assert Alert.objects.get(key="recovery:ruled").severity == Alert.Severity.CRITICAL


def test_a_cluster_default_policy_applies_to_jobs_that_name_none(node, monkeypatch):
    monkeypatch.setattr(recovery, "RETRY_ON", ("script-error",))
    monkeypatch.setattr(recovery, "MAX_ATTEMPTS", 2)
    job = failed_job(node, name="d1")
    ckpt(job, node, 10)
    nxt, note = recovery.decide(job)
    assert nxt is not None and "attempt 2 of 2 from step 10" in note


def test_without_step_times_a_node_far_busier_than_the_others_is_flagged(node, tmp_path):
    from cluster.models import HealthSample

    other = Node.objects.create(name="box2", address="127.0.0.2", transport="local", role="worker",
                                workdir=str(tmp_path / "wd2"), agent_python=sys.executable)  # fmt: skip
    job = Job.objects.create(name="g", script="t.py", state=Job.State.RUNNING)
    for i, n in enumerate((node, other)):
        Rank.objects.create(job=job, node=n, index=i, state=Rank.State.RUNNING)
    points(job, 1, [5, 10, 15])  # a loss, but no compute_s
    HealthSample.objects.create(node=node, time=timezone.now(), gpu_util_percent=97.0)
    HealthSample.objects.create(node=other, time=timezone.now(), gpu_util_percent=41.0)
    found = recovery.stragglers(job)
    assert [s["node"].name for s in found] == ["box"] and "GPU util 97%" in found[0]["message"]
    HealthSample.objects.create(node=other, time=timezone.now() + timedelta(seconds=1), gpu_util_percent=90.0)
    assert recovery.stragglers(job) == []


def test_a_node_lost_retry_without_min_nodes_waits_queued_for_the_node_and_starts_once_it_answers(
    node, monkeypatch, client, django_user_model
):
    monkeypatch.setattr(recovery, "RETRY_BACKOFF_S", 0.0)
    monkeypatch.setattr(links, "CONNECT_TIMEOUT_S", 2.0)
    from jobs.scheduler import place

    # given a job that lost node "gone" (nothing listens on its port) and may be retried after a lost node
    gone = Node.objects.create(name="gone", address="127.0.0.1", ssh_port=1, role="worker", status="down",
                               workdir="/nonexistent")  # fmt: skip
    job = failed_job(node, name="w1", kind="NODE_LOST", retry_on=["NODE_LOST"], max_attempts=2)
    update_jobs(Job.objects.filter(pk=job.pk), failure_node="gone")
    Rank.objects.create(job=job, node=gone, index=1, state=Rank.State.LOST, active=False, lost_reason="gone")
    job.refresh_from_db()
    points(job, 1, [10, 20, 30])
    ckpt(job, gone, 20)  # the latest checkpoint is on the lost node
    # when the policy acts (decides, then requeues once the backoff is over)
    retries.retry_pass([job.pk])
    retries.retry_pass([job.pk])
    job.refresh_from_db()
    # then it is QUEUED as attempt 2 from the checkpoint on the lost node, waiting for that node
    assert (job.state, job.attempt, job.wait_nodes, job.resume_step) == ("queued", 2, ["gone"], 20)
    assert "once gone is back" in job.recovery_note, job.recovery_note
    assert Attempt.objects.get(job=job, number=1).failure_kind == "NODE_LOST"
    # and the scheduler does not start it on the node that is free, and every view says why it waits
    assert place(job) is False and job.state == "queued"
    out = io.StringIO()
    call_command("queue", stdout=out)
    line = next(li for li in out.getvalue().splitlines() if " w1 " in li)
    assert re.search(r"\bnode\s+unknown\s+waiting for node gone to come back$", line), line
    out = io.StringIO()
    call_command("status", "w1", stdout=out)
    assert "waiting: for node gone to come back" in out.getvalue()
    client.force_login(django_user_model.objects.create_user("alice", password="x" * 12))
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert 'id="queue-reason"' in page and "Waiting for node gone to come back" in page
    # a node that still does not answer keeps it waiting, pass after pass
    assert retries.release_waits() == [] and retries.retry_pass() == []
    job.refresh_from_db()
    assert job.wait_nodes == ["gone"] and job.attempt == 2

    # when the node answers again (here: it becomes reachable as a local node)
    Node.objects.filter(pk=gone.pk).update(transport="local", agent_python=sys.executable, workdir=node.workdir)
    assert retries.release_waits() == ["w1:gone"]
    job.refresh_from_db()
    # then it waits for nothing, the monitor probed the node (no longer DOWN) and the scheduler starts it
    assert job.wait_nodes == [] and Node.objects.get(pk=gone.pk).status != "down"
    assert place(job) is True and job.state == "starting" and job.attempt == 2

    # and the attempts count: attempt 2 of 2 lost a node again -> the policy gives up, nothing is queued
    Rank.objects.filter(job=job).update(state=Rank.State.LOST, active=False)
    update_jobs(Job.objects.filter(pk=job.pk), state="failed", failure_kind="NODE_LOST", failure_node="gone")
    job.refresh_from_db()
    nxt, note = recovery.decide(job)
    assert nxt is None and "gave up after 2 attempts (NODE_LOST on gone)" in note


def test_a_node_lost_retry_with_enough_nodes_left_runs_without_the_node_and_waits_for_nothing(node):
    gone = Node.objects.create(name="gone", address="127.0.0.1", ssh_port=1, role="worker", workdir="/x")
    job = failed_job(node, name="m1", kind="NODE_LOST", retry_on=["NODE_LOST"], min_nodes=1)
    update_jobs(Job.objects.filter(pk=job.pk), failure_node="gone")
    Rank.objects.create(job=job, node=gone, index=1, state=Rank.State.LOST, active=False)
    job.refresh_from_db()
    ckpt(job, gone, 30)  # on the lost node: not usable without it
    ckpt(job, node, 20)
    far = Node.objects.create(name="far", address="127.0.0.1", ssh_port=1, role="worker", status="down", workdir="/y")
    ckpt(job, far, 40)  # an earlier attempt's, on a node that is DOWN now: not usable either
    nxt, note = recovery.decide(job)
    assert nxt.nodes == ["box"] and nxt.wait_nodes == [] and nxt.checkpoint.step == 20
    assert "on box (without gone)" in note
    # with too few nodes left it waits for the lost one instead
    Job.objects.filter(pk=job.pk).update(min_nodes=2)
    job.refresh_from_db()
    nxt, note = recovery.decide(job)
    # (from the latest checkpoint there is once it is back: not the one on "far", which it does not wait for)
    assert nxt.nodes is None and nxt.wait_nodes == ["gone"] and nxt.checkpoint.step == 30
    # a launch that could not reach a node (nothing started, no rank LOST) waits for the node it named
    Rank.objects.filter(job=job).update(state=Rank.State.PENDING)
    nxt, note = recovery.decide(job)
    assert nxt.wait_nodes == ["gone"] and "once gone is back" in note


def test_a_job_with_earlier_attempts_is_deleted_whole(node):
    # given a job on its second attempt, started from a checkpoint, its first attempt's rank kept
    job = failed_job(node)
    c = ckpt(job, node, 50)
    assert lifecycle.requeue(job, lifecycle.NextAttempt(reason="test", checkpoint=c, resume_path="x.pt"))
    assert Attempt.objects.filter(job=job).count() == 2 and Rank.objects.filter(job=job).count() == 1
    # when it is deleted (the admin can), its attempts, ranks and checkpoints go with it
    Job.objects.filter(pk=job.pk).delete()
    assert not Attempt.objects.exists() and not Rank.objects.exists() and not Checkpoint.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_decision_whose_alert_could_not_be_opened_is_not_kept_and_is_made_again(node, monkeypatch):
    from cluster.models import Alert

    # given a newly failed job whose policy would retry it
    job = failed_job(node, retry_on=["SCRIPT_ERROR"], max_attempts=3)
    opened = retries.open_alert

    def dies(*args, **kwargs):
        raise RuntimeError("the worker died here")

    # when the worker dies after deciding, before the alert is opened
    monkeypatch.setattr(retries, "open_alert", dies)
    with pytest.raises(RuntimeError):
        retries._decide(Job.objects.get(pk=job.pk))
    # then the decision was not kept either, so the next pass makes it again, and tells it
    assert Job.objects.get(pk=job.pk).recovery_note == ""
    monkeypatch.setattr(retries, "open_alert", opened)
    retries._decide(Job.objects.get(pk=job.pk))
    assert "retry" in Job.objects.get(pk=job.pk).recovery_note
    assert Alert.objects.filter(key="recovery:f1", resolved_at__isnull=True).exists()
