"""Reading the central copies of rank logs: one rank, or all merged in arrival order.

The central copy is byte for byte what the rank wrote. What people see of a line is its last
carriage-return state (a progress bar redrawn 100,000 times shows once, as it ended), and a line
longer than LINE_CUT bytes is shown in LINE_CUT pieces (the follower cuts it there too).
"""

from __future__ import annotations

import bisect
import heapq
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .models import Job, Rank

LINE_CUT = 1024 * 1024  # bytes: a longer "line" (no newline yet) is taken and shown in pieces
TAIL_READ_BYTES = 256 * 1024  # a tail reads at most this much from the end of each log


def job_settled(job: Job) -> bool:
    """The job reached its final state and the worker's follower copied every rank's output it could
    (no rank is still running): what a terminal following the job waits for before it stops reading."""
    return Job.objects.filter(pk=job.pk, state__in=Job.ENDED_STATES).exists() and not job.ranks.filter(
        state="running"
    ).exists()


def write_at(path: Path, offset: int, chunk: bytes) -> None:
    """Write chunk at offset, first dropping anything past it: a central copy (log, metrics.jsonl,
    event file) is cut back to its committed size before each append, so a crash between a write and
    its commit repeats nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.ftruncate(fd, offset)
        os.lseek(fd, offset, os.SEEK_SET)
        view = memoryview(chunk)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def attempt_logs_dir(job: Job, number: int) -> Path:
    """Where attempt `number`'s central logs live once a later attempt started."""
    return job.logs_dir / f"attempt_{number}"


def archive_logs(job: Job, number: int) -> Path | None:
    """Move the current attempt's central rank logs (and arrival times) to logs/attempt_<number>/ (renames:
    nothing is copied). Returns that directory, or None when there was nothing to move."""
    files = sorted(job.logs_dir.glob("rank_*.log")) + sorted(job.logs_dir.glob("rank_*.times"))
    if not files:
        return None
    target = attempt_logs_dir(job, number)
    target.mkdir(parents=True, exist_ok=True)
    for f in files:
        f.replace(target / f.name)
    return target


def restore_logs(job: Job, number: int) -> None:
    """Undo archive_logs (the requeue that moved them lost its race)."""
    source = attempt_logs_dir(job, number)
    for f in sorted(source.glob("rank_*")):
        f.replace(job.logs_dir / f.name)


def earlier_attempt(job: Job, number: int, rank: int | None, follow: bool) -> list[Rank]:
    """The ranks of attempt `number` for reading its lines (`logs --attempt`); ValueError in one line when
    there is no such attempt or rank, or when asked to follow an attempt that has ended."""
    attempt = job.earlier_attempts.filter(number=number).first()
    ranks = list(attempt.ranks.select_related("job", "attempt").order_by("index")) if attempt else None
    if ranks is None:
        raise ValueError(f"job {job.name} has no attempt {number} (attempts 1-{job.attempt})")
    if follow:
        raise ValueError(f"attempt {number} of job {job.name} has ended: --follow is for the current one")
    if rank is not None and rank not in [r.index for r in ranks]:
        raise ValueError(f"attempt {number} of job {job.name} has no rank {rank}")
    return ranks


def times_path(rank: Rank) -> Path:
    """When each chunk of a rank's log arrived (byte offset, time), for merged views."""
    return rank.local_log.with_suffix(".times")


def store_chunk(rank: Rank, offset: int, data: bytes, arrived: float) -> None:
    """A chunk of a rank's log into its central copy at `offset` (cut back there first: write_at), and when it
    arrived (epoch seconds) beside it."""
    write_at(rank.local_log, offset, data)
    with open(times_path(rank), "a") as fh:
        fh.write(f"{offset + len(data)} {arrived:.3f}\n")


def display_text(text: str) -> str:
    """What a terminal would show of a line: its last non-empty carriage-return segment."""
    if "\r" not in text:
        return text
    for segment in reversed(text.split("\r")):
        if segment.strip():
            return segment
    return ""


