"""The worker's pass over services: place and start pending replicas, check the others, restart the dead
(at most max_restarts times each), and stop every replica of a stopping service, freeing its GPUs.

One worker tends a service at a time, under a lease on its row; each step is safe to repeat after a crash
(a start is idempotent by its tag on the node, a stop finds processes by that tag).
"""

from __future__ import annotations

import logging
import time
import uuid
from datetime import timedelta

import httpx
from django.db.models import Q
from django.utils import timezone

from cluster.fanout import node_request
from cluster.links import AgentRequestError, LinkError
from jobs.checkpoints import ensure_on, target_path
from jobs.follow import follower_id
from jobs.models import Job
from jobs.retention import Uses
from jobs.stop import stop_tagged

from . import replica_logs, scaling, updates
from .engines import EngineError, engine_argv
from .models import Replica, Service
from .placement import place, release
from .stats import drop_old

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # a real engine loads (and may compile) the model before it answers
UNHEALTHY_RESTART_S = 30.0  # a ready replica that stops answering this long is restarted
CHECK_TIMEOUT_S = 3.0
# transformers serve lists only the models in the Hub's cache on /v1/models (a 500 when there is none): its /health
HEALTH_PATHS = {"transformers": "/health", "vllm": "/health", "sglang": "/health", "custom": "/v1/models"}
TEND_LEASE_S = 120.0
NODE_ERRORS = (LinkError, AgentRequestError, OSError)


def tend() -> int:
    """One pass over every service not stopped; how many this worker tended."""
    drop_old()
    done = 0
    for pk in Service.objects.exclude(state=Service.State.STOPPED).values_list("pk", flat=True):
        service = _lease(pk)
        if service is None:
            continue
        try:
            tend_one(service)
            done += 1
        finally:
            Service.objects.filter(pk=pk, tender=service.tender).update(tender="", tend_until=None)
    return done


def _lease(pk: int) -> Service | None:
    now = timezone.now()
    me = follower_id()
    free = Q(tend_until__isnull=True) | Q(tend_until__lt=now)
    if not Service.objects.filter(free, pk=pk).update(tender=me, tend_until=now + timedelta(seconds=TEND_LEASE_S)):
        return None
    return Service.objects.select_related("checkpoint__node", "checkpoint__job", "next_checkpoint__job").get(pk=pk)


def _replicas(service: Service) -> list[Replica]:
    return list(service.replica_set.select_related("node", "checkpoint__node").order_by("index"))


def tend_one(service: Service) -> None:
    replicas = _replicas(service)
    if service.state == Service.State.STOPPING:
        unclean = [r for r in replicas if not stop(r)]
        if not unclean:
            Service.objects.filter(pk=service.pk, state=Service.State.STOPPING).update(
                state=Service.State.STOPPED, stopped_at=timezone.now()
            )
        return
    # first what the service needs (serving/scaling.py, serving/updates.py), then each replica's care
    if service.next_checkpoint_id and service.state in Service.AWAKE:
        updates.step(service, replicas)
    scaling.decide(service, replicas)
    replicas = _replicas(service)
    for replica in replicas:
        replica.service = service
        try:
            if replica.state == Replica.State.PENDING:
                if place(replica):
                    start(replica)
                elif not replica.note.startswith("waiting"):
                    _save(replica, note=f"waiting for {service.gpus_per_replica or 'a whole node of'} free GPUs")
            elif replica.state == Replica.State.DRAINING:
                replica_logs.copy(replica)
                if scaling.drained(replica):
                    stop(replica)
            elif replica.state in Replica.HOLDING:
                replica_logs.copy(replica)  # before the check: a restart's reason is in what it wrote last
                check(replica)
        except Exception:  # one replica's trouble must not stop the others' care
            log.exception("service %s replica %s", service.name, replica.index)
    if service.state == Service.State.WAKING:
        hurry(service, replicas)


WAKE_POLL_S = 4.0  # a waking service's starting replica is asked this long (a held request waits for it)
WAKE_POLL_EVERY_S = 0.25


def hurry(service: Service, replicas: list[Replica]) -> None:
    """While requests wait for a waking service, ask its starting replicas more often than each pass (bounded)."""
    deadline = time.monotonic() + WAKE_POLL_S
    starting = [r for r in replicas if r.state == Replica.State.STARTING]
    while starting and time.monotonic() < deadline:
        up = [r for r in starting if answers(r)]
        if up:
            for r in up:
                check(r)
            return
        time.sleep(WAKE_POLL_EVERY_S)


