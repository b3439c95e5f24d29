#!/usr/bin/env python
"""Code sync: UGRO's `jobs.sync.push` beside `rsync -a` over ssh, to the same N nodes in the same run.

    .venv/bin/python bench/sync.py [--sizes 3 16] [--repeat 3] [--max-busy 0.6] [--quiet-wait 3] [--keep]

The issue's goal: "`bench/sync.py`: a 50 MB tree of 2,000 files to 3 and 16 nodes, cold and with nothing
changed, beside `rsync -a` over ssh to the same nodes in the same run; goal: no slower than rsync cold,
under 1 s with nothing changed at 16 nodes."

The tree: 2,000 files of random bytes, 50,000,000 bytes in all, under a temp dir that cluster.yaml's
paths.sync_roots names (checked with jobs.sync.check_source): 1,980 small .py/.json/.yaml/.txt files
(log-normal sizes, 14 MB together) in nested package dirs, 16 files of 1 MB and 4 of 5 MB (bigger than
jobs.sync.CHUNK_BYTES: they travel in chunks). max(sizes) real sshd nodes on 127.0.5.2.. (tests/loopback.py;
a subnet no test or other benchmark uses), a throwaway PostgreSQL UGRO with one Node row per node
(workdir: the node's dir). Each trial of N nodes uses the first N.

  ugro        `jobs.sync.push(job, nodes)` for a fresh Job whose JobCode holds the tree's snapshot
              (jobs.sync.snapshot, taken before the clock, as `launch --sync` does at launch), timed
              around the call (manifest load and DB update included). Links warm: a `hello` to every
              node first, so SSH and agent start-up are not counted (the worker holds its links).
  ugro_cold_links
              the same with every link closed first (pool.close_all()): SSH handshake, agent bootstrap
              and the first request are in the clock, as rsync's own ssh is.
  rsync       `rsync -a --stats -e "ssh -p PORT -i KEY <the other benches' -o options>" TREE/
              root@ADDR:<workdir>/rsync-copy/` to every node at once (one process per node, started
              together), until the last exits.

Cells: `cold` (the node holds nothing: <workdir>/.ugro, outputs/ and rsync-copy/ removed just before),
`unchanged` (a second job with the same tree: nothing travels; rsync into its existing copy) and
`one_changed` (one small .py file gets a line appended: a new snapshot, new job; rsync into the copy).
Each repeat runs every size in turn; at each size each method runs its three cells from emptied nodes,
which method goes first alternating by repeat. Each method's cold trial comes after a removal of its
own: on this VM the trial right after removing the last copies was the slow one, 5-15 s more at 16
nodes whichever method it was (freed memory handed back to the host, virtio-balloon free page reporting,
and faulted in again: a likely cause, not a proven one).
Before each timed trial: os.sync() and a wait (at most 30 s) until the disk is idle (no writeback of the
previous trial's 16 x 50 MB, nor the discards of the removed copies, land in it: / is mounted with
`discard`), then a wait (at most --quiet-wait s) for the machine to be at most --max-busy busy. After
each cold trial every node's copy is checked (file count and bytes). Results: medians (and minimums) of
the repeats in seconds, UGRO's bytes sent (Pushed.sent_bytes), rsync's (its --stats), CPU seconds over
each trial (the whole machine's, other work included; the sending side's: UGRO's process, all threads,
or the rsync and ssh client processes; the nodes' side: each node's sshd and all it ran, without other
work on the machine; "own": sending side plus nodes' side, the figure to compare on a shared machine),
and snapshot times (paid once at launch, not per node); bench/results/sync.json (overwritten). SIGTERM
stops it cleanly (nodes stopped, temp dir and DB removed).
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    RESULTS,
    SSH_OPTS,
    bashrc_cost,
    machine_info,
    make_tmp,
    median,
    setup_django,
    wait_quiet,
    write_json,
)
from _db import throwaway_database  # noqa: E402

SUBNET = "127.0.5"  # never 127.0.0.x (tests), nor 127.0.1-4/6 (the other benchmarks)
TREE_FILES = 2000
TREE_BYTES = 50_000_000
BIG_FILES = [5_000_000] * 4 + [1_000_000] * 16  # 36 MB in 20 files; the rest are small source files
SMALL_SUFFIXES = (".py", ".py", ".py", ".json", ".yaml", ".txt")
RSYNC_DEST = "rsync-copy"
TRIAL_TIMEOUT_S = 300
HZ = os.sysconf("SC_CLK_TCK")


def code_under_test() -> dict:
    """Where the sync code this run loaded lives, and each file's sha256 (the working tree may hold edits)."""
    import hashlib

    from cluster import links
    from jobs import sync

    files = [Path(sync.__file__), Path(links.__file__), Path(links.NODE_CODE_DIR) / "codesync.py"]
    return {str(f): hashlib.sha256(f.read_bytes()).hexdigest()[:16] for f in files}


