from __future__ import annotations

import json

from django.core.management.base import CommandError

from accounts import audit
from accounts.commands import UserCommand
from cluster.provision import ProvisionError, probe_node


class Command(UserCommand):
    action = "nodes"
    help = "Probe a node again: its GPUs, CPUs, RAM, disk, Python environments and route; says what changed."

    def add_arguments(self, parser):
        parser.add_argument("node", help="the node's name")
        parser.add_argument("--json", action="store_true")

    def handle(self, node, **options):
        found = self.named_node(node)
        try:
            result = probe_node(found)
        except ProvisionError as exc:
            audit.record(self.user, "node_probe", node, source=self.source, outcome=f"refused: {exc}")
            raise CommandError(str(exc)) from None
        audit.record(self.user, "node_probe", node, source=self.source, changed=result.changed)
        self.stdout.write(json.dumps(result.as_dict(), indent=2) if options.get("json") else "\n".join(result.lines))
