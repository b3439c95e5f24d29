"""Pinned SSH host keys: trust on first use (or known_hosts), refuse a changed key, `trust` a new one.

cluster/links.py checks every connection against the key pinned here before it authenticates; this
module is its database side: it records a node's first key and replaces it when an operator says so.
"""

from __future__ import annotations

import logging

from django.db import transaction
from django.utils import timezone

from .links import Endpoint, fetch_host_key, fingerprint
from .models import Node

log = logging.getLogger(__name__)


def record_first_key(ep: Endpoint, key: str, source: str) -> str:
    """Pin `key` for the node behind `ep` if none is pinned; return the key pinned afterwards.

    A conditional UPDATE: of two processes meeting the node for the first time, one pins and the
    other is told the winner's key (and refuses its link when it saw another).
    """
    now = timezone.now()
    pinned = Node.objects.filter(name=ep.name, host_key="").update(
        host_key=key, host_key_source=source, host_key_pinned_at=now
    )
    current = Node.objects.filter(name=ep.name).values_list("host_key", flat=True).first()
    if pinned:
        log.warning("node %s: host key %s pinned (%s)", ep.name, fingerprint(key), source)
    return current or key


def trust(node: Node, expect_fingerprint: str = "", timeout: float = 10.0) -> tuple[str, str]:
    """Pin the key the node offers now; returns (old fingerprint or '', new fingerprint).

    With `expect_fingerprint` the key is pinned only if it has that fingerprint (compare it with
    `ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub` run on the node itself). Raises ValueError.
    """
    if node.transport != Node.Transport.SSH:
        raise ValueError(f"node {node.name} is reached without SSH ({node.transport}): it has no host key")
    key = fetch_host_key(node.endpoint(), timeout)
    new = fingerprint(key)
    if expect_fingerprint and expect_fingerprint.strip() != new:
        raise ValueError(f"node {node.name} offers {new}, not {expect_fingerprint.strip()}; nothing was changed")
    old = node.host_key_fingerprint
    with transaction.atomic():
        Node.objects.filter(pk=node.pk).update(host_key=key, host_key_source="trust", host_key_pinned_at=timezone.now())
    return old, new
