from __future__ import annotations

import json

from django.core.management.base import CommandError

from accounts.commands import UserCommand
from jobs.network import NetcheckError, netcheck, report


def _names(values: list[str]) -> list[str]:
    return [n for item in values for n in item.split(",") if n]


def _sizes(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise CommandError(f"--sizes: whole numbers of MB separated by commas, not {text[:40]!r}") from None


class Command(UserCommand):
    help = (
        "Measure the network between the given (default: every enabled) nodes with their own torch: the interface "
        "each uses, all_reduce bus bandwidth and latency for the group and each pair (docs/scaling.md). "
        "Exit code 1 with one line per problem."
    )

    def add_arguments(self, parser):
        parser.add_argument("--nodes", nargs="+", default=[], metavar="NODE", help="a,b,c or a b c")
        parser.add_argument("--sizes", default="", help="all_reduce sizes in MB, e.g. 1,16,64 (the default)")
        parser.add_argument("--json", action="store_true", dest="as_json", help="Machine-readable output.")

    def handle(self, nodes, sizes, as_json=False, **options):
        try:
            chosen, out = netcheck(_names(nodes), _sizes(sizes) if sizes else None)
        except NetcheckError as exc:
            raise CommandError(str(exc)) from None
        answer = report(chosen, out)
        if as_json:
            self.stdout.write(json.dumps(answer, indent=2))
        else:
            for line in answer["problems"] + answer["lines"]:
                self.stdout.write(line)
        if out.problems:
            raise CommandError(f"netcheck refused on {len(chosen)} node(s): {len(out.problems)} problem(s)")
        if not answer["ok"]:
            raise CommandError("netcheck failed: " + out.measured.error)
