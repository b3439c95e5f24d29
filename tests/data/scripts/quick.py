"""Prints a few metric lines and exits 0 (torchrun's start is most of its run time)."""

import json
import os

rank = int(os.environ.get("RANK", "0"))
for step in range(1, 4):
    print(json.dumps({"step": step, "loss": 1.0 / step, "rank": rank}), flush=True)
