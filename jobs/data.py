"""Datasets and model weights on every node (docs/data.md): `--data SRC[:DEST]` puts a directory or file of the
controller (SRC a path) or of one node (SRC `NODE:PATH`) at DEST in the job's directory (`{job_dir}/DEST`,
<workdir>/outputs/<job>/DEST) on every node of each attempt, before pre-flight, as read-only hard links into the
node's store, or the attempt fails before anything starts.

Staging hashes the source once (each file's sha256 and its chunk sums; the controller keeps them by path, size
and mtime, so a second launch of the same 20 GB reads nothing); the bytes travel by jobs/transfer.py, the one
transfer path: a node that has them already gets nothing, the others get them node to node.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import time
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

from cluster.models import ClusterSettings, Node

from . import transfer
from .models import Job, JobCode
from .sync import check_source, save_manifest

RESERVED = ("code", ".ugro")  # the synced copy's place, UGRO's records
STAGE_TIMEOUT_S = 3600.0


class DataError(ValueError):
    """A --data item that cannot be used: one line."""


@dataclass
class Item:
    src: str  # a controller path (as given), or the path on `node`
    dest: str  # relative to the job's directory
    node: str = ""  # the node that holds it ('' : the controller)

    def as_dict(self) -> dict:
        return {"src": self.src, "dest": self.dest, "node": self.node}

    def label(self) -> str:
        return f"{self.node}:{self.src}" if self.node else self.src


def parse(value: str, node_names: set[str] | None = None) -> Item:
    """SRC[:DEST], SRC a controller path or NODE:PATH (PATH absolute or ~); DataError in one line."""
    if not isinstance(value, str) or not value.strip() or "\0" in value or "\n" in value:
        raise DataError("--data needs SRC[:DEST]")
    value = value.strip()
    names = node_names if node_names is not None else set(Node.objects.values_list("name", flat=True))
    parts = value.split(":")
    node = ""
    if len(parts) >= 2 and parts[0] in names and parts[1].startswith(("/", "~")):
        node, parts = parts[0], parts[1:]
    if len(parts) > 2:
        raise DataError(f"--data {value}: SRC[:DEST] with at most one ':' after the node")
    src = parts[0]
    if not src:
        raise DataError(f"--data {value}: no source")
    dest = parts[1] if len(parts) == 2 else posixpath.basename(src.rstrip("/")) or "data"
    return Item(src=src, dest=check_dest(dest, value), node=node)


def check_dest(dest: str, given: str) -> str:
    """A destination inside the job's directory: relative, no '..', not UGRO's own places."""
    norm = posixpath.normpath(dest) if dest else ""
    if not dest or dest.startswith(("/", "~")) or norm in (".", "..") or norm.startswith("../"):
        raise DataError(f"--data {given}: the destination {dest!r} escapes the job's directory")
    if norm.split("/")[0] in RESERVED:
        raise DataError(f"--data {given}: the destination {norm!r} is UGRO's (the synced code, .ugro)")
    if any(c in norm for c in "\r\t") or len(norm) > 300:
        raise DataError(f"--data {given}: a bad destination")
    return norm


def check(items: list[Item], cs: ClusterSettings) -> list[Item]:
    """Each item checked at launch: a controller source inside paths.sync_roots and readable, destinations that
    do not overlap. DataError in one line."""
    seen: list[str] = []
    for item in items:
        if not item.node:
            real = _controller_source(item, cs)
            if not os.access(real, os.R_OK):
                raise DataError(f"--data {item.src}: not readable")
        for other in seen:
            if item.dest == other or item.dest.startswith(other + "/") or other.startswith(item.dest + "/"):
                raise DataError(f"--data: two items at {item.dest} and {other}")
        seen.append(item.dest)
    return items


def _controller_source(item: Item, cs: ClusterSettings) -> str:
    try:
        real = check_source(item.src, cs) if os.path.isdir(os.path.expanduser(item.src)) else None
    except ValueError as exc:
        raise DataError(str(exc).replace("--sync", "--data")) from None
    if real is None:  # a file: its directory must be inside the roots
        path = os.path.realpath(os.path.expanduser(item.src))
        if not os.path.isfile(path):
            raise DataError(f"--data {item.src}: no such file or directory on the controller")
        try:
            check_source(os.path.dirname(path), cs)
        except ValueError as exc:
            raise DataError(str(exc).replace("--sync", "--data")) from None
        real = path
    return real


def check_cluster_value(value) -> None:
    """cluster.yaml's training.data, read at import: a list of SRC[:DEST] (a node's name before ':' is taken as a
    NODE:PATH source); ValueError in one line. The sources themselves are checked at each launch."""
    items = value if isinstance(value, list) else [value]
    for item in items:
        if not isinstance(item, str) or not item.strip():
            raise ValueError("must be a list of SRC[:DEST] items, e.g. ['~/datasets/tiny:tiny']")
        head, _, rest = item.partition(":")
        parse(item, {head} if rest.startswith(("/", "~")) else set())


def cluster_items(cs: ClusterSettings) -> list[str]:
    """Data every job gets (cluster.yaml training.data: a list of SRC[:DEST])."""
    value = (cs.training or {}).get("data") or []
    return [str(v) for v in (value if isinstance(value, list) else [value]) if str(v).strip()]


# -- staging -----------------------------------------------------------------------------------------------


def _hash_dir() -> Path:
    return Path(settings.DATA_DIR) / "data" / "hashes"


def hash_file(path: str) -> dict:
    """A controller file's sha256 and chunk sums, read once per (size, mtime): kept under <data>/data/hashes."""
    st = os.stat(path)
    key = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}".encode()).hexdigest()
    cache = _hash_dir() / key[:2] / f"{key}.json"
    try:
        return json.loads(cache.read_text())
    except (OSError, ValueError):
        pass
    whole, sums, size = hashlib.sha256(), [], 0
    with open(path, "rb") as fh:
        while True:
            block = fh.read(transfer.CHUNK)
            if not block:
                break
            size += len(block)
            whole.update(block)
            sums.append(hashlib.sha256(block).hexdigest())
    if size != st.st_size:
        raise DataError(f"{path} changed while it was read; launch again")
    out = {"sha256": whole.hexdigest(), "size": size, "chunks": sums if size > transfer.CHUNK else [],
           "mtime_ns": st.st_mtime_ns}  # fmt: skip
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(out))
    tmp.replace(cache)
    return out


