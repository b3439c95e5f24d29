"""Ingestion: the lines a rank printed become metric points in the DB and in metrics.jsonl."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import NamedTuple

from django.db import connection
from django.db.models import F

from .models import FinalMetric, JobMetrics, MetricFile, MetricPoint
from .parsing import MAX_LINE_CHARS, LineParser, Point, compile_pattern


class Sample(NamedTuple):
    """A metric point on its way to the database: a plain row, not a model instance (the follower makes
    thousands a second; building MetricPoint objects was most of its CPU after parsing)."""

    job_id: int
    rank: int
    step: int
    name: str
    value: float
    time: datetime
    attempt: int = 1  # the job's attempt (a resume makes the next one)


_new_tuple = tuple.__new__  # a Sample from its fields in order, without the named tuple's Python-level __new__
POINT_COLUMNS = ("job_id", "rank", "step", "name", "value", "time", "attempt")
# The columns' PostgreSQL types, for COPY's binary format (the server then parses no text: no float or
# timestamp from its decimal form, on the path every metric line takes)
POINT_TYPES = ("int8", "int4", "int8", "varchar", "float8", "timestamptz", "int4")


def save_points(points: Sequence[Sample]) -> None:
    """Insert the points with PostgreSQL's COPY. The rollup the charts read is not touched:
    rollup.catch_up() folds them in later (the follower calls it about once a second, outside the
    transaction that holds the job's row lock)."""
    if not points:
        return
    table = connection.ops.quote_name(MetricPoint._meta.db_table)
    columns = ", ".join(connection.ops.quote_name(c) for c in POINT_COLUMNS)
    with (
        connection.cursor() as cursor,
        cursor.connection.cursor().copy(f"COPY {table} ({columns}) FROM STDIN (FORMAT BINARY)") as copy,
    ):
        copy.set_types(POINT_TYPES)
        for p in points:
            copy.write_row(p)


@dataclass
class RankStream:
    """Parser state for one rank's log, kept by whoever follows it."""

    parser: LineParser = field(default_factory=LineParser)
    truncated: int = 0
    configured: bool = False  # the job's metric settings were applied to the parser
    progress_saved: tuple[int | None, int | None] = (None, None)


REPLAY_BYTES = 256 * 1024


def configure(stream: RankStream, job_id: int, rank_index: int) -> None:
    """Ready a new stream: the job's metric settings (its pattern; bars give only steps when it reads
    metric files), and the parser state the committed end of the rank's log leaves.

    Followers come and go (a CLI watcher starts a new one every few seconds, a worker restarts): the
    parser's state across lines (a Trainer dict waiting for the bar's redraw, the values a bar last
    showed, the training bar's total) is rebuilt by reading the last committed lines of the rank's
    copied log again, their points dropped: they were taken when those lines were.
    """
    from jobs.models import Rank

    parser = stream.parser
    settings = JobMetrics.objects.filter(job_id=job_id).first()
    if settings is not None:
        if settings.pattern:
            try:
                parser.pattern = compile_pattern(settings.pattern)
            except ValueError:
                pass  # validated at launch; a pattern that broke since is no reason to stop following
        stream.progress_saved = (settings.step, settings.total_steps)
    parser.bar_metrics = not (settings and settings.files) and not MetricFile.objects.filter(job_id=job_id).exists()
    rank = (
        Rank.objects.select_related("job", "attempt")
        .filter(job_id=job_id, job__current=F("attempt"), index=rank_index)
        .first()
    )
    if rank is not None and rank.log_offset > 0:
        known_step = parser.last_step
        for line in _committed_tail(rank.local_log, rank.log_offset):
            parser.feed(line)
        if known_step is not None:
            parser.last_step = known_step  # what was stored last: inferred steps go on from there
        parser.malformed = parser.metric_lines = 0
    stream.configured = True


def _committed_tail(path, offset: int) -> list[str]:
    """The whole lines of the last REPLAY_BYTES before `offset` in the copied log."""
    try:
        with open(path, "rb") as fh:
            start = max(0, offset - REPLAY_BYTES)
            fh.seek(start)
            data = fh.read(offset - start)
    except OSError:
        return []
    if start > 0:
        data = data[data.find(b"\n") + 1 :] if b"\n" in data else b""
    lines = data.decode("utf-8", "replace").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def parse_lines(
    job_id: int,
    rank_index: int,
    lines: list[str],
    stream: RankStream,
    when: datetime,
    end: bool = False,
    attempt: int = 1,
) -> tuple[list[Sample], list[str]]:
    """Unsaved metric points (of the job's `attempt`) and their metrics.jsonl lines, for lines of one rank.

    end: the rank's log is complete (points still waiting for a progress bar's redraw are taken).
    Side effects, idempotent so a retried pass may repeat them: the run's final metrics (the
    Trainer's end-of-training summary) are upserted, and the training bar's step and total saved.
    """
    if not stream.configured:
        configure(stream, job_id, rank_index)
    points: list[Sample] = []
    jsonl: list[str] = []
    finals: list[Point] = []
    parsed: list[Point] = []
    for line in lines:
        if len(line) > MAX_LINE_CHARS:
            stream.truncated += 1
        parsed.extend(stream.parser.feed(line))
    if end:
        parsed.extend(stream.parser.flush())
    stamp = _json_number(when.timestamp())
    for p in parsed:
        step, name, value, rank, final = p
        if rank is None:
            rank = rank_index
        # json.dumps of {"rank", "step", "name", "value", "time"[, "final"]}, byte for byte, without
        # building a dict and an encoder per point (the follower writes one line per point it stores).
        # The parser's steps are ints and its values finite floats, whose repr is what json writes.
        quoted = _json_name(name)
        if type(step) is int and type(value) is float and not final:
            points.append(_new_tuple(Sample, (job_id, rank, step, name[:100], value, when, attempt)))
            jsonl.append(f'{{"rank": {rank}, "step": {step}, "name": {quoted}, "value": {value!r}, "time": {stamp}}}')
            continue
        number = _json_number
        line = f'{{"rank": {rank}, "step": {number(step)}, "name": {quoted}, "value": {number(value)}, "time": {stamp}'
        if final:
            finals.append(p)
            jsonl.append(f'{line}, "final": true}}')
        else:
            points.append(Sample(job_id, rank, step, name[:100], value, when, attempt))
            jsonl.append(f"{line}}}")
    if finals:
        save_final_metrics(job_id, rank_index, finals, when)
    _save_progress(job_id, stream)
    return points, jsonl


_NAMES: dict[str, str] = {}


def _json_name(name: str) -> str:
    """json.dumps(name), remembered (a run logs the same few names over and over)."""
    quoted = _NAMES.get(name)
    if quoted is None:
        quoted = json.dumps(name)
        if len(_NAMES) < 10_000:
            _NAMES[name] = quoted
    return quoted


def _json_number(value) -> str:
    """json.dumps of an int, a float (NaN and infinities as json writes them) or None."""
    kind = type(value)
    if kind is float:
        return float.__repr__(value) if value == value and value not in (math.inf, -math.inf) else json.dumps(value)
    if kind is int:
        return int.__repr__(value)
    return json.dumps(value)


def save_final_metrics(job_id: int, rank_index: int, finals: list[Point], when: datetime) -> None:
    """Upsert a rank's final metrics (a summary printed again replaces the values)."""
    rows = [
        FinalMetric(
            job_id=job_id,
            rank=p.rank if p.rank is not None else rank_index,
            name=p.name[:100],
            value=p.value,
            step=p.step,
            time=when,
        )
        for p in finals
    ]
    FinalMetric.objects.bulk_create(
        rows, update_conflicts=True, unique_fields=["job", "rank", "name"], update_fields=["value", "step", "time"]
    )


def _save_progress(job_id: int, stream: RankStream) -> None:
    """The training bar's step (and total, when it says), for progress and ETA; written only when they move."""
    parser = stream.parser
    if parser.counter is None:
        return
    now = (parser.counter, parser.total_steps)
    if now == stream.progress_saved:
        return
    JobMetrics.objects.update_or_create(job_id=job_id, defaults={"step": now[0], "total_steps": now[1]})
    stream.progress_saved = now
