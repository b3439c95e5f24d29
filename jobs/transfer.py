"""The one path by which bytes reach the nodes' stores: a dataset's files, model weights, checkpoint copies
(docs/data.md). Content-addressed (each file is an object named by its sha256, kept once per node in
<workdir>/.ugro/objects, shared by the nodes of one working directory), chunked (each CHUNK checked as it
arrives), resumable (a node keeps the chunks it checked; the next round starts from them) and fanned out node to
node: the nodes that lack objects form a chain, the source (a node that holds them, else the controller) sends
to the first, and each node passes every byte on to the next as it reads it (cluster/node/transfer.py). Each byte
leaves the controller about once, whatever the number of nodes.

A round asks every node what it holds and how much room it has (nothing is sent to a node that cannot hold it),
runs one chain per source, and asks again; a node the chain did not reach (its peer could not connect to it, a
node dropped mid-way) is taken again in the next round, from a node that now holds the objects or from the
controller. After ROUNDS rounds, the nodes still lacking something fail the delivery in one line.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cluster.fanout import node_request, on_each
from cluster.links import HostKeyError
from cluster.models import Node

log = logging.getLogger(__name__)

CHUNK = 8 << 20  # each chunk is checked on arrival; a cut transfer resumes from the last whole chunk
ROUNDS = 4  # chains run again for nodes a round did not complete (a peer unreachable, a node dropped)
REQUEST_TIMEOUT_S = 60.0
STALL_S = 300.0  # a chain whose nodes gain no byte for this long is given up (the round ends)
PROGRESS_EVERY_S = 2.0
FREE_MARGIN = 256 << 20  # left free on a node's disk beyond what it receives
PIECE = 1 << 20


def node_store(node: Node) -> str:
    """A node's store: one per working directory, shared by the nodes that share that directory."""
    return f"{node.workdir.rstrip('/')}/.ugro/objects"


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


class TransferError(ValueError):
    """Objects that could not be delivered: one line naming the nodes and why."""


@dataclass
class Obj:
    """One object to deliver: its sha256, size and chunk sums (empty: one chunk), and where the controller reads
    it from (None: only nodes hold it)."""

    sha: str
    size: int
    chunks: list[str] = field(default_factory=list)
    path: str | None = None
    mtime_ns: int | None = None  # the controller file's, when staged: a file changed since is refused

    def spec(self, offset: int = 0) -> dict:
        return {"sha": self.sha, "size": self.size, "offset": offset, "chunks": self.chunks}


@dataclass
class Delivered:
    seconds: float = 0.0
    controller_bytes: int = 0  # what left the controller
    peer_bytes: int = 0  # what a node that held the objects sent as a chain's source
    relayed_bytes: int = 0  # what the nodes of the chains passed on to the next node (the pipeline's hops)
    rounds: int = 0
    nodes: dict[str, dict] = field(default_factory=dict)  # name -> {bytes, total, from}


Progress = Callable[[dict[str, dict]], None]


def controller_chunks(objs: list[Obj], offsets: dict[str, int], sent: list[int]):
    """The bytes of objects read from the controller's files, each from its offset, in pieces; sent[0] counts."""
    for obj in objs:
        if obj.path is None:
            raise TransferError(f"object {obj.sha[:12]} is not on the controller")
        try:
            st = os.stat(obj.path)
        except OSError as exc:
            raise TransferError(f"{obj.path}: {exc.strerror}") from None
        if st.st_size != obj.size or (obj.mtime_ns is not None and st.st_mtime_ns != obj.mtime_ns):
            raise TransferError(f"{obj.path} changed since it was staged; launch again")
        pos = offsets[obj.sha]
        with open(obj.path, "rb") as fh:
            fh.seek(pos)
            while pos < obj.size:
                block = fh.read(min(PIECE, obj.size - pos))
                if not block:
                    raise TransferError(f"{obj.path} shrank while it was sent")
                pos += len(block)
                sent[0] += len(block)
                yield block


