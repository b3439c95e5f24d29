"""Start-time checks (Django's system checks, run by runserver, migrate and `manage.py check`)."""

from __future__ import annotations

import stat
from pathlib import Path

from django.conf import settings
from django.core.checks import Warning, register


def _loose(path: Path, want: int) -> int | None:
    """The path's mode when it grants more than `want` to group or others; None if fine or absent."""
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return None
    return mode if mode & 0o077 & ~want else None


def storage_problems() -> list[str]:
    """One line per data path readable or writable by other local users."""
    data = Path(settings.DATA_DIR)
    found = []
    mode = _loose(data, 0)
    if mode is not None:
        found.append(f"data directory {data} is {mode:04o}; other local users can read it (chmod 700 {data})")
    files = [data / "secret_key"]
    db = settings.DATABASES["default"]
    if db["ENGINE"] == "django.db.backends.sqlite3":
        name = Path(str(db["NAME"]))
        files += [name, Path(f"{name}-wal"), Path(f"{name}-shm")]
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
