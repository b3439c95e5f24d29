"""Ingestion: the lines a rank printed become metric points in the DB and in metrics.jsonl."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime

from .models import MetricPoint
from .parsing import MAX_LINE_CHARS, LineParser


@dataclass
class RankStream:
    """Parser state for one rank's log, kept by whoever follows it."""

    parser: LineParser = field(default_factory=LineParser)
    truncated: int = 0


def parse_lines(
    job_id: int, rank_index: int, lines: list[str], stream: RankStream, when: datetime
) -> tuple[list[MetricPoint], list[str]]:
    """Unsaved MetricPoints and their metrics.jsonl lines, for lines of one rank."""
    points: list[MetricPoint] = []
    jsonl: list[str] = []
    for line in lines:
        if len(line) > MAX_LINE_CHARS:
            stream.truncated += 1
        for p in stream.parser.feed(line):
            rank = p.rank if p.rank is not None else rank_index
            points.append(
                MetricPoint(job_id=job_id, rank=rank, step=p.step, name=p.name[:100], value=p.value, time=when)
            )
            jsonl.append(
                json.dumps({"rank": rank, "step": p.step, "name": p.name, "value": p.value, "time": when.timestamp()})
            )
    return points, jsonl
