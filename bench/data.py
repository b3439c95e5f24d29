#!/usr/bin/env python
"""Data to every node: UGRO's transfer path beside rsync from the controller to every node at once, the
controller's link rate-limited, in one run; and the resume after a cut.

    .venv/bin/python bench/data.py [--sizes 3 16] [--data-mb 2048] [--files 4] [--rate 1gbit] [--repeat 1]
                                   [--resume-nodes 3] [--cut-at 0.5] [--nodes-dir DIR] [--quick] [--keep] [--out F]

The issue's proof (36): "2 GB to 3 and 16 loopback nodes with the controller's link rate-limited (`tc` on the
loopback addresses), beside rsync from the controller to every node at once, in one run: controller bytes sent
(goal at most 1.5x the data at 16 nodes, rsync 16x), time (goal at most 0.5x rsync's at 16 nodes), and the resume
after a cut (goal: bytes resent under 5 % of the data)."

The data: --files files of random bytes (os.urandom, written out: not sparse), --data-mb MiB in all (default 4 x
512 MiB), in a temp dir under /tmp (outside the repository) that the throwaway UGRO's paths.sync_roots names. It is
staged once with jobs.data.stage_controller (each file's sha256 and chunk sums, read once; the seconds are recorded,
`stage_cold_s`, and not in the delivery's clock: a launch pays them once per file version, the hashes are kept).
`--quick`: 200 MiB, for a try in a minute or two. max(sizes) real sshd nodes on 127.0.7.2.. (tests/loopback.py; a
subnet of this benchmark's own: the tests use 127.0.0.x, the other benchmarks 127.0.1-6.x), each its own sshd and
working directory, one Node row each (a throwaway PostgreSQL database, bench/_db.py).

The controller's link: an htb qdisc on lo (this kernel has no netem) with two classes at --rate, one for what
goes to the nodes' sshd port (u32: destination in 127.0.7.0/24, destination port the nodes' sshd port: the
controller's uploads), one for what comes back from it. Everything else on lo is not classified and passes
unshaped (htb's direct queue): the nodes' traffic between each other (UGRO's node-to-node hops go to the agents'
own ports) and every other process on the machine. The qdisc is removed in a `finally`. Both tools' controller
traffic goes through SSH to that port: rsync's `-e ssh`, and UGRO's first hop (a forwarded connection, `ssh -W`,
to the first node's agent). `link_check` in the results: 64 MiB piped through `ssh node1 cat >/dev/null`, the
rate the shaped link gave. If tc cannot be used (not root, no htb), the run goes on unshaped and says so
(`shaping.ok` false, `shaping.why`).

For each size N, in the same run on the same nodes (the order of the two tools alternating by repeat):

  ugro   `jobs.transfer.deliver(objs, nodes[:N])` over links opened beforehand (a `hello` to every node: the
         worker holds its links), into empty stores (<workdir>/.ugro removed before). Figures: Delivered's
         controller_bytes, peer_bytes, rounds, seconds (its own clock) and the wall time around the call. After
         it, every node's store is checked (every object there at its size; the last node of the chain's copy
         of the first object hashed again).
  rsync  `rsync -a --stats -e "ssh -p PORT -i KEY ..." DATA/ root@ADDR:<workdir>/rsync-copy/` to every node at
         once (bench/sync.py's rsync_all: one process per node, all started together, each into a fresh
         directory), until the last exits. Controller bytes: the sum of `Total bytes sent` of --stats. Every
         copy checked (files, bytes).

For both: `wire_bytes_up`, what the shaped class carried towards the nodes' sshd port during the run (tc's
counters: SSH's framing and the TCP/IP headers included, and for UGRO its requests to the agents too); CPU
seconds (the benchmark's process and its children, the nodes' sshds and all they ran, the whole machine).
Between runs each tool's copies are removed, os.sync() and a wait (bounded) for the disk to go idle.

Resume after a cut, at --resume-nodes nodes (default 3), two ways:

  agent_killed       a delivery into empty stores, in a thread of this process; when the first node of the
                     chain holds --cut-at of the data (its store's verified bytes, read from its disk every
                     50 ms), its agent (the python under that node's sshd) is SIGKILLed: the chain breaks at its
                     head, as a node that drops mid-transfer. The same deliver() call goes on (its next round asks
                     the nodes again, a fresh agent starts on that node) or, if it fails, deliver() is called
                     again. resent = controller + peer bytes over all calls - N x data (each node needed all of
                     it), i.e. what travelled twice.
  controller_killed  a delivery by a child process (this script, `--child`, the same database and hashes); when
                     the first node holds --cut-at of the data the child's whole process group is SIGKILLed (the
                     controller restarted: its ssh clients die with it). Once the nodes' stores stop changing,
                     what each holds is read from disk; then this process delivers again. resent = controller +
                     peer bytes of that delivery - what the nodes lacked (sum over nodes of data - held).
                     The child's own bytes are counted by tc only (wire_bytes_up of the child's part).

Goal: resent under 5 % of the data (one copy, not N). The chunk is jobs.transfer.CHUNK (8 MiB): a node cut
mid-chunk loses the unchecked part, and a chain restarts from the smallest offset any of its nodes holds, so
the bytes resent do not shrink with the data: --quick's 200 MiB cannot meet a 5 % goal that 2 GiB can.

Disk: max(sizes) x data for one tool at a time, plus the data itself; with less free than that plus 4 GiB the
data is scaled down to fit and the results say so (`meta.scaled_down`). Results: bench/results/data.json
(--quick: data_quick.json; --out overrides), overwritten. The machine has 2 cores: every node's agent, sshd,
rsync and ssh share them with the controller, so the 16-node figures of both tools are CPU-bound (meta.notes).
SIGTERM stops it cleanly (qdisc removed, nodes stopped, temp dir and database removed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sync as sync_bench  # noqa: E402  (bench/sync.py: rsync_all, the disk and CPU readers)
from _common import (  # noqa: E402
    CONTROLLER_PY,
    REPO,
    RESULTS,
    SSH_OPTS,
    bashrc_cost,
    machine_info,
    make_tmp,
    median,
    node_rows,
    setup_django,
    ugro_env,
    wait_quiet,
    write_json,
)
from _db import throwaway_database  # noqa: E402

SUBNET = "127.0.7"  # never 127.0.0.x (tests), nor 127.0.1-6 (the other benchmarks)
MIB = 1 << 20
QUICK_MB = 200
DISK_MARGIN = 4 << 30
LINK_CHECK_BYTES = 64 * MIB
GOAL_CONTROLLER_X = 1.5
GOAL_TIME_X = 0.5
GOAL_RESENT = 0.05
NOTES = [
    "One machine with 2 cores: every node's sshd, agent (sha256 of each chunk, writes, passing bytes on), rsync "
    "server and ssh share them with the controller. A run whose link_use (wire.up over its seconds, as a part of "
    "--rate) is well under 1 was bound by this machine's CPU and disk, not by the shaped link: UGRO's at 16 nodes "
    "(16 agents hashing and writing 2 GB each on 2 cores); on 16 real machines each node's work runs on its own "
    "cores. rsync's streams share the shaped link: its link_use near 1 says the link set its time.",
    "UGRO's node-to-node hops go over loopback, unshaped (as a switch gives each port its own 1 GbE); only the "
    "controller's traffic to and from the nodes' sshd port is rate-limited.",
    "controller_bytes: rsync's --stats 'Total bytes sent' summed over nodes (before SSH); UGRO's "
    "Delivered.controller_bytes (file bytes handed to the first hop). wire.up: both tools' the same way, bytes of "
    "packets to the nodes' sshd port (iptables, SSH framing and headers included); wire.nodes: to the nodes' other "
    "ports (UGRO's node-to-node hops). Delivered.peer_bytes counts only what a chain's source node sends, not what "
    "each node passes on to the next (wire.nodes has those): 0 when every chain starts at the controller.",
]


def rate_bytes(rate: str) -> float | None:
    """A tc rate ('1gbit', '100mbit', '125mbps': tc's bps is bytes) in bytes per second; None if not one of those."""
    found = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)(bit|bps)", rate.strip().lower())
    if not found:
        return None
    value = float(found.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[found.group(2)]
    return value / 8 if found.group(3) == "bit" else value


# -- the controller's link: htb on lo ------------------------------------------------------------------------


class Shaper:
    """The nodes' sshd port on SUBNET rate-limited both ways (an htb qdisc on lo, two classes, u32 filters);
    every other packet on lo unclassified, so unshaped. remove() in a finally."""

    UP, DOWN = "1:20", "1:30"

    def __init__(self, port: int, rate: str) -> None:
        self.port, self.rate, self.on = port, rate, False

    @staticmethod
    def tc(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(["tc", *args], capture_output=True, text=True, check=check, timeout=30)

    def apply(self) -> dict:
        if shutil.which("tc") is None:
            return {"ok": False, "why": "tc is not installed (apt-get install iproute2)"}
        if os.geteuid() != 0:
            return {"ok": False, "why": "not root: tc cannot change lo's qdisc"}
        root = self.tc("qdisc", "show", "dev", "lo", check=False).stdout.strip()
        if root and not root.startswith("qdisc noqueue"):
            return {"ok": False, "why": f"lo already has a qdisc ({root.splitlines()[0]}): left alone"}
        try:
            self.tc("qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb")
            self.on = True
            for cls in (self.UP, self.DOWN):
                self.tc("class", "add", "dev", "lo", "parent", "1:", "classid", cls, "htb", "rate", self.rate,
                        "ceil", self.rate, "burst", "256k", "cburst", "256k")  # fmt: skip
            for prio, way, cls in ((1, "dst", self.UP), (2, "src", self.DOWN)):
                port = "dport" if way == "dst" else "sport"
                self.tc("filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio", str(prio), "u32",
                        "match", "ip", way, f"{SUBNET}.0/24", "match", "ip", port, str(self.port), "0xffff",
                        "flowid", cls)  # fmt: skip
        except subprocess.CalledProcessError as exc:
            self.remove()
            return {"ok": False, "why": f"tc {' '.join(exc.cmd[1:4])}: {(exc.stderr or '').strip()[:300]}"}
        qdisc = self.tc("qdisc", "show", "dev", "lo").stdout.strip()
        filters = f"{SUBNET}.0/24 dport {self.port} -> {self.UP}, sport {self.port} -> {self.DOWN}"
        return {"ok": True, "rate": self.rate, "port": self.port, "qdisc": qdisc, "filters": filters}

    def remove(self) -> None:
        if self.on:
            self.tc("qdisc", "del", "dev", "lo", "root", check=False)
            self.on = False


class Wire:
    """Bytes on the wire, counted by iptables in OUTPUT (lo's packets pass it; IP and TCP headers included), for
    packets to SUBNET: `up`, to the nodes' sshd port (what the controller sends: SSH's framing included), and
    `nodes`, to any other port there (the nodes' agents: UGRO's node-to-node hops; a node connects to another's
    address, the controller's connections to an agent go through sshd to 127.0.0.1). A chain of this process's
    own, removed in a finally."""

    def __init__(self, port: int) -> None:
        self.port, self.chain, self.on = port, f"UGRO_BENCH_DATA_{os.getpid()}", False

    @staticmethod
    def iptables(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(["iptables", "-w", *args], capture_output=True, text=True, check=check, timeout=30)

    def apply(self) -> dict:
        if shutil.which("iptables") is None:
            return {"ok": False, "why": "iptables is not installed"}
        try:
            self.iptables("-N", self.chain)
            self.on = True
            self.iptables("-A", self.chain, "-p", "tcp", "--dport", str(self.port), "-j", "RETURN")
            self.iptables("-A", self.chain, "-p", "tcp", "-j", "RETURN")
            self.iptables("-I", "OUTPUT", "-d", f"{SUBNET}.0/24", "-j", self.chain)
        except subprocess.CalledProcessError as exc:
            self.remove()
            return {"ok": False, "why": f"iptables: {(exc.stderr or '').strip()[:300]}"}
        return {"ok": True, "chain": self.chain}

    def read(self) -> dict[str, int] | None:
        """{"up": bytes to the sshd port, "nodes": bytes to the agents' ports} so far; None when not counting."""
        if not self.on:
            return None
        rows = self.iptables("-nvx", "-L", self.chain).stdout.splitlines()[2:]
        counts = [int(r.split()[1]) for r in rows if r.strip()]
        return {"up": counts[0], "nodes": counts[1]} if len(counts) == 2 else None

    @staticmethod
    def since(before: dict | None, after: dict | None) -> dict | None:
        if before is None or after is None:
            return None
        return {k: after[k] - before[k] for k in after}

    def remove(self) -> None:
        if self.on:
            self.iptables("-D", "OUTPUT", "-d", f"{SUBNET}.0/24", "-j", self.chain, check=False)
            self.iptables("-F", self.chain, check=False)
            self.iptables("-X", self.chain, check=False)
            self.on = False


# -- data, stores, processes ---------------------------------------------------------------------------------


def make_data(root: Path, total: int, files: int) -> dict:
    """files files of random bytes, total bytes in all, written out (not sparse)."""
    root.mkdir(parents=True)
    each = total // files
    sizes = [each] * files
    sizes[-1] += total - sum(sizes)
    t0 = time.monotonic()
    for i, size in enumerate(sizes):
        with open(root / f"shard-{i:05d}-of-{files:05d}.bin", "wb") as fh:
            left = size
            while left:
                block = os.urandom(min(16 * MIB, left))
                fh.write(block)
                left -= len(block)
    allocated = sum(os.stat(p).st_blocks * 512 for p in root.iterdir())
    return {"files": files, "bytes": sum(sizes), "sizes": sizes, "allocated_bytes": allocated,
            "made_s": round(time.monotonic() - t0, 2)}  # fmt: skip


def store_of(workdir: Path) -> Path:
    return workdir / ".ugro" / "objects"


def held_on_disk(workdir: Path, objs, chunk: int) -> int:
    """The bytes of objs a node's store holds verified, read from its disk as its agent would answer
    (cluster/node/transfer.py _xfer_held): whole objects, and of a part its checked length in whole chunks."""
    store, total = store_of(workdir), 0
    for o in objs:
        try:
            if (store / o.sha).stat().st_size == o.size:
                total += o.size
                continue
        except OSError:
            pass
        try:
            ok = int((store / ".xfer" / f"{o.sha}.ok").read_text().strip() or 0)
            have = (store / ".xfer" / o.sha).stat().st_size
        except (OSError, ValueError):
            continue
        got = min(ok, have, o.size)
        total += got if got == o.size else got - got % chunk
    return total


def descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, comm) of every live process under pid."""
    parent: dict[int, list[int]] = {}
    comm: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                text = fh.read()
        except OSError:
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        parent.setdefault(int(text.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
        comm[int(entry)] = name
    out, todo = [], list(parent.get(pid, []))
    while todo:
        p = todo.pop()
        out.append((p, comm.get(p, "")))
        todo.extend(parent.get(p, []))
    return out


def agents_of(node) -> list[int]:
    """The UGRO agents on a loopback node: the python processes under its sshd."""
    return [p for p, name in descendants(node.proc.pid) if name.startswith("python")]


def reset(workdirs: list[Path]) -> None:
    for w in workdirs:
        for name in (".ugro", sync_bench.RSYNC_DEST):
            shutil.rmtree(w / name, ignore_errors=True)


class Cpu:
    """CPU seconds over a run: this process and its reaped children, the nodes' sshds and all they ran, the
    whole machine."""

    def __init__(self, node_pids: list[int]) -> None:
        self.node_pids = node_pids
        self.c0 = sync_bench.self_cpu_s() + sync_bench.children_cpu_s()
        self.n0 = sync_bench.nodes_cpu_s(node_pids)
        self.m0 = sync_bench.machine_cpu_s()

    def done(self) -> dict:
        return {
            "controller_cpu_s": round(sync_bench.self_cpu_s() + sync_bench.children_cpu_s() - self.c0, 2),
            "nodes_cpu_s": round(sync_bench.nodes_cpu_s(self.node_pids) - self.n0, 2),
            "machine_cpu_s": round(sync_bench.machine_cpu_s() - self.m0, 2),
        }


# -- the benchmark -----------------------------------------------------------------------------------------


class Bench:
    def __init__(self, args, cluster, wire: Wire, data_dir: Path, database_url: str) -> None:
        from cluster.models import ClusterSettings

        self.args, self.cluster, self.wire, self.data_dir = args, cluster, wire, data_dir
        self.database_url = database_url
        cs = ClusterSettings.load()
        cs.paths = {**(cs.paths or {}), "sync_roots": [str(data_dir.parent)]}
        cs.save()
        self.cs = cs
        self.rows = node_rows(cluster)
        self.node_pids = [n.proc.pid for n in cluster.nodes]
        self.objs: list = []
        self.data_bytes = 0

    def stage(self) -> dict:
        from jobs.data import Item, stage_controller

        t0 = time.monotonic()
        _, objs = stage_controller(Item(str(self.data_dir), "data"), self.cs)
        cold = time.monotonic() - t0
        t0 = time.monotonic()
        stage_controller(Item(str(self.data_dir), "data"), self.cs)
        self.objs, self.data_bytes = objs, sum(o.size for o in objs)
        return {"stage_cold_s": round(cold, 2), "stage_cached_s": round(time.monotonic() - t0, 3),
                "objects": len(objs), "chunks": sum(max(1, len(o.chunks)) for o in objs)}  # fmt: skip

    def warm_links(self, rows) -> None:
        sync_bench.Ugro.warm_links(None, rows)  # a `hello` to each node, retried (it uses nothing of its self)

    def link_check(self) -> dict:
        """LINK_CHECK_BYTES through `ssh node1 'cat >/dev/null'`, less a `ssh node1 true` (the login and root's
        .bashrc): the rate the controller's link gives one SSH stream."""
        node = self.cluster.nodes[0]
        argv = ["ssh", "-p", str(self.cluster.port), "-i", str(self.cluster.client_key), *SSH_OPTS,
                f"{self.cluster.user}@{node.address}"]  # fmt: skip
        t0 = time.monotonic()
        subprocess.run([*argv, "true"], check=True, timeout=60)
        login = time.monotonic() - t0
        block = os.urandom(MIB)
        t0 = time.monotonic()
        proc = subprocess.Popen([*argv, "cat > /dev/null"], stdin=subprocess.PIPE)
        for _ in range(LINK_CHECK_BYTES // MIB):
            proc.stdin.write(block)
        proc.stdin.close()
        rc = proc.wait(timeout=300)
        seconds = time.monotonic() - t0
        return {"bytes": LINK_CHECK_BYTES, "seconds": round(seconds, 2), "login_s": round(login, 2), "rc": rc,
                "MB_per_s_less_login": round(LINK_CHECK_BYTES / max(1e-3, seconds - login) / 1e6, 1)}  # fmt: skip

    def before_run(self) -> dict:
        settle = sync_bench.settle_disk(self.args.disk, timeout=120.0)
        busy = wait_quiet(self.args.max_busy, self.args.quiet_wait)
        return {"disk_settle_s": round(settle, 2), "busy_before": round(busy, 2)}

    def ugro(self, n: int) -> dict:
        from jobs import transfer

        reset([c.workdir for c in self.cluster.nodes[:n]])
        out = self.before_run()
        wire0, cpu = self.wire.read(), Cpu(self.node_pids)
        t0 = time.monotonic()
        try:
            got = transfer.deliver(self.objs, self.rows[:n])
        except transfer.TransferError as exc:
            out.update(failed=str(exc), wall_s=round(time.monotonic() - t0, 2))
            return out
        wall = time.monotonic() - t0
        out.update(cpu.done())
        out.update(wall_s=round(wall, 2), deliver_s=round(got.seconds, 2), controller_bytes=got.controller_bytes,
                   peer_bytes=got.peer_bytes, rounds=got.rounds, wire=Wire.since(wire0, self.wire.read()))  # fmt: skip
        out["check"] = self.check_stores(n)
        return out

    def check_stores(self, n: int) -> str:
        """Every object at its size in every node's store; the last node's copy of the first object hashed."""
        for c in self.cluster.nodes[:n]:
            for o in self.objs:
                path = store_of(c.workdir) / o.sha
                if not path.is_file() or path.stat().st_size != o.size:
                    raise RuntimeError(f"{c.name}: object {o.sha[:12]} missing or short after the delivery")
        first, last = self.objs[0], self.cluster.nodes[n - 1]
        h = hashlib.sha256()
        with open(store_of(last.workdir) / first.sha, "rb") as fh:
            for block in iter(lambda: fh.read(8 * MIB), b""):
                h.update(block)
        if h.hexdigest() != first.sha:
            raise RuntimeError(f"{last.name}: object {first.sha[:12]} has another sha256")
        return f"{n} stores x {len(self.objs)} objects at their sizes; {last.name}'s first object's sha256 matches"

    def rsync(self, n: int) -> dict:
        nodes = self.cluster.nodes[:n]
        reset([c.workdir for c in nodes])
        out = self.before_run()
        wire0, cpu = self.wire.read(), Cpu(self.node_pids)
        # one rsync per node, started together (bench/sync.py); its timeout is the whole run's
        sync_bench.TRIAL_TIMEOUT_S = max(600, int(3 * n * self.data_bytes / 100e6))
        try:
            got = sync_bench.rsync_all(self.cluster, nodes, self.data_dir)
        except RuntimeError as exc:
            out.update(failed=str(exc)[:2000])
            return out
        out.update(cpu.done())
        out.update(wall_s=round(got["seconds"], 2), controller_bytes=got["sent_bytes"],
                   wire=Wire.since(wire0, self.wire.read()))  # fmt: skip
        want = (len(self.objs), self.data_bytes)
        for c in nodes:
            have = sync_bench.copy_stats(c.workdir / sync_bench.RSYNC_DEST)
            if have != want:
                raise RuntimeError(f"{c.name}: rsync's copy holds {have}, not {want}")
        out["check"] = f"{n} copies with {want[0]} files, {want[1]} bytes"
        return out

    # -- resume --------------------------------------------------------------------------------------------
    def _wait_cut(self, alive, target: int, limit_s: float) -> int:
        """Poll the first node's store until it holds target bytes (or the delivery ended); what it held."""
        from jobs import transfer

        first, t0, held = self.cluster.nodes[0].workdir, time.monotonic(), 0
        while alive() and time.monotonic() - t0 < limit_s:
            held = held_on_disk(first, self.objs, transfer.CHUNK)
            if held >= target:
                break
            time.sleep(0.05)
        return held

    def _held(self, n: int) -> dict[str, int]:
        from jobs import transfer

        return {c.name: held_on_disk(c.workdir, self.objs, transfer.CHUNK) for c in self.cluster.nodes[:n]}

    def _resent(self, out: dict, wire: dict | None, baseline: dict) -> None:
        """What the cut cost, in wire bytes: all the cut run's (controller's link and nodes' hops) less the uncut
        run's at the same size, and that as a part of one copy's (the uncut run's over the nodes)."""
        base = baseline.get("wire")
        if wire is None or base is None:
            out.update(resent_wire_bytes=None, resent_of_data=None)
            return
        extra = wire["up"] + wire["nodes"] - base["up"] - base["nodes"]
        one_copy = (base["up"] + base["nodes"]) / self.args.resume_nodes
        out.update(resent_wire_bytes=extra, resent_of_data=round(extra / one_copy, 4))

    def resume_agent_killed(self, n: int, baseline: dict) -> dict:
        from jobs import transfer

        rows, nodes = self.rows[:n], self.cluster.nodes[:n]
        reset([c.workdir for c in nodes])
        out = self.before_run()
        wire0 = self.wire.read()
        box: dict = {}

        def call() -> None:
            t = time.monotonic()
            try:
                box["got"] = transfer.deliver(self.objs, rows)
            except transfer.TransferError as exc:
                box["err"] = str(exc)
            box["seconds"] = time.monotonic() - t

        t0 = time.monotonic()
        thread = threading.Thread(target=call, name="bench-deliver")
        thread.start()
        held = self._wait_cut(thread.is_alive, int(self.args.cut_at * self.data_bytes), 600)
        if not thread.is_alive():
            thread.join()
            out.update(failed=f"the delivery ended before the cut ({box.get('err') or 'complete'})")
            return out
        killed = agents_of(nodes[0])
        for pid in killed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        cut_at_s = time.monotonic() - t0
        out["cut"] = {"at_s": round(cut_at_s, 2), "first_node_held": held, "agents_killed": len(killed)}
        thread.join()
        calls = [self._call_figures(box)]
        if "err" in box:  # the call gave up: deliver again, as the job's next attempt would
            box.clear()
            call()
            calls.append(self._call_figures(box))
        total_s = time.monotonic() - t0
        wire = Wire.since(wire0, self.wire.read())
        controller = sum(c.get("controller_bytes", 0) for c in calls)
        out.update(calls=calls, wire=wire, total_s=round(total_s, 2), after_cut_s=round(total_s - cut_at_s, 2),
                   complete="err" not in box, controller_bytes=controller,
                   controller_resent_bytes=controller - self.data_bytes)  # fmt: skip
        self._resent(out, wire, baseline)
        if "err" not in box:
            out["check"] = self.check_stores(n)
        return out

    def _call_figures(self, box: dict) -> dict:
        got = box.get("got")
        if got is None:
            return {"failed": box.get("err"), "seconds": round(box.get("seconds", 0), 2)}
        return {"seconds": round(got.seconds, 2), "controller_bytes": got.controller_bytes,
                "peer_bytes": got.peer_bytes, "rounds": got.rounds,
                "nodes_got": {k: v["bytes"] for k, v in got.nodes.items()}}  # fmt: skip

    def resume_controller_killed(self, n: int, tmp: Path, baseline: dict) -> dict:
        from cluster.links import pool
        from jobs import transfer

        nodes = self.cluster.nodes[:n]
        reset([c.workdir for c in nodes])
        out = self.before_run()
        wire0 = self.wire.read()
        env = {**os.environ, **ugro_env(tmp, self.database_url)}
        spec = {"tmp": str(tmp), "database_url": self.database_url, "data": str(self.data_dir),
                "nodes": [r.name for r in self.rows[:n]]}  # fmt: skip
        t0 = time.monotonic()
        argv = [str(CONTROLLER_PY), __file__, "--child", json.dumps(spec)]
        child = subprocess.Popen(argv, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)  # fmt: skip
        try:
            held = self._wait_cut(lambda: child.poll() is None, int(self.args.cut_at * self.data_bytes), 600)
            alive = child.poll() is None
            if alive:
                os.killpg(child.pid, signal.SIGKILL)
            cut_at_s = time.monotonic() - t0
            _, err = child.communicate(timeout=30)
        finally:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
        if not alive:
            out.update(failed=f"the child ended before the cut (rc {child.returncode}): {err.strip()[-800:]}")
            return out
        # the agents of the child's links end as their sessions close: wait until the stores stop changing
        last, t1 = None, time.monotonic()
        while time.monotonic() - t1 < 60:
            now = self._held(n)
            if now == last:
                break
            last = now
            time.sleep(1.0)
        held_after = last or {}
        out["cut"] = {"at_s": round(cut_at_s, 2), "first_node_held": held, "held_on_disk": held_after,
                      "child_wire": Wire.since(wire0, self.wire.read())}  # fmt: skip
        pool.close_all()  # the controller restarted: its links are new ones
        self.warm_links(self.rows[:n])
        wire1 = self.wire.read()
        t2 = time.monotonic()
        got = transfer.deliver(self.objs, self.rows[:n])
        lacked = sum(self.data_bytes - h for h in held_after.values())
        resume_wire = Wire.since(wire1, self.wire.read())
        out.update(resume_wall_s=round(time.monotonic() - t2, 2), call=self._call_figures({"got": got}),
                   resume_wire=resume_wire, lacked_bytes=lacked, lacked_of_data=round(lacked / self.data_bytes, 3),
                   lacked_by_delivery=sum(v["bytes"] for v in got.nodes.values()))  # fmt: skip
        # the resume alone: its wire bytes over what the nodes lacked, at the uncut run's bytes per byte delivered
        base = baseline.get("wire")
        if resume_wire and base:
            per_byte = (base["up"] + base["nodes"]) / (n * self.data_bytes)
            extra = resume_wire["up"] + resume_wire["nodes"] - lacked * per_byte
            out.update(resume_resent_wire_bytes=int(extra),
                       resume_resent_of_data=round(extra / (self.data_bytes * per_byte), 4))  # fmt: skip
        whole = Wire.since(wire0, self.wire.read())
        out["wire"] = whole
        self._resent(out, whole, baseline)
        out["check"] = self.check_stores(n)
        return out


def child(spec: str) -> None:
    """The controller_killed cut's delivering process: stage (hashes cached) and deliver to the named nodes."""
    conf = json.loads(spec)
    setup_django(Path(conf["tmp"]), conf["database_url"])  # migrates: the tree may have changed since
    from cluster.models import ClusterSettings, Node
    from jobs import transfer
    from jobs.data import Item, stage_controller

    _, objs = stage_controller(Item(conf["data"], "data"), ClusterSettings.load())
    rows = sorted(Node.objects.filter(name__in=conf["nodes"]), key=lambda r: r.order)
    transfer.deliver(objs, rows)
    print("delivered before the cut", file=sys.stderr)


# -- the run -----------------------------------------------------------------------------------------------


def disk_plan(args, where: Path) -> dict:
    """The data's size: asked, or scaled down to what the disk holds (one tool's copies at a time)."""
    asked = args.data_mb * MIB
    free = shutil.disk_usage(where).free
    copies = max(args.sizes) + 1  # the nodes' copies of one tool, and the data itself
    plan = {"free_bytes": free, "asked_bytes": asked, "copies_at_once": copies}
    if copies * asked + DISK_MARGIN > free:
        fit = max(0, (free - DISK_MARGIN) // copies)
        used = fit - fit % (args.files * MIB)
        if used <= 0:
            raise SystemExit(f"bench/data.py: {free / 1e9:.1f} GB free under {where}: no room for {copies} copies")
        plan.update(scaled_down=True, used_bytes=used,
                    why=f"{free / 1e9:.1f} GB free cannot hold {copies} x {asked / 1e9:.2f} GB + margin")  # fmt: skip
    else:
        plan.update(scaled_down=False, used_bytes=asked)
    return plan


def summarise(trials: list[dict], sizes: list[int], data_bytes: int, rate: float | None) -> list[dict]:
    out = []
    for t in trials:
        for tool in ("ugro", "rsync"):
            r = t.get(tool) or {}
            if rate and r.get("wire") and r.get("wall_s"):
                r["link_use"] = round(r["wire"]["up"] / r["wall_s"] / rate, 3)
    for n in sizes:
        row: dict = {"nodes": n}
        for tool in ("ugro", "rsync"):
            mine = [t[tool] for t in trials if t["nodes"] == n and tool in t]
            runs = [r for r in mine if "failed" not in r]
            wires = [r["wire"] for r in runs if r.get("wire")]
            row[f"{tool}_s"] = median([r["wall_s"] for r in runs])
            row[f"{tool}_min_s"] = min((r["wall_s"] for r in runs), default=None)
            row[f"{tool}_controller_bytes"] = median([r["controller_bytes"] for r in runs])
            row[f"{tool}_controller_x_data"] = (None if row[f"{tool}_controller_bytes"] is None else
                                                round(row[f"{tool}_controller_bytes"] / data_bytes, 3))  # fmt: skip
            row[f"{tool}_wire_up_bytes"] = median([w["up"] for w in wires])
            row[f"{tool}_link_use"] = median([r["link_use"] for r in runs if r.get("link_use") is not None])
            row[f"{tool}_wire_nodes_bytes"] = median([w["nodes"] for w in wires])
            row[f"{tool}_own_cpu_s"] = median([r["controller_cpu_s"] + r["nodes_cpu_s"] for r in runs])
            row[f"{tool}_controller_cpu_s"] = median([r["controller_cpu_s"] for r in runs])
            row[f"{tool}_failed"] = [r["failed"] for r in mine if "failed" in r]
        row["ugro_peer_bytes"] = median([t["ugro"]["peer_bytes"] for t in trials
                                         if t["nodes"] == n and "peer_bytes" in t.get("ugro", {})])  # fmt: skip
        row["time_ugro_over_rsync"] = (round(row["ugro_s"] / row["rsync_s"], 3)
                                       if row["ugro_s"] and row["rsync_s"] else None)  # fmt: skip
        out.append(row)
    return out


def _f(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(summary: list[dict], resume: dict, data_bytes: int) -> None:
    print(f"data: {data_bytes / 1e9:.2f} GB")
    print(f"{'nodes':>5} {'ugro s':>8} {'rsync s':>8} {'ugro/rsync':>10} {'ugro ctl GB':>11} {'rsync ctl GB':>12} "
          f"{'ugro x data':>11} {'rsync x data':>12}")  # fmt: skip
    for s in summary:
        ugro_gb = None if s["ugro_controller_bytes"] is None else s["ugro_controller_bytes"] / 1e9
        rsync_gb = None if s["rsync_controller_bytes"] is None else s["rsync_controller_bytes"] / 1e9
        print(f"{s['nodes']:>5} {_f(s['ugro_s'], '.1f'):>8} {_f(s['rsync_s'], '.1f'):>8} "
              f"{_f(s['time_ugro_over_rsync'], '.2f'):>10} {_f(ugro_gb, '.2f'):>11} {_f(rsync_gb, '.2f'):>12} "
              f"{_f(s['ugro_controller_x_data'], '.2f'):>11} "
              f"{_f(s['rsync_controller_x_data'], '.2f'):>12}")  # fmt: skip
    for name, r in resume.items():
        print(f"resume {name}: resent {_f(r.get('resent_wire_bytes'), ',')} wire bytes = "
              f"{_f(r.get('resent_of_data'), '.2%')} of one copy; {r.get('failed') or ''}")  # fmt: skip


def code_under_test() -> dict:
    """The transfer path's files as this run read them (the working tree may hold edits, and change)."""
    from cluster import links

    files = [REPO / "jobs" / "transfer.py", REPO / "jobs" / "data.py", Path(links.NODE_CODE_DIR) / "transfer.py",
             Path(links.__file__)]  # fmt: skip
    return {str(f.relative_to(REPO)): hashlib.sha256(f.read_bytes()).hexdigest()[:16] for f in files}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[3, 16])
    parser.add_argument("--data-mb", type=int, default=2048, help="MiB of data in all (default 2048)")
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--rate", default="1gbit", help="the controller's link, a tc rate (default 1gbit)")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--resume-nodes", type=int, default=3, help="0: no resume runs")
    parser.add_argument("--cut-at", type=float, default=0.5, help="the part of the data node1 holds at the cut")
    parser.add_argument("--max-busy", type=float, default=0.6)
    parser.add_argument("--quiet-wait", type=float, default=3.0)
    parser.add_argument("--nodes-dir", type=Path, default=None, help="where the nodes' working directories go")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_MB} MiB of data")
    parser.add_argument("--keep", action="store_true", help="leave the temp dir and the database")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    if args.quick:
        args.data_mb = QUICK_MB
    if args.files < 1 or args.data_mb < args.files or not 0 < args.cut_at < 1 or min(args.sizes) < 1:
        parser.error("--files >= 1, --data-mb >= --files, 0 < --cut-at < 1, sizes >= 1")
    if args.resume_nodes > max(args.sizes):
        parser.error("--resume-nodes at most max(--sizes)")
    args.out = args.out or RESULTS / ("data_quick.json" if args.quick else "data.json")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally blocks undo everything
    with throwaway_database(keep=args.keep) as database_url:
        run(args, database_url)


def run(args, database_url: str) -> None:
    tmp = make_tmp("ugro-data-bench-")
    info = machine_info()
    shaper = wire = None
    try:
        setup_django(tmp, database_url)
        from cluster.links import pool
        from jobs import transfer
        from tests.loopback import LoopbackCluster

        nodes_root = tmp / "nodes"
        if args.nodes_dir:
            nodes_root = Path(tempfile.mkdtemp(prefix="ugro-data-nodes-", dir=args.nodes_dir))
        nodes_root.mkdir(parents=True, exist_ok=True)
        args.disk = nodes_root
        plan = disk_plan(args, nodes_root)
        data_dir = tmp / "src" / "dataset"
        info["data"] = make_data(data_dir, plan["used_bytes"], args.files)
        info["disk"] = plan
        info["nodes_filesystem"] = sync_bench.filesystem_of(nodes_root)
        info["rsync"] = subprocess.run(["rsync", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
        info["bashrc"] = bashrc_cost()
        info["chunk_bytes"] = transfer.CHUNK
        info["code_under_test"] = code_under_test()
        info["notes"] = NOTES
        cluster = LoopbackCluster(nodes_root, count=max(args.sizes), subnet=SUBNET).start()
        shaper, wire = Shaper(cluster.port, args.rate), Wire(cluster.port)
        trials, resume = [], {}
        try:
            info["shaping"] = shaper.apply()
            info["counting"] = wire.apply()
            print("shaping:", info["shaping"], "counting:", info["counting"], flush=True)
            bench = Bench(args, cluster, wire, data_dir, database_url)
            info["staging"] = bench.stage()
            bench.warm_links(bench.rows)
            info["link_check"] = bench.link_check()
            print("staged:", info["staging"], "link:", info["link_check"], flush=True)
            for rep in range(args.repeat):
                for n in args.sizes:
                    bench.warm_links(bench.rows[:n])
                    trial = {"repeat": rep, "nodes": n}
                    order = ("ugro", "rsync") if rep % 2 == 0 else ("rsync", "ugro")
                    for tool in order:
                        trial[tool] = getattr(bench, tool)(n)
                        print(f"n={n} repeat {rep} {tool}: {trial[tool]}", flush=True)
                    reset([c.workdir for c in cluster.nodes[:n]])
                    trials.append(trial)
            if args.resume_nodes:
                n = args.resume_nodes
                bench.warm_links(bench.rows[:n])
                resume["baseline_uncut"] = bench.ugro(n)
                print("resume baseline (uncut):", resume["baseline_uncut"], flush=True)
                resume["agent_killed"] = bench.resume_agent_killed(n, resume["baseline_uncut"])
                print("resume agent_killed:", resume["agent_killed"], flush=True)
                resume["controller_killed"] = bench.resume_controller_killed(n, tmp, resume["baseline_uncut"])
                print("resume controller_killed:", resume["controller_killed"], flush=True)
                reset([c.workdir for c in cluster.nodes[:n]])
        finally:
            shaper.remove()
            wire.remove()
            pool.close_all()
            cluster.stop()
            if args.nodes_dir and not args.keep:
                shutil.rmtree(nodes_root, ignore_errors=True)
        data_bytes = bench.data_bytes
        summary = summarise(trials, args.sizes, data_bytes, rate_bytes(args.rate) if info["shaping"]["ok"] else None)
        top = next((s for s in summary if s["nodes"] == max(args.sizes)), None)
        goals: dict = {}
        if top:
            key = f"at_{top['nodes']}_nodes"
            x, r = top["ugro_controller_x_data"], top["time_ugro_over_rsync"]
            goals[f"controller_bytes_{key}_at_most_{GOAL_CONTROLLER_X}x_data"] = None if x is None else x <= 1.5
            goals[f"time_{key}_at_most_{GOAL_TIME_X}x_rsync"] = None if r is None else r <= GOAL_TIME_X
        for name in ("agent_killed", "controller_killed"):
            v = resume.get(name, {}).get("resent_of_data")
            goals[f"resume_{name}_resent_under_{GOAL_RESENT:.0%}_of_data"] = None if v is None else v < GOAL_RESENT
        info["code_under_test_end"] = code_under_test()
        info["code_changed_during_run"] = info["code_under_test_end"] != info["code_under_test"]
        info["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        info["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                        if k not in ("disk", "child")}  # fmt: skip
        info["subnet"] = SUBNET
        write_json(args.out, {
            "benchmark": "data",
            "goal": "at 16 nodes: controller bytes at most 1.5x the data (rsync 16x), time at most 0.5x rsync's; "
                    "resume after a cut: bytes resent under 5 % of the data",
            "meta": info,
            "summary": summary,
            "resume": resume,
            "goals_met": goals,
            "trials": trials,
        })  # fmt: skip
        print_table(summary, resume, data_bytes)
        print("goals:", goals)
        print("wrote", args.out)
    finally:
        for undo in (shaper, wire):
            if undo is not None:
                undo.remove()
        if args.keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
