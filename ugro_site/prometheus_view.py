"""`/metrics` for Prometheus: node, GPU, health, job, alert and service replica series read from the database.

Off unless UGRO_PROMETHEUS_TOKEN is set (404 until then); scrapes then need
`Authorization: Bearer <token>` (403 without). Each scrape reads the latest raw sample of every
node, so the numbers are as fresh as the health monitor's last poll (see docs/prometheus.md).
"""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from datetime import timedelta

from django.conf import settings
from django.contrib.auth.decorators import login_not_required
from django.db.models import Count, OuterRef, Q, Subquery
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseForbidden
from django.utils import timezone
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from cluster.models import GPU, Alert, HealthSample, Node
from jobs.energy import J_PER_WH, job_energies
from jobs.models import Job
from serving.models import Replica, Service
from serving.stats import recent

NODE_GAUGES = (
    ("cpu_percent", "ugro_node_cpu_percent", "CPU busy, percent"),
    ("ram_percent", "ugro_node_ram_percent", "RAM used, percent"),
    ("disk_percent", "ugro_node_disk_percent", "Disk of the work dir used, percent"),
    ("disk_free_gb", "ugro_node_disk_free_gigabytes", "Disk free under the work dir, GiB"),
    ("load1", "ugro_node_load1", "1-minute load average"),
    ("rtt_ms", "ugro_node_ssh_rtt_milliseconds", "Probe round trip over the warm SSH link, ms"),
)
GPU_GAUGES = (
    ("util_percent", "ugro_gpu_utilization_percent", "GPU utilization, percent"),
    ("mem_used_mb", "ugro_gpu_memory_used_megabytes", "GPU memory used, MiB"),
    ("mem_total_mb", "ugro_gpu_memory_total_megabytes", "GPU memory total, MiB"),
    ("temp_c", "ugro_gpu_temperature_celsius", "GPU temperature, C"),
    ("power_w", "ugro_gpu_power_watts", "GPU power draw, W"),
)


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


class ClusterCollector:
    """Builds every metric from the database at scrape time (nothing is kept in memory)."""

    def collect(self) -> Iterator[Metric]:
        latest = HealthSample.objects.filter(node=OuterRef("pk"), kind=HealthSample.Kind.RAW, ok=True)
        nodes = list(
            Node.objects.filter(enabled=True).annotate(sample_id=Subquery(latest.order_by("-time").values("pk")[:1]))
        )
        samples = HealthSample.objects.in_bulk([n.sample_id for n in nodes if n.sample_id])
        now = timezone.now()

        up = GaugeMetricFamily("ugro_node_up", "1 unless the monitor marked the node DOWN", labels=["node"])
        score = GaugeMetricFamily("ugro_node_health_score", "Health score 0-100", labels=["node"])
        status = GaugeMetricFamily("ugro_node_status", "1 for the node's current status", labels=["node", "status"])
        age = GaugeMetricFamily("ugro_node_sample_age_seconds", "Age of the latest good probe", labels=["node"])
        node_gauges = {f: GaugeMetricFamily(name, doc, labels=["node"]) for f, name, doc in NODE_GAUGES}
        gpu_gauges = {f: GaugeMetricFamily(name, doc, labels=["node", "gpu", "name"]) for f, name, doc in GPU_GAUGES}
        for node in nodes:
            up.add_metric([node.name], 0.0 if node.status == Node.Status.DOWN else 1.0)
            if node.health_score is not None:
                score.add_metric([node.name], float(node.health_score))
            for value in Node.Status.values:
                status.add_metric([node.name, value], 1.0 if node.status == value else 0.0)
            sample = samples.get(node.sample_id)
            if sample is None:
                continue
            age.add_metric([node.name], (now - sample.time).total_seconds())
            for field, gauge in node_gauges.items():
                if (v := _number(getattr(sample, field))) is not None:
                    gauge.add_metric([node.name], v)
            for pos, gpu in enumerate(sample.gpus or []):
                labels = [node.name, str(gpu.get("index", pos)), str(gpu.get("name") or "")]
                for field, gauge in gpu_gauges.items():
                    if (v := _number(gpu.get(field))) is not None:
                        gauge.add_metric(labels, v)
        yield from (up, score, status, age, *node_gauges.values(), *gpu_gauges.values())

        # The model the probe last read, also for a node whose latest probe failed (one series per GPU).
        info = GaugeMetricFamily("ugro_gpu_info", "1 per GPU, labelled with its model as the probe read it",
                                 labels=["node", "gpu", "name"])  # fmt: skip
        names = {n.pk: n.name for n in nodes}
        for gpu in GPU.objects.filter(node__in=list(names)).order_by("node_id", "index"):
            info.add_metric([names[gpu.node_id], str(gpu.index), gpu.model], 1.0)
        yield info

        jobs = GaugeMetricFamily("ugro_jobs", "Jobs by state", labels=["state"])
        counts = dict(Job.objects.values_list("state").annotate(n=Count("id")))
        for state in Job.State.values:
            jobs.add_metric([state], float(counts.get(state, 0)))
        yield jobs
        yield GaugeMetricFamily("ugro_queue_length", "Jobs waiting for nodes", value=counts.get(Job.State.QUEUED, 0))

        # Failures of the last day, one series per job: what failed, where, and the decisive line.
        failed = GaugeMetricFamily(
            "ugro_job_failed", "1 per job that failed in the last 24 h, labelled with its failure",
            labels=["job", "kind", "rank", "node", "exit_code", "line"],
        )  # fmt: skip
        since = now - timedelta(hours=24)
        failed_since = Job.objects.filter(state=Job.State.FAILED, current__finished_at__gte=since)
        failed_since = failed_since.select_related("current").order_by("-current__finished_at")
        for job in failed_since[:100]:
            failed.add_metric(
                [job.name, job.failure_kind or "UNKNOWN", "" if job.failure_rank is None else str(job.failure_rank),
                 job.failure_node, "" if job.failure_exit_code is None else str(job.failure_exit_code),
                 (job.failure_line or "")[:200]],
                1.0,
            )  # fmt: skip
        yield failed
        yield from _energy(since)

        alerts = GaugeMetricFamily("ugro_alerts_open", "Open alerts by severity", labels=["severity"])
        open_counts = dict(
            Alert.objects.filter(resolved_at__isnull=True).values_list("severity").annotate(n=Count("id"))
        )
        for severity in Alert.Severity.values:
            alerts.add_metric([severity], float(open_counts.get(severity, 0)))
        yield alerts


