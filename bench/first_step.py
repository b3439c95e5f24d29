#!/usr/bin/env python
"""Time from command to the first training step on 2 nodes: bare torchrun by hand vs. UGRO.

    .venv/bin/python bench/first_step.py [--repeat 3]

Two real sshd nodes on 127.0.1.2-3 (tests/loopback.py), each with the repo's train/ in its working
dir, and a throwaway PostgreSQL UGRO with the nodes imported from cluster.yaml. Every trial trains
train/train_production.py for 5 steps (tiny model, --seq-len 32 --batch-size 8, a log line per
step) with a rendezvous port of its own:

  bare       two `ssh node 'cd WD && torchrun --nnodes=2 ... > WD/<log> 2>&1'` started at once
             (Popen), as one would by hand in two terminals
  ugro_warm  create_job() + schedule() in this process over links opened beforehand (the path a
             launch through the running worker takes: hello, pre-flight, start)
  ugro_cmd   a fresh `manage.py launch --detach --name X --nodes 2 -- ...` subprocess while a real
             worker (bench/_worker.py: `bin/worker`, Redis db 11) is up: the command queues the job and
             the worker starts and follows it. The worker is paused (SIGSTOP, heartbeat deleted) during
             the other methods' trials. (The command with no worker, once method `ugro_cold`, is gone:
             since 1c16252 it refuses without a worker, the only executor of job work.)

The clock runs from the command to the first line starting with {"step" in the rank logs (each
node's log file, polled every 10 ms; all nodes are this machine). Results:
bench/results/first_step.json (overwritten) and a table on stdout.
"""

from __future__ import annotations

import argparse
import glob
import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    BENCH_REDIS,
    CONTROLLER_PY,
    NODE_ENV,
    NODE_TORCHRUN,
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
from _db import throwaway_database  # noqa: E402
from _worker import Worker, bench_redis  # noqa: E402

METHODS = ("bare", "ugro_warm", "ugro_cmd")
EXTRA = ["--max-steps", "5", "--log-every", "1", "--seq-len", "32", "--batch-size", "8"]
STEP_TIMEOUT = 120.0
FINISH_TIMEOUT = 120.0
POLL = 0.010


def cluster_yaml(cluster, port: int) -> str:
    """cluster.yaml in the user's format (see tests/conftest.py) for the loopback nodes."""
    lines = ["cluster:", '  name: "bench"', f'  master_ip: "{cluster.nodes[0].address}"', f"  master_port: {port}"]
    lines.append("nodes:")
    for i, node in enumerate(cluster.nodes):
        lines += [
            f"  {node.name}:",
            f'    ip: "{node.address}"',
            f'    user: "{cluster.user}"',
            "    gpus: 0",
            f"    rank: {i}",
            f'    role: "{"master" if i == 0 else "worker"}"',
            f"    ssh_port: {node.port}",
            f'    key: "{cluster.client_key}"',
            f'    torchrun: "{NODE_TORCHRUN}"',
            f'    workdir: "{node.workdir}"',
        ]
    lines += ["training:", "  script: train/train_production.py"]
    return "\n".join(lines) + "\n"


class StepWatch:
    """Polls rank log files for the first {"step" line; paths may appear late (a glob)."""

    def __init__(self, patterns: list[str]) -> None:
        self.patterns = patterns
        self.paths: list[str | None] = [None] * len(patterns)
        self.offsets = [0] * len(patterns)
        self.partial = [b""] * len(patterns)
        self.first: list[float | None] = [None] * len(patterns)

    def poll(self) -> None:
        now = time.monotonic()
        for i, pattern in enumerate(self.patterns):
            if self.first[i] is not None:
                continue
            if self.paths[i] is None:
                hits = glob.glob(pattern)
                if not hits:
                    continue
                self.paths[i] = hits[0]
            try:
                with open(self.paths[i], "rb") as fh:
                    fh.seek(self.offsets[i])
                    data = fh.read()
            except OSError:
                continue
            self.offsets[i] += len(data)
            lines = (self.partial[i] + data).split(b"\n")
            self.partial[i] = lines.pop()
            if any(line.startswith(b'{"step"') for line in lines):
                self.first[i] = now

    @property
    def done(self) -> bool:
        return all(t is not None for t in self.first)

    def wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.done and time.monotonic() < deadline:
            self.poll()
            if self.done:
                return
            time.sleep(POLL)
        self.poll()


