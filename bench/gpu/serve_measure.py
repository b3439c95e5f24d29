"""Cold start from zero and tokens/s of one service, through UGRO's endpoint (/serve/NAME/v1/completions).

Run with the controller's python and its Django settings (bench/gpu/open_issues.sh does): the service must be
asleep (--min-replicas 0). Prints one JSON object: the first request's time to its first token (the wake: a replica
placed, the engine started, the weights loaded), the cold start UGRO recorded, then streamed completions one at a time
and N at once, as generated tokens per second.
"""

import argparse
import getpass
import json
import os
import statistics
import sys
import threading
import time

import django
import httpx

sys.path.insert(0, os.getcwd())
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ugro_site.settings")
django.setup()

from django.contrib.auth import get_user_model  # noqa: E402

from accounts.tokens import create_token  # noqa: E402
from serving.models import Replica, Service  # noqa: E402

PROMPT = "the cluster trains a model on"


def stream(base: str, name: str, headers: dict, max_tokens: int) -> dict:
    """One streamed completion: seconds to the first chunk, to the end, and the chunks (one token each)."""
    body = {"model": name, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True, "temperature": 1.0}
    t0 = time.perf_counter()
    first, chunks = None, 0
    with httpx.stream("POST", f"{base}/serve/{name}/v1/completions", json=body, headers=headers, timeout=600) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "body": r.read()[:300].decode(errors="replace")}
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks += 1
                if first is None:
                    first = time.perf_counter() - t0
    end = time.perf_counter() - t0
    return {"status": 200, "first_s": first, "end_s": end, "tokens": chunks}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="http://127.0.0.1:8099")
    ap.add_argument("--name", required=True)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=8)
    a = ap.parse_args()
    user = get_user_model().objects.get(username=getpass.getuser())
    headers = {"Authorization": f"Bearer {create_token(user, 'gpu-bench', 'infer')[1]}"}
    service = Service.objects.get(name=a.name)
    out: dict = {"service": a.name, "engine": service.engine, "state_before": service.state,
                 "checkpoint": f"{service.checkpoint.node.name}:{service.checkpoint.path}"}  # fmt: skip
    cold = stream(a.base, a.name, headers, 16)
    service.refresh_from_db()
    out["cold_start"] = cold
    single = [stream(a.base, a.name, headers, a.max_tokens) for _ in range(a.repeat)]
    ok = [r for r in single if r.get("status") == 200 and r["tokens"] > 1]
    out["single"] = {
        "runs": single,
        "tokens_per_s_median": statistics.median((r["tokens"] - 1) / (r["end_s"] - r["first_s"]) for r in ok)
        if ok else None,
        "first_token_s_median": statistics.median(r["first_s"] for r in ok) if ok else None,
    }  # fmt: skip
    results: list = []
    t0 = time.perf_counter()
    threads = [threading.Thread(target=lambda: results.append(stream(a.base, a.name, headers, a.max_tokens)))
               for _ in range(a.concurrency)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    out["concurrent"] = {"streams": a.concurrency, "wall_s": round(wall, 2),
                         "failed": sum(1 for r in results if r.get("status") != 200),
                         "tokens": sum(r.get("tokens", 0) for r in results),
                         "tokens_per_s": round(sum(r.get("tokens", 0) for r in results) / wall, 1)}  # fmt: skip
    service.refresh_from_db()
    out["cold_start"]["recorded_s"] = service.last_cold_start_s  # recorded by the worker once the replica is ready
    rows = Replica.objects.filter(service=service)
    out["replicas"] = list(rows.values("index", "state", "node__name", "gpu_indices"))
    print(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
