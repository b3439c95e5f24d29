#!/usr/bin/env python3
"""Django's command-line utility for UGRO."""

from __future__ import annotations

import os
import sys


def main() -> None:
    os.umask(0o077)  # the data directory, database and logs are this user's alone
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ugro_site.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
