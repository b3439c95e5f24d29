from __future__ import annotations

import json

from django.core.management.base import CommandError

from accounts.commands import UserCommand
from cluster.links import AgentRequestError, LinkError
from cluster.models import Node
from jobs.cache import disk


class Command(UserCommand):
    action = "nodes"
    help = (
        "What a node's store holds and why: its size against its limit, the disk's free space, and each job's "
        "code copy and data, objects no job uses and partial transfers, with size, last use and what keeps it."
    )

    def add_arguments(self, parser):
        parser.add_argument("node", help="the node's name")
        parser.add_argument("--json", action="store_true", dest="as_json", help="Machine-readable output.")

    def handle(self, node, as_json=False, **options):
        found = Node.objects.filter(name=node).first()
        if found is None:
            raise CommandError(f"no node named {node!r}")
        try:
            report = disk(found)
        except (LinkError, AgentRequestError, OSError) as exc:
            raise CommandError(f"{node} did not say what its store holds: {exc}") from None
        if as_json:
            self.stdout.write(json.dumps(report, indent=2))
        else:
            self.stdout.write("\n".join(report["lines"]))
