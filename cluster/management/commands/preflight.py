from __future__ import annotations

import json

from django.core.management.base import CommandError

from accounts.commands import UserCommand
from cluster.models import ClusterSettings, Node
from jobs.launch import LaunchError, check_script
from jobs.preflight import check_nodes


class Command(UserCommand):
    help = (
        "Run the launch pre-flight checks on the given (default: all enabled) nodes. "
        "Exit code 1 with one line per problem."
    )

    def add_arguments(self, parser):
        parser.add_argument("--nodes", nargs="+", default=[], metavar="NODE")
        parser.add_argument("--script", default="", help="Training script (default: the cluster's).")
        parser.add_argument("--json", action="store_true", dest="as_json", help="Machine-readable output.")

    def handle(self, nodes, script, as_json=False, **options):
        cs = ClusterSettings.load()
        chosen = list(Node.objects.filter(enabled=True))
        if nodes:
            by_name = {n.name: n for n in Node.objects.filter(name__in=nodes)}
            unknown = [n for n in nodes if n not in by_name]
            if unknown:
                raise CommandError(f"unknown node(s): {', '.join(unknown)}")
            chosen = [by_name[n] for n in nodes]
        if not chosen:
            raise CommandError("no enabled nodes; import cluster.yaml or add nodes in admin")
        # Rank 0 (the rendezvous host) is a master when there is one, as at launch.
        chosen.sort(key=Node.placement_key)
        host = chosen[0].address
        try:
            script = check_script(script or cs.default_script)
        except LaunchError as exc:
            raise CommandError(str(exc)) from None
        report = check_nodes(chosen, script, host, cs.rendezvous_port)
        if as_json:
            self.stdout.write(json.dumps({
                "ok": report.ok, "nodes": [n.name for n in chosen], "rendezvous": f"{host}:{cs.rendezvous_port}",
                "problems": report.problems, "notes": report.notes, "versions": report.versions,
            }, indent=2))  # fmt: skip
            if report.problems:
                raise CommandError(f"pre-flight failed on {len(chosen)} node(s): {len(report.problems)} problem(s)")
            return
        for note in report.notes:
            self.stdout.write(f"note: {note}")
        if report.problems:
            for problem in report.problems:
                self.stdout.write(problem)
            raise CommandError(f"pre-flight failed on {len(chosen)} node(s): {len(report.problems)} problem(s)")
        names = ", ".join(n.name for n in chosen)
        self.stdout.write(f"pre-flight passed: {names} (rendezvous {host}:{cs.rendezvous_port})")
