"""Bounded caches (docs/data.md, "Bounded caches"): each node's store (<workdir>/.ugro/objects) and the controller's
(<data>/sync/, <data>/data/hashes/) held under a size limit (cluster/cache.py), least recently used first, never
what a queued, starting, running or stopping job needs (the objects of its code snapshot and of its --data, and its
trees on the nodes), nor what a service serves.

This module says what is needed and asks each store once (nodes that share a working directory share one); the
node's agent deletes (cluster/node/cache.py), only inside its store and the trees of ended jobs named here, oldest
ended first, never a file the job wrote. A trim runs after a delivery added bytes to a node (`trim`) and every
TRIM_CACHES_EVERY_S on the worker (`trim_all`, the `trim_caches` task); `disk` is what `ugro node disk NAME` shows.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from cluster import cache as limits
from cluster.fanout import on_each
from cluster.models import ClusterSettings, Node

from . import envs, locks, sync
from .models import Job, JobCode

log = logging.getLogger(__name__)

UPLOAD_KEEP_S = 24 * 3600  # a client's upload no job uses yet is kept this long (a launch follows it in seconds)
CONTROLLER_KEY = 0  # the controller store's key of the CACHE lock (a node group's is its first node's pk)
# A job in these states needs its files; a failed one with an automatic retry due too (jobs/loops/retries.py)
NEEDING = Job.NEEDING_STATES


@dataclass
class Needs:
    """What no trim may remove: objects (sha256 -> why) and the trees of jobs (name -> why)."""

    shas: dict[str, str] = field(default_factory=dict)
    jobs: dict[str, str] = field(default_factory=dict)
    digests: dict[str, str] = field(default_factory=dict)  # manifests of the controller's store -> why
    wheels: dict[tuple[str, str], str] = field(default_factory=dict)  # (name, version) a job's lock pins -> why

    def merge(self, other: Needs) -> None:
        for mine, theirs in ((self.shas, other.shas), (self.jobs, other.jobs), (self.digests, other.digests),
                             (self.wheels, other.wheels)):  # fmt: skip
            for key, why in theirs.items():
                mine.setdefault(key, why)


_hooks: list[Callable[[], Needs]] = []


def needs_from(hook: Callable[[], Needs]) -> None:
    """Register what an app above jobs needs kept (serving: the job and checkpoint each service serves), from its
    AppConfig.ready."""
    if hook not in _hooks:
        _hooks.append(hook)


def manifests_of(code: JobCode) -> list[str]:
    """The controller-store manifests a job's files are made of: its code snapshot's, and each --data item's once
    its delivery kept one (jobs/data.py, `manifest` of each item)."""
    digests = [code.sync_digest] if code.sync_digest else []
    digests += [str(d["manifest"]) for d in code.data or [] if isinstance(d, dict) and d.get("manifest")]
    return digests


def _manifest_shas(digest: str) -> set[str]:
    try:
        return {f["sha256"] for f in sync.load_manifest(digest)["files"]}
    except (sync.SyncError, KeyError, TypeError):
        return set()


def needed(extra: Iterable[str] = (), why: str = "the delivery under way") -> Needs:
    """Everything no trim may remove now; extra: objects the caller needs too (a delivery's, before placing them)."""
    needs = Needs()
    retrying = Q(state=Job.State.FAILED, current__retry_at__isnull=False)
    for job in Job.objects.filter(Q(state__in=NEEDING) | retrying).select_related("code"):
        reason = f"{job.state} job {job.name}"
        needs.jobs[job.name] = reason
        try:
            code = job.code
        except JobCode.DoesNotExist:
            continue
        for digest in manifests_of(code):
            needs.digests.setdefault(digest, reason)
            for sha in _manifest_shas(digest):
                needs.shas.setdefault(sha, reason)
        for pin in ((code.envs or {}).get("lock") or {}).get("pins") or []:  # its --packages lock's wheels
            needs.wheels.setdefault((envs.norm(pin[0]), pin[1]), reason)
    for hook in _hooks:
        needs.merge(hook())
    for sha in extra:
        needs.shas.setdefault(sha, why)
    return needs


def _epoch(at: datetime | None) -> float | None:
    return at.timestamp() if at is not None else None


def trees_on(group: list[Node], needs: Needs) -> list[dict]:
    """The job trees a store's nodes may hold (each job that ran there: its code copy, its --data items), each with
    when its job ended (None: not ended) and why it is needed ('' : it is not); ended ones oldest first."""
    out = []
    jobs = Job.objects.filter(all_ranks__node__in=group).distinct().select_related("code", "current")
    for job in jobs:
        try:
            code = job.code
        except JobCode.DoesNotExist:
            continue
        trees = (["code"] if code.sync_digest else []) + [str(d["dest"]) for d in code.data or [] if d.get("dest")]
        if not trees:
            continue
        ended = None
        if job.state in Job.ENDED_STATES:
            ended = _epoch(job.state_changed_at or job.finished_at or job.created_at)
        out.append({"job": job.name, "trees": trees, "digest": code.sync_digest, "ended": ended, "state": job.state,
                    "protected": needs.jobs.get(job.name, "")})  # fmt: skip
    out.sort(key=lambda j: (j["ended"] is None, j["ended"] or 0.0, j["job"]))
    return out


def _sharing(node: Node) -> list[Node]:
    """Every node that uses the node's store (the same working directory), the node first."""
    if not node.workdir_id:
        return [node]
    others = Node.objects.filter(workdir_id=node.workdir_id).exclude(pk=node.pk).order_by("pk")
    return [node, *others]


@dataclass
class Trimmed:
    """One store's trim: the node that did it, its answer (cluster/node/cache.py op_cache_trim) or why not."""

    node: str
    answer: dict | None = None
    error: str = ""
    nodes: list[str] = field(default_factory=list)  # every node of that store


def trim(nodes: Node | Iterable[Node], protected: Iterable[str] = ()) -> list[Trimmed]:
    """Bring the stores of these nodes under their limits (once per shared working directory), keeping what is
    needed (`needed`) and `protected` (sha256s the caller still needs: a delivery's objects, not placed yet).
    Never raises: a store that could not be trimmed says why in its Trimmed, and in the log."""
    nodes = [nodes] if isinstance(nodes, Node) else list(nodes)
    if not nodes:
        return []
    needs = needed(protected)
    cs = ClusterSettings.load()
    plans: list[tuple[Node, list[Node], int, list[dict]]] = []  # read here: the threads below only ask the nodes
    out: list[Trimmed] = []
    seen: set[int] = set()
    for asked in limits.stores(nodes):
        everyone = _sharing(asked[0])
        if any(n.pk in seen for n in everyone):
            continue
        seen.update(n.pk for n in everyone)
        node = next((n for n in asked if n.status not in Node.NOT_ANSWERING), asked[0])
        try:
            limit = min(limits.node_limit(n, cs) for n in everyone)
        except ValueError as exc:  # a limit cluster.yaml no longer parses (it is checked at import)
            out.append(Trimmed(node.name, error=str(exc), nodes=[n.name for n in everyone]))
            continue
        plans.append((node, everyone, limit, trees_on(everyone, needs)))

    def one(plan: tuple[Node, list[Node], int, list[dict]]) -> dict:
        node, _, limit, jobs = plan
        return limits.trim_store_of(node, sync.node_store(node), limit, needs.shas, jobs)

    with locks.held_each(locks.CACHE, [min(n.pk for n in plan[1]) for plan in plans]) as mine:
        busy = [p for p in plans if min(n.pk for n in p[1]) not in mine]
        out += [Trimmed(p[0].name, error="another trim of this store is running", nodes=[n.name for n in p[1]])
                for p in busy]  # fmt: skip
        asked = on_each([p for p in plans if p not in busy], one)
    for (node, everyone, _, _), answer, err in asked:
        why = str(err) if err else "another trim of this store is running" if answer.get("busy") else ""
        out.append(Trimmed(node.name, answer=None if why else answer, error=why, nodes=[n.name for n in everyone]))
    for trimmed in out:
        if trimmed.error:
            log.warning("cache of %s not trimmed: %s", trimmed.node, trimmed.error)
        elif trimmed.answer and (trimmed.answer.get("bytes") or trimmed.answer.get("skipped")):
            a = trimmed.answer
            log.info("cache of %s trimmed: %s freed (%d objects, trees %s), %s of %s held; left: %s", trimmed.node,
                     limits.human(a["bytes"]), a["objects"], a["trees"] or "none", limits.human(a["after"]),
                     limits.human(a["limit"]), a["skipped"] or "nothing")  # fmt: skip
    return out


def trim_all() -> tuple[list[Trimmed], dict]:
    """The worker's pass: every enabled node's store that answers, and the controller's."""
    nodes = list(Node.objects.filter(enabled=True).exclude(status__in=Node.NOT_ANSWERING).order_by("pk"))
    envs.trim(nodes)  # environments no job used for paths.env_ttl (never one a live job names)
    envs.trim_uv_caches(nodes)  # then uv's cache beside each store: what the removed envs linked may go
    return trim(nodes), trim_controller()


# -- the controller's store -------------------------------------------------------------------------------


def _hash_dir() -> Path:
    return Path(settings.DATA_DIR) / "data" / "hashes"


def _files(folder: Path, pattern: str) -> list[tuple[Path, os.stat_result]]:
    out = []
    for path in folder.glob(pattern):
        try:
            st = path.lstat()
        except OSError:
            continue
        if path.is_file():
            out.append((path, st))
    return out


def _last(st: os.stat_result) -> float:
    return max(st.st_atime, st.st_mtime)


def trim_controller(limit: int | None = None) -> dict:
    """Bring the controller's store under its limit (paths.store_limit): its objects, the hash cache's entries and
    the --packages wheel cache (<DATA_DIR>/envs/wheels, never a wheel a needed job's lock pins), least recently
    used first (an object's use: its own atime and mtime, and the newest launch or end of a job whose
    snapshot names it), never an object of a needed job's snapshot or of a client's upload no job uses yet (for
    UPLOAD_KEEP_S). A manifest that names a removed object goes with it (a resume of that job says its snapshot is
    gone). {"before", "after", "limit", "objects", "hashes", "wheels", "manifests", "bytes"}, or {"busy": True}."""
    with locks.held(locks.CACHE, CONTROLLER_KEY) as got:
        if not got:
            return {"busy": True}
        return _trim_controller(limit if limit is not None else limits.store_limit())


def _trim_controller(limit: int) -> dict:
    root = sync.store_dir()
    objects = {p.name: (st.st_size, _last(st), p) for p, st in _files(root / "objects", "*/*") if len(p.name) == 64}
    manifests = {p.stem: (st, p) for p, st in _files(root / "manifests", "*.json")}
    uploads = {p.stem: (st, p) for p, st in _files(root / "uploads", "*.json")}
    hashes = [(st.st_size, _last(st), p) for p, st in _files(_hash_dir(), "*/*.json")]
    wheels = [(st.st_size, _last(st), p) for p, st in _files(envs.cache_dir(), "*.whl")]
    before = (sum(o[0] for o in objects.values()) + sum(h[0] for h in hashes) + sum(w[0] for w in wheels)
              + sum(st.st_size for st, _ in [*manifests.values(), *uploads.values()]))  # fmt: skip
    done = {"busy": False, "before": before, "after": before, "limit": limit, "objects": 0, "hashes": 0,
            "wheels": 0, "manifests": 0, "bytes": 0}  # fmt: skip
    if before <= limit:
        return done
    needs = needed()
    kept = set(needs.shas)
    now = timezone.now().timestamp()
    used: dict[str, float] = {}  # digest -> the newest launch or end of a job that used it
    for code in JobCode.objects.select_related("job"):
        job = code.job
        at = max(filter(None, [_epoch(job.created_at), _epoch(job.state_changed_at)]), default=0.0)
        for digest in manifests_of(code):
            used[digest] = max(used.get(digest, 0.0), at)
    contents: dict[str, set[str]] = {}
    last = {sha: o[1] for sha, o in objects.items()}
    for digest, (st, _path) in manifests.items():
        shas = _manifest_shas(digest)
        contents[digest] = shas
        when = max(st.st_mtime, used.get(digest, 0.0))
        upload = uploads.get(digest)
        if upload is not None and digest not in used and now - upload[0].st_mtime < UPLOAD_KEEP_S:
            kept |= shas  # a client's upload its launch has not used yet
        for sha in shas & last.keys():
            last[sha] = max(last[sha], when)
    queue = sorted([(last[sha], "object", sha) for sha in objects if sha not in kept]
                   + [(h[1], "hash", str(h[2])) for h in hashes]
                   + [(w[1], "wheel", str(w[2])) for w in wheels  # (one fetched just now: a launch sends it)
                      if envs.wheel_pin(w[2].name) not in needs.wheels and w[1] < now - limits.FRESH_S])  # fmt: skip
    removed: set[str] = set()
    for _when, kind, key in queue:
        if done["bytes"] >= before - limit:
            break
        path = objects[key][2] if kind == "object" else Path(key)
        try:
            size = path.stat().st_size
            path.unlink()
        except OSError:
            continue
        done["bytes"] += size
        if kind == "object":
            done["objects"] += 1
            removed.add(key)
        else:
            done["hashes" if kind == "hash" else "wheels"] += 1
    for digest, shas in contents.items():
        if shas & removed and digest not in needs.digests:
            for path in (manifests[digest][1], uploads[digest][1] if digest in uploads else None):
                if path is not None:
                    try:
                        done["bytes"] += path.stat().st_size
                        path.unlink()
                    except OSError:
                        pass
            done["manifests"] += 1
    done["after"] = before - done["bytes"]
    if done["bytes"]:
        log.info("controller store trimmed: %s freed (%d objects, %d hash entries, %d wheels, %d manifests), %s of "
                 "%s held", limits.human(done["bytes"]), done["objects"], done["hashes"], done["wheels"],
                 done["manifests"], limits.human(done["after"]), limits.human(limit))  # fmt: skip
    return done


# -- what a node holds, for people -----------------------------------------------------------------------------


def _when(ts: float | None) -> str:
    if not ts:
        return "-"
    return timezone.localtime(datetime.fromtimestamp(ts, tz=UTC)).strftime("%Y-%m-%d %H:%M")


def disk(node: Node) -> dict:
    """What the node's store holds and why (`ugro node disk NAME`): its size against its limit, the disk's free
    space, and each item (a job's code copy, a job's data, objects no job's tree uses, partial transfers) with its
    size, last use and what keeps it (a job that needs it) or that a trim may take it. `lines` is the text the
    commands print. LinkError / AgentRequestError when the node does not answer."""
    needs = needed()
    everyone = _sharing(node)
    jobs = trees_on(everyone, needs)
    by_name = {j["job"]: j for j in jobs}
    answer = limits.report_of(node, sync.node_store(node), needs.shas, jobs)
    limit = limits.node_limit(node)
    items = []
    for t in answer["trees"]:
        job = by_name[t["job"]]
        kind = "code" if t["path"] == "code" else "data"
        if job["protected"]:
            why = f"kept: {job['protected']}"
        elif job["ended"] is None:
            why = f"kept: job {job['job']} is {job['state']}"
        elif t.get("outside"):
            why = "kept: a symlink leads out of the job's directory"
        elif t["foreign"]:
            why = f"kept: holds {t['foreign']}, which the job wrote"
        else:
            why = f"may be trimmed (job {job['state']} {_when(job['ended'])})"
        items.append({"kind": kind, "job": t["job"], "path": t["path"], "bytes": t["bytes"], "files": t["files"],
                      "last": job["ended"] or t["last"], "protected": job["protected"], "why": why})  # fmt: skip
    free = answer["unreferenced"]
    if free["count"]:
        items.append({"kind": "unreferenced", "bytes": free["bytes"], "files": free["count"], "last": free["newest"],
                      "oldest": free["oldest"], "protected": "",
                      "why": f"{free['count']} objects no job's tree uses: trimmed first, oldest first"})  # fmt: skip
    for group in answer["needed"]:
        items.append({"kind": "needed", "bytes": group["bytes"], "files": group["count"], "last": None,
                      "protected": group["why"], "why": f"kept: {group['why']} (not placed yet)"})  # fmt: skip
    if answer["elsewhere"]["count"]:
        e = answer["elsewhere"]
        items.append({"kind": "elsewhere", "bytes": e["bytes"], "files": e["count"], "last": None, "protected": "",
                      "why": f"{e['count']} objects also linked outside the job trees listed (a node's own data "
                             "staged from where it lies, the wheels uv's cache reads: .ugro/uv-wheels): "
                             "kept"})  # fmt: skip
    for p in answer["partials"]:
        state = "being written" if p["writing"] else "resumes from here"
        items.append({"kind": "partial", "sha": p["sha"], "bytes": p["bytes"], "files": 1, "last": p["last"],
                      "protected": p.get("needed") or "",
                      "why": f"part of object {p['sha'][:12]}: {state}"
                             + (f", kept: {p['needed']}" if p.get("needed") else "")})  # fmt: skip
    report = {"node": node.name, "store": answer["store"], "shared_with": [n.name for n in everyone[1:]],
              "limit": limit, "bytes": answer["bytes"], "over": answer["bytes"] > limit, "free": answer["free"],
              "disk": answer["disk"], "manifests": answer["manifests"], "items": items}  # fmt: skip
    report["lines"] = disk_lines(report)
    return report


def disk_lines(report: dict) -> list[str]:
    """The report as `ugro node disk` prints it: a head line, then one line per item."""
    shared = f" (shared with {', '.join(report['shared_with'])})" if report["shared_with"] else ""
    over = "  OVER its limit: the next trim takes what it may" if report["over"] else ""
    lines = [f"{report['node']}: {report['store']}{shared}",
             f"  holds {limits.human(report['bytes'])} of its {limits.human(report['limit'])} limit; "
             f"{limits.human(report['free'])} free of {limits.human(report['disk'])} on its disk{over}",
             f"  {'SIZE':>9}  {'LAST USE':16}  {'ITEM':36}  WHY"]  # fmt: skip
    for item in report["items"]:
        if item["kind"] in ("code", "data"):
            name = f"{item['kind']} of {item['job']}" + (f": {item['path']}" if item["kind"] == "data" else "")
        else:
            name = {"unreferenced": "unreferenced objects", "needed": "objects needed, not placed",
                    "elsewhere": "objects linked elsewhere", "partial": "partial transfer"}[item["kind"]]  # fmt: skip
        lines.append(f"  {limits.human(item['bytes']):>9}  {_when(item['last']):16}  {name[:36]:36}  {item['why']}")
    if not report["items"]:
        lines.append("  (nothing held)")
    return lines