def stage_controller(item: Item, cs: ClusterSettings) -> tuple[dict, list[transfer.Obj]]:
    """(manifest, objects) of a controller source, read where it is (not copied into the controller's store)."""
    real = _controller_source(item, cs)
    if os.path.isfile(real):
        names = [""]
    else:
        names = []
        for base, dirs, files in os.walk(real):
            dirs.sort()
            names += [os.path.relpath(os.path.join(base, f), real) for f in sorted(files)]
    files, objs = [], []
    for name in names:
        full = os.path.join(real, name) if name else real
        if os.path.islink(full) or not os.path.isfile(full):
            continue
        try:
            h = hash_file(full)
        except OSError as exc:
            raise DataError(f"--data {item.src}: {name or real}: {exc.strerror}") from None
        files.append({"path": name, "sha256": h["sha256"], "size": h["size"], "mode": 0o444})
        objs.append(transfer.Obj(h["sha256"], h["size"], h["chunks"], full, h["mtime_ns"]))
    if not files:
        raise DataError(f"--data {item.src}: no files there")
    return {"files": files}, objs


def stage_node(item: Item) -> tuple[Node, dict, list[transfer.Obj]]:
    """A node's source taken into that node's store (hashed there, on a thread of its agent)."""
    try:
        node = Node.objects.get(name=item.node)
    except Node.DoesNotExist:
        raise DataError(f"--data {item.label()}: no node {item.node}") from None
    try:
        manifest = transfer.stage_on(node, item.src, STAGE_TIMEOUT_S)
    except Exception as exc:
        raise DataError(f"--data {item.label()}: {exc}") from None
    if not manifest["files"]:
        raise DataError(f"--data {item.label()}: no files there")
    objs = transfer.objects_of(manifest)
    files = [{"path": f["path"], "sha256": f["sha256"], "size": f["size"], "mode": 0o444} for f in manifest["files"]]
    return node, {"files": files}, objs


