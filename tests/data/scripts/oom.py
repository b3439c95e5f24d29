"""The last node rank runs out of (CUDA) memory and exits 3, as a script that catches the error would."""

import os
import sys
import time

node_rank = int(os.environ.get("UGRO_NODE_RANK", "0"))
last = int(sys.argv[-1]) if len(sys.argv) > 1 else 2  # the last argument
for step in range(1, 4):
    print(f'{{"step": {step}, "loss": {1.0 / step}}}', flush=True)
    time.sleep(0.2)
if node_rank == last:
    try:
        raise RuntimeError(
            "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 7.79 GiB total capacity; "
            "5.12 GiB already allocated; 1.01 GiB free; 5.50 GiB reserved in total by PyTorch)"
        )
    except RuntimeError as exc:
        print(f"RuntimeError: {exc}", file=sys.stderr, flush=True)
        sys.exit(3)
time.sleep(60)
