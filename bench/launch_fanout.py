#!/usr/bin/env python
"""How long until a rank process runs on every one of N nodes: sequential ssh, pdsh, UGRO.

    .venv/bin/python bench/launch_fanout.py [--sizes 1,4,8,16] [--repeat 3]

Real sshd nodes on 127.0.1.2.. (tests/loopback.py), a throwaway PostgreSQL UGRO; every method starts
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
  ugro_cli_worker
             the admins' command, `manage.py launch --detach --name X --nodes N` (a fresh process),
             while a real worker (bench/_worker.py: `bin/worker`, Redis db 11) is up and warm: the
             command queues the job and the worker starts the ranks. The nodes are imported into the
             throwaway DB as a UGRO cluster whose `torchrun` is a fake that execs the same sleeping
             rank. Between its own trials the worker is paused (SIGSTOP, heartbeat key deleted) so the
             other methods run with no worker, and resumed (SIGCONT, heartbeat back) before each of its
             trials. (The same command with no worker running, once method `ugro_cli`, is gone: since
             1c16252 the command refuses without a worker, which is the only executor of job work.)
  ugro_client
             the thin client a user runs, `ugro launch --detach --name X --nodes N` (ugro_client, a
             fresh python process, no Django) against the REST API served by daphne, with a real
             token; the API queues the job and the same warm worker starts the ranks.

The clock runs from just before the command is issued until a separate watcher process
(bench/_procwatch.py, polling /proc every 5 ms; by tag prefix for the
methods whose tag UGRO picks) sees N exec'd rank processes with the tag.
Results: bench/results/launch_fanout.json (overwritten) and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    BENCH,
    BENCH_REDIS,
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
from _db import throwaway_database  # noqa: E402
from _worker import Worker, bench_redis  # noqa: E402

METHODS = ("seq_ssh", "pdsh", "ugro_cold", "ugro_warm", "ugro_cli_worker", "ugro_client")
CLI_METHODS = ("ugro_cli_worker", "ugro_client")
WORKER_METHODS = ("ugro_cli_worker", "ugro_client")  # the worker starts the ranks
SLEEP_CODE = "import time; time.sleep(30)"
RANK_ARGV = [str(NODE_PY), "-c", SLEEP_CODE]
DETECT_TIMEOUT = 60.0
CLI_DETECT_TIMEOUT = 40.0  # a failed `ugro launch` starts nothing: do not wait a minute for it
UGRO_ADMIN = [str(CONTROLLER_PY), str(REPO / "manage.py")]
UGRO_CLIENT = [str(CONTROLLER_PY), "-m", "ugro_client.cli"]  # what the `ugro` console script runs
RANK_SCRIPT = "bench_rank.py"  # training.script: an empty file in each node's workdir (pre-flight stats it)


class Watcher:
    """The /proc watcher subprocess: arm it with a tag, then read when the ranks appeared."""

    def __init__(self, script: str = "_procwatch.py") -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(BENCH / script)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )

    def arm(self, tag: str, count: int, prefix: bool = False, timeout: float = DETECT_TIMEOUT) -> None:
        """Watch for `count` ranks with UGRO_JOB=tag (prefix=True: UGRO_JOB=tag..., the prefix watcher)."""
        req = {"tag_prefix" if prefix else "tag": tag, "count": count, "argv": RANK_ARGV, "timeout": timeout,
               "interval": 0.005}  # fmt: skip
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


def fake_torchrun_cluster_yaml(cluster, bin_dir: Path, port: int) -> str:
    """cluster.yaml (tests/conftest.py's format) for the loopback nodes with a fake torchrun.

    bin_dir/torchrun execs the same sleeping rank as the other methods (UGRO's torchrun arguments
    are ignored); bin_dir/python execs the node env's python, which pre-flight finds next to
    torchrun and uses to read torch's version.
    """
    bin_dir.mkdir(parents=True, exist_ok=True)
    torchrun = bin_dir / "torchrun"
    torchrun.write_text(f"#!/bin/sh\nexec {shlex.join(RANK_ARGV)}\n")
    torchrun.chmod(0o755)
    # A wrapper, not a symlink: a venv's python reached through a symlink in another directory
    # does not find the venv's pyvenv.cfg, so not its site-packages (nor torch).
    python = bin_dir / "python"
    python.write_text(f'#!/bin/sh\nexec {shlex.quote(str(NODE_PY))} "$@"\n')
    python.chmod(0o755)
    # ... and the env's lib/ beside it, as in a real env: the agent keeps its version report while the
    # site-packages there are unchanged (cluster/node/agent.py op_env_report), as it would for the real env
    lib = bin_dir.parent / "lib"
    if not lib.exists():
        lib.symlink_to(NODE_PY.parent.parent / "lib")
    lines = ["cluster:", '  name: "bench"', f'  master_ip: "{cluster.nodes[0].address}"', f"  master_port: {port}"]
    lines.append("nodes:")
    for i, node in enumerate(cluster.nodes):
        (node.workdir / RANK_SCRIPT).touch()
        lines += [
            f"  {node.name}:",
            f'    ip: "{node.address}"',
            f'    user: "{cluster.user}"',
            "    gpus: 0",
            f"    rank: {i}",
            f'    role: "{"master" if i == 0 else "worker"}"',
            f"    ssh_port: {node.port}",
            f'    key: "{cluster.client_key}"',
            f'    torchrun: "{torchrun}"',
            f'    workdir: "{node.workdir}"',
        ]
    lines += ["training:", f"  script: {RANK_SCRIPT}"]
    return "\n".join(lines) + "\n"


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
        # the command methods: set up by main() when they run
        self.cli_env: dict[str, str] = {}
        self.worker: Worker | None = None
        self.prefix_watcher: Watcher | None = None
        self.rdzv_port = 29700
        self.api_env: dict[str, str] = {}  # the ugro_client method: UGRO_URL and UGRO_TOKEN
        self.token = ""
        self.daphne_pid: int | None = None

    # -- the ways of issuing ----------------------------------------------------------------
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
        from cluster.fanout import node_request, on_each

        res = on_each(self.nodes[:n], lambda x: node_request(x, "hello", timeout=10))
        errs = [f"{x.name}: {e}" for x, _, e in res if e]
        if errs:
            raise RuntimeError("warm-up failed: " + "; ".join(errs))

    def issue_ugro_warm(self, tag: str, n: int) -> dict:
        from cluster.fanout import node_request, on_each

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

    def next_rdzv_port(self) -> int:
        """A rendezvous port of this trial's own (pre-flight listens on it on the first node)."""
        from cluster.models import ClusterSettings
        from tests.loopback import _port_free

        for _ in range(500):
            self.rdzv_port += 1
            if all(_port_free(n.address, self.rdzv_port) for n in self.cluster.nodes):
                ClusterSettings.objects.filter(pk=1).update(rendezvous_port=self.rdzv_port)
                return self.rdzv_port
        raise RuntimeError("no free rendezvous port")

    def _issue_cli(self, name: str, n: int) -> dict:
        proc = subprocess.run(
            [*UGRO_ADMIN, "launch", "--detach", "--name", name, "--nodes", str(n)],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120, env=self.cli_env, cwd=self.tmp,
        )  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"ugro launch exited {proc.returncode}: {(proc.stdout + proc.stderr)[-800:]}")
        return {"stdout_tail": proc.stdout.strip().splitlines()[-1:]}

    def issue_ugro_cli_worker(self, name: str, n: int) -> dict:
        return self._issue_cli(name, n)

    def issue_ugro_client(self, name: str, n: int) -> dict:
        proc = subprocess.run(
            [*UGRO_CLIENT, "launch", "--detach", "--name", name, "--nodes", str(n)],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120, env=self.api_env, cwd=REPO,
        )  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"ugro (client) launch exited {proc.returncode}: {(proc.stdout + proc.stderr)[-800:]}")
        return {"stdout_tail": proc.stdout.strip().splitlines()[-1:]}

    def finish_cli(self, name: str, t0_wall: float) -> dict:
        """After a trial of a command: the job's timeline from the DB, then cancel it (as `ugro cancel`)."""
        from jobs import lifecycle
        from jobs.models import Job

        job = Job.objects.filter(name=name).first()
        out: dict = {}
        if job is None:
            return {"job": None}
        launcher = job.launcher.split(":")
        worker_pid = str(self.worker.proc.pid) if self.worker and self.worker.proc else None
        out.update(job_state=job.state, job_tag=job.tag, launched_by="worker" if launcher[1:2] == [worker_pid] else
                   "command" if launcher[1:2] else "-")  # fmt: skip
        if job.failure_reason:
            out["failure_reason"] = job.failure_reason[:400]
        stamps = [("created", job.created_at), ("placed", job.started_at), ("running", job.running_at)]
        if all(ts is not None for _, ts in stamps):
            # wall-clock stamps UGRO recorded, against the wall clock at the bench's t0
            out["cli_breakdown_s"] = {
                "start_to_job_created": round(job.created_at.timestamp() - t0_wall, 4),
                "created_to_placed": round((job.started_at - job.created_at).total_seconds(), 4),
                "placed_to_running": round((job.running_at - job.started_at).total_seconds(), 4),
            }
        if not job.is_ended:
            t = time.monotonic()
            job = lifecycle.cancel(job)
            lifecycle.teardown(job)
            job.refresh_from_db()
            out["cancel_s"] = round(time.monotonic() - t, 3)
            if "not confirmed stopped" in job.failure_reason:
                out["cancel_unclean"] = job.failure_reason
        return out

    # -- one timed trial ---------------------------------------------------------------------------
    def trial(self, watcher: Watcher, method: str, n: int, max_busy: float = 1.0, quiet_s: float = 0.0) -> dict:
        tag = f"bench-{method}-{n}-{uuid.uuid4().hex[:8]}"
        cli = method in CLI_METHODS
        if cli:
            # UGRO picks the job's tag (<name>-<8 hex>): watch for the name's prefix.
            letter = {"ugro_cli_worker": "w", "ugro_client": "k"}[method]
            tag = f"bf{letter}{n}-{uuid.uuid4().hex[:8]}"
            watcher = self.prefix_watcher
            self.next_rdzv_port()
            self.worker.resume()
        if method == "ugro_warm":
            self.warm_up(n)  # links are warm before the clock starts, as in the worker
        issue = getattr(self, f"issue_{method}")
        # Other people's work shares these 2 cores: wait (bounded) for a quiet moment, and record it.
        busy = wait_quiet(max_busy, quiet_s) if quiet_s > 0 else cpu_busy(0.1)
        load = os.getloadavg()[0]
        if cli:
            watcher.arm(tag + "-", n, prefix=True, timeout=CLI_DETECT_TIMEOUT)
        else:
            watcher.arm(tag, n)
        worker_cpu0 = self.worker.cpu() if method in WORKER_METHODS else 0.0
        api_cpu0 = pid_cpu(self.daphne_pid) if method == "ugro_client" else 0.0
        cpu0 = controller_cpu()
        t0_wall = time.time()
        t0 = time.monotonic()
        info: dict = {}
        error = None
        try:
            info = issue(tag, n)
        except Exception as exc:  # recorded, and the ranks that did start are still cleaned up
            error = f"{type(exc).__name__}: {exc}"
        t_returned = time.monotonic()
        cpu = controller_cpu() - cpu0
        worker_cpu = None
        if method in WORKER_METHODS:
            worker_cpu = self.worker.cpu() - worker_cpu0
            cpu += worker_cpu
        api_cpu = None
        if method == "ugro_client":
            api_cpu = pid_cpu(self.daphne_pid) - api_cpu0
            cpu += api_cpu
        seen = watcher.result()
        if cli:
            try:
                info.update(self.finish_cli(tag, t0_wall))
            except Exception as exc:  # noqa: BLE001 - recorded; the tagged processes are killed below
                error = (error + "; " if error else "") + f"cleanup {type(exc).__name__}: {exc}"
            survivors = kill_tagged(tag + "-", prefix=True)
            if method in WORKER_METHODS:
                self.worker.pause()
        else:
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
        if worker_cpu is not None:
            row["worker_cpu_s"] = round(worker_cpu, 4)
        if api_cpu is not None:
            row["api_server_cpu_s"] = round(api_cpu, 4)
        if cli:
            for key in ("job_state", "job_tag", "launched_by", "cli_breakdown_s", "cancel_s", "cancel_unclean",
                        "failure_reason", "stdout_tail"):  # fmt: skip
                if key in info:
                    row[key] = info[key]
            row["job_name"] = tag
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


