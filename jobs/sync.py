"""The same code on every node: a directory snapshotted when a job is launched, copied to every node of
each attempt before its ranks start, and the ranks started in that copy (docs/sync.md).

At launch the directory's manifest (ugro_client/manifest.py: .gitignore respected, EXCLUDED names left
out, a size limit) is built and each file is kept once in the controller's content store
(<data>/sync/objects/<sha256[:2]>/<sha256>), so the job runs the code as it was when launched, however
long it queues. A `ugro` client uploads its directory's files into the same store through the API.

Before an attempt starts, the job's copy is built on each node at <workdir>/outputs/<job>/code and moved
into place whole. Only objects the node's own store lacks travel: a few small ones inside the request that builds
the copy, more by the one transfer path (jobs/transfer.py: into each node's store in checked chunks, along a chain
of the nodes that lack them, resumable), after which every file of the copy is a hard link to that store. A node
that fails any step fails the attempt before a rank starts.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

from cluster.fanout import node_request, on_each
from cluster.links import AgentRequestError
from cluster.models import ClusterSettings, Node
from ugro_client.manifest import Manifest, ManifestError, build, digest_of, git_info

from . import transfer
from .models import Job, JobCode
from .transfer import node_store, one_per_workdir

log = logging.getLogger(__name__)

INLINE_BYTES = 1024 * 1024  # up to this much to send travels inside one request: no transfer to set up
REQUEST_TIMEOUT_S = 60.0


class SyncError(ValueError):
    """A directory that cannot be synced, or a node that did not take it: one line."""


@dataclass
class Pushed:
    seconds: float
    sent_bytes: int
    nodes: int


def store_dir() -> Path:
    return Path(settings.DATA_DIR) / "sync"


def _object(sha: str) -> Path:
    return store_dir() / "objects" / sha[:2] / sha


def _manifest_file(digest: str) -> Path:
    return store_dir() / "manifests" / f"{digest}.json"


def code_dir_on(job: Job, node: Node) -> str:
    """Where the job's copy lives on a node, and where its ranks start: <workdir>/outputs/<job>/code."""
    return f"{node.workdir.rstrip('/')}/outputs/{job.name}/code"


def job_sync_digest(job: Job) -> str:
    """The digest of the job's code snapshot, '' when it runs from each node's working directory."""
    if job.pk is None or job.pk < 0:
        return ""
    try:
        return job.code.sync_digest
    except JobCode.DoesNotExist:
        return ""


def start_dir(job: Job, node: Node) -> str:
    """Where the job's ranks start on a node: its synced copy, else the node's working directory."""
    if getattr(job, "sync_planned", None) or job_sync_digest(job):
        return code_dir_on(job, node)
    return node.workdir


def check_digest(digest: str) -> str:
    if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise SyncError(f"not a sha256 digest: {str(digest)[:80]!r}")
    return digest


def sync_roots(cs: ClusterSettings) -> list[str]:
    """Directories on the controller that `launch --sync` may read (cluster.yaml paths.sync_roots; by
    default the home directory of the user UGRO runs as)."""
    configured = [str(r) for r in (cs.paths or {}).get("sync_roots") or [] if str(r).strip()] or ["~"]
    return [os.path.realpath(os.path.expanduser(r)) for r in configured]


def check_source(path: str, cs: ClusterSettings) -> str:
    """The real path of a directory to sync, refused in one line when it lies outside the sync roots."""
    if not path or "\0" in path:
        raise SyncError("--sync needs a directory")
    real = os.path.realpath(os.path.expanduser(path))
    roots = sync_roots(cs)
    if not any(real == r or real.startswith(r.rstrip("/") + "/") for r in roots):
        raise SyncError(f"--sync {path}: outside the directories UGRO may sync ({', '.join(roots)}; "
                        "cluster.yaml paths.sync_roots)")  # fmt: skip
    if not os.path.isdir(real):
        raise SyncError(f"--sync {path}: not a directory")
    return real


def snapshot(path: str) -> tuple[Manifest, dict]:
    """Take the directory's files into the controller's store as they are now; (manifest, git info)."""
    try:
        manifest = build(path)
    except ManifestError as exc:
        raise SyncError(str(exc)) from None
    for f in manifest.files:
        if _stored(f["sha256"], f["size"]):
            continue
        with open(os.path.join(manifest.root, f["path"]), "rb") as fh:
            got, _ = _keep(f["sha256"], iter(lambda fh=fh: fh.read(1 << 20), b""))
        if got != f["sha256"]:  # changed since the manifest read it: the launch says so
            raise SyncError(f"--sync: {f['path']} changed while it was copied; launch again")
    save_manifest(manifest.as_dict())
    return manifest, git_info(manifest.root)


def save_manifest(manifest: dict) -> str:
    digest = digest_of(manifest)
    path = _manifest_file(digest)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"files": manifest["files"], "links": manifest.get("links", [])}))
    tmp.replace(path)
    return digest


def load_manifest(digest: str) -> dict:
    try:
        return json.loads(_manifest_file(digest).read_text())
    except (OSError, ValueError):
        raise SyncError(f"the job's code snapshot {digest[:12]} is not in the controller's store") from None


