"""The services page: every service, each replica's state, where it runs, and its requests of the last minute;
for those who may serve, a form that starts a service (`ugro serve NAME --from JOB`) and a stop button on each."""

from __future__ import annotations

from django import forms
from django.contrib import messages
from django.db.models import Case, IntegerField, Value, When
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_GET, require_POST

from accounts import policy
from accounts.audit import web_source
from ugro_site.celery import NoWorker

from .models import Replica, Service
from .replica_logs import shown
from .replicas import log_tail
from .requests import MAX_REPLICAS, ServeError, ServeRequest, start_service, stop_service
from .stats import WINDOW_S, recent


class ServeForm(forms.Form):
    """The page's `ugro serve NAME --from JOB[:STEP|latest] --replicas N --gpus-per-replica K --engine E`."""

    name = forms.CharField(
        max_length=48,
        help_text="The endpoint is /serve/NAME/v1/. A running service's name: "
        "a rolling update to the checkpoint below (its other fields as they are).",
    )
    source = forms.CharField(
        label="From", max_length=120, help_text="JOB, JOB:STEP or JOB:latest (a checkpoint directory)."
    )
    replicas = forms.IntegerField(min_value=1, max_value=MAX_REPLICAS, required=False,
                                  help_text="How many start (default: the minimum, at least 1).")  # fmt: skip
    min_replicas = forms.IntegerField(label="Min replicas", min_value=0, max_value=MAX_REPLICAS, required=False,
                                      help_text="0: it sleeps when idle and wakes on a request.")  # fmt: skip
    max_replicas = forms.IntegerField(label="Max replicas", min_value=1, max_value=MAX_REPLICAS, required=False,
                                      help_text="Added with the load up to this.")  # fmt: skip
    idle_after = forms.CharField(label="Idle after", max_length=20, required=False,
                                 help_text="Min 0: sleep after this long without a request (15m).")  # fmt: skip
    gpus_per_replica = forms.IntegerField(label="GPUs per replica", min_value=0, initial=1)
    engine = forms.ChoiceField(choices=Service.Engine.choices, initial=Service.Engine.TRANSFORMERS)
    command = forms.CharField(
        max_length=1000,
        required=False,
        help_text="custom only: argv with {model} {host} {port} {gpus} {name} {python}; no shell.",
    )

    def serve_request(self) -> ServeRequest:
        d = self.cleaned_data
        return ServeRequest(
            name=d["name"].strip(),
            source=d["source"].strip(),
            replicas=d["replicas"],
            gpus_per_replica=d["gpus_per_replica"],
            engine=d["engine"],
            command=d["command"] or None,
            min_replicas=d["min_replicas"],
            max_replicas=d["max_replicas"],
            idle_after=d["idle_after"].strip() or None,
        )


@require_GET
def services_page(request: HttpRequest) -> HttpResponse:
    return _page(request, ServeForm())


@require_POST
def service_start(request: HttpRequest) -> HttpResponse:
    """The start form (`serve` in the policy table): the page again with the error, or back to it once queued."""
    form = ServeForm(request.POST)
    if form.is_valid():
        req = form.serve_request()
        live = Service.objects.filter(name=req.name, state__in=Service.AWAKE_OR_ASLEEP).exists()
        try:
            service = start_service(request.user, req, web_source(request))
        except (ServeError, NoWorker, policy.Refused) as exc:
            form.add_error(None, str(exc))
        else:  # a live service's name: a rolling update to that checkpoint (serving/updates.py), its note says which
            said = f"service {service.name}: {service.note}" if live else f"service {service.name} starting"
            messages.success(request, f"{said}: /serve/{service.name}/v1/")
            return redirect("services")
    return _page(request, form, status=400)


def _page(request: HttpRequest, form: ServeForm, status: int = 200) -> HttpResponse:
    """Services not stopped first, then stopped ones; each replica with its request stats (three queries)."""
    stopped_last = Case(When(state=Service.State.STOPPED, then=Value(1)), default=Value(0), output_field=IntegerField())
    services = Service.objects.select_related("job", "checkpoint", "next_checkpoint")
    services = list(services.order_by(stopped_last, "name"))
    replicas = list(Replica.objects.filter(service__in=services).select_related("node", "checkpoint").order_by("index"))
    traffic = recent(replicas)
    by_service: dict[int, list[Replica]] = {s.pk: [] for s in services}
    for r in replicas:
        r.stats = traffic[r.pk]
        by_service[r.service_id].append(r)
    for s in services:
        # replicas that left (asleep, scaled down, replaced by an update) are not listed while the service lives
        s.rows = [r for r in by_service[s.pk] if s.state == Service.State.STOPPED or r.state != Replica.State.STOPPED]
        s.idle_after_min = f"{s.idle_after_s / 60:g}" if s.idle_after_s else ""
    return render(request, "serving/services.html", {"services": services, "window_s": int(WINDOW_S), "form": form,
                                                     "live_states": Service.AWAKE_OR_ASLEEP,
                                                     "may_serve": policy.allowed(request.user, "serve"),
                                                     "nav": "services"}, status=status)  # fmt: skip


@require_POST
def service_stop(request: HttpRequest, name: str) -> HttpResponse:
    """`ugro serve NAME --stop`: the worker drains and stops its replicas and frees their GPUs."""
    service = get_object_or_404(Service, name=name)
    try:
        stop_service(request.user, service, web_source(request))
    except (ServeError, NoWorker, policy.Refused) as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, f"service {service.name} stopping")
    return redirect("services")


@require_GET
def replica_log(request: HttpRequest, name: str, index: int) -> HttpResponse:
    """The tail of one replica's log: its central copy (serving/replica_logs.py), else read from its node now;
    escaped (it is what the engine printed); the page reloads it every 5 s."""
    replica = get_object_or_404(Replica.objects.select_related("service", "node"), service__name=name, index=index)
    text, error, central = shown(replica), "", True
    if text is None:  # nothing copied yet (a replica started before logs were copied): read from its node
        central = False
        try:
            text = log_tail(replica)
        except ValueError as exc:
            text, error = "", str(exc)
    return render(request, "serving/replica_log.html", {"replica": replica, "text": text, "error": error,
                                                        "central": central, "nav": "services"})  # fmt: skip
