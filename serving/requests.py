"""What a command asks of services: start one, stop one. Only the database changes here; the worker
(serving/replicas.py) does the work. Bad input is refused in one line with nothing written."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from django.db import transaction
from django.utils import timezone

from accounts import audit, policy
from cluster.links import AgentRequestError, LinkError
from cluster.names import check_name
from jobs.limits import parse_duration
from jobs.models import Checkpoint, Job
from ugro_site.celery import require_worker, send_task

from .engines import EngineError, check_template
from .models import Replica, Service
from .placement import capacity_problem, held, min_vram_mb
from .scaling import cold_start_timeout
from .stats import recent
from .updates import begin_update

log = logging.getLogger(__name__)
MAX_REPLICAS = 64


class ServeError(ValueError):
    """A request refused; the message is one line."""


MIN_IDLE_S = 60  # a shorter --idle-after would stop replicas between a chat's messages
DEFAULT_IDLE_S = 15 * 60
MAX_COLD_START_S = 3600
MAX_TARGET = 1000
SHAPE = ("replicas", "gpus_per_replica", "engine", "command", "min_replicas", "max_replicas", "target_outstanding",
         "idle_after", "cold_start_timeout")  # fmt: skip


@dataclass
class ServeRequest:
    """What `ugro serve NAME --from JOB` asks; None: not given (the default, or, for a running service's update,
    unchanged)."""

    name: str
    source: str  # JOB, JOB:STEP or JOB:latest
    replicas: int | None = None  # how many start: at least min_replicas (default 1); 0 with min 0: starts asleep
    gpus_per_replica: int | None = None
    engine: str | None = None
    command: str | None = None
    min_replicas: int | None = None  # default: replicas
    max_replicas: int | None = None  # default: the larger of replicas and min_replicas
    target_outstanding: int | None = None
    idle_after: str | int | None = None  # "15m", or seconds; only with min_replicas 0 (its default there: 15m)
    cold_start_timeout: str | int | None = None  # default: the engine's (engines.COLD_START_S)
    owner: object = None

    def given(self) -> list[str]:
        """The service's shape that was typed (an update changes only the checkpoint)."""
        return [key for key in SHAPE if getattr(self, key) not in (None, "")]


@dataclass
class Shape:
    """A request's numbers, defaults applied and checked."""

    replicas: int
    gpus_per_replica: int
    engine: str
    command: str
    min_replicas: int
    max_replicas: int
    target_outstanding: int
    idle_after_s: int | None
    cold_start_timeout_s: int | None


def seconds(value: str | int | None, flag: str) -> int | None:
    """A duration typed as "15m", "2h", "90s" or a number of seconds; ServeError in one line."""
    if value in (None, ""):
        return None
    if isinstance(value, bool):
        raise ServeError(f"{flag} must be a duration like 15m, 1h or 90s, not {value!r}")
    if isinstance(value, int) or str(value).strip().isdigit():
        return int(value)
    try:
        return parse_duration(str(value))
    except ValueError:
        raise ServeError(f"{flag} must be a duration like 15m, 1h or 90s, not {value!r}") from None


