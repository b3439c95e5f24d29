"""What users do to jobs and nodes, checked by the policy and written to the audit log.

Every surface (pages, the API, management commands) calls these, so a rule or an audit row cannot
be forgotten on one of them. They only change the database and enqueue; nothing here talks to a node.
"""

from __future__ import annotations

from dataclasses import replace

from cluster.models import Node
from jobs import lifecycle, recovery
from jobs.launch import LaunchError, LaunchRequest, create_job, dry_run
from jobs.models import Job, Sweep
from jobs.sweeps import SweepRequest, cancel_sweep, create_sweep

from . import audit, policy


def _checked(user, action: str, target: str, source: str, job: Job | None = None, *, what: str = "", **kw) -> None:
    try:
        policy.check(user, action, job, **kw)
    except policy.Refused as exc:
        audit.record(user, what or action, target, source=source, outcome=f"refused: {exc}")
        raise


def launch(user, req: LaunchRequest, source: str) -> Job:
    """Queue the job as `user` (its owner); raises policy.Refused or LaunchError, with nothing created."""
    _checked(user, "launch", req.name, source, priority=req.priority)
    try:
        job = create_job(replace(req, owner=user))
    except LaunchError as exc:
        audit.record(user, "launch", req.name, source=source, outcome=f"refused: {exc}")
        raise
    audit.record(
        user, "launch", job.name, source=source, argv=[job.script, *job.script_args],
        job_id=job.pk, priority=job.priority, nodes=job.requested_nodes, count=job.requested_count,
    )  # fmt: skip
    return job


def preview(user, req: LaunchRequest) -> list[str]:
    """The dry run (each rank's exact command), for those who may launch."""
    policy.check(user, "launch", priority=req.priority)
    return dry_run(req)


def cancel(user, job: Job, source: str) -> Job:
    """Cancel the job as `user`; raises policy.Refused, or ValueError for a job that already ended."""
    _checked(user, "cancel", job.name, source, job=job)
    job = lifecycle.cancel(job)
    audit.record(user, "cancel", job.name, source=source, job_id=job.pk, state=job.state)
    return job


def set_node_enabled(user, node: Node, enabled: bool, source: str) -> Node:
    """Drain (no new job is placed on it; running ones go on) or undrain a node."""
    action = "undrain" if enabled else "drain"
    _checked(user, "nodes", node.name, source, what=action)
    Node.objects.filter(pk=node.pk).update(enabled=enabled)
    node.enabled = enabled
    audit.record(user, action, node.name, source=source)
    return node


def launch_sweep(user, req: SweepRequest, source: str) -> Sweep:
    """Create the sweep and its trial jobs as `user` (their owner); raises policy.Refused or LaunchError."""
    _checked(user, "launch", req.name, source, priority=req.base.priority, what="sweep")
    try:
        sweep = create_sweep(replace(req, base=replace(req.base, owner=user)))
    except LaunchError as exc:
        audit.record(user, "sweep", req.name, source=source, outcome=f"refused: {exc}")
        raise
    audit.record(user, "sweep", sweep.name, source=source, sweep_id=sweep.pk, trials=sweep.trials.count(),
                 spec=sweep.spec)  # fmt: skip
    return sweep


def cancel_sweep_as(user, sweep: Sweep, source: str) -> list[Job]:
    """Cancel every trial of the sweep not yet ended, as `user` (who must be allowed to cancel each one:
    nothing is cancelled otherwise); returns the trials now stopping."""
    for trial in sweep.trials.exclude(state__in=Job.ENDED_STATES).select_related("owner"):
        _checked(user, "cancel", sweep.name, source, job=trial, what="cancel sweep")
    stopping = cancel_sweep(sweep)
    audit.record(user, "cancel sweep", sweep.name, source=source, sweep_id=sweep.pk)
    return stopping


def resume(user, job: Job, wanted: str | None, nodes: list[str] | None, source: str) -> Job:
    """Resume a failed or cancelled job as its next attempt (jobs/recovery.py) as `user`; raises
    policy.Refused or recovery.RecoveryError (one line), with nothing changed."""
    _checked(user, "resume", job.name, source, job=job)
    try:
        job = recovery.resume(job, wanted, nodes, who=user.get_username() if user else "")
    except recovery.RecoveryError as exc:
        audit.record(user, "resume", job.name, source=source, outcome=f"refused: {exc}")
        raise
    audit.record(user, "resume", job.name, source=source, job_id=job.pk, attempt=job.attempt,
                 from_step=job.resume_step, nodes=job.requested_nodes)  # fmt: skip
    return job
