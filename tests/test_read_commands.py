"""The read commands: `status` as a table of recent jobs, and `--json` on status, queue, results, alerts, logs."""

from __future__ import annotations

import io
import json
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.utils import timezone

from cluster.alerts import open_alert
from cluster.models import Node
from jobs.models import Job, Rank
from metrics.models import JobMetrics, MetricPoint

from .jobrows import update_jobs

pytestmark = pytest.mark.django_db


def run(*args) -> str:
    out = io.StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


@pytest.fixture
def jobs(settings, tmp_path):
    """A running job a quarter done (alice's, on two nodes), a finished one, and a queued one."""
    settings.JOBS_DIR = tmp_path / "jobs"
    alice = get_user_model().objects.create_user("alice")
    n1 = Node.objects.create(name="gpu1", address="10.0.0.1", gpu_count=0)
    n2 = Node.objects.create(name="gpu2", address="10.0.0.2", gpu_count=0)
    now = timezone.now()
    running = Job.objects.create(name="exp1", script="train.py", state=Job.State.RUNNING, owner=alice,
                                 created_at=now - timedelta(minutes=12), started_at=now - timedelta(minutes=11),
                                 running_at=now - timedelta(minutes=10))  # fmt: skip
    r0 = Rank.objects.create(job=running, node=n1, index=0, state=Rank.State.RUNNING)
    Rank.objects.create(job=running, node=n2, index=1, state=Rank.State.RUNNING)
    JobMetrics.objects.create(job=running, step=30, total_steps=120)
    MetricPoint.objects.create(job=running, rank=0, name="loss", step=30, value=2.5, time=now)
    # two committed log lines of rank 0 (the central copy the follower writes)
    log = r0.local_log
    log.parent.mkdir(parents=True)
    log.write_bytes(b'{"step": 1, "loss": 3.1}\n<b>done</b>\n')
    Rank.objects.filter(pk=r0.pk).update(log_offset=log.stat().st_size, log_lines=2)
    done = Job.objects.create(name="exp0", script="train.py", state=Job.State.SUCCEEDED,
                              created_at=now - timedelta(hours=3), started_at=now - timedelta(hours=3),
                              running_at=now - timedelta(hours=3), finished_at=now - timedelta(hours=2))  # fmt: skip
    Rank.objects.create(job=done, node=n1, index=0, state=Rank.State.EXITED, exit_code=0, active=False)
    Job.objects.create(name="exp2", script="train.py", requested_count=2, created_at=now - timedelta(seconds=5))
    return running


