"""Checkpoint retention: `--keep LATEST[,best:METRIC:K[:min|:max]]` keeps a job's newest LATEST checkpoints and
the K best by a metric it logs, and deletes the others on every node that holds a copy (docs/recovery.md,
"Checkpoint retention").

- A checkpoint is one path as the ranks name it (relative to where they start, else absolute): the rows the
  follower recorded for it on several nodes, and the copies a resume (jobs/checkpoints.py ensure_on) or a
  service made of it elsewhere, are one checkpoint with several copies.
- Only complete (`ready`) checkpoints with a step take part; one being written, or without a step in its
  name, is never deleted. Latest is by step, as a resume's 'latest' is.
- Its METRIC value is the job's own point of METRIC at the checkpoint's step, or the nearest logged step
  before it; one with no value is not "best" (it may still be among the latest). Lower is better for names
  with loss, ppl, perplexity or error in them, or the words wer or cer; higher otherwise; `:min`/`:max` says it.
- Never deleted: the checkpoint a queued or starting resume starts from (and a running one until that attempt
  wrote a checkpoint of its own), the one a retry would resume from, one a service serves (serving registers
  itself with `uses_from`).
- Each copy is deleted through its node's agent (`remove_checkpoints`, which deletes only under the job's own
  directory or checkpoints by name in the workdir); nodes that share a working directory hold one copy. A node
  that does not answer keeps its copy's row "freeing", and the next pass tries again; the rows stay, with
  `removed_at` set once their copy is gone.

The job's spec is resolved at launch (`resolve`: the typed one, else cluster.yaml's `training.keep`), so a
default added later never reaches jobs launched before it. The reconciler's running loop runs a pass while a
job runs, the ended loop the last ones after its end (jobs/loops/).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from django.db.models import Exists, OuterRef, Q, QuerySet
from django.utils import timezone

from cluster.fanout import node_request, on_each, unreachable
from cluster.links import AgentRequestError
from cluster.models import Node
from metrics.models import MetricPoint

from . import checkpoints, sync
from .models import Attempt, Checkpoint, Job

log = logging.getLogger(__name__)

LOWER_IS_BETTER = ("loss", "ppl", "perplexity", "error")  # anywhere in the name
LOWER_IS_BETTER_WORDS = ("wer", "cer")  # as words of the name: `eval_wer`, not `power`
COUNT_MAX = 100_000
METRIC_NAME = re.compile(r"[A-Za-z0-9_./-]{1,100}")
REMOVE_TIMEOUT_S = 60.0  # one copy's deletion: a directory of many GB goes in seconds, a silent node fails
# what keep_reason starts with while retention works on a checkpoint, and once it is done with it
FREEING, FREED, LEFT, PROTECTED = "freeing", "freed", "left", "protected"


@dataclass(frozen=True)
class Keep:
    """A parsed `--keep`: the newest `latest`, and the `best` best by `metric` (lowest first when `lower`)."""

    latest: int
    metric: str = ""
    best: int = 0
    lower: bool = True

    def __str__(self) -> str:
        """The spec as a job records it: `2`, `2,best:eval_loss:1`, `1,best:acc:2` (`:min`/`:max` only when it
        differs from what the name implies)."""
        if not self.best:
            return str(self.latest)
        direction = "" if self.lower == lower_is_better(self.metric) else (":min" if self.lower else ":max")
        return f"{self.latest},best:{self.metric}:{self.best}{direction}"

    def rule_text(self) -> str:
        """Why a checkpoint was freed: `not among the newest 2 nor the best 1 by eval_loss (lowest)`."""
        text = f"not among the newest {self.latest}"
        if self.best:
            text += f" nor the best {self.best} by {self.metric} ({'lowest' if self.lower else 'highest'})"
        return text


def lower_is_better(metric: str) -> bool:
    """Whether a lower value of the metric is better, by its name (loss, ppl, perplexity, error, wer, cer)."""
    name = metric.lower()
    words = re.split(r"[^a-z0-9]+", name)
    return any(w in name for w in LOWER_IS_BETTER) or any(w in words for w in LOWER_IS_BETTER_WORDS)


def parse(text: str | int | None) -> Keep | None:
    """A `--keep` spec; None for none (keep all). ValueError in one line: `--keep: LATEST must be >= 1`."""
    text = str(text if text is not None else "").strip()
    if not text:
        return None
    if len(text) > 200:
        raise ValueError("--keep: at most 200 characters")
    first, *rest = [p.strip() for p in text.split(",")]
    if first.lower().startswith("best:"):
        raise ValueError(f"--keep: LATEST comes first, e.g. --keep 2,{first}")
    latest = _count(first, "LATEST")
    best: Keep | None = None
    for part in rest:
        bits = part.split(":")
        if bits[0].lower() != "best" or len(bits) not in (3, 4):
            raise ValueError(f"--keep: unknown part {part[:60]!r} (takes LATEST[,best:METRIC:K[:min|:max]])")
        if best is not None:
            raise ValueError("--keep: one best:METRIC:K part at most")
        _, metric, k, *direction = bits
        if not METRIC_NAME.fullmatch(metric):
            raise ValueError(f"--keep: METRIC must be a metric's name (letters, digits, _ . / -), not {metric[:60]!r}")
        if direction and direction[0].lower() not in ("min", "max"):
            raise ValueError(f"--keep: the direction is min or max, not {direction[0][:20]!r}")
        lower = direction[0].lower() == "min" if direction else lower_is_better(metric)
        best = Keep(latest, metric, _count(k, "K"), lower)
    return best or Keep(latest)


def _count(text: str, what: str) -> int:
    if not re.fullmatch(r"-?\d{1,12}", text):
        raise ValueError(f"--keep: {what} must be a whole number, not {text[:40]!r}")
    number = int(text)
    if number < 1:
        raise ValueError(f"--keep: {what} must be >= 1")
    if number > COUNT_MAX:
        raise ValueError(f"--keep: {what} must be <= {COUNT_MAX}")
    return number


def check_default(value: object) -> Keep | None:
    """cluster.yaml's `training.keep` (a number or a spec); ValueError in one line, without the flag's name."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"must be LATEST[,best:METRIC:K], e.g. 3 or 2,best:eval_loss:1, not {str(value)[:40]!r}")
    try:
        return parse(value)
    except ValueError as exc:
        raise ValueError(str(exc).removeprefix("--keep: ")) from None


