"""--scale-probe: will more nodes help? The job's own scaling measured before it runs, not guessed.

While the job is STARTING on the N nodes it was given (and after its code, data and environment are on them and
pre-flight passed), its first steps run on 1, 2, ... N of those nodes in turn, each count for a bounded time from
the same start, with its outputs in a scratch directory that is then left behind (never the job's checkpoints).
Each count's throughput comes from the job's own step lines: samples/s = steps/s x the global batch (every
rank's local batch), steps/s from when the step lines of the node that holds the lowest logging rank arrived (the
agent's long-poll tail hears a line within milliseconds). The job then runs on the fastest count (`choose`): the
first K nodes in rank order, the others freed (`lifecycle.shrink_starting`), unless it named its nodes (`--node`):
those are what was asked, and it runs on all of them with a warning that says how much faster fewer would be.

With `--batch-weights auto`, each node's share of the global batch comes from its ranks' measured time per sample
(the script's compute_s over its local batch) in the probe's largest count (`weights_from`).

Every probe rank carries the job's tag (UGRO_JOB), so a cancel or a teardown stops it like any rank of the job;
the probe checks the job is still STARTING between every read and stops its ranks itself when it is not.
Results (the table, the count chosen and why, the weights) are recorded on the attempt (Attempt.scale_probe):
`status`, the job page and the API show them (`summary_lines`). docs/scaling.md.
"""

from __future__ import annotations

import base64
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cluster.fanout import node_request, on_each
from cluster.links import AgentRequestError, LinkError
from metrics.parsing import LineParser

from .limits import parse_duration
from .models import Attempt, Job, Rank
from .stop import stop_tagged

log = logging.getLogger(__name__)

PROBE_MIN_S, PROBE_MAX_S = 2, 600  # per node count
FIRST_STEP_WAIT_S = 180.0  # a count's first step line within max(this, its time) (a model loads first), or it fails
WARMUP_LINES = 1  # the first step line of each count (start-up, first-step caches) is not measured
MIN_MEASURED_LINES = 2  # step lines after the warm-up, at least, for a rate
TIE = 0.02  # counts within 2 % of the fastest are as fast: the fewest of them runs, the rest of the nodes freed
TAIL_WAIT_MS = 1000
STOP_GRACE_S = 2.0  # probe ranks save nothing worth waiting for
clock = time.monotonic  # when a line was read (tests drive their own)


def parse_probe(text: str) -> int | None:
    """Seconds per node count from "60s", "2m" (None for "", "off", "none"); ValueError in one line otherwise."""
    value = (text or "").strip().lower()
    if value in ("", "off", "none", "0"):
        return None
    try:
        seconds = parse_duration(value)
    except ValueError:
        raise ValueError(f"--scale-probe {text[:40]!r} is not a duration like 60s or 2m, or off") from None
    if not PROBE_MIN_S <= seconds <= PROBE_MAX_S:
        raise ValueError(f"--scale-probe must be from {PROBE_MIN_S}s to {PROBE_MAX_S // 60}m per node count")
    return seconds


def check_cluster_value(value: Any) -> None:
    """cluster.yaml's training.scale_probe: a duration per node count, or off; ValueError otherwise."""
    parse_probe(str(value))


def seconds_for(text: str, training: dict) -> int | None:
    """The probe's time per count for a launch: its own --scale-probe, else the cluster's training.scale_probe."""
    given = (text or "").strip()
    return parse_probe(given if given else str(training.get("scale_probe") or ""))


# -- measuring one count from its step lines (pure: tests feed recorded lines) ------------------------------


@dataclass
class StepLine:
    """One step line a probe rank logged: its step, its values, the worker that logged it, when it was seen."""

    step: int
    values: dict[str, float]
    worker: int | None
    seen: float  # time.monotonic() when the controller read it


@dataclass
class CountRun:
    """What one node count's run logged: step lines by node (rank order), and why it stopped early if it did."""

    nodes: list[str]
    workers: int  # processes in all (world size)
    local_batches: list[int | None]  # per node: each of its workers' batch
    workers_per_node: list[int]
    lines: dict[str, list[StepLine]] = field(default_factory=dict)
    problem: str = ""


