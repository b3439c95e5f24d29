"""Following a running job: copy each rank's log from its node, ingest metrics, notice how it ended.

Exactly-once across controller restarts: the central copy of a rank's log is truncated to the
offset stored in the DB before new bytes are appended, and the offset advances in the same
transaction as the metric points taken from those bytes. A crash between the write and the commit
leaves bytes past the offset that the next step overwrites: nothing lost, nothing repeated.
Only whole lines are taken while a rank runs; its last partial line is taken once it has exited.
"""

from __future__ import annotations

import base64
import logging
import os
import socket
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from cluster.links import AgentRequestError, LinkError
from metrics.files import follow_metric_files
from metrics.ingest import RankStream, parse_lines
from metrics.models import MetricPoint

from .events import publish_job
from .models import Job, Rank
from .nodes import node_request, on_each

log = logging.getLogger(__name__)
TAIL_BYTES = 4 * 1024 * 1024
PUBLISH_SLICE = 1000


def follower_id() -> str:
    """Who follows: host, process and thread. Per thread, because a threads-pool worker runs several
    follow_jobs tasks at once (beat queues one every few seconds) and each must see the others'
    leases as someone else's, or all of them follow the same job and trip over each other."""
    return f"{socket.gethostname()}:{os.getpid()}:{threading.get_native_id()}"


def claim(job_id: int, owner: str, *, live_only: bool = True) -> bool:
    """Take or renew the right to follow a job (one follower per job; a lease, so a dead one is replaced)."""
    now = timezone.now()
    qs = Job.objects.filter(pk=job_id).filter(
        Q(follower="") | Q(follower=owner) | Q(follower_until__lt=now) | Q(follower_until__isnull=True)
    )
    if live_only:
        qs = qs.filter(state=Job.State.RUNNING)
    return bool(qs.update(follower=owner, follower_until=now + timedelta(seconds=settings.UGRO["FOLLOW_LEASE_S"])))


def release(job_id: int, owner: str) -> None:
    Job.objects.filter(pk=job_id, follower=owner).update(follower="", follower_until=None)


