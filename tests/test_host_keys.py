"""SSH host keys are pinned: trust on first use, a changed key refused by links, health probes and
pre-flight alike (naming the node and both fingerprints), `trust NODE` accepts the new key, and an
existing known_hosts file is honoured. Real sshd: a small loopback cluster of this test's own, so
the shared session cluster keeps its key."""

from __future__ import annotations

import io
import subprocess

import pytest
from django.core.management import CommandError, call_command

from cluster import monitor
from cluster.fanout import node_request
from cluster.links import HostKeyError, LinkError, pool
from cluster.models import Node
from jobs.preflight import check_nodes

from .loopback import SSH_KEYGEN, LoopbackCluster

pytestmark = pytest.mark.e2e


def ssh_fingerprint(pub: str) -> str:
    """The fingerprint OpenSSH itself prints for a public key file."""
    out = subprocess.run([SSH_KEYGEN, "-lf", pub], capture_output=True, text=True, check=True).stdout
    return out.split()[1]


@pytest.fixture(scope="module")
def own_cluster(tmp_path_factory):
    cluster = LoopbackCluster(tmp_path_factory.mktemp("hostkey-nodes"), count=1, first_octet=40).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def node(own_cluster, transactional_db, fast_settings, tmp_path):
    fast_settings.UGRO = {**fast_settings.UGRO, "KNOWN_HOSTS": str(tmp_path / "known_hosts")}
    lb = own_cluster.nodes[0]
    made = Node.objects.create(
        name="keyed", address=lb.address, ssh_port=lb.port, user=own_cluster.user,
        key_path=str(own_cluster.client_key), workdir=str(lb.workdir), gpu_count=0, agent_python="/usr/bin/python3",
    )  # fmt: skip
    yield made
    pool.get(made.endpoint()).close()


def test_first_contact_pins_the_key_and_a_replaced_key_is_refused_until_trusted(own_cluster, node):
    """Covers: a real sshd's host key pinned on first use, then refused by the link, the health probe and pre-flight
    once the node comes back with another key, until `trust` pins it: no fake link has a host key.
    """
    # given a node never contacted: when UGRO first reaches it
    node_request(node, "hello", timeout=10)
    node.refresh_from_db()
    first = ssh_fingerprint(f"{own_cluster.host_key}.pub")
    # then its key is pinned, trust on first use, and shown as OpenSSH shows it
    assert node.host_key.startswith("ssh-ed25519 ") and node.host_key_source == "first use"
    assert node.host_key_fingerprint == first
    health = io.StringIO()
    call_command("health", stdout=health)
    assert f"host key {first} (first use)" in health.getvalue()

    # when the node's sshd comes back with another key (reinstalled, or someone else on its address)
    own_cluster.replace_host_key()
    second = ssh_fingerprint(f"{own_cluster.host_key}.pub")
    assert second != first
    # then a link refuses it, naming the node and both fingerprints, and nothing is sent
    with pytest.raises(HostKeyError) as info:
        node_request(node, "hello", timeout=10)
    message = str(info.value)
    assert "keyed" in message and first in message and second in message and "ugro trust keyed" in message
    assert "\n" not in message
    # and the health probe says the same (the node is not healthy)
    monitor.poll_once(nodes=[Node.objects.get(pk=node.pk)], force=True)
    node.refresh_from_db()
    assert node.status != Node.Status.HEALTHY and "host key changed" in node.status_reason
    # and so does pre-flight
    report = check_nodes([node], "x.py", node.address, 29500)
    assert any("host key changed" in p and second in p for p in report.problems)
    # and the pinned key did not move
    assert node.host_key_fingerprint == first

    # when the operator trusts it with the wrong fingerprint: refused, nothing changed
    with pytest.raises(CommandError, match="nothing was changed"):
        call_command("trust", "keyed", "--fingerprint", first, stdout=io.StringIO())
    node.refresh_from_db()
    assert node.host_key_fingerprint == first
    # when the operator trusts the new key (checked against the node's own ssh-keygen -l)
    out = io.StringIO()
    call_command("trust", "keyed", "--fingerprint", second, stdout=out)
    assert out.getvalue().strip() == f"keyed: host key {second} pinned (was {first})"
    node.refresh_from_db()
    assert node.host_key_fingerprint == second and node.host_key_source == "trust"
    # then the node is reached again
    assert node_request(node, "hello", timeout=10)["pid"] > 0


