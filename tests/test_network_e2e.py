"""`ugro netcheck` on real sshd nodes: the measurement run by each node's own torch (gloo) sees the one link that is
slow (htb with a u32 filter on node1's loopback address: this kernel has no netem), and an interface the others
cannot reach (iptables refuses connections to it) is refused naming both addresses before anything is measured."""

from __future__ import annotations

import io
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from django.core.management import CommandError, call_command

from cluster.models import Node
from jobs.models import NetCheck

from .links import shaped

pytestmark = [pytest.mark.e2e, pytest.mark.no_test_worker]

RATE = "100mbit"  # 12.5 MB/s: a home network's rate, far under loopback's
SLOW_BPS = 20e6  # what a pair through the shaped link may show at most (htb lets a burst through)


@contextmanager
def unreachable(address: str) -> Iterator[None]:
    """New TCP connections to `address` from this machine refused (a reset), as a docker bridge or a VPN address of
    another machine would be; only this rule, by its comment, removed at the end."""
    rule = ["INPUT", "-i", "lo", "-d", address, "-p", "tcp", "--syn", "-m", "comment", "--comment",
            f"ugro-netcheck-test-{os.getpid()}", "-j", "REJECT", "--reject-with", "tcp-reset"]  # fmt: skip
    subprocess.run(["iptables", "-w", "-I", *rule], check=True, capture_output=True, timeout=10)
    try:
        yield
    finally:
        subprocess.run(["iptables", "-w", "-D", *rule], check=False, capture_output=True, timeout=10)


def other_interface() -> tuple[str, str]:
    """This machine's first interface but lo that has an IPv4 address, and that address."""
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        parts = line.split()
        if parts[1] != "lo":
            return parts[1], parts[3].split("/")[0]
    pytest.fail("no interface but lo has an IPv4 address here")


def test_netcheck_sees_the_slow_link_and_refuses_an_unreachable_interface(lab):
    """Covers: `netcheck` on three real nodes: the nodes' own torch (gloo) measures each pair and the group through
    a link shaped with tc, and an interface the others cannot reach is refused naming both addresses."""
    # given node3's env names an interface whose address the other nodes cannot connect to
    dev, address = other_interface()
    Node.objects.filter(name="node3").update(env={"GLOO_SOCKET_IFNAME": dev})
    with unreachable(address), pytest.raises(CommandError, match="netcheck refused on 3 node"):
        out = io.StringIO()
        call_command("netcheck", "--sizes", "1", stdout=out)
    # then one line names node3's address and those it was not reached from, and nothing was measured
    line = next(x for x in out.getvalue().splitlines() if x.startswith("node3:"))
    assert line.startswith(f"node3: its interface {dev} (GLOO_SOCKET_IFNAME in its env) at {address} cannot be "
                           "reached from node1 (127.0.0.2): ")  # fmt: skip
    assert "node2 (127.0.0.3): " in line and not NetCheck.objects.exists()

    # given node3 back on its route's interface, and every packet to or from node1 at a home network's rate (node1:
    # gloo's other side connects to it, and on one machine a connection leaves from 127.0.0.1, not the node's address)
    Node.objects.filter(name="node3").update(env={})
    out = io.StringIO()
    with shaped([lab.nodes[0].address], RATE):
        call_command("netcheck", "--nodes", "node1,node2,node3", "--sizes", "1", stdout=out)
    row = NetCheck.objects.get()
    # then each node used lo at its own address, and the two pairs through node1 are the slow ones
    assert {n: i["address"] for n, i in row.interfaces.items()} == {"node1": "127.0.0.2", "node2": "127.0.0.3",
                                                                     "node3": "127.0.0.4"}  # fmt: skip
    busbw = {(p["a"], p["b"]): p["sizes"][0]["busbw"] for p in row.pairs}
    assert set(busbw) == {("node1", "node2"), ("node1", "node3"), ("node2", "node3")}
    fast = busbw[("node2", "node3")]
    assert busbw[("node1", "node2")] < min(SLOW_BPS, fast / 2) and busbw[("node1", "node3")] < min(SLOW_BPS, fast / 2)
    assert row.group["sizes"][0]["busbw"] < SLOW_BPS and row.group["latency_us"] > 0  # the group waits for node1
    assert "node1 <-> node3: " in out.getvalue() and "group of 3 (gloo)" in out.getvalue()
