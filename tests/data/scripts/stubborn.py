"""Ignores SIGTERM; the worker of node rank FAIL_NODE_RANK fails after a few lines, the rest run on."""

import os
import signal
import sys
import time

signal.signal(signal.SIGTERM, signal.SIG_IGN)
node_rank = int(os.environ.get("UGRO_NODE_RANK", "0"))
fail_on = int(sys.argv[-1]) if len(sys.argv) > 1 else 1  # the last argument
for i in range(3):
    print(f"node rank {node_rank} working {i}", flush=True)
    time.sleep(0.2)
if node_rank == fail_on:
    print("giving up", flush=True)
    sys.exit(1)
while True:
    time.sleep(1)