def step_lines(parser: LineParser, text: str, seen: float) -> list[StepLine]:
    """The step lines among these output lines, each with its values (a line without a step is not one)."""
    out = []
    for line in text.splitlines():
        points = parser.feed(line)
        steps = {p.step for p in points if p.step is not None}
        if len(steps) != 1:
            continue
        worker = next((p.rank for p in points if p.rank is not None), None)
        out.append(StepLine(steps.pop(), {p.name: p.value for p in points}, worker, seen))
    return out


def _rate(lines: list[StepLine]) -> tuple[float, int] | None:
    """(steps/s, lines measured) from one worker's step lines after the warm-up, by when they were seen."""
    if not lines:
        return None
    worker = min((ln.worker for ln in lines if ln.worker is not None), default=None)
    mine = [ln for ln in lines if ln.worker == worker]
    first_seen: dict[int, float] = {}
    for ln in mine:
        first_seen.setdefault(ln.step, ln.seen)
    steps = sorted(first_seen)[WARMUP_LINES:]
    if len(steps) < MIN_MEASURED_LINES:
        return None
    span = first_seen[steps[-1]] - first_seen[steps[0]]
    if span <= 0:
        return None
    return (steps[-1] - steps[0]) / span, len(steps)


def _median_after_warmup(lines: list[StepLine], key: str) -> float | None:
    firsts: dict[int | None, int] = {}
    for ln in lines:
        firsts.setdefault(ln.worker, ln.step)
    values = [ln.values[key] for ln in lines if key in ln.values and ln.step > firsts[ln.worker]]
    return statistics.median(values) if values else None


def _timing_lines(run: CountRun) -> list[StepLine]:
    """The step lines that time the count: those of the node that holds the lowest global rank that logged (ranks
    follow join order under c10d: rank 0, often the only one that logs, may be on any node), else the most."""
    logged = {name: lines for name, lines in run.lines.items() if lines}
    if not logged:
        return []

    def key(name: str) -> tuple[int, int]:
        ranks = [ln.worker for ln in logged[name] if ln.worker is not None]
        return (min(ranks) if ranks else 1 << 30, -len(logged[name]))

    return logged[min(logged, key=key)]


def measure(run: CountRun) -> dict:
    """One row of the probe's table: nodes, steps/s, samples/s (the global batch x steps/s; with no batch known,
    per-rank batches x steps/s: `unit` says which), the compute/sync split where the script reports it, and each
    node's time per sample. `error` says why a count gave no rate."""
    row: dict[str, Any] = {"nodes": len(run.nodes), "workers": run.workers, "names": list(run.nodes)}
    first = _timing_lines(run)
    rate = _rate(first)
    if rate is None:
        row["error"] = run.problem or (
            "no step lines" if not first else f"too few step lines ({len(first)}) to measure a rate"
        )
        return row
    steps_per_s, measured = rate
    known = all(b is not None for b in run.local_batches)
    batch = sum(b * w for b, w in zip(run.local_batches, run.workers_per_node, strict=True)) if known else run.workers
    row.update(steps_per_s=round(steps_per_s, 4), samples_per_s=round(steps_per_s * batch, 3), measured_lines=measured,
               unit="samples" if known else "per-rank batches")  # fmt: skip
    compute, wait = _median_after_warmup(first, "compute_s"), _median_after_warmup(first, "sync_wait_s")
    if compute is not None and wait is not None:
        row["compute_s"], row["sync_wait_s"] = round(compute, 6), round(wait, 6)
    per_sample = {}
    for name, local in zip(run.nodes, run.local_batches, strict=True):
        node_compute = _median_after_warmup(run.lines.get(name, []), "compute_s")
        if node_compute is not None and local:
            per_sample[name] = node_compute / local
    if per_sample:
        row["per_sample_s"] = {k: round(v, 9) for k, v in per_sample.items()}
    return row


def with_efficiency(rows: list[dict]) -> list[dict]:
    """Each row's scaling efficiency: its samples/s over the one-node row's times its share of the workers."""
    one = next((r for r in rows if r["nodes"] == 1 and r.get("samples_per_s")), None)
    for r in rows:
        if one and r.get("samples_per_s"):
            r["efficiency"] = round(r["samples_per_s"] / (one["samples_per_s"] * r["workers"] / one["workers"]), 3)
    return rows


