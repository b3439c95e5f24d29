"""The health monitor on real sshd nodes: DOWN, alerts, recovery, webhook, samples, `manage.py health`; and,
without a node (fast), the samples' prune, a job's alert posted and mailed, `alerts`, and the knock on a DOWN node.

No GPU exists here: nodes that need GPUs read them from a JSON fixture through the probe's
`fixture:<path>` reader (Node.gpu_reader).
"""

from __future__ import annotations

import dataclasses
import io
import json
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from cluster import monitor
from cluster.alerts import job_finished_alert
from cluster.models import Alert, HealthSample, Node

from .conftest import wait_for

# Each test drives the monitor itself; those that reach the loopback nodes are marked e2e one by one, the rest
# (database rows, a local HTTP receiver, a TCP knock) run with the fast tests.
pytestmark = pytest.mark.no_test_worker

GPU = {
    "index": 0,
    "name": "NVIDIA GeForce RTX 4070",
    "uuid": "GPU-5f2a9c1e-3b7d-4e21-9a0c-8d6f1b2e4c73",
    "util_percent": 37,
    "mem_used_mb": 2113,
    "mem_total_mb": 8188,
    "temp_c": 54,
    "power_w": 41.23,
}


@pytest.fixture(autouse=True)
def shared_machine(monkeypatch):
    """Other test runs share this machine's CPUs: a busy CPU is not what these tests judge."""
    monkeypatch.setattr(monitor, "THRESHOLDS", dataclasses.replace(monitor.THRESHOLDS, cpu_warn=100))


class _Receiver(BaseHTTPRequestHandler):
    received: list

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.received.append((self.headers["Content-Type"], json.loads(body)))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def webhook(settings):
    """A real HTTP receiver on loopback; alerts are posted to it."""
    server = HTTPServer(("127.0.0.1", 0), _Receiver)
    server.received = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    settings.UGRO_ALERT_WEBHOOK_URL = f"http://127.0.0.1:{server.server_address[1]}/hook"
    yield server.received
    server.shutdown()
    server.server_close()


def gpu_fixture(lab, index: int, gpus: list[dict], count: int | None = None) -> Node:
    """Give loopback node `index` a GPU reading file and declare `count` GPUs on it."""
    path = lab.nodes[index].workdir / "gpus.json"
    path.write_text(json.dumps(gpus))
    node = Node.objects.get(name=lab.nodes[index].name)
    node.gpu_reader = f"fixture:{path}"
    node.gpu_count = len(gpus) if count is None else count
    node.save()
    return node


@pytest.mark.e2e
def test_stopped_node_is_down_within_two_polls_alerts_and_recovers(lab, webhook):
    """Covers: the monitor polling real sshd nodes, one stopped (its sessions cut): DOWN after two polls, one critical
    alert posted to a real webhook, then recovered; the rules alone are tests/test_health.py's.
    """
    # given three healthy nodes, one of them reading one GPU
    gpu_fixture(lab, 0, [GPU])
    first = {o.node: o for o in monitor.poll_once(force=True)}
    assert {name: o.status for name, o in first.items()} == {n: "healthy" for n in ("node1", "node2", "node3")}, {
        n: (o.score, o.reason) for n, o in first.items()
    }
    assert first["node1"].sample["gpus"][0]["name"] == "NVIDIA GeForce RTX 4070"
    try:
        # when node2's sshd stops (its open sessions cut, as a machine falling off the LAN)
        lab.nodes[1].stop()
        polls = [{o.node: o for o in monitor.poll_once(force=True)} for _ in range(2)]
        # then after two polls it is DOWN with a CRITICAL alert; the others stay healthy
        node2 = Node.objects.get(name="node2")
        assert node2.status == Node.Status.DOWN and node2.status_reason.startswith("unreachable")
        assert polls[1]["node2"].went_down and not polls[1]["node2"].ok
        assert polls[1]["node1"].status == "healthy"
        down = Alert.objects.get(node=node2, key="down", resolved_at__isnull=True)
        assert down.severity == Alert.Severity.CRITICAL
        # and the webhook receiver got the alert's JSON
        posted = wait_for(lambda: [b for _, b in webhook if b["alert"]["key"] == "down"], 15, what="webhook")
        ctype, body = next((c, b) for c, b in webhook if b["alert"]["key"] == "down")
        assert ctype == "application/json"
        assert body["alert"]["node"] == "node2" and body["alert"]["severity"] == "critical"
        assert "node2" in body["text"] and len(posted) == 1
        # and a third failed poll opens no second alert (one per condition)
        monitor.poll_once(force=True)
        assert Alert.objects.filter(node=node2, key="down").count() == 1
    finally:
        lab.nodes[1].start()
    # when it is back
    again = {o.node: o for o in monitor.poll_once(force=True)}
    # then it is recovered, the DOWN alert is resolved and an INFO recovery alert is recorded
    node2 = Node.objects.get(name="node2")
    assert again["node2"].recovered and node2.status == Node.Status.HEALTHY
    assert node2.breaker["state"] == "closed"
    assert Alert.objects.get(node=node2, key="down").resolved_at is not None
    info = Alert.objects.get(node=node2, key="recovered")
    assert info.severity == Alert.Severity.INFO and not info.is_open
    wait_for(lambda: any(b["alert"]["key"] == "recovered" for _, b in webhook), 15, what="recovery webhook")
    # and every poll left a sample: good ones with readings, failed ones marked not ok
    samples = HealthSample.objects.filter(node=node2)
    assert samples.filter(ok=False).count() == 3 and samples.filter(ok=True).count() == 2
    assert HealthSample.objects.filter(node__name="node1").first().gpu_temp_c == 54


