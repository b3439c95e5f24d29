"""Following the metric files frameworks write beside a run: Lightning's metrics.csv (CSVLogger) and
TensorBoard event files (TensorBoardLogger, SummaryWriter), on the nodes, like the logs.

A job names them at launch (`--metrics-file`, a file or a directory searched a few levels deep, relative
to the node's working directory). Each pass the follower calls follow_metric_files(): it finds the
files on every rank's node, reads each from the byte offset kept in MetricFile through the node agent's
`tail`, and stores the new points, the offsets and metrics.jsonl in one transaction (the logs' rule:
nothing lost, nothing repeated across controller restarts).

CSV: only whole lines are taken; when the header changes (Lightning rewrites the file with the new
column set when a new metric appears), the file is read again and the rows already taken are skipped.
TensorBoard: the bytes are appended to a copy in the job directory and read with tensorboard's own
EventFileLoader; the events already taken are skipped by count, a partly written record waits.
"""

from __future__ import annotations

import base64
import csv
import io
import json
import logging
import math
import re
import time
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from datetime import datetime
from pathlib import Path
from typing import Any

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from jobs.events import publish_job
from jobs.logs import write_at
from jobs.models import Job, Rank

from .models import JobMetrics, MetricFile, MetricPoint

log = logging.getLogger(__name__)
_guard: ContextVar[Callable[[], None] | None] = ContextVar("metric_files_guard", default=None)

TAIL_BYTES = 4 * 1024 * 1024
SCAN_EVERY_S = 5.0  # how often a node's directories are searched for new metric files
MAX_SCAN_DEPTH = 3  # lightning_logs/version_0/metrics.csv is two levels under lightning_logs
MAX_LISTDIRS = 64  # per node and scan: a huge directory tree cannot stall the follower
MAX_FILES = 64  # per job
MAX_PATHS = 8
MAX_PATH_CHARS = 1000
CSV_NAME = "metrics.csv"
TFEVENTS = re.compile(r"^events\.out\.tfevents\.")
STEP_COLUMNS = ("step", "global_step")

Request = Callable[..., dict[str, Any]]
_scanned: dict[tuple[int, int], float] = {}  # (job, rank) -> when its node was last searched


def check_paths(paths: Iterable[str]) -> list[str]:
    """Metric file paths as given at launch, validated; ValueError with a one-line reason."""
    out = []
    for raw in paths:
        path = str(raw).strip()
        if not path:
            continue
        if len(path) > MAX_PATH_CHARS:
            raise ValueError(f"a metrics file path is longer than {MAX_PATH_CHARS} characters")
        if any(c in path for c in "\x00\n\r"):
            raise ValueError("a metrics file path contains a NUL byte or a line break")
        out.append(path)
    if len(out) > MAX_PATHS:
        raise ValueError(f"at most {MAX_PATHS} metrics files or directories")
    return out


def kind_of(name: str) -> str | None:
    """The kind of metric file a file name (or path) is, or None."""
    name = name.rsplit("/", 1)[-1]
    if name == CSV_NAME or name.endswith(".csv"):
        return MetricFile.Kind.CSV
    if TFEVENTS.match(name):
        return MetricFile.Kind.TFEVENTS
    return None


def node_path(rank: Rank, path: str, job: Job) -> str:
    """A configured path on the rank's node: {job} is the job's name; relative paths are under the workdir."""
    path = path.replace("{job}", job.name)
    if path.startswith(("/", "~")):
        return path
    return f"{rank.node.workdir.rstrip('/') or '/'}/{path}"


