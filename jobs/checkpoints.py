"""A job's checkpoints: recorded as they appear on the nodes, offered only once complete, copied between nodes.

The follower lists each rank's checkpoint places every CHECKPOINT_SCAN_S while it runs (through the node
agent's `checkpoints` op: the job's output directory, `<workdir>/outputs/<job>`, and the job's own glob)
and once more when the rank ends; and whatever its discovery walk of the workdir finds (the agent's
`discover`, every few seconds: Hugging Face checkpoint-N/, Lightning .ckpt, step-named .pt and
.safetensors files changed since the rank started, wherever the script saves them). A candidate is
recorded with its node, path, step, size and time; it becomes `ready` (offered for a resume) only when
it is complete and stopped changing:

- a temporary name (a leading dot, `.tmp`, `.part`, `tmp-` ...) is never recorded;
- a Hugging Face `checkpoint-<N>/` directory counts only once it holds `trainer_state.json`
  (the Trainer writes it last);
- the size and mtime must be the same in two listings in a row, or the rank must have ended (nothing is
  writing any more).

Pages and commands read the rows; no request asks a node.
"""

from __future__ import annotations

import hashlib
import logging
import re
from pathlib import PurePosixPath

from django.db import IntegrityError, transaction

from cluster.fanout import node_request, on_each
from cluster.models import Node

from . import sync, transfer
from .models import Checkpoint, Job, Rank

log = logging.getLogger(__name__)

FILE_SUFFIXES = (".pt", ".pth", ".safetensors", ".bin", ".ckpt")
TEMP_MARKS = (".tmp", ".temp", ".part", ".partial", ".incomplete", ".ugro-part")
STEP_PATTERNS = (
    re.compile(r"checkpoint[_-]?step[_-]?(\d+)", re.I),  # checkpoint_step50.pt
    re.compile(r"checkpoint-(\d+)$", re.I),  # Hugging Face checkpoint-500/
    re.compile(r"(?:step|global_step|iter)[_=-]?(\d+)", re.I),  # epoch=1-step=500.ckpt, iter_0001000
)
COPY_TIMEOUT_S = 60.0  # a request while a checkpoint is copied: a silent node fails


def step_of(name: str) -> int | None:
    """The training step a checkpoint's name carries, or None."""
    stem = name
    for suffix in FILE_SUFFIXES:
        if stem.endswith(suffix):
            stem = stem[: -len(suffix)]
    for pattern in STEP_PATTERNS:
        m = pattern.search(stem)
        if m:
            return int(m.group(1))
    return None


def is_temporary(name: str) -> bool:
    low = name.lower()
    return low.startswith((".", "tmp", "~")) or any(mark in low for mark in TEMP_MARKS)


def output_dir(job: Job, node: Node) -> str:
    """Where the reference script saves: <workdir>/outputs/<job> (also where HF scripts are pointed)."""
    return f"{node.workdir.rstrip('/')}/outputs/{job.name}"


def _candidate(job: Job, entry: dict) -> tuple[int | None, str] | None:
    """(step, kind) of a listed entry that may be a checkpoint, None for anything else."""
    name = PurePosixPath(entry["path"]).name
    if is_temporary(name):
        return None
    from_glob = entry.get("glob", False)
    if entry["dir"]:
        if not (from_glob or re.fullmatch(r"checkpoint-\d+", name)):
            return None
        return step_of(name), Checkpoint.Kind.DIR
    if not (from_glob or name.endswith(FILE_SUFFIXES)):
        return None
    return step_of(name), Checkpoint.Kind.FILE


def scan(rank: Rank) -> int:
    """List the rank's checkpoint places on its node and record what is there; returns how many are ready.

    Raises LinkError / AgentRequestError when the node does not answer.
    """
    job, node = rank.job, rank.node
    globs = [job.checkpoint_glob.replace("{job}", job.name)] if job.checkpoint_glob else []
    answer = node_request(node, "checkpoints", timeout=10, dirs=[output_dir(job, node)], globs=globs, cwd=node.workdir)
    by_glob: set[str] = set()
    if globs:  # which paths only the glob found (anything it names counts, whatever the suffix)
        listed = {e["path"] for e in answer["entries"]}
        by_glob = {p for p in listed if not p.startswith(output_dir(job, node) + "/")}
    return _record(rank, answer["entries"], by_glob)


