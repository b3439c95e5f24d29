"""End-to-end tests of train/train_production.py.

The controller venv has no torch, so the script runs as a subprocess with the
node training environment: $UGRO_NODE_ENV (default <repo>/.venv-node).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "train" / "train_production.py"
NODE_ENV = Path(os.environ.get("UGRO_NODE_ENV", REPO_ROOT / ".venv-node"))
PYTHON = NODE_ENV / "bin" / "python"
TORCHRUN = NODE_ENV / "bin" / "torchrun"

METRIC_KEYS = {"step", "epoch", "loss", "lr", "tokens_per_sec", "grad_norm", "rank"}
SMALL = ["--seq-len", "32", "--batch-size", "16"]
TIMEOUT = 180

pytestmark = pytest.mark.skipif(not NODE_ENV.is_dir(), reason=f"node training env not found at {NODE_ENV}")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    for key in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "GROUP_RANK",
        "TORCHELASTIC_RUN_ID",
    ):
        env.pop(key, None)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout}\nSTDERR:\n{proc.stderr}"
    return proc


def _metrics(stdout: str) -> list[dict]:
    """JSON metric lines; every other line must be plain (non-JSON) text."""
    out = []
    for line in stdout.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        assert isinstance(obj, dict), f"non-object JSON line: {line!r}"
        assert METRIC_KEYS <= obj.keys(), f"metric line missing keys: {line!r}"
        assert isinstance(obj["step"], int) and isinstance(obj["epoch"], int)
        assert isinstance(obj["loss"], float)
        out.append(obj)
    return out


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_single_process_trains_checkpoints_and_resumes_from_latest(tmp_path):
    out_dir = tmp_path / "out"
    common = ["--model-name", "unsloth/tinyllama-bnb-4bit", "--dataset-name", "wikitext", "--job-id", "t-single",
              "--output-dir", out_dir, *SMALL]  # fmt: skip
    proc = _run([PYTHON, "-u", SCRIPT, *common, "--max-steps", "30", "--log-every", "5", "--save-every", "10"],
                cwd=tmp_path)  # fmt: skip
    metrics = _metrics(proc.stdout)
    assert [m["step"] for m in metrics] == [5, 10, 15, 20, 25, 30]
    assert all(m["rank"] == 0 for m in metrics)
    first, last = metrics[0]["loss"], metrics[-1]["loss"]
    assert first > last + 0.5, f"loss did not fall: {first} -> {last}"
    assert {p.name for p in out_dir.glob("checkpoint_step*.pt")} == {f"checkpoint_step{n}.pt" for n in (10, 20, 30)}
    assert not [p for p in out_dir.iterdir() if ".tmp" in p.name]
    assert "training complete" in proc.stdout.splitlines()[-1]
    # the final loss it prints is the last loss it logged, printed as UGRO's pages print it
    assert f"final_loss={last:.6g} " in proc.stdout.splitlines()[-1]
    # the fallback notices are single plain lines
    assert "using 'tiny'" in proc.stdout
    assert "using 'gpl-3'" in proc.stdout

    # a second run resumes from the newest checkpoint and goes on from the step after it
    second = _run([PYTHON, "-u", SCRIPT, *common, "--resume-from", "latest", "--max-steps", "35", "--log-every", "1"],
                  cwd=tmp_path)  # fmt: skip
    assert [m["step"] for m in _metrics(second.stdout)] == list(range(31, 36))
    assert "checkpoint_step30.pt" in second.stdout  # "resuming from ..." notice
    assert (out_dir / "checkpoint_step35.pt").is_file()


def test_torchrun_two_ranks(tmp_path):
    port = _free_port()
    out_dir = tmp_path / "out"
    proc = _run(
        [
            TORCHRUN,
            "--nnodes=1",
            "--nproc-per-node=2",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--local-addr=127.0.0.1",
            "--rdzv-conf=join_timeout=10",
            SCRIPT,
            "--job-id",
            "t-ddp",
            "--max-steps",
            "10",
            "--log-every",
            "5",
            "--output-dir",
            out_dir,
            "--seq-len",
            "32",
            "--batch-size",
            "8",
        ],
        cwd=tmp_path,
    )
    metrics = _metrics(proc.stdout)
    by_rank = {r: [m["step"] for m in metrics if m["rank"] == r] for r in (0, 1)}
    assert by_rank == {0: [5, 10], 1: [5, 10]}, proc.stdout
    # ranks see different data, so their losses differ
    assert len({m["loss"] for m in metrics if m["step"] == 5}) == 2
    assert (out_dir / "checkpoint_step10.pt").is_file()
    assert proc.stdout.count("training complete") == 1
