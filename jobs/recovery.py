"""Recovery: resume a failed or cancelled job as its next attempt, retry by policy, notice a hung job.

- `resume()`: what `ugro resume` and the job page's Resume button call. Picks a complete checkpoint
  (jobs/checkpoints.py), and asks jobs/lifecycle.py to requeue the job as attempt N+1; the launch copies
  the checkpoint to rank 0's node when it lives elsewhere.
- `decide()`: the retry policy, applied by the retries loop (jobs/loops/retries.py). A FAILED job whose
  failure kind is in its retry list is resumed from its latest complete checkpoint after an exponential
  backoff, unless it used up its attempts or failed twice in a row at the same step (a crash loop). An OOM
  is retried only with a batch template (half the batch, twice the accumulation); otherwise the resume is
  proposed to a person. After a lost node, the retry runs on the remaining nodes when --min-nodes allows;
  otherwise it is queued at once, waiting for the node (`wait_nodes`, queue reason "node"), and the retries
  loop lets it start once the node answers again and the job's leftovers there are stopped.
- `check_hang()`: run by the running loop (jobs/loops/running.py) on RUNNING jobs. No metric line for longer than
  max(HANG_FACTOR x the median interval between lines, the job's hang limit) -> an alert, a stack dump of
  every rank, then the job fails as HANG (and the retry policy applies).

docs/recovery.md says all this for users.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import Counter
from datetime import timedelta

from django.db import connection
from django.utils import timezone

from cluster.alerts import open_alert
from cluster.fanout import node_request, on_each
from cluster.models import Alert, HealthSample, Node
from cluster.names import check_name
from metrics.models import MetricPoint
from metrics.rollup import INT8_MAX

from . import checkpoints, follow, lifecycle
from .failure import Failure, FailureKind
from .logs import tail_lines
from .models import Job, Rank

log = logging.getLogger(__name__)

# What people type after --retry, and the failure kind each names.
RETRY_KINDS = {
    "node-lost": FailureKind.NODE_LOST,
    "rendezvous": FailureKind.RENDEZVOUS,
    "oom": FailureKind.OOM,
    "script-error": FailureKind.SCRIPT_ERROR,
    "hang": FailureKind.HANG,
    "nccl": FailureKind.NCCL,
    "killed": FailureKind.KILLED,
    "timeout": FailureKind.TIMEOUT,
    "unknown": FailureKind.UNKNOWN,
}
# The retry policy when a job names none: retry nothing, so a person sees a failure before anything reruns.
RETRY_ON: tuple[str, ...] = ()
MAX_ATTEMPTS = 3  # a job's attempts when it names none: a flaky node gets two more chances, a broken script few
RETRY_BACKOFF_S = 10.0  # before the first retry: a rebooting node or a freed port has time to come back
RETRY_BACKOFF_MAX_S = 600.0  # the doubling backoff stops here: a retry still comes within minutes
# Hang detection: silent for HANG_FACTOR x the median interval between metric lines, and at least HANG_MIN_S
HANG_MIN_S = 60.0  # (a job's --hang-after overrides it): a checkpoint save or an eval pass is not a hang
HANG_FACTOR = 5.0  # a step now and then several times slower (data loading, GC) is not a hang
HANG_STARTUP_S = 600.0  # before an attempt's first line: imports, rendezvous and loading a checkpoint take long
HANG_SAMPLE_POINTS = 64  # the median line interval is taken over this many recent points


class RecoveryError(ValueError):
    """A resume that cannot be done; the one-line message says why. Nothing was changed."""


def parse_retry(text: str | list[str]) -> list[str]:
    """`node-lost,oom` -> ["NODE_LOST", "OOM"]; RecoveryError naming an unknown kind."""
    items = text if isinstance(text, list) else [t for t in text.split(",")]
    kinds = []
    for item in (i.strip().lower() for i in items):
        if not item:
            continue
        kind = RETRY_KINDS.get(item) or RETRY_KINDS.get(item.replace("_", "-"))
        if kind is None:
            raise RecoveryError(f"unknown failure kind {item!r} for --retry (known: {', '.join(RETRY_KINDS)})")
        if kind.value not in kinds:
            kinds.append(kind.value)
    return kinds


def retry_names(kinds: list[str]) -> list[str]:
    """["NODE_LOST"] -> ["node-lost"]: what --retry takes."""
    names = {kind.value: name for name, kind in RETRY_KINDS.items()}
    return [names[k] for k in kinds if k in names]


def check_batch_template(template: str, batch: int | None, accum: int | None) -> dict:
    """The job's batch values for a batch template; RecoveryError for a template without {batch}."""
    if not template:
        return {}
    if "{batch}" not in template:
        raise RecoveryError("--batch-template must contain {batch} (and may contain {accum})")
    if batch is None or batch < 1:
        raise RecoveryError("--batch-template needs --batch N (the per-rank batch size, at least 1)")
    if accum is not None and accum < 1:
        raise RecoveryError("--grad-accum must be at least 1")
    return {"batch": batch, "accum": accum or 1}


