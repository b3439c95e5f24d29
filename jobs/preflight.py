"""Checks run on every chosen node before any rank starts. Each problem is one line naming its node.

Per node, concurrently: reachable, its python (the agent's) present; working directory, script and torchrun
(the first word of the node's torchrun command, found as a rank's start finds it) present; declared GPUs
visible and with enough free memory; disk free over DISK_FREE_GB; torch and CUDA versions of the node's
training env (read with the python next to its torchrun). What a node lacks in its set-up (its python,
torchrun, working directory, a torch that imports) is said with the command that fixes it, and a launch
refused for it leaves one alert on the node until a pre-flight passes there. Across nodes:
versions equal (a failure or a note, per VERSION_MISMATCH), NCCL too; the script the
same file on every node (its sha256; a failure unless the job allows a mismatch); the rendezvous
address not loopback when a node is on another host; the rendezvous port free on rank 0's node
and reachable from every other node over a real TCP connection (rank 0 listens, the others
connect), after which the port is free again for torchrun.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import os
import posixpath
import shlex
import time
from dataclasses import dataclass, field

from cluster.alerts import open_alert, resolve
from cluster.fanout import node_request, on_each
from cluster.links import AgentRequestError, LinkError
from cluster.models import Alert, Node
from cluster.versions import VERSION_CODE
from ugro_client.manifest import git_info

from .models import Job, JobCode, Rank

log = logging.getLogger(__name__)

VERSION_TIMEOUT_S = 35.0
LISTEN_S = 5.0
CONNECT_TIMEOUT_S = 3.0
PORT_RELEASE_S = 3.0
GPU_FREE_MB = 1024.0  # free memory a GPU needs to be used: less is another process's, and CUDA's context takes ~500 MB
DISK_FREE_GB = 2.0  # free disk a node needs: room for the logs and a checkpoint or two of a small model
# "fail": torch, CUDA or NCCL versions that differ between nodes fail the launch (a collective between them
# can hang or crash); "warn": a note only
VERSION_MISMATCH = "fail"
SETUP_ALERT = "preflight"  # the key of a node's alert for a launch refused by what its set-up lacks
# What a shell or Python says when the program it was asked to start is not there (or cannot be run), lower-cased:
# zsh writes "no such file or directory", bash and Python "No such file or directory", dash "not found"
NOT_THERE = ("no such file or directory", "not found", "permission denied")


@dataclass
class PreflightReport:
    """Problems stop the launch; notes are said but do not."""

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # node -> the problems that are its set-up's (also in problems); a node checked is here, [] when sound
    setup: dict[str, list[str]] = field(default_factory=dict)
    versions: dict[str, dict] = field(default_factory=dict)  # node -> python, torch, cuda, nccl, script...
    packages: dict[str, list[str]] = field(default_factory=dict)  # node -> name==version, sorted

    @property
    def ok(self) -> bool:
        return not self.problems


def script_path(node: Node, script: str, base: str = "") -> str:
    """The script's path on a node: as given when absolute, else under base (where the job's ranks start:
    its synced copy or the workdir), by default the node's working directory."""
    if os.path.isabs(script) or script.startswith("~"):
        return script
    return f"{(base or node.workdir).rstrip('/')}/{script}"


def env_python(node: Node) -> str | None:
    """The python of the node's training env: next to torchrun when the command is a path to it."""
    argv = node.torchrun_argv
    if len(argv) == 1 and argv[0].endswith("/torchrun"):
        return argv[0][: -len("torchrun")] + "python"
    return None


def torchrun_fix(node: Node) -> str:
    """How to give a node the torchrun it lacks."""
    if node.follows_setup:  # the demo node: UGRO picks up the env bin/setup makes at the next launch
        return "run bin/setup --node-env (it makes .venv-node, the training env this node then uses)"
    return (f"set its Torchrun command in admin > Nodes or nodes.{node.name}.torchrun in cluster.yaml "
            "(then `ugro import_cluster`), or install torch in its env")  # fmt: skip


def python_missing(node: Node, err: Exception) -> str | None:
    """The refusal line when a node could not be reached only because its python (node.python, which runs UGRO's
    agent there) does not exist or cannot run; None for any other failure."""
    text = str(err)
    if node.agent_python not in text or not any(sign in text.lower() for sign in NOT_THERE):
        return None
    return (f"{node.name}: its python {node.agent_python} (UGRO's agent runs with it) is not there; set its Agent "
            f"python in admin > Nodes or nodes.{node.name}.python in cluster.yaml (then `ugro import_cluster`) "
            "to any python >= 3.8 on it")  # fmt: skip


