"""Reading the central copies of rank logs: one rank, or all merged in arrival order."""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterator
from dataclasses import dataclass

from .follow import times_path
from .models import Job, Rank


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
            raw = fh.readline(min(end - pos, 1 << 20))
            if not raw:
                break
            pos += len(raw)
            i = bisect.bisect_left(ends, pos)
            when = times[i] if i < len(times) else (times[-1] if times else 0.0)
            text = raw.rstrip(b"\n").decode("utf-8", "replace")
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
    streams = [(line for _, line in rank_lines(r)) for r in ranks]
    merged = list(heapq.merge(*streams, key=lambda ln: (ln.time, ln.rank, ln.seq)))
    return merged[-tail:] if tail else merged