def follow_metric_files(
    job: Job, ranks: list[Rank], request: Request, guard: Callable[[], None] | None = None
) -> list[MetricPoint]:
    """One pass: find the job's metric files on its ranks' nodes and take what they gained. Never raises
    for a node that does not answer (the log follower decides about lost nodes); returns the new points.

    guard: called first inside every transaction that writes (the follower renews its lease there,
    which also locks the job's row); when it raises, nothing of that transaction is written."""
    _guard.set(guard)
    configured = JobMetrics.objects.filter(job=job).values_list("files", flat=True).first() or []
    saved: list[MetricPoint] = []
    for rank in ranks:
        try:
            if configured:
                _discover(job, rank, configured, request)
            saved.extend(_take(job, rank, request))
        except Exception as exc:  # a node's trouble, or one odd file: the logs are followed all the same
            log.warning("metric files of %s rank %s: %s", job.name, rank.index, exc)
    return saved


def adopt(job: Job, rank: Rank, entries: list[dict]) -> int:
    """Follow the metric files a discovery walk of the rank's workdir found (jobs/discovery.py): files
    changed since the rank started. One another running job already follows is that job's; the same path
    on a second node of the job (a shared filesystem) is followed once, from the lowest rank. Returns how
    many are new."""
    paths = [e["path"] for e in entries if e.get("kind") == "metrics" and kind_of(e["path"]) and
             not rank.in_other_jobs_dir(e["path"])]  # fmt: skip
    if not paths:
        return 0
    taken = set(
        MetricFile.objects.filter(path__in=paths)
        .filter(Q(job=job) | Q(job__current__finished_at__isnull=True))
        .values_list("path", flat=True)
    )
    new = [p for p in paths if p not in taken]
    room = MAX_FILES - MetricFile.objects.filter(job=job).count()
    for path in new[: max(room, 0)]:
        MetricFile.objects.get_or_create(job=job, rank=rank.index, path=path, defaults={"kind": kind_of(path)})
    return min(len(new), max(room, 0))


def _discover(job: Job, rank: Rank, paths: list[str], request: Request) -> None:
    key = (job.pk, rank.index)
    # a rank that just ended is searched once more: frameworks write their last rows on the way out
    if rank.state == Rank.State.RUNNING and time.monotonic() - _scanned.get(key, -math.inf) < SCAN_EVERY_S:
        return
    _scanned[key] = time.monotonic()
    known = set(MetricFile.objects.filter(job=job, rank=rank.index).values_list("path", flat=True))
    count = MetricFile.objects.filter(job=job).count()
    budget = [MAX_LISTDIRS]
    for configured in paths:
        path = node_path(rank, configured, job)
        name = path.rstrip("/").rsplit("/", 1)[-1]
        found = [(path, kind_of(name))] if kind_of(name) else _search(rank, path, MAX_SCAN_DEPTH, request, budget)
        for file_path, kind in found:
            if file_path in known or count >= MAX_FILES:
                continue
            MetricFile.objects.get_or_create(job=job, rank=rank.index, path=file_path, defaults={"kind": kind})
            known.add(file_path)
            count += 1


def _search(rank: Rank, directory: str, depth: int, request: Request, budget: list[int]) -> list[tuple[str, str]]:
    """Metric files under a directory (listdir does not say what is a directory: a file lists as empty)."""
    if depth < 0 or budget[0] <= 0:
        return []
    budget[0] -= 1
    entries = request(rank.node, "listdir", timeout=10, path=directory)["entries"]
    found = []
    for entry in entries:
        name = entry["name"]
        kind = kind_of(name)
        child = f"{directory.rstrip('/')}/{name}"
        if kind:
            found.append((child, kind))
        elif not name.startswith(".") and "." not in name[-5:]:  # a likely directory: no file extension
            found.extend(_search(rank, child, depth - 1, request, budget))
    return found