def _is_loopback(host: str) -> bool:
    if host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _node_checks(
    node: Node, script: str, held: list[int] | None = None, base: str = ""
) -> tuple[list[str], list[str], dict | None, list[str]]:
    """(problems, notes, versions, setup) for one node; link errors propagate to on_each. versions also holds
    the script's sha256, the GPU model and driver, and the env's packages; setup: the problems that are the
    node's set-up's (also in problems).

    held: the GPUs the job will use there (only those must have free memory: another job may be using
    the node's other GPUs); None: all of them. base: where the job's ranks start there (jobs.sync.start_dir)."""
    problems: list[str] = []
    notes: list[str] = []
    setup: list[str] = []
    node.reach()  # a silent node fails here within the connect timeout, as in the health poll
    path = script_path(node, script, base)
    argv = node.torchrun_argv
    # torchrun's first word asked with the same request, and found with the rank's own PATH (node.env)
    answer = node_request(node, "stat", timeout=10, paths=[node.workdir, path], programs=argv[:1], env=node.env)
    found = answer["exists"]
    program = (answer.get("programs") or {}).get(argv[0]) or {}
    if program.get("error"):
        what = program["error"]
        if len(argv) > 1:
            what += f" (the first word of its torchrun command {shlex.join(argv)!r})"
        setup.append(f"{node.name}: cannot start torchrun: {what}; {torchrun_fix(node)}")
    script_sha = None
    if not found.get(node.workdir):
        setup.append(f"{node.name}: working directory {node.workdir} does not exist")
    elif not found.get(path):
        problems.append(f"{node.name}: script {path} not found")
    else:
        listed = node_request(node, "files", timeout=10, path=path)["files"]
        script_sha = listed[0]["sha256"] if len(listed) == 1 else None

    sample = node_request(node, "probe", timeout=30, gpu_reader=node.gpu_reader or "auto", workdir=node.workdir)
    gpus = [g for g in sample.get("gpus") or [] if isinstance(g, dict)]
    if node.gpu_count and len(gpus) < node.gpu_count:
        why = sample.get("gpu_error") or f"reader: {sample.get('gpu_source')}"
        problems.append(f"{node.name}: {len(gpus)} of {node.gpu_count} declared GPUs visible ({why})")
    need_mb = GPU_FREE_MB
    for pos, gpu in enumerate(gpus[: node.gpu_count or 0]):
        if held is not None and gpu.get("index", pos) not in held:
            continue
        used, total = gpu.get("mem_used_mb"), gpu.get("mem_total_mb")
        if isinstance(used, (int, float)) and isinstance(total, (int, float)) and total - used < need_mb:
            problems.append(
                f"{node.name}: GPU {gpu.get('index')} has {total - used:g} MB free (needs {need_mb:g} MB); "
                "is another process using it?"
            )
    need_gb = DISK_FREE_GB
    free_gb = sample.get("disk_free_gb")
    if isinstance(free_gb, (int, float)) and free_gb < need_gb:
        problems.append(f"{node.name}: {free_gb:g} GB free under {node.workdir} (needs {need_gb:g} GB)")

    versions: dict | None = None
    python = env_python(node)
    if program.get("error"):
        pass  # no torchrun, no env to read: the line above says what to do
    elif python is None:
        why = f"{node.torchrun_now!r} is not a path to torchrun"
        notes.append(f"{node.name}: torch/CUDA versions not checked ({why})")
    else:
        # The agent's exec bounds the command by its own 30 s timeout; the link waits a little longer.
        out = node_request(node, "env_report", timeout=VERSION_TIMEOUT_S, python=python, code=VERSION_CODE)
        try:
            versions = json.loads(out["stdout"].strip().splitlines()[-1])
        except (ValueError, IndexError):
            detail = (out["stderr"].strip().splitlines() or ["no output"])[-1]
            setup.append(f"{node.name}: cannot run {python} (exit {out['rc']}): {detail}; {torchrun_fix(node)}")
            versions = None
        if versions and "error" in versions:
            setup.append(f"{node.name}: torch does not import with {python}: {versions['error']}; {torchrun_fix(node)}")
            versions = {k: v for k, v in versions.items() if k != "error"}
    named = next((g for g in gpus if g.get("name")), {})
    versions = {**(versions or {}), "script_sha256": script_sha, "gpu": named.get("name"),
                "gpus": len(gpus), "driver": named.get("driver")}  # fmt: skip
    return setup + problems, notes, versions, setup


