"""Uneven GPUs: two CPU "GPUs", one made half as fast, trained with the even split and with UGRO's
weighted split (jobs/batches.py split_batch over weights from a short solo calibration of each rank).

    .venv/bin/python bench/uneven_batch.py [--per-gpu 16] [--steps 40] [--sleep-ms 4] [--repeat 3]

Each "GPU" is one process of train/train_production.py (gloo on CPU; one process per node, as UGRO
starts one torchrun per node) slowed by TRAIN_SAMPLE_SLEEP seconds per sample of its local batch:
rank 0 by --sleep-ms, rank 1 by twice that (half its speed). Measured, per repeat, in this order:
each rank alone (its solo samples/s, the calibration), the even split (per-gpu samples each), the
weighted split (shares in proportion to the solo figures). The job's samples/s is the global batch
times steps/s after a warm-up; the goal is >= 90 % of the sum of the solo figures.

Writes bench/results/uneven_batch.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench._common import NODE_PY, RESULTS, make_tmp  # noqa: E402
from jobs.batches import split_batch  # noqa: E402

SCRIPT = REPO / "train" / "train_production.py"
SEQ = 32
WARMUP = 5  # steps left out of every rate


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(tmp: Path, batches: list[int | None], sleeps: list[float], steps: int, per_gpu: int) -> list[dict]:
    """Start one process per entry (a solo run when there is one); returns rank 0's metric lines."""
    world = len(batches)
    port = free_port()
    procs = []
    for rank, (local, sleep) in enumerate(zip(batches, sleeps, strict=True)):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TRAIN_SAMPLE_SLEEP=str(sleep))
        if world > 1:
            env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port))  # fmt: skip
        if local is not None:
            env.update(UGRO_LOCAL_BATCH=str(local), UGRO_BATCH_WEIGHT=str(local / per_gpu))
        argv = [str(NODE_PY), str(SCRIPT), "--max-steps", str(steps), "--seq-len", str(SEQ), "--log-every", "1",
                "--batch-size", str(per_gpu), "--save-every", "0", "--output-dir", str(tmp / f"out{rank}")]  # fmt: skip
        procs.append(subprocess.Popen(argv, env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=600)
        if p.returncode != 0:
            raise RuntimeError(out.decode()[-2000:])
        outs.append(out.decode())
    return [json.loads(line) for line in outs[0].splitlines() if line.startswith("{")]


def steps_per_s(lines: list[dict], local: int) -> float:
    """Rank 0's steps per second after the warm-up (its tokens/s over its local batch's tokens)."""
    rates = [m["tokens_per_sec"] / (local * SEQ) for m in lines if m["step"] > WARMUP]
    return len(rates) / sum(1 / r for r in rates)  # harmonic mean: total steps over total time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-gpu", type=int, default=16, help="the even split's batch per GPU")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--sleep-ms", type=float, default=4.0, help="rank 0's slowdown per sample; rank 1 twice it")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    sleeps = [args.sleep_ms / 1000, 2 * args.sleep_ms / 1000]
    tmp = make_tmp("ugro-uneven-")
    trials = []
    for _ in range(args.repeat):
        solo = [args.per_gpu * steps_per_s(run(tmp, [None], [s], args.steps, args.per_gpu), args.per_gpu)
                for s in sleeps]  # fmt: skip
        even_lines = run(tmp, [args.per_gpu, args.per_gpu], sleeps, args.steps, args.per_gpu)
        even = 2 * args.per_gpu * steps_per_s(even_lines, args.per_gpu)
        shares = split_batch(args.per_gpu, solo)
        weighted_lines = run(tmp, shares, sleeps, args.steps, args.per_gpu)
        weighted = 2 * args.per_gpu * steps_per_s(weighted_lines, shares[0])
        loss_gap = max(abs(a["loss"] - b["loss"]) for a, b in zip(even_lines, weighted_lines, strict=True))
        trials.append({"solo_samples_per_s": [round(x, 2) for x in solo], "sum_solo": round(sum(solo), 2),
                       "even_samples_per_s": round(even, 2), "weighted_samples_per_s": round(weighted, 2),
                       "weighted_shares": shares, "even_pct_of_sum": round(100 * even / sum(solo), 1),
                       "weighted_pct_of_sum": round(100 * weighted / sum(solo), 1),
                       "max_loss_gap_even_vs_weighted": loss_gap, "load1": os.getloadavg()[0]})  # fmt: skip
    out = {
        "benchmark": "uneven_batch",
        "args": vars(args),
        "trials": trials,
        "median_even_pct_of_sum": statistics.median(t["even_pct_of_sum"] for t in trials),
        "median_weighted_pct_of_sum": statistics.median(t["weighted_pct_of_sum"] for t in trials),
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "uneven_batch.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"{'trial':>5} {'solo0':>8} {'solo1':>8} {'sum':>8} {'even':>8} {'%':>6} {'weighted':>9} {'%':>6} shares")  # noqa: T201
    for i, t in enumerate(trials):
        print(f"{i:>5} {t['solo_samples_per_s'][0]:>8} {t['solo_samples_per_s'][1]:>8} {t['sum_solo']:>8} "  # noqa: T201
              f"{t['even_samples_per_s']:>8} {t['even_pct_of_sum']:>6} {t['weighted_samples_per_s']:>9} "
              f"{t['weighted_pct_of_sum']:>6} {t['weighted_shares']}")  # fmt: skip
    print(
        f"median: even {out['median_even_pct_of_sum']} %, weighted {out['median_weighted_pct_of_sum']} % of the "  # noqa: T201
        "sum of solo throughputs"
    )


if __name__ == "__main__":
    main()
