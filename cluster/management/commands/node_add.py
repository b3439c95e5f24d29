from __future__ import annotations

import json

from django.core.management.base import CommandError

from accounts import audit
from accounts.commands import UserCommand
from cluster.provision import TARGET_HELP, ProvisionError, add_node


class Command(UserCommand):
    action = "nodes"
    help = ("Add a node by probing it: pin its SSH host key, read its GPUs, CPUs, RAM, disk, Python environments "
            "(torch/CUDA/NCCL) and route, and record it (docs/nodes.md).")  # fmt: skip

    def add_arguments(self, parser):
        parser.add_argument("target", help=TARGET_HELP)
        parser.add_argument("--name", default="", help="the node's name (default: HOST as typed)")
        parser.add_argument("--key", default="", help="the private key to log in with, on the controller")
        parser.add_argument("--workdir", default="", help="where its ranks start (default: paths.project_base, "
                            "else ~/ugro; created if missing)")  # fmt: skip
        parser.add_argument("--fingerprint", default="", help="add it only if its host key has this SHA256 fingerprint")
        parser.add_argument("--json", action="store_true")

    def handle(self, target, name="", key="", workdir="", fingerprint="", **options):
        try:
            result = add_node(target, name=name, key_path=key, workdir=workdir, expect_fingerprint=fingerprint)
        except ProvisionError as exc:
            audit.record(self.user, "node_add", name or target, source=self.source, outcome=f"refused: {exc}")
            raise CommandError(str(exc)) from None
        audit.record(self.user, "node_add", result.node, source=self.source, address=target)
        self.stdout.write(json.dumps(result.as_dict(), indent=2) if options.get("json") else "\n".join(result.lines))