def record_found(rank: Rank, entries: list[dict]) -> int:
    """Record what a discovery walk of the rank's workdir found (the node agent's `discover`: entries changed
    since the rank started): Hugging Face checkpoint-N/ directories, Lightning .ckpt files, and .pt/.pth/
    .safetensors/.bin files whose name carries a step. A path another running job already recorded on this
    node is that job's, as is one an ended job recorded and nothing rewrote since. Returns how many are ready."""
    wanted = [e for e in entries if e.get("kind") == "checkpoint" and _named_as_checkpoint(e)]
    wanted = [e for e in wanted if not rank.in_other_jobs_dir(e["path"])]
    if not wanted:
        return 0
    # another job's: one it runs now, or one it recorded as it still is (a run that ended just before this
    # rank started, within the clock slack), not one a later run rewrote
    others = Checkpoint.objects.filter(node__in=seeing(rank.node), path__in=[e["path"] for e in wanted])
    others = others.exclude(job=rank.job)
    running = set(others.filter(job__current__finished_at__isnull=True).values_list("path", flat=True))
    recorded = set(others.values_list("path", "mtime"))
    mine = [e for e in wanted if e["path"] not in running and (e["path"], e["mtime"]) not in recorded]
    return _record(rank, mine, set())


def _named_as_checkpoint(entry: dict) -> bool:
    """A found entry that names itself a checkpoint (a model.pt or train.bin written by the run may be
    anything: only a step in its name makes it one)."""
    name = PurePosixPath(entry["path"]).name
    return entry["dir"] or name.endswith(".ckpt") or step_of(name) is not None


def seeing(node: Node) -> list[int]:
    """The nodes (ids) that see this node's working directory: itself, and those that share it (the same
    workdir id, recorded by the health probe)."""
    if not node.workdir_id:
        return [node.pk]
    return [node.pk, *Node.objects.filter(workdir_id=node.workdir_id).exclude(pk=node.pk).values_list("pk", flat=True)]


def _record(rank: Rank, entries: list[dict], by_glob: set[str]) -> int:
    job, node = rank.job, rank.node
    ended = rank.state != Rank.State.RUNNING
    # a checkpoint in a working directory several nodes share is one checkpoint, recorded by the first of them
    known = {c.path: c for c in Checkpoint.objects.filter(job=job, node__in=seeing(node)).order_by("-pk")}
    ready = 0
    for entry in entries:
        entry["glob"] = entry["path"] in by_glob
        found = _candidate(job, entry)
        if found is None:
            continue
        step, kind = found
        complete = kind == Checkpoint.Kind.FILE or entry.get("trainer_state") or entry["glob"]
        old = known.get(entry["path"])
        unchanged = old is not None and old.size == entry["size"] and old.mtime == entry["mtime"]
        is_ready = bool(complete and (unchanged or ended) and entry["size"] > 0)
        if old is None:
            try:
                with transaction.atomic():
                    Checkpoint.objects.create(
                        job=job, node=node, path=entry["path"], size=entry["size"], mtime=entry["mtime"], step=step,
                        kind=kind, ready=is_ready, attempt=job.attempt,
                    )  # fmt: skip
            except IntegrityError:  # recorded meanwhile by another scan of it (a node sharing the directory, a
                continue  # second caller): the next scan judges it against that row
        elif not (unchanged and old.ready == is_ready):
            # written again where retention had deleted it: there again, to be judged again (jobs/retention.py)
            back = {"removed_at": None, "keep_reason": ""} if old.removed_at and not unchanged else {}
            Checkpoint.objects.filter(pk=old.pk).update(
                size=entry["size"], mtime=entry["mtime"], step=step, kind=kind, ready=is_ready, **back
            )
        ready += is_ready
    return ready


def offered(job: Job) -> list[Checkpoint]:
    """The job's checkpoints that a resume may use, newest step first; one seen from several nodes that share a
    working directory is offered once (as the first of them recorded it). One that retention deleted, or is
    deleting, is not (jobs/retention.py)."""
    ready = job.checkpoints.select_related("node").filter(ready=True, step__isnull=False, removed_at__isnull=True)
    ready = ready.exclude(keep_reason__startswith="freeing")
    out, seen = [], set()
    for c in ready.order_by("-step", "-mtime", "pk"):
        where = (c.node.workdir_id or f"node {c.node_id}", c.path)
        if where not in seen:
            seen.add(where)
            out.append(c)
    return out


def choose(job: Job, wanted: str | int | None = "latest") -> Checkpoint:
    """The checkpoint at step `wanted` (or the latest); ValueError with a one-line reason if there is none."""
    ready = offered(job)
    if not ready:
        pending = job.checkpoints.filter(ready=False).count()
        more = f" ({pending} still being written or incomplete)" if pending else ""
        raise ValueError(f"job {job.name} has no complete checkpoint to resume from{more}")
    if wanted in (None, "", "latest"):
        return ready[0]
    try:
        step = int(wanted)
    except (TypeError, ValueError):
        raise ValueError(f"--from must be a step number or 'latest', not {wanted!r}") from None
    for c in ready:
        if c.step == step:
            return c
    steps = ", ".join(str(c.step) for c in ready[:20])
    raise ValueError(f"job {job.name} has no complete checkpoint at step {step} (steps: {steps})")


