"""Websocket origin check with scheme, host and port: a page may open UGRO's websockets only from
the very origin it was served from (or one listed in CSRF_TRUSTED_ORIGINS).

Channels' AllowedHostsOriginValidator compares the host name only, so a page on
http://localhost:8080 (any other local service) could open a logged-in user's websocket to
http://localhost:8099. This compares the Origin header with the scheme and Host of the websocket
request itself, the way Django's CSRF check compares a POST's Origin.
"""

from __future__ import annotations

from channels.security.websocket import WebsocketDenier
from django.conf import settings
from django.http.request import split_domain_port, validate_host


def allowed_origin(scope: dict) -> bool:
    """Whether the websocket request in `scope` comes from a page of this site."""
    origins = [v for k, v in scope.get("headers", []) if k == b"origin"]
    hosts = [v for k, v in scope.get("headers", []) if k == b"host"]
    if len(origins) != 1 or len(hosts) != 1:
        return False
    try:
        origin, host = origins[0].decode("ascii").lower(), hosts[0].decode("ascii").lower()
    except UnicodeDecodeError:
        return False
    domain, _ = split_domain_port(host)
    if not domain or not validate_host(domain, settings.ALLOWED_HOSTS):
        return False
    scheme = "https" if scope.get("scheme") in ("wss", "https") else "http"
    if origin == f"{scheme}://{host}":
        return True
    return origin in {o.lower().rstrip("/") for o in settings.CSRF_TRUSTED_ORIGINS}


class SameOriginValidator:
    """ASGI middleware: refuse (close before accept) a websocket whose Origin is not this site's."""

    def __init__(self, application) -> None:
        self.application = application

    async def __call__(self, scope, receive, send):
        if scope["type"] != "websocket":
            raise ValueError("SameOriginValidator is for websocket connections only")
        if allowed_origin(scope):
            return await self.application(scope, receive, send)
        return await WebsocketDenier()(scope, receive, send)