class _Chain:
    """One chain of a round: its source (None: the controller) and the nodes it passes through, in order."""

    def __init__(self, source: Node | None, nodes: list[Node], objs: list[Obj], held: dict[int, list[int]],
                 index: dict[str, int]) -> None:  # fmt: skip
        self.source, self.nodes, self.objs = source, nodes, objs
        self.offsets = {o.sha: min(max(0, held[n.pk][index[o.sha]]) for n in nodes) for o in objs}
        self.results: dict[str, str | None] = {}
        self.sent = [0]
        self.hops = 0  # the nodes that took the stream

    def run(self) -> None:
        listen = on_each(self.nodes, lambda n: node_request(n, "xfer_listen", timeout=REQUEST_TIMEOUT_S,
                                                             store=node_store(n), name=n.name))  # fmt: skip
        hops, failed = [], {}
        for node, answer, err in listen:
            if err is not None:
                failed[node.name] = f"could not take a transfer: {err}"
            else:
                hops.append({"name": node.name, "host": node.address, "port": int(answer["port"]),
                             "token": answer["token"]})  # fmt: skip
        self.results.update(failed)
        self.hops = len(hops)
        if not hops:
            return
        specs = [o.spec(self.offsets[o.sha]) for o in self.objs]
        if self.source is None:
            self.results.update(self._from_controller(hops, specs))
        else:
            self.results.update(self._from_node(hops, specs))

    def _from_controller(self, hops: list[dict], specs: list[dict]) -> dict[str, str | None]:
        first = next(n for n in self.nodes if n.name == hops[0]["name"])
        body = json.dumps({"objects": specs, "chunk": CHUNK, "rest": hops[1:]}).encode()
        head = hops[0]["token"].encode() + b"\n" + b"%d\n" % len(body) + body
        chunks = _Restartable(lambda: controller_chunks(self.objs, self.offsets, self.sent))
        got = first.link().forward(hops[0]["port"], head, chunks, timeout=STALL_S)
        if got is None:  # the node's sshd forwards nothing: straight to its listener (it binds every address)
            got = _direct(hops[0], head, chunks)
        rc, answer = got
        try:
            results = json.loads(answer.strip().splitlines()[-1]) if rc == 0 and answer.strip() else None
        except ValueError:
            results = None
        if not isinstance(results, dict):
            why = (answer.strip().splitlines() or
                   [f"exit {rc}" if rc else "the first node closed the stream without an answer"])[-1][:300]
            return {h["name"]: f"the stream from the controller failed: {why}" for h in hops}
        return {h["name"]: results.get(h["name"], "no answer") for h in hops}

    def _from_node(self, hops: list[dict], specs: list[dict]) -> dict[str, str | None]:
        src = self.source
        task = node_request(src, "xfer_send", timeout=REQUEST_TIMEOUT_S, store=node_store(src), objects=specs,
                            chunk=CHUNK, rest=hops, name=src.name)["task"]  # fmt: skip
        self.sent[0] = sum(o.size - self.offsets[o.sha] for o in self.objs)
        deadline = time.monotonic() + STALL_S + sum(o.size for o in self.objs) / 1e6
        while time.monotonic() < deadline:
            answer = node_request(src, "xfer_task", timeout=REQUEST_TIMEOUT_S, task=task)
            if answer["done"]:
                return {h["name"]: answer["result"].get(h["name"], "no answer") for h in hops}
            time.sleep(0.3)
        return {h["name"]: f"the stream from {src.name} did not end in time" for h in hops}


class _Restartable:
    """An iterable made again from its start each time it is iterated (a stream that must go another way)."""

    def __init__(self, make) -> None:
        self.make = make

    def __iter__(self):
        return iter(self.make())


def _direct(hop: dict, head: bytes, chunks) -> tuple[int, str]:
    import socket

    try:
        with socket.create_connection((hop["host"], hop["port"]), timeout=10) as sock:
            sock.settimeout(STALL_S)
            sock.sendall(head)
            for chunk in chunks:
                sock.sendall(chunk)
            sock.shutdown(socket.SHUT_WR)
            buf = b""
            while True:
                got = sock.recv(65536)
                if not got:
                    break
                buf += got
        return 0, buf.decode("utf-8", "replace")
    except OSError as exc:
        return -1, f"cannot reach {hop['host']}:{hop['port']}: {exc}"


def _ask(nodes: list[Node], objs: list[Obj]) -> list:
    pairs = [[o.sha, o.size] for o in objs]
    return on_each(nodes, lambda n: node_request(n, "xfer_have", timeout=REQUEST_TIMEOUT_S, store=node_store(n),
                                                 objects=pairs, chunk=CHUNK, workdir=n.workdir))  # fmt: skip


def stage_on(node: Node, path: str, timeout: float = 3600.0) -> dict:
    """A file or directory of a node taken into that node's store (hashed there, on a thread of its agent: tens of
    GB take minutes): its manifest, each file with its sha256, size and chunk sums; 'file' when path is a file."""
    task = node_request(node, "xfer_stage", timeout=REQUEST_TIMEOUT_S, store=node_store(node), path=path,
                        chunk=CHUNK)["task"]  # fmt: skip
    deadline = time.monotonic() + timeout
    while True:
        answer = node_request(node, "xfer_task", timeout=REQUEST_TIMEOUT_S, task=task)
        if answer["done"]:
            return answer["result"]
        if time.monotonic() > deadline:
            raise TransferError(f"{node.name}:{path}: hashing it there took over {timeout:.0f} s")
        time.sleep(0.3)


