from __future__ import annotations

import json

from django.core.management.base import BaseCommand, CommandError

from cluster import monitor
from cluster.models import Node


def node_line(node: Node, width: int) -> list[str]:
    """`✓ gpu-master   RTX 5070 Ti (12GB) - Ready`, or ✗ with the status and failing checks under it."""
    ok = node.status == Node.Status.HEALTHY
    head = f"{'✓' if ok else '✗'} {node.name:<{width}} {node.gpu_label}"
    if ok:
        lines = [f"{head} - Ready (score {node.health_score})"]
    else:
        lines = [f"{head} - {node.status.upper()}: {node.status_reason or 'no reading'}"]
    for check in node.health_checks or []:
        lines.append(f"    {check['severity']}: {check['detail']}")
    if node.host_key:
        lines.append(f"    host key {node.host_key_fingerprint} ({node.host_key_source})")
    return lines


class Command(BaseCommand):
    help = "Probe every enabled node now and show its health. Exit code 1 if any node is not healthy."

    def add_arguments(self, parser):
        parser.add_argument("--json", action="store_true", dest="as_json", help="Machine-readable output.")

    def handle(self, as_json=False, **options):
        monitor.poll_once(force=True)
        nodes = list(Node.objects.filter(enabled=True))
        if as_json:
            self.stdout.write(_as_json(nodes))
        else:
            width = max((len(n.name) for n in nodes), default=0) + 8
            for node in nodes:
                for line in node_line(node, width):
                    self.stdout.write(line)
        bad = [n.name for n in nodes if n.status != Node.Status.HEALTHY]
        if bad:
            raise CommandError(f"not healthy: {', '.join(bad)}")


def _as_json(nodes: list[Node]) -> str:
    return json.dumps(
        {
            "nodes": [
                {
                    "node": n.name,
                    "address": n.address,
                    "gpu": n.gpu_label,
                    "status": n.status,
                    "score": n.health_score,
                    "reason": n.status_reason,
                    "checks": n.health_checks,
                    "host_key": n.host_key_fingerprint or None,
                    "last_seen": n.last_seen.isoformat() if n.last_seen else None,
                }
                for n in nodes
            ]
        },
        indent=2,
    )
