"""Django for the services' endpoint, /serve/, without the pages' middleware.

Under ASGI each middleware of the pages (sessions, CSRF, login, the policy table, messages, CSP, axes) runs its
hooks on a thread and back: a dozen thread hops per request, most of what the endpoint added to a completion's
latency. The endpoint needs none of them: it checks its own bearer token (serving/views.py), sets no cookie and
renders no page. URLs still resolve through ROOT_URLCONF, so only /serve/ routes answer here.
"""

from __future__ import annotations

from django.core.handlers.asgi import ASGIHandler
from django.core.handlers.exception import convert_exception_to_response


class EndpointHandler(ASGIHandler):
    def load_middleware(self, is_async: bool = False) -> None:
        self._view_middleware, self._template_response_middleware, self._exception_middleware = [], [], []
        self._middleware_chain = convert_exception_to_response(self._get_response_async)


def by_path(prefix: str, inner, outer):
    """An ASGI app that sends HTTP requests whose path starts with `prefix` to `inner`, every other to `outer`."""

    async def app(scope, receive, send):
        target = inner if scope["type"] == "http" and scope.get("path", "").startswith(prefix) else outer
        return await target(scope, receive, send)

    return app
