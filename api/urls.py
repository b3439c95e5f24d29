"""/api/v1/ (the REST API), /api/schema (OpenAPI) and /api/docs (Swagger UI, for a logged-in browser)."""

from __future__ import annotations

from django.conf import settings
from django.contrib.auth.decorators import login_not_required, login_required
from django.urls import path
from django.utils.csp import CSP
from django.views.decorators.csp import csp_override
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView

from serving import api_views as serving_views

from . import views

app_name = "api"


def api(view):
    """DRF authenticates API calls itself (tokens or the session): Django's login redirect stays out of it."""
    return login_not_required(view.as_view())


class SchemaView(SpectacularAPIView):
    policy_actions = {"GET": "view"}


class DocsView(SpectacularSwaggerSplitView):
    policy_actions = {"GET": "view"}


# Swagger UI sets a few inline styles; scripts stay as strict as every other page's.
DOCS_CSP = {**settings.SECURE_CSP, "style-src": [CSP.SELF, CSP.UNSAFE_INLINE]}

urlpatterns = [
    path("v1/jobs/", api(views.JobsView), name="jobs"),
    path("v1/jobs/<str:name>/", api(views.JobView), name="job"),
    path("v1/jobs/<str:name>/logs", api(views.JobLogsView), name="job-logs"),
    path("v1/jobs/<str:name>/results", api(views.JobResultsView), name="job-results"),
    path("v1/jobs/<str:name>/metrics", api(views.JobMetricsView), name="job-metrics"),
    path("v1/jobs/<str:name>/packages", api(views.JobPackagesView), name="job-packages"),
    path("v1/jobs/<str:name>/cancel", api(views.JobCancelView), name="job-cancel"),
    path("v1/jobs/<str:name>/resume", api(views.JobResumeView), name="job-resume"),
    path("v1/queue", api(views.QueueView), name="queue"),
    path("v1/health", api(views.HealthView), name="health"),
    path("v1/nodes/<str:name>/drain", api(views.NodeDrainView), name="node-drain"),
    path(
        "v1/nodes/<str:name>/undrain", login_not_required(views.NodeDrainView.as_view(enable=True)), name="node-undrain"
    ),  # fmt: skip
    path("v1/audit", api(views.AuditView), name="audit"),
    path("v1/alerts", api(views.AlertsView), name="alerts"),
    path("v1/tokens", api(views.TokensView), name="tokens"),
    path("v1/tokens/<str:prefix>/revoke", api(views.TokenRevokeView), name="token-revoke"),
    path("v1/preflight", api(views.PreflightView), name="preflight"),
    path("v1/netcheck", api(views.NetcheckView), name="netcheck"),
    path("v1/spec/<str:kind>.schema.json", api(views.SpecSchemaView), name="spec-schema"),
    path("v1/spec/<str:kind>", api(views.SpecView), name="spec-read"),
    path("v1/cluster", api(views.ClusterConfigView), name="cluster"),
    path("v1/nodes/<str:name>/trust", api(views.NodeTrustView), name="node-trust"),
    path("v1/nodes/<str:name>/disk", api(views.NodeDiskView), name="node-disk"),
    path("v1/nodes/<str:name>/envs", api(views.NodeEnvsView), name="node-envs"),
    path("v1/nodes", api(views.NodesView), name="nodes"),
    path("v1/nodes/<str:name>/probe", api(views.NodeProbeView), name="node-probe"),
    path("v1/nodes/<str:name>/sleep", api(views.NodePowerView), name="node-sleep"),
    path("v1/nodes/<str:name>/wake", api(views.NodeWakeView), name="node-wake"),
    path("v1/services/", api(serving_views.ServicesView), name="services"),
    path("v1/services/<str:name>/", api(serving_views.ServiceView), name="service"),
    path("v1/services/<str:name>/stop", api(serving_views.ServiceStopView), name="service-stop"),
    path("v1/sweeps/", api(views.SweepsView), name="sweeps"),
    path("v1/sweeps/<str:name>/", api(views.SweepView), name="sweep"),
    path("v1/sweeps/<str:name>/cancel", api(views.SweepCancelView), name="sweep-cancel"),
    path("v1/sync", api(views.SyncView), name="sync"),
    path("v1/sync/objects", api(views.SyncObjectsView), name="sync-objects"),
    path("v1/me", api(views.MeView), name="me"),
    path("v1/controller", api(views.ControllerView), name="controller"),
    path("schema", api(SchemaView), name="schema"),
    # the docs page is for people: Django's login first (the split view serves its script as a file: CSP)
    path("docs", login_required(csp_override(DOCS_CSP)(DocsView.as_view(url_name="api:schema"))), name="docs"),
]