UGRO_METHODS = ("ugro_warm", "ugro_cold", "ugro_cli_worker", "ugro_client")


def pid_cpu(pid: int | None) -> float:
    """CPU seconds (user+sys, reaped children too) of one process, e.g. the API server."""
    if pid is None:
        return 0.0
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def accounts(bench: Bench) -> None:
    """An operator account named like the OS user (manage.py's default) and a token for the client."""
    import getpass

    from django.contrib.auth.models import Group, User

    from accounts.tokens import create_token

    for name in {getpass.getuser(), "bench"}:
        user, _ = User.objects.get_or_create(username=name)
        user.groups.add(Group.objects.get(name="operator"))
    _, bench.token = create_token(User.objects.get(username="bench"), "fanout", "launch")


def start_api(tmp: Path, bench: Bench, timeout: float = 60.0) -> tuple[subprocess.Popen, dict[str, str]]:
    """daphne serving the API on a free port, on the benchmark's DB and Redis."""
    import socket
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [str(CONTROLLER_PY), "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "ugro_site.asgi:application"],
        cwd=REPO, env=bench.cli_env, stdin=subprocess.DEVNULL, stdout=open(tmp / "daphne.log", "wb"),
        stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url + "/accounts/login/", timeout=2).close()
            break
        except OSError:
            time.sleep(0.2)
    else:
        raise RuntimeError(f"daphne did not serve in {timeout:.0f}s: {(tmp / 'daphne.log').read_text()[-800:]}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DJANGO")}
    return proc, {**env, "UGRO_URL": url, "UGRO_TOKEN": bench.token}


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
            k: (med[k][str(n)] is not None and p is not None and med[k][str(n)] <= p) for k in UGRO_METHODS
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


