from __future__ import annotations

import json

from django.core.management.base import CommandError

from accounts import audit
from accounts.commands import UserCommand
from cluster.power import PowerError
from jobs.power import by_hand


class Command(UserCommand):
    action = "nodes"
    verb = "sleep"
    help = (
        "Put a node with a power: block to sleep now (its sleep command, through its agent); refused while it holds a "
        "job or a service (docs/power.md)."
    )

    def add_arguments(self, parser):
        parser.add_argument("node", help="the node's name")
        parser.add_argument("--json", action="store_true")

    def handle(self, node, **options):
        found = self.named_node(node)
        try:
            line = by_hand(found, self.verb, self.user.username)
        except PowerError as exc:
            audit.record(self.user, f"node_{self.verb}", node, source=self.source, outcome=f"refused: {exc}")
            raise CommandError(str(exc)) from None
        audit.record(self.user, f"node_{self.verb}", node, source=self.source)
        found.refresh_from_db()
        answer = {"node": found.name, "status": found.status, "lines": [line]}
        self.stdout.write(json.dumps(answer, indent=2) if options.get("json") else line)
