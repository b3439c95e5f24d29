"""Rolling update: `ugro serve NAME --from JOB[:STEP|latest]` on a service not stopped moves it to that checkpoint
without a failed request.

The worker (serving/replicas.py, each pass) starts one replica of the new checkpoint beside the old ones (placed
as any replica: free GPUs only), and once it answers its health check it takes requests and one old replica
drains (no new requests, stopped when nothing is in flight to it: serving/scaling.py); then the next, until none
of the old is left and the service records the new checkpoint. A new replica whose engine exits, or that does not
answer within the cold-start timeout, fails the update: every new replica drains and stops, the old ones keep
serving, and the service's note says why in one line. A sleeping service just records the new checkpoint: its
next replica starts from it.
"""

from __future__ import annotations

import logging

from django.utils import timezone

from jobs.models import Checkpoint, Job

from .models import Replica, Service
from .scaling import add, cold_start_timeout, leave, staying

log = logging.getLogger(__name__)


def describe_checkpoint(job: Job, checkpoint: Checkpoint) -> str:
    return f"{job.name} step {checkpoint.step}"


def begin_update(service: Service, job: Job, checkpoint: Checkpoint, vram: int | None) -> bool:
    """Record the update (the worker carries it out); False when the service is neither awake nor asleep now, or
    already updating."""
    what = describe_checkpoint(job, checkpoint)
    rows = Service.objects.filter(pk=service.pk, next_checkpoint__isnull=True)
    asleep = f"now serves {what}: its next replica starts from it"
    if rows.filter(state=Service.State.SLEEPING).update(checkpoint=checkpoint, job=job, min_vram_mb=vram, note=asleep):
        return True
    return bool(rows.filter(state=Service.State.RUNNING).update(next_checkpoint=checkpoint, min_vram_mb=vram,
                                                           note=f"updating to {what}"))  # fmt: skip


def step(service: Service, replicas: list[Replica]) -> None:
    """One pass of an update in progress: fail it, add a new replica, drain an old one, or finish."""
    target = service.next_checkpoint
    what = describe_checkpoint(target.job, target)
    present = staying(replicas)
    new = [r for r in present if r.checkpoint_id == target.pk]
    old = [r for r in present if r.checkpoint_id != target.pk]
    broken = next((r for r in new if _broken(service, r)), None)
    if broken is not None:
        why = f"update to {what} failed: replica {broken.index} {_why(service, broken)}; the old replicas serve on"
        for r in new:
            leave(r, "its update failed")
        Service.objects.filter(pk=service.pk).update(next_checkpoint=None, note=why[:500])
        service.next_checkpoint = None
        log.warning("service %s: %s", service.name, why)
        return
    ready = [r for r in new if r.state == Replica.State.READY]
    if len(new) < service.replicas and len(ready) == len(new):  # one at a time: at most one more GPU set held
        add(service, replicas, target.pk, f"update to {what}")
        return
    surplus = max(0, len(old) - max(0, service.replicas - len(ready)))  # each ready new one relieves an old one
    for r in sorted(old, key=lambda r: (r.state == Replica.State.READY, -r.index))[:surplus]:
        leave(r, f"replaced by {what}")
    if len(ready) >= service.replicas and not [r for r in staying(replicas) if r.checkpoint_id != target.pk]:
        done = f"updated to {what} at {timezone.now():%H:%M:%S}"
        Service.objects.filter(pk=service.pk).update(checkpoint=target, job=target.job, next_checkpoint=None, note=done)
        log.info("service %s: updated to %s", service.name, what)


def _broken(service: Service, replica: Replica) -> bool:
    if replica.state == Replica.State.FAILED or replica.restarts > 0:
        return True
    if replica.state == Replica.State.STARTING and replica.started_at:
        return (timezone.now() - replica.started_at).total_seconds() > cold_start_timeout(service)
    return False


def _why(service: Service, replica: Replica) -> str:
    if replica.state == Replica.State.STARTING and not replica.restarts:
        return f"did not answer its health check within {cold_start_timeout(service):g} s"
    return replica.note.split("; starting on ")[0].removeprefix("restart 1: ") or "failed"