def cold_breakdown(
    rows: list[dict], sizes: list[int], method: str = "ugro_cold", key: str = "cold_breakdown_s"
) -> dict:
    out = {}
    for n in sizes:
        parts = [r[key] for r in rows if r["method"] == method and r["n"] == n and key in r]
        if parts:
            out[str(n)] = {k: median([p[k] for p in parts]) for k in parts[0]}
    return out


def print_table(summary: dict, sizes: list[int], breakdown: dict) -> None:
    head = f"{'method':<16}" + "".join(f"{'N=' + str(n):>10}" for n in sizes)
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
            print(f"{m:<16}{cells}{(f'{r:.2f}' if r else '-'):>12}")
    print("\nUGRO median <= pdsh median at each N:")
    for n in sizes:
        v = summary["ugro_le_pdsh"][str(n)]
        print(f"  N={n:<3} " + "  ".join(f"{k}={v[k]!s:<6}" for k in UGRO_METHODS))
    print("\nmedian controller-side CPU seconds per launch (this process + reaped children)")
    print(head)
    for m in METHODS:
        row = summary["median_controller_cpu_s"][m]
        print(f"{m:<16}" + "".join(f"{row[str(n)]:>10.3f}" if row[str(n)] is not None else f"{'-':>10}" for n in sizes))
    for name, parts_by_n in breakdown.items():
        if parts_by_n:
            print(f"\n{name} breakdown (medians, s):")
            for n, parts in parts_by_n.items():
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
    ap.add_argument("--budget", type=float, default=510.0, help="start no repeat expected to end after this (s)")
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
    with throwaway_database(keep=args.keep) as database_url:
        return run(args, sizes, methods, database_url)