def make_tree(root: Path, seed: int = 7) -> dict:
    """2,000 files of random bytes, TREE_BYTES in all: many small ones in nested dirs, a few big ones."""
    rng = random.Random(seed)
    small_count = TREE_FILES - len(BIG_FILES)
    small_total = TREE_BYTES - sum(BIG_FILES)
    raw = [rng.lognormvariate(8.0, 1.0) for _ in range(small_count)]  # median ~3 KB, a long tail
    scale = small_total / sum(raw)
    sizes = [max(1, int(r * scale)) for r in raw]
    sizes[0] += small_total - sum(sizes)
    root.mkdir(parents=True)
    (root / "train.py").write_bytes(os.urandom(sizes[0]))
    for i, size in enumerate(sizes[1:], start=1):
        d = root / f"pkg{i % 20}" / f"sub{i % 7}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"mod{i}{SMALL_SUFFIXES[i % len(SMALL_SUFFIXES)]}").write_bytes(os.urandom(size))
    data = root / "assets"
    data.mkdir()
    for i, size in enumerate(BIG_FILES):
        (data / f"blob{i}.bin").write_bytes(os.urandom(size))
    files = [p for p in root.rglob("*") if p.is_file()]
    return {
        "files": len(files),
        "bytes": sum(p.stat().st_size for p in files),
        "small_files": small_count,
        "small_median_bytes": sorted(sizes)[len(sizes) // 2],
        "big_files": BIG_FILES,
    }


def machine_cpu_s() -> float:
    """CPU seconds used on the whole machine so far (every process: nodes, controller, other work)."""
    with open("/proc/stat") as fh:
        fields = [int(x) for x in fh.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / HZ


def nodes_cpu_s(pids: list[int]) -> float:
    """CPU seconds used so far by the given node sshds and everything they ran (sessions, shells, agents,
    receivers, rsync servers): each one's own and reaped children's time, and every live descendant's. Other
    work on the machine (another user's tests) is not in it, as it is in machine_cpu_s."""
    parent: dict[int, list[int]] = {}
    times: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent.setdefault(int(fields[1]), []).append(int(entry))
        times[int(entry)] = sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
    total, todo = 0, list(pids)
    while todo:
        pid = todo.pop()
        total += times.get(pid, 0)
        todo.extend(parent.get(pid, []))
    return total / HZ


def children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def self_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def reset_node(workdir: Path) -> None:
    for name in (".ugro", "outputs", RSYNC_DEST):
        shutil.rmtree(workdir / name, ignore_errors=True)


def copy_stats(path: Path) -> tuple[int, int]:
    files = [p for p in path.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def rsync_all(cluster, nodes, tree: Path) -> dict:
    """`rsync -a` of the tree to every node at once; seconds until the last exits, bytes it sent."""
    ssh = " ".join(["ssh", "-p", str(cluster.port), "-i", str(cluster.client_key), *SSH_OPTS])
    procs = []
    t0 = time.monotonic()
    for node in nodes:
        dest = f"{cluster.user}@{node.address}:{node.workdir}/{RSYNC_DEST}/"
        argv = ["rsync", "-a", "--stats", "-e", ssh, f"{tree}/", dest]
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=max(1.0, TRIAL_TIMEOUT_S - (time.monotonic() - t0))))
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate())
    seconds = time.monotonic() - t0
    failed = [(n.name, p.returncode, err.strip()[-300:]) for n, p, (_, err) in zip(nodes, procs, outs, strict=True)
              if p.returncode != 0]  # fmt: skip
    if failed:
        raise RuntimeError(f"rsync failed: {failed}")
    sent = 0
    for out, _ in outs:
        for line in out.splitlines():
            if line.startswith("Total bytes sent:"):
                sent += int(line.split(":", 1)[1].strip().replace(",", "").split()[0])
    return {"seconds": seconds, "sent_bytes": sent}


