"""What status and results show about jobs, as plain text lines."""

from __future__ import annotations

import json

from django.core.management.base import CommandError
from django.utils import timezone

from .models import Job


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
        f"job {job.name} (id {job.pk}): {job.state}",
        f"  script: {job.script} {' '.join(json.dumps(a) if ' ' in a else a for a in job.script_args)}",
        f"  created {job.created_at:%Y-%m-%d %H:%M:%S}, duration {human_duration(job.duration())}",
    ]
    if job.rdzv_endpoint:
        out.append(f"  rendezvous {job.rdzv_endpoint}, id {job.tag}")
    if job.launch_spread_s is not None:
        out.append(f"  rank start spread {job.launch_spread_s * 1000:.0f} ms (sync window {job.sync_window_s:g}s)")
    asks = asks_text(job)
    if job.time_limit_s:
        asks += f", time limit {human_duration(job.time_limit_s)}"
    out.append(f"  asks {asks}" + (f" (VRAM {job.vram_source})" if job.vram_source.startswith("learned") else ""))
    for r in job.ranks.select_related("node").order_by("index"):
        gpus = f"GPUs {','.join(map(str, r.gpu_indices))}" if r.gpu_indices else "whole node"
        out.append(
            f"  rank {r.index} on {r.node.name:14} {gpus:12} {r.state:8} exit {r.exit_text():>6}  "
            f"{r.log_lines} lines ({r.log_offset} bytes)"
        )
    if job.failure_reason:
        out.append("  reason: " + job.failure_reason.replace("\n", "\n  "))
    return out


def checkpoints(job: Job) -> list[tuple[str, str, int]]:
    """(node, path, size) of the checkpoints the follower recorded for the job."""
    return [(c.node.name, c.path, c.size) for c in job.checkpoints.select_related("node").order_by("path")]


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
    for p in job.metric_points.filter(name="loss").order_by("-step")[:32]:
        final.setdefault(p.rank, p)
    for rank, p in sorted(final.items()):
        out.append(f"  final loss rank {rank}: {p.value:.4f} at step {p.step}")
    for m in job.final_metrics.order_by("rank", "name"):
        out.append(f"  final {m.name} rank {m.rank}: {m.value:.6g} at step {m.step}")
    ckpts = checkpoints(job)
    out.append(f"  checkpoints: {len(ckpts)}")
    for node, path, size in ckpts:
        out.append(f"    {node}:{path} ({size / 1e6:.1f} MB)")
    return out


def asks_text(job: Job) -> str:
    """What a job asks for, in a few words: 2 GPUs, 2x4 GPUs, 3 nodes, node1+node2; VRAM and time limit."""
    if job.gpus:
        what = f"{job.gpus} GPU{'s' if job.gpus > 1 else ''}"
    elif job.requested_nodes:
        what = "+".join(job.requested_nodes) + (f" x{job.gpus_per_node} GPUs" if job.gpus_per_node else "")
    elif job.gpus_per_node:
        what = f"{job.requested_count or 1}x{job.gpus_per_node} GPUs"
    else:
        what = f"{job.requested_count or 1} node{'s' if (job.requested_count or 1) > 1 else ''}"
    if job.min_vram_mb:
        what += f" >={job.min_vram_mb / 1024:.0f}G"
    return what


def queue_table(entries: list, holders: dict[str, list[str]]) -> list[str]:
    """The `queue` command's lines: waiting jobs (position, reason, estimated start), then what holds GPUs.

    entries: jobs.snapshot.Entry in queue order; holders: job name -> ["node:gpu", ...] of running jobs.
    """
    now = timezone.now()
    rows = [f"{'POS':>3} {'JOB':24} {'PRIO':>4} {'OWNER':10} {'ASKS':18} {'REASON':11} {'EST. START':16} DETAIL"]
    for e in entries:
        d, job = e.decision, e.job
        owner = job.owner.username if job.owner_id else "system"
        if d.start:
            reason, est, detail = "-", "now", f"starts at the next pass on {e.placement_text()}"
        else:
            reason, detail = d.reason, d.detail
            est = "unknown" if e.est_start is None else _when(e.est_start, now)
        rows.append(f"{d.position:>3} {job.name[:24]:24} {job.priority:>4} {owner[:10]:10} {asks_text(job)[:18]:18} "
                    f"{reason:11} {est:16} {detail}")  # fmt: skip
    if holders:
        rows.append("")
        rows.append("holding GPUs:")
        for name, gpus in holders.items():
            rows.append(f"    {name[:24]:24} {' '.join(gpus)}")
    return rows


def _when(at, now) -> str:
    local = timezone.localtime(at)
    if (at - now).total_seconds() < 60:
        return "now"
    fmt = "%H:%M" if local.date() == timezone.localtime(now).date() else "%m-%d %H:%M"
    minutes = int((at - now).total_seconds() // 60)
    left = f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m"
    return f"in {left} ({local.strftime(fmt)})"
