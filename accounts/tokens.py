"""API tokens: `ugro_<prefix>_<secret>`; only the sha256 of the whole token is stored."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import timedelta

from django.utils import timezone

from .models import ApiToken

TOKEN_START = "ugro_"
PREFIX_LEN = 8
LAST_USED_EVERY = timedelta(seconds=30)  # last-used time is written at most this often per token


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(user, name: str, scope: str) -> tuple[ApiToken, str]:
    """A new token for `user`; returns (row, the token itself: shown once, never stored)."""
    if scope not in ApiToken.Scope.values:
        raise ValueError(f"scope must be one of {', '.join(ApiToken.Scope.values)}, not {scope!r}")
    name = name.strip()
    if not name or len(name) > 100:
        raise ValueError("a token needs a name of 1-100 characters")
    while True:
        prefix = secrets.token_hex(PREFIX_LEN // 2)
        if not ApiToken.objects.filter(prefix=prefix).exists():
            break
    token = f"{TOKEN_START}{prefix}_{secrets.token_urlsafe(32)}"
    row = ApiToken.objects.create(user=user, name=name, prefix=prefix, digest=digest(token), scope=scope)
    return row, token


def find_token(token: str) -> ApiToken | None:
    """The active token row this token is, or None (unknown, malformed, revoked or wrong secret)."""
    if not token.startswith(TOKEN_START):
        return None
    prefix, sep, secret = token[len(TOKEN_START) :].partition("_")
    if not sep or not secret or len(prefix) != PREFIX_LEN:
        return None
    row = ApiToken.objects.select_related("user").filter(prefix=prefix, revoked_at__isnull=True).first()
    if row is None or not hmac.compare_digest(row.digest, digest(token)):
        return None
    return row


def mark_used(row: ApiToken, address: str) -> None:
    now = timezone.now()
    if row.last_used_at is None or now - row.last_used_at >= LAST_USED_EVERY or row.last_used_from != address:
        ApiToken.objects.filter(pk=row.pk).update(last_used_at=now, last_used_from=address[:64])
        row.last_used_at, row.last_used_from = now, address[:64]


def revoke(row: ApiToken) -> bool:
    """True if this call revoked it (False: it already was)."""
    return bool(ApiToken.objects.filter(pk=row.pk, revoked_at__isnull=True).update(revoked_at=timezone.now()))
