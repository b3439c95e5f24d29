from __future__ import annotations

from django.apps import AppConfig
from django.db.models.signals import post_save


class ClusterConfig(AppConfig):
    name = "cluster"
    verbose_name = "Cluster"

    def ready(self) -> None:
        from . import checks, hostkeys, links  # noqa: F401  (checks registers the start-time checks)
        from .models import Node

        links.host_key_recorder = hostkeys.record_first_key
        post_save.connect(_node_saved, sender=Node, dispatch_uid="cluster.sync_gpus")


def _node_saved(sender, instance, raw: bool = False, **kwargs) -> None:
    """A node's GPU rows follow its declared count whenever it is saved (admin, cluster.yaml, code)."""
    if raw:  # loading a fixture: rows come with it
        return
    from .gpus import sync_gpus

    sync_gpus(instance)
