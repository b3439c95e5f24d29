"""Per-replica request stats of the endpoint: requests, errors, completion tokens and latency.

The endpoint counts in memory (a few integer additions per request) and writes what it counted every
FLUSH_S seconds, one ReplicaTraffic row per replica with traffic, plus the replica's running totals: no
database write per request, and several web processes add up. Readers (the services page, the API,
/metrics) sum the rows of the last WINDOW_S seconds. Latency is kept as counts per bucket of a geometric
scale, so windows and processes merge and a percentile is the upper edge of its bucket (at most 10% high).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import threading
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from asgiref.sync import sync_to_async
from django.db import IntegrityError, close_old_connections, transaction
from django.db.models import F
from django.utils import timezone

from .models import Replica, ReplicaTraffic, Service

log = logging.getLogger(__name__)

FLUSH_S = 5.0  # how late the page may be
WINDOW_S = 60.0  # rates and percentiles are over the last minute
KEEP_S = 3600.0  # the worker drops older rows
BUCKET_FLOOR_S = 0.001  # bucket 0: up to 1 ms
BUCKET_GROWTH = 1.1
_LOG_GROWTH = math.log(BUCKET_GROWTH)
# transformers serve, vLLM and SGLang put usage in a non-streamed answer and (transformers serve always, the others
# when asked) in the last streamed chunk; a model's text cannot match: its quotes are escaped in JSON
USAGE = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
TAIL = 64  # bytes of the previous chunk kept, so that a marker split between two chunks is still seen


def bucket(seconds: float) -> int:
    """The latency bucket of a duration: 0 up to 1 ms, then each 10% wider than the last."""
    if seconds <= BUCKET_FLOOR_S:
        return 0
    return math.ceil(math.log(seconds / BUCKET_FLOOR_S) / _LOG_GROWTH - 1e-9)


def bucket_top(index: int) -> float:
    """The upper edge of a latency bucket, in seconds."""
    return BUCKET_FLOOR_S * BUCKET_GROWTH**index


def percentile(counts: dict[int, int], q: float) -> float | None:
    """The q-th (0-1) latency, as its bucket's upper edge; None with no requests."""
    total = sum(counts.values())
    if not total:
        return None
    rank = max(1, math.ceil(q * total))
    seen = 0
    for index in sorted(counts):
        seen += counts[index]
        if seen >= rank:
            return bucket_top(index)
    return bucket_top(max(counts))


class TokenCount:
    """Completion tokens of one answer, fed its bytes as they are relayed: the usage field's completion_tokens
    when the engine sends one, else the streamed events (one token each, as engines stream them)."""

    def __init__(self) -> None:
        self.usage: int | None = None
        self.events = 0
        self.tail = b""

    def feed(self, chunk: bytes) -> None:
        seen = self.tail + chunk
        self.events += seen.count(b"data:") - self.tail.count(b"data:")
        self.events -= seen.count(b"[DONE]") - self.tail.count(b"[DONE]")
        if b"completion_tokens" in seen:
            found = USAGE.findall(seen)
            if found:
                self.usage = int(found[-1])
        self.tail = seen[-TAIL:]

    @property
    def tokens(self) -> int:
        return self.usage if self.usage is not None else max(self.events, 0)


@dataclass
class Tally:
    requests: int = 0
    errors: int = 0
    tokens: int = 0
    latency: dict[int, int] = field(default_factory=dict)