def object_bytes(sha: str, limit: int) -> bytes:
    """A stored file's bytes; ValueError when it is bigger than limit, OSError when it is not stored."""
    path = _object(check_digest(sha))
    if path.stat().st_size > limit:
        raise ValueError(f"object {sha[:12]} is over {limit} bytes")
    return path.read_bytes()


def _stored(sha: str, size: int) -> bool:
    try:
        return _object(sha).stat().st_size == size
    except OSError:
        return False


def _keep(sha: str, chunks, limit: int | None = None) -> tuple[str, int]:
    """Write the chunks into the store as object sha, in one pass hashing them: kept only when their sha256
    is sha. (their sha256, their size); SyncError past limit bytes (nothing kept)."""
    target = _object(check_digest(sha))
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(f"{target.name}.{os.getpid()}.part")
    h, size = hashlib.sha256(), 0
    try:
        with open(part, "wb") as fh:
            for chunk in chunks:
                size += len(chunk)
                if limit is not None and size > limit:
                    raise SyncError(f"object {sha[:12]} is over the {limit / 1e6:.0f} MB upload limit")
                h.update(chunk)
                fh.write(chunk)
        if h.hexdigest() == sha:
            part.replace(target)
    finally:
        part.unlink(missing_ok=True)
    return h.hexdigest(), size


def missing_objects(manifest: dict) -> list[str]:
    """The objects of a manifest the controller's store lacks (what an upload must still send), each once."""
    missing: dict[str, None] = {}
    for f in manifest["files"]:
        if f["sha256"] not in missing and not _stored(f["sha256"], f["size"]):
            missing[f["sha256"]] = None
    return list(missing)


def push(job: Job, nodes: list[Node]) -> Pushed:
    """Copy the job's snapshot to every node and build its copy there; SyncError naming the nodes that
    failed (nothing has started then). Every node is asked what it lacks before any bytes travel: a node
    still connecting is not starved by the streams to the others.

    Nodes that share a working directory (an NFS home: the same id in it, cluster/node/probe.py) share its
    store and the job's copy: one of them builds it, and each other one is then asked whether it sees it (a
    workdir copied with its id would not: that node gets a copy of its own)."""
    code = JobCode.objects.get(job=job)
    digest = code.sync_digest
    manifest = load_manifest(digest)
    t0 = time.monotonic()
    asked = on_each(nodes, lambda node: _knows(node, digest))
    _fail_on(asked)
    known = {node.pk: bool(have["known"]) for node, have, _ in asked}
    builders, sharers = one_per_workdir(nodes, {node.pk: have.get("workdir_id") for node, have, _ in asked})
    sent = _build(job, builders, digest, manifest, known)
    if sharers:
        seen = on_each(sharers, lambda node: _sees_copy(job, node))
        _fail_on(seen)
        astray = [node for node, sees, _ in seen if not sees]
        if astray:
            names = ", ".join(n.name for n in astray)
            log.warning("job %s: %s share a workdir id with another node but not its copy (a workdir copied with "
                        "its .ugro/workdir-id?): building theirs", job.name, names)  # fmt: skip
            sent += _build(job, astray, digest, manifest, known)
    pushed = Pushed(time.monotonic() - t0, sent, len(nodes))
    JobCode.objects.filter(pk=code.pk).update(sync_s=pushed.seconds, sync_sent_bytes=pushed.sent_bytes)
    return pushed


def _fail_on(results: list) -> None:
    failed = [f"{node.name}: {err}" for node, _, err in results if err is not None]
    if failed:
        raise SyncError("code sync failed on " + "; ".join(failed))


def _sees_copy(job: Job, node: Node) -> bool:
    """Whether the node sees the job's copy another node of its working directory built."""
    dest = code_dir_on(job, node)
    return bool(node_request(node, "stat", timeout=REQUEST_TIMEOUT_S, paths=[dest])["exists"].get(dest))


def _build(job: Job, nodes: list[Node], digest: str, manifest: dict, known: dict[int, bool]) -> int:
    """Build the job's copy on each node (none of them sharing a working directory with another): what its store
    lacks is sent first, a few small objects inside the request that builds the copy, more by the one transfer path
    (jobs/transfer.py: checked chunks along a chain of the nodes, resumable), after which the copy is linked from
    the store alone. What left the controller for the code; SyncError naming the nodes that failed."""

    sizes = {f["sha256"]: f["size"] for f in manifest["files"]}
    asked = on_each(nodes, lambda node: [] if known[node.pk] else _missing(node, digest, manifest))
    _fail_on(asked)
    lacking = {node.pk: missing for node, missing, _ in asked}
    streamed = [node for node in nodes if sum(sizes[sha] for sha in lacking[node.pk]) > INLINE_BYTES]
    sent = 0
    if streamed:
        wanted = dict.fromkeys(sha for node in streamed for sha in lacking[node.pk])
        objs = [transfer.Obj(sha, sizes[sha], _chunk_sums(sha, sizes[sha], transfer.CHUNK), path=str(_object(sha)))
                for sha in wanted]  # fmt: skip
        try:
            sent += transfer.deliver(objs, streamed, what="code").controller_bytes
        except transfer.TransferError as exc:
            raise SyncError(str(exc).replace("code transfer failed on ", "code sync failed on ", 1)) from None

    def build(node: Node) -> int:
        store, dest = node_store(node), code_dir_on(job, node)
        if node in streamed:  # every object is in its store now
            _apply(node, store, digest, dest, manifest, [])
            return 0
        _apply(node, store, digest, dest, manifest, lacking[node.pk])
        return sum(sizes[sha] for sha in lacking[node.pk])

    results = on_each(nodes, build)
    _fail_on(results)
    return sent + sum(inline for _, inline, _ in results)


