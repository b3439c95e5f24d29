#!/usr/bin/env python
"""A job's environment on every node (`--packages`, docs/envs.md): UGRO beside each node running pip install
from the same wheel files, at 3 and 16 loopback nodes, cold and warm, in one run.

    .venv/bin/python bench/envs.py [--sizes 3 16] [--budget-s 900] [--keep] [--out F]

The issue's proof (37): "build time and bytes sent by the controller for 3 and 16 nodes, cold and warm, beside
each node running `pip install -r` from the same files in the same run; goal: cold at 16 nodes at most 0.5x the
pip time, warm under 1 s, controller bytes at most 1.1x one node's download."

The lock (lock_text: tests/test_envs_e2e.py's): torch 2.13.0+cpu (the cp311 wheel this machine keeps in
/opt/wheels) with its dependencies, and a few small packages (EXTRA: numpy, pyyaml, tqdm, packaging), every one
pinned to what the machine's local index holds (/opt/pypi/simple, file://: no network). max(sizes) real sshd nodes
on 127.0.8.2.. (tests/loopback.py; a subnet of this benchmark's own), each its own working directory, one Node row
each (a throwaway PostgreSQL database, bench/_db.py); the nodes' agent Python is /usr/bin/python3 (3.11).

First the controller fetches the wheels once into its cache (jobs/envs.py download: pip download, the local
index; `controller_fetch_s`, not in either tool's clock: both tools then start from the same files). Then, for
each size N, on nodes whose working directories are emptied before:

  ugro cold  jobs.envs.prepare(job, nodes[:N]) over links opened beforehand: the wheels and uv sent by the
             transfer path (each byte once from the controller, node to node after), each node building with uv
             offline. Figures: the wall time around the call, the record's controller_bytes and peer_bytes, the
             slowest node's build seconds.
  ugro warm  a second job with the same lock: every environment kept, nothing sent.
  pip cold   the same wheel files and the lock as requirements.txt, `rsync -a` from the controller to every node
             at once (bench/sync.py rsync_all: each node's download), then on every node at once over SSH:
             `python3 -m venv pip-env && pip-env/bin/pip install --no-index --find-links rsync-copy -r
             rsync-copy/requirements.txt` (pip's defaults: it compiles .pyc files, uv does not). Controller
             bytes: rsync's "Total bytes sent", summed.
  pip warm   the rsync and the pip install again (everything already there: "Requirement already satisfied").

Each result is checked: the first and the last node's environment imports torch, numpy, yaml and tqdm. The
working directories are emptied after each size (disk: about 1.5 GB a node for both tools). `one_node_download`
is the lock's wheels' bytes: what pip needs on one node. The run stops starting new sizes past --budget-s and
says so (`meta.skipped`). Results: bench/results/envs.json (--out overrides), overwritten. The machine has 2
cores shared with other work: at 16 nodes both tools are bound by its CPU and disk (16 unpacks of torch at once),
which 16 real machines would each do on their own.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sync as sync_bench  # noqa: E402  (bench/sync.py: rsync_all, the CPU readers)
from _common import (  # noqa: E402
    RESULTS,
    SSH_OPTS,
    cpu_busy,
    machine_info,
    make_tmp,
    node_rows,
    setup_django,
    write_json,
)
from _db import throwaway_database  # noqa: E402

SUBNET = "127.0.8"  # never 127.0.0.x (tests), nor 127.0.1-7 (the other benchmarks)
NODE_PYTHON = "/usr/bin/python3"
PIP_ENV = "pip-env"
STEP_TIMEOUT_S = 1800.0  # pip at 16 nodes on this 2-core machine: about 20 minutes
GOAL_COLD_X = 0.5
GOAL_WARM_S = 1.0
GOAL_BYTES_X = 1.1
INDEX = {"PIP_INDEX_URL": "file:///opt/pypi/simple", "PIP_EXTRA_INDEX_URL": "file:///opt/pypi-more/simple",
         "PIP_FIND_LINKS": "/opt/wheels"}  # fmt: skip
EXTRA = "numpy==2.4.6\npyyaml==6.0.3\ntqdm==4.70.1\npackaging==26.3\n"  # beside torch and its dependencies
CHECK = "import torch, numpy, yaml, tqdm; print(torch.__version__)"
NOTES = [
    "One machine with 2 cores, shared with other work (loadavg in each trial): every node's sshd, agent, uv or pip "
    "share them with the controller, so at 16 nodes both tools' times are set by this machine's CPU and disk "
    "(16 unpacks of torch at once); on 16 real machines each node's build runs on its own cores and disk.",
    "pip runs with its defaults: it compiles every .py file to .pyc as it installs; uv does not (its "
    "--compile-bytecode is off by default), which is part of uv's lead.",
    "ugro controller_bytes include uv itself (the controller's binary gzipped, uv_sent_bytes, sent once to nodes "
    "that lack it); one_node_download is the lock's wheels alone (pip is already on the nodes).",
    "Both tools start from the wheels in the controller's cache (controller_fetch_s, paid once, is in neither).",
]


def lock_text() -> str:
    """The end-to-end test's torch lock (torch 2.13.0+cpu and its dependencies, pinned to the local index) without
    its test package, and EXTRA."""
    from tests.test_envs_e2e import LOCK

    return "".join(line + "\n" for line in LOCK.splitlines() if line and not line.startswith("tinya")) + EXTRA


class Bench:
    def __init__(self, args, cluster, tmp: Path) -> None:
        from cluster.models import ClusterSettings
        from jobs import envs

        self.args, self.cluster, self.tmp = args, cluster, tmp
        locks = tmp / "locks"
        locks.mkdir()
        (locks / "requirements.txt").write_text(lock_text())
        cs = ClusterSettings.load()
        cs.paths = {**(cs.paths or {}), "sync_roots": [str(locks)]}
        cs.save()
        self.lock = envs.read_lock(str(locks / "requirements.txt"))
        self.rows = node_rows(cluster)
        self.node_pids = [n.proc.pid for n in cluster.nodes]
        self.jobs = 0
        self.wheels: list = []
        self.tree = tmp / "pip-wheels"

    def fetch(self) -> dict:
        """The controller's cache filled once (pip download from the local index), for the nodes' Python and
        platform; the pip peer's tree: the same files (hard links) and the lock."""
        from cluster.fanout import node_request
        from jobs import envs

        info = node_request(self.rows[0], "env_info", timeout=60, workdir=self.rows[0].workdir)
        t0 = time.monotonic()
        self.wheels = envs.download(self.lock.requirements(), info["version"], info["platforms"], "bench")
        fetch_s = time.monotonic() - t0
        self.tree.mkdir()
        for w in self.wheels:
            os.link(w.file, self.tree / os.path.basename(w.file))
        (self.tree / "requirements.txt").write_text(self.lock.requirements(hashes=False))
        return {"controller_fetch_s": round(fetch_s, 2), "python": info["version"], "platform": info["platforms"][0],
                "wheels": len(self.wheels), "one_node_download": sum(w.size for w in self.wheels),
                "torch_wheel_bytes": next(w.size for w in self.wheels if envs.norm(w.name) == "torch"),
                "uv_bytes": os.path.getsize(envs.uv_binary()), "uv": envs.uv_version(),
                "uv_sent_bytes": os.path.getsize(envs._uv_gzipped())}  # fmt: skip

    def reset(self, n: int) -> None:
        for c in self.cluster.nodes[:n]:
            for name in (".ugro", sync_bench.RSYNC_DEST, PIP_ENV):
                shutil.rmtree(c.workdir / name, ignore_errors=True)

    def _trial_head(self) -> dict:
        return {"loadavg": [round(x, 2) for x in os.getloadavg()], "busy_before": round(cpu_busy(), 2)}

    def ugro(self, n: int) -> dict:
        from jobs import envs
        from jobs.models import Job, JobCode

        self.jobs += 1
        job = Job.objects.create(name=f"envs-bench-{self.jobs}", script="train.py")
        JobCode.objects.create(job=job, envs={"lock": self.lock.as_dict()})
        out = self._trial_head()
        cpu = sync_bench.nodes_cpu_s(self.node_pids)
        t0 = time.monotonic()
        try:
            paths = envs.prepare(job, self.rows[:n])
        except envs.EnvError as exc:
            out.update(failed=str(exc), wall_s=round(time.monotonic() - t0, 2))
            return out
        wall = time.monotonic() - t0
        rec = JobCode.objects.get(job=job).envs
        builds = [v.get("seconds") or 0.0 for v in rec["nodes"].values() if not v["kept"]]
        out.update(wall_s=round(wall, 3), controller_bytes=rec["controller_bytes"], peer_bytes=rec["peer_bytes"],
                   built=len(builds), kept=sum(1 for v in rec["nodes"].values() if v["kept"]),
                   slowest_build_s=round(max(builds), 2) if builds else None,
                   nodes_cpu_s=round(sync_bench.nodes_cpu_s(self.node_pids) - cpu, 2))  # fmt: skip
        out["check"] = self.check([paths[self.rows[0].pk], paths[self.rows[n - 1].pk]])
        return out

    def pip(self, n: int) -> dict:
        nodes = self.cluster.nodes[:n]
        out = self._trial_head()
        cpu = sync_bench.nodes_cpu_s(self.node_pids)
        t0 = time.monotonic()
        copied = sync_bench.rsync_all(self.cluster, nodes, self.tree)
        installed = self.pip_all(nodes)
        wall = time.monotonic() - t0
        out.update(wall_s=round(wall, 3), copy_s=round(copied["seconds"], 3), install_s=round(installed, 3),
                   controller_bytes=copied["sent_bytes"],
                   nodes_cpu_s=round(sync_bench.nodes_cpu_s(self.node_pids) - cpu, 2))  # fmt: skip
        out["check"] = self.check([str(nodes[0].workdir / PIP_ENV), str(nodes[-1].workdir / PIP_ENV)])
        return out

    def pip_all(self, nodes) -> float:
        """On every node at once over SSH: a venv (unless there) and pip install from the copied wheels."""
        ssh = ["ssh", "-p", str(self.cluster.port), "-i", str(self.cluster.client_key), *SSH_OPTS]
        procs = []
        t0 = time.monotonic()
        for node in nodes:
            wd = shlex.quote(str(node.workdir))
            script = (f"cd {wd} && {{ test -x {PIP_ENV}/bin/pip || {NODE_PYTHON} -m venv {PIP_ENV}; }} && "
                      f"{PIP_ENV}/bin/pip install --quiet --disable-pip-version-check --no-index --find-links "
                      f"{sync_bench.RSYNC_DEST} -r {sync_bench.RSYNC_DEST}/requirements.txt")  # fmt: skip
            argv = [*ssh, f"{self.cluster.user}@{node.address}", script]
            procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        failed = []
        for node, p in zip(nodes, procs, strict=True):
            try:
                _, err = p.communicate(timeout=max(1.0, STEP_TIMEOUT_S - (time.monotonic() - t0)))
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate()
            if p.returncode != 0:
                failed.append((node.name, p.returncode, err.strip()[-300:]))
        if failed:
            raise RuntimeError(f"pip install failed: {failed}")
        return time.monotonic() - t0

    @staticmethod
    def check(envs: list[str]) -> str:
        """'ok' when each environment's python imports the lock's packages, else what failed."""
        for env in dict.fromkeys(envs):
            got = subprocess.run([f"{env}/bin/python", "-c", CHECK], capture_output=True, text=True, timeout=300)
            if got.returncode != 0 or got.stdout.strip() != "2.13.0+cpu":
                return f"{env}: {(got.stderr or got.stdout).strip()[-300:]}"
        return "ok"


