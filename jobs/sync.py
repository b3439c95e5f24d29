"""The same code on every node: a directory snapshotted when a job is launched, copied to every node of
each attempt before its ranks start, and the ranks started in that copy (docs/sync.md).

At launch the directory's manifest (ugro_client/manifest.py: .gitignore respected, EXCLUDED names left
out, a size limit) is built and each file is kept once in the controller's content store
(<data>/sync/objects/<sha256[:2]>/<sha256>), so the job runs the code as it was when launched, however
long it queues. A `ugro` client uploads its directory's files into the same store through the API.

Before an attempt starts, the job's copy is built on each node at <workdir>/outputs/<job>/code and moved
into place whole. Only objects the node's own store lacks travel: a few small ones inside one request, more
as one stream (the manifest, then a tar of the objects) to the node's agent, on a port of the node's
127.0.0.1 reached through SSH (`ssh -W` held to the node's pinned host key, else a forwarded channel of the
node's own SSH connection; where sshd forwards nothing, a receiver process started there). Each object is
written at its path in the copy and kept in the node's store once checked against its sha256; every other
file is a hard link to that store. A node that fails any step fails the attempt before a rank starts.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

from cluster.fanout import node_request, on_each
from cluster.links import AgentRequestError, node_file
from cluster.models import ClusterSettings, Node
from ugro_client.manifest import Manifest, ManifestError, build, digest_of, git_info

from .models import Job, JobCode

log = logging.getLogger(__name__)

INLINE_BYTES = 1024 * 1024  # up to this much to send travels inside one request: no second channel to open
STREAM_PIECE = 1024 * 1024  # bytes handed to the link at a time while objects stream to a node
STREAM_TIMEOUT_S = 600.0  # a stream's every step, and its end: 200 MB over a slow Wi-Fi link
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


def node_store(node: Node) -> str:
    return f"{node.workdir.rstrip('/')}/.ugro/objects"


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


def one_per_workdir(nodes: list[Node], ids: dict[int, str | None]) -> tuple[list[Node], list[Node]]:
    """(one node of each working directory, the other nodes that share one of those), in the nodes' order: nodes
    answering the same workdir id (ids, by node pk) see the same directory; a node without an id is alone."""
    first: dict[str, Node] = {}
    builders, sharers = [], []
    for node in nodes:
        wid = ids.get(node.pk)
        if wid and wid in first:
            sharers.append(node)
        else:
            builders.append(node)
            if wid:
                first[wid] = node
    return builders, sharers


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
    lacks is sent first. The bytes sent; SyncError naming the nodes that failed."""
    sizes = {f["sha256"]: f["size"] for f in manifest["files"]}
    asked = on_each(nodes, lambda node: [] if known[node.pk] else _missing(node, digest, manifest))
    _fail_on(asked)
    lacking = {node.pk: missing for node, missing, _ in asked}
    # Each distinct stream is built once, however many nodes take it (a cold cluster: one for all); the
    # OpenSSH client of each node then reads it through the kernel, not through this process.
    streams: dict[tuple[str, ...], StreamFile] = {}

    def deliver(node: Node) -> int:
        store, dest = node_store(node), code_dir_on(job, node)
        missing = lacking[node.pk]
        sent = sum(sizes[sha] for sha in missing)
        if sent > INLINE_BYTES:
            _stream(node, store, digest, dest, len(missing), streams[tuple(missing)])
        else:
            _apply(node, store, digest, dest, manifest, missing)
        return sent

    try:
        # written on threads of their own while the nodes' connections for them are made; each begins the same
        head = b""
        for missing in lacking.values():
            if tuple(missing) not in streams and sum(sizes[sha] for sha in missing) > INLINE_BYTES:
                head = head or receiver_head(manifest)
                streams[tuple(missing)] = StreamFile(TarStream(missing, sizes, head=head))
        results = on_each(nodes, deliver)
    finally:
        for stream in streams.values():
            stream.close()
    for stream in streams.values():  # one line for all the nodes it failed (an object gone or cut short, no room)
        try:
            stream.wait()
        except SyncError as exc:
            raise SyncError(f"code sync failed: {exc}") from None
    _fail_on(results)
    return sum(sent for _, sent, _ in results)


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


def _stream(node: Node, store: str, digest: str, dest: str, count: int, stream: StreamFile) -> None:
    """Build the job's copy on a node through one stream (`stream`, built by push: the receiver's source, the
    manifest, then a tar of the objects the node lacks), raw bytes beside the node's link, read by
    codesync.py _sync_receive: each object written once, at its path in the copy, and kept in the store once
    checked against its sha256; the other files linked from the store. SyncError in one line (the copy
    removed, dest as it was).

    The stream goes to the node's agent, which runs the receiver in a thread of its own, on a port of the
    node's 127.0.0.1 that its sshd forwards to (codesync.py op_sync_listen): nothing is started on the node,
    not even the login shell and its .bashrc. Where the node's sshd forwards no connections, a receiver of its
    own is run there instead, the stream its stdin."""
    link = node.link()
    if not link.forward_refused:
        listen = node_request(node, "sync_listen", timeout=REQUEST_TIMEOUT_S, store=store, count=count,
                              digest=digest, dest=dest)  # fmt: skip
        token = f"{listen['token']}\n".encode()
        got = link.forward(int(listen["port"]), token, stream, timeout=STREAM_TIMEOUT_S)
        if got is not None:
            rc, answer = got
            if rc == 0 and answer.startswith("ok "):
                return
            detail = (answer.strip().splitlines() or ["no answer"])[-1].removeprefix("refused: ")
            raise SyncError(f"receiving the code there failed: {detail}")
    # -S: no site (site-packages, .pth files, sitecustomize): the stdlib-only receiver starts in about 6 ms less.
    argv = [node.agent_python, "-S", "-c", RECEIVE_BOOTSTRAP, store, str(count), digest, dest]
    rc, err = link.run_with_input(argv, stream, timeout=STREAM_TIMEOUT_S)
    if rc != 0:
        detail = (err.strip().splitlines() or ["no output"])[-1]
        raise SyncError(f"receiving the code there failed (exit {rc}): {detail}")