@pytest.mark.e2e
def test_missing_and_hot_gpus_degrade_the_node_and_alert_until_cleared(lab):
    """Covers: GPU readings from the fixture reader through a real agent degrading the node, then opening, lowering and
    resolving its alerts over three polls.
    """
    # given node1 declares 2 GPUs but the reader sees one, at 87 C
    node = gpu_fixture(lab, 0, [{**GPU, "temp_c": 87}], count=2)
    # when polled
    (out,) = monitor.poll_once(nodes=[node], force=True)
    # then it is degraded with both reasons and one critical alert per condition
    node.refresh_from_db()
    assert node.status == Node.Status.DEGRADED
    assert "1 of 2 declared GPUs visible" in node.status_reason and "GPU 0 at 87 C" in node.status_reason
    open_keys = dict(Alert.objects.filter(node=node, resolved_at__isnull=True).values_list("key", "severity"))
    assert open_keys["gpu_count"] == "critical" and open_keys["gpu_temp:0"] == "critical"
    # when the GPU cools to 82 C: the temperature alert drops to a warning (the same alert)
    gpu_fixture(lab, 0, [{**GPU, "temp_c": 82}], count=2)
    monitor.poll_once(nodes=[node], force=True)
    temp = Alert.objects.get(node=node, key="gpu_temp:0")
    assert temp.severity == "warning" and temp.is_open
    # when both GPUs are there and cool: every alert resolves
    gpu_fixture(lab, 0, [GPU, {**GPU, "index": 1}], count=2)
    monitor.poll_once(nodes=[node], force=True)
    assert not Alert.objects.filter(node=node, resolved_at__isnull=True).exists()
    node.refresh_from_db()
    assert node.status == Node.Status.HEALTHY


@pytest.mark.e2e
def test_adaptive_interval_skips_nodes_polled_moments_ago(lab):
    """Covers: which nodes a tick polls after a real first poll; beyond that poll it is the due-time and lease rule on
    rows (a fast test could hold it).
    """
    # given every node just polled
    monitor.poll_once(force=True)
    # when beat fires again right away: nothing is due (idle nodes wait 40 s)
    assert monitor.poll_once() == []
    # when 41 s have passed (the clock is an argument) while another poll still probes node2
    Node.objects.filter(name="node2").update(poll_lease_until=timezone.now() + timedelta(seconds=30))
    later = timezone.now().timestamp() + 41
    # then the other two are polled, node2 is left to the poll that holds it
    assert sorted(o.node for o in monitor.poll_once(now=later)) == ["node1", "node3"]
    assert Node.objects.get(name="node1").poll_lease_until is None


def test_prune_turns_old_raw_samples_into_minute_aggregates(db):
    # given raw samples 25 h old (two in one minute) and a 31-day-old aggregate
    node = Node.objects.create(name="node1", address="127.0.0.9")
    old = (timezone.now() - timedelta(hours=25)).replace(second=10, microsecond=0)
    HealthSample.objects.create(node=node, time=old, cpu_percent=10, ram_percent=50, score=90)
    HealthSample.objects.create(node=node, time=old + timedelta(seconds=20), cpu_percent=30, ram_percent=70, score=80)
    HealthSample.objects.create(node=node, time=timezone.now(), cpu_percent=5)
    HealthSample.objects.create(node=node, time=timezone.now() - timedelta(days=31), kind="minute")
    # when pruned
    counts = monitor.prune_samples()
    # then one aggregate holds their mean CPU and peak RAM; recent raw stays, expired goes
    assert counts == {"aggregated": 1, "raw_deleted": 2, "expired": 1}
    agg = HealthSample.objects.get(node=node, kind="minute")
    assert (agg.cpu_percent, agg.ram_percent, agg.score, agg.samples) == (20, 70, 85, 2)
    assert HealthSample.objects.filter(node=node, kind="raw").count() == 1