def objects_of(manifest: dict) -> list[Obj]:
    return [Obj(f["sha256"], f["size"], f.get("chunks") or []) for f in manifest["files"]]


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def deliver(objs: list[Obj], nodes: list[Node], *, holders: list[Node] = (), what: str = "data",
            progress: Progress | None = None) -> Delivered:  # fmt: skip
    """Every object whole in the store of every node (of each shared working directory, one). holders: other
    nodes known to hold them (a dataset's node, a checkpoint's). TransferError in one line: a node that does not
    answer, has no room (known before anything is sent), or still lacks objects after ROUNDS rounds."""
    t0 = time.monotonic()
    done = Delivered()
    uniq: dict[str, Obj] = {}
    for o in objs:
        uniq.setdefault(o.sha, o)
    objs = list(uniq.values())
    index = {o.sha: i for i, o in enumerate(objs)}
    if not objs or not nodes:
        return done
    others = [h for h in holders if h.pk not in {n.pk for n in nodes}]
    asked = _ask([*nodes, *others], objs)
    failed = [f"{n.name}: {err}" for n, _, err in asked if err is not None and n in nodes]
    if failed:
        raise TransferError(f"{what} transfer failed on " + "; ".join(failed))
    held = {n.pk: a["held"] for n, a, err in asked if err is None}
    ids = {n.pk: a.get("workdir_id") for n, a, err in asked if err is None}
    receivers, _sharers = one_per_workdir(nodes, ids)
    total = sum(o.size for o in objs)
    short = []
    for node, answer, err in asked:
        if err is None and node in receivers:
            need = sum(o.size - max(0, held[node.pk][i]) for i, o in enumerate(objs))
            if need and need + FREE_MARGIN > int(answer["free"]):
                short.append(f"{node.name} needs {_gb(need)} for the {what}, {_gb(int(answer['free']))} free in "
                             f"{node_store(node)}")  # fmt: skip
    if short:
        raise TransferError("; ".join(short))
    first_held = {n.pk: sum(max(0, h) for h in held[n.pk]) for n in receivers}
    unreachable: set[tuple[str, str]] = set()  # (source, node) pairs a node-to-node hop could not make
    why: dict[str, str] = {}
    holders_now = [h for h in others if h.pk in held]
    for rnd in range(ROUNDS):
        needy = [n for n in receivers if any(h != o.size for h, o in zip(held[n.pk], objs, strict=True))]
        if not needy:
            break
        done.rounds = rnd + 1
        chains = _plan(objs, needy, [*receivers, *holders_now], held, index, unreachable)
        if not chains:
            break
        watcher = _Watcher(needy, objs, held, total, progress)
        try:
            ran = on_each(chains, lambda c: c.run())
        finally:
            watcher.stop()
        for chain, _, err in ran:
            if err is None:
                continue
            if isinstance(err, HostKeyError):  # a node answering with another key: no round will change that
                raise TransferError(f"{what} transfer failed on {chain.nodes[0].name}: {err}")
            # a link that failed before any answer: its line, for each node of the chain without one
            chain.results.update({n.name: str(err) for n in chain.nodes if not chain.results.get(n.name)})
        for chain in chains:
            src = chain.source.name if chain.source else "controller"
            if chain.source is None:
                done.controller_bytes += chain.sent[0]
            else:
                done.peer_bytes += chain.sent[0]
            done.relayed_bytes += chain.sent[0] * max(0, chain.hops - 1)  # each hop after the first: what it got
            for name, err in chain.results.items():
                if err:
                    why[name] = err
                    if chain.source is not None:
                        unreachable.add((src, name))
                    log.warning("%s transfer to %s from %s: %s", what, name, src, err)
        again = _ask(needy, objs)
        for n, a, err in again:
            if err is None:
                held[n.pk] = a["held"]
            else:
                why[n.name] = str(err)
    still = [n for n in receivers if any(h != o.size for h, o in zip(held[n.pk], objs, strict=True))]
    done.seconds = time.monotonic() - t0
    for n in receivers:
        got = sum(max(0, h) for h in held[n.pk]) - first_held[n.pk]
        done.nodes[n.name] = {"bytes": got, "total": total, "held": sum(max(0, h) for h in held[n.pk])}
    if still:
        raise TransferError(f"{what} transfer failed on " + "; ".join(
            f"{n.name}: {why.get(n.name) or 'objects still missing'}" for n in still))  # fmt: skip
    return done


