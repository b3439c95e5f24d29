"""Start-time checks (Django's system checks, run by runserver, migrate and `manage.py check`)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from django.conf import settings
from django.core.checks import Warning, register

from ugro_site import localdb


def _loose(path: Path, want: int) -> int | None:
    """The path's mode when it grants more than `want` to group or others; None if fine or absent."""
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return None
    return mode if mode & 0o077 & ~want else None


def _server_may_pass(data: Path) -> int:
    """Group x on the data directory when it is the group of the account UGRO's private PostgreSQL runs as
    (UGRO as root: ugro_site/localdb.py), else nothing."""
    try:
        return 0o010 if data.stat().st_gid == localdb.pgdata(data).stat().st_gid != os.getgid() else 0
    except OSError:
        return 0


def storage_problems() -> list[str]:
    """One line per data path readable or writable by other local users."""
    data = Path(settings.DATA_DIR)
    found = []
    mode = _loose(data, _server_may_pass(data))
    if mode is not None:
        found.append(f"data directory {data} is {mode:04o}; other local users can read it (chmod 700 {data})")
    files = [data / "secret_key"]
    run = data / "run"
    if run.is_dir():
        files += sorted(run.glob("*.log"))
    for path in files:
        mode = _loose(path, 0)
        if mode is not None:
            found.append(f"{path} is {mode:04o}; other local users can read it (chmod 600 {path})")
    return found


@register()
def storage_permissions(app_configs, **kwargs) -> list[Warning]:
    return [Warning(line, id="ugro.W001") for line in storage_problems()]