def resolve(typed: str, training: dict) -> str:
    """The spec a new job records: the typed one, else the cluster's `training.keep`, else '' (keep all), in the
    form `Keep.__str__` writes. ValueError in one line."""
    if str(typed or "").strip():
        return str(parse(typed))
    try:
        keep = check_default(training["keep"]) if training.get("keep") is not None else None
    except ValueError as exc:
        raise ValueError(f"training.keep in cluster.yaml: {exc}") from None
    return str(keep) if keep else ""


# -- the choice -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """One complete checkpoint with a step, as the choice sees it: its key, step, time and metric value."""

    key: str
    step: int
    mtime: float = 0.0
    value: float | None = None


def choose(candidates: list[Candidate], keep: Keep, protected: dict[str, str]) -> dict[str, str]:
    """Which checkpoints stay, each with why (`latest`, `best eval_loss 0.41`, `protected: ...`); every candidate
    not in the answer is freed. A protected one stays whatever its rank."""
    kept: dict[str, list[str]] = {}
    for c in sorted(candidates, key=lambda c: (-c.step, -c.mtime))[: keep.latest]:
        kept[c.key] = ["latest"]
    if keep.best:
        valued = [c for c in candidates if c.value is not None and math.isfinite(c.value)]
        valued.sort(key=lambda c: (c.value if keep.lower else -c.value, -c.step))
        for c in valued[: keep.best]:
            kept.setdefault(c.key, []).append(f"best {keep.metric} {c.value:.4g}")
    for c in candidates:
        if c.key in protected and c.key not in kept:
            kept[c.key] = [f"{PROTECTED}: {protected[c.key]}"]
    return {key: ", ".join(why) for key, why in kept.items()}