# -- a person's resume ------------------------------------------------------------------------------


def resume(job: Job, wanted: str | None = "latest", nodes: list[str] | None = None, who: str = "") -> Job:
    """Requeue a FAILED or CANCELLED job as its next attempt from a checkpoint (`wanted`: a step, `latest`,
    or `scratch`), optionally on other nodes. Raises RecoveryError with a one-line reason."""
    job.refresh_from_db()
    if job.state not in lifecycle.RESUMABLE_STATES:
        raise RecoveryError(f"job {job.name} is {job.state}: only a failed or cancelled job can be resumed")
    if nodes:
        for name in nodes:
            try:
                check_name(name, "node name")
            except ValueError as exc:
                raise RecoveryError(str(exc)) from None
        if len(set(nodes)) != len(nodes):
            raise RecoveryError("a node is named twice")
        enabled = set(Node.objects.filter(enabled=True, name__in=nodes).values_list("name", flat=True))
        missing = [n for n in nodes if n not in enabled]
        if missing:
            raise RecoveryError(f"node {missing[0]!r} is not an enabled node of the cluster")
    if wanted == "scratch":
        ckpt, path, where = None, "", "from scratch"
    else:
        try:
            ckpt = checkpoints.choose(job, wanted)
        except ValueError as exc:
            raise RecoveryError(str(exc)) from None
        path = checkpoints.path_for_rank0(ckpt)
        where = f"from step {ckpt.step} ({ckpt.node.name}:{ckpt.path})"
    reason = f"attempt {job.attempt + 1} resumed {where}" + (f" by {who}" if who else "")
    if not lifecycle.requeue(
        job, lifecycle.NextAttempt(reason=reason, checkpoint=ckpt, resume_path=path, nodes=nodes or None)
    ):
        raise RecoveryError(f"job {job.name} is {job.state}: only a failed or cancelled job can be resumed")
    return job


# -- the retry policy -------------------------------------------------------------------------------


def policy(job: Job) -> tuple[list[str], int]:
    """(failure kinds retried, most attempts) for the job: its own, else the cluster default."""
    kinds = list(job.retry_on or [])
    if not kinds and RETRY_ON:
        kinds = parse_retry(list(RETRY_ON))
    return kinds, int(job.max_attempts or MAX_ATTEMPTS)


def backoff_s(attempt: int) -> float:
    """Seconds before attempt `attempt + 1` starts: base x 2^(attempt - 1), capped."""
    return min(RETRY_BACKOFF_S * 2 ** max(0, attempt - 1), RETRY_BACKOFF_MAX_S)


def last_step(job: Job, attempt: int) -> int | None:
    points = MetricPoint.objects.filter(job=job, attempt=attempt, step__isnull=False)
    return points.order_by("-step").values_list("step", flat=True).first()


