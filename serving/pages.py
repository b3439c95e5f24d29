"""The services page: every service, each replica's state, where it runs, and its requests of the last minute."""

from __future__ import annotations

from django.db.models import Case, IntegerField, Value, When
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from .models import Replica, Service
from .stats import WINDOW_S, recent


@require_GET
def services_page(request: HttpRequest) -> HttpResponse:
    """Services not stopped first, then stopped ones; each replica with its request stats (three queries)."""
    stopped_last = Case(When(state=Service.State.STOPPED, then=Value(1)), default=Value(0), output_field=IntegerField())
    services = list(Service.objects.select_related("job", "checkpoint").order_by(stopped_last, "name"))
    replicas = list(Replica.objects.filter(service__in=services).select_related("node").order_by("index"))
    traffic = recent(replicas)
    by_service: dict[int, list[Replica]] = {s.pk: [] for s in services}
    for r in replicas:
        r.stats = traffic[r.pk]
        by_service[r.service_id].append(r)
    for s in services:
        s.rows = by_service[s.pk]
    return render(request, "serving/services.html", {"services": services, "window_s": int(WINDOW_S),
                                                     "nav": "services"})  # fmt: skip