class Ugro:
    """The benchmark's side of UGRO: node rows, jobs with a snapshot, and timed pushes."""

    def __init__(self, cluster, tree: Path) -> None:
        from cluster.models import ClusterSettings, Node
        from jobs import sync

        cs = ClusterSettings.load()
        cs.paths = {**(cs.paths or {}), "sync_roots": [str(tree.parent)]}
        cs.save()
        self.tree = sync.check_source(str(tree), cs)
        self.rows = [
            Node.objects.create(name=n.name, address=n.address, ssh_port=n.port, user=cluster.user,
                                key_path=str(cluster.client_key), workdir=str(n.workdir), gpu_count=0, order=i,
                                role="master" if i == 0 else "worker")  # fmt: skip
            for i, n in enumerate(cluster.nodes)
        ]
        self.jobs = 0
        self.snapshots: list[dict] = []

    def snapshot(self) -> tuple[str, dict]:
        from jobs import sync

        t0 = time.monotonic()
        manifest, git = sync.snapshot(self.tree)
        self.snapshots.append({"seconds": round(time.monotonic() - t0, 4), "digest": manifest.digest[:12]})
        return manifest.digest, {"files": len(manifest.files), "bytes": manifest.total_bytes}

    def job(self, digest: str, listing: dict):
        from jobs.models import Job, JobCode

        self.jobs += 1
        job = Job.objects.create(name=f"sync-bench-{self.jobs}", script="train.py")
        JobCode.objects.create(job=job, sync_source=self.tree, sync_digest=digest, sync_files=listing["files"],
                               sync_bytes=listing["bytes"])  # fmt: skip
        return job

    def warm_links(self, rows) -> None:
        from cluster.fanout import node_request, on_each

        for _ in range(3):  # a connection that just failed repeats its failure for a connect timeout
            results = on_each(rows, lambda n: node_request(n, "hello"))
            bad = [(n.name, str(err)) for n, _, err in results if err is not None]
            if not bad:
                return
            time.sleep(6.0)
        raise RuntimeError(f"hello failed: {bad}")

    def push(self, job, rows) -> dict:
        from jobs import sync

        t0 = time.monotonic()
        pushed = sync.push(job, rows)
        return {"seconds": time.monotonic() - t0, "push_inner_s": pushed.seconds, "sent_bytes": pushed.sent_bytes}


def filesystem_of(path: Path) -> dict:
    """The mount that holds path (device, type, options) and whether it keeps a journal (ext4: dumpe2fs)."""
    best = None
    with open("/proc/mounts") as fh:
        for line in fh:
            dev, point, fstype, options = line.split()[:4]
            inside = (str(path.resolve()) + "/").startswith(point.rstrip("/") + "/")
            if inside and (best is None or len(point) > len(best[1])):
                best = (dev, point, fstype, options)
    if best is None:
        return {}
    out = {"device": best[0], "mount": best[1], "type": best[2], "options": best[3]}
    if best[2] == "ext4":
        dump = subprocess.run(["dumpe2fs", "-h", best[0]], capture_output=True, text=True).stdout
        lines = [ln for ln in dump.splitlines() if ln.startswith("Filesystem features")]
        features = lines[0].split(":", 1)[1].split() if lines else []
        out["journal"] = "has_journal" in features
    return out


def disk_counters(path: Path) -> tuple[int, ...] | None:
    """(in flight, sectors written, sectors discarded) of the disk that holds path, from /proc/diskstats."""
    dev = os.stat(path).st_dev
    want = (os.major(dev), os.minor(dev))
    with open("/proc/diskstats") as fh:
        for line in fh:
            f = line.split()
            if (int(f[0]), int(f[1])) == want:
                return (int(f[11]), int(f[9]), int(f[16]) if len(f) > 16 else 0)
    return None


