"""What status and results show about jobs, as plain text lines."""

from __future__ import annotations

import json
import time

from django.core.management.base import CommandError
from django.db.models import F
from django.utils import timezone

from .models import Checkpoint, Job


def get_job(name: str) -> Job:
    try:
        return Job.objects.get(name=name)
    except Job.DoesNotExist:
        raise CommandError(f"no job named {name!r} (see: ugro status)") from None


def human_duration(seconds: float | None, *, empty: str = "-", sep: str = "") -> str:
    """1h02m03s (terminal) or, with sep=" ", 1h 02m 03s (pages); `empty` when there is none."""
    if seconds is None:
        return empty
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{sep}{m:02d}m{sep}{s:02d}s" if h else f"{m}m{sep}{s:02d}s"


def jobs_table(jobs: list[Job]) -> list[str]:
    rows = [f"{'JOB':24} {'STATE':10} {'NODES':28} {'STARTED':20} {'DURATION':>9}"]
    for job in jobs:
        nodes = ",".join(r.node.name for r in job.ranks.all()) or (
            ",".join(job.requested_nodes) or f"{job.requested_count or '?'} nodes"
        )
        started = timezone.localtime(job.started_at).strftime("%Y-%m-%d %H:%M:%S") if job.started_at else "-"
        took = human_duration(job.duration())
        rows.append(f"{job.name[:24]:24} {job.state:10} {nodes[:28]:28} {started:20} {took:>9}")
    return rows


def job_detail(job: Job) -> list[str]:
    out = [
        f"job {job.name} (id {job.pk}): {job.state}" + (f", attempt {job.attempt}" if job.attempt > 1 else ""),
        f"  script: {job.script} {' '.join(json.dumps(a) if ' ' in a else a for a in job.script_args)}",
        f"  created {job.created_at:%Y-%m-%d %H:%M:%S}, duration {human_duration(job.duration())}",
    ]
    if job.rdzv_endpoint:
        out.append(f"  rendezvous {job.rdzv_endpoint}, id {job.tag}")
    if job.launch_spread_s is not None:
        out.append(f"  rank start spread {job.launch_spread_s * 1000:.0f} ms (sync window {job.sync_window_s:g}s)")
    for r in job.ranks.select_related("node").order_by("index"):
        out.append(
            f"  rank {r.index} on {r.node.name:14} {r.state:8} exit {r.exit_text():>6}  "
            f"{r.log_lines} lines ({r.log_offset} bytes)"
        )
    if job.failure_reason:
        out.append("  reason: " + job.failure_reason.replace("\n", "\n  "))
    return out


def checkpoints(job: Job) -> list[Checkpoint]:
    """The checkpoints the follower recorded for the job, newest step first."""
    return list(job.checkpoints.select_related("node").order_by(F("step").desc(nulls_last=True), "path"))


def age(mtime: float) -> str:
    """How long ago a node's file changed (node clock vs ours: close enough for an age)."""
    return human_duration(max(0.0, time.time() - mtime))


def results(job: Job) -> list[str]:
    out = job_detail(job)
    cfg = job.job_dir / "config.json"
    out.append(f"  config: {cfg if cfg.exists() else '-'}")
    for r in job.ranks.order_by("index"):
        out.append(f"  log rank {r.index}: {r.local_log}")
    metrics = job.job_dir / "metrics.jsonl"
    if metrics.exists():
        out.append(f"  metrics: {metrics}")
    final = {}
    for p in job.metric_points.filter(name="loss", superseded=False).order_by("-step")[:32]:
        final.setdefault(p.rank, p)
    for rank, p in sorted(final.items()):
        out.append(f"  final loss rank {rank}: {p.value:.4f} at step {p.step}")
    for m in job.final_metrics.order_by("rank", "name"):
        out.append(f"  final {m.name} rank {m.rank}: {m.value:.6g} at step {m.step}")
    ckpts = checkpoints(job)
    ready = sum(c.ready for c in ckpts)
    out.append(f"  checkpoints: {len(ckpts)} ({ready} complete)")
    if ckpts:
        out.append(f"    {'STEP':>8} {'NODE':12} {'SIZE':>10} {'AGE':>9}  PATH")
    for c in ckpts:
        step = str(c.step) if c.step is not None else "-"
        note = "" if c.ready else "  (being written or incomplete: not offered)"
        out.append(f"    {step:>8} {c.node.name[:12]:12} {c.size / 1e6:>7.1f} MB {age(c.mtime):>9}  {c.path}{note}")
    for a in job.attempts.order_by("number"):
        out.append(
            f"  attempt {a.number}: {a.state}{' ' + a.failure_kind if a.failure_kind else ''} at step "
            f"{a.last_step if a.last_step is not None else '-'} (from step {a.from_step or 0}) on "
            f"{','.join(a.nodes) or '-'}; then {a.next_reason}"
        )
    if job.attempt > 1 or job.recovery_note:
        out.append(f"  attempt {job.attempt}: {job.state}" + (f"; {job.recovery_note}" if job.recovery_note else ""))
    return out
