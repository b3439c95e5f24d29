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
from .requests import ServeError, ServeRequest, describe, listing, start_service, stop_service


def _service(name: str) -> Service:
    service = Service.objects.select_related("checkpoint__node", "job").filter(name=name).first()
    if service is None:
        raise Http404(f"no service named {name!r}")
    return service


def _int(body: dict, key: str) -> int | None:
    value = body.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ServeError(f"{key} must be a whole number, not {value!r}")
    return value


def _duration(body: dict, key: str) -> str | int | None:
    value = body.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, str))):
        raise ServeError(f"{key} must be a duration like 15m or a number of seconds, not {value!r}")
    return value


class ServicesView(APIView):
    policy_actions = {"GET": "view", "POST": "serve"}

    @extend_schema(summary="Every service and each replica's state (`ugro serve --list`)", responses=None)
    def get(self, request: Request) -> Response:
        services = [describe(s) for s in Service.objects.select_related("checkpoint__node", "job").order_by("name")]
        return Response({"services": services, "lines": listing(services)})

    @extend_schema(summary='Start a service (`ugro serve NAME --from JOB[:STEP]`): body {"name", "from", "replicas", '
                   '"gpus_per_replica", "engine", "command", "min_replicas", "max_replicas", "target_outstanding", '
                   '"idle_after", "cold_start_timeout"}; the worker starts its replicas. For a service not stopped, '
                   '"from" alone is a rolling update (200, "update": true)', request=None,
                   responses=None)  # fmt: skip
    def post(self, request: Request) -> Response:
        body = request.data if isinstance(request.data, dict) else {}
        name = str(body.get("name") or "")
        try:
            req = ServeRequest(
                name=name, source=str(body.get("from") or ""),
                replicas=_int(body, "replicas"), gpus_per_replica=_int(body, "gpus_per_replica"),
                engine=str(body["engine"]) if body.get("engine") else None,
                command=str(body["command"]) if body.get("command") else None,
                min_replicas=_int(body, "min_replicas"), max_replicas=_int(body, "max_replicas"),
                target_outstanding=_int(body, "target_outstanding"), idle_after=_duration(body, "idle_after"),
                cold_start_timeout=_duration(body, "cold_start_timeout"),
            )  # fmt: skip
            updating = Service.objects.filter(name=name, state__in=Service.AWAKE_OR_ASLEEP).exists()
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
