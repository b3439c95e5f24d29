"""The REST API (/api/v1/): everything the `ugro` client does. Handlers only read or enqueue: no request
talks to a node (launch queues the job and asks the worker to schedule it; cancel moves the job to
CANCELLING and the worker stops its processes), but one: `trust` reads the key a node offers now, bounded
by the connect timeout."""

from __future__ import annotations

import csv
import heapq
import io
import re
import tarfile

import yaml
from django.http import Http404, HttpResponse
from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import status
from rest_framework.exceptions import APIException, ValidationError
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView, exception_handler

from accounts import actions, audit, policy
from accounts.audit import web_source
from accounts.models import ApiToken, AuditEvent
from accounts.tokens import create_token, revoke
from cluster.alerts import alert_record
from cluster.config_yaml import ConfigError, export_cluster, import_cluster
from cluster.hostkeys import trust
from cluster.links import AgentRequestError, LinkError
from cluster.models import Alert, Node
from cluster.power import PowerError
from cluster.provision import ProvisionError, add_node, probe_node
from jobs import cache, envs, report, retention, sync
from jobs.energy import energy_record, energy_records, job_energies
from jobs.launch import LaunchError, preflight_nodes
from jobs.logs import LogLine, earlier_attempt, job_lines, rank_lines
from jobs.models import Job, JobCode, Rank, Sweep
from jobs.network import NetcheckError, netcheck
from jobs.network import advice as network_advice
from jobs.network import report as netcheck_report
from jobs.power import by_hand as power_by_hand
from jobs.recovery import RecoveryError
from jobs.scheduler import request_schedule
from jobs.snapshot import queue
from jobs.sweeps import trial_rows
from metrics.models import FinalMetric, MetricPoint
from metrics.series import metric_names
from ugro_client import __version__, manifest
from ugro_site.celery import NO_SCHEDULER, scheduler_alive, send_task, worker_alive

from . import serializers as s
from . import spec

MAX_TAIL = 5000
MAX_LINES = 5000  # lines per `since` answer; `more` says when to ask again at once
LIST_MAX = 500


def one_line_errors(exc, context):
    """Every error as {"error": "one line"} (DRF's own shapes are nested per field)."""
    if isinstance(exc, LaunchError):
        exc = ValidationError(str(exc))
    elif isinstance(exc, policy.Refused):
        return Response({"error": str(exc)}, status=status.HTTP_403_FORBIDDEN)
    elif isinstance(exc, Http404):
        return Response({"error": str(exc) or "not found"}, status=status.HTTP_404_NOT_FOUND)
    response = exception_handler(exc, context)
    if response is None:
        return None
    response.data = {"error": _first_message(exc.detail if isinstance(exc, APIException) else response.data)}
    return response


def _first_message(detail, field: str = "") -> str:
    if isinstance(detail, dict):
        for key, value in detail.items():
            return _first_message(value, "" if key in ("non_field_errors", "detail") else key)
    if isinstance(detail, list) and detail:
        return _first_message(detail[0], field)
    text = str(detail)
    return f"{field}: {text}" if field else text


def _job(name: str) -> Job:
    job = Job.objects.select_related("owner").filter(name=name).first()
    if job is None:
        raise Http404(f"no job named {name!r}")
    return job


def job_summary(job: Job, prog: dict | None = None, energy: dict | None = None) -> dict:
    """A job as the API lists it; `prog` is jobs.report.job_progress's answer (None: not asked, or none); `energy`
    its jobs.energy record where a list read all of them at once."""
    ranks = list(job.ranks.all())
    nodes = [r.node.name for r in sorted(ranks, key=lambda r: r.index)] or job.nodes_asked
    pct = prog["percent"] if prog else (100.0 if job.state == Job.State.SUCCEEDED else None)
    return {
        "id": job.pk,
        "name": job.name,
        "state": job.state,
        "owner": job.owner.get_username() if job.owner_id else None,
        "priority": job.priority,
        "attempt": job.attempt,
        "nodes": nodes,
        "progress": pct,
        "step": prog["step"] if prog else None,
        "max_steps": prog["max_steps"] if prog else None,
        "created_at": job.created_at,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
        "age_s": (timezone.now() - job.created_at).total_seconds(),
        "duration_s": job.duration(),
        "failure_kind": job.failure_kind,
        "failure_reason": job.failure_reason,
        "energy": energy if energy is not None else energy_record(job),
    }


def live_progress(job: Job) -> dict | None:
    """Progress for lists: live jobs only (an ended job costs no metric queries there)."""
    return report.job_progress(job) if job.running_at and job.is_live else None


def job_detail(job: Job) -> dict:
    """One job as `ugro status NAME` shows it; `ugro results NAME` starts from the same dict, so the two
    cannot disagree on a field they share."""
    ranks = list(job.ranks.select_related("node").order_by("index"))
    return {
        **job_summary(job, report.job_progress(job)),
        "script": job.script,
        "script_args": [str(a) for a in job.script_args or []],
        "rdzv_endpoint": job.rdzv_endpoint,
        "launch_spread_s": job.launch_spread_s,
        "ranks": [
            {
                "index": r.index,
                "node": r.node.name,
                "state": r.state,
                "exit_code": r.exit_code,
                "log_lines": r.log_lines,
                "log_offset": r.log_offset,
            }
            for r in ranks
        ],  # fmt: skip
        "lines": report.job_detail(job),
        "code": report.code_record(job),
        "retention": retention.summary(job),
        "scale_probe": report.probe_record(job),  # each node count's samples/s and the count chosen
        "network_advice": network_advice(job) or None,  # a multi-node job's share of communication
    }