def test_a_known_hosts_entry_is_honoured(own_cluster, node, tmp_path):
    """Covers: a known_hosts entry checked against a real sshd's key, a wrong one refused, the right one pinned."""
    lb = own_cluster.nodes[0]
    pub = (own_cluster.host_key.with_suffix(".pub")).read_text().split()
    other = tmp_path / "other"
    subprocess.run([SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    wrong = (tmp_path / "other.pub").read_text().split()
    known = tmp_path / "known_hosts"
    # given a known_hosts that lists another key for the node's address and port
    known.write_text(f"[{lb.address}]:{lb.port} {wrong[0]} {wrong[1]}\n")
    # then the node is refused, and the message says the key came from known_hosts
    with pytest.raises(HostKeyError, match="the key in .*known_hosts is SHA256"):
        node_request(node, "hello", timeout=10)
    node.refresh_from_db()
    assert node.host_key == ""
    # given known_hosts with the node's real key: it is accepted and pinned from there
    known.write_text(f"[{lb.address}]:{lb.port} {pub[0]} {pub[1]}\n")
    node_request(node, "hello", timeout=10)
    node.refresh_from_db()
    assert node.host_key == f"{pub[0]} {pub[1]}" and node.host_key_source == "known_hosts"


def test_trust_refuses_unknown_and_local_nodes(node):
    """Covers: no node is contacted: `trust`'s refusals read the database only; e2e only by its module's pytestmark: it
    belongs in a fast file.
    """
    with pytest.raises(CommandError, match="no node named 'nope'"):
        call_command("trust", "nope", stdout=io.StringIO())
    Node.objects.create(name="here", address="127.0.0.1", transport=Node.Transport.LOCAL)
    with pytest.raises(CommandError, match="without SSH"):
        call_command("trust", "here", stdout=io.StringIO())


def test_a_node_that_does_not_answer_is_a_link_error_not_a_key_error(node):
    """Covers: a refused connection (port 1) reported by `trust` and a request as a link error, not a key error (a
    second).
    """
    Node.objects.filter(pk=node.pk).update(ssh_port=1)
    node.refresh_from_db()
    with pytest.raises(CommandError, match="cannot reach"):
        call_command("trust", "keyed", stdout=io.StringIO())
    with pytest.raises(LinkError) as info:
        node_request(node, "hello", timeout=5)
    assert not isinstance(info.value, HostKeyError)


def test_a_warm_link_is_kept_when_its_key_gets_pinned_and_pins_a_row_made_again(own_cluster, node):
    """Covers: a warm paramiko link kept across the pinning of its key, and reused for the node's row made again: only a
    real connection is warm.
    """
    link = node.link()
    node_request(node, "hello", timeout=10)
    node.refresh_from_db()
    assert node.host_key
    # the endpoint now carries the pinned key: the same warm link serves it, no new connection
    assert node.link() is link and link.connected
    # when the node's row is made again (deleted and re-added): the checked, warm link pins the key it saw
    fields = {f: getattr(node, f) for f in ("address", "ssh_port", "user", "key_path", "workdir", "agent_python")}
    Node.objects.filter(pk=node.pk).delete()
    again = Node.objects.create(name="keyed", gpu_count=0, **fields)
    assert again.link() is link
    again.refresh_from_db()
    assert again.host_key == node.host_key and again.host_key_source == "first use"