def _rendezvous_checks(nodes: list[Node], host: str, port: int) -> list[str]:
    """Port free on rank 0's node, then a real connection to it from every other node."""
    master = nodes[0]
    free = node_request(master, "port_free", timeout=10, address=master.address, port=port)
    if not free["free"]:
        return [
            f"{master.name}: rendezvous port {port} is in use on {master.address} ({free['error']}); "
            f"choose another with cluster.master_port in cluster.yaml (then `ugro import_cluster`) "
            f"or Rendezvous port in admin > Cluster settings"
        ]
    workers = nodes[1:]
    if not workers:
        return []
    node_request(master, "listen", timeout=10, address=master.address, port=port, seconds=LISTEN_S,
                 expect=len(workers))  # fmt: skip

    def connect(node: Node) -> dict:
        # `timeout` is the link's wait; the connect attempt itself is bounded by the agent (3 s).
        return node_request(node, "port_check", timeout=CONNECT_TIMEOUT_S + 5, host=host, port=port)

    problems = []
    for node, result, err in on_each(workers, connect):
        if err is not None:
            problems.append(f"{node.name}: {err}")
        elif not result["ok"]:
            problems.append(f"{node.name}: cannot reach the rendezvous at {host}:{port} ({result['error']})")
    if problems:
        return problems
    # The listener closes once every worker connected; torchrun binds the port right after us.
    deadline = time.monotonic() + PORT_RELEASE_S
    while not node_request(master, "port_free", timeout=10, address=master.address, port=port)["free"]:
        if time.monotonic() > deadline:
            return [f"{master.name}: rendezvous port {port} still busy after the reachability check"]
        time.sleep(0.05)
    return []


def check_nodes(
    nodes: list[Node], script: str, rdzv_host: str, rdzv_port: int, held: dict[int, list[int]] | None = None,
    base: dict[int, str] | None = None, allow_mismatch: bool = False,
) -> PreflightReport:
    """Every pre-flight check for a job on `nodes` (rank 0 first) with this script and rendezvous; held:
    node id -> the GPUs the job holds there (None: every GPU of each node); base: node id -> where the
    job's ranks start there; allow_mismatch: a script that differs between nodes is a note, not a problem."""
    report = PreflightReport()
    reachable = []
    held, base = held or {}, base or {}
    for node in nodes:
        follow_setup(node)
    for node, result, err in on_each(nodes, lambda n: _node_checks(n, script, held.get(n.pk), base.get(n.pk, ""))):
        if err is not None:
            missing = python_missing(node, err)
            if missing:
                report.setup[node.name] = [missing]
            why = str(err).removeprefix(f"node {node.name}: ")  # the link's own "node X: ..." lines
            report.problems.append(missing or f"{node.name}: {why}")
            continue
        reachable.append(node)
        problems, notes, versions, setup = result
        report.setup[node.name] = setup
        report.problems.extend(problems)
        report.notes.extend(notes)
        if versions is not None:
            report.packages[node.name] = versions.pop("packages", None) or []
            report.versions[node.name] = versions

    scripts = {name: v["script_sha256"] for name, v in report.versions.items() if v.get("script_sha256")}
    if len(set(scripts.values())) > 1:
        each = ", ".join(f"{name} sha256 {sha[:12]}" for name, sha in scripts.items())
        line = f"script {script} differs between nodes: {each}"
        if allow_mismatch:
            report.notes.append(line + " (started anyway: --allow-mismatch)")
        else:
            report.problems.append(line + "; sync it (launch --sync DIR) or pass --allow-mismatch")
    checked = {name: v for name, v in report.versions.items() if "torch" in v}
    distinct = {(v.get("torch"), v.get("cuda"), v.get("nccl")) for v in checked.values()}
    if len(distinct) > 1:
        each = ", ".join(
            f"{name} torch {v.get('torch')} CUDA {v.get('cuda') or 'none'} NCCL {v.get('nccl') or 'none'}"
            for name, v in checked.items()
        )
        line = f"torch/CUDA/NCCL versions differ between nodes: {each}"
        if VERSION_MISMATCH == "warn":
            report.notes.append(line)
        else:
            report.problems.append(line)

    if _is_loopback(rdzv_host):
        remote = [n for n in nodes if not _is_loopback(n.address)]
        if remote:
            report.problems.append(
                f"{remote[0].name}: rendezvous address {rdzv_host} is loopback but {remote[0].name} "
                f"({remote[0].address}) is another host; set the master address to one the nodes can reach"
            )
    if len(reachable) == len(nodes) and nodes:
        try:
            report.problems.extend(_rendezvous_checks(nodes, rdzv_host, rdzv_port))
        except (LinkError, AgentRequestError) as exc:
            report.problems.append(f"{nodes[0].name}: rendezvous check failed: {exc}")
    return report


