"""An in-memory node agent, for fast tests of the worker's loops: what each node holds (its ranks' start
and exit records, its processes tagged with a job) is a dict here, and every request a loop sends through
`node.link().request(...)` is answered from it, as cluster/node/agent.py answers it on a real node. A
silent node raises what a silent link raises. The end-to-end tests keep one thin path per loop on real sshd
and torchrun; these check each loop's rule in milliseconds."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from cluster.links import AgentRequestError, LinkError


@dataclass
class FakeNode:
    name: str
    boot_id: str = "boot-1"
    silent: bool = False
    tags: dict[str, list[int]] = field(default_factory=dict)  # job tag -> live pids
    stubborn: set[str] = field(default_factory=set)  # tags whose processes ignore SIGTERM
    exits: dict[str, dict] = field(default_factory=dict)  # a rank's start key -> its exit record
    started: dict[str, str] = field(default_factory=dict)  # a rank's start key -> its job tag (record kept)
    requests: list[tuple[str, dict]] = field(default_factory=list)
    exec_answer: dict = field(default_factory=lambda: {"rc": 0, "stdout": "", "stderr": ""})  # what `exec` returns
    logs: dict[str, bytes] = field(default_factory=dict)  # a log's path on the node -> its bytes
    exit_files: dict[str, dict] = field(default_factory=dict)  # a rank's exit record's path -> the record


class FakeCluster:
    """The nodes by name; `install(monkeypatch)` routes every Node.link() here."""

    def __init__(self, *names: str) -> None:
        self.nodes = {name: FakeNode(name) for name in names}
        self._pids = itertools.count(1000)

    def __getitem__(self, name: str) -> FakeNode:
        return self.nodes[name]

    def run(self, node: str, tag: str, key: str, processes: int = 2) -> None:
        """A rank of job `tag` started on `node` under start key `key`, its processes alive."""
        n = self.nodes[node]
        n.started[key] = tag
        n.tags.setdefault(tag, []).extend(next(self._pids) for _ in range(processes))

    def install(self, monkeypatch) -> FakeCluster:
        from cluster.models import Node

        monkeypatch.setattr(Node, "link", lambda node: _Link(self.nodes[node.name]))
        return self


class _Link:
    def __init__(self, node: FakeNode) -> None:
        self.node = node

    def request(self, op: str, timeout: float = 30.0, when_silent: bool = True, **fields) -> dict:
        node = self.node
        if node.silent:
            raise LinkError(f"node {node.name}: SSH did not answer within {timeout:g} s")
        node.requests.append((op, fields))
        answer = getattr(self, f"op_{op}", None)
        if answer is None:
            raise AgentRequestError(f"the fake agent has no op {op!r}")
        return answer(**fields)

    def close(self) -> None:
        pass

    def heard_again(self) -> None:
        pass

    def op_exec(self, argv: list[str], **_fields) -> dict:
        return dict(self.node.exec_answer)

    def op_tail(self, files: list[dict], wait_ms: float = 0) -> dict:
        import base64

        out = []
        for item in files:
            whole, start = self.node.logs.get(item["path"]), item["offset"]
            data = b"" if whole is None else whole[start : start + int(item.get("max_bytes") or 1 << 20)]
            out.append({"key": item.get("key"), "size": None if whole is None else len(whole), "zlib": False,
                        "data": base64.b64encode(data).decode(),
                        "exit": self.node.exit_files.get(item.get("exit_file")),
                        "eof": whole is None or start + len(data) >= len(whole)})  # fmt: skip
        return {"files": out}

    def op_hello(self) -> dict:
        return {"version": "fake", "boot_id": self.node.boot_id, "time": 0.0}

    def op_procs(self, tag: str, node: str) -> dict:
        return {"pids": list(self.node.tags.get(tag, []))}

    def op_kill(self, tag: str, node: str, signal: int) -> dict:
        pids = list(self.node.tags.get(tag, []))
        if signal == 9 or tag not in self.node.stubborn:
            self.node.tags.pop(tag, None)
        return {"pids": pids}

    def op_tagged(self, node: str) -> dict:
        return {"tags": {tag: pids for tag, pids in self.node.tags.items() if pids}}

    def op_rank_status(self, ranks: list[dict]) -> dict:
        out = []
        for item in ranks:
            key = item.get("key")
            tag = self.node.started.get(key)
            alive = bool(tag and self.node.tags.get(tag))
            out.append({
                "key": key, "record": tag is not None, "record_key": key if tag else None,
                "key_matches": tag is not None, "state": "started" if tag else None, "error": None,
                "pid": None, "wrapper_pid": None, "exit": self.node.exits.get(key),
                "wrapper_alive": alive, "torchrun_alive": alive,
                "tagged_pids": list(self.node.tags.get(item.get("tag") or "", [])),
                "boot_id_at_start": self.node.boot_id, "boot_id": self.node.boot_id, "rebooted": False,
            })  # fmt: skip
        return {"ranks": out}