def run(args: argparse.Namespace, sizes: list[int], methods: list[str], database_url: str) -> int:
    tmp = make_tmp("ugro-bench-fanout-")
    env = setup_django(tmp, database_url)
    from cluster.links import pool
    from tests.loopback import LoopbackCluster

    meta = machine_info()
    meta["bashrc"] = bashrc_cost()
    meta.update({"sizes": sizes, "repeat": args.repeat, "methods": methods, "tmp": str(tmp), "subnet": SUBNET})
    meta.update({"max_busy": args.max_busy, "quiet_wait_s": args.quiet_wait, "poll_interval_s": 0.005})
    meta["budget_s"] = args.budget
    rows: list[dict] = []
    t_start = time.monotonic()
    cluster = LoopbackCluster(tmp / "nodes", max(sizes), subnet=SUBNET, first_octet=2)
    watcher = bench = daphne = None
    cli = [m for m in methods if m in CLI_METHODS]
    try:
        cluster.start()
        watcher = Watcher()
        bench = Bench(cluster, tmp)
        if cli:
            from cluster.config_yaml import import_cluster

            import_cluster(fake_torchrun_cluster_yaml(cluster, tmp / "fake-bin", bench.rdzv_port))
            bench_redis().flushdb()  # the benchmark's own Redis database: no stale heartbeat or task
            bench.cli_env = {**os.environ, **env, "REDIS_URL": BENCH_REDIS, "PYTHONUNBUFFERED": "1"}
            bench.prefix_watcher = Watcher("_procwatch.py")
            meta["redis"] = BENCH_REDIS
            meta["fake_torchrun"] = (tmp / "fake-bin" / "torchrun").read_text()
            accounts(bench)  # manage.py runs as the OS user's account; the client with a token
        if "ugro_client" in cli:
            daphne, bench.api_env = start_api(tmp, bench)
            bench.daphne_pid = daphne.pid
            meta["api_url"] = bench.api_env["UGRO_URL"]
        if any(m in cli for m in WORKER_METHODS):
            bench.worker = Worker(tmp, bench.cli_env)
            meta["worker_start_s"] = round(bench.worker.start(), 2)
            meta["worker_pid"] = bench.worker.proc.pid
            # Warm it: one launch through it on every node (its health polls reach them all too).
            row = bench.trial(watcher, next(m for m in WORKER_METHODS if m in cli), max(sizes))
            meta["worker_warmup_trial"] = row
            print(f"worker up in {meta['worker_start_s']}s; warm-up launch on {max(sizes)} nodes: "
                  f"{row['all_running_s']}s {row.get('error', '')}", flush=True)  # fmt: skip
        # One untimed round first: page cache, sshd's first fork, pdsh/ssh binaries.
        for m in methods:
            bench.trial(watcher, m, min(sizes))
        # Each repeat runs every size, so drifting load on the shared machine hits all sizes alike;
        # a repeat starts only if it is expected to end within --budget (then fewer repeats are run).
        last_rep_s = 0.0
        for rep in range(args.repeat):
            elapsed = time.monotonic() - t_start
            if rep and elapsed + 1.15 * last_rep_s > args.budget:
                print(f"stopping after {rep} repeats: {elapsed:.0f}s spent, budget {args.budget:.0f}s", flush=True)
                break
            t_rep = time.monotonic()
            for n in sizes:
                # Rotate the order each repeat so no method always runs right after another.
                order = methods[rep % len(methods) :] + methods[: rep % len(methods)]
                for m in order:
                    row = bench.trial(watcher, m, n, args.max_busy, args.quiet_wait)
                    row["repeat"] = rep
                    rows.append(row)
                    shown = f"{row['all_running_s']:.3f}s" if row["all_running_s"] is not None else "TIMEOUT"
                    print(f"N={n:<3} rep={rep} {m:<15} {shown}  (busy {row['cpu_busy_before']:.0%})" +
                          (f"  ERROR {row['error']}" if "error" in row else ""), flush=True)  # fmt: skip
            last_rep_s = time.monotonic() - t_rep
            meta["repeats_done"] = rep + 1
    finally:
        if bench is not None and bench.worker is not None:
            meta["worker_pause_retries"] = bench.worker.pause_retries
            bench.worker.stop()
        if daphne is not None and daphne.poll() is None:
            os.killpg(daphne.pid, signal.SIGTERM)
            daphne.wait(timeout=10)
        pool.close_all()
        for tag in ("bfk",):
            kill_tagged(tag, prefix=True)
        for w in (watcher, bench.prefix_watcher if bench is not None else None):
            if w is not None:
                w.close()
        cluster.stop()
        for r in rows:
            prefix = r["method"] in CLI_METHODS
            tag = r["tag"] + "-" if prefix else r["tag"]
            if tagged_pids(tag, prefix):
                kill_tagged(tag, prefix=prefix)
        # anything of this run's cli jobs (warm-up and untimed trials included): names start bfw/bfk
        for tag in ("bfw", "bfk"):
            kill_tagged(tag, prefix=True)
        if cli:
            try:
                bench_redis().flushdb()
            except Exception:  # noqa: BLE001 - Redis gone: nothing to clean
                pass
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    meta["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    meta["elapsed_s"] = round(time.monotonic() - t_start, 1)
    summary = summarize(rows, sizes)
    breakdown = {
        "ugro_cold": cold_breakdown(rows, sizes),
        "ugro_cli_worker": cold_breakdown(rows, sizes, "ugro_cli_worker", "cli_breakdown_s"),
        "ugro_client": cold_breakdown(rows, sizes, "ugro_client", "cli_breakdown_s"),
    }
    write_json(Path(args.out), {
        "meta": meta, "summary": summary, "ugro_cold_breakdown_s": breakdown["ugro_cold"],
        "ugro_cli_breakdown_s": {k: v for k, v in breakdown.items() if k != "ugro_cold"}, "trials": rows,
    })  # fmt: skip
    print_table(summary, sizes, breakdown)
    b = meta["bashrc"]
    print(
        f"\nroot's .bashrc per SSH command: +{b['bashrc_extra_wall_s']:.3f}s wall, +{b['bashrc_extra_cpu_s']:.3f}s CPU"
        f"; wrote {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
