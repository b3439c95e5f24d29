from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand

from cluster.models import ClusterSettings, Node, detect_torchrun

DEMO_NAME = "local"


def local_gpu_count() -> int:
    """This machine's GPUs: NVML's count (nvidia-ml-py), else the `GPU n:` lines of `nvidia-smi -L`, else 0."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no package, no driver library, a driver mismatch: each means ask nvidia-smi
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        listing = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in listing.splitlines() if line.startswith("GPU "))


def runnable(command: str) -> bool:
    """Whether the command's program exists here: an executable path, or a name found on PATH."""
    try:
        argv = shlex.split(command)
    except ValueError:
        return False
    if not argv:
        return False
    if "/" in argv[0]:
        path = os.path.expanduser(argv[0])
        return os.path.isfile(path) and os.access(path, os.X_OK)
    return shutil.which(argv[0]) is not None


class Command(BaseCommand):
    help = (
        "Add a local demo node (this machine, no SSH) if the cluster has no nodes yet; on later runs, "
        "re-point the demo node's torchrun, python and working dir when they no longer exist (moved venv or repo). "
        "A torchrun it detected itself follows the repo's node env (bin/setup --node-env) at every launch."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--torchrun", default="", help="torchrun of the training env (default: detect, and follow bin/setup)"
        )

    def handle(self, torchrun="", **options):
        repo = Path(settings.BASE_DIR)
        if Node.objects.exists():
            demo = Node.objects.filter(name=DEMO_NAME, transport=Node.Transport.LOCAL).first()
            if demo is not None:
                self._repoint(demo, repo, torchrun)
            self.stdout.write(f"cluster has {Node.objects.count()} node(s); no demo node added")
            return
        auto = "" if torchrun else detect_torchrun(repo)  # one detected here follows bin/setup --node-env
        torchrun = torchrun or auto
        gpus = local_gpu_count()
        Node.objects.create(
            name=DEMO_NAME, hostname="localhost", address="127.0.0.1", transport=Node.Transport.LOCAL,
            role=Node.Role.MASTER, gpu_count=gpus, torchrun_command=torchrun, torchrun_auto=auto, workdir=str(repo),
            agent_python=shutil.which("python3") or "/usr/bin/python3",
        )  # fmt: skip
        cs = ClusterSettings.load()
        cs.default_script = "train/train_production.py"
        cs.save()
        self.stdout.write(f"added demo node '{DEMO_NAME}' (this machine, {gpus} GPU(s), torchrun: {torchrun})")

    def _repoint(self, node: Node, repo: Path, torchrun: str) -> None:
        """Paths fixed when the demo node was made go stale when the venv or the repo moves: find them again.

        Only what no longer exists is changed; a command the user set that still runs is kept. One this command
        detected itself (torchrun_auto) is detected again, and one it finds now is its own choice from then on.
        """
        changes: dict[str, tuple[str, str]] = {}
        if torchrun or node.follows_setup or not runnable(node.torchrun_command):
            found = torchrun or detect_torchrun(repo)
            # given: the user's, kept from then on; detected: this command's choice, which launches follow
            auto = "" if torchrun else found
            if (runnable(found) or node.follows_setup) and found != node.torchrun_command:
                changes["torchrun_command"] = (node.torchrun_command, found)
            if (runnable(found) or node.follows_setup) and auto != node.torchrun_auto:
                changes["torchrun_auto"] = (node.torchrun_auto, auto)
            if not runnable(found):
                self.stderr.write(
                    f"demo node '{node.name}': torchrun {node.torchrun_command!r} is not there and none was found "
                    "(run bin/setup --node-env, or set the node's torchrun in admin)"
                )
        if not os.path.isdir(os.path.expanduser(node.workdir)):
            changes["workdir"] = (node.workdir, str(repo))
        if not runnable(shlex.quote(node.agent_python)):
            python = shutil.which("python3")
            if python:
                changes["agent_python"] = (node.agent_python, python)
        if not changes:
            return
        for field, (_, new) in changes.items():
            setattr(node, field, new)
        node.save(update_fields=list(changes))
        for field, (old, new) in changes.items():
            if field != "torchrun_auto":  # bookkeeping, not the user's to read
                self.stdout.write(f"demo node '{node.name}': {field} {old} -> {new}")
