from __future__ import annotations

from cluster.models import Node
from jobs.envs import report

from .node_disk import NodeReportCommand


class Command(NodeReportCommand):
    help = (
        "A node's Python environments (--packages, docs/envs.md): each with its size, last use and the queued or "
        "running jobs that name it; unused ones are removed after paths.env_ttl."
    )
    failed = "did not list its environments"

    def report(self, node: Node) -> dict:
        return report(node)
