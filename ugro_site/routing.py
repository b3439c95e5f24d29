"""Websocket routes."""

from __future__ import annotations

from django.urls import path

from jobs.consumers import ClusterConsumer, JobConsumer

websocket_urlpatterns: list = [
    path("ws/jobs/<int:job_id>/", JobConsumer.as_asgi()),
    path("ws/cluster/", ClusterConsumer.as_asgi()),
]