def _save(replica: Replica, **fields) -> None:
    for key, value in fields.items():
        setattr(replica, key, value)
    Replica.objects.filter(pk=replica.pk).update(**fields)


def checkpoint_uses(job: Job) -> Uses:
    """What checkpoint retention (jobs/retention.py) must know of a job's checkpoints: the one each service not
    stopped serves stays (and the one it is updating to, and each of its replicas'), and the copies replicas were
    given go with their checkpoint."""
    uses = Uses()
    live = Service.objects.exclude(state=Service.State.STOPPED)
    for pk, name in live.filter(checkpoint__job=job).values_list("checkpoint_id", "name"):
        uses.needed.setdefault(pk, f"service {name} serves it")
    for pk, name in live.filter(next_checkpoint__job=job).values_list("next_checkpoint_id", "name"):
        uses.needed.setdefault(pk, f"service {name} is updating to it")
    serving = Replica.objects.filter(checkpoint__job=job, service__in=live).exclude(state=Replica.State.STOPPED)
    for pk, name in serving.values_list("checkpoint_id", "service__name"):
        uses.needed.setdefault(pk, f"a replica of service {name} serves it")
    copies = Replica.objects.filter(node__isnull=False).exclude(model_path="")
    copies = copies.filter(Q(checkpoint__job=job) | Q(checkpoint__isnull=True, service__checkpoint__job=job))
    for r in copies.select_related("node", "service"):
        uses.copies.append((r.checkpoint_id or r.service.checkpoint_id, r.node, r.model_path))
    return uses


def model_path(replica: Replica) -> str:
    """The checkpoint's directory on the replica's node, copied there first when it is elsewhere."""
    checkpoint = replica.checkpoint or replica.service.checkpoint
    if checkpoint.node_id == replica.node_id:
        return checkpoint.path
    ensure_on(checkpoint, [replica.node])
    return target_path(checkpoint, replica.node)


def start(replica: Replica) -> bool:
    """Start the engine of a replica that holds its slots: STARTING; a start that fails counts as a restart."""
    service, node = replica.service, replica.node
    try:
        path = model_path(replica)
        port = node_request(node, "free_port", timeout=10, host=node.address)["port"]
        tag = f"serve-{service.name}-{replica.index}-{uuid.uuid4().hex[:8]}"
        argv = engine_argv(service.engine, service.command_template, node, model=path, port=port,
                           gpus=len(replica.gpu_indices), name=service.name)  # fmt: skip
        env = {str(k): str(v) for k, v in (node.env or {}).items()}
        env.update({"UGRO_JOB": tag, "UGRO_NODE": node.name, "UGRO_SERVICE": service.name})
        if replica.gpu_indices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in replica.gpu_indices)
        replica.tag = tag  # remote() names this start's files
        node_request(node, "start", timeout=30, argv=argv, cwd=node.workdir, env=env, key=tag,
                     log=replica.remote("log"), exit_file=replica.remote("exit"))  # fmt: skip
    except (*NODE_ERRORS, ValueError, EngineError) as exc:
        _gave_up_or_retry(replica, f"could not start on {node.name}: {exc}", release_slots=True)
        return False
    again = f"{replica.note}; " if replica.restarts and replica.note.startswith("restart ") else ""  # why, kept
    _save(replica, state=Replica.State.STARTING, tag=tag, port=port, model_path=path, started_at=timezone.now(),
          ready_at=None, unhealthy_since=None, note=f"{again}starting on {node.name}:{port}"[:500])  # fmt: skip
    return True


def health_path(replica: Replica) -> str:
    return HEALTH_PATHS[replica.service.engine]


def answers(replica: Replica) -> bool:
    try:
        return httpx.get(replica.url + health_path(replica), timeout=CHECK_TIMEOUT_S).status_code == 200
    except httpx.HTTPError:
        return False


def process_gone(replica: Replica) -> str | None:
    """Why the replica's engine is gone by its node's account, or None while it runs (or the node is silent)."""
    item = {"exit_file": replica.remote("exit"), "key": replica.tag, "tag": replica.tag, "node": replica.node.name}
    try:
        st = node_request(replica.node, "rank_status", timeout=10, ranks=[item])["ranks"][0]
    except NODE_ERRORS:
        return None
    if st.get("exit") is not None:
        return f"its engine exited ({st['exit'].get('rc')}): {last_line(replica)}"
    if not st.get("wrapper_alive") and not st.get("torchrun_alive"):
        return "its engine is gone without an exit record"
    return None


