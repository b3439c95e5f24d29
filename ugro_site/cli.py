"""The `ugro` console script: `ugro launch ...` is `manage.py launch ...` from anywhere."""

from __future__ import annotations

import os
import sys


def main() -> None:
    from ugro_site.env import private_umask

    private_umask()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ugro_site.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(["ugro", *sys.argv[1:]])
