"""Following the metric files a job names (Lightning's metrics.csv, TensorBoard event files) on a real
sshd node through the node agent, from byte offsets kept in the DB: nothing lost, nothing repeated."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from django.utils import timezone

from cluster.fanout import node_request
from jobs.models import Job, Rank
from metrics import files
from metrics.files import events_points, follow_metric_files
from metrics.models import JobMetrics, MetricFile, MetricPoint

pytestmark = [pytest.mark.e2e, pytest.mark.no_test_worker]  # each test follows its job's files itself

CORPUS = Path(__file__).parent / "data" / "frameworks" / "lightning_tqdm" / "lightning_logs"


@pytest.fixture
def job_on_node1(lab, monkeypatch):
    from cluster.models import Node

    monkeypatch.setattr(files, "SCAN_EVERY_S", 0.0)
    node = Node.objects.get(name="node1")
    job = Job.objects.create(name="files1", script="x.py", state=Job.State.RUNNING, running_at=timezone.now())
    Rank.objects.create(job=job, node=node, index=0, state=Rank.State.RUNNING)
    JobMetrics.objects.create(job=job, files=["logs_{job}"])
    workdir = Path(node.workdir)
    shutil.rmtree(workdir / "logs_files1", ignore_errors=True)
    (workdir / "logs_files1" / "version_0").mkdir(parents=True)
    return job, workdir / "logs_files1"


def follow(job: Job) -> list[tuple[int, str, float]]:
    ranks = list(job.ranks.select_related("node"))
    return sorted((p.step, p.name, p.value) for p in follow_metric_files(job, ranks, node_request))


def stored(job: Job) -> list[tuple[int, str, float]]:
    return sorted(MetricPoint.objects.filter(job=job).values_list("step", "name", "value"))


def test_csv_is_followed_by_whole_lines_and_a_rewritten_header_repeats_nothing(job_on_node1):
    """Covers: a CSV followed through a real agent over SSH from offsets kept in the database: whole lines only, a
    rewritten header repeating nothing.
    """
    job, logs = job_on_node1
    csv_file = logs / "version_0" / "metrics.csv"
    # given Lightning has written a header, two rows and half of a third
    csv_file.write_bytes(b"epoch,step,train_loss\r\n0,4,0.75\r\n0,9,0.86\r\n0,14,2.3")
    # when followed, the whole rows are taken, found under the directory the job named
    assert follow(job) == [(4, "epoch", 0.0), (4, "train_loss", 0.75), (9, "epoch", 0.0), (9, "train_loss", 0.86)]
    mf = MetricFile.objects.get(job=job)
    assert mf.path.endswith("/logs_files1/version_0/metrics.csv") and mf.kind == "csv" and mf.records == 2
    # then the row completes and another follows: only they are new
    csv_file.write_bytes(b"epoch,step,train_loss\r\n0,4,0.75\r\n0,9,0.86\r\n0,14,2.33\r\n0,19,0.21\r\n")
    assert follow(job) == [(14, "epoch", 0.0), (14, "train_loss", 2.33), (19, "epoch", 0.0), (19, "train_loss", 0.21)]
    # when a new metric makes Lightning rewrite the file with a wider header
    csv_file.write_bytes(
        b"epoch,step,train_loss,val_loss\r\n0,4,0.75,\r\n0,9,0.86,\r\n0,14,2.33,\r\n0,19,0.21,\r\n0,19,,0.08\r\n"
    )
    # then only the new row's value is taken (its 'epoch' at step 19 is already there)
    assert follow(job) == [(19, "val_loss", 0.08)]
    assert follow(job) == []
    assert len(stored(job)) == len(set((s, n) for s, n, _ in stored(job))) == 9
    assert (job.job_dir / "metrics.jsonl").read_text().count("\n") == 9


def test_tensorboard_events_are_read_with_tensorboards_reader_record_by_record(job_on_node1):
    """Covers: a TensorBoard event file read through a real agent record by record, a half-written record taken once
    whole, across a controller restart.
    """
    job, logs = job_on_node1
    recorded = next((CORPUS / "version_1").glob("events.out.tfevents.*"))
    data = recorded.read_bytes()
    events = logs / "version_1" / recorded.name
    events.parent.mkdir()
    # given the writer has flushed the file up to the middle of a record
    events.write_bytes(data[: len(data) // 2])
    first = follow(job)
    # when the controller restarts elsewhere (no copy of the file in its job directory)
    files._scanned.clear()
    shutil.rmtree(job.job_dir / "metric_files")
    # and the rest is written and followed
    events.write_bytes(data)
    second = follow(job)
    # then together they are every scalar of the file once, the half record taken when it was whole
    whole = {(s, n): v for s, n, v in events_points(recorded, 0)[0]}
    assert first and second
    assert sorted(first + second) == sorted((s, n, v) for (s, n), v in whole.items())
    assert follow(job) == []
    assert MetricFile.objects.get(job=job).offset == len(data)
