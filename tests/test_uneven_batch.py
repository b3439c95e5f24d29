"""Uneven GPUs: ranks with different local batches (UGRO_LOCAL_BATCH, weighted gradient averaging) train
exactly like an even split of the same global batch on the same seed (train/train_production.py), and
UGRO hands each rank its share (jobs/batches.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

from jobs.batches import split_batch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "train" / "train_production.py"
NODE_ENV = Path(os.environ.get("UGRO_NODE_ENV", REPO / ".venv-node"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_ranks(tmp_path: Path, local_batches: tuple[int, int], tag: str) -> list[dict]:
    """Two ranks (one process each, as UGRO starts one torchrun per node) with these local batches."""
    port = free_port()
    procs = []
    for rank, local in enumerate(local_batches):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
        env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", UGRO_LOCAL_BATCH=str(local),
                   UGRO_BATCH_WEIGHT=str(local * 2 / sum(local_batches)))  # fmt: skip
        argv = [str(NODE_ENV / "bin" / "python"), str(SCRIPT), "--max-steps", "12", "--seq-len", "32",
                "--batch-size", "8", "--log-every", "1", "--save-every", "0", "--seed", "7",
                "--output-dir", str(tmp_path / f"{tag}-{rank}")]  # fmt: skip
        procs.append(subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=180)
        assert p.returncode == 0, out.decode()
        outs.append(out.decode())
    return [json.loads(line) for line in outs[0].splitlines() if line.startswith("{")]


@pytest.mark.e2e
def test_a_weighted_split_trains_exactly_like_the_even_split_on_the_same_seed(tmp_path):
    """Covers: two real torch.distributed ranks of train_production.py with uneven batches and weighted gradients
    matching the even split step for step (no sshd, no UGRO: only a real run shows it).
    """
    even = run_two_ranks(tmp_path, (8, 8), "even")
    uneven = run_two_ranks(tmp_path, (12, 4), "uneven")  # rank 0 three times as fast
    assert [m["step"] for m in even] == list(range(1, 13)) == [m["step"] for m in uneven]
    for a, b in zip(even, uneven, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-5), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3), (a, b)
    # and the loss really moved (it is not a constant that trivially matches)
    assert even[-1]["loss"] < even[0]["loss"] - 0.1


def test_split_batch_keeps_the_global_batch_and_follows_the_weights():
    assert split_batch(8, [1.0, 1.0]) == [8, 8]
    assert split_batch(8, [3.0, 1.0]) == [12, 4]
    assert split_batch(4, [2.0, 1.0, 1.0]) == [6, 3, 3]
    out = split_batch(5, [1.0, 1.0, 1.0])  # 15 samples in thirds
    assert out == [5, 5, 5]
    out = split_batch(7, [1.0, 2.0, 4.0])  # 21 samples
    assert sum(out) == 21 and out == [3, 6, 12]
    assert sum(split_batch(3, [1.0, 1.2, 0.7])) == 9
    assert min(split_batch(2, [100.0, 1.0])) >= 1  # every rank keeps at least one sample


@pytest.mark.django_db
def test_each_rank_gets_its_share_in_its_environment_and_the_local_batch_template():
    import io

    from django.core.management import CommandError, call_command

    from cluster.models import Node

    for i in range(2):
        Node.objects.create(name=f"gpu{i}", address=f"10.4.0.{i + 1}", order=i, gpu_count=1,
                            role="master" if i == 0 else "worker")  # fmt: skip
    out = io.StringIO()
    call_command("launch", "--name", "uneven", "--nodes", "2", "--batch-per-gpu", "8", "--batch-weights",
                 "gpu0=1.5,gpu1=0.5", "--dry-run", "--", "--batch-size", "{local_batch}", stdout=out)  # fmt: skip
    lines = out.getvalue().splitlines()
    # rank 0's GPU is three times as fast: 12 of the 16 samples; rank 1 gets 4
    assert lines[2].endswith("--batch-size 12") and "UGRO_LOCAL_BATCH=12" in lines[3].split()
    assert "UGRO_BATCH_WEIGHT=1.5" in lines[3].split()
    assert lines[5].endswith("--batch-size 4") and "UGRO_LOCAL_BATCH=4" in lines[6].split()
    # without weights the template still gets the even batch and no uneven environment is set
    out = io.StringIO()
    call_command("launch", "--name", "even", "--nodes", "2", "--batch-per-gpu", "8", "--dry-run", "--",
                 "--batch-size", "{local_batch}", stdout=out)  # fmt: skip
    lines = out.getvalue().splitlines()
    assert lines[2].endswith("--batch-size 8") and "UGRO_LOCAL_BATCH" not in lines[3]
    with pytest.raises(CommandError, match="batch weight 'gpu0=fast': write NODE=WEIGHT"):
        call_command("launch", "--name", "bad", "--batch-weights", "gpu0=fast", stdout=io.StringIO())
    with pytest.raises(CommandError, match="batch weight for 'nope': no such node"):
        call_command("launch", "--name", "bad", "--batch-per-gpu", "8", "--batch-weights", "nope=1",
                     stdout=io.StringIO())  # fmt: skip


@pytest.mark.django_db
def test_auto_weights_are_learned_from_earlier_solo_runs_of_the_script_on_each_node():
    import io

    from django.core.management import call_command
    from django.utils import timezone

    from cluster.models import Node
    from jobs.models import Job, Rank
    from metrics.models import MetricPoint

    nodes = [Node.objects.create(name=f"gpu{i}", address=f"10.4.0.{i + 1}", order=i, gpu_count=1,
                                 role="master" if i == 0 else "worker") for i in range(3)]  # fmt: skip
    now = timezone.now()
    # given solo runs of the script: gpu0 at 3000 tokens/s, gpu1 at 1000 (warm-up steps are slower);
    # a 2-node run on both says nothing of either GPU; gpu2 never ran the script alone
    for node, rate in ((nodes[0], 3000.0), (nodes[1], 1000.0)):
        job = Job.objects.create(name=f"solo-{node.name}", script="train/t.py", state="succeeded", running_at=now)
        Rank.objects.create(job=job, node=node, index=0, active=False)
        MetricPoint.objects.bulk_create(
            MetricPoint(job=job, rank=0, step=s, name="tokens_per_sec", value=rate if s > 5 else rate / 10, time=now)
            for s in range(1, 21)
        )
    both = Job.objects.create(name="pair", script="train/t.py", state="succeeded", running_at=now)
    for i, node in enumerate(nodes[:2]):
        Rank.objects.create(job=both, node=node, index=i, active=False)
    MetricPoint.objects.create(job=both, rank=0, step=10, name="tokens_per_sec", value=50.0, time=now)
    out = io.StringIO()
    call_command("launch", "--name", "auto", "--nodes", "3", "--script", "train/t.py", "--batch-per-gpu", "8",
                 "--batch-weights", "auto", "--dry-run", stdout=out)  # fmt: skip
    envs = [line.split() for line in out.getvalue().splitlines() if "environment:" in line]
    # then 24 samples split 3000 : 1000 : 2000 (gpu2 gets the mean of the known)
    assert [next(e for e in env if e.startswith("UGRO_LOCAL_BATCH=")) for env in envs] == [
        "UGRO_LOCAL_BATCH=12", "UGRO_LOCAL_BATCH=4", "UGRO_LOCAL_BATCH=8"
    ]  # fmt: skip
