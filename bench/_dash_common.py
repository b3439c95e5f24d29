"""Shared pieces of the dashboard benchmarks (delivery_latency, log_throughput, page_load).

A throwaway UGRO on PostgreSQL (database `ugro_bench3`, recreated at the start, dropped at the
end), Redis db 12 (flushed at the start), a temp UGRO_DATA_DIR, real sshd nodes on 127.0.3.2..
(never the test suite's 127.0.0.x nor the launch benchmarks' 127.0.1.x), a real daphne and a real
Celery worker (`-B -P threads`, as in production), and a websocket client in a process of its own.

Run as a script, this module is that websocket client:

    python bench/_dash_common.py wsclient URL COOKIE ORIGIN OUT READY MAX_SECONDS
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
from _common import make_tmp, tagged_pids, write_json  # noqa: E402,F401  (re-exported to the dashboard benchmarks)

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
CONTROLLER_PY = REPO / ".venv" / "bin" / "python"
DAPHNE = REPO / ".venv" / "bin" / "daphne"
NODE_ENV = Path(os.environ.get("UGRO_NODE_ENV", REPO / ".venv-node"))
# Overridable so that two benchmarks on one machine keep apart (e.g. UGRO_BENCH_DB=ugro_bench_ui).
DB_NAME = os.environ.get("UGRO_BENCH_DB", "ugro_bench3")
DB_URL = f"postgres://postgres@127.0.0.1:5432/{DB_NAME}"
REDIS_DB = os.environ.get("UGRO_BENCH_REDIS_DB", "12")
REDIS_URL = f"redis://127.0.0.1:6379/{REDIS_DB}"
SUBNET = "127.0.3"
SECRET = "dashboard-bench-secret-key-dashboard-bench-secret-key"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip
TERMINAL = {"succeeded", "failed", "cancelled"}


# ---- the throwaway UGRO ------------------------------------------------------------------------
def psql(sql: str) -> None:
    subprocess.run(["psql", "-q", "-h", "127.0.0.1", "-U", "postgres", "-d", "postgres", "-c", sql],
                   check=True, capture_output=True, timeout=60)  # fmt: skip


def recreate_db() -> None:
    psql(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")
    psql(f"CREATE DATABASE {DB_NAME}")


def drop_db() -> None:
    from django.db import connections

    connections.close_all()
    psql(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")


def flush_redis() -> None:
    subprocess.run(["redis-cli", "-n", REDIS_DB, "flushdb"], check=True, capture_output=True, timeout=30)


def ugro_env(tmp: Path, **extra: str) -> dict[str, str]:
    data = tmp / "ugro-data"
    data.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(
        DATABASE_URL=DB_URL,
        REDIS_URL=REDIS_URL,
        UGRO_DATA_DIR=str(data),
        SECRET_KEY=SECRET,
        DJANGO_SETTINGS_MODULE="ugro_site.settings",
        PYTHONUNBUFFERED="1",
        **extra,
    )
    return env


def setup(tmp: Path, **extra: str) -> dict[str, str]:
    """Fresh DB + Redis db, django.setup() and migrate in this process; returns the env for children."""
    recreate_db()
    flush_redis()
    env = ugro_env(tmp, **extra)
    os.environ.update({k: env[k] for k in ("DATABASE_URL", "REDIS_URL", "UGRO_DATA_DIR", "SECRET_KEY",
                                           "DJANGO_SETTINGS_MODULE")})  # fmt: skip
    os.environ.update(extra)
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    return env


def cluster_yaml(cluster, count: int) -> str:
    lines = ["cluster:", '  name: "Bench lab"', f'  master_ip: "{cluster.nodes[0].address}"', "  master_port: 29700",
             "nodes:"]  # fmt: skip
    for i, node in enumerate(cluster.nodes[:count]):
        lines += [
            f"  {node.name}:", f'    ip: "{node.address}"', f'    user: "{cluster.user}"',
            f'    hostname: "{node.name}"',
            '    gpu: "none"', "    vram_gb: 0", "    gpus: 0", f"    rank: {i}",
            f'    role: "{"master" if i == 0 else "worker"}"', f"    ssh_port: {node.port}",
            f'    key: "{cluster.client_key}"', f'    torchrun: "{NODE_ENV}/bin/torchrun"',
            f'    workdir: "{node.workdir}"',
        ]  # fmt: skip
    lines += ["training:", '  default_model: "tiny"', '  default_dataset: "none"', "  script: bench_rank.py"]
    return "\n".join(lines) + "\n"


def start_cluster(tmp: Path, count: int = 1):
    """`count` sshd nodes on 127.0.3.2.., imported into UGRO, each with bench_rank.py in its workdir."""
    from cluster.config_yaml import import_cluster
    from tests.loopback import LoopbackCluster

    cluster = LoopbackCluster(tmp / "nodes", count, subnet=SUBNET, first_octet=2).start()
    for node in cluster.nodes:
        (node.workdir / "bench_rank.py").write_text(RANK_SCRIPT)
    import_cluster(cluster_yaml(cluster, count))
    return cluster


# The rank: waits for GO (bounded), then prints what bench_rank.json in its workdir asks for.
RANK_SCRIPT = r"""
import json, math, os, sys, time
here = os.path.dirname(os.path.abspath(__file__))
cfg = json.load(open(os.path.join(here, "bench_rank.json")))
deadline = time.time() + cfg.get("go_timeout", 180)
while not os.path.exists(os.path.join(here, "GO")) and time.time() < deadline:
    time.sleep(0.01)