def _take(job: Job, rank: Rank, request: Request) -> list[MetricPoint]:
    files = list(MetricFile.objects.filter(job=job, rank=rank.index).order_by("pk"))
    if not files:
        return []
    items = []
    starts: dict[int, int] = {}
    for f in files:
        starts[f.pk] = f.offset
        if f.kind == MetricFile.Kind.TFEVENTS and _copy_size(job, rank, f) < f.offset:
            starts[f.pk] = 0  # the job directory's copy is gone (another controller): read it whole again
        items.append({"key": f.pk, "path": f.path, "offset": starts[f.pk], "max_bytes": TAIL_BYTES})
        if f.kind == MetricFile.Kind.CSV and f.header:
            # is the header still the one the rows were read with?
            items.append({"key": f"head:{f.pk}", "path": f.path, "offset": 0, "max_bytes": len(f.header.encode()) + 1})
    answer = request(rank.node, "tail", timeout=15, files=items)
    by_key = {item["key"]: item for item in answer["files"]}
    saved = []
    for f in files:
        item = by_key.get(f.pk)
        if not item or item["size"] is None:
            continue
        data = base64.b64decode(item["data"])
        head = by_key.get(f"head:{f.pk}")
        if f.kind == MetricFile.Kind.CSV:
            head_bytes = base64.b64decode(head["data"]) if head else None
            if head_bytes is not None and head_bytes != (f.header + "\n").encode():
                # rewritten with another header: read it whole again, skipping the rows already taken
                f.offset, f.header = 0, ""
                again = request(rank.node, "tail", timeout=15, files=[{"key": 0, "path": f.path, "offset": 0}])
                data = base64.b64decode(again["files"][0]["data"])
            saved.extend(_take_csv(job, rank, f, data))
        else:
            saved.extend(_take_events(job, rank, f, data, starts[f.pk]))
    return saved


def csv_points(header: str, rows_text: str, skip: int) -> tuple[list[tuple[int, str, float]], int]:
    """(step, name, value) of the CSV rows after the first `skip`, and how many rows there were."""
    columns = next(csv.reader([header.rstrip("\r")]), [])
    points = []
    rows = 0
    for row in csv.reader(io.StringIO(rows_text)):
        if not row:
            continue
        rows += 1
        if rows <= skip:
            continue
        record = dict(zip(columns, row, strict=False))
        step = next((_int(record.get(c)) for c in STEP_COLUMNS if _int(record.get(c)) is not None), None)
        if step is None:
            continue
        for name, raw in record.items():
            if name in STEP_COLUMNS or not name or len(name) > 100:
                continue
            value = _float(raw)
            if value is not None:
                points.append((step, name, value))
    return points, rows


def _take_csv(job: Job, rank: Rank, f: MetricFile, data: bytes) -> list[MetricPoint]:
    cut = data.rfind(b"\n")
    if cut < 0:
        return []
    whole = data[: cut + 1]
    text = whole.decode("utf-8", "replace")
    header = f.header
    skip = f.records
    if not header:
        header, _, text = text.partition("\n")  # kept as written (with its \r): compared byte for byte
    else:
        skip = 0  # reading on from the offset: every row is new
    triples, rows = csv_points(header, text, skip)
    if f.offset == 0:
        rows_total = max(rows, f.records)
    else:
        rows_total = f.records + rows
    return _save(job, rank, f, triples, offset=f.offset + len(whole), header=header, records=rows_total)


def events_points(path: Path, skip: int) -> tuple[list[tuple[int, str, float]], int]:
    """(step, tag, value) of the scalar events of a TensorBoard event file after the first `skip` events,
    read with tensorboard's EventFileLoader (a partly written last record is left for later)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    points = []
    count = 0
    for event in EventFileLoader(str(path)).Load():
        count += 1
        if count <= skip or not event.HasField("summary"):
            continue
        for value in event.summary.value:
            number = None
            if value.HasField("simple_value"):
                number = value.simple_value
            elif value.HasField("tensor"):
                array = tensor_util.make_ndarray(value.tensor)
                if array.size == 1 and array.dtype.kind in "fiu":
                    number = float(array.reshape(()))
            name = series_name(value.tag)
            if number is not None and math.isfinite(number) and name and len(name) <= 100:
                points.append((int(event.step), name, float(number)))
    return points, count


# The Hugging Face Trainer's TensorBoard tags (its rewrite_logs: train/loss, eval/loss, test/...) under the
# names its printed log dicts give the same values (loss, eval_loss, test_...): one series each, not two.
_HF_TAGS = {"train/": "", "eval/": "eval_", "test/": "test_"}


def series_name(tag: str) -> str:
    """The series a TensorBoard tag feeds."""
    head, sep, rest = tag.partition("/")
    if sep and rest and "/" not in rest and head + "/" in _HF_TAGS:
        return _HF_TAGS[head + "/"] + rest
    return tag


def _copy(job: Job, rank: Rank, f: MetricFile) -> Path:
    """Where the job directory keeps its copy of a node's event file."""
    return job.job_dir / "metric_files" / f"rank_{rank.index}" / re.sub(r"[^\w.-]", "_", f.path.strip("/"))