def _plan(objs: list[Obj], needy: list[Node], known: list[Node], held: dict[int, list[int]], index: dict[str, int],
          unreachable: set[tuple[str, str]]) -> list[_Chain]:  # fmt: skip
    """This round's chains: objects grouped by the source they come from (a node that holds them whole, the one
    holding most of them first, else the controller), each chain through the needy nodes that lack any of its
    objects and that its source has not failed to reach."""
    lacking = {n.pk: {o.sha for i, o in enumerate(objs) if held[n.pk][i] != o.size} for n in needy}
    wanted = set().union(*lacking.values())
    holders = sorted((k for k in known if k.pk in held),
                     key=lambda k: -sum(1 for sha in wanted if held[k.pk][index[sha]] == objs[index[sha]].size))
    by_source: dict[int | None, list[Obj]] = {}
    sources: dict[int | None, Node | None] = {None: None}
    for o in objs:
        if o.sha not in wanted:
            continue
        src = next((k for k in holders if held[k.pk][index[o.sha]] == o.size), None)
        if src is None and o.path is None:
            continue  # on no node and not here: reported as missing
        key = src.pk if src is not None else None
        sources[key] = src
        by_source.setdefault(key, []).append(o)
    chains = []
    for key, group in by_source.items():
        src = sources[key]
        shas = {o.sha for o in group}
        through = [n for n in needy if lacking[n.pk] & shas and (src is None or n.pk != src.pk)]
        if src is not None:
            direct = [n for n in through if (src.name, n.name) in unreachable]
            through = [n for n in through if (src.name, n.name) not in unreachable]
            if direct and all(o.path for o in group):
                chains.append(_Chain(None, direct, group, held, index))
        if through:
            # nodes holding most first: the stream starts at the smallest offset of the chain, resent to none
            through.sort(key=lambda n: -sum(max(0, h) for h in held[n.pk]))
            chains.append(_Chain(src, through, group, held, index))
    return chains


class _Watcher:
    """Asks the nodes of a round what they hold every PROGRESS_EVERY_S and hands the bytes and rate per node to
    progress (the job's record, the launch's output)."""

    def __init__(self, nodes: list[Node], objs: list[Obj], held: dict[int, list[int]], total: int,
                 progress: Progress | None) -> None:  # fmt: skip
        self.nodes, self.objs, self.total, self.progress = nodes, objs, total, progress
        self.base = {n.pk: sum(max(0, h) for h in held[n.pk]) for n in nodes}
        self.stopped = threading.Event()
        self.thread = None
        if progress is not None:
            self.thread = threading.Thread(target=self._run, name="ugro-xfer-progress", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        from django.db import connection

        t0, last = time.monotonic(), {}
        try:
            while not self.stopped.wait(PROGRESS_EVERY_S):
                now = time.monotonic()
                report = {}
                for node, answer, err in _ask(self.nodes, self.objs):
                    if err is not None:
                        continue
                    have = sum(max(0, h) for h in answer["held"])
                    got = have - self.base[node.pk]
                    prev = last.get(node.pk, (t0, 0))
                    rate = (got - prev[1]) / max(1e-3, now - prev[0])
                    last[node.pk] = (now, got)
                    report[node.name] = {"held": have, "total": self.total, "rate": max(0.0, rate)}
                try:
                    self.progress(report)
                except Exception:  # progress is for people; the transfer goes on
                    log.exception("transfer progress")
        finally:
            connection.close()

    def stop(self) -> None:
        self.stopped.set()
        if self.thread is not None:
            self.thread.join(timeout=10)


def place(nodes: list[Node], dest_of: Callable[[Node], str], files: list[dict], *, what: str = "data",
          copies: bool = False) -> None:  # fmt: skip
    """The manifest's files at dest_of(node) on every node, hard links to its store (cluster/node/transfer.py
    op_xfer_place); of nodes that share a working directory one places them and the others are asked whether they
    see them. copies: writable copies instead (a checkpoint a resumed job may write over). TransferError naming the
    nodes that failed."""
    answers = on_each(nodes, lambda n: node_request(n, "workdir_id", timeout=REQUEST_TIMEOUT_S, workdir=n.workdir))
    ids = {n.pk: (a or {}).get("workdir_id") for n, a, _ in answers}
    firsts, sharers = one_per_workdir(nodes, ids)
    files = [{"path": f["path"], "sha256": f["sha256"], "size": f["size"], "mode": f.get("mode", 0o444)}
             for f in files]  # fmt: skip

    def put(node: Node) -> None:
        node_request(node, "xfer_place", timeout=REQUEST_TIMEOUT_S * 5, store=node_store(node), dest=dest_of(node),
                     files=files, copy=copies)  # fmt: skip

    def sees(node: Node) -> None:
        dest = dest_of(node)
        if not node_request(node, "stat", timeout=REQUEST_TIMEOUT_S, paths=[dest])["exists"].get(dest):
            put(node)

    failed = [f"{n.name}: {err}" for n, _, err in [*on_each(firsts, put), *on_each(sharers, sees)] if err]
    if failed:
        raise TransferError(f"placing the {what} failed on " + "; ".join(failed))
