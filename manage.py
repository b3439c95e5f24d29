#!/usr/bin/env python3
"""Django's command-line utility for UGRO."""

from __future__ import annotations

import os
import sys


def main() -> None:
    os.umask(0o077)  # the data directory, database and logs are this user's alone
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ugro_site.settings")
    from django.core.management import execute_from_command_line
    from django.db import OperationalError

    try:
        execute_from_command_line(sys.argv)
    except OperationalError as exc:
        if os.environ.get("DATABASE_URL"):
            raise
        from ugro_site.localdb import pgdata

        why = str(exc).splitlines()[0]
        sys.exit(f"ugro: UGRO's database (PostgreSQL in {pgdata()}) does not answer: start UGRO with bin/start ({why})")


if __name__ == "__main__":
    main()