def path_for_rank0(checkpoint: Checkpoint) -> str:
    """How rank 0 names the checkpoint: relative to where the ranks start (the job's synced copy, else the
    workdir) when it lies under it (the same relative path then holds on any node it is copied to), else
    its absolute path."""
    start = sync.start_dir(checkpoint.job, checkpoint.node).rstrip("/") + "/"
    if checkpoint.path.startswith(start):
        return checkpoint.path[len(start) :]
    return checkpoint.path


def resume_args(job: Job) -> list[str]:
    """The resume argument for the current attempt, from the job's template (none when from scratch)."""
    if not job.resume_path:
        return []
    return [item.replace("{checkpoint}", job.resume_path) for item in job.resume_template.split()]


def batch_args(job: Job) -> list[str]:
    """The batch arguments from the job's batch template, e.g. --batch-size 8 --grad-accum 2 (none if unset)."""
    batch = job.current.batch if job.current else job.batch  # a dry run's job has no attempt yet
    if not job.batch_template or not batch:
        return []
    values = {"batch": str(batch.get("batch")), "accum": str(batch.get("accum", 1))}
    out = []
    for item in job.batch_template.split():
        for key, value in values.items():
            item = item.replace("{" + key + "}", value)
        out.append(item)
    return out


def target_path(checkpoint: Checkpoint, node: Node) -> str:
    rel = path_for_rank0(checkpoint)
    return rel if rel.startswith("/") else f"{sync.start_dir(checkpoint.job, node).rstrip('/')}/{rel}"


def ensure_on(checkpoint: Checkpoint, nodes: list[Node]) -> None:
    """Make the checkpoint present on every node of an attempt: rank 0 reads it in the reference script,
    but frameworks such as the Hugging Face Trainer load it on every rank. It travels by the one transfer path
    (jobs/transfer.py): taken into its node's store, sent in checked chunks along a chain of the nodes that lack
    it (a node that holds the same bytes gets nothing; a cut copy resumes), and put at its place on each node as
    read-only hard links. Nodes that share a working directory (the same workdir id, asked now) are one place: the
    source's sharers see it already, and of any other such group one node gets the copy and the rest see it (each
    checked: one that does not gets its own). ValueError with a one-line reason."""
    source = checkpoint.node
    places = [source, *[n for n in nodes if n.pk != source.pk]]
    if len(places) == 1:
        return
    asked = on_each(places, lambda n: node_request(n, "workdir_id", timeout=COPY_TIMEOUT_S, workdir=n.workdir))
    ids = {node.pk: (answer or {}).get("workdir_id") for node, answer, _ in asked}  # a node that did not say: alone
    # the checkpoint's node gone: its workdir's id as its last probe read it (the others of its directory see it)
    ids[source.pk] = ids[source.pk] or source.workdir_id or None
    firsts, sharers = sync.one_per_workdir(places, ids)
    targets = firsts[1:]  # the source is first: its sharers are checked like any other
    paths = {n.pk: target_path(checkpoint, n) for n in places}  # here: the job's rows read once, not per thread
    staged: list[dict] = []

    def copy(to: list[Node]) -> None:
        if not staged:
            staged.append(_stage(checkpoint))
        manifest = staged[0]
        try:
            transfer.deliver(transfer.objects_of(manifest), to, holders=[source], what=f"checkpoint {label}")
            transfer.place(to, lambda n: paths[n.pk], manifest["files"], what=f"checkpoint {label}", copies=True)
        except transfer.TransferError as exc:
            raise ValueError(f"copying checkpoint {label}: {exc}") from None
        if not checkpoint.sha256:
            files = manifest["files"]
            digest = files[0]["sha256"] if manifest.get("file") else _list_digest(
                [{"name": f["path"], "sha256": f["sha256"]} for f in files])  # fmt: skip
            Checkpoint.objects.filter(pk=checkpoint.pk).update(sha256=digest)
        log.info("checkpoint %s on %s", label, ", ".join(n.name for n in to))

    label = f"{source.name}:{checkpoint.path}"
    if targets:
        copy(targets)
    astray = []
    for node, answer, err in on_each(sharers, lambda n: node_request(n, "stat", timeout=COPY_TIMEOUT_S,
                                                                       paths=[paths[n.pk]])):  # fmt: skip
        if err is not None:
            raise ValueError(f"{node.name}: {err}")
        if not answer["exists"].get(paths[node.pk]):
            log.warning("%s shares a workdir id but does not see %s: copying it there", node.name, paths[node.pk])
            astray.append(node)
    if astray:
        copy(astray)


def _stage(checkpoint: Checkpoint) -> dict:
    """The checkpoint's files taken into its node's store, with their sha256 and chunk sums."""
    try:
        return transfer.stage_on(checkpoint.node, checkpoint.path)
    except Exception as exc:  # the node that holds it does not answer, or the files are gone
        raise ValueError(f"checkpoint {checkpoint.node.name}:{checkpoint.path} cannot be read: {exc}") from None


def _list_digest(files: list[dict]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f['name']}\0{f['sha256']}\n".encode())
    return h.hexdigest()