def shape_of(req: ServeRequest) -> Shape:
    """The request's numbers with their defaults; ServeError (one line) for any out of bounds."""
    for key in ("replicas", "gpus_per_replica", "min_replicas", "max_replicas", "target_outstanding"):
        value = getattr(req, key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ServeError(f"--{key.replace('_', '-')} must be a whole number, not {value!r}")
    replicas = req.replicas
    low = req.min_replicas if req.min_replicas is not None else (replicas if replicas is not None else 1)
    high = req.max_replicas if req.max_replicas is not None else max(replicas or 1, low, 1)
    if not 0 <= low <= MAX_REPLICAS:
        raise ServeError(f"--min-replicas must be 0-{MAX_REPLICAS}, not {low}")
    if not 1 <= high <= MAX_REPLICAS:
        raise ServeError(f"--max-replicas must be 1-{MAX_REPLICAS}, not {high}")
    if low > high:
        raise ServeError(f"--min-replicas {low} is above --max-replicas {high}")
    if replicas is not None and not (1 if low else 0) <= replicas <= MAX_REPLICAS:
        raise ServeError(f"--replicas must be 1-{MAX_REPLICAS} (0 only with --min-replicas 0), not {replicas}")
    if replicas is not None and replicas > high:
        raise ServeError(f"--replicas {replicas} is above --max-replicas {high}")
    if replicas is not None and replicas < low:
        raise ServeError(f"--replicas {replicas} is below --min-replicas {low}")
    start = replicas if replicas is not None else max(low, 1)
    gpus = req.gpus_per_replica if req.gpus_per_replica is not None else 1
    if gpus < 0:
        raise ServeError(f"--gpus-per-replica must be 0 or more, not {gpus}")
    target = req.target_outstanding if req.target_outstanding is not None else 4
    if not 1 <= target <= MAX_TARGET:
        raise ServeError(f"--target-outstanding must be 1-{MAX_TARGET}, not {target}")
    idle = seconds(req.idle_after, "--idle-after")
    if idle is not None and low:
        raise ServeError(f"--idle-after is for --min-replicas 0 (a service that sleeps), not {low}")
    if low == 0 and idle is None:
        idle = DEFAULT_IDLE_S
    if idle is not None and idle < MIN_IDLE_S:
        raise ServeError(f"--idle-after must be at least 1m, not {req.idle_after}")
    cold = seconds(req.cold_start_timeout, "--cold-start-timeout")
    if cold is not None and not 1 <= cold <= MAX_COLD_START_S:
        raise ServeError(f"--cold-start-timeout must be 1s-1h, not {req.cold_start_timeout}")
    return Shape(replicas=start, gpus_per_replica=gpus, engine=req.engine or "transformers", command=req.command or "",
                 min_replicas=low, max_replicas=high, target_outstanding=target, idle_after_s=idle,
                 cold_start_timeout_s=cold)  # fmt: skip


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
    shape = shape_of(req)
    try:
        check_name(req.name, "service name")
        check_template(shape.engine, shape.command)
    except (ValueError, EngineError) as exc:
        raise ServeError(str(exc)) from None
    job, checkpoint = checkpoint_of(req.source)
    vram = checked_vram(req.name, checkpoint, shape.gpus_per_replica)
    problem = capacity_problem(max(shape.replicas, shape.min_replicas, 1), shape.gpus_per_replica, vram)
    if problem:
        raise ServeError(problem)
    old = Service.objects.filter(name=req.name).exclude(state=Service.State.STOPPED).first()
    if old is not None:
        raise ServeError(taken(old))
    return job, checkpoint, vram


def checked_vram(name: str, checkpoint: Checkpoint, gpus: int) -> int | None:
    """What each of a replica's GPUs needs for this checkpoint; None (logged) when its node does not list it: not a
    reason to refuse, its node may be back before a replica needs the copy (which then says why)."""
    try:
        return min_vram_mb(checkpoint, gpus)
    except (LinkError, AgentRequestError) as exc:
        log.warning("service %s: VRAM not checked, %s does not list the checkpoint: %s", name, checkpoint.node.name,
                    exc)  # fmt: skip
        return None


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
        shape = shape_of(req)
        service = Service.objects.create(
            name=req.name, job=job, checkpoint=checkpoint, engine=shape.engine, command_template=shape.command,
            replicas=shape.replicas, gpus_per_replica=shape.gpus_per_replica, min_vram_mb=vram, owner=req.owner,
            min_replicas=shape.min_replicas, max_replicas=shape.max_replicas, idle_after_s=shape.idle_after_s,
            target_outstanding=shape.target_outstanding, cold_start_timeout_s=shape.cold_start_timeout_s,
            last_request_at=timezone.now(), state=Service.State.RUNNING if shape.replicas else Service.State.SLEEPING,
        )  # fmt: skip
        if not shape.replicas:  # asleep from the start: the first request starts its first replica
            service.replicas = 1
            Service.objects.filter(pk=service.pk).update(replicas=1, note="asleep: the first request wakes it")
        Replica.objects.bulk_create(
            [Replica(service=service, index=i, checkpoint=checkpoint) for i in range(shape.replicas)]
        )
        transaction.on_commit(request_tend)
    return service


def request_stop(service: Service) -> bool:
    """RUNNING, SLEEPING or WAKING -> STOPPING (the worker stops the replicas and frees their GPUs); False if it was
    neither."""
    with transaction.atomic():
        moved = Service.objects.filter(pk=service.pk, state__in=Service.AWAKE_OR_ASLEEP).update(
            state=Service.State.STOPPING, next_checkpoint=None
        )
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
    current = Service.objects.filter(name=req.name, state__in=Service.AWAKE_OR_ASLEEP).first()
    if current is not None:
        return update_service(user, current, req, source)
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


def reshaped(req: ServeRequest, service: Service) -> list[str]:
    """The shape the request gives that the service does not have (a service file kept beside its service, its
    `from:` changed, updates it). A running service's count follows its load: any `replicas` in its bounds is its."""
    now = {"gpus_per_replica": service.gpus_per_replica, "engine": service.engine, "command": service.command_template,
           "min_replicas": service.min_replicas, "max_replicas": service.max_replicas,
           "target_outstanding": service.target_outstanding, "idle_after": service.idle_after_s,
           "cold_start_timeout": cold_start_timeout(service)}  # fmt: skip
    changed = []
    for key in req.given():
        asked = getattr(req, key)
        if key == "replicas":
            same = isinstance(asked, int) and service.min_replicas <= asked <= service.max_replicas
        else:
            if key in ("idle_after", "cold_start_timeout"):
                asked = seconds(asked, "--" + key.replace("_", "-"))
            same = asked == now[key]
        if not same:
            changed.append(key)
    return changed


def update_service(user, service: Service, req: ServeRequest, source: str) -> Service:
    """`ugro serve NAME --from JOB[:STEP]` on a service not stopped: a rolling update to that checkpoint
    (serving/updates.py), audited; ServeError (one line, nothing changed) for what an update cannot do."""
    try:
        changed = reshaped(req, service)
        if changed:
            flags = ", ".join("--" + key.replace("_", "-") for key in changed)
            raise ServeError(f"service {service.name} is {service.state}: an update changes only its checkpoint "
                             f"(--from); {flags} need a new service (first: manage.py serve {service.name} "
                             "--stop)")  # fmt: skip
        job, checkpoint = checkpoint_of(req.source)
        if service.next_checkpoint_id:
            step = service.next_checkpoint.step
            raise ServeError(f"service {service.name} is already updating to step {step}: wait for it to end")
        if checkpoint.pk == service.checkpoint_id:
            raise ServeError(f"service {service.name} already serves {job.name} step {checkpoint.step}")
        vram = checked_vram(service.name, checkpoint, service.gpus_per_replica)
        problem = capacity_problem(1, service.gpus_per_replica, vram)
        if problem:
            raise ServeError(f"the update's replicas could never be placed: {problem}")
    except ServeError as exc:
        audit.record(user, "serve update", service.name, source=source, outcome=f"refused: {exc}")
        raise
    require_worker()
    with transaction.atomic():
        asked = begin_update(service, job, checkpoint, vram)
        if not asked:
            raise ServeError(f"service {service.name} changed meanwhile (it is {service.state}): try again")
        audit.record(user, "serve update", service.name, source=source, service_id=service.pk,
                     checkpoint=f"{checkpoint.node.name}:{checkpoint.path}", step=checkpoint.step)  # fmt: skip
        transaction.on_commit(request_tend)
    service.refresh_from_db()
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
    replicas = list(service.replica_set.select_related("node", "checkpoint").order_by("index"))
    traffic = recent(replicas)
    update = service.next_checkpoint
    return {
        "name": service.name, "state": service.state, "engine": service.engine, "job": service.job.name,
        "step": c.step, "checkpoint": f"{c.node.name}:{c.path}", "endpoint": f"/serve/{service.name}/v1/",
        "holds": held(service), "min_replicas": service.min_replicas,
        # the count it runs at now: none while asleep (its target keeps the count a wake starts with)
        "replicas_now": 0 if service.state == Service.State.SLEEPING else service.replicas,
        "max_replicas": service.max_replicas, "target_outstanding": service.target_outstanding,
        "idle_after_s": service.idle_after_s, "cold_start_timeout_s": cold_start_timeout(service),
        "last_cold_start_s": service.last_cold_start_s, "updating_to_step": update.step if update else None,
        "note": service.note,
        "replicas": [
            {"index": r.index, "state": r.state, "node": r.node.name if r.node else None, "port": r.port,
             "gpus": r.gpu_indices, "restarts": r.restarts, "note": r.note, "step": (r.checkpoint or c).step,
             "in_flight": r.outstanding, "stats": traffic[r.pk].as_dict()}
            for r in replicas
        ],
    }  # fmt: skip


def listing(services: list[dict]) -> list[str]:
    """--list's lines: each replica with the last minute's requests per second, median latency and errors."""
    out = []
    for s in services:
        out.append(f"{s['name']}  {s['state']}  {s['engine']}  from {s['job']} step {s['step']}  {s['endpoint']}  "
                   f"holds {', '.join(s['holds']) or 'nothing'}")  # fmt: skip
        shape = f"  replicas {s['replicas_now']} ({s['min_replicas']}-{s['max_replicas']})"
        if s["idle_after_s"]:
            cold = s["last_cold_start_s"]
            shape += f"  sleeps after {s['idle_after_s'] / 60:g} min idle  last cold start " + (
                f"{cold:.1f} s" if cold is not None else "-")  # fmt: skip
        if s["updating_to_step"] is not None:
            shape += f"  updating to step {s['updating_to_step']}"
        out.append(shape + (f"  {s['note']}" if s["note"] else ""))
        for r in s["replicas"]:
            if r["state"] == "stopped" and s["state"] != "stopped":
                continue  # left when asleep, scaled down or updated: its totals stay in the API and /metrics
            where = f"{r['node']}:{r['port']}" if r["node"] and r["port"] else (r["node"] or "-")
            st = r.get("stats") or {}
            p50 = f"{st['p50_ms']:.0f} ms" if st.get("p50_ms") is not None else "-"
            traffic = f"{st.get('rps') or 0:.2f} req/s  p50 {p50}  errors {st.get('errors') or 0}"
            out.append(f"  replica {r['index']}  {r['state']:<9}  {where:<22}  step {r['step']}  restarts "
                       f"{r['restarts']}  {traffic}  {r['note']}")  # fmt: skip
    return out
