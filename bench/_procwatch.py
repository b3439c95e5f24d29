"""Process watcher for the launch benchmark, run as its own process (so its polling never holds the
benchmark's GIL while paramiko threads in there are starting ranks).

Protocol, one JSON object per line: the benchmark writes
  {"tag": T, "count": N, "argv": [...], "timeout": 60, "interval": 0.005}
or, when UGRO picks the tag itself (`<job name>-<8 hex>`, the ugro_cli methods), "tag_prefix": P
instead of "tag": then an environment entry starting with `UGRO_JOB=P` matches.
the watcher snapshots the pids that exist now (a rank cannot be one of them), answers "ready",
then every `interval` seconds scans the new pids for processes whose environment carries
UGRO_JOB=T and whose command line is exactly argv (the exec'd rank, not the shell or nohup on the
way to it). When N exist it answers {"found_at": <time.monotonic()>, "pids": [...], "polls": k, "tags": [...]};
after `timeout` seconds {"timeout": true, "pids": [...]}. CLOCK_MONOTONIC is machine-wide, so
the benchmark compares found_at with its own time.monotonic() taken when it issued the command.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError:
        return None


def watch(req: dict) -> dict:
    exact = "tag" in req
    want = f"UGRO_JOB={req['tag'] if exact else req['tag_prefix']}".encode()
    argv = [a.encode() for a in req["argv"]]
    count = int(req["count"])
    interval = float(req.get("interval", 0.005))
    baseline = {name for name in os.listdir("/proc") if name.isdigit()}
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    deadline = time.monotonic() + float(req.get("timeout", 60))
    found: set[int] = set()
    tags: set[str] = set()
    polls = 0
    while True:
        polls += 1
        for name in os.listdir("/proc"):
            if not name.isdigit() or name in baseline or int(name) in found:
                continue
            cmdline = _read(f"/proc/{name}/cmdline")
            if not cmdline or cmdline.rstrip(b"\0").split(b"\0") != argv:
                continue
            env = _read(f"/proc/{name}/environ")
            if not env:
                continue
            hit = next((e for e in env.split(b"\0") if (e == want if exact else e.startswith(want))), None)
            if hit is not None:
                found.add(int(name))
                tags.add(hit.split(b"=", 1)[1].decode(errors="replace"))
        now = time.monotonic()
        if len(found) >= count:
            return {"found_at": now, "pids": sorted(found), "polls": polls, "tags": sorted(tags)}
        if now > deadline:
            return {"timeout": True, "pids": sorted(found), "polls": polls, "tags": sorted(tags)}
        time.sleep(interval)


def main() -> None:
    for line in sys.stdin:
        if not line.strip():
            continue
        result = watch(json.loads(line))
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
