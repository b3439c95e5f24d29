"""What status and results show about jobs, as plain text lines."""

from __future__ import annotations

import difflib
import hashlib
import json
import time

from django.core.management.base import CommandError
from django.db.models import F, Max
from django.utils import timezone

from metrics.final import final_loss
from metrics.models import LAST_FIRST, JobMetrics, MetricPoint
from metrics.series import metric_names

from . import sync
from .data import summary as data_summary
from .energy import attempt_energy, energy_record, job_energy
from .envs import summary as env_summary
from .models import Checkpoint, Job, JobCode
from .network import advice as network_advice
from .retention import summary as retention_summary
from .retention import summary_text as retention_text
from .scale_probe import summary_lines as probe_lines


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


def human_age(seconds: float) -> str:
    """How long ago, kubectl style: 45s, 12m, 3h, 2d."""
    seconds = max(0, int(seconds))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def node_names(job: Job) -> list[str]:
    """The nodes a job runs on, or (while queued) the ones it asked for."""
    return [r.node.name for r in job.ranks.all()] or job.nodes_asked


def _nodes_text(job: Job) -> str:
    return ",".join(node_names(job)) or f"{job.count_asked or '?'} nodes"


def jobs_table(jobs: list[Job], progress: dict[int, dict | None] | None = None) -> list[str]:
    """Recent jobs, one row each: name, state, progress, nodes, age (since created) and owner.

    `progress` maps job id to progress()'s answer (the one definition the pages use too).
    """
    progress = progress or {}
    now = timezone.now()
    rows = [f"{'JOB':24} {'STATE':10} {'PROGRESS':>8}  {'NODES':24} {'AGE':>5}  OWNER"]
    for job in jobs:
        prog = progress.get(job.pk)
        percent = f"{prog['percent']:.1f}%" if prog else "-"
        age = human_age((now - job.created_at).total_seconds())
        owner = job.owner.get_username() if job.owner_id else "-"
        rows.append(f"{job.name[:24]:24} {job.state:10} {percent:>8}  {_nodes_text(job)[:24]:24} {age:>5}  {owner}")
    return rows


def _max_steps(job: Job) -> int | None:
    """The script's --max-steps, if it was given one (the reference script's option)."""
    args = [str(a) for a in job.script_args or []]
    for i, arg in enumerate(args):
        value = arg.partition("=")[2] if arg.startswith("--max-steps=") else None
        if arg == "--max-steps" and i + 1 < len(args):
            value = args[i + 1]
        if value is not None:
            try:
                steps = int(value)
            except ValueError:
                continue
            return steps if steps > 0 else None
    return None


def progress(job: Job, names: list[str]) -> dict | None:
    """Best-effort progress and ETA: from the step and total steps the script shows (a bar's N/M, a logged
    max_steps), else from --max-steps and the last step seen, else from the epoch metric; 100 % at success."""
    if not job.running_at:
        return None
    bar = JobMetrics.objects.filter(job=job, total_steps__gt=0, step__isnull=False).first()
    if not names and bar is None and job.state != Job.State.SUCCEEDED:
        return None
    fraction = None
    last = None
    max_steps = None
    if bar is not None:
        last, max_steps = bar.step, bar.total_steps
        fraction = min(1.0, max(0.0, last / max_steps))
    elif names:
        name = "loss" if "loss" in names else names[0]
        last = MetricPoint.objects.filter(job=job, name=name, superseded=False).aggregate(step=Max("step"))["step"]
        max_steps = _max_steps(job)
    if fraction is None and max_steps and last is not None:
        fraction = min(1.0, last / max_steps)
    if fraction is None and "epoch" in names and (job.params or {}).get("epochs"):
        epochs = MetricPoint.objects.filter(job=job, name="epoch").order_by(LAST_FIRST, "-id")
        epoch = epochs.values_list("value", flat=True).first()
        if epoch is not None:
            fraction = min(1.0, max(0.0, epoch / float(job.params["epochs"])))
    if job.state == Job.State.SUCCEEDED:
        # A run that ended well is done, whatever its last counter said (0-based epochs, a bar not redrawn).
        fraction = 1.0
        if max_steps:
            last = max_steps
    if fraction is None:
        return None
    end = job.finished_at or timezone.now()
    elapsed = (end - job.running_at).total_seconds()
    eta = elapsed * (1 - fraction) / fraction if fraction > 0 and job.is_live else None
    return {"fraction": fraction, "percent": round(fraction * 100, 1), "step": last, "max_steps": max_steps, "eta": eta}


