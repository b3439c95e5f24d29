"""What a command asks of services: start one, stop one. Only the database changes here; the worker
(serving/replicas.py) does the work. Bad input is refused in one line with nothing written."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from django.db import transaction

from accounts import audit, policy
from cluster.links import AgentRequestError, LinkError
from cluster.names import check_name
from jobs.models import Checkpoint, Job
from ugro_site.celery import require_worker, send_task

from .engines import EngineError, check_template
from .models import Replica, Service
from .placement import capacity_problem, held, min_vram_mb
from .stats import recent

log = logging.getLogger(__name__)
MAX_REPLICAS = 64


class ServeError(ValueError):
    """A request refused; the message is one line."""


@dataclass
class ServeRequest:
    name: str
    source: str  # JOB, JOB:STEP or JOB:latest
    replicas: int = 1
    gpus_per_replica: int = 1
    engine: str = "transformers"
    command: str = ""
    owner: object = None


def checkpoint_of(source: str) -> tuple[Job, Checkpoint]:
    """The job and the checkpoint `JOB[:STEP|latest]` names: a complete directory the job recorded (what
    save_pretrained writes; an engine cannot serve a lone .pt file)."""
    name, _, wanted = source.partition(":")
    job = Job.objects.filter(name=name).first()
    if job is None:
        raise ServeError(f"no job named {name!r}")
    ready = job.checkpoints.select_related("node").filter(ready=True, kind=Checkpoint.Kind.DIR, step__isnull=False)
    ready = list(ready.order_by("-step", "-mtime"))
    if not ready:
        raise ServeError(f"job {job.name} recorded no complete checkpoint directory to serve")
    if wanted in ("", "latest"):
        return job, ready[0]
    try:
        step = int(wanted)
    except ValueError:
        raise ServeError(f"--from takes JOB, JOB:STEP or JOB:latest, not {source!r}") from None
    for c in ready:
        if c.step == step:
            return job, c
    steps = ", ".join(str(c.step) for c in ready[:20])
    raise ServeError(f"job {job.name} has no complete checkpoint directory at step {step} (steps: {steps})")


def check_request(req: ServeRequest) -> tuple[Job, Checkpoint, int | None]:
    """The job, the checkpoint to serve and what VRAM each replica GPU needs; ServeError (one line) for anything
    wrong with the request."""
    try:
        check_name(req.name, "service name")
        check_template(req.engine, req.command)
    except (ValueError, EngineError) as exc:
        raise ServeError(str(exc)) from None
    if not 1 <= req.replicas <= MAX_REPLICAS:
        raise ServeError(f"--replicas must be 1-{MAX_REPLICAS}, not {req.replicas}")
    if req.gpus_per_replica < 0:
        raise ServeError(f"--gpus-per-replica must be 0 or more, not {req.gpus_per_replica}")
    job, checkpoint = checkpoint_of(req.source)
    try:
        vram = min_vram_mb(checkpoint, req.gpus_per_replica)
    except (LinkError, AgentRequestError) as exc:
        # not a reason to refuse: its node may be back before a replica needs the copy (which then says why)
        log.warning("service %s: VRAM not checked, %s does not list the checkpoint: %s", req.name,
                    checkpoint.node.name, exc)  # fmt: skip
        vram = None
    problem = capacity_problem(req.replicas, req.gpus_per_replica, vram)
    if problem:
        raise ServeError(problem)
    old = Service.objects.filter(name=req.name).exclude(state=Service.State.STOPPED).first()
    if old is not None:
        raise ServeError(taken(old))
    return job, checkpoint, vram


def taken(service: Service) -> str:
    return f"service {service.name} exists ({service.state}): stop it first (manage.py serve {service.name} --stop)"


def create_service(req: ServeRequest) -> Service:
    """Record the service RUNNING with its replicas PENDING and ask a worker to start them."""
    job, checkpoint, vram = check_request(req)
    with transaction.atomic():
        old = Service.objects.select_for_update().filter(name=req.name).first()
        if old is not None and old.state != Service.State.STOPPED:
            raise ServeError(taken(old))  # started by someone else meanwhile
        if old is not None:
            old.delete()  # a stopped service leaves its name free
        service = Service.objects.create(
            name=req.name, job=job, checkpoint=checkpoint, engine=req.engine, command_template=req.command,
            replicas=req.replicas, gpus_per_replica=req.gpus_per_replica, min_vram_mb=vram, owner=req.owner,
        )  # fmt: skip
        Replica.objects.bulk_create([Replica(service=service, index=i) for i in range(req.replicas)])
        transaction.on_commit(request_tend)
    return service


def request_stop(service: Service) -> bool:
    """RUNNING -> STOPPING (the worker stops the replicas and frees their GPUs); False if it was not running."""
    with transaction.atomic():
        moved = Service.objects.filter(pk=service.pk, state=Service.State.RUNNING).update(state=Service.State.STOPPING)
        if moved:
            transaction.on_commit(request_tend)
    service.refresh_from_db()
    return bool(moved)


def request_tend() -> None:
    send_task("serving.tasks.tend_services")


def start_service(user, req: ServeRequest, source: str) -> Service:
    """Start a service as `user`, audited: policy.Refused, ServeError or NoWorker (one line), nothing written.
    Bad input is named before a missing worker."""
    policy.check(user, "serve")
    try:
        check_request(req)
    except ServeError as exc:
        audit.record(user, "serve", req.name, source=source, outcome=f"refused: {exc}")
        raise
    require_worker()
    with transaction.atomic():
        service = create_service(ServeRequest(**{**req.__dict__, "owner": user}))
        c = service.checkpoint
        audit.record(user, "serve", service.name, source=source, service_id=service.pk, replicas=service.replicas,
                     checkpoint=f"{c.node.name}:{c.path}", engine=service.engine)  # fmt: skip
    return service


def stop_service(user, service: Service, source: str) -> Service:
    """Ask the worker to stop a service as `user`, audited; ServeError if it is already stopped."""
    policy.check(user, "serve")
    if service.state == Service.State.STOPPED:
        raise ServeError(f"service {service.name} is already stopped")
    require_worker()
    request_stop(service)
    audit.record(user, "serve stop", service.name, source=source, service_id=service.pk)
    return service


def describe(service: Service) -> dict:
    """A service and each replica's state and request stats (the last minute's), as --list and the API show them."""
    c = service.checkpoint
    replicas = list(service.replica_set.select_related("node").order_by("index"))
    traffic = recent(replicas)
    return {
        "name": service.name, "state": service.state, "engine": service.engine, "job": service.job.name,
        "step": c.step, "checkpoint": f"{c.node.name}:{c.path}", "endpoint": f"/serve/{service.name}/v1/",
        "holds": held(service),
        "replicas": [
            {"index": r.index, "state": r.state, "node": r.node.name if r.node else None, "port": r.port,
             "gpus": r.gpu_indices, "restarts": r.restarts, "note": r.note, "stats": traffic[r.pk].as_dict()}
            for r in replicas
        ],
    }  # fmt: skip


def listing(services: list[dict]) -> list[str]:
    """--list's lines: each replica with the last minute's requests per second, median latency and errors."""
    out = []
    for s in services:
        out.append(f"{s['name']}  {s['state']}  {s['engine']}  from {s['job']} step {s['step']}  {s['endpoint']}  "
                   f"holds {', '.join(s['holds']) or 'nothing'}")  # fmt: skip
        for r in s["replicas"]:
            where = f"{r['node']}:{r['port']}" if r["node"] and r["port"] else (r["node"] or "-")
            st = r.get("stats") or {}
            p50 = f"{st['p50_ms']:.0f} ms" if st.get("p50_ms") is not None else "-"
            traffic = f"{st.get('rps') or 0:.2f} req/s  p50 {p50}  errors {st.get('errors') or 0}"
            out.append(f"  replica {r['index']}  {r['state']:<9}  {where:<22}  restarts {r['restarts']}  {traffic}  "
                       f"{r['note']}")  # fmt: skip
    return out
