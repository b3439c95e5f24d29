"""Following a job: copy each rank's log from its node, ingest metrics, notice how the ranks ended.

One follower per job, by a lease in the row of its current attempt. The follower owns what it writes: a
round of node reads starts with at least 7/8 of the lease left (renewed first unless that is so), no round
may outlast 3/4 of it, and every write
(central log, arrival times, metrics.jsonl, metric rows, offsets) happens inside a transaction that
first renews the lease with an UPDATE (a row lock), so a follower that lost its lease writes nothing
and a new one waits for the old one's last commit.

The charts' rollup is not written in those transactions (its upserts held the job's row lock as long
as the points' COPY did): after a pass, at most every ROLLUP_INTERVAL_S and always after a rank's last
lines, the follower folds the points stored since into it in a short transaction of its own
(metrics/rollup.py catch_up; the charts fold the points not yet in it themselves).

Exactly once across controller restarts: the central copy of a rank's log is truncated to the
offset stored in the DB before new bytes are appended, and the offset advances in the same
transaction as the metric points taken from those bytes. Only whole lines are taken while a rank
runs (a line with no newline is taken in LINE_CUT pieces once it is that long); its last partial
line is taken once it has exited.
"""

from __future__ import annotations

import base64
import logging
import math
import os
import socket
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from datetime import datetime, timedelta
from typing import NamedTuple

from django.conf import settings
from django.db import DatabaseError, connection, transaction
from django.db.models import Q
from django.utils import timezone

from cluster import links
from cluster.fanout import Late, node_request, on_each, unreachable
from cluster.links import AgentRequestError, LinkError
from cluster.models import Node
from metrics import rollup
from metrics.files import adopt, follow_metric_files
from metrics.ingest import RankStream, Sample, parse_lines, save_points
from metrics.models import JobMetrics, MetricFile

from . import checkpoints, discovery, lifecycle
from .events import publish_job
from .logs import LINE_CUT, display_text, store_chunk, write_at
from .models import Attempt, Job, Rank

log = logging.getLogger(__name__)
TAIL_BYTES = 4 * 1024 * 1024
PUBLISH_SLICE = 1000  # lines (and points) of one rank in one part of an event
EVENT_LINES = 3000  # lines (or points) of all parts in one event: a message stays under ~200 KB


class LeaseLost(Exception):
    """Another follower holds the job now: this one must write nothing more."""


def follower_id() -> str:
    """Who follows: host, process and thread. Per thread, because a threads-pool worker runs several
    follow_jobs tasks at once (beat queues one every few seconds) and each must see the others'
    leases as someone else's, or all of them follow the same job and trip over each other."""
    return f"{socket.gethostname()}:{os.getpid()}:{threading.get_native_id()}"


# The follower's node reads, on threads that are kept (cluster/fanout.py on_each). A read only waits for its node, so
# the pool cannot deadlock; when more reads are under way than it has threads, the rest queue for a moment.
READS = ThreadPoolExecutor(max_workers=64, thread_name_prefix="ugro-follow-read")
PASS_READ_GRACE_S = 2.0  # beyond a pass's long-poll wait, how long it waits for a node's read

MORE_WANTED_EVERY_S = 2.0
LANES = 8  # jobs whose passes run side by side when one follower takes every job (the CLI's, the tests')
ROUND_GRACE_S = 0.25  # beyond its long-poll wait, how long a round waits for its jobs' passes
# A follower whose passes take nothing polls less often: each quiet round doubles its idle budget (the long
# polls' wait, or the sleep), up to QUIET_MAX_FACTOR x idle_sleep; a round that takes anything resets it.
# Without it every idle job costs a steady stream of round trips and queries.
# Lines on the node that last had some still come at once (its long poll answers when its log grows);
# a quiet job's other nodes are asked at most every QUIET_MAX_FACTOR x idle_sleep (1 s by default).
QUIET_MAX_FACTOR = 4
# A follower's claim on a job lasts this long unrenewed: a dead follower's jobs are taken over within it, and
# no read may outlast it (a quarter to wait for lines, half to answer).
FOLLOW_LEASE_S = 15.0
# MIN_ROUND: a round of passes that took lines is followed by the next no sooner than this after it began;
# lines that stream in are taken a round's worth at a time, not a pass, an event and a commit per line.
FOLLOW_MIN_ROUND_S = 0.05
ROLLUP_INTERVAL_S = 1.0  # how often a job's new points are folded into the charts' rollup: the charts show the rest
CHECKPOINT_SCAN_S = 30.0  # how often a running rank's checkpoint directory is listed: saves come minutes apart


