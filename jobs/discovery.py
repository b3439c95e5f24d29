"""What a run writes without being told where: one bounded walk of each rank's working directory on its node
finds the metric files (Lightning's metrics.csv, TensorBoard event files) and checkpoints (Hugging Face
checkpoint-N/, Lightning .ckpt, step-named .pt/.safetensors files) changed since the rank started.

The node agent's `discover` walks (cluster/node/agent.py: depth, entry and time bounds, newest directories
first, hidden and cache directories skipped); the follower calls walk() for each rank every DISCOVER_EVERY_S
while it runs and once more when it ends, and hands what was found to metrics.files.adopt() and
jobs.checkpoints.record_found().
"""

from __future__ import annotations

import logging
from datetime import datetime

from cluster.fanout import node_request
from cluster.links import AgentRequestError, LinkError

from . import sync
from .models import Rank

log = logging.getLogger(__name__)

DISCOVER_EVERY_S = 5.0
MAX_DEPTH = 6  # <workdir>/outputs/run/runs/<date_host>/events.out.tfevents.* is four levels down
MAX_ENTRIES = 20_000  # directory entries read per walk: a few milliseconds on the node
WALK_BUDGET_S = 0.5
# Node clocks differ a little from the controller's (NTP keeps a LAN within this): a file written in the
# rank's first second still counts. Only when the node has no start record for the rank: its own record of
# when the rank started (node clock) is what counts otherwise.
CLOCK_SLACK_S = 2.0


def walk(rank: Rank, started: datetime) -> list[dict] | None:
    """The entries the node's walk found for this rank (None when the node did not answer)."""
    root = sync.start_dir(rank.job, rank.node)  # where the ranks start
    try:
        answer = node_request(
            rank.node, "discover", timeout=10, when_silent=False, root=root,
            since=started.timestamp() - CLOCK_SLACK_S, record=rank.start_record or None, max_depth=MAX_DEPTH,
            max_entries=MAX_ENTRIES, budget_s=WALK_BUDGET_S,
        )  # fmt: skip
    except (LinkError, AgentRequestError) as exc:
        log.info("discovery on %s for %s: %s", rank.node.name, rank, exc)
        return None
    if not answer.get("complete"):
        log.info("discovery on %s for %s stopped at its bounds", rank.node.name, rank)
    return answer["entries"]