def _jobs_qs():
    return Job.objects.select_related("owner", "current").prefetch_related("current__ranks__node")


class JobsView(APIView):
    policy_actions = {"GET": "view", "POST": "launch"}

    @extend_schema(
        summary="Recent jobs (`ugro status`)",
        parameters=[
            OpenApiParameter("limit", int, description="at most this many, newest first (default 20)"),
            OpenApiParameter("state", str, description="only jobs in this state"),
        ],  # fmt: skip
        responses=s.JobSerializer(many=True),
    )
    def get(self, request: Request) -> Response:
        try:
            limit = min(LIST_MAX, max(1, int(request.query_params.get("limit", 20))))
        except ValueError:
            raise ValidationError("limit must be an integer") from None
        jobs = _jobs_qs()
        state = request.query_params.get("state", "")
        if state:
            if state not in Job.State.values:
                raise ValidationError(f"state must be one of {', '.join(Job.State.values)}")
            jobs = jobs.filter(state=state)
        listed = list(jobs[:limit])
        energy = energy_records(listed)  # every job's in a few queries
        rows = [job_summary(j, live_progress(j), energy[j.pk]) for j in listed]
        return Response(s.JobSerializer(rows, many=True).data)

    @extend_schema(
        summary="Launch a job (`ugro launch`): queued now, started by the worker when its nodes are free",
        request=s.LaunchSerializer,
        responses={201: s.JobSerializer, 200: s.LinesSerializer},
    )
    def post(self, request: Request) -> Response:
        data = s.LaunchSerializer(data=spec.merged(request.data, "launch"))
        data.is_valid(raise_exception=True)
        req = data.launch_request()
        if data.validated_data["dry_run"]:
            resolved = {k: v for k, v in data.validated_data.items() if k in s.LaunchSerializer().fields}
            return Response({"lines": actions.preview(request.user, req), "spec": resolved})
        job = actions.launch(request.user, req, web_source(request))
        request_schedule()
        data = {**s.JobSerializer(job_summary(job, live_progress(job))).data, "worker_alive": worker_alive()}
        return Response(data, status=status.HTTP_201_CREATED)


class JobView(APIView):
    policy_actions = {"GET": "view"}

    @extend_schema(summary="One job: ranks, nodes, exit codes, the failure explained (`ugro status NAME`)",
                   responses=s.JobDetailSerializer)  # fmt: skip
    def get(self, request: Request, name: str) -> Response:
        return Response(s.JobDetailSerializer(job_detail(_job(name))).data)


def _parse_since(text: str) -> dict[int, int]:
    """`0:1234,1:88` -> {0: 1234, 1: 88}."""
    offsets = {}
    for item in filter(None, text.split(",")):
        m = re.fullmatch(r"(\d{1,4}):(\d{1,15})", item.strip())
        if not m:
            raise ValidationError("since must look like 0:1234,1:88 (rank:byte offset, as `offsets` returned)")
        offsets[int(m.group(1))] = int(m.group(2))
    return offsets


def lines_since(ranks: list[Rank], since: dict[int, int], limit: int) -> tuple[list[LogLine], dict[int, int], bool]:
    """Committed lines after each rank's offset, merged by arrival, at most `limit`; new offsets; more left?"""
    streams = []
    for r in ranks:
        start = min(since.get(r.index, 0), r.log_offset)
        streams.append(((end, line) for end, line in rank_lines(r, start)))
    offsets = {r.index: min(since.get(r.index, 0), r.log_offset) for r in ranks}
    out: list[LogLine] = []
    merged = heapq.merge(*streams, key=lambda item: (item[1].time, item[1].rank, item[1].seq))
    for end, line in merged:
        if len(out) >= limit:
            return out, offsets, True
        out.append(line)
        offsets[line.rank] = end
    return out, offsets, False


class JobLogsView(APIView):
    policy_actions = {"GET": "view"}

    @extend_schema(
        summary="A job's log lines: the tail, or every line after `since` (`ugro logs [--follow]`)",
        description="To follow, call again with `since` set to the `offsets` returned, until `settled`. "
        "The server never waits: ask every half second or so (at once while `more`).",
        parameters=[
            OpenApiParameter("rank", int, description="one rank only"),
            OpenApiParameter("tail", int, description="the last N lines (default 200; without `since`)"),
            OpenApiParameter("since", str, description="rank:offset,... from a previous answer's `offsets`"),
            OpenApiParameter("attempt", int, description="an earlier attempt's lines (default: the current one)"),
        ],
        responses=s.LogsSerializer,
    )
    def get(self, request: Request, name: str) -> Response:
        job = _job(name)
        q = request.query_params
        try:
            rank = int(q["rank"]) if q.get("rank", "") != "" else None
            tail = min(MAX_TAIL, max(1, int(q.get("tail", 200))))
            attempt = int(q["attempt"]) if q.get("attempt", "") != "" else None
        except ValueError:
            raise ValidationError("rank, tail and attempt must be integers") from None
        if attempt is not None and attempt != job.attempt:
            return self._earlier(job, attempt, rank, tail, "since" in q)
        ranks = list(job.ranks.order_by("index"))
        if rank is not None:
            if rank not in {r.index for r in ranks}:
                raise ValidationError(f"job {job.name} has no rank {rank}")
            ranks = [r for r in ranks if r.index == rank]
        settled = job.is_ended and not any(r.state == Rank.State.RUNNING for r in ranks)
        if "since" in q:
            lines, offsets, more = lines_since(ranks, _parse_since(q["since"]), MAX_LINES)
        else:
            lines, more = job_lines(job, rank_index=rank, tail=tail, ranks=ranks), False
            offsets = {r.index: r.log_offset for r in ranks}
        data = {
            "job": job.name,
            "state": job.state,
            "settled": settled and not more,
            "lines": [[ln.time, ln.rank, ln.text] for ln in lines],
            "offsets": {str(k): v for k, v in offsets.items()},
            "more": more,
        }
        return Response(s.LogsSerializer(data).data)

    def _earlier(self, job: Job, attempt: int, rank: int | None, tail: int, following: bool) -> Response:
        """An earlier attempt's lines: ended, so all of them at once (settled), never followed."""
        try:
            ranks = earlier_attempt(job, attempt, rank, following)
        except ValueError as exc:
            raise ValidationError(str(exc)) from None
        lines = job_lines(job, rank_index=rank, tail=tail, ranks=ranks)
        data = {"job": job.name, "state": job.state, "settled": True, "more": False, "offsets": {},
                "lines": [[ln.time, ln.rank, ln.text] for ln in lines]}  # fmt: skip
        return Response(s.LogsSerializer(data).data)