t0 = time.time()
out = sys.stdout
if cfg["mode"] == "latency":
    period = 1.0 / cfg["rate"]
    for i in range(cfg["count"]):
        wake = t0 + i * period
        delay = wake - time.time()
        if delay > 0:
            time.sleep(delay)
        print(json.dumps({"step": i, "loss": 2.0 * math.exp(-i / 500.0), "t_print": time.time()}), flush=True)
    printed = cfg["count"]
else:
    n, every = cfg["count"], cfg["metric_every"]
    pad = "x" * cfg.get("pad", 40)
    w = out.write
    for i in range(n):
        if i % every == 0:
            w('{"step": %d, "loss": %.6f}\n' % (i, 2.0 / (1 + i * 1e-4)))
        else:
            w("BENCHLOG %d iteration %d of the data loader %s\n" % (i, i, pad))
        if i % 512 == 511:
            out.flush()
            if cfg.get("rate"):  # paced: at most `rate` lines/s, on an absolute schedule
                delay = t0 + (i + 1) / cfg["rate"] - time.time()
                if delay > 0:
                    time.sleep(delay)
    out.flush()
    printed = n
t1 = time.time()
with open(os.path.join(here, "rank_done.json"), "w") as fh:
    json.dump({"printed": printed, "t_first": t0, "t_last": t1}, fh)
"""


# ---- processes ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(argv: list[str], env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(argv, cwd=REPO, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip


def stop(proc: subprocess.Popen | None, timeout: float = 10) -> None:
    """Stop a process this benchmark started (its own session: the group id is its pid)."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    except ProcessLookupError:
        pass


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out waiting for {what}")