def job_progress(job: Job) -> dict | None:
    """The progress the job page shows; none before the job ran."""
    return progress(job, metric_names(job.pk)) if job.running_at else None


def _when(value) -> str | None:
    return value.isoformat() if value else None


def job_summary(job: Job, prog: dict | None = None, energy: dict | None = None) -> dict:
    """A job as JSON for `status --json`, `queue --json` and the detail views; `energy`: its jobs.energy record
    where a list read all of them at once (`energy_records`)."""
    now = timezone.now()
    return {
        "name": job.name,
        "id": job.pk,
        "state": job.state,
        "attempt": job.attempt,
        "priority": job.priority,
        "progress": round(prog["fraction"], 4) if prog else None,
        "step": prog["step"] if prog else None,
        "max_steps": prog["max_steps"] if prog else None,
        "nodes": node_names(job),
        "requested_count": job.count_asked,
        "owner": job.owner.get_username() if job.owner_id else None,
        "created_at": _when(job.created_at),
        "started_at": _when(job.started_at),
        "finished_at": _when(job.finished_at),
        "age_s": round((now - job.created_at).total_seconds(), 1),
        "duration_s": round(job.duration(), 1) if job.duration() is not None else None,
        # its GPUs' (and hosts') energy and cost, each attempt's (docs/power.md)
        "energy": energy if energy is not None else energy_record(job),
        "waits_for_nodes": list(job.wait_nodes) if job.state == Job.State.QUEUED else [],
        "failure": None
        if not job.failure_reason
        else {
            "kind": job.failure_kind or None,
            "rank": job.failure_rank,
            "node": job.failure_node or None,
            "exit_code": job.failure_exit_code,
            "signal": job.failure_signal,
            "line": job.failure_line or None,
            "reason": job.failure_reason,
        },
    }


def job_record(job: Job) -> dict:
    """`job_summary` plus what `status NAME` shows: script, rendezvous, start spread and every rank.

    `results --json` starts from this record too, so the two commands cannot disagree on a shared field.
    """
    ranks = job.ranks.select_related("node").order_by("index")
    return {
        **job_summary(job, job_progress(job)),
        "script": job.script,
        "script_args": job.script_args,
        "params": job.params,
        "tag": job.tag or None,
        "rendezvous": job.rdzv_endpoint or None,
        "start_spread_s": job.launch_spread_s,
        "sync_window_s": job.sync_window_s,
        "network_advice": network_advice(job) or None,  # a multi-node job's share of communication (jobs/network.py)
        "ranks": [
            {
                "rank": r.index,
                "node": r.node.name,
                "state": r.state,
                "exit_code": r.exit_code,
                "log_lines": r.log_lines,
                "log_bytes": r.log_offset,
                "lost_reason": r.lost_reason or None,
            }
            for r in ranks
        ],
        "code": code_record(job),
        "retention": retention_summary(job),  # what --keep kept and freed (jobs/retention.py)
        "scale_probe": probe_record(job),  # --scale-probe: each node count's samples/s, the count chosen
    }


def probe_record(job: Job) -> dict | None:
    """The current attempt's scale probe (jobs/scale_probe.py), None when it had none."""
    return (job.current.scale_probe or None) if job.current_id else None


