from __future__ import annotations

import shutil
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand

from cluster.models import ClusterSettings, Node


class Command(BaseCommand):
    help = "Add a local demo node (this machine, no SSH) if the cluster has no nodes yet."

    def add_arguments(self, parser):
        parser.add_argument("--torchrun", default="", help="torchrun of the training env (default: detect)")

    def handle(self, torchrun="", **options):
        if Node.objects.exists():
            self.stdout.write(f"cluster has {Node.objects.count()} node(s); no demo node added")
            return
        repo = Path(settings.BASE_DIR)
        if not torchrun:
            local_env = repo / ".venv-node" / "bin" / "torchrun"
            torchrun = str(local_env) if local_env.exists() else (shutil.which("torchrun") or "torchrun")
        gpus = 1 if shutil.which("nvidia-smi") else 0
        Node.objects.create(
            name="local", hostname="localhost", address="127.0.0.1", transport=Node.Transport.LOCAL,
            role=Node.Role.MASTER, gpu_count=gpus, torchrun_command=torchrun, workdir=str(repo),
            agent_python=shutil.which("python3") or "/usr/bin/python3",
        )  # fmt: skip
        cs = ClusterSettings.load()
        cs.default_script = "train/train_production.py"
        cs.save()
        self.stdout.write(f"added demo node 'local' (this machine, {gpus} GPU(s), torchrun: {torchrun})")
