"""Links between loopback nodes made slow, and addresses of their own for the nodes' collectives, for the e2e tests
that measure the network (tests/test_network_e2e.py, tests/test_scale_probe_links_e2e.py).

- `shaped(addresses, rate)`: every packet from or to those addresses on lo limited to `rate`, one htb class per
  address (each node its own link, as on a home switch): this kernel has no netem; htb with u32 filters on the
  addresses works. Tests that shape take a lock first (xdist runs them in parallel processes): lo has one root
  qdisc, and one test's clean-up would take another's classes with it.
- `labelled(addresses)`: each address on lo under a label of its own (`lo:5u2` for 127.77.5.2), the name gloo and
  NCCL find it by (getifaddrs), so that a rank told GLOO_SOCKET_IFNAME=lo:5u2 binds that address and not lo's
  127.0.0.1: on one machine every node's traffic would otherwise go to and from 127.0.0.1, which no filter tells
  apart.
"""

from __future__ import annotations

import fcntl
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

LOCK = "/tmp/ugro-tests-lo-shaping.lock"
HANDLE = "4e4:"
PRIO = "44"


def tc(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["tc", *args], capture_output=True, text=True, check=check, timeout=10)


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=10)


@contextmanager
def exclusive() -> Iterator[None]:
    """The one test (of all xdist workers) that changes lo's qdisc now."""
    with open(LOCK, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextmanager
def shaped(addresses: list[str], rate: str) -> Iterator[None]:
    """Each address's packets on lo (from it or to it) limited to `rate`: a class and two filters per address, under
    lo's htb root (made here when lo has none, else the existing one's); only those removed at the end."""
    with exclusive():
        root = tc("qdisc", "show", "dev", "lo").stdout.split("\n")[0].split()
        ours = not root or root[1] == "noqueue"
        if not ours and (root[1] != "htb" or root[root.index("default") + 1] not in ("0", "0x0")):
            # another's qdisc that shapes what it does not classify would slow the unshaped traffic too
            pytest.fail(f"lo's root qdisc is {' '.join(root)}: another process shapes lo; run this test alone")
        handle = HANDLE if ours else root[2]
        classes = [f"{handle}{0x4E4 + i:x}" for i in range(len(addresses))]
        if ours:
            tc("qdisc", "add", "dev", "lo", "root", "handle", handle, "htb")
        try:
            for address, cls in zip(addresses, classes, strict=True):
                tc("class", "add", "dev", "lo", "parent", handle, "classid", cls, "htb", "rate", rate, "ceil", rate,
                   "burst", "32k", "cburst", "32k")  # fmt: skip
                for way in ("src", "dst"):
                    tc("filter", "add", "dev", "lo", "parent", handle, "protocol", "ip", "prio", PRIO, "u32",
                       "match", "ip", way, f"{address}/32", "flowid", cls)  # fmt: skip
            yield
        finally:
            if ours:
                tc("qdisc", "del", "dev", "lo", "root", "handle", handle, check=False)
            else:
                tc("filter", "del", "dev", "lo", "parent", handle, "prio", PRIO, check=False)
                for cls in classes:
                    tc("class", "del", "dev", "lo", "classid", cls, check=False)


def label(address: str) -> str:
    """127.77.12.2 -> lo:12u2 (at most 15 characters, unique per address within 127.77.0.0/16)."""
    _, _, third, fourth = address.split(".")
    return f"lo:{third}u{fourth}"


@contextmanager
def labelled(addresses: list[str]) -> Iterator[dict[str, str]]:
    """Each address added to lo as a /32 under a label of its own ({address: label}); removed at the end."""
    added = []
    try:
        for address in addresses:
            ip("addr", "del", f"{address}/32", "dev", "lo", check=False)  # left by a run that was killed
            ip("addr", "add", f"{address}/32", "dev", "lo", "label", label(address))
            added.append(address)
        yield {a: label(a) for a in addresses}
    finally:
        for address in added:
            ip("addr", "del", f"{address}/32", "dev", "lo", check=False)
