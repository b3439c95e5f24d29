"""The Celery app: tasks are thin and live in each app's tasks.py."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ugro_site.settings")

app = Celery("ugro")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