def decide(job: Job) -> tuple[lifecycle.NextAttempt | None, str]:
    """What the policy does about a FAILED job: (the next attempt, note) or (None, why not)."""
    kinds, most = policy(job)
    kind = job.failure_kind
    where = f" ({kind}" + (f" on {job.failure_node}" if job.failure_node else "") + ")"
    if kind not in kinds:
        return None, _proposal(job, f"not retried: {kind or 'the failure'} is not in the job's retry list")
    if job.attempt >= most:
        return None, _proposal(job, f"not retried: gave up after {job.attempt} attempts{where}")
    step = last_step(job, job.attempt)
    prev = job.attempts.filter(number=job.attempt - 1).first()
    if prev is not None and prev.state == Job.State.FAILED and step is not None and prev.last_step == step:
        return None, _proposal(
            job, f"not retried: crash loop, attempts {prev.number} and {job.attempt} both failed at step {step}"
        )
    batch = None
    if kind == FailureKind.OOM.value:
        b = job.current.batch or {}
        if not (job.batch_template and int(b.get("batch") or 0) > 1):
            return None, _oom_proposal(job)
        batch = {"batch": int(b["batch"]) // 2, "accum": int(b.get("accum") or 1) * 2}
    nodes = None
    wait: list[str] = []
    ready = checkpoints.offered(job)
    if kind == FailureKind.NODE_LOST.value:
        prev_nodes = list(job.ranks.order_by("index").values_list("node__name", flat=True))
        lost = set(job.ranks.filter(state=Rank.State.LOST).values_list("node__name", flat=True))
        down = set(Node.objects.filter(status=Node.Status.DOWN).values_list("name", flat=True))
        gone = lost | (down & set(prev_nodes)) | ({job.failure_node} if job.failure_node else set())
        remaining = [n for n in prev_nodes if n not in gone]
        reachable = [c for c in ready if c.node.name not in gone | down]
        # go on without the node only from a checkpoint that is not on it (else wait for it to come back)
        if job.min_nodes and remaining and len(remaining) >= job.min_nodes and (reachable or not ready):
            nodes, ready = remaining, reachable
        else:  # queued, waiting for them: the scheduler starts it only once they answer again
            wait = [n for n in prev_nodes if n in gone] or ([job.failure_node] if job.failure_node else [])
            ready = [c for c in ready if c.node.name not in down or c.node.name in wait]  # held where it will be
    ckpt = ready[0] if ready else None
    pause = backoff_s(job.attempt)
    what = f"from step {ckpt.step}" if ckpt else "from scratch (no complete checkpoint)"
    extra = ""
    if batch:
        extra += f", batch {batch['batch']} x accum {batch['accum']}"
    if nodes:
        extra += f", on {', '.join(nodes)} (without {job.failure_node})"
    elif wait:
        extra += f", once {', '.join(wait)} {'is' if len(wait) == 1 else 'are'} back"
    note = f"retry: attempt {job.attempt + 1} of {most} {what}{extra}{where}, after {pause:g}s"
    nxt = lifecycle.NextAttempt(
        reason=note, checkpoint=ckpt, resume_path=checkpoints.path_for_rank0(ckpt) if ckpt else "", nodes=nodes,
        batch=batch, retry_at=timezone.now() + timedelta(seconds=pause), wait_nodes=wait,
    )  # fmt: skip
    return nxt, note


def _proposal(job: Job, why: str) -> str:
    ready = checkpoints.offered(job)
    if ready:
        return f"{why}; to resume from step {ready[0].step}: ugro resume {job.name}"
    return f"{why}; no complete checkpoint to resume from"


def _oom_proposal(job: Job) -> str:
    node = Node.objects.filter(name=job.failure_node).first()
    vram = f"{node.gpu_vram_gb:g} GB VRAM" if node and node.gpu_vram_gb else "VRAM unknown"
    line = (job.failure_line or "").strip()[:300]
    why = f"not retried: OOM on {job.failure_node or '?'} ({vram}): {line}"
    if not job.batch_template:
        why += " (set --batch-template to retry with a smaller batch)"
    return _proposal(job, why)


# -- hangs ------------------------------------------------------------------------------------------


def _points_sql(sql: str, params: list) -> list[tuple]:
    """Rows of a query on the metric points' table, named {points} in it."""
    with connection.cursor() as cursor:
        cursor.execute(sql.format(points=connection.ops.quote_name(MetricPoint._meta.db_table)), params)
        return cursor.fetchall()


def _newest_points(job: Job) -> list[tuple[int, str, object]]:
    """(rank, name, time) of the job's newest points of its attempt, newest first.

    Read backwards along the (job, id) index from the job's end, as rollup._after_mark reads: the row
    comparison and the ORDER BY leave the planner no other plan, with or without statistics (a growing
    table's lag behind; with plain filters PostgreSQL may sort every point of the job, on every check of
    every running job)."""
    return _points_sql(
        "SELECT rank, name, time FROM (SELECT job_id, attempt, rank, name, time FROM {points}"
        " WHERE (job_id, id) <= (%s, %s) ORDER BY job_id DESC, id DESC LIMIT %s) AS newest"
        " WHERE job_id = %s AND attempt = %s",
        [job.pk, INT8_MAX, HANG_SAMPLE_POINTS, job.pk, job.attempt],
    )


def _series_times(job: Job, rank: int, name: str) -> list:
    """Times of one series' points at its greatest steps (a rank's loss): backwards along the (job, name, step)
    index, as _newest_points reads (the other ranks' points of the name among them are read and skipped)."""
    rows = _points_sql(
        "SELECT time FROM (SELECT job_id, name, attempt, rank, time FROM {points}"
        " WHERE (job_id, name, step) <= (%s, %s, %s) ORDER BY job_id DESC, name DESC, step DESC LIMIT %s)"
        " AS newest WHERE job_id = %s AND name = %s AND attempt = %s AND rank = %s LIMIT %s",
        [job.pk, name, INT8_MAX, HANG_SAMPLE_POINTS * 8, job.pk, name, job.attempt, rank, HANG_SAMPLE_POINTS],
    )
    return [when for (when,) in rows]


def hang_limit(job: Job, newest: list | None = None) -> tuple[float, float | None]:
    """(seconds of silence that make the job HUNG, the median interval between its metric lines).

    The interval is measured on the series the job logs most often among its newest points (a rank's
    loss, say, rather than an eval metric logged once an epoch); newest: _newest_points(job), if read."""
    floor = job.hang_after_s if job.hang_after_s else HANG_MIN_S
    newest = _newest_points(job) if newest is None else newest
    median = None
    if newest:
        counts = Counter((rank, name) for rank, name, _ in newest)
        rank, name = min(counts, key=lambda key: (-counts[key], key))
        times = _series_times(job, rank, name)
        gaps = [(a - b).total_seconds() for a, b in zip(times, times[1:], strict=False)]
        gaps = [g for g in gaps if g > 0]
        if gaps:
            median = statistics.median(gaps)
    limit = max(HANG_FACTOR * (median or 0.0), floor)
    return limit, median


def check_hang(job: Job) -> bool:
    """Fail a RUNNING job that stopped printing metric lines (kind HANG) after an alert and a stack dump of
    every rank; True if this call did. Judged only while a follower is copying its logs (otherwise
    silence here says nothing about the job)."""
    if job.state != Job.State.RUNNING or not job.running_at:
        return False
    now = timezone.now()
    ranks = list(job.ranks.select_related("node").order_by("index"))
    if not ranks or any(r.state != "running" for r in ranks):
        return False  # a rank ended or was lost: judge() explains that
    lease = follow.FOLLOW_LEASE_S
    contacts = [r.last_contact for r in ranks if r.last_contact]
    if len(contacts) < len(ranks) or (now - min(contacts)).total_seconds() > 2 * lease:
        return False  # nobody has copied its logs lately: cannot tell a hang from an absent follower
    newest = _newest_points(job)
    since = max((when for _, _, when in newest), default=None)  # the last point stored
    limit, median = hang_limit(job, newest)
    if since is None:  # start-up (imports, rendezvous, loading a checkpoint) gets its own, longer allowance
        since = job.running_at
        limit = max(limit, HANG_STARTUP_S)
    silent = (now - since).total_seconds()
    if silent <= limit:
        return False
    step = last_step(job, job.attempt)
    how = f"median {median:.2f}s between lines" if median else "one metric line so far"
    message = (
        f"job {job.name} HUNG: no metric line for {silent:.0f}s (limit {limit:g}s, {how}), "
        f"last step {step if step is not None else '-'}"
    )
    open_alert(None, f"hung:{job.name}", Alert.Severity.CRITICAL, message, job_name=job.name)
    dumped = dump_stacks(job, ranks)
    line = f"no metric line for {silent:.0f}s (limit {limit:g}s) at step {step if step is not None else '-'}; {dumped}"
    failure = Failure(kind=FailureKind.HANG, rank=None, node=None, exit_code=None, signal=None, line=line)
    return lifecycle.fail(job, failure)


def dump_stacks(job: Job, ranks: list, settle_s: float = 2.0) -> str:
    """Every rank's stacks into the job's logs: py-spy's dumps into logs/stacks_attempt<N>.txt, and the
    faulthandler's (SIGUSR1) into the ranks' own output, given `settle_s` to be written. One line back."""
    answers = on_each(ranks, lambda r: node_request(r.node, "dump_stacks", timeout=30, tag=job.tag, node=r.node.name))
    path = job.logs_dir / f"stacks_attempt{job.attempt}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    counts = {"py-spy": 0, "SIGUSR1": 0}
    failed = []
    with open(path, "a") as fh:
        fh.write(f"== stack dump of job {job.name} attempt {job.attempt} at {timezone.now().isoformat()}\n")
        for rank, result, err in answers:
            if err is not None:
                failed.append(rank.node.name)
                fh.write(f"-- rank {rank.index} on {rank.node.name}: no answer: {err}\n")
                continue
            for d in result["dumps"]:
                counts[d["how"]] = counts.get(d["how"], 0) + 1
                fh.write(f"-- rank {rank.index} on {rank.node.name}, pid {d['pid']} ({d['how']})\n{d['text']}\n")
    if counts.get("SIGUSR1"):
        time.sleep(settle_s)  # faulthandler writes at once; the follower copies it with the rest
    parts = [f"{n} by {how}" for how, n in counts.items() if n]
    said = f"stacks dumped ({', '.join(parts)}; {path.name} and the rank logs)" if parts else "no stacks dumped"
    if failed:
        said += f"; no answer from {', '.join(failed)}"
    return said


# -- stragglers -------------------------------------------------------------------------------------

STRAGGLER_METRIC = "compute_s"  # the reference script's per-rank time per step, waiting excluded
STRAGGLER_RATIO = 1.33  # a rank a third slower than the median holds every other rank back by as much
STRAGGLER_WINDOWS = 3  # windows in a row: one slow step (a checkpoint, a GC pause) is no straggler
GPU_SKEW_POINTS = 30.0  # fallback: a node this many utilisation points above the others' median


def _gpu_util(node_id: int) -> float | None:
    return (
        HealthSample.objects.filter(node_id=node_id, kind=HealthSample.Kind.RAW, gpu_util_percent__isnull=False)
        .order_by("-time")
        .values_list("gpu_util_percent", flat=True)
        .first()
    )


def _node_of(job: Job, global_rank: int) -> Rank | None:
    """The rank (node) whose log carries global rank `global_rank`'s metric lines (ranks follow join order
    under c10d, so the node is read from the lines, not assumed)."""
    marker = f'"rank": {global_rank},'
    ranks = list(job.ranks.select_related("node").order_by("index"))
    for r in ranks:
        if any(marker in line for line in tail_lines(r, 100)):
            return r
    return ranks[global_rank] if 0 <= global_rank < len(ranks) else None


def stragglers(job: Job) -> list[dict]:
    """Ranks slower than STRAGGLER_RATIO x the median rank in each of the last STRAGGLER_WINDOWS windows
    (a window: one metric line's interval), from the per-rank step time the script prints; when it prints
    none, nodes whose GPU utilisation stands GPU_SKEW_POINTS above the others'. Reads the DB only."""
    ratio_max, windows = STRAGGLER_RATIO, STRAGGLER_WINDOWS
    points = MetricPoint.objects.filter(job=job, attempt=job.attempt, name=STRAGGLER_METRIC, superseded=False)
    steps = list(points.order_by("-step").values_list("step", flat=True).distinct()[: windows + 1])
    by_step: dict[int, dict[int, float]] = {}
    for rank, step, value in points.filter(step__in=steps).values_list("rank", "step", "value"):
        by_step.setdefault(step, {})[rank] = value
    full = [s for s in sorted(by_step, reverse=True) if len(by_step[s]) >= 2]
    if not full:
        return _gpu_skew(job)
    width = max(len(by_step[s]) for s in full)
    full = [s for s in full if len(by_step[s]) == width][:windows]
    if len(full) < windows:
        return []
    slow: dict[int, list[float]] = {}
    for s in full:
        values = by_step[s]
        median = statistics.median(values.values())
        for rank, value in values.items():
            if median > 0 and value / median > ratio_max:
                slow.setdefault(rank, []).append(value / median)
    out = []
    for rank, ratios in sorted(slow.items()):
        if len(ratios) < windows:
            continue
        holder = _node_of(job, rank)
        node = holder.node if holder else None
        util = _gpu_util(node.pk) if node else None
        where = f" on {node.name}" if node else ""
        gpu = f", GPU util {util:.0f}%" if util is not None else ""
        out.append({
            "rank": rank, "node": node, "ratio": min(ratios),
            "message": f"rank {rank}{where} is a straggler: {min(ratios):.2f}x-{max(ratios):.2f}x the median rank's "
                       f"{STRAGGLER_METRIC} over the last {windows} windows (to step {full[0]}){gpu}",
        })  # fmt: skip
    return out


def _gpu_skew(job: Job) -> list[dict]:
    """Fallback without step times: a node whose GPU is much busier than the others' (they wait for it)."""
    ranks = list(job.ranks.select_related("node").order_by("index"))
    utils = {r.node: _gpu_util(r.node_id) for r in ranks}
    known = {n: u for n, u in utils.items() if u is not None}
    if len(known) < 2:
        return []
    median = statistics.median(known.values())
    out = []
    for node, util in known.items():
        others = [u for n, u in known.items() if n != node]
        if util - max(others) >= GPU_SKEW_POINTS:
            out.append({
                "rank": None, "node": node, "ratio": None,
                "message": f"{node.name} may be a straggler: GPU util {util:.0f}% while the others' median is "
                           f"{median:.0f}% (no per-rank step times: GPU utilisation skew)",
            })  # fmt: skip
    return out


def check_stragglers(job: Job) -> list[str]:
    """Alert (WARNING, on the node) for each straggler of a RUNNING job; the messages."""
    if job.state != Job.State.RUNNING:
        return []
    found = stragglers(job)
    for s in found:
        open_alert(s["node"], f"straggler:{job.name}", Alert.Severity.WARNING, f"job {job.name}: {s['message']}",
                   job_name=job.name)  # fmt: skip
    return [s["message"] for s in found]