def settle_disk(path: Path, timeout: float = 30.0) -> float:
    """os.sync(), then wait (bounded) until the disk is idle: nothing in flight, nothing written or discarded
    for 0.3 s. The root filesystem is mounted with `discard`: removing the last trial's gigabytes sends
    discards that would otherwise land in the next trial's clock, whichever method it times."""
    t0 = time.monotonic()
    os.sync()
    last = disk_counters(path)
    while last is not None and time.monotonic() - t0 < timeout:
        time.sleep(0.3)
        now = disk_counters(path)
        if now == last and now[0] == 0:
            break
        last = now
    return time.monotonic() - t0


def timed(fn, args: argparse.Namespace, node_pids: list[int]) -> dict:
    settle = settle_disk(args.disk)
    busy = wait_quiet(args.max_busy, args.quiet_wait)
    n0 = nodes_cpu_s(node_pids)
    m0, s0, c0 = machine_cpu_s(), self_cpu_s(), children_cpu_s()
    out = fn()
    controller = self_cpu_s() - s0 + children_cpu_s() - c0
    nodes = nodes_cpu_s(node_pids) - n0
    out.update(
        busy_before=round(busy, 2),
        disk_settle_s=round(settle, 2),
        load1=round(os.getloadavg()[0], 2),
        machine_cpu_s=round(machine_cpu_s() - m0, 3),
        controller_cpu_s=round(controller, 3),
        nodes_cpu_s=round(nodes, 3),
        own_cpu_s=round(controller + nodes, 3),
    )
    out["seconds"] = round(out["seconds"], 4)
    if "push_inner_s" in out:
        out["push_inner_s"] = round(out["push_inner_s"], 4)
    return out


def check_copies(paths: list[Path], want: dict | None) -> None:
    """Every copy holds the tree's files and bytes (want None: only that every copy is there)."""
    for path in paths:
        if want is None:
            if not path.is_dir():
                raise RuntimeError(f"{path}: no copy")
            continue
        got = copy_stats(path)
        if got != (want["files"], want["bytes"]):
            raise RuntimeError(f"{path}: {got[0]} files, {got[1]} bytes; want {want['files']}, {want['bytes']}")


def one_size(ugro: Ugro, cluster, size: int, rep: int, tree: Path, base: tuple[str, dict], args) -> dict:
    """Every cell at one size: each method from nodes emptied just before its cold trial (cold, unchanged,
    one file changed), the order alternating by repeat; then UGRO's cold trial with its links closed."""
    from cluster.links import pool
    from jobs import sync

    rows, nodes = ugro.rows[:size], cluster.nodes[:size]
    pids = [n.proc.pid for n in nodes]
    digest, listing = base
    row: dict = {"nodes": size, "repeat": rep, "rsync_first": rep % 2 == 0}

    def fresh_nodes() -> None:
        for node in nodes:
            reset_node(node.workdir)

    def ugro_cell(name: str, job) -> None:
        t0 = time.monotonic()
        try:
            row[name] = timed(lambda: ugro.push(job, rows), args, pids)
        except sync.SyncError as exc:  # kept as a result: a push that fails is a finding, not a crash
            row[f"{name}_failed"] = {"after_s": round(time.monotonic() - t0, 2), "error": str(exc)[:1000]}
            print(f"{name} at {size} nodes failed: {exc}", flush=True)
            return
        check_copies([Path(sync.code_dir_on(job, r)) for r in rows], listing if "changed" not in name else None)

    def rsync_cell(name: str) -> None:
        row[name] = timed(lambda: rsync_all(cluster, nodes, tree), args, pids)
        check_copies([n.workdir / RSYNC_DEST for n in nodes], listing if "changed" not in name else None)

    def with_one_changed(fn) -> None:
        changed = tree / "pkg1" / "sub1" / "mod1.py"
        original = changed.read_bytes()
        try:
            changed.write_bytes(original + b"\n# one more line\n")
            fn()
        finally:
            changed.write_bytes(original)

    def run_rsync() -> None:
        fresh_nodes()
        rsync_cell("rsync_cold")
        rsync_cell("rsync_unchanged")
        with_one_changed(lambda: rsync_cell("rsync_one_changed"))

    def run_ugro() -> None:
        fresh_nodes()
        ugro.warm_links(rows)
        ugro_cell("ugro_cold", ugro.job(digest, listing))
        ugro_cell("ugro_unchanged", ugro.job(digest, listing))
        pool.close_all()
        ugro_cell("ugro_cold_links_unchanged", ugro.job(digest, listing))
        ugro.warm_links(rows)
        with_one_changed(lambda: ugro_cell("ugro_one_changed", ugro.job(*ugro.snapshot())))

    for method in (run_rsync, run_ugro) if row["rsync_first"] else (run_ugro, run_rsync):
        method()
    fresh_nodes()
    pool.close_all()
    ugro_cell("ugro_cold_links_cold", ugro.job(digest, listing))
    ugro.warm_links(rows)
    return row