# -- what uses a checkpoint -----------------------------------------------------------------------------------


@dataclass
class Uses:
    """What another app knows of a job's checkpoints (by Checkpoint pk): those it needs kept, with why, and the
    copies it made of them elsewhere (pk, node, path)."""

    needed: dict[int, str] = field(default_factory=dict)
    copies: list[tuple[int, Node, str]] = field(default_factory=list)


_hooks: list[Callable[[Job], Uses]] = []


def uses_from(hook: Callable[[Job], Uses]) -> None:
    """Register what an app above jobs knows of a job's checkpoints (serving: the one a service serves, and its
    replicas' copies); called from its AppConfig.ready."""
    if hook not in _hooks:
        _hooks.append(hook)


def _others_uses(job: Job) -> Uses:
    out = Uses()
    for hook in _hooks:
        found = hook(job)
        for pk, why in found.needed.items():
            out.needed.setdefault(pk, why)
        out.copies += found.copies
    return out


# -- a job's checkpoints, grouped ------------------------------------------------------------------------------


@dataclass
class Group:
    """One checkpoint: its rows (one per node that recorded it, or a copy retention deleted)."""

    key: str
    rows: list[Checkpoint] = field(default_factory=list)

    @property
    def live(self) -> list[Checkpoint]:
        return [c for c in self.rows if c.removed_at is None]

    @property
    def first(self) -> Checkpoint:
        return self.rows[0]

    @property
    def step(self) -> int | None:
        return self.first.step

    @property
    def ready(self) -> bool:
        return any(c.ready for c in self.live)

    def state(self) -> str:
        """removed (every copy gone), left (what is left was refused), freeing, or live."""
        live = self.live
        if not live:
            return "removed"
        if all(c.keep_reason.startswith(LEFT) for c in live):
            return "left"
        if any(c.keep_reason.startswith(FREEING) for c in live):
            return "freeing"
        if len(live) < len(self.rows) and not any(c.ready for c in live):
            return "freeing"  # parts of a freed one recorded since (a rank's share); one written again is complete
        return "live"


def groups(job: Job) -> dict[str, Group]:
    """The job's checkpoints by key (the path as its ranks name it), each with its rows, oldest row first."""
    out: dict[str, Group] = {}
    starts: dict[int, str] = {}
    for c in job.checkpoints.select_related("node").order_by("pk"):
        c.job = job  # one job object: its code record (where ranks start) is read once
        if c.node_id not in starts:
            starts[c.node_id] = sync.start_dir(job, c.node).rstrip("/") + "/"
        start = starts[c.node_id]
        key = c.path[len(start) :] if c.path.startswith(start) else c.path
        out.setdefault(key, Group(key)).rows.append(c)
    return out


def metric_at(job: Job, metric: str, step: int) -> float | None:
    """The job's value of `metric` at `step`, or at the nearest logged step before it (rank 0's first); None if
    it logged none by then."""
    points = MetricPoint.objects.filter(job=job, name=metric, superseded=False, step__isnull=False, step__lte=step)
    return points.order_by("-step", "rank").values_list("value", flat=True).first()


def _protected(job: Job, found: dict[str, Group], uses: Uses) -> dict[str, str]:
    """key -> why it must stay: a resume about to start from it, a retry's, a service's."""
    by_pk = {c.pk: g.key for g in found.values() for c in g.rows}
    out: dict[str, str] = {}
    starting = (Job.State.QUEUED, Job.State.STARTING)
    for a in Attempt.objects.filter(resume_checkpoint__in=list(by_pk)).select_related("job"):
        other = a.job
        if other.current_id != a.pk or other.state not in (*starting, Job.State.RUNNING):
            continue
        if (
            other.state == Job.State.RUNNING
            and other.checkpoints.filter(attempt=a.number, ready=True, step__gt=a.from_step or 0).exists()
        ):
            continue  # the attempt wrote its own: it has read this one long ago
        out.setdefault(by_pk[a.resume_checkpoint_id], f"{other.name} attempt {a.number} resumes from it")
    if job.retry_on:
        try:
            latest = checkpoints.choose(job, "latest")
        except ValueError:
            latest = None
        if latest is not None and latest.pk in by_pk:
            out.setdefault(by_pk[latest.pk], "a retry resumes from it")
    for pk, why in uses.needed.items():
        if pk in by_pk:
            out.setdefault(by_pk[pk], why)
    return out