def summarise(trials: list[dict], download: int) -> list[dict]:
    out = []
    for t in trials:
        u, p = t.get("ugro_cold", {}), t.get("pip_cold", {})
        row = {"nodes": t["nodes"]}
        for tool in ("ugro_cold", "ugro_warm", "pip_cold", "pip_warm"):
            row[f"{tool}_s"] = t.get(tool, {}).get("wall_s")
            row[f"{tool}_controller_bytes"] = t.get(tool, {}).get("controller_bytes")
        row["cold_ugro_over_pip"] = round(u["wall_s"] / p["wall_s"], 3) if u.get("wall_s") and p.get("wall_s") else None
        cb = u.get("controller_bytes")
        row["ugro_cold_controller_x_one_node"] = round(cb / download, 3) if cb is not None else None
        uv = t.get("uv_sent_bytes") or 0
        row["ugro_cold_wheel_bytes_x_one_node"] = round((cb - uv) / download, 3) if cb is not None else None
        pb = p.get("controller_bytes")
        row["pip_cold_controller_x_one_node"] = round(pb / download, 3) if pb is not None else None
        out.append(row)
    return out


def goals_of(summary: list[dict], sizes: list[int]) -> dict:
    goals: dict = {}
    top = next((s for s in summary if s["nodes"] == max(sizes)), None)
    if top:
        r = top["cold_ugro_over_pip"]
        goals[f"cold_at_{top['nodes']}_nodes_at_most_{GOAL_COLD_X}x_pip"] = None if r is None else r <= GOAL_COLD_X
    for s in summary:
        w = s["ugro_warm_s"]
        goals[f"warm_at_{s['nodes']}_nodes_under_{GOAL_WARM_S:g}_s"] = None if w is None else w < GOAL_WARM_S
        x = s["ugro_cold_controller_x_one_node"]
        goals[f"controller_bytes_at_{s['nodes']}_nodes_at_most_{GOAL_BYTES_X}x_one_node"] = (
            None if x is None else x <= GOAL_BYTES_X
        )
    return goals


