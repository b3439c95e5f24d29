"""A job's limits as the user writes them (--time-limit 2h, --min-vram 10G) and the VRAM learned from
earlier runs (the health monitor's per-GPU memory readings while they ran)."""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable

from django.db.models import Count, F, Window
from django.db.models.functions import RowNumber

from cluster.models import HealthSample

from .models import Job

_DURATION = re.compile(r"(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?")
_CLOCK = re.compile(r"(?:(\d+)-)?(\d+):(\d{1,2})(?::(\d{1,2}))?")  # Slurm's [D-]H:MM[:SS]
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?", re.IGNORECASE)
_SIZE_MB = {"": 1024, "b": 1 / 2**20, "k": 1 / 1024, "m": 1, "g": 1024, "t": 1024**2}
LEARNED_MARGIN = 1.05  # a learned need is the peak seen plus 5 %


def parse_duration(text: str) -> int:
    """Seconds from "2h", "90m", "1h30m", "45s", "1d", "2:00:00" or "1-12:00"; ValueError otherwise."""
    value = (text or "").strip().lower()
    if value.isdigit():
        raise ValueError(f"time limit {text!r} needs a unit: 90m, 2h, 1d or H:MM:SS")
    m = _CLOCK.fullmatch(value)
    if m:
        d, h, mi, s = (int(x) if x else 0 for x in m.groups())
        seconds = ((d * 24 + h) * 60 + mi) * 60 + s
    else:
        m = _DURATION.fullmatch(value)
        if not value or not m:
            raise ValueError(f"time limit {text!r} is not a duration like 90m, 2h, 1d or H:MM:SS")
        d, h, mi, s = (int(x) if x else 0 for x in m.groups())
        seconds = ((d * 24 + h) * 60 + mi) * 60 + s
    if seconds < 1:
        raise ValueError(f"time limit {text!r} must be at least 1s")
    return seconds


def parse_size_mb(text: str) -> int:
    """MiB from "10G", "10GB", "512M", "10" (GB); ValueError otherwise."""
    m = _SIZE.fullmatch((text or "").strip())
    if not m:
        raise ValueError(f"VRAM {text!r} is not a size like 10G or 512M")
    unit = (m.group(2) or "").lower()[:1]
    mb = float(m.group(1)) * _SIZE_MB[unit]
    if mb < 1:
        raise ValueError(f"VRAM {text!r} must be at least 1M")
    return round(mb)


def peak_vram_mb(job: Job) -> float | None:
    """The most memory any of the job's GPUs used while it ran, by the health monitor's readings."""
    if not job.running_at:
        return None
    peak = None
    held: dict[int, set[int]] = {}
    for node_id, index in job.allocations.values_list("node_id", "gpu_index"):
        if index >= 0:
            held.setdefault(node_id, set()).add(index)
    if not held:
        return None
    samples = HealthSample.objects.filter(
        node_id__in=list(held), kind=HealthSample.Kind.RAW, ok=True, time__gte=job.running_at
    )
    if job.finished_at:
        samples = samples.filter(time__lte=job.finished_at)
    for node_id, gpus in samples.values_list("node_id", "gpus").iterator():
        for pos, gpu in enumerate(gpus or []):
            if not isinstance(gpu, dict) or gpu.get("index", pos) not in held[node_id]:
                continue
            used = gpu.get("mem_used_mb")
            if isinstance(used, int | float) and (peak is None or used > peak):
                peak = float(used)
    return peak


def learned_vram(script: str, previous: Job | None = None) -> tuple[int, str] | None:
    """(MiB, where from) for a job that names no --min-vram: the peak of its previous attempt, else of
    the latest run of the same script that ran long enough to be sampled; None when nothing is known."""
    candidates = [previous] if previous is not None else []
    candidates += list(
        Job.objects.filter(script=script, current__running_at__isnull=False)
        .exclude(allocations=None)
        .order_by("-current__running_at")[:3]
    )
    for job in candidates:
        peak = peak_vram_mb(job)
        if peak:
            return round(peak * LEARNED_MARGIN), f"learned: peak {peak / 1024:.1f} GB of job {job.name}"
    return None


SPEED_WARMUP_STEPS = 5  # the first steps (compilation, caches) say little about a GPU's speed


def learned_speeds(script: str, nodes: list) -> dict[str, float]:
    """Per node: its GPUs' speed (median tokens/s per worker) in the latest run of the script that ran on
    that node alone (in a multi-node run every rank steps at the slowest one's pace: it says nothing of
    a GPU's own speed). Nodes with no such run get the mean of the others; {} when none has one."""
    speeds: dict[str, float] = {}
    for node in nodes:
        solo = (
            Job.objects.filter(script=script, current__running_at__isnull=False, current__ranks__node=node)
            .annotate(n=Count("current__ranks"))
            .filter(n=1)
            .order_by("-current__running_at")
            .first()
        )
        if solo is None:
            continue
        rates = sorted(
            solo.metric_points.filter(name="tokens_per_sec", step__gt=SPEED_WARMUP_STEPS).values_list(
                "value", flat=True
            )[:1000]
        )
        if rates:
            speeds[node.name] = rates[len(rates) // 2]
    if speeds:
        mean = sum(speeds.values()) / len(speeds)
        speeds = {n.name: speeds.get(n.name, mean) for n in nodes}
    return speeds


RUNS_FOR_ESTIMATE = 5  # the latest few: a script's run time drifts as it is edited


def typical_durations(scripts: Iterable[str]) -> dict[str, float]:
    """Per script: the median run (started to finished, seconds) of its latest successful runs, in one
    query. The queue's estimate for a job with no time limit of its own; scripts never run to success
    are left out (their jobs' ends are unknown)."""
    scripts = set(scripts)
    if not scripts:
        return {}
    latest = (
        Job.objects.filter(
            script__in=scripts,
            state=Job.State.SUCCEEDED,
            current__started_at__isnull=False,
            current__finished_at__isnull=False,
        )
        .annotate(nth=Window(RowNumber(), partition_by=F("script"), order_by=F("current__finished_at").desc()))
        .filter(nth__lte=RUNS_FOR_ESTIMATE)
        .values_list("script", "current__started_at", "current__finished_at")
    )
    runs: dict[str, list[float]] = {}
    for script, started, finished in latest:
        runs.setdefault(script, []).append((finished - started).total_seconds())
    return {script: statistics.median(seconds) for script, seconds in runs.items()}
