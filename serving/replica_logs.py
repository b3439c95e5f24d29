"""Each replica's log, copied to the controller as it is written: the replica's page shows it live, and it stays
after the replica stops (or its node goes away).

The worker's pass reads what each started replica's engine wrote since the last pass, through its node agent's
`tail` op (as a job's follower reads a rank's log, jobs/follow.py), and appends it to
<DATA_DIR>/serve-logs/<service>/<index>-<tag>.log: one file per start, so a restart's log does not overwrite the
one that says why it was restarted. The offset is stored on the replica (log_tag, log_offset); the central file is
cut back to it before each append (jobs/logs.py write_at), so a crash between the two repeats nothing.
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


def central_path(replica: Replica, tag: str | None = None) -> Path:
    """The controller's copy of one start's log."""
    return Path(settings.DATA_DIR) / "serve-logs" / replica.service.name / f"{replica.index}-{tag or replica.tag}.log"


def copy(replica: Replica) -> int:
    """Append what the replica's engine wrote since the last pass to its central copy; the bytes copied (0 when
    its node does not answer: the next pass tries again)."""
    if not replica.tag or replica.node is None:
        return 0
    offset = replica.log_offset if replica.log_tag == replica.tag else 0
    item = {"key": replica.tag, "path": replica.remote("log"), "offset": offset, "max_bytes": READ_BYTES}
    try:
        answer = node_request(replica.node, "tail", timeout=10, files=[item])["files"][0]
    except (LinkError, AgentRequestError, OSError) as exc:
        log.info("service %s replica %s: log not read: %s", replica.service.name, replica.index, exc)
        return 0
    data = tail_bytes(answer)
    if not data and replica.log_tag == replica.tag:
        return 0
    write_at(central_path(replica), offset, data)
    Replica.objects.filter(pk=replica.pk).update(log_tag=replica.tag, log_offset=offset + len(data))
    replica.log_tag, replica.log_offset = replica.tag, offset + len(data)
    return len(data)


def shown(replica: Replica, size: int = SHOWN_BYTES) -> str | None:
    """The last `size` bytes of the central copy of the replica's latest start's log; None when none was copied."""
    if not replica.log_tag:
        return None
    path = central_path(replica, replica.log_tag)
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, path.stat().st_size - size))
            return fh.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return None