def tail_lines(rank: Rank, count: int = 200, max_bytes: int = TAIL_READ_BYTES) -> list[str]:
    """The last `count` committed lines of a rank's central log, read from its end (bounded)."""
    end = rank.log_offset
    start = max(0, end - max_bytes)
    try:
        with open(rank.local_log, "rb") as fh:
            fh.seek(start)
            data = fh.read(end - start)
    except OSError:
        return []
    if start > 0:
        cut = data.find(b"\n")
        data = data[cut + 1 :] if cut >= 0 else data
    lines = [display_text(ln) for ln in data.decode("utf-8", "replace").split("\n")]
    if lines and lines[-1] == "":
        lines.pop()
    return lines[-count:]


@dataclass(frozen=True)
class LogLine:
    time: float
    rank: int
    seq: int
    text: str

    def prefixed(self) -> str:
        return f"[rank {self.rank}] {self.text}"


def _arrivals(rank: Rank) -> tuple[list[int], list[float]]:
    ends, times = [], []
    try:
        with open(times_path(rank)) as fh:
            for row in fh:
                end, _, when = row.partition(" ")
                try:
                    ends.append(int(end))
                    times.append(float(when))
                except ValueError:
                    continue
    except OSError:
        pass
    return ends, times


def rank_lines(rank: Rank, start: int = 0, end: int | None = None) -> Iterator[tuple[int, LogLine]]:
    """(byte offset after the line, line) for committed lines of a rank's central log."""
    end = rank.log_offset if end is None else end
    ends, times = _arrivals(rank)
    try:
        fh = open(rank.local_log, "rb")
    except OSError:
        return
    with fh:
        fh.seek(start)
        pos, seq = start, 0
        while pos < end:
            raw = fh.readline(min(end - pos, LINE_CUT))
            if not raw:
                break
            pos += len(raw)
            i = bisect.bisect_left(ends, pos)
            when = times[i] if i < len(times) else (times[-1] if times else 0.0)
            text = display_text(raw.rstrip(b"\n").decode("utf-8", "replace"))
            yield pos, LogLine(when, rank.index, seq, text)
            seq += 1


def job_lines(
    job: Job, rank_index: int | None = None, tail: int | None = None, ranks: list[Rank] | None = None
) -> list[LogLine]:
    """Committed lines of one rank, or of all ranks merged by arrival time (then rank).

    Pass `ranks` to read exactly up to the offsets those rows hold (what a caller reports with them).
    """
    ranks = list(job.ranks.order_by("index")) if ranks is None else ranks
    if rank_index is not None:
        ranks = [r for r in ranks if r.index == rank_index]
    start = {}
    if tail:
        # Read only the end of each log: each rank contributes at most `tail` lines to a merged tail.
        start = {r.pk: _tail_start(r, tail) for r in ranks}
    streams = [(line for _, line in rank_lines(r, start.get(r.pk, 0))) for r in ranks]
    merged = list(heapq.merge(*streams, key=lambda ln: (ln.time, ln.rank, ln.seq)))
    return merged[-tail:] if tail else merged


def _tail_start(rank: Rank, count: int) -> int:
    """A line-start offset at or before the `count`-th last committed line (reading back in blocks)."""
    end = rank.log_offset
    pos, newlines, block = end, 0, 64 * 1024
    try:
        fd = os.open(rank.local_log, os.O_RDONLY)
    except OSError:
        return 0
    try:
        while pos > 0:
            read_from = max(0, pos - block)
            data = os.pread(fd, pos - read_from, read_from)
            # the last line's own newline does not separate it from the one before
            stop = len(data) - 1 if pos == end and data.endswith(b"\n") else len(data)
            i = stop
            while True:
                i = data.rfind(b"\n", 0, i)
                if i < 0:
                    break
                newlines += 1
                if newlines >= count:
                    return read_from + i + 1
            pos = read_from
    finally:
        os.close(fd)
    return 0
