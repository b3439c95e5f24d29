"""UGRO's Django project: settings, urls, ASGI routing and the Celery app."""

from __future__ import annotations

from .celery import app as celery_app

__all__ = ["celery_app"]