def dest_on(job: Job, node: Node, dest: str) -> str:
    return f"{node.workdir.rstrip('/')}/outputs/{job.name}/{dest}"


def deliver(job: Job, nodes: list[Node]) -> transfer.Delivered | None:
    """Every --data item of the job at its place on every node; DataError / TransferError in one line (nothing
    has started then). The result's peer_bytes counts every byte that went node to node (sources and relays). The
    delivery's figures and each node's progress are kept on the job's code record."""
    code = JobCode.objects.filter(job=job).first()
    if code is None or not code.data:
        return None
    cs = ClusterSettings.load()
    t0 = time.monotonic()
    total = transfer.Delivered()
    record = {"stage": "staging", "nodes": {}, "started": time.time()}
    _save(code, record)

    def progress(report: dict) -> None:
        record["stage"] = "sending"
        record["nodes"].update(report)
        _save(code, record)

    items = []
    for raw in code.data:
        item = Item(raw["src"], raw["dest"], raw.get("node") or "")
        if item.node:
            holder, manifest, objs = stage_node(item)
            holders = [holder]
        else:
            manifest, objs = stage_controller(item, cs)
            holders = []
        raw.update(files=len(manifest["files"]), bytes=sum(f["size"] for f in manifest["files"]),
                   digest=hashlib.sha256(json.dumps(manifest["files"], sort_keys=True).encode()).hexdigest(),
                   manifest=save_manifest({"files": manifest["files"]}))  # what the caches keep (jobs/cache.py)
        items.append((item, manifest, objs, holders))
    JobCode.objects.filter(pk=code.pk).update(data=code.data)
    for item, manifest, objs, holders in items:
        got = transfer.deliver(objs, nodes, holders=holders, what=f"data {item.label()}", progress=progress)
        total.controller_bytes += got.controller_bytes
        total.peer_bytes += got.peer_bytes + got.relayed_bytes
        total.rounds = max(total.rounds, got.rounds)
        for name, n in got.nodes.items():
            mine = total.nodes.setdefault(name, {"bytes": 0, "total": 0, "held": 0})
            for k in mine:
                mine[k] += n[k]
        files = manifest["files"]
        transfer.place(nodes, lambda n, d=item.dest: dest_on(job, n, d), files, what=f"data {item.label()}")
    total.seconds = time.monotonic() - t0
    record.update(stage="done", seconds=round(total.seconds, 3), controller_bytes=total.controller_bytes,
                  peer_bytes=total.peer_bytes, rounds=total.rounds, nodes=total.nodes)  # fmt: skip
    _save(code, record)
    return total


def _save(code: JobCode, record: dict) -> None:
    JobCode.objects.filter(pk=code.pk).update(transfer=json.loads(json.dumps(record)))


def summary(code: JobCode) -> str:
    """One line for status and the job page: what the data is and how its last delivery went."""
    if not code.data:
        return ""
    items = ", ".join(f"{(d.get('node') + ':') if d.get('node') else ''}{d['src']} -> {d['dest']}" for d in code.data)
    size = sum(int(d.get("bytes") or 0) for d in code.data)
    t = code.transfer or {}
    if t.get("stage") == "done":
        how = (f"delivered in {t.get('seconds', 0):.1f}s ({transfer_gb(t.get('controller_bytes', 0))} from the "
               f"controller, {transfer_gb(t.get('peer_bytes', 0))} node to node)")  # fmt: skip
    elif t.get("stage"):
        nodes = t.get("nodes") or {}
        parts = [f"{name} {transfer_gb(n.get('held', 0))}/{transfer_gb(n.get('total', 0))} "
                 f"({transfer_gb(n.get('rate', 0))}/s)" for name, n in sorted(nodes.items())]  # fmt: skip
        how = f"{t['stage']}: " + (", ".join(parts) or "asking the nodes")
    else:
        how = "not delivered yet"
    return f"data: {items} ({transfer_gb(size)}), {how}"


def transfer_gb(n: float) -> str:
    n = float(n or 0)
    if n >= 1e9:
        return f"{n / 1e9:.1f} GB"
    if n >= 1e6:
        return f"{n / 1e6:.1f} MB"
    return f"{n / 1e3:.0f} kB" if n >= 1e3 else f"{n:.0f} B"
