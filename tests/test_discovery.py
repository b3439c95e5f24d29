"""Finding what a run writes without being told where: the node agent's bounded `discover` walk (a real agent
process), and what the controller adopts of it (metric files, checkpoints)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from django.utils import timezone

from cluster.links import Endpoint, NodeLink
from cluster.models import Node
from jobs import checkpoints
from jobs.models import Checkpoint, Job, Rank
from metrics import files
from metrics.models import MetricFile

from .jobrows import update_jobs


@pytest.fixture
def agent():
    link = NodeLink(Endpoint(name="local-agent", address="127.0.0.1", transport="local"), connect_timeout=10)
    yield link
    link.close()


def touch(path: Path, data: bytes = b"x", age_s: float = 0.0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    if age_s:
        then = time.time() - age_s
        os.utime(path, (then, then))
    return path


def walk(link, root: Path, since: float, **bounds) -> dict:
    return link.request("discover", timeout=10, root=str(root), since=since, **bounds)


def test_the_walk_finds_what_the_run_wrote_and_nothing_older_hidden_or_cached(agent, tmp_path):
    # given a workdir holding an earlier run's files and this run's
    touch(tmp_path / "lightning_logs" / "version_0" / "metrics.csv", age_s=3600)
    touch(tmp_path / "outputs" / "old" / "checkpoint-5" / "trainer_state.json", age_s=3600)
    os.utime(tmp_path / "outputs" / "old" / "checkpoint-5", (time.time() - 3600,) * 2)
    since = time.time() - 1
    new = {
        touch(tmp_path / "lightning_logs" / "version_1" / "metrics.csv"),
        touch(tmp_path / "lightning_logs" / "version_1" / "events.out.tfevents.1.host.1.0"),
        touch(tmp_path / "lightning_logs" / "version_1" / "checkpoints" / "epoch=1-step=300.ckpt"),
        touch(tmp_path / "my_run" / "runs" / "Nov26_host" / "events.out.tfevents.2.host.2.0"),
        touch(tmp_path / "ckpt" / "model_step_120.safetensors"),
    }
    hf = tmp_path / "my_run" / "checkpoint-100"
    touch(hf / "trainer_state.json")
    touch(hf / "model.safetensors", b"w" * 1000)
    touch(tmp_path / ".git" / "metrics.csv")  # hidden: never entered
    touch(tmp_path / "__pycache__" / "x_step_1.pt")  # a cache: never entered
    # when the node walks it
    answer = walk(agent, tmp_path, since)
    # then this run's metric files and checkpoint candidates are found, each once; an HF checkpoint whole
    assert answer["complete"] is True
    by_path = {e["path"]: e for e in answer["entries"]}
    assert set(by_path) == {str(p) for p in new} | {str(hf)}
    assert by_path[str(hf)]["dir"] and by_path[str(hf)]["trainer_state"] and by_path[str(hf)]["size"] >= 1001
    assert by_path[str(hf)]["files"] == 2
    kinds = {Path(p).name: e["kind"] for p, e in by_path.items()}
    assert kinds["metrics.csv"] == "metrics" and kinds["epoch=1-step=300.ckpt"] == "checkpoint"


def test_a_workdir_with_many_files_costs_a_bounded_walk_and_new_directories_come_first(agent, tmp_path):
    # given a dataset directory of 3000 old files and, beside it, the run's new log directory
    data = tmp_path / "data"
    data.mkdir()
    for i in range(3000):
        (data / f"{i:05d}.jpg").write_bytes(b"")
    then = time.time() - 3600
    os.utime(data, (then, then))
    since = time.time() - 1
    csv = touch(tmp_path / "zzz_logs" / "version_0" / "metrics.csv")
    # when the walk may read 200 entries only
    answer = walk(agent, tmp_path, since, max_entries=200)
    # then it stops at its bound (says so), having reached the newest directory first
    assert answer["complete"] is False
    assert [e["path"] for e in answer["entries"]] == [str(csv)]
    # and a depth bound holds too
    deep = touch(tmp_path / "a" / "b" / "c" / "d" / "metrics.csv")
    found = {e["path"] for e in walk(agent, tmp_path, since, max_depth=2)["entries"]}
    assert str(deep) not in found
    assert str(deep) in {e["path"] for e in walk(agent, tmp_path, since, max_depth=4)["entries"]}


def test_the_ranks_start_on_the_nodes_own_clock_decides_what_is_new(agent, tmp_path):
    # given a checkpoint an earlier run saved a moment (0.5 s) before this rank started, by the node's clock
    earlier = touch(tmp_path / "outputs" / "gone" / "checkpoint_step60.pt", age_s=0.5)
    record = tmp_path / "rank0.start"
    record.write_text(f'{{"state": "started", "started": {time.time()}}}')
    mine = touch(tmp_path / "outputs" / "now" / "checkpoint_step20.pt")
    # when the walk is asked with a controller clock 2 s behind (a slack for clock differences) and the record
    found = {e["path"] for e in walk(agent, tmp_path, time.time() - 2, record=str(record))["entries"]}
    # then only what this rank wrote is found; without the record, the slack would have taken the earlier one
    assert found == {str(mine)}
    assert str(earlier) in {e["path"] for e in walk(agent, tmp_path, time.time() - 2)["entries"]}
    # and a record that is missing or not a start yet leaves the given time
    assert len(walk(agent, tmp_path, time.time() - 2, record=str(tmp_path / "none"))["entries"]) == 2


def test_a_missing_workdir_finds_nothing(agent, tmp_path):
    assert walk(agent, tmp_path / "nope", 0)["entries"] == []


@pytest.fixture
def rank(db, tmp_path):
    node = Node.objects.create(name="gpu1", address="127.0.0.9", workdir=str(tmp_path))
    job = Job.objects.create(name="disc", script="x.py", state=Job.State.RUNNING, started_at=timezone.now())
    return Rank.objects.create(job=job, node=node, index=0, state=Rank.State.RUNNING)


def entry(path: str, kind: str, **more) -> dict:
    return {"path": path, "kind": kind, "dir": False, "size": 10, "mtime": 1.0, **more}


def test_found_metric_files_are_followed_once_and_another_running_jobs_are_left_to_it(rank, tmp_path):
    other = Job.objects.create(name="other", script="y.py", state=Job.State.RUNNING)
    MetricFile.objects.create(job=other, rank=0, path=f"{tmp_path}/theirs/metrics.csv", kind="csv")
    found = [
        entry(f"{tmp_path}/lightning_logs/version_3/metrics.csv", "metrics"),
        entry(f"{tmp_path}/lightning_logs/version_3/events.out.tfevents.1.h.1.0", "metrics"),
        entry(f"{tmp_path}/theirs/metrics.csv", "metrics"),
        entry(f"{tmp_path}/ck/epoch=0-step=9.ckpt", "checkpoint"),
    ]
    assert files.adopt(rank.job, rank, found) == 2
    assert files.adopt(rank.job, rank, found) == 0  # the next walk finds the same: nothing new
    mine = dict(MetricFile.objects.filter(job=rank.job).values_list("path", "kind"))
    assert mine == {found[0]["path"]: "csv", found[1]["path"]: "tfevents"}
    # and a finished job's file is no claim (a rerun rewrote it since this job started)
    update_jobs(Job.objects.filter(pk=other.pk), state=Job.State.SUCCEEDED, finished_at=timezone.now())
    assert files.adopt(rank.job, rank, found) == 1


def test_found_checkpoints_need_a_step_in_their_name_or_a_framework_shape(rank, tmp_path):
    found = [
        {**entry(f"{tmp_path}/run/checkpoint-100", "checkpoint", dir=True, trainer_state=True), "files": 3},
        {**entry(f"{tmp_path}/run/checkpoint-200", "checkpoint", dir=True, trainer_state=False), "files": 1},
        entry(f"{tmp_path}/lightning_logs/version_0/checkpoints/epoch=1-step=300.ckpt", "checkpoint"),
        entry(f"{tmp_path}/lightning_logs/version_0/checkpoints/last.ckpt", "checkpoint"),
        entry(f"{tmp_path}/ck/model_step_50.safetensors", "checkpoint"),
        entry(f"{tmp_path}/model.pt", "checkpoint"),  # no step: anything the run saves
        entry(f"{tmp_path}/data/train.bin", "checkpoint"),
        entry(f"{tmp_path}/logs/metrics.csv", "metrics"),
    ]
    checkpoints.record_found(rank, found)
    recorded = {Path(c.path).name: c.step for c in Checkpoint.objects.filter(job=rank.job)}
    assert recorded == {"checkpoint-100": 100, "checkpoint-200": 200, "epoch=1-step=300.ckpt": 300,
                        "last.ckpt": None, "model_step_50.safetensors": 50}  # fmt: skip
    # when the next walk finds them unchanged: complete ones are offered, newest step first
    checkpoints.record_found(rank, found)
    assert [c.step for c in checkpoints.offered(rank.job)] == [300, 100, 50]


def test_a_bars_values_keep_their_time_until_the_frameworks_file_replaces_them(rank, tmp_path):
    import base64

    from metrics.ingest import RankStream, parse_lines, save_points
    from metrics.models import MetricPoint
    from metrics.series import series

    job = rank.job
    # given Lightning's bar showed train_loss twice (the batch in an epoch, not the step)
    stream = RankStream()
    bar = "Epoch 0:  {}%|##| {}/20 [00:01<00:01, 9.9it/s, v_num=0, train_loss={}]"
    lines = [bar.format(25, 5, "0.91"), bar.format(50, 10, "0.52")]
    points, _ = parse_lines(job.pk, 0, lines, stream, timezone.now())
    save_points(points)
    # then they are stored with no step, and the chart gets them by time
    assert list(MetricPoint.objects.filter(job=job).values_list("step", "value")) == [(None, 0.91), (None, 0.52)]
    drawn = series(job.pk, "train_loss", with_time=True)
    assert drawn["by_time"] is True and drawn["ranks"]["0"]["y"] == [0.91, 0.52]
    assert drawn["ranks"]["0"]["x"] == drawn["times"]["0"] and drawn["total_points"] == 2
    # when the walk finds the framework's metrics.csv and it is read
    path = f"{tmp_path}/lightning_logs/version_0/metrics.csv"
    files.adopt(job, rank, [entry(path, "metrics")])
    data = b"epoch,step,train_loss\n0,4,0.9132\n0,9,0.5187\n"

    def request(node, op, **kwargs):
        assert op == "tail"
        return {"files": [{"key": f["key"], "size": len(data), "data": base64.b64encode(data[f["offset"]:]).decode()}
                          for f in kwargs["files"]]}  # fmt: skip

    files.follow_metric_files(job, [rank], request)
    # then the file's values at Lightning's steps replace the bar's: one series, nothing twice
    assert sorted(MetricPoint.objects.filter(job=job, name="train_loss").values_list("step", "value")) == [
        (4, 0.9132), (9, 0.5187)]  # fmt: skip
    assert "by_time" not in series(job.pk, "train_loss")
    # and a follower configured from now on takes no more values from the bar
    later = RankStream()
    assert parse_lines(job.pk, 0, [bar.format(75, 15, "0.33")], later, timezone.now())[0] == []


def test_an_ended_jobs_checkpoint_found_within_the_clock_slack_stays_its_own(rank, tmp_path):
    node = rank.node
    before = Job.objects.create(name="before", script="x.py", state=Job.State.SUCCEEDED, finished_at=timezone.now())
    path = f"{tmp_path}/ckpt/checkpoint_step100.pt"
    Checkpoint.objects.create(job=before, node=node, path=path, size=10, mtime=1.0, step=100, ready=True)
    # the walk of a job that started a second after it ended finds that file, unchanged
    checkpoints.record_found(rank, [entry(path, "checkpoint")])
    assert not Checkpoint.objects.filter(job=rank.job).exists()
    # a later run that rewrote it makes it this job's
    checkpoints.record_found(rank, [entry(path, "checkpoint", mtime=2.0)])
    assert Checkpoint.objects.filter(job=rank.job, path=path).exists()


def test_another_jobs_own_directory_is_that_jobs(rank, tmp_path):
    Job.objects.create(name="other", script="x.py", state=Job.State.FAILED, finished_at=timezone.now())
    found = [entry(f"{tmp_path}/outputs/other/checkpoint_step60.pt", "checkpoint"),
             entry(f"{tmp_path}/outputs/other/lightning_logs/version_0/metrics.csv", "metrics"),
             entry(f"{tmp_path}/outputs/disc/checkpoint_step20.pt", "checkpoint")]  # fmt: skip
    checkpoints.record_found(rank, found)
    assert files.adopt(rank.job, rank, found) == 0
    assert list(Checkpoint.objects.filter(job=rank.job).values_list("step", flat=True)) == [20]


def test_a_job_without_metric_files_asks_the_nodes_nothing(db, tmp_path):
    node = Node.objects.create(name="node1", address="127.0.0.9", workdir=str(tmp_path))
    job = Job.objects.create(name="nofiles", script="x.py", state=Job.State.RUNNING)
    rank = Rank.objects.create(job=job, node=node, index=0, state=Rank.State.RUNNING)

    def request(*args, **kwargs):
        raise AssertionError("no request expected")

    assert files.follow_metric_files(job, [rank], request) == []
