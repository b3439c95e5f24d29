"""The audit log: one row per launch, cancel, resume, node change and token change (and refusals of them)."""

from __future__ import annotations

import getpass
import socket
from typing import Any

from .models import AuditEvent


def client_address(request) -> str:
    return str(request.META.get("REMOTE_ADDR") or "?")


def web_source(request) -> str:
    """Where a request came from: `web 127.0.0.1`, or `api 127.0.0.1 token 1a2b3c4d`."""
    token = getattr(request, "auth", None)
    prefix = getattr(token, "prefix", "")
    kind = "api" if request.path.startswith("/api/") else "web"
    return f"{kind} {client_address(request)}" + (f" token {prefix}" if prefix else "")


def cli_source() -> str:
    """A management command: the OS user and the machine it ran on."""
    try:
        who = getpass.getuser()
    except (KeyError, OSError):
        who = "?"
    return f"cli {who}@{socket.gethostname()}"


def record(
    user,
    action: str,
    target: str = "",
    *,
    source: str = "",
    outcome: str = "ok",
    argv: list[str] | None = None,
    **detail: Any,
) -> AuditEvent:
    authenticated = user is not None and getattr(user, "is_authenticated", False)
    return AuditEvent.objects.create(
        user=user if authenticated else None,
        username=user.get_username() if authenticated else "",
        action=action,
        target=target[:200],
        source=source[:200],
        outcome=outcome[:300],
        argv=list(argv or []),
        detail=detail,
    )
