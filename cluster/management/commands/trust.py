from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from cluster.hostkeys import trust
from cluster.links import LinkError
from cluster.models import Node


class Command(BaseCommand):
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
        found = Node.objects.filter(name=node).first()
        if found is None:
            raise CommandError(f"no node named {node!r}")
        try:
            old, new = trust(found, fingerprint)
        except (ValueError, LinkError) as exc:
            raise CommandError(str(exc)) from None
        if old == new:
            self.stdout.write(f"{node}: host key {new} was already pinned")
        elif old:
            self.stdout.write(f"{node}: host key {new} pinned (was {old})")
        else:
            self.stdout.write(f"{node}: host key {new} pinned")
