"""Copy the SQLite database of a UGRO from before PostgreSQL into this one (`bin/start --import-sqlite`)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.db import DEFAULT_DB_ALIAS, connections

from cluster.models import Node
from jobs.models import Job

SOURCE = "sqlite_import"
# Rebuilt by Django itself (content types, permissions), not worth keeping (sessions, the admin's history), or
# no table at all (accounts.Access only holds permissions).
SKIPPED = ["contenttypes", "auth.permission", "sessions", "admin.logentry", "accounts.access"]


@contextmanager
def sqlite_database(path: Path, alias: str = SOURCE) -> Iterator[str]:
    """The SQLite file as a database alias of its own for as long as the block runs (settings refuse SQLite)."""
    configured = connections.configure_settings({
        DEFAULT_DB_ALIAS: dict(connections.settings[DEFAULT_DB_ALIAS]),
        alias: {"ENGINE": "django.db.backends.sqlite3", "NAME": str(path.resolve())},
    })  # fmt: skip
    connections.settings[alias] = configured[alias]
    try:
        yield alias
    finally:
        connections[alias].close()
        del connections.settings[alias]


class Command(BaseCommand):
    help = "Copy an older UGRO's SQLite database (data/ugro.sqlite3) into this UGRO's PostgreSQL, once."

    def add_arguments(self, parser):
        parser.add_argument("path", help="the SQLite file, e.g. data/ugro.sqlite3")

    def handle(self, path: str, **options):
        source = Path(path)
        if not source.is_file():
            raise CommandError(f"{source} is not a file")
        if source.read_bytes()[:16] != b"SQLite format 3\x00":
            raise CommandError(f"{source} is not a SQLite database")
        if Job.objects.exists() or Node.objects.exists() or get_user_model().objects.exists():
            raise CommandError("this UGRO's database already holds nodes, jobs or users: import into a fresh one")
        with sqlite_database(source):
            # an older UGRO's schema first brought up to this one's, then every row copied with its own id
            # (job directories and logs are named by it); JSON lines, read back one row at a time
            call_command("migrate", database=SOURCE, verbosity=0, interactive=False)
            with tempfile.TemporaryDirectory() as tmp:
                dump = Path(tmp) / "ugro.jsonl"
                call_command("dumpdata", database=SOURCE, exclude=SKIPPED, natural_foreign=True, format="jsonl",
                             output=str(dump), verbosity=0)  # fmt: skip
                rows = sum(1 for _ in dump.open())
                call_command("loaddata", str(dump), verbosity=0)
        self.stdout.write(f"copied {rows} rows from {source} into PostgreSQL")
