from __future__ import annotations

from django.apps import AppConfig


class ClusterConfig(AppConfig):
    name = "cluster"
    verbose_name = "Cluster"