@dataclass
class Choice:
    """The node count a probe chose, and the one line that says why."""

    nodes: int
    line: str
    warning: bool = False


def waited(row: dict | None) -> str:
    """Why a larger count was slower, where the script reports its split (`compute_s`, `sync_wait_s`): the share of
    its step its ranks spent waiting in the gradient exchange ("" when not reported)."""
    compute, wait = (row or {}).get("compute_s"), (row or {}).get("sync_wait_s")
    if compute is None or wait is None or compute + wait <= 0:
        return ""
    return (f", where {100 * wait / (compute + wait):.0f} % of a step ({wait:.3f} s of {compute + wait:.3f} s) was "
            "waiting for the gradient exchange")  # fmt: skip


def choose(rows: list[dict], asked: int, forced: bool, floor: int = 1) -> Choice:
    """The count to run on: the fewest nodes within TIE of the fastest measured count, at least `floor`
    (--min-nodes). A job that named its nodes (forced) runs on all of them, with a warning when fewer measured
    faster. Rows without a rate are skipped; with none measured, all the nodes asked."""
    measured = [r for r in rows if r.get("samples_per_s")]
    if not measured:
        return Choice(asked, f"the probe measured no node count; runs on the {asked} nodes asked", warning=True)
    eligible = [r for r in measured if r["nodes"] >= floor] or measured
    best = max(eligible, key=lambda r: r["samples_per_s"])
    pick = min(
        (r for r in eligible if r["samples_per_s"] >= best["samples_per_s"] * (1 - TIE)), key=lambda r: r["nodes"]
    )
    unit = pick.get("unit", "samples")
    at_asked = next((r for r in measured if r["nodes"] == asked), None)
    if forced and pick["nodes"] < asked:
        if at_asked is None:
            there = "could not be measured"
        else:
            there = f"{at_asked['samples_per_s']:.1f} {unit}/s"
        return Choice(
            asked,
            f"fewer nodes would be faster: {pick['nodes']} measured {pick['samples_per_s']:.1f} {unit}/s, all "
            f"{asked} named nodes {there}{waited(at_asked)}; runs on the {asked} nodes named, as asked",
            warning=True,
        )
    if pick["nodes"] < asked:
        there = f"{at_asked['samples_per_s']:.1f} {unit}/s" if at_asked else "no rate"
        return Choice(pick["nodes"], f"runs on {pick['nodes']} of {asked} nodes: {pick['samples_per_s']:.1f} {unit}/s "
                      f"against {there} on all {asked}{waited(at_asked)}; the others are freed")  # fmt: skip
    return Choice(
        pick["nodes"], f"runs on all {asked} nodes: {pick['samples_per_s']:.1f} {unit}/s, the fastest measured"
    )


def weights_from(rows: list[dict], nodes: list[str]) -> dict[str, float]:
    """--batch-weights auto from the probe: each node's relative speed, 1 / its time per sample (compute_s over
    its local batch) in the largest count that measured it; a node not measured gets the mean of the others,
    {} when none was. Normalised so the slowest is 1."""
    seen: dict[str, float] = {}
    for row in sorted(rows, key=lambda r: r["nodes"]):
        for name, t in (row.get("per_sample_s") or {}).items():
            if t > 0:
                seen[name] = t
    if not seen:
        return {}
    speed = {n: 1.0 / t for n, t in seen.items()}
    mean = sum(speed.values()) / len(speed)
    speed = {n: speed.get(n, mean) for n in nodes}
    low = min(speed.values())
    return {n: round(v / low, 4) for n, v in speed.items()}


# -- running it on the nodes ------------------------------------------------------------------------------


@dataclass
class ProbeStart:
    """How one probe rank starts (made by jobs/launch.py, which knows the rank's command)."""

    argv: list[str]
    script_index: int
    env: dict[str, str]
    cwd: str
    workers: int
    local_batch: int | None