def named_nodes(names: list[str]) -> list[Node]:
    """The named nodes (default: every enabled one), rank 0 first as at launch (a master when there is one);
    ValueError in one line for an unknown name."""
    chosen = list(Node.objects.filter(enabled=True))
    if names:
        by_name = {n.name: n for n in Node.objects.filter(name__in=names)}
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise ValueError(f"unknown node(s): {', '.join(unknown)[:200]}")
        chosen = [by_name[n] for n in dict.fromkeys(names)]
    return sorted(chosen, key=Node.placement_key)


def follow_setup(node: Node) -> None:
    """Keep the torchrun a node follows (Node.follows_setup: the demo node's) as the one it runs now, so that
    pages and cluster.yaml exports show it after `bin/setup --node-env`; a launch runs it either way."""
    now = node.torchrun_now
    if now == node.torchrun_command:
        return
    old = node.torchrun_command
    Node.objects.filter(pk=node.pk, torchrun_command=old, torchrun_auto=old).update(
        torchrun_command=now, torchrun_auto=now
    )
    node.torchrun_command = node.torchrun_auto = now
    log.info("node %s: torchrun %s -> %s (it follows bin/setup --node-env)", node.name, old, now)


def tell_setup(job: Job, nodes: list[Node], setup: dict[str, list[str]]) -> None:
    """A node whose set-up refused the job keeps one alert saying what it lacks and the fix (a second refusal
    updates it); a node checked sound resolves it. A node not checked (unreachable) keeps what it has."""
    for node in nodes:
        lines = setup.get(node.name)
        if lines:
            message = f"job {job.name} was not started: " + "; ".join(lines)
            open_alert(node, SETUP_ALERT, Alert.Severity.WARNING, message)
        elif lines is not None:
            resolve(Alert.objects.filter(node=node, key=SETUP_ALERT, resolved_at__isnull=True))


def refuse_missing_pythons(job: Job, failed: list[tuple[Node, Exception]]) -> list[str]:
    """The refusal lines when every node that could not be reached lacks only its python ([] otherwise: a node
    lost, not one to set up), each then told in the node's alert."""
    lines = {node: python_missing(node, err) for node, err in failed}
    if not lines or not all(lines.values()):
        return []
    tell_setup(job, list(lines), {node.name: [line] for node, line in lines.items() if line})
    return [line for line in lines.values() if line]


def run_preflight(job: Job, ranks: list[Rank], base: dict[int, str] | None = None) -> list[str]:
    """Return the problems found (empty when the job may start); notes go to the log. What each node
    holds (script sha256, versions, packages) is recorded with the job (JobCode), whatever the outcome;
    what a node's set-up lacks is told in its alert (tell_setup)."""
    host, _, port = job.rdzv_endpoint.rpartition(":")
    held = {r.node_id: list(r.gpu_indices) for r in ranks if r.gpu_indices}
    code, _ = JobCode.objects.get_or_create(job=job)
    nodes = [r.node for r in ranks]
    report = check_nodes(nodes, job.script, host, int(port), held, base, code.allow_mismatch)
    for note in report.notes:
        log.warning("job %s pre-flight: %s", job.name, note)
    record(job, code, ranks, report)
    tell_setup(job, nodes, report.setup)
    return report.problems


def record(job: Job, code: JobCode, ranks: list[Rank], report: PreflightReport) -> None:
    """Keep what this attempt's nodes hold with the job: per node the versions, hashes and packages (the
    package list once, its sha256 beside the versions); the script's repository on rank 0's node when the
    job has no synced copy (whose repository was read at launch)."""
    nodes = {}
    for name, versions in report.versions.items():
        packages = report.packages.get(name) or []
        digest = hashlib.sha256("\n".join(packages).encode()).hexdigest() if packages else None
        nodes[name] = {**versions, "packages_sha256": digest, "packages_count": len(packages)}
    code.nodes, code.packages, code.attempt = nodes, dict(report.packages), job.attempt
    fields = ["nodes", "packages", "attempt"]
    if not code.sync_digest and ranks and not report.problems:
        code.git = _git_on(ranks[0].node, script_path(ranks[0].node, job.script))
        fields.append("git")
    code.save(update_fields=fields)


def _git_on(node: Node, script: str) -> dict:
    """The commit, branch and uncommitted diff of the git repository holding the script on a node ({} if
    none, or git is not installed there)."""
    directory = posixpath.dirname(script)

    def git(*args: str) -> str | None:
        try:
            out = node_request(node, "exec", timeout=15, argv=["git", "-C", directory, *args])
        except (LinkError, AgentRequestError):
            return None
        return out["stdout"] if out.get("rc") == 0 else None

    info = git_info(directory, git)
    if info:  # the agent's exec keeps the last 64 KB of what a command prints
        info.update(diff_truncated=info["diff_truncated"] or len(info["diff"]) >= 65536,
                    where=f"{node.name}:{directory}")  # fmt: skip
    return info
