"""Process watcher for ranks whose UGRO_JOB tag is not known in advance (bench/launch_fanout.py's
ugro_cli methods: UGRO picks the tag, `<job name>-<8 hex>`, when it places the job).

Same protocol and timing as bench/_procwatch.py, except that the request carries
  {"tag_prefix": P, ...}
and a process matches when its command line is exactly argv and one of its environment entries
starts with `UGRO_JOB=P` (P is `<job name>-`, and job names are unique). The answer adds
"tags": the distinct UGRO_JOB values seen.
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
    want = f"UGRO_JOB={req['tag_prefix']}".encode()
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
            hit = next((e for e in env.split(b"\0") if e.startswith(want)), None)
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
