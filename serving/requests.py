"""What a command asks of services: start one, stop one. Only the database changes here; the worker
(serving/replicas.py) does the work. Bad input is refused in one line with nothing written."""

from __future__ import annotations

from dataclasses import dataclass

from django.db import transaction

from cluster.names import check_name
from jobs.models import Checkpoint, Job
from ugro_site.celery import send_task

from .engines import EngineError, check_template
from .models import Replica, Service
from .placement import capacity_problem

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


def check_request(req: ServeRequest) -> tuple[Job, Checkpoint]:
    """The job and checkpoint to serve; ServeError (one line) for anything wrong with the request."""
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
    problem = capacity_problem(req.replicas, req.gpus_per_replica)
    if problem:
        raise ServeError(problem)
    old = Service.objects.filter(name=req.name).exclude(state=Service.State.STOPPED).first()
    if old is not None:
        raise ServeError(taken(old))
    return job, checkpoint


def taken(service: Service) -> str:
    return f"service {service.name} exists ({service.state}): stop it first (manage.py serve {service.name} --stop)"


def create_service(req: ServeRequest) -> Service:
    """Record the service RUNNING with its replicas PENDING and ask a worker to start them."""
    job, checkpoint = check_request(req)
    with transaction.atomic():
        old = Service.objects.select_for_update().filter(name=req.name).first()
        if old is not None and old.state != Service.State.STOPPED:
            raise ServeError(taken(old))  # started by someone else meanwhile
        if old is not None:
            old.delete()  # a stopped service leaves its name free
        service = Service.objects.create(
            name=req.name, job=job, checkpoint=checkpoint, engine=req.engine, command_template=req.command,
            replicas=req.replicas, gpus_per_replica=req.gpus_per_replica, owner=req.owner,
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