def _chunk_sums(sha: str, size: int, chunk: int) -> list[str]:
    """The sha256 of each chunk of a stored object larger than one chunk (a smaller one is checked whole)."""
    if size <= chunk:
        return []
    sums = []
    with open(_object(sha), "rb") as fh:
        for block in iter(lambda: fh.read(chunk), b""):
            sums.append(hashlib.sha256(block).hexdigest())
    if len(sums) != -(-size // chunk):
        raise SyncError(f"object {sha[:12]} in the controller's store is shorter than recorded")
    return sums


def _knows(node: Node, digest: str) -> dict:
    """Whether the node's store holds the snapshot whole ("known"), and the id of its working directory."""
    return node_request(node, "sync_have", timeout=REQUEST_TIMEOUT_S, store=node_store(node), digest=digest,
                        workdir=node.workdir)  # fmt: skip


def _missing(node: Node, digest: str, manifest: dict) -> list[str]:
    """The objects the node's store lacks for a snapshot it does not know yet."""
    return node_request(node, "sync_have", timeout=REQUEST_TIMEOUT_S, store=node_store(node), digest=digest,
                        manifest=manifest)["missing"]  # fmt: skip


def _apply(node: Node, store: str, digest: str, dest: str, manifest: dict, missing: list[str]) -> None:
    """Build the job's copy on a node whose store lacks a few small objects at most: they travel inside the
    request (codesync.py op_sync_apply), so a change of a file or two costs one request."""
    blobs = [{"sha256": sha, "data": base64.b64encode(_object(sha).read_bytes()).decode()} for sha in missing]
    try:
        node_request(node, "sync_apply", timeout=REQUEST_TIMEOUT_S, store=store, digest=digest, dest=dest,
                     blobs=blobs)  # fmt: skip
    except AgentRequestError as exc:  # a new agent since it was asked (the link reconnected)
        if "is not known here" not in str(exc):
            raise
        node_request(node, "sync_apply", timeout=REQUEST_TIMEOUT_S, store=store, digest=digest, dest=dest,
                     blobs=blobs, manifest=manifest)  # fmt: skip


# -- uploads from a client ---------------------------------------------------------------------------


def _upload_file(digest: str) -> Path:
    return store_dir() / "uploads" / f"{digest}.json"


def record_upload(manifest: dict, source: str, git: dict) -> tuple[str, list[str]]:
    """Keep an uploaded directory's manifest (and where it came from); (digest, objects still missing)."""
    files = manifest.get("files")
    if not isinstance(files, list) or not isinstance(manifest.get("links", []), list):
        raise SyncError('a manifest is {"files": [...], "links": [...]}')
    for f in files:
        if not isinstance(f, dict) or not isinstance(f.get("path"), str) or not isinstance(f.get("size"), int):
            raise SyncError("each manifest file needs path, sha256, size and mode")
        check_digest(f.get("sha256"))
        _check_rel(f["path"])
    for link in manifest.get("links", []):
        _check_rel(link.get("path"))
    digest = save_manifest(manifest)
    path = _upload_file(digest)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"source": source[:500], "git": git if isinstance(git, dict) else {}}))
    return digest, missing_objects(manifest)


def _check_rel(path: object) -> None:
    if not isinstance(path, str) or not path or path.startswith("/") or "\0" in path:
        raise SyncError(f"bad path in manifest: {str(path)[:200]!r}")
    if any(part in ("", ".", "..") for part in path.split("/")):
        raise SyncError(f"bad path in manifest: {path[:200]!r}")


def put_object(sha: str, chunks, limit: int) -> int:
    """Store one uploaded object from an iterable of byte chunks, checked against its sha256 (nothing is
    kept otherwise); refuses more than limit bytes. Returns its size."""
    got, size = _keep(sha, chunks, limit)
    if got != sha:
        raise SyncError(f"object {sha[:12]}: the uploaded bytes have sha256 {got[:12]}")
    return size


def _upload_meta(digest: str) -> dict:
    try:
        return json.loads(_upload_file(digest).read_text())
    except (OSError, ValueError):
        return {}


def upload_source(digest: str) -> str:
    return _upload_meta(digest).get("source") or f"upload {digest[:12]}"


def upload_git(digest: str) -> dict:
    return _upload_meta(digest).get("git") or {}