class JobResultsView(APIView):
    policy_actions = {"GET": "view"}

    @extend_schema(summary="The job as `ugro status NAME` shows it, with its config, exit codes, final metrics, "
                   "checkpoints and log files (`ugro results`)",
                   responses=s.ResultsSerializer)  # fmt: skip
    def get(self, request: Request, name: str) -> Response:
        job = _job(name)
        ranks = list(job.ranks.order_by("index"))
        cfg = job.job_dir / "config.json"
        data = {
            **job_detail(job),
            "job": job.name,
            "exit_codes": {str(r.index): r.exit_code for r in ranks},
            "final_metrics": [
                {"name": m.name, "rank": m.rank, "value": m.value, "step": m.step}
                for m in FinalMetric.objects.filter(job=job).order_by("rank", "name")
            ],
            "checkpoints": [{"node": c.node.name, "path": c.path, "size": c.size} for c in report.checkpoints(job)],
            "config": str(cfg) if cfg.exists() else None,
            "logs": {str(r.index): str(r.local_log) for r in ranks},
            "lines": report.results(job),
        }
        return Response(s.ResultsSerializer(data).data)


class JobCancelView(APIView):
    policy_actions = {"POST": "cancel"}

    @extend_schema(summary="Cancel a job (`ugro cancel`): it goes CANCELLING now; the worker stops every "
                   "process; poll the job until it is cancelled", request=None, responses=s.JobSerializer)  # fmt: skip
    def post(self, request: Request, name: str) -> Response:
        job = _job(name)
        try:
            job = actions.cancel(request.user, job, web_source(request))
        except policy.Refused:
            raise
        except ValueError as exc:
            return Response({"error": str(exc)}, status=status.HTTP_409_CONFLICT)
        return Response(s.JobSerializer(job_summary(job)).data)


class JobResumeView(APIView):
    policy_actions = {"POST": "resume"}

    @extend_schema(summary="Resume a failed or cancelled job as its next attempt (`ugro resume`): body "
                   '{"from": STEP | "latest" | "scratch", "nodes": [names]}; it is QUEUED now',
                   request=None, responses=s.JobSerializer)  # fmt: skip
    def post(self, request: Request, name: str) -> Response:
        job = _job(name)
        body = request.data if isinstance(request.data, dict) else {}
        wanted = str(body.get("from", "latest"))[:40]
        nodes = body.get("nodes") or None
        if nodes is not None and (not isinstance(nodes, list) or not all(isinstance(n, str) for n in nodes)):
            return Response({"error": "nodes must be a list of node names"}, status=status.HTTP_400_BAD_REQUEST)
        try:
            job = actions.resume(request.user, job, wanted, nodes, web_source(request))
        except policy.Refused:
            raise
        except RecoveryError as exc:
            return Response({"error": str(exc)}, status=status.HTTP_409_CONFLICT)
        request_schedule()
        return Response(s.JobSerializer(job_summary(job)).data)


class QueueView(APIView):
    policy_actions = {"GET": "view"}

    @extend_schema(summary="Waiting jobs in the order they will start, with the reason each waits and its "
                   "estimated start (`ugro queue`)", responses=s.QueueEntrySerializer(many=True))  # fmt: skip
    def get(self, request: Request) -> Response:
        waiting = queue()
        energy = energy_records([e.job for e in waiting])  # every job's in a few queries
        entries = [
            {
                **job_summary(e.job, energy=energy[e.job.pk]),
                "position": e.decision.position,
                "starts_now": e.decision.start,
                "reason": None if e.decision.start else e.decision.reason,
                "detail": e.decision.detail,
                "estimated_start": e.est_start,
                "gpus": e.placement_text() or None,
            }
            for e in waiting
        ]
        return Response(s.QueueEntrySerializer(entries, many=True).data)


def node_summary(node: Node, running: dict[int, str]) -> dict:
    return {
        "name": node.name,
        "address": node.address,
        "role": node.role,
        "gpu": node.gpu_label,
        "enabled": node.enabled,
        "status": node.status,
        "score": node.health_score,
        "reason": node.status_reason or "",
        "checks": list(node.health_checks or []),
        "last_seen": node.last_seen,
        "job": running.get(node.pk),
    }