# -- one pass ---------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What a pass did: checkpoints freed on every node, and those with a copy still to delete."""

    freed: list[str] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)


def _note(rows: list[Checkpoint], reason: str) -> None:
    reason = reason[:200]
    pks = [c.pk for c in rows if c.keep_reason != reason]
    if pks:
        Checkpoint.objects.filter(pk__in=pks).update(keep_reason=reason)
    for c in rows:
        c.keep_reason = reason


def retain(job: Job) -> Outcome | None:
    """One retention pass over a job: decide what stays, delete the rest on every node that holds it (and go on
    with deletions an earlier pass left). None when the job keeps everything."""
    keep = parse(job.keep)
    if keep is None:
        return None
    found = groups(job)
    uses = _others_uses(job)
    protected = _protected(job, found, uses)
    candidates, freeing = [], []
    for g in found.values():
        state = g.state()
        if state in ("removed", "left"):
            continue
        if state == "freeing" and g.key not in protected:
            freeing.append(g)
        elif g.ready and g.step is None:
            _note(g.live, "kept: no step in its name")
        elif g.ready:
            candidates.append(g)
        elif job.is_ended:  # its writer is gone: it stays as it is, never offered, never deleted
            _note(g.live, "kept: never complete")
    values = {g.key: metric_at(job, keep.metric, g.step) for g in candidates} if keep.best else {}
    chosen = choose([Candidate(g.key, g.step, g.first.mtime, values.get(g.key)) for g in candidates], keep,
                    protected)  # fmt: skip
    for g in candidates:
        if g.key in chosen:
            _note(g.live, chosen[g.key])
        else:
            _note(g.live, f"{FREEING}: {keep.rule_text()}")  # first: a crash from here on goes on freeing it
            freeing.append(g)
    outcome = Outcome()
    for g in freeing:
        left = _free(job, g, keep, uses)
        (outcome.pending if left else outcome.freed).append(f"{g.key}{': ' + left if left else ''}")
    return outcome


def _copies(job: Job, g: Group, uses: Uses) -> list[Checkpoint]:
    """Rows for the copies of a checkpoint that were made without one (a resume's on its nodes, a service's on its
    replicas'), created now so that each copy's deletion is recorded (size 0 until its deletion says it)."""
    pks = {c.pk for c in g.rows}
    source = next((c for c in g.live if c.ready), g.first)
    wanted: list[tuple[Node, str]] = [(n, p) for pk, n, p in uses.copies if pk in pks]
    for a in Attempt.objects.filter(resume_checkpoint__in=pks).select_related("resume_checkpoint__node"):
        copied = a.resume_checkpoint
        copied.job = job
        for rank in a.ranks.select_related("node"):
            wanted.append((rank.node, checkpoints.target_path(copied, rank.node)))
    have = {_place(c.node, c.path) for c in g.rows}  # a copy in a directory a row's node shares is that row's
    made = []
    for node, path in wanted:
        if _place(node, path) in have:
            continue
        have.add(_place(node, path))
        row, created = Checkpoint.objects.get_or_create(
            job=job, node=node, path=path,
            defaults={"size": 0, "mtime": source.mtime, "step": source.step, "kind": source.kind, "ready": True,
                      "attempt": source.attempt, "keep_reason": source.keep_reason},
        )  # fmt: skip
        row.node, row.job = node, job
        (made if created else g.rows).append(row)
    g.rows += made
    return made