class Bench:
    def __init__(self, cluster, tmp: Path, ugro_env: dict[str, str]) -> None:
        self.cluster, self.tmp, self.ugro_env = cluster, tmp, ugro_env
        self.worker: Worker | None = None  # ugro_cmd's, started by run()
        self.port = 29611
        self.ssh_base = ["ssh", "-i", str(cluster.client_key), "-p", str(cluster.port), *SSH_OPTS]

    def next_port(self) -> int:
        from tests.loopback import _port_free

        for _ in range(500):
            self.port += 1
            if all(_port_free(n.address, self.port) for n in self.cluster.nodes):
                return self.port
        raise RuntimeError("no free rendezvous port")

    def _set_port(self, port: int) -> None:
        from cluster.models import ClusterSettings

        ClusterSettings.objects.filter(pk=1).update(rendezvous_port=port)

    def _row(self, method: str, t0: float, watch: StepWatch, **extra) -> dict:
        firsts = [None if t is None else round(t - t0, 4) for t in watch.first]
        ok = all(t is not None for t in firsts)
        return {
            "method": method,
            "first_step_any_s": min((t for t in firsts if t is not None), default=None),
            "first_step_all_s": max(firsts) if ok else None,
            "first_step_per_rank_s": firsts,
            **extra,
        }

    # -- bare torchrun by hand -----------------------------------------------------------------
    def bare(self) -> dict:
        from jobs.launch import DEFAULT_ARGS_TEMPLATE, render_args

        uid = uuid.uuid4().hex[:8]
        name, tag, port = f"bare-{uid}", f"fs-bare-{uid}", self.next_port()
        # the lab configures a default model and dataset; epochs and lr are not given, so not passed
        values = {"model": "tiny", "dataset": "gpl-3", "epochs": None, "lr": None, "job": name}
        script_args = render_args(DEFAULT_ARGS_TEMPLATE, values) + EXTRA  # exactly what UGRO passes
        master = self.cluster.nodes[0].address
        logs = [node.workdir / f"{name}.log" for node in self.cluster.nodes]
        cmds = []
        for node, logf in zip(self.cluster.nodes, logs, strict=True):
            argv = [
                str(NODE_TORCHRUN), "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={master}:{port}", f"--rdzv-id={tag}", f"--local-addr={node.address}",
                "--max-restarts=0", "train/train_production.py", *script_args,
            ]  # fmt: skip
            remote = (
                f"cd {shlex.quote(str(node.workdir))} && UGRO_JOB={tag} UGRO_NODE={node.name} "
                f"{shlex.join(argv)} > {shlex.quote(str(logf))} 2>&1"
            )
            cmds.append([*self.ssh_base, f"{self.cluster.user}@{node.address}", remote])
        watch = StepWatch([str(p) for p in logs])
        t0 = time.monotonic()
        procs = [subprocess.Popen(c, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL) for c in cmds]
        t_issued = time.monotonic()
        watch.wait(STEP_TIMEOUT)
        rcs = []
        for p in procs:
            try:
                rcs.append(p.wait(timeout=FINISH_TIMEOUT))
            except subprocess.TimeoutExpired:
                rcs.append(None)
        t_end = time.monotonic()
        survivors = kill_tagged(tag)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        return self._row(
            "bare", t0, watch, tag=tag, port=port, issued_s=round(t_issued - t0, 4),
            finished_s=round(t_end - t0, 4), ssh_rcs=rcs, survivors=survivors,
        )  # fmt: skip

    # -- UGRO ---------------------------------------------------------------------------------------
    def _finish_job(self, name: str, here: bool = True) -> dict:
        """Follow the job to its end in this process (as the worker would), or (here=False) wait for the
        worker to, bounded."""
        from jobs.follow import follow
        from jobs.models import Job

        job = Job.objects.get(name=name)
        t_follow = time.monotonic()
        deadline = time.monotonic() + FINISH_TIMEOUT
        while not job.is_ended and time.monotonic() < deadline:
            if here:
                follow(2.0, job_ids=[job.pk], idle_sleep=0.1)
            else:
                time.sleep(0.1)
            job.refresh_from_db()
        survivors = kill_tagged(job.tag) if job.tag else 0
        ended = [r.ended_at for r in job.ranks.all() if r.ended_at]
        lag = (job.finished_at - max(ended)).total_seconds() if ended and job.finished_at else None
        return {
            "follow_s": round(time.monotonic() - t_follow, 4),
            "job_end_lag_s": None if lag is None else round(lag, 4),
            "tag": job.tag,
            "state": job.state,
            "launch_spread_s": job.launch_spread_s,
            "failure_reason": job.failure_reason[:500],
            "survivors": survivors,
        }

    def _patterns(self, name: str) -> list[str]:
        return [f"{n.workdir}/.ugro/jobs/{glob.escape(name)}-*/rank_{i}.log" for i, n in enumerate(self.cluster.nodes)]

    def ugro_warm(self) -> dict:
        from cluster.fanout import node_request, on_each
        from cluster.models import Node
        from jobs.launch import LaunchRequest, create_job
        from jobs.models import Job
        from jobs.scheduler import schedule

        port = self.next_port()
        self._set_port(port)
        res = on_each(list(Node.objects.all()), lambda n: node_request(n, "hello", timeout=10))
        if any(err for _, _, err in res):
            raise RuntimeError(f"warm-up failed: {[str(e) for _, _, e in res if e]}")
        name = f"fsw-{uuid.uuid4().hex[:8]}"
        # Time launch()'s pre-flight from the outside (launch imports it at call time).
        import jobs.preflight as preflight

        real, spent = preflight.run_preflight, []

        def timed(*a, **kw):
            t = time.monotonic()
            try:
                return real(*a, **kw)
            finally:
                spent.append(time.monotonic() - t)

        preflight.run_preflight = timed
        try:
            t0 = time.monotonic()
            job = create_job(LaunchRequest(name=name, count=2, extra_args=EXTRA))
            schedule()
            t_launched = time.monotonic()
        finally:
            preflight.run_preflight = real
        job = Job.objects.get(pk=job.pk)
        # The rank logs are known now (Rank.remote_log); the glob finds the same files.
        patterns = [r.remote_log for r in job.ranks.order_by("index")] or self._patterns(name)
        watch = StepWatch(patterns)
        watch.wait(STEP_TIMEOUT)
        t_step = time.monotonic()
        info = self._finish_job(name)
        return self._row(
            "ugro_warm", t0, watch, name=name, port=port, launched_s=round(t_launched - t0, 4),
            preflight_s=round(sum(spent), 4) if spent else None,
            job_state_after_launch=job.state, finished_s=round(time.monotonic() - t0, 4),
            follow_started_s=round(t_step - t0, 4), **info,
        )  # fmt: skip

    def ugro_cmd(self) -> dict:
        port = self.next_port()
        self._set_port(port)
        name = f"fsc-{uuid.uuid4().hex[:8]}"
        out = self.tmp / f"{name}.out"
        watch = StepWatch(self._patterns(name))
        argv = [str(CONTROLLER_PY), "manage.py", "launch", "--detach", "--name", name, "--nodes", "2", "--", *EXTRA]
        self.worker.resume()
        try:
            with open(out, "wb") as fh:
                t0 = time.monotonic()
                proc = subprocess.Popen(
                    argv, cwd=REPO, env=self.worker.env, stdin=subprocess.DEVNULL, stdout=fh, stderr=fh
                )
                t_exit = None
                deadline = time.monotonic() + STEP_TIMEOUT
                while not watch.done and time.monotonic() < deadline:
                    watch.poll()
                    if t_exit is None and proc.poll() is not None:
                        t_exit = time.monotonic()
                    if watch.done:
                        break
                    time.sleep(POLL)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                if t_exit is None:
                    t_exit = time.monotonic()
            text = out.read_text(errors="replace")
            from jobs.models import Job

            info = self._finish_job(name, here=False) if Job.objects.filter(name=name).exists() else {}
        finally:
            self.worker.pause()
        return self._row(
            "ugro_cmd", t0, watch, name=name, port=port, launch_rc=proc.returncode,
            launch_exited_s=round(t_exit - t0, 4), launch_output=text[-600:],
            finished_s=round(time.monotonic() - t0, 4), **info,
        )  # fmt: skip