# (rank, node count, rendezvous id, scratch job dir) -> how it starts
StartBuilder = Callable[[Rank, int, str, str], ProbeStart]


def _paths(job: Job, rank: Rank, count: int) -> dict[str, str]:
    base = f"{rank.node.workdir.rstrip('/') or '/'}/.ugro/jobs/{job.tag}/probe_{count}"
    stem = f"{base}/rank_{rank.index}"
    return {"log": f"{stem}.log", "exit_file": f"{stem}.exit", "record": f"{stem}.start", "job_dir": f"{base}/job"}


def _starting(job: Job) -> bool:
    return Job.objects.filter(pk=job.pk, state=Job.State.STARTING).exists()


def record(job: Job, probe: dict) -> None:
    """The probe as it stands, on the job's current attempt (pages and status read it while it runs)."""
    Attempt.objects.filter(pk=job.current_id).update(scale_probe=probe)
    job.current.scale_probe = probe


def run_count(job: Job, ranks: list[Rank], count: int, seconds: float, build: StartBuilder) -> CountRun:
    """The job's first `count` ranks started for the probe, their step lines read for `seconds` after the first
    one arrived (at most max(FIRST_STEP_WAIT_S, seconds) for that), then stopped; what they logged."""
    sub = ranks[:count]
    rdzv_id = f"{job.tag}-probe{count}"
    paths = {r.pk: _paths(job, r, count) for r in sub}
    starts = {r.pk: build(r, count, rdzv_id, paths[r.pk]["job_dir"]) for r in sub}
    run = CountRun(nodes=[r.node.name for r in sub], workers=sum(s.workers for s in starts.values()),
                   local_batches=[starts[r.pk].local_batch for r in sub],
                   workers_per_node=[starts[r.pk].workers for r in sub])  # fmt: skip

    def start(rank: Rank) -> None:
        s, p = starts[rank.pk], paths[rank.pk]
        node_request(rank.node, "start", timeout=30, argv=s.argv, script_index=s.script_index, env=s.env, cwd=s.cwd,
                     log=p["log"], exit_file=p["exit_file"], key=f"{rdzv_id}:{rank.index}", record=p["record"],
                     mkdirs=[p["job_dir"]])  # fmt: skip

    try:
        failed = [f"rank {r.index} on {r.node.name}: {err}" for r, _, err in on_each(sub, start) if err]
        if failed:
            run.problem = "did not start: " + "; ".join(failed)
            return run
        parsers = {r.pk: LineParser() for r in sub}
        offsets = {r.pk: 0 for r in sub}
        partial = {r.pk: b"" for r in sub}
        exited: set[int] = set()
        until = clock() + max(FIRST_STEP_WAIT_S, seconds)
        measuring = False
        while clock() < until and len(exited) < len(sub):
            if not _starting(job):
                run.problem = "the job left STARTING"
                return run

            def tail(rank: Rank) -> tuple[dict, float]:
                p = paths[rank.pk]
                item = {"key": rank.pk, "path": p["log"], "offset": offsets[rank.pk], "exit_file": p["exit_file"]}
                answer = node_request(rank.node, "tail", timeout=TAIL_WAIT_MS / 1000 + 10, files=[item],
                                      wait_ms=TAIL_WAIT_MS)["files"][0]  # fmt: skip
                return answer, clock()  # timed here: another node's long poll must not delay this one's lines

            for rank, answer, err in on_each(sub, tail):
                if err or not answer:
                    continue
                item, seen = answer
                data = base64.b64decode(item["data"])
                offsets[rank.pk] += len(data)
                text, _, partial[rank.pk] = (partial[rank.pk] + data).rpartition(b"\n")
                if text:
                    lines = step_lines(parsers[rank.pk], text.decode("utf-8", "replace"), seen)
                    run.lines.setdefault(rank.node.name, []).extend(lines)
                if item.get("exit") and item.get("eof"):
                    exited.add(rank.pk)
            if not measuring and any(run.lines.values()):
                measuring = True  # the time per count starts at the first step line: start-up is not the job's pace
                until = min(until, clock() + seconds)
        if exited and not any(run.lines.values()):
            run.problem = "the script exited before it logged a step"
        elif not measuring:
            run.problem = f"no step line within {max(FIRST_STEP_WAIT_S, seconds):.0f}s"
        return run
    finally:
        stop_tagged(job.tag, [r.node for r in sub], grace=STOP_GRACE_S, what=f"scale probe of {job.name}")