def _append(path: Path, offset: int, chunk: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.ftruncate(fd, offset)  # drop anything written past the committed offset
        os.lseek(fd, offset, os.SEEK_SET)
        view = memoryview(chunk)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def split_lines(data: bytes) -> list[str]:
    """Lines as the log file has them: split at b"\n" only (a tqdm bar's \r stays inside its line)."""
    if not data:
        return []
    lines = data.decode("utf-8", "replace").split("\n")
    if lines[-1] == "":
        lines.pop()
    return lines


def times_path(rank: Rank) -> Path:
    return rank.local_log.with_suffix(".times")


def last_lines(rank: Rank, count: int = 5) -> list[str]:
    try:
        with open(rank.local_log, "rb") as fh:
            fh.seek(max(0, os.fstat(fh.fileno()).st_size - 8192))
            tail = fh.read()
    except OSError:
        return []
    lines = [ln for ln in tail.decode("utf-8", "replace").splitlines() if ln.strip()]
    return [ln[:300] for ln in lines[-count:]]


class JobFollower:
    """Follows one job; keeps per-rank parser state between steps."""

    def __init__(self, job: Job, owner: str) -> None:
        self.job = job
        self.owner = owner
        self.streams: dict[int, RankStream] = {}
        self.lost_reasons: dict[int, str] = {}  # rank pk -> why its node could not be reached
        self.seen: dict[int, int] = {}  # rank pk -> log size at the last answer (partial line included)
        self.hot_node: int | None = None  # the node whose ranks last had new lines

    def _stream(self, rank: Rank) -> RankStream:
        stream = self.streams.get(rank.pk)
        if stream is None:
            stream = self.streams[rank.pk] = RankStream()
            last = MetricPoint.objects.filter(job=self.job, rank=rank.index).order_by("-step").first()
            if last:
                stream.parser.last_step = last.step  # inferred steps continue after a restart
        return stream

    def step(self, wait: float = 0.0) -> int:
        """One pass over every rank still running: returns the number of new bytes taken.

        wait: seconds one node may hold its answer until one of its logs grows (a long poll in
        the agent). Only the node that last had new lines waits (the first node until one has):
        the others answer at once, so a silent rank on another node never holds up rank 0's lines.
        """
        job = self.job
        ranks = list(job.ranks.select_related("node").filter(state__in=[Rank.State.RUNNING, Rank.State.PENDING]))
        by_node: dict[int, list[Rank]] = {}
        for r in ranks:
            by_node.setdefault(r.node_id, []).append(r)
        hot = self.hot_node if self.hot_node in by_node else next(iter(by_node), None)

        def tail(group: list[Rank]) -> dict:
            files = [
                {
                    "key": r.pk,
                    "path": r.remote_log,
                    "offset": r.log_offset,
                    "wait_above": self.seen.get(r.pk, 0),
                    "exit_file": r.remote_exit,
                    "max_bytes": TAIL_BYTES,
                }
                for r in group
            ]
            node_wait = wait if group[0].node_id == hot else 0.0
            return node_request(
                group[0].node, "tail", timeout=15 + node_wait, files=files, wait_ms=int(node_wait * 1000)
            )

        taken = 0
        now = None
        for group, result, err in on_each(list(by_node.values()), tail):
            now = now or timezone.now()  # after the answers: a long poll may have waited
            if err is not None:
                self._unreachable(group, err, now)
                continue
            for rank, item in zip(group, result["files"], strict=True):
                self.seen[rank.pk] = item.get("size") or 0
                got = self._take(rank, item, now)
                if got:
                    self.hot_node = rank.node_id
                taken += got
        follow_metric_files(job, ranks, node_request)  # metrics.csv / TensorBoard files the job named
        return taken

    def _take(self, rank: Rank, item: dict, now) -> int:
        data = base64.b64decode(item["data"])
        exited = item["exit"] is not None
        final = exited and item["eof"]
        if not final:
            cut = data.rfind(b"\n")
            data = data[: cut + 1] if cut >= 0 else b""
        lines = split_lines(data)
        stream = self._stream(rank)
        points, jsonl = parse_lines(self.job.pk, rank.index, lines, stream, now, end=final)
        old = rank.log_offset
        if data:
            _append(rank.local_log, old, data)
            with open(times_path(rank), "a") as fh:  # when each chunk arrived, for merged views
                fh.write(f"{old + len(data)} {now.timestamp():.3f}\n")
        fields = {"log_offset": old + len(data), "log_lines": rank.log_lines + len(lines), "last_contact": now}
        if final:
            rc = int(item["exit"]["rc"])
            ended = item["exit"].get("ended")
            fields.update(
                state=Rank.State.EXITED, exit_code=rc, ended_at=datetime.fromtimestamp(ended, tz=UTC) if ended else now
            )
        with transaction.atomic():
            if points:
                self._append_jsonl(jsonl)
                MetricPoint.objects.bulk_create(points, batch_size=2000)
            if not Rank.objects.filter(pk=rank.pk, log_offset=old).update(**fields):
                raise RuntimeError(f"rank {rank.index} of {self.job.name} was advanced by another follower")
            if points:
                Job.objects.filter(pk=self.job.pk).update(metrics_bytes=self.job.metrics_bytes)
        for key, value in fields.items():
            setattr(rank, key, value)
        # Every line goes out (in slices that keep messages small); start/end are the byte offsets
        # of this commit, so a page that loaded the log up to some offset can drop what it has.
        for i in range(0, max(len(lines), len(points)), PUBLISH_SLICE):
            publish_job(
                self.job,
                "lines",
                {
                    "rank": rank.index,
                    "start": old,
                    "end": old + len(data),
                    "lines": lines[i : i + PUBLISH_SLICE],
                    "points": [[p.rank, p.step, p.name, p.value] for p in points[i : i + PUBLISH_SLICE]],
                },
            )
        return len(data)

    def _append_jsonl(self, jsonl: list[str]) -> None:
        # Same rule as the logs: cut back to the committed size, append, commit the new size.
        chunk = ("\n".join(jsonl) + "\n").encode()
        _append(self.job.job_dir / "metrics.jsonl", self.job.metrics_bytes, chunk)
        self.job.metrics_bytes += len(chunk)

    def _unreachable(self, group: list[Rank], err: Exception, now) -> None:
        lost_after = settings.UGRO["NODE_LOST_AFTER_S"]
        for rank in group:
            since = rank.last_contact or rank.started_at or now
            if (now - since).total_seconds() > lost_after:
                Rank.objects.filter(pk=rank.pk).update(state=Rank.State.LOST)
                rank.state = Rank.State.LOST
                self.lost_reasons[rank.pk] = str(err)

    def verdict(self) -> tuple[str, str, Rank | None] | None:
        """(state, reason, the rank at fault) once the ranks say how the job ended, else None."""
        ranks = list(self.job.ranks.select_related("node").order_by("index"))
        lost = [r for r in ranks if r.state == Rank.State.LOST]
        if lost:
            r = lost[0]
            reason = self.lost_reasons.get(r.pk, "no contact")
            return Job.State.FAILED, f"node {r.node.name} (rank {r.index}) stopped answering: {reason}", r
        failed = sorted(
            (r for r in ranks if r.state == Rank.State.EXITED and r.exit_code != 0),
            key=lambda r: (r.ended_at or timezone.now(), r.index),
        )
        if failed:
            r = failed[0]
            lines = "\n".join("    " + ln for ln in last_lines(r))
            return (
                Job.State.FAILED,
                f"rank {r.index} on {r.node.name} exited with code {r.exit_text()}"
                + (f"; last lines:\n{lines}" if lines else ""),
                r,
            )
        if all(r.state == Rank.State.EXITED for r in ranks):
            return Job.State.SUCCEEDED, "", None
        return None


def finish_if_done(follower: JobFollower) -> bool:
    """End the job when its ranks say so: stop the rest on failure. True if the job ended."""
    from .stop import _end, release_nodes, stop_processes

    outcome = follower.verdict()
    if outcome is None:
        return False
    state, reason, culprit = outcome
    job = _end(follower.job, state, reason)
    if job.state == state and state == Job.State.FAILED:
        if culprit is not None and culprit.state == Rank.State.EXITED:
            from cluster.alerts import rank_died_alert

            rank_died_alert(culprit)  # a lost node is the health monitor's alert to raise
        stop_processes(job)
        drain(follower)
    release_nodes(job)
    publish_job(job, "state", {"state": job.state, "reason": job.failure_reason})
    return True


def drain(follower: JobFollower, timeout: float = 10.0) -> None:
    """Take what the stopped ranks wrote last (their wrappers record exit codes after the kill)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        follower.step()
        if not follower.job.ranks.filter(state__in=[Rank.State.RUNNING, Rank.State.PENDING]).exists():
            return
        time.sleep(0.2)


def drain_job(job: Job, timeout: float = 10.0) -> None:
    owner = follower_id() + ":drain"
    deadline = time.monotonic() + settings.UGRO["FOLLOW_LEASE_S"] + 1
    while not claim(job.pk, owner, live_only=False) and time.monotonic() < deadline:
        time.sleep(0.2)  # let the current follower finish its step
    try:
        drain(JobFollower(job, owner), timeout)
    finally:
        release(job.pk, owner)


def follow(
    max_seconds: float,
    job_ids: list[int] | None = None,
    owner: str | None = None,
    idle_sleep: float = 0.25,
    exit_when_idle: bool = False,
) -> None:
    """Follow running jobs (all, or the given ones) until none is left or max_seconds pass.

    exit_when_idle: return as soon as a pass finds no job this follower may follow (another
    follower holds them all, or none runs), so periodic tasks do not pile up.
    """
    owner = owner or follower_id()
    followers: dict[int, JobFollower] = {}
    deadline = time.monotonic() + max_seconds
    try:
        while time.monotonic() < deadline:
            started = time.monotonic()
            qs = Job.objects.filter(state=Job.State.RUNNING)
            if job_ids is not None:
                qs = qs.filter(pk__in=job_ids)
            running = list(qs)
            if not running and (job_ids is not None):
                return
            taken = 0
            # Instead of sleeping between idle passes, each job's node long-polls its share of
            # idle_sleep: a line is taken as soon as it is written, and an idle job costs the
            # same round trips per second as before.
            wait = min(idle_sleep / max(1, len(running)), max(0.0, deadline - time.monotonic()))
            for job in running:
                if not claim(job.pk, owner):
                    followers.pop(job.pk, None)
                    continue
                f = followers.get(job.pk)
                if f is None:
                    f = followers[job.pk] = JobFollower(job, owner)
                try:
                    taken += f.step(wait=wait)
                    if finish_if_done(f):
                        followers.pop(job.pk, None)
                        release(job.pk, owner)
                except (LinkError, AgentRequestError) as exc:
                    log.warning("following %s: %s", job.name, exc)
                except Exception:  # one job's trouble must not stop the others being followed
                    log.exception("following %s failed; starting afresh next pass", job.name)
                    followers.pop(job.pk, None)
            if exit_when_idle and not followers:
                return
            if not taken:
                # What the long polls did not already wait (all of it when nothing was polled;
                # also guards against a node answering early without new whole lines).
                time.sleep(max(0.0, min(idle_sleep - (time.monotonic() - started), deadline - time.monotonic())))
    finally:
        for job_id in list(followers):
            release(job_id, owner)
