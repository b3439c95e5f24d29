from __future__ import annotations

from django.apps import AppConfig


class ServingConfig(AppConfig):
    name = "serving"
    verbose_name = "Serving"

    def ready(self) -> None:
        from jobs import retention

        from .replicas import checkpoint_uses

        retention.uses_from(checkpoint_uses)  # a served checkpoint is never deleted; its replicas' copies go with it
