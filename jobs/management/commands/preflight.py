from __future__ import annotations

import json

from django.core.management.base import CommandError

from accounts.commands import UserCommand
from jobs.launch import LaunchError, preflight_nodes


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
        try:
            run = preflight_nodes(nodes, script)
        except LaunchError as exc:
            raise CommandError(str(exc)) from None
        report, count = run.report, len(run.nodes)
        if as_json:
            self.stdout.write(json.dumps({
                "ok": report.ok, "nodes": [n.name for n in run.nodes], "rendezvous": run.rendezvous,
                "problems": report.problems, "notes": report.notes, "versions": report.versions,
            }, indent=2))  # fmt: skip
            if report.problems:
                raise CommandError(f"pre-flight failed on {count} node(s): {len(report.problems)} problem(s)")
            return
        for note in report.notes:
            self.stdout.write(f"note: {note}")
        if report.problems:
            for problem in report.problems:
                self.stdout.write(problem)
            raise CommandError(f"pre-flight failed on {count} node(s): {len(report.problems)} problem(s)")
        names = ", ".join(n.name for n in run.nodes)
        self.stdout.write(f"pre-flight passed: {names} (rendezvous {run.rendezvous})")