def code_record(job: Job) -> dict | None:
    """What the job runs (docs/sync.md): its synced directory and the time its copy took, the code's git
    commit, and per node the script's sha256 and the environment's versions (packages: their sha256 and
    count here, the full lists from GET /api/v1/jobs/<name>/packages)."""
    try:
        code = job.code
    except JobCode.DoesNotExist:
        return None
    return {
        "sync": {"source": code.sync_source, "digest": code.sync_digest, "files": code.sync_files,
                 "bytes": code.sync_bytes, "seconds": code.sync_s, "sent_bytes": code.sync_sent_bytes}
        if code.sync_digest else None,
        "git": code.git or None,
        "allow_mismatch": code.allow_mismatch,
        "attempt": code.attempt or None,
        "nodes": code.nodes,
        "data": code.data or [],
        "transfer": code.transfer or None,
        "data_line": data_summary(code),
        "env_lines": env_summary(code),  # --packages: the lock and each node's environment (docs/envs.md)
        "envs": code.envs or None,
    }  # fmt: skip


def code_lines(job: Job) -> list[str]:
    """The job's code and environment, a few lines for `status NAME` and `results`."""
    record = code_record(job)
    if record is None:
        return []
    out = []
    synced = record["sync"]
    if synced:
        took = f", copied to the nodes in {synced['seconds']:.2f}s ({synced['sent_bytes']} bytes sent)" if (
            synced["seconds"] is not None) else ""  # fmt: skip
        out.append(f"  code: {synced['source']} synced ({synced['files']} files, {synced['bytes']} bytes){took}")
    if record["data_line"]:
        out.append(f"  {record['data_line']}")
    out += [f"  {line}" for line in record["env_lines"]]
    git = record["git"]
    if git:
        dirty = ", uncommitted changes" if git.get("dirty") else ""
        out.append(f"  git: {git.get('commit', '')[:12]} on {git.get('branch') or '-'}{dirty}")
    for name, v in sorted(record["nodes"].items()):
        sha = (v.get("script_sha256") or "-")[:12]
        out.append(
            f"  {name}: script {sha}, Python {v.get('python') or '-'}, torch {v.get('torch') or '-'}, "
            f"CUDA {v.get('cuda') or '-'}, NCCL {v.get('nccl') or '-'}, driver {v.get('driver') or '-'}, "
            f"GPU {v.get('gpu') or '-'}, {v.get('packages_count') or 0} packages "
            f"({(v.get('packages_sha256') or '-')[:12]})"
        )
    return out


CODE_FIELDS = (("python", "Python"), ("torch", "torch"), ("cuda", "CUDA"), ("nccl", "NCCL"), ("driver", "driver"),
               ("gpu", "GPU"), ("script_sha256", "script sha256"), ("packages_sha256", "packages"))  # fmt: skip


def code_rows(jobs: list[Job]) -> list[dict]:
    """What each job ran, one row per item (code, commit, per-node versions), marked where the jobs differ;
    a node's value is shown once when every node had the same."""
    codes = {c.job_id: c for c in JobCode.objects.filter(job__in=jobs)}
    columns: dict[str, list[str]] = {"code": [], "git commit": [], "uncommitted changes": []}
    for job in jobs:
        code = codes.get(job.pk)
        git = code.git if code else {}
        columns["code"].append(f"{code.sync_source} ({code.sync_digest[:12]})" if code and code.sync_digest else "")
        columns["git commit"].append(f"{git.get('commit', '')[:12]} {git.get('branch') or ''}".strip() if git else "")
        diff = git.get("diff") or ""
        columns["uncommitted changes"].append(
            f"{len(diff.splitlines())} diff lines, sha256 {hashlib.sha256(diff.encode()).hexdigest()[:12]}" if diff else
            ("none" if git else "")
        )  # fmt: skip
    for key, label in CODE_FIELDS:
        column = []
        for job in jobs:
            nodes = codes[job.pk].nodes if job.pk in codes else {}
            values = {name: str(v.get(key) or "-")[: 12 if key.endswith("sha256") else 60] for name, v in nodes.items()}
            distinct = set(values.values())
            column.append(next(iter(distinct)) if len(distinct) == 1 else
                          ", ".join(f"{n}: {v}" for n, v in sorted(values.items())))  # fmt: skip
        columns[label] = column
    if not any(v for values in columns.values() for v in values):
        return []
    return [{"name": k, "values": v, "differs": len(set(v)) > 1} for k, v in columns.items()]