def _running_by_node() -> dict[int, str]:
    return dict(Rank.objects.filter(active=True).values_list("node_id", "job__name"))


class HealthView(APIView):
    policy_actions = {"GET": "view"}

    @extend_schema(summary="Every node's last known health (`ugro health`); asks the worker for a fresh poll",
                   responses=s.NodeSerializer(many=True))  # fmt: skip
    def get(self, request: Request) -> Response:
        send_task("cluster.tasks.poll_health")  # enqueue only: readings arrive with the worker's next poll
        running = _running_by_node()
        nodes = [node_summary(n, running) for n in Node.objects.order_by("order", "name").prefetch_related("gpus")]
        return Response(s.NodeSerializer(nodes, many=True).data)


class NodeDrainView(APIView):
    policy_actions = {"POST": "nodes"}
    enable = False

    @extend_schema(summary="Drain a node (no new job is placed on it; a running one goes on) or undrain it",
                   request=None, responses=s.NodeSerializer)  # fmt: skip
    def post(self, request: Request, name: str) -> Response:
        node = _node(name)
        node = actions.set_node_enabled(request.user, node, self.enable, web_source(request))
        return Response(s.NodeSerializer(node_summary(node, _running_by_node())).data)


class AuditView(APIView):
    policy_actions = {"GET": "audit"}

    @extend_schema(summary="The audit log, newest first (`ugro audit`)",
                   parameters=[OpenApiParameter("limit", int), OpenApiParameter("action", str),
                               OpenApiParameter("user", str)],
                   responses=s.AuditSerializer(many=True))  # fmt: skip
    def get(self, request: Request) -> Response:
        try:
            limit = min(LIST_MAX, max(1, int(request.query_params.get("limit", 50))))
        except ValueError:
            raise ValidationError("limit must be an integer") from None
        events = AuditEvent.objects.all()
        if request.query_params.get("action"):
            events = events.filter(action=request.query_params["action"])
        if request.query_params.get("user"):
            events = events.filter(username=request.query_params["user"])
        return Response(s.AuditSerializer(events[:limit], many=True).data)


class ControllerView(APIView):
    policy_actions = {"GET": "view"}

    @extend_schema(summary="Whether a worker and its scheduler run (without them no job starts or is followed)",
                   responses=s.ControllerSerializer)  # fmt: skip
    def get(self, request: Request) -> Response:
        alive = scheduler_alive()
        return Response({"worker_alive": worker_alive(), "scheduler_alive": alive,
                         "problem": "" if alive else NO_SCHEDULER, "version": __version__})  # fmt: skip


class MeView(APIView):
    policy_actions = {"GET": "view"}

    @extend_schema(summary="Who the token or session is, its role and scope", responses=s.MeSerializer)
    def get(self, request: Request) -> Response:
        scope = getattr(request.auth, "scope", None)
        return Response({"username": request.user.get_username(), "role": policy.role_of(request.user),
                         "scope": scope})  # fmt: skip


class AlertsView(APIView):
    policy_actions = {"GET": "view"}

    @extend_schema(summary="Open alerts, newest first (`ugro alerts`; all=1: resolved ones and INFO events too)",
                   parameters=[OpenApiParameter("all", bool), OpenApiParameter("limit", int)])  # fmt: skip
    def get(self, request: Request) -> Response:
        try:
            limit = min(LIST_MAX, max(1, int(request.query_params.get("limit", 50))))
        except ValueError:
            raise ValidationError("limit must be an integer") from None
        alerts = Alert.objects.select_related("node")
        if request.query_params.get("all", "") not in ("1", "true"):
            alerts = alerts.filter(resolved_at__isnull=True)
        return Response({"alerts": [alert_record(a) for a in alerts[:limit]]})


class ClusterConfigView(APIView):
    """cluster.yaml, in the user's format: read back (`ugro export_cluster`), or imported all or nothing
    (`ugro import_cluster FILE`, operators)."""

    policy_actions = {"GET": "view", "POST": "nodes"}

    @extend_schema(summary="The cluster (nodes and settings) as cluster.yaml, and parsed (`ugro export_cluster`)")
    def get(self, request: Request) -> Response:
        text = export_cluster()
        return Response({"yaml": text, "cluster": yaml.safe_load(text)})

    @extend_schema(summary='Import cluster.yaml, all or nothing (`ugro import_cluster`): body {"yaml": TEXT}')
    def post(self, request: Request) -> Response:
        body = request.data if isinstance(request.data, dict) else {}
        text = body.get("yaml")
        if not isinstance(text, str):
            raise ValidationError("yaml: the text of a cluster.yaml is required")
        source = web_source(request)
        try:
            summary = import_cluster(text.encode())
        except ConfigError as exc:
            audit.record(request.user, "import_cluster", "api", source=source, outcome=f"refused: {exc}")
            raise ValidationError(f"{exc}; nothing was imported") from None
        audit.record(request.user, "import_cluster", "api", source=source, summary=str(summary))
        return Response({"summary": str(summary)})