def test_job_finished_alert_is_info_posted_and_mailed(transactional_db, webhook, settings, mailoutbox):
    # given a finished job and an alert address in the environment
    from jobs.models import Job

    settings.UGRO_ALERT_EMAILS = ["ops@example.org"]
    job = Job.objects.create(name="exp9", script="train.py", state=Job.State.SUCCEEDED)
    # when announced
    alert = job_finished_alert(job)
    # then an INFO alert names it, the webhook receives it and it is mailed
    assert alert.severity == "info" and alert.job_name == "exp9" and "exp9 succeeded" in alert.message
    wait_for(lambda: any(b["alert"]["job"] == "exp9" for _, b in webhook), 15, what="job webhook")
    wait_for(lambda: mailoutbox, 15, what="alert mail")
    assert mailoutbox[0].to == ["ops@example.org"] and "exp9 succeeded" in mailoutbox[0].body


@pytest.mark.e2e
def test_a_failing_webhook_does_not_block_the_poll(lab, settings):
    """Covers: a poll through a real agent completing while the webhook's address refuses the post."""
    # given a webhook address where nothing listens
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings.UGRO_ALERT_WEBHOOK_URL = f"http://127.0.0.1:{port}/hook"
    node = gpu_fixture(lab, 0, [], count=1)
    # when a poll opens an alert: the poll completes and the alert is recorded
    monitor.poll_once(nodes=[node], force=True)
    assert Alert.objects.filter(node=node, key="gpu_count", resolved_at__isnull=True).exists()


@pytest.mark.e2e
def test_health_command_lists_every_node_and_exits_1_when_one_is_down(lab):
    """Covers: `health` polling three real sshd nodes with fixture GPUs: a line per node, the failing checks under the
    bad one, exit 1, and the same verdicts in --json.
    """
    # given node1 with one GPU, node3 declaring a GPU it does not have
    gpu_fixture(lab, 0, [GPU])
    gpu_fixture(lab, 2, [], count=1)
    out = io.StringIO()
    # when `manage.py health` runs
    with pytest.raises(CommandError, match="not healthy: node3"):
        call_command("health", stdout=out)
    text = out.getvalue()
    # then one line per node, failing checks listed under the bad one, exit status 1
    lines = text.splitlines()
    assert lines[0].startswith("✓ node1") and "1× NVIDIA GeForce RTX 4070 8 GB - Ready" in lines[0]
    assert any(line.startswith("✓ node2") for line in lines)
    bad = next(i for i, line in enumerate(lines) if line.startswith("✗ node3"))
    assert "DEGRADED" in lines[bad]
    assert "0 of 1 declared GPUs visible" in lines[bad + 1]
    # and --json carries the same verdicts
    out = io.StringIO()
    with pytest.raises(CommandError):
        call_command("health", "--json", stdout=out)
    data = {n["node"]: n for n in json.loads(out.getvalue())["nodes"]}
    assert data["node3"]["status"] == "degraded" and data["node1"]["status"] == "healthy"


@pytest.mark.e2e
def test_health_command_exits_0_when_all_nodes_are_healthy(lab):
    """Covers: `health` over SSH on three healthy nodes exiting 0 (about a second)."""
    out = io.StringIO()
    call_command("health", stdout=out)
    assert out.getvalue().count("✓") == 3


def test_alerts_command_lists_open_alerts_and_all_with_flag(db):
    # given one open and one resolved alert
    from cluster.alerts import open_alert, record_event

    node = Node.objects.create(name="node2", address="127.0.0.9")
    open_alert(node, "ram", "warning", "RAM 92 % used")
    record_event(node, "recovered", "node2 recovered")
    out = io.StringIO()
    call_command("alerts", stdout=out)
    assert "RAM 92 % used" in out.getvalue() and "recovered" not in out.getvalue()
    out = io.StringIO()
    call_command("alerts", "--all", stdout=out)
    assert "node2 recovered" in out.getvalue()


