#!/usr/bin/env python
"""Serving endpoint: latency it adds and throughput it keeps, /serve/NAME/v1/completions vs the replicas direct.

    .venv/bin/python bench/serve.py [--pairs 300] [--seconds 6] [--rounds 5] [--concurrency 4] [--max-tokens 8]
                                    [--keep]

Two `transformers serve` replicas (the node env's, on CPU) serve a tiny GPT-2 built here with nothing downloaded
(tests/data/serve/tiny_gpt2.py) on 127.0.0.1; daphne serves UGRO (`ugro_site.asgi`, as bin/start runs it) on a
throwaway PostgreSQL database whose rows say the service runs with both replicas ready (the worker's part,
starting and checking them, is not measured: tests/test_serve.py runs it). Every request is a non-streamed
completion of `--max-tokens` tokens (`"the cluster"`), with an infer-scoped token on the endpoint's calls.

- latency: `--pairs` sequential pairs, each one request straight to a replica (alternating) and one through the
  endpoint, in alternating order; added = p50 (p99) through the endpoint - p50 (p99) direct.
- throughput: `--concurrency` closed-loop clients for `--seconds`, straight to the replicas (client i to replica
  i % 2) then through the endpoint, `--rounds` times each, alternating; kept = endpoint / direct requests per second
  (all rounds, and the median of each round's pair: the machine's other load drifts). daphne's CPU seconds per
  request through it are read from /proc.

Goal (issue 27): under 5 ms added at p50, at least 90% of direct throughput. Results: bench/results/serve.json.
"""

from __future__ import annotations

import argparse
import getpass
import os
import secrets
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    CONTROLLER_PY,
    NODE_ENV,
    NODE_PY,
    REPO,
    RESULTS,
    kill_tagged,
    machine_info,
    make_tmp,
    setup_django,
    write_json,
)
from _db import throwaway_database  # noqa: E402