def _place(node: Node, path: str) -> tuple[str, str]:
    """Where a copy lies: the path in a working directory, one for all the nodes that share it."""
    return (node.workdir_id or f"node {node.pk}", path)


def _free(job: Job, g: Group, keep: Keep, uses: Uses) -> str:
    """Delete every copy of a checkpoint; returns what is left ('' when every copy is gone), one line."""
    made = {c.pk for c in _copies(job, g, uses)}
    why = keep.rule_text()
    # one place per shared working directory; each asked through its rows' nodes first, then its sharers
    places: dict[tuple[str, str], list[Checkpoint]] = {}
    for c in g.live:
        places.setdefault(_place(c.node, c.path), []).append(c)
    results: dict[tuple[str, str], tuple[str, str]] = {}  # place -> (gone | refused | failed, detail)
    tried: dict[tuple[str, str], set[int]] = {place: set() for place in places}
    down: set[int] = set()  # nodes that did not answer this pass
    globs = [job.checkpoint_glob.replace("{job}", job.name)] if job.checkpoint_glob else []
    for _round in range(2):  # the second: a place whose node did not answer, through a node that shares it
        asked: dict[int, tuple[Node, list[tuple[str, str]]]] = {}
        for place, rows in places.items():
            if place in results and results[place][0] != "failed":
                continue
            node = next((n for n in _nodes_for(rows) if n.pk not in down and n.pk not in tried[place]), None)
            if node is not None:
                tried[place].add(node.pk)
                asked.setdefault(node.pk, (node, []))[1].append(place)
        if not asked:
            break
        for (node, _mine), answer, err in on_each(list(asked.values()), lambda item: _remove(job, item, globs)):
            if err is not None:  # (_remove answers for every place; this is a bug of its own, said as such)
                answer = {place: ("failed", _said(node, err)) for place in _mine}
            results.update(answer)
            if any(outcome == "failed" for outcome, _ in answer.values()):
                down.add(node.pk)
    now = timezone.now()
    left = []
    for place, rows in places.items():
        outcome, detail = results.get(place, ("failed", "no node to ask"))
        if outcome == "gone":
            gone, size = [c for c in rows if not (c.pk in made and detail == "absent")], _size(detail)
            for c in gone:
                fields = {"removed_at": now, "keep_reason": f"{FREED}: {why}"[:200]}
                if size and (c.pk in made or not c.size):  # a copy retention made a row for: its size now known
                    fields["size"] = size
                Checkpoint.objects.filter(pk=c.pk).update(**fields)
            Checkpoint.objects.filter(pk__in=[c.pk for c in rows if c not in gone]).delete()  # never was a copy
        elif outcome == "refused":
            _note(rows, f"{LEFT}: {detail}")
            left.append(detail)
        else:
            _note(rows, f"{FREEING}: {why}; {detail}, tried again later")
            left.append(detail)
    if left:
        log.info("retention of %s: %s left (%s)", job.name, g.key, "; ".join(left))
    return "; ".join(left)


def _nodes_for(rows: list[Checkpoint]) -> list[Node]:
    """The nodes that see a place: its rows' nodes, then the others that share their working directory."""
    nodes = {c.node_id: c.node for c in rows}
    ids = {c.node.workdir_id for c in rows if c.node.workdir_id}
    if ids:
        for n in Node.objects.filter(workdir_id__in=ids).exclude(pk__in=list(nodes)).order_by("name"):
            nodes[n.pk] = n
    return list(nodes.values())