CELLS = ("cold", "unchanged", "one_changed")


def summarise(rows: list[dict], sizes: list[int]) -> list[dict]:
    out = []
    for size in sizes:
        mine = [r for r in rows if r["nodes"] == size]

        def med(key: str, field: str = "seconds", runs: list[dict] = mine) -> float | None:
            value = median([r[key][field] for r in runs if key in r])
            return round(value, 4) if value is not None else None

        def low(key: str, runs: list[dict] = mine) -> float | None:
            values = [r[key]["seconds"] for r in runs if key in r]
            return round(min(values), 4) if values else None

        failed = sorted(k for r in mine for k in r if k.endswith("_failed"))
        entry: dict = {"nodes": size, "repeats": len(mine), "ugro_failed_trials": failed}
        for cell in CELLS:
            entry[cell] = {
                "ugro_s": med(f"ugro_{cell}"),
                "rsync_s": med(f"rsync_{cell}"),
                "ugro_min_s": low(f"ugro_{cell}"),
                "rsync_min_s": low(f"rsync_{cell}"),
                "ugro_sent_bytes": med(f"ugro_{cell}", "sent_bytes"),
                "rsync_sent_bytes": med(f"rsync_{cell}", "sent_bytes"),
                "ugro_machine_cpu_s": med(f"ugro_{cell}", "machine_cpu_s"),
                "rsync_machine_cpu_s": med(f"rsync_{cell}", "machine_cpu_s"),
                "ugro_controller_cpu_s": med(f"ugro_{cell}", "controller_cpu_s"),
                "rsync_client_cpu_s": med(f"rsync_{cell}", "controller_cpu_s"),
                "ugro_nodes_cpu_s": med(f"ugro_{cell}", "nodes_cpu_s"),
                "rsync_nodes_cpu_s": med(f"rsync_{cell}", "nodes_cpu_s"),
                "ugro_own_cpu_s": med(f"ugro_{cell}", "own_cpu_s"),
                "rsync_own_cpu_s": med(f"rsync_{cell}", "own_cpu_s"),
            }
        entry["cold"]["ugro_cold_links_s"] = med("ugro_cold_links_cold")
        entry["unchanged"]["ugro_cold_links_s"] = med("ugro_cold_links_unchanged")
        entry["cold"]["ugro_cold_links_min_s"] = low("ugro_cold_links_cold")
        entry["unchanged"]["ugro_cold_links_min_s"] = low("ugro_cold_links_unchanged")
        out.append(entry)
    return out


