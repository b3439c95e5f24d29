#!/usr/bin/env python
"""How long until a rank process runs on every one of N nodes: sequential ssh, pdsh, UGRO.

    .venv/bin/python bench/launch_fanout.py [--sizes 1,4,8,16] [--repeat 3]

Real sshd nodes on 127.0.1.2.. (cluster.loopback), a throwaway SQLite UGRO; every method starts
the same long-sleeping rank (<node env>/bin/python -c "import time; time.sleep(30)") carrying
UGRO_JOB=<tag> UGRO_NODE=<node> on each node:

  seq_ssh    one `ssh ... 'UGRO_JOB=.. UGRO_NODE=.. nohup setsid CMD >/dev/null 2>&1 &'` per node,
             one after the other (what the original scripts did)
  pdsh       one `pdsh -R ssh -w addr1,addr2,..` (fanout 32) running the same one-liner, the node
             name derived from pdsh's %h substitution
  ugro_cold  a fresh python process (bench/_ugro_launch_once.py): django.setup(), links to all
             nodes at once (SSH + agent bootstrap + hello), then one agent `start` per node at once
  ugro_warm  the same `start` requests from this process over links opened before the clock
             starts (as the Celery worker holds them)

The clock runs from just before the command is issued until a separate watcher process
(bench/_procwatch.py, polling /proc every 5 ms) sees N exec'd rank processes with the tag.
Results: bench/results/launch_fanout.json (overwritten) and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    BENCH,
    CONTROLLER_PY,
    NODE_PY,
    REPO,
    RESULTS,
    SSH_OPTS,
    SUBNET,
    bashrc_cost,
    cpu_busy,
    kill_tagged,
    machine_info,
    make_tmp,
    median,
    setup_django,
    tagged_pids,
    wait_quiet,
    write_json,
)

METHODS = ("seq_ssh", "pdsh", "ugro_cold", "ugro_warm")
SLEEP_CODE = "import time; time.sleep(30)"
RANK_ARGV = [str(NODE_PY), "-c", SLEEP_CODE]
DETECT_TIMEOUT = 60.0


class Watcher:
    """The /proc watcher subprocess: arm it with a tag, then read when the ranks appeared."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(BENCH / "_procwatch.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )

    def arm(self, tag: str, count: int) -> None:
        req = {"tag": tag, "count": count, "argv": RANK_ARGV, "timeout": DETECT_TIMEOUT, "interval": 0.005}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"watcher said {line!r}")

    def result(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("watcher died")
        return json.loads(line)

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def controller_cpu() -> float:
    """CPU seconds used on the controller side: this process plus its reaped children (ssh, pdsh, helper)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def remote_oneliner(tag: str, node_expr: str) -> str:
    """The shell line each node runs for seq_ssh/pdsh; node_expr is a literal name or a `$n`."""
    cmd = " ".join(shlex.quote(a) for a in RANK_ARGV)
    return f"UGRO_JOB={tag} UGRO_NODE={node_expr} nohup setsid {cmd} >/dev/null 2>&1 &"


class Bench:
    def __init__(self, cluster, tmp: Path) -> None:
        self.cluster = cluster
        self.tmp = tmp
        self.ugro_env = {k: os.environ[k] for k in ("DATABASE_URL", "UGRO_DATA_DIR", "REDIS_URL")}
        from cluster.models import Node

        self.nodes = [
            Node(
                name=n.name,
                address=n.address,
                ssh_port=n.port,
                user=cluster.user,
                key_path=str(cluster.client_key),
                agent_python="/usr/bin/python3",
                workdir=str(n.workdir),
            )  # fmt: skip
            for n in cluster.nodes
        ]
        self.ssh_base = ["ssh", "-i", str(cluster.client_key), "-p", str(cluster.port), *SSH_OPTS]

    # -- the four ways of issuing ----------------------------------------------------------------
    def issue_seq_ssh(self, tag: str, n: int) -> dict:
        stderr = []
        for node in self.nodes[:n]:
            proc = subprocess.run(
                [*self.ssh_base, f"{self.cluster.user}@{node.address}", remote_oneliner(tag, node.name)],
                stdin=subprocess.DEVNULL, capture_output=True, text=True, check=True, timeout=30,
            )  # fmt: skip
            stderr += proc.stderr.splitlines()
        return {"stderr": stderr}

    def issue_pdsh(self, tag: str, n: int) -> dict:
        nodes = self.nodes[:n]
        cases = " ".join(f"{node.address}) n={node.name};;" for node in nodes)
        line = f"case %h in {cases} esac; " + remote_oneliner(tag, "$n")
        env = dict(
            os.environ,
            PDSH_RCMD_TYPE="ssh",
            PDSH_SSH_ARGS_APPEND=" ".join(
                ["-i", str(self.cluster.client_key), "-p", str(self.cluster.port), *SSH_OPTS]
            ),
        )
        proc = subprocess.run(
            ["pdsh", "-R", "ssh", "-f", "32", "-l", self.cluster.user, "-w", ",".join(x.address for x in nodes), line],
            stdin=subprocess.DEVNULL, env=env, capture_output=True, text=True, check=True, timeout=60,
        )  # fmt: skip
        return {"stderr": proc.stderr.splitlines()}

    def _node_spec(self, node) -> dict:
        return {
            "name": node.name, "address": node.address, "port": node.ssh_port, "user": node.user,
            "key": node.key_path, "python": node.agent_python, "workdir": node.workdir,
        }  # fmt: skip

    def issue_ugro_cold(self, tag: str, n: int) -> dict:
        spec = {"nodes": [self._node_spec(x) for x in self.nodes[:n]], "tag": tag, "argv": RANK_ARGV}
        proc = subprocess.run(
            [str(CONTROLLER_PY), str(BENCH / "_ugro_launch_once.py"), json.dumps(spec)],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
            env={**os.environ, **self.ugro_env}, cwd=REPO,
        )  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"ugro_cold helper failed: {proc.stdout[-500:]} {proc.stderr[-1500:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def warm_up(self, n: int) -> None:
        from jobs.nodes import node_request, on_each

        res = on_each(self.nodes[:n], lambda x: node_request(x, "hello", timeout=10))
        errs = [f"{x.name}: {e}" for x, _, e in res if e]
        if errs:
            raise RuntimeError("warm-up failed: " + "; ".join(errs))

    def issue_ugro_warm(self, tag: str, n: int) -> dict:
        from jobs.nodes import node_request, on_each

        def start(node) -> dict:
            base = f"{node.workdir}/.bench/{tag}"
            return node_request(
                node, "start", timeout=30, argv=RANK_ARGV, env={"UGRO_JOB": tag, "UGRO_NODE": node.name},
                cwd=node.workdir, log=f"{base}/rank.log", exit_file=f"{base}/rank.exit",
            )  # fmt: skip

        res = on_each(self.nodes[:n], start)
        errs = [f"{x.name}: {e}" for x, _, e in res if e]
        if errs:
            raise RuntimeError("ugro_warm start failed: " + "; ".join(errs))
        return {}

    # -- one timed trial ---------------------------------------------------------------------------
    def trial(self, watcher: Watcher, method: str, n: int, max_busy: float = 1.0, quiet_s: float = 0.0) -> dict:
        tag = f"bench-{method}-{n}-{uuid.uuid4().hex[:8]}"
        if method == "ugro_warm":
            self.warm_up(n)  # links are warm before the clock starts, as in the worker
        issue = getattr(self, f"issue_{method}")
        # Other people's work shares these 2 cores: wait (bounded) for a quiet moment, and record it.
        busy = wait_quiet(max_busy, quiet_s) if quiet_s > 0 else cpu_busy(0.1)
        load = os.getloadavg()[0]
        watcher.arm(tag, n)
        cpu0 = controller_cpu()
        t0 = time.monotonic()
        info: dict = {}
        error = None
        try:
            info = issue(tag, n)
        except Exception as exc:  # recorded, and the ranks that did start are still cleaned up
            error = f"{type(exc).__name__}: {exc}"
        t_returned = time.monotonic()
        cpu = controller_cpu() - cpu0
        seen = watcher.result()
        survivors = kill_tagged(tag)
        row = {
            "method": method,
            "n": n,
            "tag": tag,
            "loadavg_1m": round(load, 2),
            "cpu_busy_before": round(busy, 2),
            "issuer_returned_s": round(t_returned - t0, 4),
            "controller_cpu_s": round(cpu, 4),
            "all_running_s": None if seen.get("timeout") else round(seen["found_at"] - t0, 4),
            "ranks_seen": len(seen["pids"]),
            "polls": seen["polls"],
        }
        if method == "ugro_cold" and "t_main" in info:
            row["cold_breakdown_s"] = {
                "process_start_to_main": round(info["t_main"] - t0, 4),
                "django_setup_and_imports": round(info["t_setup"] - info["t_main"], 4),
                "connect_all_links": round(info["t_connected"] - info["t_setup"], 4),
                "start_requests": round(info["t_started"] - info["t_connected"], 4),
            }
        if info.get("stderr"):
            row["stderr_lines"] = len(info["stderr"])
            row["stderr_sample"] = info["stderr"][:3]
        if error:
            row["error"] = error
        if survivors:
            row["survivors_after_kill"] = survivors
        return row


def summarize(rows: list[dict], sizes: list[int]) -> dict:
    med: dict[str, dict[str, float | None]] = {}
    best: dict[str, dict[str, float | None]] = {}
    for m in METHODS:
        med[m], best[m] = {}, {}
        for n in sizes:
            vals = [r["all_running_s"] for r in rows if r["method"] == m and r["n"] == n]
            med[m][str(n)] = median(vals)
            best[m][str(n)] = min((v for v in vals if v is not None), default=None)
    lo, hi = str(min(sizes)), str(max(sizes))
    ratio, ratio_min = {}, {}
    for m in METHODS:
        a, b = med[m][lo], med[m][hi]
        ratio[m] = round(b / a, 2) if a and b else None
        a, b = best[m][lo], best[m][hi]
        ratio_min[m] = round(b / a, 2) if a and b else None
    ugro_le_pdsh = {}
    for n in sizes:
        p = med["pdsh"][str(n)]
        ugro_le_pdsh[str(n)] = {
            k: (med[k][str(n)] is not None and p is not None and med[k][str(n)] <= p)
            for k in ("ugro_warm", "ugro_cold")
        }
    cpu = {
        m: {str(n): median([r["controller_cpu_s"] for r in rows if r["method"] == m and r["n"] == n]) for n in sizes}
        for m in METHODS
    }
    returned = {
        m: {str(n): median([r["issuer_returned_s"] for r in rows if r["method"] == m and r["n"] == n]) for n in sizes}
        for m in METHODS
    }
    return {
        "median_all_running_s": med,
        "min_all_running_s": best,
        "median_issuer_returned_s": returned,
        "median_controller_cpu_s": cpu,
        f"ratio_t{hi}_over_t{lo}": ratio,
        f"ratio_t{hi}_over_t{lo}_of_min": ratio_min,
        "ugro_le_pdsh": ugro_le_pdsh,
    }


def cold_breakdown(rows: list[dict], sizes: list[int]) -> dict:
    out = {}
    for n in sizes:
        parts = [
            r["cold_breakdown_s"]
            for r in rows
            if r["method"] == "ugro_cold" and r["n"] == n and "cold_breakdown_s" in r
        ]
        if parts:
            out[str(n)] = {k: median([p[k] for p in parts]) for k in parts[0]}
    return out


def print_table(summary: dict, sizes: list[int], breakdown: dict) -> None:
    head = f"{'method':<11}" + "".join(f"{'N=' + str(n):>10}" for n in sizes)
    ratio_key = next(k for k in summary if k.startswith("ratio_") and not k.endswith("_of_min"))
    for title, key, rkey in (
        ("median", "median_all_running_s", ratio_key),
        ("best (min)", "min_all_running_s", ratio_key + "_of_min"),
    ):
        table = summary[key]
        print(f"\n{title} seconds from command to all N ranks running")
        print(head + f"{ratio_key.removeprefix('ratio_'):>12}")
        for m in METHODS:
            cells = "".join(
                f"{table[m][str(n)]:>10.3f}" if table[m][str(n)] is not None else f"{'-':>10}" for n in sizes
            )
            r = summary[rkey][m]
            print(f"{m:<11}{cells}{(f'{r:.2f}' if r else '-'):>12}")
    print("\nUGRO <= pdsh at each N (warm / cold):")
    for n in sizes:
        v = summary["ugro_le_pdsh"][str(n)]
        print(f"  N={n:<3} warm={v['ugro_warm']!s:<6} cold={v['ugro_cold']!s}")
    print("\nmedian controller-side CPU seconds per launch (this process + reaped children)")
    print(head)
    for m in METHODS:
        row = summary["median_controller_cpu_s"][m]
        print(f"{m:<11}" + "".join(f"{row[str(n)]:>10.3f}" if row[str(n)] is not None else f"{'-':>10}" for n in sizes))
    if breakdown:
        print("\nugro_cold breakdown (medians, s):")
        for n, parts in breakdown.items():
            print(f"  N={n:<3} " + "  ".join(f"{k}={v:.3f}" for k, v in parts.items()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,4,8,16", help="comma-separated node counts")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--out", default=str(RESULTS / "launch_fanout.json"))
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (nodes, DB) afterwards")
    ap.add_argument("--max-busy", type=float, default=0.6, help="wait for CPU busy <= this before a trial")
    ap.add_argument("--quiet-wait", type=float, default=3.0, help="longest wait for that, seconds (0: never)")
    args = ap.parse_args()
    sizes = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
    methods = [m for m in args.methods.split(",") if m]
    if not sizes or min(sizes) < 1 or max(sizes) > 60:
        ap.error("sizes must be between 1 and 60")
    if any(m not in METHODS for m in methods) or args.repeat < 1:
        ap.error(f"methods are {', '.join(METHODS)}; repeat >= 1")
    if not NODE_PY.exists():
        print(f"node env missing: {NODE_PY}", file=sys.stderr)
        return 2

    tmp = make_tmp("ugro-bench-fanout-")
    setup_django(tmp)
    from cluster.links import pool
    from cluster.loopback import LoopbackCluster

    meta = machine_info()
    meta["bashrc"] = bashrc_cost()
    meta.update({"sizes": sizes, "repeat": args.repeat, "methods": methods, "tmp": str(tmp), "subnet": SUBNET})
    meta.update({"max_busy": args.max_busy, "quiet_wait_s": args.quiet_wait, "poll_interval_s": 0.005})
    rows: list[dict] = []
    t_start = time.monotonic()
    cluster = LoopbackCluster(tmp / "nodes", max(sizes), subnet=SUBNET, first_octet=2)
    watcher = None
    try:
        cluster.start()
        watcher = Watcher()
        bench = Bench(cluster, tmp)
        # One untimed round first: page cache, sshd's first fork, pdsh/ssh binaries.
        for m in methods:
            bench.trial(watcher, m, min(sizes))
        for n in sizes:
            for rep in range(args.repeat):
                # Rotate the order each repeat so no method always runs right after another.
                order = methods[rep % len(methods) :] + methods[: rep % len(methods)]
                for m in order:
                    row = bench.trial(watcher, m, n, args.max_busy, args.quiet_wait)
                    row["repeat"] = rep
                    rows.append(row)
                    shown = f"{row['all_running_s']:.3f}s" if row["all_running_s"] is not None else "TIMEOUT"
                    print(f"N={n:<3} rep={rep} {m:<10} {shown}  (busy {row['cpu_busy_before']:.0%})" +
                          (f"  ERROR {row['error']}" if "error" in row else ""), flush=True)  # fmt: skip
    finally:
        pool.close_all()
        if watcher is not None:
            watcher.close()
        cluster.stop()
        left = [r["tag"] for r in rows if tagged_pids(r["tag"])]
        for tag in left:
            kill_tagged(tag)
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    meta["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    meta["elapsed_s"] = round(time.monotonic() - t_start, 1)
    summary = summarize(rows, sizes)
    breakdown = cold_breakdown(rows, sizes)
    write_json(Path(args.out), {"meta": meta, "summary": summary, "ugro_cold_breakdown_s": breakdown, "trials": rows})
    print_table(summary, sizes, breakdown)
    b = meta["bashrc"]
    print(
        f"\nroot's .bashrc per SSH command: +{b['bashrc_extra_wall_s']:.3f}s wall, +{b['bashrc_extra_cpu_s']:.3f}s CPU"
        f"; wrote {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
