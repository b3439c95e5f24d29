from __future__ import annotations

import json

from django.core.management.base import CommandError

from accounts.commands import UserCommand
from cluster.links import AgentRequestError, LinkError
from cluster.models import Node
from jobs.envs import report


class Command(UserCommand):
    action = "nodes"
    help = (
        "A node's Python environments (--packages, docs/envs.md): each with its size, last use and the queued or "
        "running jobs that name it; unused ones are removed after paths.env_ttl."
    )

    def add_arguments(self, parser):
        parser.add_argument("node", help="the node's name")
        parser.add_argument("--json", action="store_true", dest="as_json", help="Machine-readable output.")

    def handle(self, node, as_json=False, **options):
        found = Node.objects.filter(name=node).first()
        if found is None:
            raise CommandError(f"no node named {node!r}")
        try:
            out = report(found)
        except (LinkError, AgentRequestError, OSError) as exc:
            raise CommandError(f"{node} did not list its environments: {exc}") from None
        if as_json:
            self.stdout.write(json.dumps(out, indent=2))
        else:
            self.stdout.write("\n".join(out["lines"]))