def run_probe(job: Job, ranks: list[Rank], seconds: float, build: StartBuilder, forced: bool,
              floor: int = 1) -> dict | None:  # fmt: skip
    """Probe 1..N of these ranks' nodes in turn and choose a count. The probe's record (also saved on the
    attempt): rows, the count chosen and its line, or `skipped` with the one line that says why it did not
    run. None when the job left STARTING meanwhile (cancelled or timed out: its teardown stops the rest)."""
    probe: dict[str, Any] = {"phase": "probing", "seconds_per_count": seconds, "asked": len(ranks), "rows": []}
    record(job, probe)
    for count in range(1, len(ranks) + 1):
        probe["probing"] = count
        record(job, probe)
        try:
            run = run_count(job, ranks, count, seconds, build)
        except (LinkError, AgentRequestError, OSError) as exc:
            run = CountRun(nodes=[r.node.name for r in ranks[:count]], workers=0, local_batches=[None] * count,
                           workers_per_node=[1] * count, problem=str(exc))  # fmt: skip
        if run.problem == "the job left STARTING":
            return None
        row = measure(run)
        probe["rows"] = with_efficiency([*probe["rows"], row])
        log.info("job %s: scale probe on %d nodes: %s", job.name, count, row)
        if "error" in row:  # a count that cannot run says why, and larger ones would not do better
            break
    probe.pop("probing", None)
    rows = probe["rows"]
    if not any(r.get("samples_per_s") for r in rows):
        first = rows[0].get("error", "no rate") if rows else "nothing ran"
        probe.update(phase="skipped", chosen=len(ranks), line=f"scale probe did not run: {first}; runs on the "
                     f"{len(ranks)} nodes asked", warning=True)  # fmt: skip
        record(job, probe)
        return probe
    choice = choose(rows, len(ranks), forced, floor)
    probe.update(phase="done", chosen=choice.nodes, line=choice.line, warning=choice.warning)
    record(job, probe)
    return probe


def skipped(job: Job, line: str) -> dict:
    """A probe that could not run at all (one node, ...): recorded with its one line; the job runs as asked."""
    probe = {"phase": "skipped", "asked": job.ranks.count(), "rows": [], "line": line, "warning": True}
    record(job, probe)
    return probe


def summary_lines(probe: dict | None) -> list[str]:
    """The probe as `status` and the launch print it: its table, then its line and the weights it set."""
    if not probe:
        return []
    if probe.get("phase") == "probing":
        head = [f"scale probe: measuring {probe.get('probing', '?')} of {probe.get('asked', '?')} nodes"]
    else:
        head = [f"scale probe: {probe.get('line', '')}"]
    rows = probe.get("rows") or []
    if rows:
        head.append(f"  {'nodes':>5}  {'samples/s':>10}  {'efficiency':>10}  {'compute s':>9}  {'sync s':>8}")
    for r in rows:
        if "error" in r:
            head.append(f"  {r['nodes']:>5}  {'-':>10}  {'-':>10}  {r['error']}")
            continue
        eff = f"{r['efficiency'] * 100:.0f} %" if r.get("efficiency") is not None else "-"
        comp = f"{r['compute_s']:.4f}" if r.get("compute_s") is not None else "-"
        wait = f"{r['sync_wait_s']:.4f}" if r.get("sync_wait_s") is not None else "-"
        head.append(f"  {r['nodes']:>5}  {r['samples_per_s']:>10.1f}  {eff:>10}  {comp:>9}  {wait:>8}")
    if rows and rows[0].get("unit") == "per-rank batches":
        head.append("  (samples/s in per-rank batches: the job names no --batch-per-gpu)")
    if probe.get("weights"):
        shown = ", ".join(f"{n}={w:g}" for n, w in probe["weights"].items())
        head.append(f"  batch weights from the probe's time per sample: {shown}")
    return head
