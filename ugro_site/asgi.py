"""ASGI entry point: HTTP through Django, websockets through Channels (logged-in users only, from
pages of this very origin: scheme, host and port, ugro_site/origin.py). The services' endpoint, /serve/, is an ASGI
app of its own beside Django (serving/endpoint.py).

Static files (CSS, JS, the vendored chart library) are served by the same process whatever DEBUG
says: UGRO is a LAN tool run by daphne alone, with no web server in front to serve them.
"""

from __future__ import annotations

import os

from django.core.asgi import get_asgi_application

from ugro_site.env import private_umask

private_umask()
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ugro_site.settings")
django_asgi_app = get_asgi_application()

import logging  # noqa: E402

from cluster.checks import storage_problems  # noqa: E402

for _line in storage_problems():
    logging.getLogger("ugro").warning("%s", _line)

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402

from serving import endpoint  # noqa: E402
from ugro_site.origin import SameOriginValidator  # noqa: E402
from ugro_site.routing import websocket_urlpatterns  # noqa: E402


def by_path(prefix: str, inner, outer):
    """An ASGI app that sends HTTP requests whose path starts with `prefix` to `inner`, every other to `outer`."""

    async def app(scope, receive, send):
        target = inner if scope["type"] == "http" and scope.get("path", "").startswith(prefix) else outer
        return await target(scope, receive, send)

    return app


application = ProtocolTypeRouter(
    {
        "http": by_path("/serve/", endpoint.app, ASGIStaticFilesHandler(django_asgi_app)),
        "websocket": SameOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
    }
)