class NodeTrustView(APIView):
    policy_actions = {"POST": "nodes"}

    @extend_schema(summary='Pin the SSH host key a node offers now (`ugro trust NODE`): body {"fingerprint": '
                   '"SHA256:..."} to pin only that key. The one request that talks to a node: it reads the '
                   "node's key (bounded by the connect timeout)", request=None)  # fmt: skip
    def post(self, request: Request, name: str) -> Response:
        node = _node(name)
        body = request.data if isinstance(request.data, dict) else {}
        fingerprint = str(body.get("fingerprint") or "")[:200]
        source = web_source(request)
        try:
            old, new = trust(node, fingerprint)
        except (ValueError, LinkError) as exc:
            audit.record(request.user, "trust", name, source=source, outcome=f"refused: {exc}")
            return Response({"error": str(exc)}, status=status.HTTP_409_CONFLICT)
        audit.record(request.user, "trust", name, source=source, old=old, new=new)
        return Response({"node": name, "old": old, "new": new})


class NodeReportView(APIView):
    """A report a node's agent is asked for (like trust, a request that asks the node); 409 naming the node when it
    does not answer."""

    policy_actions = {"GET": "nodes"}
    failed = ""

    def report(self, node: Node) -> dict:
        raise NotImplementedError

    def get(self, request: Request, name: str) -> Response:
        node = _node(name)
        try:
            return Response(self.report(node))
        except (LinkError, AgentRequestError, OSError) as exc:
            return Response({"error": f"{name} {self.failed}: {exc}"}, status=status.HTTP_409_CONFLICT)


class NodeDiskView(NodeReportView):
    """What a node's store holds and why (`ugro node disk NAME`, jobs/cache.py): its agent walks the store and the job
    trees."""

    failed = "did not say what its store holds"

    @extend_schema(summary="A node's store: its size against its limit, the disk's free space, and each item (a "
                   "job's code copy or data, objects no job uses, partial transfers) with its size, last use and what "
                   "keeps it; `lines` is what `ugro node disk` prints. Asks the node")  # fmt: skip
    def get(self, request: Request, name: str) -> Response:
        return super().get(request, name)

    def report(self, node: Node) -> dict:
        return cache.disk(node)


class NodesView(APIView):
    """`ugro node add`: connects to a machine, pins its host key, surveys it and records it (cluster/provision.py)."""

    policy_actions = {"POST": "nodes"}

    @extend_schema(summary='Add a node by probing it (`ugro node add`): body {"target": "[USER@]HOST[:PORT]", "name", '
                   '"key" (a private key on the controller), "workdir", "fingerprint"}; pins its host key, reads its '
                   "GPUs, CPUs, RAM, disk, Python environments and route, records it; `lines` is what the client "
                   "prints. Refused in one line, nothing recorded", request=None)  # fmt: skip
    def post(self, request: Request) -> Response:
        body = request.data if isinstance(request.data, dict) else {}
        args = {k: str(body.get(k) or "")[:1000] for k in ("target", "name", "key", "workdir", "fingerprint")}
        source = web_source(request)
        try:
            result = add_node(args["target"], name=args["name"], key_path=args["key"], workdir=args["workdir"],
                              expect_fingerprint=args["fingerprint"])  # fmt: skip
        except ProvisionError as exc:
            audit.record(request.user, "node_add", args["name"] or args["target"][:200], source=source,
                         outcome=f"refused: {exc}")  # fmt: skip
            return Response({"error": str(exc)}, status=status.HTTP_409_CONFLICT)
        audit.record(request.user, "node_add", result.node, source=source, address=args["target"])
        return Response(result.as_dict(), status=status.HTTP_201_CREATED)


class NodeProbeView(APIView):
    policy_actions = {"POST": "nodes"}

    @extend_schema(summary="Probe a node again (`ugro node probe NAME`): its GPUs, CPUs, RAM, disk, Python "
                   "environments and route recorded anew; `changed` says what differs. Asks the node",
                   request=None)  # fmt: skip
    def post(self, request: Request, name: str) -> Response:
        node = _node(name)
        source = web_source(request)
        try:
            result = probe_node(node)
        except ProvisionError as exc:
            audit.record(request.user, "node_probe", name, source=source, outcome=f"refused: {exc}")
            return Response({"error": str(exc)}, status=status.HTTP_409_CONFLICT)
        audit.record(request.user, "node_probe", name, source=source, changed=result.changed)
        return Response(result.as_dict())


class NodePowerView(APIView):
    """`ugro node sleep NAME` / `ugro node wake NAME` (operators): jobs/power.py by_hand."""

    policy_actions = {"POST": "nodes"}
    verb = "sleep"

    @extend_schema(summary="Put a node to sleep now (its power: block's sleep command; refused while it holds a job "
                   "or a service), or wake it (POST .../wake: its magic packet or wake command). Asks the node",
                   request=None)  # fmt: skip
    def post(self, request: Request, name: str) -> Response:
        node = _node(name)
        source = web_source(request)
        try:
            line = power_by_hand(node, self.verb, request.user.username)
        except PowerError as exc:
            audit.record(request.user, f"node_{self.verb}", name, source=source, outcome=f"refused: {exc}")
            return Response({"error": str(exc)}, status=status.HTTP_409_CONFLICT)
        audit.record(request.user, f"node_{self.verb}", name, source=source)
        node.refresh_from_db()
        return Response({"node": node.name, "status": node.status, "lines": [line]})


class NodeWakeView(NodePowerView):
    verb = "wake"


class NodeEnvsView(NodeReportView):
    """A node's Python environments (`ugro node envs NAME`, jobs/envs.py): asks the node."""

    failed = "did not list its environments"

    @extend_schema(summary="A node's environments built from --packages locks (docs/envs.md): each with its size, "
                   "last use and the live jobs that name it; `lines` is what `ugro node envs` prints. Asks the "
                   "node")  # fmt: skip
    def get(self, request: Request, name: str) -> Response:
        return super().get(request, name)

    def report(self, node: Node) -> dict:
        return envs.report(node)


