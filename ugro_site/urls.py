"""URL routes: each app's pages and JSON endpoints, admin and auth."""

from __future__ import annotations

from django.conf import settings
from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path

from serving import pages as serving_pages

from . import cluster_views, prometheus_view, views

# django.contrib.auth.urls without the password reset views unless mail is configured (a reset link
# that can never arrive only tells an attacker which accounts exist).
auth_urls = [
    path("login/", auth_views.LoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("password_change/", auth_views.PasswordChangeView.as_view(), name="password_change"),
    path("password_change/done/", auth_views.PasswordChangeDoneView.as_view(), name="password_change_done"),
]
if settings.PASSWORD_RESET_ENABLED:
    auth_urls += [
        path("password_reset/", auth_views.PasswordResetView.as_view(), name="password_reset"),
        path("password_reset/done/", auth_views.PasswordResetDoneView.as_view(), name="password_reset_done"),
        path("reset/<uidb64>/<token>/", auth_views.PasswordResetConfirmView.as_view(), name="password_reset_confirm"),
        path("reset/done/", auth_views.PasswordResetCompleteView.as_view(), name="password_reset_complete"),
    ]

urlpatterns = [
    path("favicon.ico", views.favicon, name="favicon"),
    path("admin/", admin.site.urls),
    path("accounts/", include(auth_urls)),
    path("api/", include("api.urls")),
    path("", cluster_views.overview, name="cluster-overview"),
    path("metrics", prometheus_view.prometheus, name="prometheus-metrics"),
    path("services/", serving_pages.services_page, name="services"),
    path("services/start", serving_pages.service_start, name="service-start"),
    path("services/<str:name>/stop", serving_pages.service_stop, name="service-stop-page"),
    path("services/<str:name>/replicas/<int:index>/log", serving_pages.replica_log, name="replica-log"),
    path("nodes/<str:name>/", cluster_views.node_detail, name="node-detail"),
    path("api/nodes/<str:name>/history", cluster_views.api_node_history, name="api-node-history"),
    path("", include("jobs.urls")),
    path("", include("metrics.urls")),
]