def _energy(since) -> Iterator[Metric]:
    """Each live job's energy so far and each job's that ended since `since` (docs/power.md); none where not
    measured (a series at 0 would say it cost nothing)."""
    joules = GaugeMetricFamily(
        "ugro_job_energy_joules", "Energy of the job's GPUs (and hosts' CPUs where RAPL is readable), all attempts, "
        "so far while it runs; jobs live or ended in the last 24 h", labels=["job", "state"],
    )  # fmt: skip
    cost = GaugeMetricFamily("ugro_job_energy_cost", "That energy at cluster.yaml's power.price_per_kwh",
                             labels=["job", "state", "currency"])  # fmt: skip
    live = [*Job.LIVE_STATES, *Job.STOPPING_STATES]
    jobs = list(Job.objects.filter(Q(state__in=live) | Q(current__finished_at__gte=since)).order_by("-pk")[:100])
    used = job_energies(jobs)
    for job in jobs:
        e = used[job.pk]
        if e.wh is not None:
            joules.add_metric([job.name, job.state], e.wh * J_PER_WH)
        if e.cost is not None:
            cost.add_metric([job.name, job.state, e.currency], e.cost)
    yield joules
    yield cost


REPLICA_LABELS = ["service", "replica", "node"]


class ServiceCollector:
    """Each replica of every service not stopped: its state, restarts, and the endpoint's requests to it
    (totals as counters; the last minute's rate, latency and tokens as gauges, as the services page shows)."""

    def collect(self) -> Iterator[Metric]:
        replicas = list(Replica.objects.exclude(service__state=Service.State.STOPPED)
                        .select_related("service", "node").order_by("service__name", "index"))  # fmt: skip
        traffic = recent(replicas)
        state = GaugeMetricFamily("ugro_replica_state", "1 for the replica's current state",
                                  labels=[*REPLICA_LABELS, "state"])  # fmt: skip
        counters = {
            "restarts": CounterMetricFamily("ugro_replica_restarts", "Restarts of the replica", labels=REPLICA_LABELS),
            "requests_total": CounterMetricFamily("ugro_replica_requests", "Requests the endpoint sent it",
                                                  labels=REPLICA_LABELS),
            "errors_total": CounterMetricFamily("ugro_replica_errors", "Its requests that failed: refused, reset, "
                                                "a 5xx, or cut off", labels=REPLICA_LABELS),
            "tokens_total": CounterMetricFamily("ugro_replica_completion_tokens", "Completion tokens it answered",
                                                labels=REPLICA_LABELS),
        }  # fmt: skip
        gauges = {
            "rps": GaugeMetricFamily("ugro_replica_requests_per_second", "Requests per second, last minute",
                                     labels=REPLICA_LABELS),
            "p50_s": GaugeMetricFamily("ugro_replica_latency_p50_seconds", "Median latency to the last byte, "
                                       "last minute", labels=REPLICA_LABELS),
            "p99_s": GaugeMetricFamily("ugro_replica_latency_p99_seconds", "99th percentile latency, last minute",
                                       labels=REPLICA_LABELS),
            "tokens_per_s": GaugeMetricFamily("ugro_replica_tokens_per_second", "Completion tokens per second, "
                                              "last minute", labels=REPLICA_LABELS),
        }  # fmt: skip
        for r in replicas:
            labels = [r.service.name, str(r.index), r.node.name if r.node else ""]
            for value in Replica.State.values:
                state.add_metric([*labels, value], 1.0 if r.state == value else 0.0)
            stats = traffic[r.pk]
            counters["restarts"].add_metric(labels, float(r.restarts))
            for field in ("requests_total", "errors_total", "tokens_total"):
                counters[field].add_metric(labels, float(getattr(stats, field)))
            for field, gauge in gauges.items():
                if (v := getattr(stats, field)) is not None:
                    gauge.add_metric(labels, float(v))
        yield from (state, *counters.values(), *gauges.values())


def _authorized(request: HttpRequest, token: str) -> bool:
    header = request.headers.get("Authorization", "")
    scheme, _, given = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


@login_not_required
@require_GET
def prometheus(request: HttpRequest) -> HttpResponse:
    token = getattr(settings, "UGRO_PROMETHEUS_TOKEN", "")
    if not token:
        raise Http404("metrics are off (set UGRO_PROMETHEUS_TOKEN)")
    if not _authorized(request, token):
        return HttpResponseForbidden("bearer token required\n", content_type="text/plain")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ClusterCollector())
    registry.register(ServiceCollector())
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)
