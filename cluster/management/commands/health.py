from __future__ import annotations

import json

from django.core.management.base import CommandError

from accounts.commands import UserCommand
from cluster import monitor
from cluster.health import BREAKER_TRIP_AFTER, Breaker
from cluster.models import Node
from ugro_site.celery import NO_SCHEDULER, scheduler_alive


def node_line(node: Node, width: int, failed: str | None = None) -> list[str]:
    """`✓ gpu-master   1× NVIDIA GeForce RTX 5070 Ti 12 GB - Ready (score 97)`, or ✗ with the status and the
    failing checks under it.

    `failed` is this poll's error when the node did not answer it but is not DOWN yet (the breaker
    waits for 3 failures in a row): the line says so instead of showing the last good reading.
    """
    ok = node.status == Node.Status.HEALTHY and failed is None
    resting = node.status in Node.RESTING and failed is None
    head = f"{'✓' if ok else '○' if resting else '✗'} {node.name:<{width}} {node.gpu_label}"
    if ok:
        lines = [f"{head} - Ready (score {node.health_score})"]
    elif resting:  # put to sleep by its power: block (cluster/power.py): woken when the queue needs it
        lines = [f"{head} - {node.status.upper()}: {node.status_reason or 'woken when a job needs it'}"]
    elif failed is not None:
        so_far = Breaker.from_dict(node.breaker).failures
        lines = [f"{head} - UNREACHABLE: {failed} ({so_far} of {BREAKER_TRIP_AFTER} failed probes before DOWN)"]
    else:
        lines = [f"{head} - {node.status.upper()}: {node.status_reason or 'no reading'}"]
    if failed is None:
        for check in node.health_checks or []:
            lines.append(f"    {check['severity']}: {check['detail']}")
    if node.host_key:
        lines.append(f"    host key {node.host_key_fingerprint} ({node.host_key_source})")
    if shared := node.shares_workdir_with():
        lines.append(f"    working directory shared with {', '.join(shared)}")
    return lines


class Command(UserCommand):
    help = (
        "Probe every enabled node now and show its health. Exit code 1 if any node is not healthy "
        "(one asleep or waking by its power: block is not a failure)."
    )

    def add_arguments(self, parser):
        parser.add_argument("--json", action="store_true", dest="as_json", help="Machine-readable output.")

    def handle(self, as_json=False, **options):
        outcomes = monitor.poll_once(force=True)
        # Not answering this poll, yet not DOWN (it answered before): say so rather than show old readings.
        failed = {o.node: o.reason for o in outcomes if not o.ok and o.status != Node.Status.DOWN}
        nodes = list(Node.objects.filter(enabled=True).prefetch_related("gpus"))
        if as_json:
            self.stdout.write(_as_json(nodes, failed))
        else:
            width = max((len(n.name) for n in nodes), default=0) + 8
            for node in nodes:
                for line in node_line(node, width, failed.get(node.name)):
                    self.stdout.write(line)
        bad = [n.name for n in nodes if n.status not in (Node.Status.HEALTHY, *Node.RESTING) or n.name in failed]
        if not as_json and not scheduler_alive():
            self.stdout.write(f"✗ {NO_SCHEDULER}")
        if bad:
            raise CommandError(f"not healthy: {', '.join(bad)}")


def _as_json(nodes: list[Node], failed: dict[str, str]) -> str:
    return json.dumps(
        {
            "nodes": [
                {
                    "node": n.name,
                    "address": n.address,
                    "gpu": n.gpu_label,
                    "status": n.status,
                    "reachable": n.status != Node.Status.DOWN and n.name not in failed,
                    "score": n.health_score,
                    "reason": failed.get(n.name) or n.status_reason,
                    "checks": n.health_checks,
                    "host_key": n.host_key_fingerprint or None,
                    "workdir_shared_with": n.shares_workdir_with(),
                    "last_seen": n.last_seen.isoformat() if n.last_seen else None,
                }
                for n in nodes
            ]
        },
        indent=2,
    )