def start_daphne(env: dict, tmp: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = start([str(DAPHNE), "-b", "127.0.0.1", "-p", str(port), "ugro_site.asgi:application"], env,
                 tmp / "daphne.log")  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    wait_for(lambda: http_ok(base + "/accounts/login/"), 60, "daphne to serve", 0.2)
    return proc, base


def start_worker(env: dict, tmp: Path) -> subprocess.Popen:
    return start([str(CONTROLLER_PY), "-m", "celery", "-A", "ugro_site", "worker", "-P", "threads", "-c", "4",
                  "-n", "bench3@%h", "--loglevel=warning"],
                 env, tmp / "worker.log")  # fmt: skip


def session_cookie(username: str = "bench", password: str = "bench-pw-123") -> str:
    """Log a user in the way the login form would, with Django's test client; returns the session id."""
    from django.contrib.auth.models import User
    from django.test import Client

    if not User.objects.filter(username=username).exists():
        User.objects.create_user(username, password=password)
    client = Client()
    assert client.login(username=username, password=password)
    return client.cookies["sessionid"].value


def start_wsclient(base: str, job_id: int, cookie: str, tmp: Path, max_seconds: float) -> tuple[subprocess.Popen, Path]:
    out, ready = tmp / f"ws_{job_id}.json", tmp / f"ws_{job_id}.ready"
    url = base.replace("http://", "ws://") + f"/ws/jobs/{job_id}/"
    proc = subprocess.Popen([str(CONTROLLER_PY), __file__, "wsclient", url, cookie, base, str(out), str(ready),
                             str(max_seconds)], stdout=open(tmp / "wsclient.log", "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    wait_for(lambda: ready.exists() or proc.poll() is not None, 30, "the websocket client to connect")
    if not ready.exists():
        raise RuntimeError("websocket client failed: " + (tmp / "wsclient.log").read_text()[-2000:])
    return proc, out


def rank_dir(job) -> Path:
    rank = job.ranks.select_related("node").get(index=0)
    return Path(rank.node.workdir)


def write_rank_config(cluster, cfg: dict) -> None:
    for node in cluster.nodes:
        (node.workdir / "GO").unlink(missing_ok=True)
        (node.workdir / "rank_done.json").unlink(missing_ok=True)
        (node.workdir / "bench_rank.json").write_text(json.dumps(cfg))


def go(cluster) -> float:
    t = time.time()
    for node in cluster.nodes:
        (node.workdir / "GO").write_text("go")
    return t


def machine_info() -> dict:
    """The launch benchmarks' machine facts plus this benchmark's database and channel layer."""
    info = _common.machine_info()
    info["database"] = f"PostgreSQL (127.0.0.1:5432, database {DB_NAME})"
    info["channel_layer"] = f"channels_redis, Redis {REDIS_URL}"
    try:
        info["mem_gb"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
        pg = subprocess.run(["psql", "-h", "127.0.0.1", "-U", "postgres", "-tAc", "show server_version"],
                            capture_output=True, text=True, timeout=10)  # fmt: skip
        info["postgres"] = pg.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


def cleanup(cluster, procs: list, tmp: Path, keep: bool) -> None:
    for proc in procs:
        stop(proc)
    try:
        from jobs.models import Attempt

        tags = list(Attempt.objects.values_list("tag", flat=True))
    except Exception:
        tags = []
    for _ in range(50):  # bounded: SIGKILL what this benchmark's jobs left running
        pids = sorted({pid for tag in tags for pid in tagged_pids(tag)})
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.1)
    if cluster is not None:
        cluster.stop()
    try:
        from cluster.links import pool

        pool.close_all()
    except Exception:
        pass
    if not keep:
        try:
            drop_db()
        except Exception as exc:
            print("could not drop the bench database:", exc)
        shutil.rmtree(tmp, ignore_errors=True)


# ---- the websocket client (a process of its own, so the benchmark's work never delays a receive) --
def wsclient(url: str, cookie: str, origin: str, out: str, ready: str, max_seconds: float) -> None:
    import asyncio

    from websockets.asyncio.client import connect

    records = []

    state = {"ended_at": None, "closes": []}

    async def session(deadline: float) -> None:
        headers = {"Cookie": f"sessionid={cookie}"}
        async with connect(url, additional_headers=headers, origin=origin, max_size=2**26) as ws:
            Path(ready).write_text("ok")
            while time.monotonic() < deadline:
                ended_at = state["ended_at"]
                wait = 1.0 if ended_at is None else max(0.01, ended_at + 1.0 - time.monotonic())
                try:
                    raw = await asyncio.wait_for(ws.recv(), timeout=wait)
                except TimeoutError:
                    if ended_at is not None:
                        return  # a quiet second after the end: everything is in
                    continue
                t = time.time()
                msg = json.loads(raw)
                kind, data = msg.get("kind"), msg.get("data") or {}
                if kind == "batch":  # a follower's pass: one part per rank, each recorded as a "lines" event
                    for part in data.get("parts") or []:
                        take("lines", part or {}, t)
                else:
                    take(kind, data, t)

    def take(kind: str | None, data: dict, t: float) -> None:
        rec = {"t": t, "kind": kind}
        if kind == "lines":
            lines = data.get("lines") or []
            tp = []
            for ln in lines:
                if '"t_print"' in ln:
                    try:
                        obj = json.loads(ln)
                        tp.append([obj["step"], obj["t_print"]])
                    except (ValueError, KeyError):
                        pass
            rec.update(
                rank=data.get("rank"),
                start=data.get("start"),
                end=data.get("end"),
                n=len(lines),
                np=len(data.get("points") or []),
                tp=tp,
                bench=sum(1 for ln in lines if ln.startswith("BENCHLOG ") or ln.startswith('{"step"')),
            )
        elif kind == "state":
            rec["state"] = data.get("state")
            if data.get("state") in TERMINAL:
                state["ended_at"] = time.monotonic()
        records.append(rec)

    async def main() -> None:
        # Like the page's UGRO.socket: a connection the server closes is opened again (and counted).
        from websockets.exceptions import ConnectionClosed

        deadline = time.monotonic() + max_seconds
        for _ in range(1000):
            try:
                await session(deadline)
                return
            except ConnectionClosed as exc:
                state["closes"].append([time.time(), str(exc)])
                records.append({"t": time.time(), "kind": "_closed", "why": str(exc)})
                if time.monotonic() >= deadline or state["ended_at"] is not None:
                    return
                await asyncio.sleep(0.05)

    try:
        asyncio.run(main())
    finally:
        Path(out).write_text(json.dumps(records))


if __name__ == "__main__":
    if len(sys.argv) == 8 and sys.argv[1] == "wsclient":
        wsclient(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6], float(sys.argv[7]))
    else:
        sys.exit(__doc__)