def claim(job_id: int, owner: str, *, any_state: bool = False) -> bool:
    """Take or renew the right to follow a job with output to copy (one follower per job; a lease, so a
    dead follower is replaced). any_state: also a job with no running rank (to fetch a lost rank's rest)."""
    now = timezone.now()
    qs = Attempt.objects.filter(pk__in=Job.objects.filter(pk=job_id).values("current")).filter(
        Q(follower="") | Q(follower=owner) | Q(follower_until__lt=now) | Q(follower_until__isnull=True)
    )
    if not any_state:
        qs = qs.filter(pk__in=Job.objects.filter(lifecycle.followable()).values("current"))
    return bool(qs.update(follower=owner, follower_until=now + timedelta(seconds=FOLLOW_LEASE_S)))


def followed_by_nobody(job: Job | _Listed, now: datetime) -> bool:
    """Whether any follower may claim the job now (no lease, or a lapsed one): claim's condition, read
    from a job row already loaded."""
    return job.follower == "" or job.follower_until is None or job.follower_until < now


def renew(job_id: int, owner: str, *, grow: int = 0, relaxed: bool = False) -> int:
    """Extend this follower's lease if it still holds it; LeaseLost otherwise. Inside a transaction the
    statement also locks the job's row (and its current attempt's) until commit. Returns the job's committed
    metrics.jsonl size, read by the same statement (a pass that stores points needs it).

    grow: bytes this transaction appends to metrics.jsonl: the committed size is raised by them in the same
    statement (the caller writes them at the size returned, and a rollback undoes both). relaxed: this
    transaction commits without waiting for its WAL to reach the disk (PostgreSQL's synchronous_commit off,
    set in the same round trip). A database crash may then lose the last fraction of a second of commits,
    never corrupt them; and what it loses is taken again: the central files are cut back to the offsets the
    database kept before anything is appended (see above). One statement, since every pass of every followed
    job makes it: a round trip each for the lease, the size and the commit mode would cost the worker more."""
    now = timezone.now()
    jobs, attempts = (connection.ops.quote_name(m._meta.db_table) for m in (Job, Attempt))
    # The job's row is locked first, then its attempt's: the order every lifecycle move takes (_move updates
    # the job, then the attempt). The other order deadlocked a follower's pass against a job failing at the
    # same moment. The lease is checked again on the attempt's row once it is locked (a follower that took it
    # meanwhile wins: no row, LeaseLost, and the caller's rollback undoes the job's bump).
    sql = (
        f"WITH bump AS (UPDATE {jobs} AS j SET metrics_bytes = j.metrics_bytes + %s FROM {attempts} AS a"
        " WHERE j.id = %s AND a.id = j.current_id AND a.follower = %s AND a.follower_until > %s"
        " RETURNING j.current_id, j.metrics_bytes - %s AS committed)"
        f" UPDATE {attempts} AS a SET follower_until = %s FROM bump"
        " WHERE a.id = bump.current_id AND a.follower = %s AND a.follower_until > %s"
        " RETURNING bump.committed"
    )
    params = [grow, job_id, owner, now, grow, now + timedelta(seconds=FOLLOW_LEASE_S), owner, now]
    with connection.cursor() as cursor:
        cursor.execute(f"{RELAXED_COMMIT}; {sql}" if relaxed else sql, params)
        if relaxed:
            cursor.nextset()  # the SET's result first, then the UPDATE's
        row = cursor.fetchone()
    if row is None:
        raise LeaseLost(f"job {job_id}: lease lost to another follower")
    return row[0]


RELAXED_COMMIT = "SET LOCAL synchronous_commit TO OFF"


def release(job_id: int, owner: str) -> None:
    Attempt.objects.filter(job_id=job_id, follower=owner).update(follower="", follower_until=None)


def tail_bytes(item: dict) -> bytes:
    """The bytes of one file of a `tail` answer (zlib-compressed by the agent when asked and worth it)."""
    raw = base64.b64decode(item["data"])
    if not item.get("zlib"):
        return raw
    return zlib.decompressobj().decompress(raw, TAIL_BYTES)  # never more than was asked for


def split_lines(data: bytes) -> list[str]:
    """Lines as the log file has them: split at b"\n" only (a tqdm bar's \r stays inside its line),
    and pieces of at most LINE_CUT bytes (the log view reads the file the same way)."""
    if not data:
        return []
    lines = []
    for raw in data.split(b"\n"):
        for i in range(0, max(1, len(raw)), LINE_CUT):
            lines.append(raw[i : i + LINE_CUT].decode("utf-8", "replace"))
    if data.endswith(b"\n"):
        lines.pop()
    return lines


