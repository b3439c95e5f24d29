"""The Celery app: tasks are thin and live in each app's tasks.py."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ugro_site.settings")

app = Celery("ugro")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


def broker_answers(timeout: float = 0.3) -> bool:
    """Whether the broker accepts connections now (Celery's own publish retries for seconds if not)."""
    import socket
    from urllib.parse import urlsplit

    from django.conf import settings

    url = urlsplit(settings.CELERY_BROKER_URL)
    try:
        with socket.create_connection((url.hostname or "127.0.0.1", url.port or 6379), timeout=timeout):
            return True
    except OSError:
        return False
