"""/api/v1/services/: start, list and stop services through the REST API (`ugro serve`)."""

from __future__ import annotations

from django.http import Http404
from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.audit import web_source
from ugro_site.celery import NoWorker

from .models import Service
from .requests import ServeError, describe, listing, start_service, stop_service
from .spec import request_of_body


def _service(name: str) -> Service:
    service = Service.objects.select_related("checkpoint__node", "job").filter(name=name).first()
    if service is None:
        raise Http404(f"no service named {name!r}")
    return service


class ServicesView(APIView):
    policy_actions = {"GET": "view", "POST": "serve"}

    @extend_schema(summary="Every service and each replica's state (`ugro serve --list`)", responses=None)
    def get(self, request: Request) -> Response:
        services = [describe(s) for s in Service.objects.select_related("checkpoint__node", "job").order_by("name")]
        return Response({"services": services, "lines": listing(services)})

    @extend_schema(summary='Start a service (`ugro serve NAME --from JOB[:STEP]`): body {"name", "from", "replicas", '
                   '"gpus_per_replica", "engine", "command", "min_replicas", "max_replicas", "target_outstanding", '
                   '"idle_after", "cold_start_timeout"}, and a service file\'s text as "spec" (`ugro serve -f`; the '
                   'fields win over it); the worker starts its replicas. For a service not stopped, a new "from" is '
                   'a rolling update (200, "update": true)', request=None, responses=None)  # fmt: skip
    def post(self, request: Request) -> Response:
        try:
            req = request_of_body(request.data)
            updating = Service.objects.filter(name=req.name, state__in=Service.AWAKE_OR_ASLEEP).exists()
            service = start_service(request.user, req, web_source(request))
        except ServeError as exc:
            return Response({"error": str(exc)}, status=status.HTTP_400_BAD_REQUEST)
        except NoWorker as exc:
            return Response({"error": str(exc)}, status=status.HTTP_503_SERVICE_UNAVAILABLE)
        if updating:
            return Response({**describe(service), "update": True})
        return Response(describe(service), status=status.HTTP_201_CREATED)


class ServiceView(APIView):
    policy_actions = {"GET": "view"}

    @extend_schema(summary="One service and each replica's state", responses=None)
    def get(self, request: Request, name: str) -> Response:
        return Response(describe(_service(name)))


class ServiceStopView(APIView):
    policy_actions = {"POST": "serve"}

    @extend_schema(summary="Stop a service (`ugro serve NAME --stop`): it is stopping now; poll it until stopped",
                   request=None, responses=None)  # fmt: skip
    def post(self, request: Request, name: str) -> Response:
        service = _service(name)
        try:
            stop_service(request.user, service, web_source(request))
        except ServeError as exc:
            return Response({"error": str(exc)}, status=status.HTTP_409_CONFLICT)
        except NoWorker as exc:
            return Response({"error": str(exc)}, status=status.HTTP_503_SERVICE_UNAVAILABLE)
        return Response(describe(_service(name)))
