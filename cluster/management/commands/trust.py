from __future__ import annotations

from django.core.management.base import CommandError

from accounts import audit
from accounts.commands import UserCommand
from cluster.hostkeys import trust
from cluster.links import LinkError


class Command(UserCommand):
    action = "nodes"
    help = "Pin the SSH host key a node offers now (after it was reinstalled or its key rotated)."

    def add_arguments(self, parser):
        parser.add_argument("node", help="the node's name")
        parser.add_argument(
            "--fingerprint",
            default="",
            help="pin only if the node's key has this SHA256 fingerprint "
            "(from `ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub` on the node)",
        )

    def handle(self, node, fingerprint="", **options):
        found = self.named_node(node)
        try:
            old, new = trust(found, fingerprint)
        except (ValueError, LinkError) as exc:
            audit.record(self.user, "trust", node, source=self.source, outcome=f"refused: {exc}")
            raise CommandError(str(exc)) from None
        audit.record(self.user, "trust", node, source=self.source, old=old, new=new)
        if old == new:
            self.stdout.write(f"{node}: host key {new} was already pinned")
        elif old:
            self.stdout.write(f"{node}: host key {new} pinned (was {old})")
        else:
            self.stdout.write(f"{node}: host key {new} pinned")
