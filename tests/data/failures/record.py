"""Re-record the real torchrun failures that tests/test_failure.py explains.

Usage: .venv/bin/python tests/data/failures/record.py [CASE ...]   (all cases when none is named)

Each case runs the real torchrun from .venv-node (torch 2.13, gloo on CPU) on 127.0.0.1: two torchrun
processes under c10d for nnodes=2 (the first started hosts the store), one where that suffices, each
with its own TORCHELASTIC_ERROR_FILE, the way UGRO starts a rank. It writes tests/data/failures/<case>/:
<node>.log (torchrun's combined output), <node>.error.json (only if torchrun wrote one) and case.json
(the facts the controller would have, plus the Failure that must come out, written by hand below).
A node's rank is the GROUP_RANK its worker printed (c10d ranks follow join order, not start order).

oom_then_abort/ is not written here: it is a run of oom_raise_record in which the worker, after printing its
OOM traceback, aborted at exit (SIGABRT, "terminate called without an active exception") because its gloo
process group was still alive. torch does that at random; it was kept because real jobs see it too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = HERE / "scripts"
REPO = HERE.parents[2]
NODE_NAMES = ("node-a", "node-b")
WAIT_S = 120.0  # per torchrun; a case that takes longer is broken, not slow


@dataclass
class Case:
    """One recording: how to run it and what explain() must say about it."""

    name: str
    mode: str
    expected: dict | None
    nnodes: int = 2
    nproc: int = 1
    started: int = 2
    record: bool = False  # decorate the script's main with torch's @record (it then writes an error file)
    env: dict[str, str] = field(default_factory=dict)  # extra environment for every node
    env_a: dict[str, str] = field(default_factory=dict)  # extra environment for the first node only
    sigterm_b_after: str | None = None  # SIGTERM node-b's torchrun once its log has this text
    join_timeout: int = 30


OOM_1GIB = (
    "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 7.79 GiB total capacity; "
    "5.12 GiB already allocated; 1.20 GiB free; 5.50 GiB reserved in total by PyTorch)"
)
PID = r"\d+"

CASES = [
    Case(
        "oom_exit3",
        "oom_exit3",
        {"kind": "OOM", "rank": 1, "exit_code": 3, "signal": None, "line": OOM_1GIB},
    ),
    Case(
        "oom_raise_record",
        "oom_raise",
        {"kind": "OOM", "rank": 1, "exit_code": 1, "signal": None, "line": OOM_1GIB},
        record=True,
    ),
    Case(
        "torch_oom",
        "torch_oom",
        {
            "kind": "OOM",
            "rank": 1,
            "exit_code": 1,
            "signal": None,
            "line_re": r"^torch\.OutOfMemoryError: CUDA out of memory\. Tried to allocate 20\.00 MiB\. ",
        },
        record=True,
    ),
    Case(
        "hip_oom",
        "hip_oom",
        {
            "kind": "OOM",
            "rank": 0,
            "exit_code": 1,
            "signal": None,
            "line_re": r"^torch\.OutOfMemoryError: HIP out of memory\. Tried to allocate 1\.00 GiB\. ",
        },
        nnodes=1,
        started=1,
        env_a={"REC_FAIL_RANK": "0"},
    ),
    Case(
        "mps_oom",
        "mps_oom",
        {
            "kind": "OOM",
            "rank": 0,
            "exit_code": 1,
            "signal": None,
            "line_re": r"^RuntimeError: MPS backend out of memory \(MPS allocated: 17\.00 GB, ",
        },
        nnodes=1,
        started=1,
        env_a={"REC_FAIL_RANK": "0"},
    ),
    Case(
        "value_error",
        "value_error",
        {
            "kind": "SCRIPT_ERROR",
            "rank": 1,
            "exit_code": 1,
            "signal": None,
            "line": "ValueError: learning rate must be positive, got -0.1",
        },
    ),
    Case(
        "sigkill_worker",
        "sigkill",
        {
            "kind": "KILLED",
            "rank": 1,
            "exit_code": None,
            "signal": 9,
            "line_re": rf"^Signal 9 \(SIGKILL\) received by PID {PID}$",
        },
    ),
    Case(
        "sigterm_worker",
        "sigterm",
        {
            "kind": "KILLED",
            "rank": 0,
            "exit_code": None,
            "signal": 15,
            "line_re": rf"^Signal 15 \(SIGTERM\) received by PID {PID}$",
        },
        nnodes=1,
        nproc=2,
        started=1,
    ),
    Case(
        "sigterm_torchrun",
        "wait",
        {
            "kind": "KILLED",
            "rank": "node-b",
            "exit_code": None,
            "signal": 15,
            "line_re": rf"SignalException: Process {PID} got signal: 15$",
        },
        sigterm_b_after="step 2 ",
    ),
    Case(
        "rendezvous_timeout",
        "ok",
        {
            "kind": "RENDEZVOUS",
            "rank": 0,
            "exit_code": None,
            "signal": None,
            "line_re": r"^torch\.distributed\.elastic\.rendezvous\.api\.RendezvousTimeoutError",
        },
        started=1,
        join_timeout=5,
    ),
    Case(
        "nccl",
        "nccl",
        {
            "kind": "NCCL",
            "rank": 1,
            "exit_code": 1,
            "signal": None,
            "line_re": r"^torch\.distributed\.DistBackendError: NCCL error in: .*unhandled system error",
        },
        record=True,
    ),
    Case(
        "store_host_first",
        "store_host_first",
        {
            "kind": "SCRIPT_ERROR",
            "rank": "node-a",
            "exit_code": 1,
            "signal": None,
            "line": "ValueError: learning rate must be positive, got -0.1",
        },
        env={"REC_FAIL_RANK": "none"},
        env_a={"REC_FAIL_NODE": "1"},
    ),
    Case(
        "store_host_mid_run",
        "store_host_mid_run",
        {
            "kind": "SCRIPT_ERROR",
            "rank": "node-a",
            "exit_code": 1,
            "signal": None,
            "line": "ValueError: learning rate must be positive, got -0.1",
        },
        env={"REC_FAIL_RANK": "none"},
        env_a={"REC_FAIL_NODE": "1"},
    ),
    Case("success", "ok", None),
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_argv(torchrun: str, case: Case, port: int) -> list[str]:
    return [
        torchrun,
        f"--nnodes={case.nnodes}",
        f"--nproc-per-node={case.nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id=rec-{case.name}",
        f"--rdzv-conf=join_timeout={case.join_timeout}",
        "--local-addr=127.0.0.1",
        "--max-restarts=0",
        "worker.py",
        case.mode,
    ]


def wait_for_text(path: Path, text: str, proc: subprocess.Popen, deadline: float) -> None:
    while time.monotonic() < deadline and proc.poll() is None:
        if text in path.read_text(errors="replace"):
            return
        time.sleep(0.1)
    raise RuntimeError(f"{path.name} never printed {text!r}")


def run_case(case: Case, torchrun: str, version: str) -> dict:
    """Run one case for real and return its case.json (logs and error files are written next to it)."""
    out = HERE / case.name
    tmp = Path(tempfile.mkdtemp(prefix=f"ugro-rec-{case.name}-"))
    port = free_port()
    procs: list[tuple[str, subprocess.Popen, Path, Path]] = []
    try:
        for i in range(case.started):
            node = NODE_NAMES[i]
            log, err = tmp / f"{node}.log", tmp / f"{node}.error.json"
            env = dict(os.environ, TORCHELASTIC_ERROR_FILE=str(err), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
            env["REC_RECORD"] = "1" if case.record else "0"
            env.update(case.env)
            if i == 0:
                env.update(case.env_a)
            with open(log, "wb") as fh:
                proc = subprocess.Popen(
                    torchrun_argv(torchrun, case, port),
                    cwd=SCRIPTS,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # so a stuck case can be stopped with all its workers
                )
            procs.append((node, proc, log, err))
            if i == 0 and case.started > 1:
                time.sleep(1.5)  # the first one binds the store port and hosts it
        deadline = time.monotonic() + WAIT_S
        if case.sigterm_b_after:
            _, proc_b, log_b, _ = procs[1]
            wait_for_text(log_b, case.sigterm_b_after, proc_b, deadline)
            proc_b.send_signal(signal.SIGTERM)
        for _, proc, _, _ in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        ranks = []
        for i, (node, proc, log, err) in enumerate(procs):
            text = log.read_bytes()
            shown = re.search(rb"^GROUP_RANK=(\d+)", text, re.MULTILINE)
            rc = proc.returncode
            ranks.append(
                {
                    "index": int(shown.group(1)) if shown else i,
                    "node": node,
                    "state": "exited",
                    "torchrun_rc": rc if rc >= 0 else None,
                    "signal": -rc if rc < 0 else None,
                    "log": log.name,
                    "error_file": err.name if err.exists() else None,
                    "lost_reason": None,
                }
            )
        expected = dict(case.expected) if case.expected else None
        if expected and isinstance(expected["rank"], str):  # named by node: its rank is known only now
            expected["rank"] = next(r["index"] for r in ranks if r["node"] == expected["rank"])
        if expected:
            expected["node"] = next(r["node"] for r in ranks if r["index"] == expected["rank"])
        if out.exists():
            shutil.rmtree(out)
        out.mkdir()
        for _, _, log, err in procs:
            shutil.copy(log, out / log.name)
            if err.exists():
                shutil.copy(err, out / err.name)
        doc = {
            "case": case.name,
            "recorded_with": f"torchrun (torch {version}), gloo on CPU, 127.0.0.1",
            "argv": [a.replace(f":{port}", ":PORT") for a in torchrun_argv("torchrun", case, port)],
            "ranks": sorted(ranks, key=lambda r: r["index"]),
            "expected": expected,
        }
        (out / "case.json").write_text(json.dumps(doc, indent=2) + "\n")
        return doc
    finally:
        for _, proc, _, _ in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def torch_version(torchrun: str) -> str:
    python = Path(torchrun).with_name("python")
    done = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help="case names (default: all)")
    default_env = os.environ.get("UGRO_NODE_ENV", str(REPO / ".venv-node"))
    parser.add_argument("--torchrun", default=str(Path(default_env) / "bin" / "torchrun"))
    args = parser.parse_args()
    known = {c.name: c for c in CASES}
    unknown = [n for n in args.cases if n not in known]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(known)}")
    version = torch_version(args.torchrun)
    for name in args.cases or list(known):
        doc = run_case(known[name], args.torchrun, version)
        rcs = ", ".join(f"{r['node']}=rank {r['index']} rc {r['torchrun_rc']} sig {r['signal']}" for r in doc["ranks"])
        sys.stdout.write(f"{name}: {rcs}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