def _remove(job: Job, item: tuple[Node, list[tuple[str, str]]], globs: list[str]) -> dict:
    """Delete the places a node was given, one request each (a refusal is that path's alone); once the node does
    not answer, the rest of its places fail without asking."""
    node, places = item
    out: dict[tuple[str, str], tuple[str, str]] = {}
    for place in places:
        if any(outcome == "failed" for outcome, _ in out.values()):
            out[place] = ("failed", f"{node.name} did not answer")
            continue
        try:
            answer = node_request(node, "remove_checkpoints", timeout=REMOVE_TIMEOUT_S, paths=[place[1]],
                                  workdir=node.workdir, job=job.name, globs=globs)  # fmt: skip
        except AgentRequestError as exc:
            out[place] = ("refused", f"{node.name} refused: {exc}")
            continue
        except Exception as exc:  # the link: not reached, cut, or too slow
            out[place] = ("failed", _said(node, exc))
            continue
        removed = answer["removed"]
        out[place] = ("gone", str(removed[place[1]]) if place[1] in removed else "absent")
    return out


def _said(node: Node, err: Exception) -> str:
    return f"{node.name} did not answer" if unreachable(err) else f"{node.name}: {str(err)[:120]}"


def _size(detail: str) -> int:
    return int(detail) if detail.isdigit() else 0


# -- the reconciler's rule, and what pages show ---------------------------------------------------------------


def _work_left() -> Exists:
    """A job with a checkpoint retention has not decided on (complete, or left incomplete by an ended job), is still
    deleting, or keeps for a use that may end."""
    undecided = Q(keep_reason="") & (Q(ready=True) | Q(job__state__in=Job.ENDED_STATES))
    pending = undecided | Q(keep_reason__startswith=FREEING) | Q(keep_reason__startswith=PROTECTED)
    return Exists(Checkpoint.objects.filter(pending, job=OuterRef("pk"), removed_at__isnull=True))


def pending(jobs: QuerySet[Job]) -> QuerySet[Job]:
    """Of the given jobs, those that keep less than all and have retention work left (the loops take each under
    its RETENTION lock: jobs/loops run_retention)."""
    return jobs.exclude(keep="").filter(_work_left())


def act(job: Job) -> str | None:
    """One job's retention pass: `job: freed N` when it freed something."""
    outcome = retain(job)
    return f"{job.name}: freed {len(outcome.freed)}" if outcome and outcome.freed else None


def size_text(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def summary(job: Job) -> dict | None:
    """What retention kept and freed, for the job page, `status NAME` and the API; None when the job keeps all
    and nothing was ever freed."""
    found = groups(job)
    if not job.keep and not any(c.removed_at for g in found.values() for c in g.rows):
        return None
    kept = [g for g in found.values() if g.state() == "live" and g.ready]
    freed = [g for g in found.values() if g.state() == "removed"]
    reasons = [g.live[0].keep_reason for g in kept]
    keep = parse(job.keep)
    return {
        "keep": job.keep,
        "kept": len(kept),
        "latest": sum(r.startswith("latest") for r in reasons),
        "best": sum("best " in r for r in reasons),
        "metric": keep.metric if keep else "",
        "protected": sum(r.startswith(PROTECTED) for r in reasons),
        "freed": len(freed),
        "freed_bytes": sum(c.size for g in found.values() for c in g.rows if c.removed_at),
        "freeing": [g.key for g in found.values() if g.state() == "freeing"],
        "left": [g.key for g in found.values() if g.state() == "left"],
    }


def summary_text(job: Job, found: dict | None = None) -> str:
    """`checkpoints: kept 3 (latest 2, best eval_loss 1), freed 5 (1.2 GB)`; '' when the job keeps all."""
    s = found if found is not None else summary(job)
    if s is None:
        return ""
    parts = [f"latest {s['latest']}"]
    if s["metric"]:
        parts.append(f"best {s['metric']} {s['best']}")
    if s["protected"]:
        parts.append(f"in use {s['protected']}")
    text = f"checkpoints: kept {s['kept']} ({', '.join(parts)}), freed {s['freed']} ({size_text(s['freed_bytes'])})"
    if s["freeing"]:
        text += f", {len(s['freeing'])} still to delete on a node that did not answer"
    if s["left"]:
        text += f", {len(s['left'])} left where the node refused"
    return f"{text}; --keep {s['keep']}" if s["keep"] else text
