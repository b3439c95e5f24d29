"""Prints the GPUs this worker was given, waits (--hold seconds), and on SIGTERM says so and exits 0."""

import argparse
import os
import signal
import sys
import time


def on_term(signum, frame):
    print(f"rank {os.environ.get('RANK')} got SIGTERM: saving a last checkpoint", flush=True)
    sys.exit(0)


signal.signal(signal.SIGTERM, on_term)
print(
    f"rank {os.environ.get('RANK')} local {os.environ.get('LOCAL_RANK')}/{os.environ.get('LOCAL_WORLD_SIZE')} "
    f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}",
    flush=True,
)
parser = argparse.ArgumentParser()
parser.add_argument("--hold", type=float, default=0.0)
hold = parser.parse_known_args()[0].hold  # UGRO may pass --model-name and the like: not ours
deadline = time.monotonic() + hold
while time.monotonic() < deadline:
    time.sleep(0.1)
print("done", flush=True)
