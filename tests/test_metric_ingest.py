"""Ingestion as followers do it: a new follower mid-run (CLI watcher, restarted worker) reads on exactly
where the last one stopped; final metrics and the bar's progress are stored and shown."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.test import Client
from django.utils import timezone

from cluster.models import Node
from jobs.models import Job, Rank
from metrics.ingest import POINT_COLUMNS, RankStream, Sample, parse_lines, save_points
from metrics.models import FinalMetric, JobMetrics, MetricPoint

from .jobrows import update_jobs

CORPUS = Path(__file__).parent / "data" / "frameworks"
RECORDINGS = sorted(p.name for p in CORPUS.iterdir() if (p / "rank_0.log").exists())


@pytest.fixture
def rank(db, settings, tmp_path):
    settings.JOBS_DIR = tmp_path / "jobs"
    node = Node.objects.create(name="gpu0", address="127.0.0.2")
    now = timezone.now()
    job = Job.objects.create(name="run", script="s.py", state=Job.State.RUNNING, started_at=now, running_at=now)
    return Rank.objects.create(job=job, node=node, index=0, state=Rank.State.RUNNING)


def follow_in_chunks(rank: Rank, text: str, lines_per_follower: int) -> list[list]:
    """Feed a log as followers do, a new follower (fresh parser state) every few lines; store the points."""
    lines = text.split("\n")
    final_line = lines.pop()  # the part after the last newline: taken once the rank has exited
    rank.local_log.parent.mkdir(parents=True, exist_ok=True)
    got: list[list] = []
    for start in range(0, len(lines) + 1, lines_per_follower):
        chunk = lines[start : start + lines_per_follower]
        end = start + lines_per_follower > len(lines)
        if end:
            chunk.append(final_line)
        points, _ = parse_lines(rank.job_id, rank.index, chunk, RankStream(), timezone.now(), end=end)
        save_points(points)
        got.extend([p.step, p.name, p.value] for p in points)
        data = ("\n".join(chunk) + ("" if end else "\n")).encode()
        with open(rank.local_log, "ab") as fh:  # what the follower copies, then commits as the offset
            fh.write(data)
        Rank.objects.filter(pk=rank.pk).update(log_offset=rank.local_log.stat().st_size)
    return got


@pytest.mark.parametrize("name", RECORDINGS)
def test_a_new_follower_every_few_lines_reads_the_same_points_once(rank, name):
    # given a framework's real output and what one uninterrupted reading gives
    expected = json.loads((CORPUS / name / "expected.json").read_text())
    if expected["pattern"]:
        JobMetrics.objects.create(job=rank.job, pattern=expected["pattern"])
    text = (CORPUS / name / "rank_0.log").read_bytes().decode("utf-8", "replace")
    # when a new follower takes over every 3 lines (even between a Trainer dict and the bar's redraw)
    got = follow_in_chunks(rank, text, 3)
    # then the points are exactly those, nothing lost or repeated, and the final metrics are stored
    assert got == expected["log"]["points"]
    finals = dict(FinalMetric.objects.filter(job=rank.job).values_list("name", "value"))
    assert finals == expected["log"]["final"]


def test_final_metrics_and_progress_are_stored_and_shown(rank):
    # given a Trainer run read to its end
    text = (CORPUS / "hf5_trainer" / "rank_0.log").read_bytes().decode("utf-8", "replace")
    follow_in_chunks(rank, text, 1000)
    job = rank.job
    # then progress is the bar's N of M
    progress = JobMetrics.objects.get(job=job)
    assert (progress.step, progress.total_steps) == (30, 30)
    client = Client()
    client.force_login(User.objects.create_user("alice", password="pw-alice-123"))
    html = client.get(f"/jobs/{job.pk}/").content.decode()
    assert "step 30/30" in html and "100.0%" in html
    # and once the job ended, its page and `results` show the summary as final metrics
    update_jobs(Job.objects.filter(pk=job.pk), state=Job.State.SUCCEEDED, finished_at=timezone.now())
    html = client.get(f"/jobs/{job.pk}/").content.decode()
    assert 'id="final-metrics"' in html and "<td>train_runtime</td>" in html
    out = io.StringIO()
    call_command("results", "run", stdout=out)
    assert "final train_loss rank 0: 2.57 at step 30" in out.getvalue()
    # and a summary printed again (a retried pass) replaces, never duplicates
    parse_lines(job.pk, 0, ["{'train_runtime': '1.5', 'train_loss': '2.0', 'epoch': '1.5'}"], RankStream(),
                timezone.now())  # fmt: skip
    assert FinalMetric.objects.filter(job=job, name="train_loss").get().value == 2.0


def test_points_are_stored_exactly_whatever_their_values_and_names(rank):
    # given points at the edges of what a script may log: non-finite and extreme values, a negative zero,
    # a large step, a name with non-ASCII text and one of the column's full 100 characters, a later attempt
    when = timezone.now()
    odd = [
        Sample(rank.job_id, 0, 0, "loss", float("nan"), when),
        Sample(rank.job_id, 1, 2**62, "loss", float("inf"), when),
        Sample(rank.job_id, 2, 3, "loss", float("-inf"), when, 2),
        Sample(rank.job_id, 0, 4, "grad/norm²", -0.0, when),
        Sample(rank.job_id, 0, 5, "x" * 100, 1.7976931348623157e308, when),
        Sample(rank.job_id, 0, 6, "lr", 5e-324, when),
    ]
    # when stored as the follower stores them (COPY on PostgreSQL)
    save_points(odd)
    # then each reads back as it was
    got = list(MetricPoint.objects.filter(job_id=rank.job_id).order_by("id").values_list(*POINT_COLUMNS))
    assert len(got) == len(odd)
    for row, want in zip(got, odd, strict=True):
        assert row[:4] == tuple(want)[:4] and row[5:] == tuple(want)[5:]
        assert (math.isnan(row[4]) and math.isnan(want.value)) or (
            row[4] == want.value and math.copysign(1, row[4]) == math.copysign(1, want.value)
        )


def test_metrics_jsonl_lines_are_json_dumps_of_each_point(rank):
    # given lines whose values take every path of the jsonl writer: ints and floats, tiny, huge and
    # negative-zero values, a step given as a float, a line's own rank, names that need escaping, a
    # value out of a float's range, and the Trainer's end-of-training summary (final, at the bar's step)
    when = timezone.now()
    lines = [
        '{"step": 1, "loss": 2.5, "lr": 3, "acc": -0.0}',
        '{"step": 2.0, "loss": 1e-300, "big": 1.7976931348623157e308, "rank": 1}',
        '{"global_step": 3, "na\\"me\\\\": 0.1, "grad/norm²": 5e-324, "huge": ' + "9" * 400 + "}",
        "{'train_runtime': '1.5', 'train_loss': '2.0', 'epoch': '1.5'}",
    ]
    # when a follower parses them
    points, jsonl = parse_lines(rank.job_id, 0, lines, RankStream(), when, end=True)
    # then each metrics.jsonl line is exactly json.dumps of its point (the file's documented shape)
    finals = FinalMetric.objects.filter(job_id=rank.job_id).order_by("id")
    expected = [
        {"rank": p.rank, "step": p.step, "name": p.name, "value": p.value, "time": when.timestamp()} for p in points
    ] + [
        {"rank": f.rank, "step": f.step, "name": f.name, "value": f.value, "time": when.timestamp(), "final": True}
        for f in finals
    ]
    assert len(points) == 7 and finals.count() == 3  # the value beyond a float is left out
    assert jsonl == [json.dumps(e) for e in expected]
    assert all(type(p.step) is int and type(p.value) is float for p in points)