def summarize(rows: list[dict]) -> dict:
    out = {}
    for m in METHODS:
        mine = [r for r in rows if r["method"] == m]
        out[m] = {
            "trials": len(mine),
            "median_first_step_any_s": median([r["first_step_any_s"] for r in mine]),
            "median_first_step_all_s": median([r["first_step_all_s"] for r in mine]),
            "min_first_step_any_s": min((r["first_step_any_s"] for r in mine if r["first_step_any_s"]), default=None),
        }
        key = {"ugro_warm": "launched_s", "ugro_cmd": "launch_exited_s", "bare": "issued_s"}[m]
        out[m]["median_command_returned_s"] = median([r.get(key) for r in mine])
        out[m]["states"] = sorted({r.get("state", "-") for r in mine})
        if m == "ugro_warm":
            out[m]["median_preflight_s"] = median([r.get("preflight_s") for r in mine])
    pairs = (("overhead_vs_bare_s", "median_first_step_any_s"), ("overhead_vs_bare_min_s", "min_first_step_any_s"))
    for key, stat in pairs:
        bare = out["bare"][stat]
        for m in ("ugro_warm", "ugro_cmd"):
            v = out[m][stat]
            out[m][key] = round(v - bare, 4) if v is not None and bare is not None else None
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "first_step.json"))
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (nodes, DB, logs) afterwards")
    ap.add_argument("--max-busy", type=float, default=0.6, help="wait for CPU busy <= this before a trial")
    ap.add_argument("--quiet-wait", type=float, default=3.0, help="longest wait for that, seconds (0: never)")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error("repeat >= 1")
    if not NODE_TORCHRUN.exists():
        print(f"node env missing: {NODE_TORCHRUN}", file=sys.stderr)
        return 2
    with throwaway_database(keep=args.keep) as database_url:
        return run(args, database_url)