@pytest.mark.e2e
def test_monitor_command_polls_in_the_foreground(lab):
    """Covers: `monitor`, the foreground loop, making one step of real polls of three sshd nodes."""
    # given no poll yet; when the foreground monitor runs briefly
    out = io.StringIO()
    call_command("monitor", "--seconds", "0.5", "--tick", "5", stdout=out)
    # then it made one step and every node has a sample and a status
    assert "1 monitor steps" in out.getvalue()
    assert set(Node.objects.values_list("status", flat=True)) <= {"healthy", "degraded"}
    assert HealthSample.objects.values("node").distinct().count() == 3


@pytest.mark.e2e
def test_poll_pushes_node_status_to_the_cluster_group(lab):
    """Covers: a real poll's node events arriving on the dashboard's cluster group over the Redis channel layer."""
    # given a listener in the dashboard's "cluster" group (real Redis channel layer)
    import asyncio

    from asgiref.sync import async_to_sync
    from channels.layers import get_channel_layer

    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)("cluster", channel)

    async def receive_three() -> dict:
        got = {}
        while not {"node1", "node2", "node3"} <= set(got):
            msg = await asyncio.wait_for(layer.receive(channel), 10)
            got[msg["data"]["node"]] = msg
        return got

    try:
        # when a poll runs
        monitor.poll_once(force=True)
        got = async_to_sync(receive_three)()
    finally:
        async_to_sync(layer.group_discard)("cluster", channel)
    # then each node's status arrives as a cluster.event of kind "node"
    msg = got["node1"]
    assert msg["type"] == "cluster.event" and msg["kind"] == "node"
    assert msg["data"]["status"] in ("healthy", "degraded") and "cpu_percent" in msg["data"]["sample"]


def test_a_down_node_that_answers_again_is_probed_at_once_not_after_its_backoff(db, monkeypatch):
    """A real TCP knock on a port that starts listening (the probe itself is stubbed, no SSH)."""
    import socket
    import time

    from cluster.health import Breaker

    # given a DOWN node waiting out a long backoff, whose SSH port answers nothing
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    now = time.time()
    breaker = Breaker(failures=9, open_until=now + 300, state="open").to_dict()
    node = Node.objects.create(name="away", address="127.0.0.1", ssh_port=port, status=Node.Status.DOWN,
                               breaker=breaker, last_seen=timezone.now())  # fmt: skip
    probed = []
    monkeypatch.setattr(monitor, "probe_node", lambda n, b, t, force=False: probed.append(n.name) or _fail(b, t))
    # when ticks go by: it is knocked, not probed
    monitor._knock_answered.pop(node.pk, None)
    monitor.poll_once(now=now)
    assert probed == [] and monitor._knock_answered[node.pk] is False
    # when its port answers again (the cable is back)
    listener = socket.create_server(("127.0.0.1", port))
    try:
        monitor.poll_once(now=now + 5)
        # then it is probed on that tick, 295 s before its backoff ended
        assert probed == ["away"]
        # and a node that answers knocks but fails its probes keeps its backoff (no probe every tick)
        monitor.poll_once(now=now + 10)
        assert probed == ["away"]
    finally:
        listener.close()


def test_a_node_back_while_an_older_probe_still_holds_it_is_probed_on_the_next_tick(db, monkeypatch):
    """A real TCP knock answered while another probe holds the lease (the probe is stubbed, no SSH)."""
    import socket
    import time
    from datetime import timedelta

    from cluster.health import Breaker

    # given a DOWN node waiting out a long backoff that answers again, while another poll's probe (sent while it
    # was silent) still holds its lease
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    now = time.time()
    breaker = Breaker(failures=9, open_until=now + 300, state="open").to_dict()
    node = Node.objects.create(name="away", address="127.0.0.1", ssh_port=port, status=Node.Status.DOWN,
                               breaker=breaker, last_seen=timezone.now(),
                               poll_lease_until=timezone.now() + timedelta(seconds=30))  # fmt: skip
    probed = []
    monkeypatch.setattr(monitor, "probe_node", lambda n, b, t, force=False: probed.append(n.name) or _fail(b, t))
    monitor._knock_answered[node.pk] = False
    try:
        # when a tick finds it answering but leased: no probe now
        monitor.poll_once(now=now)
        assert probed == []
        # when the older probe has let go by the next tick
        Node.objects.filter(pk=node.pk).update(poll_lease_until=None)
        monitor.poll_once(now=now + 5)
        # then it is probed on that tick, not after its backoff
        assert probed == ["away"]
    finally:
        listener.close()


def _fail(breaker, now):
    breaker.record_failure(now)
    return None, None, "connect timed out", False