def _node(name: str) -> Node:
    node = Node.objects.filter(name=name).first()
    if node is None:
        raise Http404(f"no node named {name!r}")
    return node


def _sweep(name: str) -> Sweep:
    sweep = Sweep.objects.filter(name=name).first()
    if sweep is None:
        raise Http404(f"no sweep named {name!r}")
    return sweep


def sweep_detail(sweep: Sweep) -> dict:
    rows = trial_rows(sweep)
    used = job_energies([r.job for r in rows])
    return {
        "name": sweep.name,
        "id": sweep.pk,
        "metric": sweep.metric,
        "mode": sweep.mode,
        "max_concurrent": sweep.max_concurrent,
        "cancelled": sweep.cancelled_at is not None,
        "trials": [
            {
                "name": r.job.name,
                "state": r.job.state,
                "params": r.params,
                "final": r.final,
                "best": r.best,
                "steps": r.steps,
                "is_best": r.is_best,
                "energy": used[r.job.pk].to_dict(),  # energy per trial (docs/power.md)
            }
            for r in rows
        ],  # fmt: skip
    }


class SweepsView(APIView):
    policy_actions = {"POST": "launch"}

    @extend_schema(summary="Create a sweep (`ugro sweep NAME --grid ... | --random ...`): one queued job per "
                   "trial", request=s.SweepSerializer)  # fmt: skip
    def post(self, request: Request) -> Response:
        data = s.SweepSerializer(data=spec.merged(request.data, "sweep"))
        data.is_valid(raise_exception=True)
        try:
            sweep = actions.launch_sweep(request.user, data.sweep_request(), web_source(request))
        except ValueError as exc:  # LaunchError is one
            raise ValidationError(str(exc)) from None
        request_schedule()
        return Response(sweep_detail(sweep), status=status.HTTP_201_CREATED)


class SweepView(APIView):
    policy_actions = {"GET": "view"}

    @extend_schema(summary="A sweep's trials, their state and metric, the best marked (`ugro sweep NAME --show`)")
    def get(self, request: Request, name: str) -> Response:
        return Response(sweep_detail(_sweep(name)))


class SweepCancelView(APIView):
    policy_actions = {"POST": "cancel"}

    @extend_schema(summary="Cancel every trial not yet ended (`ugro sweep NAME --cancel`); the worker stops them",
                   request=None)  # fmt: skip
    def post(self, request: Request, name: str) -> Response:
        sweep = _sweep(name)
        actions.cancel_sweep_as(request.user, sweep, web_source(request))
        return Response(sweep_detail(Sweep.objects.get(pk=sweep.pk)))


METRICS_PAGE = 10_000  # points per answer by default; `next` says where the following page starts
METRICS_PAGE_MAX = 100_000
METRICS_NAMES_MAX = 20


class _JsonAlways(DefaultContentNegotiation):
    """JSON, whatever `format` says: here it is the view's own parameter (json or csv), not DRF's override."""

    def select_renderer(self, request, renderers, format_suffix=None):
        return renderers[0], renderers[0].media_type


class JobMetricsView(APIView):
    """A job's curves for notebooks and scripts (pandas, W&B-style exports): the names, then the points."""

    policy_actions = {"GET": "view"}
    content_negotiation_class = _JsonAlways

    @extend_schema(
        summary="A job's metrics by token: without `name`, the metric names; with `name` (repeatable), their "
        "points (name, rank, step, time, value, attempt) in stored order, a page at a time",
        description="Ask again with `after` set to the answer's `next` until it is null. `format=csv` answers "
        "text/csv (the next page's `after` in the `X-Next-After` header). Points a later attempt superseded "
        "(a resume from an earlier step) are left out unless `superseded=1`.",
        parameters=[
            OpenApiParameter("name", str, many=True, description="a metric (repeatable, at most 20)"),
            OpenApiParameter("rank", int, description="one rank only"),
            OpenApiParameter("after", int, description="the `next` of the previous page"),
            OpenApiParameter("limit", int, description=f"points per page (default {METRICS_PAGE})"),
            OpenApiParameter("format", str, enum=["json", "csv"]),
            OpenApiParameter("superseded", bool),
        ],
    )
    def get(self, request: Request, name: str) -> Response | HttpResponse:
        job = _job(name)
        q = request.query_params
        names = [n for n in q.getlist("name") if n]
        if not names:
            return Response({"job": job.name, "names": metric_names(job.pk, limit=500)})
        if len(names) > METRICS_NAMES_MAX:
            raise ValidationError(f"at most {METRICS_NAMES_MAX} names at once")
        try:
            rank = int(q["rank"]) if q.get("rank", "") != "" else None
            after = int(q.get("after") or 0)
            limit = min(METRICS_PAGE_MAX, max(1, int(q.get("limit") or METRICS_PAGE)))
        except ValueError:
            raise ValidationError("rank, after and limit must be integers") from None
        fmt = q.get("format", "json")
        if fmt not in ("json", "csv"):
            raise ValidationError("format must be json or csv")
        points = MetricPoint.objects.filter(job=job, name__in=names, id__gt=after)
        if q.get("superseded", "") not in ("1", "true"):
            points = points.filter(superseded=False)
        if rank is not None:
            points = points.filter(rank=rank)
        rows = list(points.order_by("id").values_list("id", "name", "rank", "step", "time", "value", "attempt")
                    [: limit + 1])  # fmt: skip
        more = len(rows) > limit
        rows = rows[:limit]
        following = rows[-1][0] if more else None
        if fmt == "csv":
            out = io.StringIO()
            writer = csv.writer(out)
            writer.writerow(["name", "rank", "step", "time", "value", "attempt"])
            for _id, metric, r, step, when, value, attempt in rows:
                writer.writerow([metric, r, "" if step is None else step, when.isoformat(), repr(value), attempt])
            response = HttpResponse(out.getvalue(), content_type="text/csv; charset=utf-8")
            if following is not None:
                response["X-Next-After"] = str(following)
            return response
        data = [
            {"name": metric, "rank": r, "step": step, "time": when.timestamp(), "value": value, "attempt": attempt}
            for _id, metric, r, step, when, value, attempt in rows
        ]
        return Response({"job": job.name, "points": data, "next": following})


