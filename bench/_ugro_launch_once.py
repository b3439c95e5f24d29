"""One cold UGRO launch of a rank command on N nodes, as a fresh process pays it.

Usage (by bench/launch_fanout.py): _ugro_launch_once.py '<json spec>'
  spec = {"nodes": [{"name", "address", "port", "user", "key", "python", "workdir"}, ...],
          "tag": T, "argv": [...], "connect_timeout": 10}
Environment: DATABASE_URL / UGRO_DATA_DIR of the benchmark's throwaway UGRO.

It does what `ugro launch` does up to the ranks being started, minus the database and pre-flight:
python start + imports, django.setup(), a link (SSH handshake + agent bootstrap + hello) to every
node at once through cluster.fanout.on_each, then one agent `start` per node at once. It prints one
JSON line of time.monotonic() stamps and exits (closing the links; the ranks live on).
"""

from __future__ import annotations

import json
import os
import sys
import time

T_MAIN = time.monotonic()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    spec = json.loads(sys.argv[1])
    sys.path.insert(0, REPO)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ugro_site.settings")
    import django

    django.setup()
    from cluster.fanout import node_request, on_each
    from cluster.links import pool
    from cluster.models import Node

    t_setup = time.monotonic()
    nodes = [
        Node(
            name=n["name"],
            address=n["address"],
            ssh_port=n["port"],
            user=n["user"],
            key_path=n["key"],
            agent_python=n["python"],
            workdir=n["workdir"],
        )  # fmt: skip
        for n in spec["nodes"]
    ]
    timeout = float(spec.get("connect_timeout", 10))
    tag = spec["tag"]
    hello = on_each(nodes, lambda n: node_request(n, "hello", timeout=timeout))
    t_connected = time.monotonic()
    errors = [f"{n.name}: {err}" for n, _, err in hello if err]
    if not errors:

        def start(n: Node) -> dict:
            base = f"{n.workdir}/.bench/{tag}"
            return node_request(
                n, "start", timeout=30, argv=spec["argv"], env={"UGRO_JOB": tag, "UGRO_NODE": n.name},
                cwd=n.workdir, log=f"{base}/rank.log", exit_file=f"{base}/rank.exit",
            )  # fmt: skip

        started = on_each(nodes, start)
        errors = [f"{n.name}: {err}" for n, _, err in started if err]
    t_started = time.monotonic()
    pool.close_all()
    out = {"t_main": T_MAIN, "t_setup": t_setup, "t_connected": t_connected, "t_started": t_started}
    if errors:
        out["errors"] = errors
    sys.stdout.write(json.dumps(out) + "\n")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