def print_table(summary: list[dict]) -> None:
    print(f"{'nodes':>5} {'cell':<12} {'ugro s':>8} {'rsync s':>8} {'ugro/rsync':>10} {'ugro cold links s':>17} "
          f"{'ugro MB sent':>12} {'rsync MB sent':>13}")  # fmt: skip
    for entry in summary:
        for cell in CELLS:
            c = entry[cell]
            ratio = c["ugro_s"] / c["rsync_s"] if c["ugro_s"] and c["rsync_s"] else None
            cold_links = c.get("ugro_cold_links_s")
            ugro_mb, rsync_mb = (c["ugro_sent_bytes"] or 0) / 1e6, (c["rsync_sent_bytes"] or 0) / 1e6
            shown_ratio = "-" if ratio is None else f"{ratio:.2f}"
            shown_links = "-" if cold_links is None else f"{cold_links:.3f}"
            ugro_s, rsync_s = (f"{v:.3f}" if v is not None else "-" for v in (c["ugro_s"], c["rsync_s"]))
            print(f"{entry['nodes']:>5} {cell:<12} {ugro_s:>8} {rsync_s:>8} {shown_ratio:>10} "
                  f"{shown_links:>17} {ugro_mb:>12.2f} {rsync_mb:>13.2f}")  # fmt: skip
    print(f"{'nodes':>5} {'cell':<12} {'CPU s (medians):':<17} {'ugro own':>8} {'rsync own':>9} {'ugro ctl':>8} "
          f"{'rsync ctl':>9} {'ugro nodes':>10} {'rsync nodes':>11} {'ugro mach':>9} {'rsync mach':>10}")  # fmt: skip
    for entry in summary:
        for cell in CELLS:
            c = entry[cell]
            keys = ("ugro_own_cpu_s", "rsync_own_cpu_s", "ugro_controller_cpu_s", "rsync_client_cpu_s",
                    "ugro_nodes_cpu_s", "rsync_nodes_cpu_s", "ugro_machine_cpu_s", "rsync_machine_cpu_s")  # fmt: skip
            shown = ["-" if c[k] is None else f"{c[k]:.2f}" for k in keys]
            print(f"{entry['nodes']:>5} {cell:<12} {'':<17} {shown[0]:>8} {shown[1]:>9} {shown[2]:>8} {shown[3]:>9} "
                  f"{shown[4]:>10} {shown[5]:>11} {shown[6]:>9} {shown[7]:>10}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[3, 16])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--max-busy", type=float, default=0.6)
    parser.add_argument("--quiet-wait", type=float, default=3.0)
    parser.add_argument("--nodes-dir", type=Path, default=None,
                        help="where the nodes' working directories go (default: the temp dir, under /tmp)")
    parser.add_argument("--keep", action="store_true", help="leave the temp dir and the database")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally blocks stop the nodes, drop the DB
    with throwaway_database(keep=args.keep) as database_url:
        run(args, database_url)


def run(args: argparse.Namespace, database_url: str) -> None:
    tmp = make_tmp("ugro-sync-bench-")
    args.tmp = tmp
    info = machine_info()
    try:
        setup_django(tmp, database_url)
        from cluster.links import pool
        from tests.loopback import LoopbackCluster

        tree = tmp / "src" / "project"
        tree_info = make_tree(tree)
        info["code_under_test"] = code_under_test()
        info["rsync"] = subprocess.run(["rsync", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
        info["bashrc"] = bashrc_cost()
        nodes_root = tmp / "nodes"
        if args.nodes_dir:
            nodes_root = Path(tempfile.mkdtemp(prefix="ugro-sync-nodes-", dir=args.nodes_dir))
        args.disk = nodes_root
        info["nodes_filesystem"] = filesystem_of(nodes_root)
        cluster = LoopbackCluster(nodes_root, count=max(args.sizes), subnet=SUBNET).start()
        try:
            ugro = Ugro(cluster, tree)
            base = ugro.snapshot()  # the store is empty: every object is copied in
            ugro.snapshot()  # the same tree again: only hashed
            rows = []
            for rep in range(args.repeat):
                for size in args.sizes:
                    row = one_size(ugro, cluster, size, rep, tree, base, args)
                    rows.append(row)
                    brief = {k: v.get("seconds", v.get("after_s")) for k, v in row.items() if isinstance(v, dict)}
                    print(f"n={size} repeat {rep}: {brief}", flush=True)
        finally:
            pool.close_all()
            cluster.stop()
            if args.nodes_dir and not args.keep:
                shutil.rmtree(nodes_root, ignore_errors=True)
        summary = summarise(rows, args.sizes)
        info["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        at16 = next((s for s in summary if s["nodes"] == 16), None)
        goals = {}
        for s in summary:
            ugro_s, rsync_s = s["cold"]["ugro_s"], s["cold"]["rsync_s"]
            goals[f"cold_no_slower_than_rsync_{s['nodes']}"] = None if None in (ugro_s, rsync_s) else ugro_s <= rsync_s
        if at16 and at16["unchanged"]["ugro_s"] is not None:
            goals["unchanged_under_1s_16"] = at16["unchanged"]["ugro_s"] < 1.0
        write_json(RESULTS / "sync.json", {
            "benchmark": "sync",
            "goal": "no slower than rsync cold, under 1 s with nothing changed at 16 nodes",
            "meta": {**info, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                                      if k not in ("tmp", "disk")}, "tree": tree_info,
                     "subnet": SUBNET},
            "snapshots": ugro.snapshots,
            "summary": summary,
            "goals_met": goals,
            "trials": rows,
        })  # fmt: skip
        print_table(summary)
        print("goals:", goals)
    finally:
        if args.keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