class SpecSchemaView(APIView):
    """The JSON Schema of job files (`ugro launch -f`, `ugro sweep -f`), for editors that complete YAML."""

    policy_actions = {"GET": "view"}
    SCHEMAS = {"launch": "UGRO job file", "sweep": "UGRO sweep file"}

    @extend_schema(summary="The JSON Schema of a job file (launch) or a sweep file")
    def get(self, request: Request, kind: str) -> Response:
        if kind not in self.SCHEMAS:
            raise Http404(f"no schema {kind!r}: launch or sweep")
        return Response(spec.json_schema(kind, self.SCHEMAS[kind]))


class SpecView(APIView):
    """A job (or sweep) file read as the server reads it, for `ugro launch -f`: nothing is created."""

    policy_actions = {"POST": "view"}

    @extend_schema(summary="Read a job file (`spec`, its text) and the options typed beside it: the resolved spec "
                   "as the API's fields, the directory to sync, the spec as YAML")  # fmt: skip
    def post(self, request: Request, kind: str) -> Response:
        if kind not in spec.OPTIONS:
            raise Http404(f"no job file kind {kind!r}: launch or sweep")
        return Response(spec.resolved(request.data, kind))


SCOPE_ORDER = ["read", "launch", "operate"]


def token_record(t: ApiToken) -> dict:
    return {
        "prefix": t.prefix, "name": t.name, "scope": t.scope, "user": t.user.get_username(),
        "created_at": t.created_at.isoformat(), "last_used_at": t.last_used_at.isoformat() if t.last_used_at else None,
        "revoked": t.revoked_at is not None,
    }  # fmt: skip


class TokensView(APIView):
    """One's own API tokens (`ugro token list|create`): a token never makes one wider than itself."""

    policy_actions = {"GET": "view", "POST": "view"}

    @extend_schema(summary="Your API tokens (`ugro token list`)")
    def get(self, request: Request) -> Response:
        rows = ApiToken.objects.select_related("user").filter(user=request.user)
        return Response({"tokens": [token_record(t) for t in rows]})

    @extend_schema(summary='A new token of yours (`ugro token create NAME --scope S`): body {"name", "scope"}; '
                   "the token is in this answer only", request=None)  # fmt: skip
    def post(self, request: Request) -> Response:
        body = request.data if isinstance(request.data, dict) else {}
        name, scope = str(body.get("name") or "")[:200], str(body.get("scope") or "read")
        if scope not in SCOPE_ORDER:
            raise ValidationError(f"scope must be one of {', '.join(SCOPE_ORDER)}, not {scope[:20]!r}")
        mine = getattr(request.auth, "scope", None)
        if mine is not None and SCOPE_ORDER.index(scope) > SCOPE_ORDER.index(mine):
            raise policy.Refused(f"a {mine}-scoped token cannot make a {scope}-scoped one")
        try:
            row, token = create_token(request.user, name, scope)
        except ValueError as exc:
            raise ValidationError(str(exc)) from None
        audit.record(request.user, "token_create", f"{row.prefix} ({request.user})", source=web_source(request),
                     scope=scope)  # fmt: skip
        return Response({**token_record(row), "token": token}, status=status.HTTP_201_CREATED)


class TokenRevokeView(APIView):
    policy_actions = {"POST": "view"}

    @extend_schema(summary="Revoke one of your tokens by its prefix (`ugro token revoke PREFIX`)", request=None)
    def post(self, request: Request, prefix: str) -> Response:
        prefix = prefix.removeprefix("ugro_").split("_")[0]
        row = ApiToken.objects.select_related("user").filter(prefix=prefix, user=request.user).first()
        if row is None:
            raise Http404(f"no token {prefix[:20]!r} of yours (see: ugro token list)")
        if not revoke(row):
            return Response({"error": f"token {prefix} was already revoked"}, status=status.HTTP_409_CONFLICT)
        audit.record(request.user, "token_revoke", f"{row.prefix} ({row.user})", source=web_source(request))
        row.refresh_from_db()
        return Response(token_record(row))


class PreflightView(APIView):
    """The launch pre-flight checks on demand (`ugro preflight`): like trust, a request that talks to the
    nodes, each check bounded by its own timeout."""

    policy_actions = {"POST": "launch"}

    @extend_schema(summary='Run the pre-flight checks (`ugro preflight`): body {"nodes": [names], "script": PATH}',
                   request=None)  # fmt: skip
    def post(self, request: Request) -> Response:
        body = request.data if isinstance(request.data, dict) else {}
        names = body.get("nodes") or []
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValidationError("nodes must be a list of node names")
        run = preflight_nodes(names, str(body.get("script") or ""))  # LaunchError: one line
        report = run.report
        return Response({"ok": report.ok, "nodes": [n.name for n in run.nodes], "problems": report.problems,
                         "rendezvous": run.rendezvous, "notes": report.notes, "versions": report.versions})  # fmt: skip


