from __future__ import annotations

from django.apps import AppConfig


def cache_needs():
    """What the nodes' caches keep for each service not stopped (jobs/cache.py): the trees of the job whose
    checkpoint it serves, and the checkpoint's object where it travelled as one."""
    from jobs.cache import Needs

    from .models import Service

    needs = Needs()
    serving = Service.objects.exclude(state=Service.State.STOPPED)
    for name, job, sha in serving.values_list("name", "job__name", "checkpoint__sha256"):
        needs.jobs.setdefault(job, f"service {name}")
        if sha:
            needs.shas.setdefault(sha, f"service {name}")
    return needs


class ServingConfig(AppConfig):
    name = "serving"
    verbose_name = "Serving"

    def ready(self) -> None:
        from jobs import cache, retention

        from .replicas import checkpoint_uses

        retention.uses_from(checkpoint_uses)  # a served checkpoint is never deleted; its replicas' copies go with it
        cache.needs_from(cache_needs)  # a service's job keeps its trees and its checkpoint's object