def test_status_without_a_name_is_a_table_of_recent_jobs(jobs):
    lines = run("status").splitlines()
    header = lines[0].split()
    assert header == ["JOB", "STATE", "PROGRESS", "NODES", "AGE", "OWNER"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["exp1"] == ["exp1", "running", "25.0%", "gpu1,gpu2", "12m", "alice"]
    assert rows["exp0"][1:2] == ["succeeded"] and rows["exp0"][-2:] == ["3h", "-"]
    assert rows["exp2"] == ["exp2", "queued", "-", "2", "nodes", "5s", "-"]
    # newest first
    assert [line.split()[0] for line in lines[1:]] == ["exp2", "exp1", "exp0"]


def test_status_json_lists_jobs_and_details_one(jobs):
    data = json.loads(run("status", "--json"))
    by_name = {j["name"]: j for j in data["jobs"]}
    assert by_name["exp1"]["progress"] == 0.25 and by_name["exp1"]["owner"] == "alice"
    assert by_name["exp1"]["nodes"] == ["gpu1", "gpu2"] and by_name["exp2"]["state"] == "queued"
    one = json.loads(run("status", "exp1", "--json"))
    assert [(r["rank"], r["node"], r["state"]) for r in one["ranks"]] == [
        (0, "gpu1", "running"),
        (1, "gpu2", "running"),
    ]
    assert one["step"] == 30 and one["max_steps"] == 120 and one["failure"] is None


def test_status_json_of_a_failed_job_still_exits_1_with_one_line(jobs):
    update_jobs(
        Job.objects.filter(name="exp0"), state=Job.State.FAILED, failure_kind="OOM", failure_reason="OOM on rank 0"
    )
    out = io.StringIO()
    with pytest.raises(CommandError, match="job exp0 failed: OOM on rank 0"):
        call_command("status", "exp0", "--json", stdout=out)
    assert json.loads(out.getvalue())["failure"]["kind"] == "OOM"


def test_queue_results_alerts_and_logs_speak_json(jobs):
    queue = json.loads(run("queue", "--json"))["queue"]
    assert [(q["position"], q["name"]) for q in queue] == [(1, "exp2")]
    results = json.loads(run("results", "exp1", "--json"))
    assert results["final_loss"] == {"rank": 0, "value": 2.5, "step": 30} and results["checkpoints"] == []
    assert results["logs"]["0"].endswith("rank_0.log")
    open_alert(Node.objects.get(name="gpu2"), "ram", "warning", "RAM 92 % used")
    (alert,) = json.loads(run("alerts", "--json"))["alerts"]
    assert (alert["node"], alert["severity"], alert["message"], alert["open"]) == (
        "gpu2",
        "warning",
        "RAM 92 % used",
        True,
    )
    lines = [json.loads(x) for x in run("logs", "exp1", "--json").splitlines()]
    # text is carried as it was written (a consumer escapes it), one object per line
    assert [(x["rank"], x["text"]) for x in lines] == [(0, '{"step": 1, "loss": 3.1}'), (0, "<b>done</b>")]


def test_empty_json_answers_are_still_json(db):
    assert json.loads(run("status", "--json")) == {"jobs": []}
    assert json.loads(run("queue", "--json")) == {"queue": [], "holding": {}}
    assert json.loads(run("alerts", "--json")) == {"alerts": []}


def test_bad_input_is_one_line_and_changes_nothing(jobs):
    for args, message in [(("results", "ghost", "--json"), "no job named 'ghost'"),
                          (("status", "--limit", "0"), "--limit must be at least 1"),
                          (("alerts", "--limit", "0"), "--limit must be at least 1")]:  # fmt: skip
        with pytest.raises(CommandError, match=message):
            call_command(*args, stdout=io.StringIO())


def test_reading_commands_fail_with_one_line_for_unknown_jobs(db):
    for cmd in ("status", "logs", "results", "cancel"):
        with pytest.raises(CommandError, match="no job named 'ghost'"):
            call_command(cmd, "ghost", stdout=io.StringIO())


def test_status_and_results_agree_on_every_field_they_share(jobs, monkeypatch):
    # given a finished job whose bar reached 300 of 300, seen at one fixed moment (age_s is computed per call)
    from django.contrib.auth.models import Group
    from django.test import Client

    now = timezone.now()
    monkeypatch.setattr(timezone, "now", lambda: now)
    done = Job.objects.get(name="exp0")
    JobMetrics.objects.create(job=done, step=300, total_steps=300)
    # when status and results answer as JSON, through manage.py
    status, results = json.loads(run("status", "exp0", "--json")), json.loads(run("results", "exp0", "--json"))
    # then every field status shows is in results with the same value
    assert (status["progress"], status["step"], status["max_steps"]) == (1.0, 300, 300)
    assert {k: results.get(k, "missing") for k in status} == status
    # and through the API the `ugro` client reads (`lines`: each command's own text)
    viewer = get_user_model().objects.create_user("bob")
    viewer.groups.add(Group.objects.get(name="launcher"))
    client = Client()
    client.force_login(viewer)
    status = client.get("/api/v1/jobs/exp0/").json()
    results = client.get("/api/v1/jobs/exp0/results").json()
    assert (status["progress"], status["step"], status["max_steps"]) == (100.0, 300, 300)
    shared = {k: v for k, v in status.items() if k != "lines"}
    assert {k: results.get(k, "missing") for k in shared} == shared