def code_changes(base: Job, other: Job) -> dict:
    """What changed from one job's code and environment to another's: files of their synced directories
    (added, removed, changed), and rank 0's node's packages (added, removed, other version)."""
    codes = {c.job_id: c for c in JobCode.objects.filter(job__in=[base, other])}
    a, b = codes.get(base.pk), codes.get(other.pk)
    files: dict[str, list[str]] = {"added": [], "removed": [], "changed": []}
    if a and b and a.sync_digest and b.sync_digest and a.sync_digest != b.sync_digest:
        try:
            old = {f["path"]: f["sha256"] for f in sync.load_manifest(a.sync_digest)["files"]}
            new = {f["path"]: f["sha256"] for f in sync.load_manifest(b.sync_digest)["files"]}
        except ValueError:
            old = new = {}
        files = {"added": sorted(set(new) - set(old)), "removed": sorted(set(old) - set(new)),
                 "changed": sorted(p for p in set(old) & set(new) if old[p] != new[p])}  # fmt: skip
        diff = _text_diff([(p, old[p], new[p]) for p in files["changed"]])
    else:
        diff = ""

    def first(code: JobCode | None) -> dict[str, str]:
        listing = next(iter(code.packages.values()), []) if code and code.packages else []
        return dict(p.split("==", 1) if "==" in p else (p, "") for p in listing)

    pa, pb = first(a), first(b)
    packages = [f"+ {n}=={pb[n]}" for n in sorted(set(pb) - set(pa))]
    packages += [f"- {n}=={pa[n]}" for n in sorted(set(pa) - set(pb))]
    packages += [f"{n} {pa[n]} -> {pb[n]}" for n in sorted(set(pa) & set(pb)) if pa[n] != pb[n]]
    return {"base": base.name, "other": other.name, "files": files, "packages": packages, "diff": diff}


DIFF_FILE_MAX = 256 * 1024  # a changed file bigger than this is named, not diffed
DIFF_MAX = 128 * 1024  # the whole diff shown on the compare page


def _text_diff(changed: list[tuple[str, str, str]]) -> str:
    """A unified diff of the changed text files of two snapshots, from the controller's store (both versions
    are there); binary or big files are named instead."""
    out: list[str] = []
    size = 0
    for path, old_sha, new_sha in changed:
        try:
            before, after = sync.object_bytes(old_sha, DIFF_FILE_MAX), sync.object_bytes(new_sha, DIFF_FILE_MAX)
            lines = difflib.unified_diff(before.decode().splitlines(True), after.decode().splitlines(True),
                                         f"a/{path}", f"b/{path}")  # fmt: skip
            text = "".join(lines)
        except (OSError, ValueError):  # too big, binary (not UTF-8) or no longer in the store
            text = f"Binary or large file {path} differs\n"
        if size + len(text) > DIFF_MAX:
            out.append(f"... (diff cut at {DIFF_MAX // 1024} KB)\n")
            break
        out.append(text)
        size += len(text)
    return "".join(out)


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
    if job.started_at:
        out.append(f"  energy{'' if job.is_ended else ' so far'} {job_energy(job).text()}")
    out.extend(f"  {line}" for line in probe_lines(probe_record(job)))
    if advice := network_advice(job):
        out.append(f"  network: {advice}")
    out.extend(code_lines(job))
    if kept := retention_text(job):
        out.append(f"  {kept}")
    if job.failure_reason:
        out.append("  reason: " + job.failure_reason.replace("\n", "\n  "))
    if job.state == Job.State.QUEUED and job.wait_nodes:
        out.append(f"  waiting: {waiting_text(job)}")
    return out


def waiting_text(job: Job) -> str:
    """Why a queued retry after a lost node has not started: the nodes it waits for."""
    names = list(job.wait_nodes)
    return f"for node{'s' if len(names) > 1 else ''} {', '.join(names)} to come back (a retry after a lost node)"


