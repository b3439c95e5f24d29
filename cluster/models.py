"""Nodes and cluster-wide settings: what the user declares about their machines."""

from __future__ import annotations

import shlex

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import models

from .links import Endpoint
from .names import validate_safe_name


class ClusterSettings(models.Model):
    """The one row of cluster-wide settings (the `cluster:`/`training:`/`paths:` parts of cluster.yaml)."""

    name = models.CharField(max_length=200, default="UGRO cluster")
    master_address = models.CharField(
        max_length=255, blank=True, help_text="Rendezvous address; blank means the first placed node's address."
    )
    rendezvous_port = models.PositiveIntegerField(default=29500)
    default_script = models.CharField(
        max_length=500,
        default="train/train_production.py",
        help_text="Path of the training script on the nodes, relative to each node's working directory.",
    )
    script_args_template = models.JSONField(
        default=list,
        blank=True,
        help_text=(
            "Arguments for the script; each item may use {model} {dataset} {epochs} {lr} {job}. "
            "Empty means the train_production.py interface."
        ),
    )
    training = models.JSONField(default=dict, blank=True)
    paths = models.JSONField(default=dict, blank=True)

    class Meta:
        verbose_name = verbose_name_plural = "cluster settings"

    def __str__(self) -> str:
        return self.name

    @classmethod
    def load(cls) -> ClusterSettings:
        obj, _ = cls.objects.get_or_create(pk=1)
        return obj


class Node(models.Model):
    """One machine of the cluster, reached over SSH (or run locally), with its GPUs and training env."""

    class Role(models.TextChoices):
        MASTER = "master", "master"
        WORKER = "worker", "worker"

    class Transport(models.TextChoices):
        SSH = "ssh", "SSH"
        LOCAL = "local", "local (this machine, no SSH)"

    class Status(models.TextChoices):
        UNKNOWN = "unknown", "unknown"
        HEALTHY = "healthy", "healthy"
        DEGRADED = "degraded", "degraded"
        DOWN = "down", "down"

    name = models.CharField(max_length=64, unique=True, validators=[validate_safe_name])
    hostname = models.CharField(max_length=255, blank=True)
    address = models.CharField(max_length=255, help_text="IP or DNS name the controller and other nodes use.")
    ssh_port = models.PositiveIntegerField(default=22)
    user = models.CharField(max_length=64, blank=True)
    key_path = models.CharField(max_length=500, blank=True, help_text="Private key; blank uses your SSH agent/keys.")
    transport = models.CharField(max_length=8, choices=Transport.choices, default=Transport.SSH)
    role = models.CharField(max_length=8, choices=Role.choices, default=Role.WORKER)
    order = models.IntegerField(default=0, help_text="Placement order (the YAML's rank); masters come first.")
    gpu_count = models.PositiveIntegerField(default=1)
    gpu_model = models.CharField(max_length=100, blank=True)
    gpu_vram_gb = models.FloatField(default=0)
    torchrun_command = models.CharField(
        max_length=500,
        default="torchrun",
        help_text="Starts torchrun in this node's training env, e.g. /opt/venv/bin/torchrun or "
        "'pixi run -e cuda torchrun'. Split like a shell would, never run through one.",
    )
    agent_python = models.CharField(
        max_length=255, default="/usr/bin/python3", help_text="Any python >= 3.8 on the node, for UGRO's agent."
    )
    workdir = models.CharField(max_length=500, default="~", help_text="Where ranks start; scripts are relative to it.")
    env = models.JSONField(default=dict, blank=True, help_text="Extra environment for ranks on this node.")
    enabled = models.BooleanField(default=True)
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.UNKNOWN)
    status_reason = models.CharField(max_length=500, blank=True)
    last_seen = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["order", "name"]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        try:
            argv = shlex.split(self.torchrun_command)
        except ValueError as exc:
            raise ValidationError({"torchrun_command": f"cannot split: {exc}"}) from None
        if not argv:
            raise ValidationError({"torchrun_command": "must not be empty"})
        if not isinstance(self.env, dict) or not all(isinstance(k, str) for k in self.env):
            raise ValidationError({"env": "must be a mapping of names to values"})

    @property
    def torchrun_argv(self) -> list[str]:
        return shlex.split(self.torchrun_command)

    @property
    def gpu_label(self) -> str:
        if not self.gpu_count:
            return "no GPU"
        vram = f" ({self.gpu_vram_gb:g}GB)" if self.gpu_vram_gb else ""
        count = f"{self.gpu_count}x " if self.gpu_count > 1 else ""
        return f"{count}{self.gpu_model or 'GPU'}{vram}"

    def endpoint(self) -> Endpoint:
        return Endpoint(
            name=self.name,
            address=self.address,
            port=self.ssh_port,
            user=self.user,
            key_path=self.key_path,
            transport=self.transport,
            python=self.agent_python,
        )

    def link(self):
        """The warm link to this node's agent (created on first use)."""
        from .links import pool

        return pool.get(self.endpoint(), settings.UGRO["CONNECT_TIMEOUT_S"])