def run(args: argparse.Namespace, database_url: str) -> int:
    tmp = make_tmp("ugro-bench-first-step-")
    env = setup_django(tmp, database_url)
    from cluster.config_yaml import import_cluster
    from cluster.links import pool
    from tests.loopback import LoopbackCluster

    meta = machine_info()
    meta["bashrc"] = bashrc_cost()
    meta.update({"repeat": args.repeat, "extra_args": EXTRA, "node_env": str(NODE_ENV), "subnet": SUBNET})
    meta.update({"max_busy": args.max_busy, "quiet_wait_s": args.quiet_wait, "poll_interval_s": POLL})
    try:
        meta["torch"] = subprocess.run(
            [str(NODE_ENV / "bin" / "python"), "-c", "import torch; print(torch.__version__)"],
            capture_output=True, text=True, timeout=60,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        pass
    rows: list[dict] = []
    t_start = time.monotonic()
    cluster = LoopbackCluster(tmp / "nodes", 2, subnet=SUBNET, first_octet=2)
    bench = None
    try:
        cluster.start()
        for node in cluster.nodes:
            shutil.copytree(REPO / "train", node.workdir / "train", ignore=shutil.ignore_patterns("__pycache__"))
        import_cluster(cluster_yaml(cluster, 29611))
        bench = Bench(cluster, tmp, {k: env[k] for k in ("DATABASE_URL", "UGRO_DATA_DIR", "REDIS_URL")})
        bench_redis().flushdb()  # the benchmark's own Redis database: no stale heartbeat or task
        bench.worker = Worker(tmp, {**os.environ, **env, "REDIS_URL": BENCH_REDIS, "PYTHONUNBUFFERED": "1"})
        meta["worker_start_s"] = round(bench.worker.start(), 2)
        meta["redis"] = BENCH_REDIS
        bench.worker.pause()
        # One untimed round: page cache for torch, sshd, Django's first queries.
        for m in METHODS:
            getattr(bench, m)()
        for rep in range(args.repeat):
            order = list(METHODS[rep % len(METHODS) :] + METHODS[: rep % len(METHODS)])
            for m in order:
                busy = wait_quiet(args.max_busy, args.quiet_wait) if args.quiet_wait > 0 else cpu_busy(0.1)
                row = getattr(bench, m)()
                row["repeat"] = rep
                row["cpu_busy_before"] = round(busy, 2)
                row["loadavg_1m"] = round(os.getloadavg()[0], 2)
                rows.append(row)
                any_s, all_s = row["first_step_any_s"], row["first_step_all_s"]
                print(
                    f"rep={rep} {m:<10} first step {any_s if any_s is not None else 'TIMEOUT'}s "
                    f"(all ranks {all_s}s) state={row.get('state', '-')} busy={row['cpu_busy_before']:.0%}",
                    flush=True,
                )
    finally:
        if bench is not None and bench.worker is not None:
            bench.worker.stop()
            bench_redis().flushdb()
        pool.close_all()
        cluster.stop()
        for r in rows:
            if r.get("tag") and tagged_pids(r["tag"]):
                kill_tagged(r["tag"])
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    meta["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    meta["elapsed_s"] = round(time.monotonic() - t_start, 1)
    summary = summarize(rows)
    write_json(Path(args.out), {"meta": meta, "summary": summary, "trials": rows})
    print('\nseconds from command to the first {"step" line on any rank (2 nodes); other columns: medians')
    print(f"{'method':<11}{'median':>9}{'min':>8}{'all ranks':>11}{'cmd done':>10}{'vs bare':>9}{'(min)':>8}  states")
    for m in METHODS:
        s = summary[m]

        def f(v):
            return f"{v:.3f}" if v is not None else "-"

        print(
            f"{m:<11}{f(s['median_first_step_any_s']):>9}{f(s['min_first_step_any_s']):>8}"
            f"{f(s['median_first_step_all_s']):>11}{f(s['median_command_returned_s']):>10}"
            f"{f(s.get('overhead_vs_bare_s')):>9}{f(s.get('overhead_vs_bare_min_s')):>8}  {','.join(s['states'])}"
        )
    w = summary["ugro_warm"]
    if w.get("median_preflight_s") is not None:
        print(
            f"\nugro_warm: launch (create_job + schedule) median {w['median_command_returned_s']:.3f}s, "
            f"of which pre-flight {w['median_preflight_s']:.3f}s"
        )
    b = meta["bashrc"]
    print(
        f"\nroot's .bashrc per SSH command: +{b['bashrc_extra_wall_s']:.3f}s wall, +{b['bashrc_extra_cpu_s']:.3f}s CPU"
        f"; wrote {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