class NetcheckView(APIView):
    """`ugro netcheck`: the network between nodes measured now (jobs/network.py); like preflight, a request that
    talks to the nodes, bounded by the measurement's own limits. A refusal is an answer with ok false."""

    policy_actions = {"POST": "launch"}

    @extend_schema(summary='Measure the network between nodes (`ugro netcheck`): body {"nodes": [names], '
                   '"sizes": [MB]}', request=None)  # fmt: skip
    def post(self, request: Request) -> Response:
        body = request.data if isinstance(request.data, dict) else {}
        names, sizes = body.get("nodes") or [], body.get("sizes") or None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValidationError("nodes must be a list of node names")
        if sizes is not None and (not isinstance(sizes, list) or not all(type(x) is int for x in sizes)):
            raise ValidationError("sizes must be a list of whole numbers of MB")
        try:
            chosen, out = netcheck(names, sizes)
        except NetcheckError as exc:
            raise ValidationError(str(exc)) from None
        return Response(netcheck_report(chosen, out))


class SyncView(APIView):
    """A directory a client syncs (`ugro launch --sync DIR`, docs/sync.md): its manifest first; the answer
    names its digest and the files the controller lacks, which POST sync/objects then sends."""

    policy_actions = {"POST": "launch"}

    @extend_schema(summary='Register a directory to sync: body {"manifest": {"files": [...], "links": [...]}, '
                   '"source": PATH, "git": {...}}; answers {"digest", "missing"}')  # fmt: skip
    def post(self, request: Request) -> Response:
        body = request.data if isinstance(request.data, dict) else {}
        listing = body.get("manifest")
        if not isinstance(listing, dict):
            raise ValidationError("manifest: the directory's files (ugro_client.manifest)")
        files = listing.get("files") if isinstance(listing.get("files"), list) else []
        if len(files) > manifest.LIMIT_FILES:
            raise ValidationError(f"more than {manifest.LIMIT_FILES} files to sync")
        total = sum(f.get("size", 0) for f in files if isinstance(f, dict) and isinstance(f.get("size"), int))
        if total > manifest.LIMIT_BYTES:
            raise ValidationError(f"{total / 1e6:.1f} MB to sync is over the {manifest.LIMIT_BYTES / 1e6:.0f} MB limit")
        source = f"{request.user.username}@{web_source(request)}:{str(body.get('source') or '')[:300]}"
        try:
            digest, missing = sync.record_upload(listing, source, body.get("git") or {})
        except ValueError as exc:
            raise ValidationError(str(exc)) from None
        return Response({"digest": digest, "missing": missing})


class SyncObjectsView(APIView):
    """The files of a directory being synced, as a tar stream whose members are named by their sha256;
    each is checked against its name before it is kept."""

    policy_actions = {"POST": "launch"}

    @extend_schema(summary="Upload files to sync: an application/x-tar body, one member per file named by its "
                   "sha256; answers {\"stored\": N, \"bytes\": B}", request=None)  # fmt: skip
    def post(self, request: Request) -> Response:
        stored, total = 0, 0
        try:
            with tarfile.open(fileobj=request._request, mode="r|") as tar:
                for member in tar:
                    if not member.isfile():
                        raise ValidationError(f"{member.name[:80]}: only files may be uploaded")
                    total += member.size
                    if total > manifest.LIMIT_BYTES:
                        raise ValidationError(f"over the {manifest.LIMIT_BYTES / 1e6:.0f} MB upload limit")
                    stream = tar.extractfile(member)
                    sync.put_object(member.name, iter(lambda s=stream: s.read(1 << 20), b""), manifest.LIMIT_BYTES)
                    stored += 1
        except tarfile.TarError as exc:
            raise ValidationError(f"not a tar stream: {exc}") from None
        except sync.SyncError as exc:
            raise ValidationError(str(exc)) from None
        return Response({"stored": stored, "bytes": total}, status=status.HTTP_201_CREATED)


class JobPackagesView(APIView):
    """The packages installed in each node's training env when the job's latest attempt started (pip's
    name==version, as `pip freeze` lists them): JSON, or one node's list as text (?node=N&text=1; DRF keeps
    `format` for itself)."""

    policy_actions = {"GET": "view"}

    @extend_schema(summary="Each node's installed packages for a job (provenance; docs/sync.md)",
                   parameters=[OpenApiParameter("node", str), OpenApiParameter("text", bool)])  # fmt: skip
    def get(self, request: Request, name: str) -> HttpResponse:
        job = _job(name)
        packages = JobCode.objects.filter(job=job).values_list("packages", flat=True).first() or {}
        node = request.query_params.get("node", "")
        if node and node not in packages:
            raise ValidationError(f"job {job.name} has no package list for node {node[:64]!r}")
        if request.query_params.get("text") in ("1", "true"):
            if not node:
                raise ValidationError("text=1 needs node=NAME")
            return HttpResponse("\n".join(packages[node]) + "\n", content_type="text/plain; charset=utf-8")
        return Response({"job": job.name, "packages": {node: packages[node]} if node else packages})
