"""Typed environment helpers: a bad value fails loudly at start-up, never silently."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import NamedTuple
from urllib.parse import parse_qs, unquote, urlsplit

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


class EnvError(ValueError):
    """A setting read from the environment has a value that cannot be used."""


def env_str(name: str, default: str) -> str:
    return os.environ.get(name, default)


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    value = raw.strip().lower()
    if value in {"1", "true", "yes", "on"}:
        return True
    if value in {"0", "false", "no", "off"}:
        return False
    raise EnvError(f"{name}={raw!r} is not a boolean (use true/false)")


def env_int(name: str, default: int, *, minimum: int | None = None, maximum: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise EnvError(f"{name}={raw!r} is not an integer") from None
    if minimum is not None and value < minimum:
        raise EnvError(f"{name}={value} is below the minimum {minimum}")
    if maximum is not None and value > maximum:
        raise EnvError(f"{name}={value} is above the maximum {maximum}")
    return value


def env_float(name: str, default: float, *, minimum: float | None = None, maximum: float | None = None) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise EnvError(f"{name}={raw!r} is not a number") from None
    if not math.isfinite(value):
        raise EnvError(f"{name}={raw!r} is not a finite number")
    if minimum is not None and value < minimum:
        raise EnvError(f"{name}={value} is below the minimum {minimum}")
    if maximum is not None and value > maximum:
        raise EnvError(f"{name}={value} is above the maximum {maximum}")
    return value


def env_list(name: str, default: list[str]) -> list[str]:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    return [item.strip() for item in raw.split(",") if item.strip()]


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    value = os.environ.get(name, "").strip().lower() or default
    if value not in choices:
        raise EnvError(f"{name}={value!r} must be one of: {', '.join(choices)}")
    return value


class Mail(NamedTuple):
    """How UGRO sends mail: a Django mail backend, its options, the sender; configured: the URL was set."""

    backend: str
    options: dict
    sender: str
    configured: bool


SMTP_SCHEMES = {"smtp": {}, "smtp+tls": {"use_tls": True}, "smtps": {"use_ssl": True}}


def env_email_url(name: str) -> Mail:
    """Mail from one URL: smtp://[user:password@]host[:port][?from=address] (smtp+tls:// for STARTTLS,
    smtps:// for TLS from the start; user and password percent-encoded), or console:// to print mail
    to the log. Unset: this machine's own mail server (localhost:25), and configured=False."""
    raw = os.environ.get(name, "").strip()
    url = urlsplit(raw or "smtp://localhost:25")
    query = parse_qs(url.query)
    unknown = set(query) - {"from"}
    sender = query.get("from", ["ugro@localhost"])[-1]
    if unknown:
        raise EnvError(f"{name}: unknown parameter {sorted(unknown)[0]!r} (only ?from=address)")
    if url.scheme == "console":
        return Mail("django.core.mail.backends.console.EmailBackend", {}, sender, True)
    if url.scheme not in SMTP_SCHEMES or not url.hostname:
        raise EnvError(f"{name} must look like smtp://user:password@host:587 (or smtp+tls://, smtps://, console://)")
    try:
        port = url.port or (465 if url.scheme == "smtps" else 25)
    except ValueError:
        raise EnvError(f"{name} has a port that is not a number") from None
    options = {
        "host": url.hostname,
        "port": port,
        "username": unquote(url.username or ""),
        "password": unquote(url.password or ""),
        "timeout": 10,
        **SMTP_SCHEMES[url.scheme],
    }
    return Mail("django.core.mail.backends.smtp.EmailBackend", options, sender, bool(raw))


def data_dir() -> Path:
    """UGRO's data directory (UGRO_DATA_DIR, else data/ in the checkout), absolute."""
    default = Path(__file__).resolve().parent.parent / "data"
    return Path(env_str("UGRO_DATA_DIR", str(default))).resolve()


def private_umask() -> None:
    """Files and directories UGRO makes are its user's alone (0600/0700): the data directory holds
    the database, session keys and job logs. Called first by every entry point."""
    os.umask(0o077)
