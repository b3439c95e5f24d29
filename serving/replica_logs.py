"""Each replica's log, copied to the controller as it is written: the replica's page shows it live, and it stays
after the replica stops (or its node goes away).

The worker's pass reads what each started replica's engine wrote since the last pass, through its node agent's
`tail` op (as a job's follower reads a rank's log, jobs/follow.py), and appends it to
<DATA_DIR>/serve-logs/<service>/<index>-<tag>.log: one file per start, so a restart's log does not overwrite the
one that says why it was restarted. The offset is stored on the replica (log_tag, log_offset); the central file is
cut back to it before each append (jobs/logs.py write_at), so a crash between the two repeats nothing.

Bounded: a service runs for weeks and its engine logs a line per request. On the node, the log's disk blocks that
were copied here, but its newest NODE_KEEP_BYTES, are freed as each pass copies more (the agent's `tail` op punches
a hole: the file keeps its size and offsets, its writer goes on at the end). Here each start's copy is kept in
segments of SEGMENT_BYTES of its log (`<index>-<tag>.log`, then `.log.1`, `.log.2`, ...: segment k holds the log's
bytes from k x SEGMENT_BYTES), of which the last KEEP_SEGMENTS stay; and the copies of each replica index's last
KEEP_STARTS starts stay (the older ones are removed when a new start's copy begins).
"""

from __future__ import annotations

import logging
from pathlib import Path

from django.conf import settings

from cluster.fanout import node_request
from cluster.links import AgentRequestError, LinkError
from jobs.follow import tail_bytes
from jobs.logs import write_at

from .models import Replica

log = logging.getLogger(__name__)

READ_BYTES = 1024 * 1024  # at most this much of one replica's log per pass (engines log little once ready)
SHOWN_BYTES = 64 * 1024  # the page shows the last this much
SEGMENT_BYTES = 16 * 1024 * 1024
KEEP_SEGMENTS = 2  # at most 32 MiB of one start's log on the controller: its newest part
KEEP_STARTS = 5  # a replica index's copies of its last this many starts (a crash loop's earlier ones go)
NODE_KEEP_BYTES = 1024 * 1024  # the engine's log on its node keeps its newest this much on disk (see copy)


def central_path(replica: Replica, tag: str | None = None, segment: int = 0) -> Path:
    """The controller's copy of one start's log (its segment `segment`: see the module's docstring)."""
    name = f"{replica.index}-{tag or replica.tag}.log" + (f".{segment}" if segment else "")
    return Path(settings.DATA_DIR) / "serve-logs" / replica.service.name / name


def _write(replica: Replica, offset: int, data: bytes) -> None:
    """The log's bytes [offset, offset + len(data)) into their segments; segments before the last KEEP_SEGMENTS
    removed."""
    pos, view = offset, memoryview(data)
    while True:
        segment, within = divmod(pos, SEGMENT_BYTES)
        piece = view[: SEGMENT_BYTES - within]
        write_at(central_path(replica, segment=segment), within, bytes(piece))
        pos, view = pos + len(piece), view[len(piece) :]
        if not view:
            break
    # the last write left none before its first segment - KEEP_SEGMENTS + 1; this one may have begun new ones
    for old in range(max(0, offset // SEGMENT_BYTES - KEEP_SEGMENTS), segment - KEEP_SEGMENTS + 1):
        central_path(replica, segment=old).unlink(missing_ok=True)


def _forget_old_starts(replica: Replica) -> None:
    """Remove the copies of this replica index's starts but the last KEEP_STARTS (by when each was last written)."""
    folder = central_path(replica).parent
    starts: dict[str, float] = {}
    for path in folder.glob(f"{replica.index}-*.log*"):
        tag = path.name[len(f"{replica.index}-") :].split(".log")[0]
        try:
            starts[tag] = max(starts.get(tag, 0.0), path.stat().st_mtime)
        except FileNotFoundError:
            continue
    starts.pop(replica.tag, None)
    for tag in sorted(starts, key=starts.__getitem__, reverse=True)[KEEP_STARTS - 1 :]:
        for path in folder.glob(f"{replica.index}-{tag}.log*"):
            path.unlink(missing_ok=True)


def copy(replica: Replica) -> int:
    """Append what the replica's engine wrote since the last pass to its central copy; the bytes copied (0 when
    its node does not answer: the next pass tries again)."""
    if not replica.tag or replica.node is None:
        return 0
    offset = replica.log_offset if replica.log_tag == replica.tag else 0
    item = {"key": replica.tag, "path": replica.remote("log"), "offset": offset, "max_bytes": READ_BYTES}
    if offset > NODE_KEEP_BYTES:  # what is stored here already, but its newest part, leaves the node's disk
        item["release_before"] = offset - NODE_KEEP_BYTES
    try:
        answer = node_request(replica.node, "tail", timeout=10, files=[item])["files"][0]
    except (LinkError, AgentRequestError, OSError) as exc:
        log.info("service %s replica %s: log not read: %s", replica.service.name, replica.index, exc)
        return 0
    data = tail_bytes(answer)
    if not data and replica.log_tag == replica.tag:
        return 0
    if replica.log_tag != replica.tag:  # a new start's first copy
        _forget_old_starts(replica)
    _write(replica, offset, data)
    Replica.objects.filter(pk=replica.pk).update(log_tag=replica.tag, log_offset=offset + len(data))
    replica.log_tag, replica.log_offset = replica.tag, offset + len(data)
    return len(data)


def shown(replica: Replica, size: int = SHOWN_BYTES) -> str | None:
    """The last `size` bytes of the central copy of the replica's latest start's log; None when none was copied."""
    if not replica.log_tag:
        return None
    last = max(0, replica.log_offset - 1) // SEGMENT_BYTES
    chunks: list[bytes] = []
    wanted = size
    for segment in (last, last - 1):  # the last segment, and the one before where it holds less than `size`
        if segment < 0 or wanted <= 0:
            break
        path = central_path(replica, replica.log_tag, segment)
        try:
            with open(path, "rb") as fh:
                fh.seek(max(0, path.stat().st_size - wanted))
                chunks.insert(0, fh.read())
        except FileNotFoundError:
            break
        wanted -= len(chunks[0])
    if not chunks:
        return None
    return b"".join(chunks).decode("utf-8", "replace")
