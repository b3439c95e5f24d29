from __future__ import annotations

from pathlib import Path

from accounts.commands import UserCommand
from cluster.config_yaml import export_cluster


class Command(UserCommand):
    help = "Write the cluster (nodes and settings) as cluster.yaml, to a file or stdout."

    def add_arguments(self, parser):
        parser.add_argument("path", nargs="?", help="file to write (default: stdout)")

    def handle(self, path=None, **options):
        text = export_cluster()
        if path:
            Path(path).write_text(text)
            self.stdout.write(f"wrote {path}")
        else:
            self.stdout.write(text, ending="")