def _f(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def print_table(summary: list[dict]) -> None:
    print(f"{'nodes':>5} {'ugro cold':>10} {'pip cold':>10} {'ratio':>6} {'ugro warm':>10} {'pip warm':>10} "
          f"{'ugro MB':>9} {'pip MB':>9}")  # fmt: skip
    for s in summary:
        mb = [None if s[k] is None else s[k] / 1e6 for k in ("ugro_cold_controller_bytes", "pip_cold_controller_bytes")]
        print(f"{s['nodes']:>5} {_f(s['ugro_cold_s']):>10} {_f(s['pip_cold_s']):>10} {_f(s['cold_ugro_over_pip']):>6} "
              f"{_f(s['ugro_warm_s'], '.3f'):>10} {_f(s['pip_warm_s']):>10} {_f(mb[0], '.1f'):>9} "
              f"{_f(mb[1], '.1f'):>9}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[3, 16])
    parser.add_argument("--budget-s", type=float, default=900.0, help="no new size is started past this")
    parser.add_argument("--keep", action="store_true", help="leave the temp dir and the database")
    parser.add_argument("--out", type=Path, default=RESULTS / "envs.json")
    args = parser.parse_args()
    if min(args.sizes) < 1 or max(args.sizes) > 60:
        parser.error("sizes from 1 to 60")
    if not sorted(Path("/opt/wheels").glob("torch-2.13.0*-cp311-*.whl")):
        parser.error("no torch 2.13.0 cp311 wheel in /opt/wheels on this machine")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally blocks undo everything
    with throwaway_database(keep=args.keep) as database_url:
        run(args, database_url)


def run(args, database_url: str) -> None:
    tmp = make_tmp("ugro-envs-bench-")
    info = machine_info()
    start = time.monotonic()
    try:
        os.environ.update(INDEX)  # the controller's pip: this machine's local index, no network
        setup_django(tmp, database_url)
        from cluster.links import pool
        from tests.loopback import LoopbackCluster

        info["notes"] = NOTES
        cluster = LoopbackCluster(tmp / "nodes", count=max(args.sizes), subnet=SUBNET).start()
        trials, skipped = [], []
        try:
            bench = Bench(args, cluster, tmp)
            info["fetch"] = bench.fetch()
            print("fetched:", info["fetch"], flush=True)
            for n in args.sizes:
                if time.monotonic() - start > args.budget_s:
                    skipped.append(n)
                    continue
                bench.reset(n)
                sync_bench.Ugro.warm_links(None, bench.rows[:n])  # a `hello` to each node (the worker's links)
                trial = {"nodes": n, "uv_sent_bytes": info["fetch"]["uv_sent_bytes"]}
                for name, call in (("ugro_cold", bench.ugro), ("ugro_warm", bench.ugro), ("pip_cold", bench.pip),
                                   ("pip_warm", bench.pip)):  # fmt: skip
                    try:
                        trial[name] = call(n)
                    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:  # said in the results
                        trial[name] = {"failed": str(exc)[:500]}
                    print(f"n={n} {name}: {trial[name]}", flush=True)
                bench.reset(n)
                trials.append(trial)
        finally:
            pool.close_all()
            cluster.stop()
        summary = summarise(trials, info["fetch"]["one_node_download"])
        goals = goals_of(summary, args.sizes)
        info["skipped"] = skipped
        info["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        info["total_s"] = round(time.monotonic() - start, 1)
        info["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        info["subnet"] = SUBNET
        write_json(args.out, {
            "benchmark": "envs",
            "goal": "cold at 16 nodes at most 0.5x the pip time, warm under 1 s, controller bytes at most 1.1x one "
                    "node's download",
            "lock": lock_text().split(),
            "meta": info,
            "summary": summary,
            "goals_met": goals,
            "trials": trials,
        })  # fmt: skip
        print_table(summary)
        print("goals:", goals)
        print("wrote", args.out)
    finally:
        if args.keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