def _copy_size(job: Job, rank: Rank, f: MetricFile) -> int:
    try:
        return _copy(job, rank, f).stat().st_size
    except OSError:
        return 0


def _take_events(job: Job, rank: Rank, f: MetricFile, data: bytes, start: int) -> list[MetricPoint]:
    if not data:
        return []
    copy = _copy(job, rank, f)
    write_at(copy, start, data)
    triples, count = events_points(copy, f.records)
    return _save(job, rank, f, triples, offset=start + len(data), header="", records=max(count, f.records))


def _save(
    job: Job, rank: Rank, f: MetricFile, triples: list[tuple[int, str, float]], *, offset: int, header: str,
    records: int,
) -> list[MetricPoint]:  # fmt: skip
    now = timezone.now()
    # one point per step and name: Lightning writes the same values to metrics.csv and to TensorBoard,
    # and repeats 'epoch' on the rows of one step
    unique = {(step, name): value for step, name, value in triples}
    if unique:
        steps = {step for step, _ in unique}
        taken = MetricPoint.objects.filter(
            job=job, rank=rank.index, step__gte=min(steps), step__lte=max(steps), name__in={n for _, n in unique}
        ).values_list("step", "name")
        for key in taken:
            unique.pop(key, None)
    points = [
        MetricPoint(job=job, rank=rank.index, step=step, name=name, value=value, time=now, attempt=job.attempt)
        for (step, name), value in unique.items()
    ]
    with transaction.atomic():
        guard = _guard.get()
        if guard is not None:
            guard()
        if points:
            _append_jsonl(job, points, now)
            MetricPoint.objects.bulk_create(points, batch_size=2000)  # the follower folds them into the rollup
            # the values a progress bar showed of these metrics before the file was found had no step: the
            # file's, at the framework's steps, replace them (one series, not two)
            MetricPoint.objects.filter(job=job, step__isnull=True, name__in={p.name for p in points}).delete()
            Job.objects.filter(pk=job.pk).update(metrics_bytes=job.metrics_bytes)
        MetricFile.objects.filter(pk=f.pk).update(offset=offset, header=header, records=records)
    f.offset, f.header, f.records = offset, header, records
    if points:
        publish_job(job, "points", {"rank": rank.index, "points": [[p.rank, p.step, p.name, p.value] for p in points]})
    return points


def _append_jsonl(job: Job, points: list[MetricPoint], when: datetime) -> None:
    """metrics.jsonl, by the follower's rule: cut back to the committed size, append, commit the new size."""
    lines = [
        json.dumps({"rank": p.rank, "step": p.step, "name": p.name, "value": p.value, "time": when.timestamp()})
        for p in points
    ]
    chunk = ("\n".join(lines) + "\n").encode()
    # the committed size, read under the row lock the guard took: the log follower appends here too
    job.metrics_bytes = Job.objects.values_list("metrics_bytes", flat=True).get(pk=job.pk)
    write_at(job.job_dir / "metrics.jsonl", job.metrics_bytes, chunk)
    job.metrics_bytes += len(chunk)


def _int(raw: Any) -> int | None:
    value = _float(raw)
    return int(value) if value is not None and value.is_integer() else None


def _float(raw: Any) -> float | None:
    try:
        value = float(raw)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None