LOG_TAIL_BYTES = 64 * 1024  # what the replica's log page shows: the engine's start-up and its latest requests


def log_tail(replica: Replica, size: int = LOG_TAIL_BYTES) -> str:
    """The last `size` bytes of the replica's current log on its node (read when asked: engines log little
    once ready, so nothing copies it centrally); ValueError in one line when it cannot be read."""
    if replica.node is None or not replica.tag:
        raise ValueError(f"replica {replica.index} has not started yet: no log")
    try:
        out = node_request(replica.node, "exec", timeout=10, argv=["tail", "-c", str(size), replica.remote("log")])
    except NODE_ERRORS as exc:
        raise ValueError(f"the log of replica {replica.index} on {replica.node.name} cannot be read: {exc}") from None
    return out.get("stdout", "")


def last_line(replica: Replica) -> str:
    try:
        text = log_tail(replica, 2000)
    except ValueError:
        return "(its log cannot be read)"
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


def check(replica: Replica) -> None:
    now = timezone.now()
    if answers(replica):
        fields = {"state": Replica.State.READY, "checked_at": now, "unhealthy_since": None}
        if replica.state != Replica.State.READY:
            fields.update(ready_at=now, note=f"ready on {replica.node.name}:{replica.port}")
        _save(replica, **fields)
        return
    gone = process_gone(replica)
    path = health_path(replica)
    if gone:
        restart(replica, gone)
    elif replica.state == Replica.State.STARTING:
        if (now - replica.started_at).total_seconds() > START_TIMEOUT_S:
            restart(replica, f"did not answer {path} within {START_TIMEOUT_S:g} s")
        else:
            _save(replica, checked_at=now)
    elif replica.state == Replica.State.READY:
        _save(replica, state=Replica.State.UNHEALTHY, unhealthy_since=now, checked_at=now,
              note=f"stopped answering {path}")  # fmt: skip
    elif (now - replica.unhealthy_since).total_seconds() > UNHEALTHY_RESTART_S:
        restart(replica, f"did not answer {path} for {UNHEALTHY_RESTART_S:g} s")


def _kill(replica: Replica) -> list[str]:
    """Stop the replica's processes (TERM, grace, KILL) on its node; what could not be confirmed."""
    if not replica.tag or replica.node is None:
        return []
    return stop_tagged(replica.tag, [replica.node], what=f"service {replica.service.name} replica {replica.index}")


def restart(replica: Replica, why: str) -> None:
    unclean = _kill(replica)
    replica_logs.copy(replica)  # its last words, before the next start's tag replaces it
    log.warning("service %s replica %s: %s", replica.service.name, replica.index, why)
    # a node that cannot confirm the old engine gone lets go of the replica: it is placed again, elsewhere if need be
    if _gave_up_or_retry(replica, why, release_slots=bool(unclean)):
        start(replica)


def _gave_up_or_retry(replica: Replica, why: str, release_slots: bool) -> bool:
    """Count a restart; FAILED (slots freed) past max_restarts. True when it should start again where it is."""
    restarts = replica.restarts + 1
    if restarts > replica.service.max_restarts:
        release(replica)
        _save(replica, state=Replica.State.FAILED, restarts=restarts,
              note=f"given up after {replica.service.max_restarts} restarts: {why}"[:500])  # fmt: skip
        return False
    if release_slots:
        release(replica)
        _save(replica, state=Replica.State.PENDING, restarts=restarts, node=None, gpu_indices=[],
              note=f"restart {restarts}: {why}"[:500])  # fmt: skip
        return False
    _save(replica, restarts=restarts, note=f"restart {restarts}: {why}"[:500])
    return True


def stop(replica: Replica) -> bool:
    """Stop a replica for good: no process left, its slots freed, STOPPED. False if its node could not
    confirm its processes gone (the next pass tries again, the slots still held)."""
    if replica.state == Replica.State.STOPPED:
        return True
    unclean = _kill(replica)
    if unclean:
        _save(replica, note=f"stopping: {'; '.join(unclean)}"[:500])
        return False
    replica_logs.copy(replica)  # kept centrally after it stops
    release(replica)
    _save(replica, state=Replica.State.STOPPED, note="stopped")
    return True