class Recorder:
    """This process's counts since its last flush, per replica (its pk)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tallies: dict[int, Tally] = {}
        self.since: datetime | None = None

    def record(self, replica: int, seconds: float | None, tokens: int = 0, error: bool = False) -> None:
        """One request to a replica: answered in `seconds` (None: no answer to time), with its tokens."""
        with self.lock:
            if self.since is None:
                self.since = timezone.now()
            tally = self.tallies.get(replica)
            if tally is None:
                tally = self.tallies[replica] = Tally()
            tally.requests += 1
            tally.tokens += tokens
            if error:
                tally.errors += 1
            if seconds is not None:
                b = bucket(seconds)
                tally.latency[b] = tally.latency.get(b, 0) + 1

    def take(self) -> tuple[datetime, dict[int, Tally]] | None:
        """What was counted since the last take, and since when; None if nothing."""
        with self.lock:
            if not self.tallies:
                return None
            taken, since = self.tallies, self.since
            self.tallies, self.since = {}, None
        return since, taken

    def flush(self) -> int:
        """Write what was counted (one row per replica, and the replicas' totals); how many rows."""
        taken = self.take()
        if taken is None:
            return 0
        since, tallies = taken
        return write(since, timezone.now(), tallies)


def write(since: datetime, until: datetime, tallies: dict[int, Tally]) -> int:
    """Record counts of [since, until] for replicas that still exist (a stopped service's name may have been
    taken again since: its replicas are gone)."""
    alive = set(Replica.objects.filter(pk__in=list(tallies)).values_list("pk", flat=True))
    rows = [
        ReplicaTraffic(replica_id=pk, started_at=since, ended_at=until, requests=t.requests, errors=t.errors,
                       tokens=t.tokens, latency={str(k): v for k, v in t.latency.items()})
        for pk, t in tallies.items() if pk in alive
    ]  # fmt: skip
    try:
        with transaction.atomic():
            ReplicaTraffic.objects.bulk_create(rows)
            for row in rows:
                Replica.objects.filter(pk=row.replica_id).update(
                    requests_total=F("requests_total") + row.requests, errors_total=F("errors_total") + row.errors,
                    tokens_total=F("tokens_total") + row.tokens,
                )  # fmt: skip
    except IntegrityError:  # a replica deleted between the two statements: these few seconds are lost
        log.warning("request stats of %d replicas dropped: a replica was deleted meanwhile", len(rows))
        return 0
    return len(rows)


@dataclass
class Stats:
    """One replica's requests over the last WINDOW_S seconds, and its totals."""

    requests: int = 0
    errors: int = 0
    tokens: int = 0
    rps: float = 0.0
    tokens_per_s: float = 0.0
    p50_s: float | None = None
    p99_s: float | None = None
    requests_total: int = 0
    errors_total: int = 0
    tokens_total: int = 0

    @property
    def p50_ms(self) -> float | None:
        return None if self.p50_s is None else round(self.p50_s * 1000, 1)

    @property
    def p99_ms(self) -> float | None:
        return None if self.p99_s is None else round(self.p99_s * 1000, 1)

    def as_dict(self) -> dict:
        return {"rps": round(self.rps, 2), "p50_ms": self.p50_ms, "p99_ms": self.p99_ms,
                "tokens_per_s": round(self.tokens_per_s, 1), "errors": self.errors, "requests": self.requests,
                "requests_total": self.requests_total, "errors_total": self.errors_total,
                "tokens_total": self.tokens_total, "window_s": WINDOW_S}  # fmt: skip


def recent(replicas: list[Replica], now: datetime | None = None) -> dict[int, Stats]:
    """Each replica's Stats (by pk), from the rows of the last WINDOW_S seconds: one query."""
    now = now or timezone.now()
    out = {r.pk: Stats(requests_total=r.requests_total, errors_total=r.errors_total, tokens_total=r.tokens_total)
           for r in replicas}  # fmt: skip
    merged: dict[int, dict[int, int]] = {pk: {} for pk in out}
    rows = ReplicaTraffic.objects.filter(replica_id__in=list(out), ended_at__gt=now - timedelta(seconds=WINDOW_S))
    for pk, requests, errors, tokens, latency in rows.values_list("replica_id", "requests", "errors", "tokens",
                                                                  "latency"):  # fmt: skip
        s = out[pk]
        s.requests += requests
        s.errors += errors
        s.tokens += tokens
        counts = merged[pk]
        for key, n in latency.items():
            counts[int(key)] = counts.get(int(key), 0) + n
    for pk, s in out.items():
        s.rps = s.requests / WINDOW_S
        s.tokens_per_s = s.tokens / WINDOW_S
        s.p50_s = percentile(merged[pk], 0.50)
        s.p99_s = percentile(merged[pk], 0.99)
    return out


def drop_old(now: datetime | None = None) -> int:
    """Delete rows older than KEEP_S (the worker's pass); how many."""
    cutoff = (now or timezone.now()) - timedelta(seconds=KEEP_S)
    return ReplicaTraffic.objects.filter(ended_at__lt=cutoff).delete()[0]


recorder = Recorder()


def write_load(samples: dict[int, tuple[int, float]], now: datetime | None = None) -> None:
    """Each replica's requests in flight and their recent average (serving/scaling.py reads them), and the last
    request's time on each service with requests or requests in flight (its idle clock)."""
    now = now or timezone.now()
    for pk, (outstanding, mean) in samples.items():
        Replica.objects.filter(pk=pk).update(outstanding=max(outstanding, 0), load=round(mean, 3), load_at=now)


def touch(replica_pks: set[int], now: datetime | None = None) -> None:
    """The services of these replicas had a request now: their idle clock starts again."""
    if replica_pks:
        services = Replica.objects.filter(pk__in=list(replica_pks)).values("service_id")
        Service.objects.filter(pk__in=services).update(last_request_at=now or timezone.now())


def _flush_now(samples: dict[int, tuple[int, float]] | None = None) -> int:
    close_old_connections()  # this thread's connection, if the database dropped it since the last flush
    try:
        taken = recorder.take()
        busy = {pk for pk, (n, _) in (samples or {}).items() if n}
        touch(busy | set(taken[1] if taken else ()))
        write_load(samples or {})
        return write(taken[0], timezone.now(), taken[1]) if taken else 0
    finally:
        close_old_connections()  # as a request's end does: not kept open past CONN_MAX_AGE


async def flush_every(interval: float = FLUSH_S, sample=None) -> None:
    """The web process's flusher: runs for the life of its event loop, on a thread of the loop's pool (not a
    request's: the request that started it has ended). `sample` (on the loop) gives each replica's requests in
    flight (balancer.samples)."""
    flush = sync_to_async(_flush_now, thread_sensitive=False)
    while True:
        await asyncio.sleep(interval)
        try:
            await flush(sample() if sample else None)
        except Exception:  # the database away for a moment: these counts are lost, the next flush goes on
            log.exception("request stats not written")
