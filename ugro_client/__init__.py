"""The thin `ugro` client: talks to a UGRO server's REST API over HTTP. Standard library only, no Django."""

__all__ = ["ApiError", "Client"]

from .http import ApiError, Client