def takeable(data: bytes, final: bool) -> bytes:
    """The part of new log bytes to take now: whole lines, plus whole LINE_CUT pieces of a line that has
    no newline yet (a progress bar redrawn with \r, a binary dump), or everything once the rank exited."""
    if final:
        return data
    cut = data.rfind(b"\n") + 1
    rest = len(data) - cut
    return data[: cut + (rest // LINE_CUT) * LINE_CUT]


class _Taken(NamedTuple):
    """What one rank's answer adds in a pass, before it is stored."""

    rank: Rank
    old: int  # the rank's log offset before them
    data: bytes  # the log bytes taken
    lines: list[str]
    points: list[Sample]
    fields: dict  # the rank's new offset, line count and contact time
    exit_info: dict | None  # its exit record, once its log is complete
    final: bool  # nothing more will come from it


class JobFollower:
    """Follows one job; keeps per-rank parser state between steps."""

    def __init__(self, job: Job, owner: str) -> None:
        self.job = job
        self.owner = owner
        self.streams: dict[int, RankStream] = {}
        self.seen: dict[int, int] = {}  # rank pk -> log size at the last answer (partial line included)
        self.hot_node: int | None = None  # the node whose ranks last had new lines
        self.scanned: dict[int, float] = {}  # rank pk -> monotonic time its checkpoints were last listed
        self.discovered: dict[int, float] = {}  # rank pk -> monotonic time its workdir was last walked
        self.changed = True  # a rank ended or was lost since the job was last judged (judge on the first pass)
        # monotonic time to judge the job again with no change seen: a failure that is only a consequence waits
        # FAILURE_SETTLE_S for its cause, and may have to be decided with nothing else happening meanwhile
        self.judge_at: float | None = None
        # points stored since the rollup last caught up (at first too: a follower before this one may have
        # stopped before it folded its last points)
        self.unfolded = True
        self.folded_at = -math.inf  # monotonic time of the last catch_up
        self.missed = False  # an event of this job could not be sent: pages must resync before the next
        self.renewed_at = -math.inf  # monotonic time this follower last renewed its lease
        self.metric_files: bool | None = None  # the job names metric files to follow (None: not read yet)
        self.ranks: list[Rank] | None = None  # the running ranks as last loaded (see running_ranks)

    def renew(self, *, grow: int = 0, relaxed: bool = False) -> int:
        """renew() this follower's lease (LeaseLost if another holds it), noting when; the job's committed
        metrics.jsonl size."""
        committed = renew(self.job.pk, self.owner, grow=grow, relaxed=relaxed)
        self.renewed_at = time.monotonic()
        return committed

    def holds_lease(self, within: float = 1 / 3) -> bool:
        """Whether the lease was renewed within this fraction of it. Within a third, a claim would only renew
        it again: the next pass renews it anyway (LeaseLost then, if another follower took it meanwhile)."""
        return time.monotonic() - self.renewed_at < FOLLOW_LEASE_S * within

    def running_ranks(self) -> list[Rank]:
        """The job's running ranks, with their nodes. Each pass asks only which ranks run (one light statement):
        the rows are loaded again (with their nodes, through the ORM: too costly for every pass) only when
        that set changed. What a pass reads on them stays true meanwhile: the
        offsets, line counts, contact times and steps are written only by the lease holder, which is this
        follower as long as it writes at all (LeaseLost otherwise, and a new follower starts afresh), and a
        rank that is lost or exits leaves the running set."""
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT id FROM {connection.ops.quote_name(Rank._meta.db_table)} WHERE job_id = %s AND state = %s",
                [self.job.pk, Rank.State.RUNNING],
            )
            running = {row[0] for row in cursor.fetchall()}
        if self.ranks is None or running != {r.pk for r in self.ranks}:
            self.ranks = list(self.job.ranks.select_related("node").filter(state=Rank.State.RUNNING))
        return self.ranks

    def _stream(self, rank: Rank) -> RankStream:
        stream = self.streams.get(rank.pk)
        if stream is None:
            stream = self.streams[rank.pk] = RankStream()
            if rank.metric_step is not None:
                # inferred steps go on after a change of follower from the step the last one recorded on the
                # rank's row with its last points (reading it from the points sorted the job's every point)
                stream.parser.last_step = rank.metric_step
        return stream

    def step(self, wait: float = 0.0) -> int:
        """One pass over every rank still running: returns the number of new bytes taken.

        wait: seconds one node may hold its answer until one of its logs grows (a long poll in
        the agent). Only the node that last had new lines waits (the first node until one has):
        the others answer at once, so a silent rank on another node never holds up rank 0's lines.
        Raises LeaseLost when another follower took the job.
        """
        job = self.job
        ranks = self.running_ranks()
        by_node: dict[int, list[Rank]] = {}
        for r in ranks:
            by_node.setdefault(r.node_id, []).append(r)
        hot = self.hot_node if self.hot_node in by_node else next(iter(by_node), None)
        # No read may outlast the lease: half of it (at most the connect timeout) to answer, a quarter of it to
        # wait for lines. A node gone silent holds up this pass (and the other jobs of this follow task) once,
        # for that long: then its link is silent, and reads of it fail at once until the health poll or the
        # reconciler reaches it again.
        wait = min(wait, FOLLOW_LEASE_S / 4)
        read_timeout = min(FOLLOW_LEASE_S / 2, links.CONNECT_TIMEOUT_S)

        def tail(group: list[Rank]) -> dict:
            files = [
                {
                    "key": r.pk,
                    "path": r.remote_log,
                    "offset": r.log_offset,
                    "wait_above": self.seen.get(r.pk, 0),
                    "exit_file": r.remote_exit,
                    "max_bytes": TAIL_BYTES,
                    "zlib": True,
                }
                for r in group
            ]
            node_wait = wait if group[0].node_id == hot else 0.0
            return node_request(
                group[0].node, "tail", timeout=read_timeout + node_wait, when_silent=False, files=files,
                wait_ms=int(node_wait * 1000),
            )  # fmt: skip

        # The lease must outlast the reads (at most 3/4 of it, above): renewed first unless it was renewed within
        # the last 1/8 of it (the pass before, as a rule: an UPDATE saved per pass). Whatever the reads bring is
        # written only after the transaction's own renewal (LeaseLost there if another follower took over).
        if not self.holds_lease(within=1 / 8):
            self.renew()
        now = None
        answered: list[tuple[Rank, dict, bool]] = []
        # A node that answers nothing within its wait and PASS_READ_GRACE_S more holds up neither this pass nor
        # the other jobs of this follow task: its read finishes on its own (unused), this pass goes on, and its
        # link counts as silent until that read is answered.
        gathered = on_each(list(by_node.values()), tail, pool=READS, within=wait + PASS_READ_GRACE_S)
        for group, result, err in gathered:
            now = now or timezone.now()  # after the answers: a long poll may have waited
            if isinstance(err, Late):  # the next passes skip it until that read answers (or times out)
                group[0].node.link().mark_silent()
            if err is not None:
                self._unreachable(group, err, now)
                continue
            for rank, item in zip(group, result["files"], strict=True):
                self.seen[rank.pk] = item.get("size") or 0
                answered.append((rank, item, False))
        # The discovery walks and the metric files (metrics.csv, TensorBoard files the job named or a walk found)
        # before the lines and exits commit: once a rank's exit commits, the reconciler may judge the job ended at
        # once, and an ended job's output must all be in (a framework writes its files' last rows on its way out).
        # A rank whose exit this pass saw is walked and read as ended (once more, whatever the interval).
        ending = {rank.pk: lifecycle.as_exited(rank) for rank, item, _ in answered
                  if item["exit"] is not None and item["eof"]}  # fmt: skip
        for rank, _, _ in answered:
            self._scan_checkpoints(ending.get(rank.pk, rank))
        # whether there are metric files is read once, then known from what discovery adopts
        if self.metric_files is None:
            named = JobMetrics.objects.filter(job=job).values_list("files", flat=True).first()
            self.metric_files = bool(named) or MetricFile.objects.filter(job=job).exists()
        if self.metric_files:
            self._files_win()
            if follow_metric_files(job, [ending.get(r.pk, r) for r in ranks], node_request, guard=self.renew):
                self.unfolded = True
        got = self._take_all(answered, now) if answered else {}
        for rank, _, _ in answered:
            if got.get(rank.pk):
                self.hot_node = rank.node_id
        return sum(got.values())

    def fold(self, *, now: bool = False) -> None:
        """Fold the points stored since the last fold into the charts' rollup: at most every
        ROLLUP_INTERVAL_S, or at once (a rank's last lines are in, the follower stops). Outside the lease's
        transaction, in one of its own; a database error leaves the points for the next fold."""
        if not self.unfolded or (not now and time.monotonic() - self.folded_at < ROLLUP_INTERVAL_S):
            return
        self.folded_at = time.monotonic()
        try:
            rollup.catch_up(self.job.pk)
        except DatabaseError as exc:
            log.warning("rollup of %s: %s", self.job.name, exc)
            return
        self.unfolded = False

    def _scan_checkpoints(self, rank: Rank) -> None:
        """Walk the rank's workdir for metric files and checkpoints every DISCOVER_EVERY_S while it runs (and
        list its named checkpoint places every CHECKPOINT_SCAN_S), once more when it ends (jobs/discovery.py;
        jobs/checkpoints.py decides which checkpoints are complete)."""
        ended = rank.state != Rank.State.RUNNING
        last = self.discovered.get(rank.pk)
        if ended or last is None or time.monotonic() - last >= discovery.DISCOVER_EVERY_S:
            self.discovered[rank.pk] = time.monotonic()
            found = discovery.walk(rank, rank.started_at or self.job.started_at or timezone.now())
            if found:
                if adopt(self.job, rank, found):
                    self.metric_files = True
                checkpoints.record_found(rank, found)
        last = self.scanned.get(rank.pk)
        every = CHECKPOINT_SCAN_S
        if not ended and last is not None and time.monotonic() - last < every:
            return
        self.scanned[rank.pk] = time.monotonic()
        try:
            checkpoints.scan(rank)
        except (LinkError, AgentRequestError) as exc:
            log.info("checkpoints of %s: %s", rank, exc)

    def _files_win(self) -> None:
        """A job that reads metric files takes only steps and progress from its progress bars, not their
        rounded values (the file's are exact, at the framework's own steps)."""
        for stream in self.streams.values():
            stream.parser.bar_metrics = False

    def recover(self) -> int:
        """Fetch what lost ranks wrote after they were lost, once their node answers again. A rank is
        drained when its exit record is read to the end, or when its node rebooted (nothing more comes)."""
        ranks = self.job.ranks.select_related("node", "job").filter(state=Rank.State.LOST, drained=False)
        ranks = list(ranks.exclude(node__status__in=Node.NOT_ANSWERING))  # a DOWN node: its probe says when it is back
        taken = 0
        self.renew()
        for rank in ranks:
            asked = ask_lost(rank)
            if asked is None:
                continue  # still away
            item, rebooted = asked
            taken += self._take(rank, item, timezone.now(), final=rebooted and item["eof"])
            if rebooted and item["eof"]:
                lifecycle.rank_drained(rank)
        return taken

    def _take(self, rank: Rank, item: dict, now: datetime, final: bool = False) -> int:
        return self._take_all([(rank, item, final)], now)[rank.pk]

    def _take_all(self, answered: list[tuple[Rank, dict, bool]], now: datetime) -> dict[int, int]:
        """Store what the nodes answered for these ranks (rank, tail item, final: nothing more will come) in
        one transaction under the lease: every rank's log bytes, the job's metric points and metrics.jsonl
        lines, each rank's new offset (compare-and-set); then publish them. Bytes taken, per rank pk."""
        taken: list[_Taken] = []
        jsonl: list[str] = []
        quiet: list[Rank] = []
        for rank, item, final in answered:
            raw = tail_bytes(item)
            exited = item["exit"] is not None
            final = final or (exited and item["eof"])
            data = takeable(raw, final)
            if not data and not final:
                quiet.append(rank)
                continue
            lines = split_lines(data)
            points, rank_jsonl = parse_lines(
                self.job.pk, rank.index, lines, self._stream(rank), now, end=final, attempt=self.job.attempt
            )
            if points:  # a rank's metrics.jsonl lines go with its points (a final summary alone is not written)
                jsonl += rank_jsonl
            fields = {"log_offset": rank.log_offset + len(data), "log_lines": rank.log_lines + len(lines),
                      "last_contact": now}  # fmt: skip
            if points:
                fields["metric_step"] = self.streams[rank.pk].parser.last_step
            exit_info = item["exit"] if final and exited else None
            taken.append(_Taken(rank, rank.log_offset, data, lines, points, fields, exit_info, final))
        if quiet:
            Rank.objects.filter(pk__in=[r.pk for r in quiet]).update(last_contact=now)
            for rank in quiet:  # the follower keeps these rows between passes (running_ranks): silence counts from here
                rank.last_contact = now
        if taken:
            points = [p for t in taken for p in t.points]
            chunk = ("\n".join(jsonl) + "\n").encode() if points else b""
            with transaction.atomic():
                # the lease renewed (locking the job's row: no other follower writes meanwhile), the chunk's
                # bytes added to the committed metrics.jsonl size and the commit relaxed, in one statement
                committed = self.renew(grow=len(chunk), relaxed=True)
                for t in taken:
                    if t.data:
                        store_chunk(t.rank, t.old, t.data, now.timestamp())
                if points:
                    # same rule as the logs: cut back to the committed size, append; the new size commits with it
                    write_at(self.job.job_dir / "metrics.jsonl", committed, chunk)
                    save_points(points)
                    self.unfolded = True
                if not lifecycle.ranks_progress([(t.rank, t.old, t.fields, t.exit_info) for t in taken]):
                    raise LeaseLost(f"a rank of {self.job.name} was advanced by another follower")
            self.changed = self.changed or any(t.final for t in taken)
            self._publish(taken)
        sizes = {rank.pk: 0 for rank, _, _ in answered}
        sizes.update({t.rank.pk: len(t.data) for t in taken})
        return sizes

    def _publish(self, taken: list[_Taken]) -> None:
        """One "batch" event for the pass (more only past EVENT_LINES lines or points): each part is one
        rank's commit, {"rank", "start", "end", "lines", "points"}, start/end its byte offsets, so a page
        that loaded the log up to some offset can drop what it has. An event per rank cost the worker, the
        channel layer and every viewer's web process a message each (daphne's cost is per message).

        An event that could not be sent (Redis slow or away) is not sent again: the next one sent is
        preceded by a "resync", on which the job's pages reload their log and curves from the database."""
        if self.missed and publish_job(self.job, "resync", {}):
            self.missed = False
        parts: list[dict] = []
        held = 0  # lines (or points) in parts
        for t in taken:
            shown = [display_text(ln) for ln in t.lines]
            pairs = [[p.rank, p.step, p.name, p.value] for p in t.points]
            for i in range(0, max(len(shown), len(pairs)), PUBLISH_SLICE):
                part = {"rank": t.rank.index, "start": t.old, "end": t.old + len(t.data),
                        "lines": shown[i : i + PUBLISH_SLICE], "points": pairs[i : i + PUBLISH_SLICE]}  # fmt: skip
                size = max(len(part["lines"]), len(part["points"]))
                if parts and held + size > EVENT_LINES:
                    self.missed |= not publish_job(self.job, "batch", {"parts": parts})
                    parts, held = [], 0
                parts.append(part)
                held += size
        if parts:
            self.missed |= not publish_job(self.job, "batch", {"parts": parts})

    def _unreachable(self, group: list[Rank], err: Exception, now: datetime) -> None:
        if not unreachable(err):
            return  # the node took the request (or answered an error): it is there, if slow
        lost_after = settings.UGRO["NODE_LOST_AFTER_S"]
        for rank in group:
            since = rank.last_contact or rank.started_at or now
            if (now - since).total_seconds() > lost_after and lifecycle.rank_lost(
                rank, f"node {rank.node.name} stopped answering: {err}"
            ):
                self.changed = True


def ask_lost(rank: Rank) -> tuple[dict, bool] | None:
    """A lost rank's node asked for what its log holds past the copied offset, and whether the node rebooted since
    the rank started (nothing more will come); None while the node does not answer."""
    try:
        boot_now = (node_request(rank.node, "hello", timeout=5) or {}).get("boot_id") or ""
        item = node_request(
            rank.node, "tail", timeout=FOLLOW_LEASE_S / 2,
            files=[{"key": rank.pk, "path": rank.remote_log, "offset": rank.log_offset,
                    "exit_file": rank.remote_exit, "max_bytes": TAIL_BYTES, "zlib": True}],
        )["files"][0]  # fmt: skip
    except (LinkError, AgentRequestError, OSError):
        return None
    return item, bool(rank.boot_id and boot_now and boot_now != rank.boot_id)


def recover_output(job: Job, owner: str) -> bool:
    """Fetch the rest of a lost rank's output (an ended job's); True if anything was taken."""
    if not claim(job.pk, owner, any_state=True):
        return False
    follower = JobFollower(job, owner)
    try:
        return follower.recover() > 0
    except LeaseLost:
        return False
    finally:
        follower.fold(now=True)
        release(job.pk, owner)


def recover_earlier_output(job: Job) -> int:
    """What lost ranks of the job's earlier attempts wrote after they were lost (most often the traceback that says
    why), once their node answers again, whatever the job does now: appended to that attempt's central log (where
    jobs/logs.py archive_logs moved it). The log only: the attempt's curve ended with it, and its points past the
    step the next attempt resumed from are superseded. A rank is drained when its exit record is read to the end,
    or when its node rebooted (nothing more comes). Each rank's offset moves by compare-and-set, so two workers
    never append the same bytes twice. Bytes taken."""
    ranks = (Rank.objects.filter(job=job, state=Rank.State.LOST, drained=False).exclude(attempt_id=job.current_id)
             .exclude(node__status__in=Node.NOT_ANSWERING).select_related("node", "job", "attempt"))  # fmt: skip
    taken = 0
    for rank in ranks:
        asked = ask_lost(rank)
        if asked is None:
            continue  # still away
        item, rebooted = asked
        final = bool(item["eof"] and (item["exit"] is not None or rebooted))
        data = takeable(tail_bytes(item), final)
        if data:
            now = timezone.now()
            with transaction.atomic():
                moved = Rank.objects.filter(pk=rank.pk, log_offset=rank.log_offset).update(
                    log_offset=rank.log_offset + len(data), log_lines=rank.log_lines + len(split_lines(data)),
                    last_contact=now,
                )  # fmt: skip
                if not moved:
                    continue  # another worker took these bytes
                store_chunk(rank, rank.log_offset, data, now.timestamp())
            taken += len(data)
        if final:
            lifecycle.rank_drained(rank)
    return taken


class _Listed(NamedTuple):
    """What a round of follow() reads of each job with output to copy."""

    pk: int
    attempt: int
    follower: str
    follower_until: datetime | None
    name: str


LISTED = ("pk", "current__number", "current__follower", "current__follower_until", "name")  # _Listed's columns


def follow(
    max_seconds: float,
    job_ids: list[int] | None = None,
    owner: str | None = None,
    idle_sleep: float = 0.25,
    exit_when_idle: bool = False,
    max_jobs: int | None = None,
    more_wanted: Callable[[], object] | None = None,
    stopping: Callable[[], bool] | None = None,
) -> None:
    """Follow jobs with output to copy (all, or the given ones) until none is left or max_seconds pass.

    After each pass a RUNNING job is judged: its end (success, or failure and the stopping of the
    rest) is decided by jobs/lifecycle.py. exit_when_idle: return as soon as a pass finds no job this
    follower may follow (another follower holds them all, or none runs), so periodic tasks do not pile up.
    max_jobs: follow at most this many jobs at once; when jobs nobody follows are left over, call
    more_wanted (at most every MORE_WANTED_EVERY_S) so that another follower takes them: each job's
    pass then waits only for its own nodes and writes, not for every other job's.
    stopping: checked between passes; once it says so, the jobs are handed back (leases released) at
    once, for the next follower to take without waiting for a lease to lapse.
    idle_sleep: the time a round of passes spends waiting for lines; it grows while rounds take nothing
    (QUIET_MAX_FACTOR).
    """
    owner = owner or follower_id()
    followers: dict[int, JobFollower] = {}
    deadline = time.monotonic() + max_seconds
    asked_more = 0.0
    budget = idle_sleep
    # Every round lists the jobs to follow: compiled once, run as one light statement (whole Job rows through
    # the ORM, every round of every follow task, cost the worker too much at that rate).
    # A job gets its whole row only when a follower for it starts.
    listing = Job.objects.filter(pk__in=Job.objects.filter(lifecycle.followable()).values("pk"))
    if job_ids is not None:
        listing = listing.filter(pk__in=job_ids)
    listing_sql = listing.values_list(*LISTED).query.sql_with_params()
    lanes: ThreadPoolExecutor | None = None  # the jobs' passes, side by side (made when two jobs are followed)
    inflight: dict[int, tuple[_Listed, Future]] = {}  # job pk -> its pass still running on a lane
    try:
        while time.monotonic() < deadline and not (stopping is not None and stopping()):
            started = time.monotonic()
            with connection.cursor() as cursor:
                cursor.execute(*listing_sql)
                active = [_Listed(*row) for row in cursor.fetchall()]
            if not active and (job_ids is not None):
                return
            listed = {job.pk for job in active}
            for job_id in [pk for pk in followers if pk not in listed and pk not in inflight]:
                # no rank of it runs any more: its follower is done (else, held here, it kept an idle task
                # from exiting for max_seconds, and such tasks took every thread of the worker)
                followers.pop(job_id).fold(now=True)
                release(job_id, owner)
            taken = 0
            # Instead of sleeping between idle passes, each job's node long-polls its share of
            # idle_sleep: a line is taken as soon as it is written, and an idle job costs the
            # same round trips per second as before.
            held = len(active) if max_jobs is None else min(len(active), max_jobs)
            wait = min(budget / max(1, held), max(0.0, deadline - time.monotonic()))
            left_over = False
            passes: list[tuple[_Listed, JobFollower]] = []
            for job in active:
                if job.pk in inflight:  # its pass from an earlier round still waits for its node
                    continue
                if max_jobs is not None and job.pk not in followers and len(followers) >= max_jobs:
                    left_over = left_over or followed_by_nobody(job, timezone.now())
                    continue
                f = followers.get(job.pk)
                holding = f is not None and f.job.attempt == job.attempt and f.holds_lease()
                # no claim (an UPDATE) while this follower's lease is fresh: not one per pass; nor for a job whose
                # row, as read this round, shows another follower's live lease (else a follower with room would
                # try every such job every round)
                claimable = job.follower == owner or followed_by_nobody(job, timezone.now())
                if not holding and not (claimable and claim(job.pk, owner)):
                    followers.pop(job.pk, None)
                    continue
                if f is None or f.job.attempt != job.attempt:  # a resumed job's next attempt: start afresh
                    row = Job.objects.select_related("current").filter(pk=job.pk).first()
                    if row is None:  # deleted meanwhile
                        followers.pop(job.pk, None)
                        continue
                    f = followers[job.pk] = JobFollower(row, owner)
                passes.append((job, f))
            # Each job's pass on a thread of its own when several are followed: a pass that waits for a silent
            # node (up to its wait + PASS_READ_GRACE_S) holds up neither the other jobs' passes nor the rounds
            # after this one, which go on without that job until its pass is back
            if len(passes) > 1 or inflight:
                if lanes is None:
                    lanes = ThreadPoolExecutor(max_workers=max_jobs or LANES, thread_name_prefix="ugro-follow-job")
                for job, f in passes:
                    inflight[job.pk] = (job, lanes.submit(_one_pass, f, wait))
                futures_wait([fut for _, fut in inflight.values()], timeout=wait + ROUND_GRACE_S)
                results = []
                for pk, (job, fut) in list(inflight.items()):
                    if fut.done():
                        del inflight[pk]
                        results.append((job, fut.exception() or fut.result()))
            else:
                results = [(job, _catching(_one_pass, f, wait)) for job, f in passes]
            for job, result in results:
                if isinstance(result, LeaseLost):
                    log.info("following %s: %s", job.name, result)
                    followers.pop(job.pk, None)
                elif isinstance(result, (LinkError, AgentRequestError)):
                    log.warning("following %s: %s", job.name, result)
                elif isinstance(result, BaseException):  # one job's trouble must not stop the others being followed
                    log.error("following %s failed; starting afresh next pass", job.name, exc_info=result)
                    followers.pop(job.pk, None)
                else:
                    taken += result
            if left_over and more_wanted is not None and time.monotonic() - asked_more > MORE_WANTED_EVERY_S:
                asked_more = time.monotonic()
                more_wanted()
            if exit_when_idle and not followers:
                return
            if taken:
                budget = idle_sleep
                # MIN_ROUND: the next round no sooner than FOLLOW_MIN_ROUND_S after this one began. Without
                # it a rank printing every 20 ms would get a pass, an event and a commit of its own per line or
                # two, and the worker and the web process would spend their CPU on those.
                rest = min(FOLLOW_MIN_ROUND_S - (time.monotonic() - started),
                           deadline - time.monotonic())  # fmt: skip
                if rest > 0:
                    time.sleep(rest)
            else:
                # What the long polls did not already wait (all of it when nothing was polled;
                # also guards against a node answering early without new whole lines).
                time.sleep(max(0.0, min(budget - (time.monotonic() - started), deadline - time.monotonic())))
                budget = min(budget * 2, idle_sleep * QUIET_MAX_FACTOR)
    finally:
        if inflight:  # their reads end within their own timeouts
            futures_wait([fut for _, fut in inflight.values()])
        if lanes is not None:
            _close_lanes(lanes, max_jobs or LANES)
        for job_id, f in list(followers.items()):
            f.fold(now=True)
            release(job_id, owner)


def _one_pass(f: JobFollower, wait: float) -> int:
    """One job's pass: its new lines and points taken, the job judged when a rank ended (or a settling failure
    is due), its rollup folded. Bytes taken; raises LeaseLost, a link error, or whatever went wrong."""
    taken = f.step(wait=wait)
    ended = f.changed
    due = f.judge_at is not None and time.monotonic() >= f.judge_at
    if ended or due:  # only a rank's end or loss can end the job: not every pass
        f.changed = False
        f.job.refresh_from_db()
        f.judge_at = None
        if not lifecycle.judge(f.job) and lifecycle.failure_settling(f.job):
            f.judge_at = time.monotonic() + lifecycle.FAILURE_SETTLE_S
    f.fold(now=ended)  # after a rank's last lines at once: an ended job's rollup is whole
    return taken


def _catching(fn: Callable[..., int], *args) -> int | BaseException:
    try:
        return fn(*args)
    except Exception as exc:  # handed to the caller, as a pool's future hands it
        return exc


def _close_lanes(lanes: ThreadPoolExecutor, workers: int) -> None:
    """Close each lane thread's database connection (one each; left open, they would outlive the follow task
    and hold the database), then the pool."""
    gate = threading.Barrier(workers, timeout=5)

    def close() -> None:
        try:
            gate.wait()  # every thread takes one: none closes twice while another keeps its connection
        except threading.BrokenBarrierError:
            pass
        connection.close()

    for _ in range(workers):
        lanes.submit(close)
    lanes.shutdown(wait=True)
