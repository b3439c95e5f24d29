from __future__ import annotations

import json

from django.core.management.base import CommandError

from accounts.commands import UserCommand
from cluster.links import AgentRequestError, LinkError
from cluster.models import Node
from jobs.cache import disk


class NodeReportCommand(UserCommand):
    """A report a node's agent is asked for (its store, its environments): `lines` printed, or the whole with --json;
    one line naming the node when it does not answer."""

    action = "nodes"
    failed = "did not say what its store holds"

    def report(self, node: Node) -> dict:
        return disk(node)

    def add_arguments(self, parser):
        parser.add_argument("node", help="the node's name")
        parser.add_argument("--json", action="store_true", dest="as_json", help="Machine-readable output.")

    def handle(self, node, as_json=False, **options):
        found = self.named_node(node)
        try:
            out = self.report(found)
        except (LinkError, AgentRequestError, OSError) as exc:
            raise CommandError(f"{node} {self.failed}: {exc}") from None
        self.stdout.write(json.dumps(out, indent=2) if as_json else "\n".join(out["lines"]))


class Command(NodeReportCommand):
    help = (
        "What a node's store holds and why: its size against its limit, the disk's free space, and each job's "
        "code copy and data, objects no job uses and partial transfers, with size, last use and what keeps it."
    )
