from __future__ import annotations

from pathlib import Path

from django.core.management.base import CommandError

from accounts import audit
from accounts.commands import UserCommand
from cluster.config_yaml import ConfigError, import_cluster


class Command(UserCommand):
    action = "nodes"
    help = "Import cluster.yaml (the user's format): nodes and cluster settings, all or nothing."

    def add_arguments(self, parser):
        parser.add_argument("path", help="cluster.yaml to import")

    def handle(self, path, **options):
        try:
            text = Path(path).read_bytes()  # decoded (UTF-8 only) and bounded by import_cluster
        except OSError as exc:
            raise CommandError(f"cannot read {path}: {exc.strerror}") from None
        try:
            summary = import_cluster(text)
        except ConfigError as exc:
            audit.record(self.user, "import_cluster", str(path), source=self.source, outcome=f"refused: {exc}")
            raise CommandError(f"{path}: {exc}; nothing was imported") from None
        audit.record(self.user, "import_cluster", str(path), source=self.source, summary=str(summary))
        self.stdout.write(f"imported {path}: {summary}")