def attempt_marks(job: Job) -> list[dict]:
    """Where each later attempt joined the job's curve (`{"attempt", "step"}`): the charts mark them."""
    return [
        {"attempt": n, "step": step or 0}
        for n, step in job.attempts.filter(number__gt=1).order_by("number").values_list("number", "from_step")
    ]


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
    loss = final_loss(job.pk)
    if loss is not None:
        at = f" at step {loss.step}" if loss.step is not None else ""
        out.append(f"  final loss: {loss.text}{at} (last loss logged by rank {loss.rank})")
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
        note = f"  ({c.keep_reason})" if c.removed_at or c.keep_reason.startswith(("freeing", "left")) else note
        out.append(f"    {step:>8} {c.node.name[:12]:12} {c.size / 1e6:>7.1f} MB {age(c.mtime):>9}  {c.path}{note}")
    for a in job.earlier_attempts:
        out.append(
            f"  attempt {a.number}: {a.state}{' ' + a.failure_kind if a.failure_kind else ''} at step "
            f"{a.last_step if a.last_step is not None else '-'} (from step {a.from_step or 0}) on "
            f"{','.join(a.nodes) or '-'}; then {a.next_reason}"
            + (f"; energy {attempt_energy(a).text()}" if a.started_at else "")
        )
    if job.attempt > 1 or job.recovery_note:
        out.append(f"  attempt {job.attempt}: {job.state}" + (f"; {job.recovery_note}" if job.recovery_note else ""))
    return out


def results_record(job: Job) -> dict:
    """What `results` shows, as JSON: `job_record` and the results."""
    cfg = job.job_dir / "config.json"
    metrics = job.job_dir / "metrics.jsonl"
    loss = final_loss(job.pk)
    return {
        **job_record(job),
        "config": str(cfg) if cfg.exists() else None,
        "logs": {str(r.index): str(r.local_log) for r in job.ranks.order_by("index")},
        "metrics_file": str(metrics) if metrics.exists() else None,
        # one definition everywhere: the last loss rank 0 logged
        "final_loss": None if loss is None else {"rank": loss.rank, "value": loss.value, "step": loss.step},
        "final_metrics": [
            {"name": m.name, "rank": m.rank, "value": m.value, "step": m.step}
            for m in job.final_metrics.order_by("rank", "name")
        ],
        "checkpoints": [
            {
                "node": c.node.name,
                "path": c.path,
                "bytes": c.size,
                "step": c.step,
                "complete": c.ready,
                "kept": c.keep_reason or None,
                "removed_at": _when(c.removed_at),
            }
            for c in checkpoints(job)
        ],
        "attempts": [
            {
                "attempt": a.number,
                "state": a.state,
                "failure_kind": a.failure_kind or None,
                "from_step": a.from_step,
                "last_step": a.last_step,
                "nodes": a.nodes,
                "then": a.next_reason,
            }
            for a in job.earlier_attempts
        ],
    }


def asks_text(job: Job) -> str:
    """What a job asks for, in a few words: 2 GPUs, 2x4 GPUs, 3 nodes, node1+node2; VRAM and time limit."""
    if job.gpus:
        what = f"{job.gpus} GPU{'s' if job.gpus > 1 else ''}"
    elif job.nodes_asked:
        what = "+".join(job.nodes_asked) + (f" x{job.gpus_per_node} GPUs" if job.gpus_per_node else "")
    elif job.gpus_per_node:
        what = f"{job.count_asked or 1}x{job.gpus_per_node} GPUs"
    else:
        what = f"{job.count_asked or 1} node{'s' if (job.count_asked or 1) > 1 else ''}"
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
            est = "unknown" if e.est_start is None else _eta_text(e.est_start, now)
        rows.append(f"{d.position:>3} {job.name[:24]:24} {job.priority:>4} {owner[:10]:10} {asks_text(job)[:18]:18} "
                    f"{reason:11} {est:16} {detail}")  # fmt: skip
    if holders:
        rows.append("")
        rows.append("holding GPUs:")
        for name, gpus in holders.items():
            rows.append(f"    {name[:24]:24} {' '.join(gpus)}")
    return rows


def _eta_text(at, now) -> str:
    local = timezone.localtime(at)
    seconds = int((at - now).total_seconds())
    if seconds < 1:
        return "now"
    fmt = "%H:%M" if local.date() == timezone.localtime(now).date() else "%m-%d %H:%M"
    minutes = seconds // 60
    left = f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m" if minutes else f"{seconds}s"
    return f"in {left} ({local.strftime(fmt)})"
