"""`Authorization: Bearer ugro_...` for the REST API (DRF authentication class)."""

from __future__ import annotations

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.exceptions import AuthenticationFailed

from .audit import client_address
from .tokens import find_token, mark_used


class BearerTokenAuthentication(BaseAuthentication):
    keywords = ("bearer", "token")

    def authenticate(self, request):
        header = get_authorization_header(request).decode("latin-1")
        kind, _, token = header.partition(" ")
        if not header or kind.lower() not in self.keywords:
            return None
        row = find_token(token.strip())
        if row is None:
            raise AuthenticationFailed("the API token is unknown or revoked")
        if not row.user.is_active:
            raise AuthenticationFailed(f"the token's account {row.user.get_username()} is disabled")
        mark_used(row, client_address(request))
        return row.user, row

    def authenticate_header(self, request) -> str:
        return 'Bearer realm="ugro"'


class BearerTokenScheme(OpenApiAuthenticationExtension):
    """How the OpenAPI schema describes the token (drf-spectacular finds this subclass by itself)."""

    target_class = "accounts.authentication.BearerTokenAuthentication"
    name = "ugroToken"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "description": "`Authorization: Bearer ugro_...` (ugro token)"}
