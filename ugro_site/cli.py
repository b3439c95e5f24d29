"""The `ugro-admin` console script: `ugro-admin X` is `manage.py X` from anywhere on the controller (admins).

Users run the thin `ugro` client (ugro_client/), which talks to the REST API and needs no Django."""

from __future__ import annotations

import os
import sys


def main() -> None:
    from ugro_site.env import private_umask

    private_umask()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ugro_site.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(["ugro-admin", *sys.argv[1:]])