PROMPT = "the cluster"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ok(url: str, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{what} did not answer {url} within {timeout:g} s")


def start(argv: list[str], env: dict, log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(argv, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip


def proc_cpu(pid: int) -> float:
    """CPU seconds (user+sys) of one process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


class Target:
    """Where a completion goes: a replica straight, or the endpoint (with the token, naming the service)."""

    def __init__(self, url: str, model: str, max_tokens: int, headers: dict | None = None) -> None:
        self.url, self.headers = url, headers or {}
        self.body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens}

    def call(self, client: httpx.Client) -> float:
        t0 = time.perf_counter()
        r = client.post(self.url, json=self.body, headers=self.headers)
        took = time.perf_counter() - t0
        if r.status_code != 200 or not r.json().get("choices"):
            raise RuntimeError(f"{self.url}: HTTP {r.status_code}: {r.text[:200]}")
        return took


def latency(direct: list[Target], endpoint: Target, pairs: int) -> dict:
    took = {"direct": [], "endpoint": []}
    with httpx.Client(timeout=60) as client:
        for i in range(pairs):
            ways = [("direct", direct[i % 2]), ("endpoint", endpoint)]
            for way, target in ways if i % 2 == 0 else reversed(ways):
                took[way].append(target.call(client))
    out = {way: {"p50_ms": ms(statistics.median(v)), "p99_ms": ms(pct(v, 0.99)), "mean_ms": ms(statistics.fmean(v))}
           for way, v in took.items()}  # fmt: skip
    out["added_p50_ms"] = round(out["endpoint"]["p50_ms"] - out["direct"]["p50_ms"], 2)
    out["added_p99_ms"] = round(out["endpoint"]["p99_ms"] - out["direct"]["p99_ms"], 2)
    out["pairs"] = pairs
    return out


def throughput(targets: list[Target], clients: int, seconds: float) -> dict:
    """Closed-loop clients for `seconds`: requests per second, and failures."""
    done, failed = [0] * clients, [0] * clients
    stop = threading.Event()

    def loop(i: int) -> None:
        target = targets[i % len(targets)]
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                try:
                    target.call(client)
                    done[i] += 1
                except (RuntimeError, httpx.HTTPError):
                    failed[i] += 1

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(clients)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(timeout=120)
    wall = time.monotonic() - t0
    return {"requests": sum(done), "failed": sum(failed), "seconds": round(wall, 2), "rps": round(sum(done) / wall, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--pairs", type=int, default=300)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()

    tmp = make_tmp("ugro-bench-serve-")
    tag = f"bench-serve-{secrets.token_hex(4)}"
    info = machine_info()
    try:
        with throwaway_database(keep=args.keep) as url:
            run(args, tmp, tag, url, info)
    finally:
        left = kill_tagged(tag)
        if left:
            print(f"{left} tagged processes survived", file=sys.stderr)
        if not args.keep:
            subprocess.run(["rm", "-rf", str(tmp)])


def run(args, tmp: Path, tag: str, database_url: str, info: dict) -> None:
    env = {**os.environ, **setup_django(tmp, database_url), "UGRO_JOB": tag}
    from django.contrib.auth.models import User

    from accounts.tokens import create_token
    from cluster.models import Node
    from jobs.models import Checkpoint, Job
    from serving.models import Replica, Service
    from serving.stats import recent

    model = tmp / "checkpoint-10"
    subprocess.run([str(NODE_PY), str(REPO / "tests/data/serve/tiny_gpt2.py"), str(model)], check=True,
                   capture_output=True, timeout=300)  # fmt: skip
    ports = [free_port(), free_port()]
    for i, port in enumerate(ports):
        start([str(NODE_ENV / "bin" / "transformers"), "serve", str(model), "--host", "127.0.0.1", "--port",
               str(port)], env, tmp / f"replica{i}.log")  # fmt: skip
    web_port = free_port()
    daphne = start([str(CONTROLLER_PY.parent / "daphne"), "-b", "127.0.0.1", "-p", str(web_port),
                    "ugro_site.asgi:application"], {**env, "PYTHONPATH": str(REPO)}, tmp / "daphne.log")  # fmt: skip
    base = f"http://127.0.0.1:{web_port}"
    for port in ports:
        wait_ok(f"http://127.0.0.1:{port}/health", 300, "transformers serve")
    wait_ok(base + "/accounts/login/", 60, "daphne")

    node = Node.objects.create(name="here", address="127.0.0.1", gpu_count=0)
    job = Job.objects.create(name="trained", script="train.py", state=Job.State.SUCCEEDED)
    ckpt = Checkpoint.objects.create(job=job, node=node, path=str(model), size=1, mtime=0, step=10,
                                     kind=Checkpoint.Kind.DIR, ready=True)  # fmt: skip
    service = Service.objects.create(name="bench", job=job, checkpoint=ckpt, replicas=2)
    for i, port in enumerate(ports):
        Replica.objects.create(service=service, index=i, state=Replica.State.READY, node=node, port=port,
                               model_path=str(model))  # fmt: skip
    token = create_token(User.objects.get(username=getpass.getuser()), "bench", "infer")[1]

    direct = [Target(f"http://127.0.0.1:{p}/v1/completions", str(model), args.max_tokens) for p in ports]
    endpoint = Target(f"{base}/serve/bench/v1/completions", "bench", args.max_tokens,
                      {"Authorization": f"Bearer {token}"})  # fmt: skip
    with httpx.Client(timeout=60) as client:  # warm: models loaded, connections open, code paths run once
        for _ in range(10):
            for t in (*direct, endpoint):
                t.call(client)

    print(f"latency: {args.pairs} pairs ...", flush=True)
    lat = latency(direct, endpoint, args.pairs)
    rounds = []
    for r in range(args.rounds):
        for way, targets in (("direct", direct), ("endpoint", [endpoint])):
            print(f"throughput round {r + 1}: {way} ...", flush=True)
            cpu0 = proc_cpu(daphne.pid)
            row = {"way": way, "round": r + 1, "loadavg1": round(os.getloadavg()[0], 2),
                   **throughput(targets, args.concurrency, args.seconds)}  # fmt: skip
            row["daphne_cpu_s"] = round(proc_cpu(daphne.pid) - cpu0, 2)
            if way == "endpoint" and row["requests"]:
                row["daphne_cpu_ms_per_request"] = round(1000 * row["daphne_cpu_s"] / row["requests"], 2)
            rounds.append(row)
    # each round's endpoint against the direct run just before it: the other load of a shared machine drifts
    ratios = [e["rps"] / d["rps"] for d, e in zip(rounds[::2], rounds[1::2], strict=True) if d["rps"]]
    direct_rps = sum(x["rps"] for x in rounds if x["way"] == "direct")
    endpoint_rps = sum(x["rps"] for x in rounds if x["way"] == "endpoint")
    time.sleep(6)  # the endpoint writes its stats every 5 s
    seen = recent(list(service.replica_set.order_by("index")))
    info["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result = {
        "machine": info,
        "settings": {
            **{k: getattr(args, k) for k in ("pairs", "seconds", "rounds", "concurrency", "max_tokens")},
            "replicas": 2,
        },  # fmt: skip
        "latency": lat,
        "throughput": {
            "rounds": rounds,
            "kept": round(endpoint_rps / direct_rps, 3) if direct_rps else None,
            "kept_median_of_rounds": round(statistics.median(ratios), 3) if ratios else None,
        },  # fmt: skip
        "endpoint_stats_last_minute": [s.as_dict() for s in seen.values()],
        "goal": {"added_p50_ms_under": 5, "kept_at_least": 0.9},
    }
    kept = result["throughput"]["kept_median_of_rounds"] or 0
    result["goal"]["met"] = bool(lat["added_p50_ms"] < 5 and kept >= 0.9)
    write_json(RESULTS / "serve.json", result)
    d, e = lat["direct"], lat["endpoint"]
    print(f"latency p50 direct {d['p50_ms']} ms, endpoint {e['p50_ms']} ms: added {lat['added_p50_ms']} ms "
          f"(p99 {d['p99_ms']} / {e['p99_ms']} ms: added {lat['added_p99_ms']} ms)")  # fmt: skip
    for row in rounds:
        print(f"  {row['way']:<8} {row['rps']:8.1f} req/s  {row['failed']} failed  daphne cpu {row['daphne_cpu_s']} s")
    print(f"throughput kept: {result['throughput']['kept']} (median of rounds {kept}); "
          f"load {info['loadavg_start']} -> {info['loadavg_end']}")  # fmt: skip
    daphne.terminate()


if __name__ == "__main__":
    main()