# The node's receiver is codesync.py run alone (its __name__ says so) by the python the agent runs on, its source
# ahead of the stream on stdin as the agent's is: nothing installed on the node, and only the stream's bytes travel
# beside the link. It writes each object once, hashing it as it goes (`tar -x` then a check read each file twice).
RECEIVE_BOOTSTRAP = (
    "import sys;b=sys.stdin.buffer;n=int(b.readline());"
    "exec(compile(b.read(n),'ugro-sync-receive','exec'),{'__name__':'__ugro_sync_receive__'})"
)


def receiver_head(manifest: dict) -> bytes:
    """What goes ahead of the objects in a stream: the receiver's source, then the manifest twice: as
    NUL-terminated fields the receiver reads without importing json (codesync.py _sync_listing), and as the JSON
    it keeps for the next sync (it is not parsed there)."""
    fields: list[str] = []
    for f in manifest["files"]:
        fields += ["F", f["sha256"], str(int(f["size"])), str(int(f.get("mode", 0o644))), f["path"]]
    for link in manifest.get("links") or []:
        fields += ["L", link["path"], str(link["target"])]
    if any("\0" in field for field in fields):
        raise SyncError("a manifest path or symlink target holds a NUL byte")
    listing = "".join(field + "\0" for field in fields).encode("utf-8", "surrogateescape")
    saved = json.dumps({"files": manifest["files"], "links": manifest.get("links") or []}).encode()
    src = node_file("codesync.py")
    return b"%d\n" % len(src) + src + b"%d %d\n" % (len(listing), len(saved)) + listing + saved


class TarStream:
    """A tar stream (ustar) of the controller's objects, one member per sha256, after `head` (bytes that go
    first), in pieces of about STREAM_PIECE bytes; iterable again from its start (a stream that must go
    another way)."""

    def __init__(self, shas: list[str], sizes: dict[str, int], head: bytes = b"") -> None:
        self.shas, self.sizes, self.head = shas, sizes, head

    def __iter__(self):
        objects = str(store_dir() / "objects")
        parts: list[bytes] = [self.head]
        held = len(self.head)
        for sha in self.shas:
            size = self.sizes[sha]
            parts.append(tar_header(sha, size))
            fd = os.open(os.path.join(objects, sha[:2], sha), os.O_RDONLY)
            try:
                left = size
                while left > 0:
                    block = os.read(fd, min(STREAM_PIECE, left))
                    if not block:
                        raise SyncError(f"object {sha[:12]} in the controller's store is shorter than recorded")
                    parts.append(block)
                    left -= len(block)
                    held += len(block)
                    if held >= STREAM_PIECE:
                        yield b"".join(parts)
                        parts, held = [], 0
            finally:
                os.close(fd)
            parts.append(b"\0" * (-size % tarfile.BLOCKSIZE))
        parts.append(b"\0" * (2 * tarfile.BLOCKSIZE))
        yield b"".join(parts)


class StreamFile:
    """A stream written once to an unnamed file beside the store, then sent to as many nodes as take it: it has
    a fileno() (NodeLink.run_with_input's OpenSSH path hands it to the kernel), and as an iterable it yields
    its bytes from the start in pieces of STREAM_PIECE bytes, each time it is iterated.

    Written on a thread of its own, from the start: the nodes' connections (an SSH handshake and a Python start
    each) are made meanwhile, and each waits for the file whole. A stream that could not be written (an object
    gone or cut short in the store, no room) raises SyncError to each reader; `error` says why."""

    def __init__(self, chunks) -> None:
        store_dir().mkdir(parents=True, exist_ok=True)
        self.file = tempfile.TemporaryFile(dir=store_dir())
        self.size = 0
        self.error: BaseException | None = None
        self._written = threading.Event()
        threading.Thread(target=self._write, args=(chunks,), name="ugro-sync-stream", daemon=True).start()

    def _write(self, chunks) -> None:
        try:
            for chunk in chunks:
                self.file.write(chunk)
            self.file.flush()
            self.size = self.file.tell()
        except BaseException as exc:  # told to every reader
            self.error = exc
        finally:
            self._written.set()

    def wait(self) -> None:
        """Until the file is whole; SyncError if it could not be written."""
        self._written.wait()
        if self.error is not None:
            raise SyncError(f"the stream could not be built: {self.error}")

    def fileno(self) -> int:
        self.wait()
        return self.file.fileno()

    def __iter__(self):
        self.wait()
        fd, offset = self.file.fileno(), 0
        while offset < self.size:
            block = os.pread(fd, min(STREAM_PIECE, self.size - offset), offset)
            if not block:
                raise SyncError("the stream's file ended before its size")
            offset += len(block)
            yield block

    def close(self) -> None:
        self._written.wait()  # its thread writes to the file until then
        self.file.close()


def tar_header(name: str, size: int) -> bytes:
    """The ustar header tarfile writes for a read-only file of that name (ASCII, under 100 bytes) and size,
    owned by uid 0, mtime 0; built directly: tarfile's own takes longer than reading a small file."""
    head = name.encode().ljust(100, b"\0") + b"0000444\x000000000\x000000000\x00%011o\x0000000000000\x00" % size
    tail = b"0" + b"\0" * 100 + b"ustar\x0000" + b"\0" * 247
    checksum = sum(head) + sum(tail) + 8 * 32
    return head + b"%06o\x00 " % checksum + tail


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
