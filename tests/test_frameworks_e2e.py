"""End to end: a real PyTorch Lightning job under UGRO on loopback sshd nodes with real torchrun, unmodified, and
the curves, steps and checkpoints UGRO records of it (a real Hugging Face Trainer's: tests/test_recovery_e2e.py,
where one crashes and resumes)."""

from __future__ import annotations

import csv
import io
import shutil
from pathlib import Path

import pytest
from django.core.management import call_command

from jobs import checkpoints
from jobs.models import Job
from metrics.files import events_points
from metrics.models import JobMetrics, MetricPoint

pytestmark = pytest.mark.e2e

FRAMEWORKS = Path(__file__).parent / "data" / "frameworks"


@pytest.fixture
def framework_lab(lab):
    """The lab, with the framework scripts in each node's working directory."""
    for node in lab.nodes[:3]:
        target = node.workdir / "frameworks"
        target.mkdir(exist_ok=True)
        for script in FRAMEWORKS.glob("*.py"):
            shutil.copy(script, target / script.name)
    return lab


def launch(*args: str) -> str:
    out = io.StringIO()
    call_command("launch", *args, stdout=out)
    return out.getvalue()


def curve(job: Job, name: str) -> dict[int, list[int]]:
    """rank -> steps of one metric."""
    out: dict[int, list[int]] = {}
    for rank, step in MetricPoint.objects.filter(job=job, name=name).order_by("step").values_list("rank", "step"):
        out.setdefault(rank, []).append(step)
    return out


def test_lightning_as_people_run_it_gets_every_logged_step_and_its_checkpoint_with_no_flags(framework_lab):
    """Covers: an unmodified Lightning run on two nodes whose TensorBoard file UGRO finds by itself and reads through
    the node agent, and its checkpoint recorded; the corpus tests read recorded files only.
    """
    # given an unmodified Lightning script with Lightning's own defaults: its TensorBoard logger (tensorboard is
    # installed) under lightning_logs/version_N and its ModelCheckpoint, in a workdir other runs wrote to before
    # when it runs on two nodes for 2 epochs of 20 batches, logging every 5, and UGRO is told nothing
    launch("--name", "lt1", "--nodes", "2", "--script", "frameworks/lightning_train.py",
           "--", "--bar", "tqdm", "--epochs", "2", "--batches", "20", "--log-every", "5",
           "--loggers", "default")  # fmt: skip
    job = Job.objects.get(name="lt1")
    assert job.state == Job.State.SUCCEEDED, job.failure_reason
    # then train_loss and val_loss are every logged value at Lightning's own steps, once each, found by
    # themselves (the bar's rounded copies at "epoch x 20 + N" are not stored)
    train = curve(job, "train_loss")
    assert len(train) == 1, train
    (rank,) = train
    assert train[rank] == [4, 9, 14, 19, 24, 29, 34, 39]
    assert curve(job, "val_loss") == {rank: [19, 39]}
    assert not MetricPoint.objects.filter(job=job, name="v_num").exists()
    assert not MetricPoint.objects.filter(job=job, step__isnull=True).exists()  # the bar's went when the file came
    (events,) = job.metric_files.values_list("path", flat=True)
    node = job.ranks.get(index=rank).node
    assert events.startswith(f"{node.workdir}/lightning_logs/version_") and "tfevents" in events
    logged = {s: v for s, n, v in events_points(Path(events), 0)[0] if n == "train_loss"}
    stored = dict(MetricPoint.objects.filter(job=job, name="train_loss").values_list("step", "value"))
    assert stored == logged
    # and Lightning's checkpoint is recorded at its step, ready for a resume
    (ckpt,) = checkpoints.offered(job)
    assert ckpt.step == 40 and ckpt.path.endswith("/checkpoints/epoch=1-step=40.ckpt") and ckpt.node == node
    # and the bar's counter still gave the progress: 2 epochs x 20 batches
    assert JobMetrics.objects.get(job=job).step == 40


def test_lightning_with_a_named_metrics_file_reads_only_it(framework_lab):
    """Covers: --metrics-file naming a directory that a real Lightning run fills with a CSV and a TensorBoard file, each
    read once; following each kind of file on a node is tests/test_metric_files.py's.
    """
    # given a Lightning script logging to CSV and TensorBoard under outputs/<job>, named at launch
    launch("--name", "lt2", "--nodes", "1", "--script", "frameworks/lightning_train.py",
           "--metrics-file", "outputs/{job}",
           "--", "--bar", "rich", "--epochs", "1", "--batches", "10", "--log-every", "5",
           "--log-dir", "outputs/lt2")  # fmt: skip
    job = Job.objects.get(name="lt2")
    assert job.state == Job.State.SUCCEEDED, job.failure_reason
    # then the values are the CSV's and the TensorBoard file's, once each, at Lightning's steps
    assert curve(job, "train_loss") == {0: [4, 9]}
    node = job.ranks.get(index=0).node
    (csv_path,) = (Path(node.workdir) / "outputs" / "lt2").rglob("metrics.csv")
    rows = list(csv.DictReader(csv_path.open()))
    logged = {int(row["step"]): float(row["train_loss"]) for row in rows if row["train_loss"]}
    assert dict(MetricPoint.objects.filter(job=job, name="train_loss").values_list("step", "value")) == logged
    assert set(job.metric_files.values_list("kind", flat=True)) == {"csv", "tfevents"}
