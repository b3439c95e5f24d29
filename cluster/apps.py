from __future__ import annotations

from django.apps import AppConfig


class ClusterConfig(AppConfig):
    name = "cluster"
    verbose_name = "Cluster"

    def ready(self) -> None:
        from . import checks, hostkeys, links  # noqa: F401  (checks registers the start-time checks)

        links.host_key_recorder = hostkeys.record_first_key
