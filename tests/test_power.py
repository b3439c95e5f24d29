"""Idle nodes sleep and the queue wakes them (cluster/power.py, jobs/power.py), on the in-memory agent: the power:
block's checks, the magic packet's bytes, idle -> asleep, a failing sleep command, the waking reason, the wake sent
once, a node that answers again, a node that never wakes -> DOWN, the monitor leaving asleep nodes alone."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import yaml
from django.utils import timezone

from cluster import monitor, power
from cluster.config_yaml import ConfigError, export_cluster, import_cluster
from cluster.models import Alert, HealthSample, Node
from jobs import scheduler
from jobs.launch import LaunchRequest, create_job
from jobs.management.commands.launch import waiting_reason
from jobs.models import Allocation
from jobs.power import sleep_idle
from tests.fake_agent import FakeCluster

pytestmark = pytest.mark.django_db

MAC = "02:00:00:0a:0b:0c"
WOL = {"sleep": "systemctl suspend", "wake": "wol", "mac": MAC, "idle_after": "60s", "wake_timeout": "120s"}


def _node(name: str, address: str, **fields) -> Node:
    return Node.objects.create(name=name, address=address, status=Node.Status.HEALTHY, **fields)


def _sleeper(name: str = "gpu2", address: str = "10.9.9.2", **block) -> Node:
    return _node(name, address, power=power.parse_power({**WOL, **block}, address, "ssh"))


# -- the power: block ------------------------------------------------------------------------------------------


def test_a_power_block_is_read_with_its_defaults():
    block = {"sleep": "systemctl suspend", "wake": "wol", "mac": "02-00-00-0A-0B-0C"}
    got = power.parse_power(block, "10.0.0.5", "ssh")
    assert got == {"sleep": "systemctl suspend", "wake": "wol", "mac": MAC, "broadcast": "255.255.255.255",
                   "port": 9, "idle_after_s": 1800, "wake_timeout_s": 120}  # fmt: skip
    cmd = power.parse_power({"sleep": "sudo pm-suspend", "wake_command": "ipmitool power on", "idle_after": "1h30m"},
                            "10.0.0.5", "ssh")  # fmt: skip
    assert cmd["wake"] == "command" and cmd["wake_command"] == "ipmitool power on" and cmd["idle_after_s"] == 5400


@pytest.mark.parametrize(
    ("block", "address", "transport", "says"),
    [
        ({**WOL, "mac": "02:00:00:0a:0b"}, "10.0.0.5", "ssh", "nodes.gpu2.power.mac: must be a MAC address"),
        ({**WOL, "mac": "zz:00:00:0a:0b:0c"}, "10.0.0.5", "ssh", "nodes.gpu2.power.mac: must be a MAC address"),
        ({**WOL, "suspend_after": "5m"}, "10.0.0.5", "ssh", "nodes.gpu2.power.suspend_after: unknown key"),
        (WOL, "127.0.0.1", "ssh", "nodes.gpu2.power.sleep: would put the controller's own machine to sleep"),
        (WOL, "localhost", "ssh", "nodes.gpu2.power.sleep: would put the controller's own machine to sleep"),
        (WOL, "127.0.0.1", "local", "nodes.gpu2.power.sleep: would put the controller's own machine to sleep"),
        ({"sleep": "systemctl suspend"}, "10.0.0.5", "ssh", "nodes.gpu2.power.wake: must be wol"),
        ({**WOL, "idle_after": "soon"}, "10.0.0.5", "ssh", "nodes.gpu2.power.idle_after: must be a duration"),
        ({**WOL, "port": 70000}, "10.0.0.5", "ssh", "nodes.gpu2.power.port: must be a UDP port"),
        ({**WOL, "sleep": "'unclosed"}, "10.0.0.5", "ssh", "nodes.gpu2.power.sleep: cannot be split"),
    ],
)
def test_a_bad_power_block_is_refused_at_import_in_one_line_and_nothing_changes(block, address, transport, says):
    # given a cluster of one node
    import_cluster("nodes:\n  gpu1: {ip: 10.0.0.4}\n")
    text = yaml.safe_dump({"nodes": {"gpu1": {"ip": "10.0.0.4"},
                                     "gpu2": {"ip": address, "transport": transport, "power": block}}})  # fmt: skip
    # when a file with a bad power: block is imported, it is refused in one line naming the key and its line
    with pytest.raises(ConfigError) as err:
        import_cluster(text)
    assert str(err.value).startswith(says) and "\n" not in str(err.value) and "(line " in str(err.value)
    # and nothing was recorded
    assert list(Node.objects.values_list("name", flat=True)) == ["gpu1"]


def test_a_power_block_survives_export_and_import():
    block = f"{{sleep: systemctl suspend, wake: wol, mac: '{MAC}'}}"
    import_cluster(f"nodes:\n  gpu2:\n    ip: 10.0.0.5\n    power: {block}\n")
    before = Node.objects.get(name="gpu2").power
    import_cluster(export_cluster())
    assert Node.objects.get(name="gpu2").power == before and before["mac"] == MAC


def test_admin_checks_a_power_block_as_import_does_and_keeps_the_stored_form():
    from django.core.exceptions import ValidationError

    node = Node(name="gpu2", address="10.9.9.2", power={"sleep": "systemctl suspend", "wake": "wol", "mac": "nope"})
    with pytest.raises(ValidationError) as err:
        node.clean()
    assert err.value.message_dict == {"power": ["mac: must be a MAC address like 3c:7c:3f:aa:bb:cc, not 'nope'"]}
    stored = power.parse_power(WOL, "10.9.9.2", "ssh")
    node.power = dict(stored)
    node.clean()  # the form admin shows (idle_after_s ...) is read back as it was
    assert node.power == stored
    node.address = "127.0.0.1"
    with pytest.raises(ValidationError, match="controller's own machine"):
        node.clean()


def test_the_magic_packet_is_six_ff_then_the_mac_sixteen_times_sent_over_udp():
    packet = power.magic_packet(MAC)
    assert len(packet) == 102 and packet[:6] == b"\xff" * 6
    assert packet[6:] == bytes([0x02, 0x00, 0x00, 0x0A, 0x0B, 0x0C]) * 16
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as card:
        card.bind(("127.0.0.1", 0))
        card.settimeout(5)
        power.send_magic_packet(MAC, "127.0.0.1", card.getsockname()[1])
        assert card.recv(200) == packet


# -- idle nodes sleep ----------------------------------------------------------------------------------------------


def test_an_idle_node_is_put_to_sleep_after_idle_after_without_an_alert(monkeypatch):
    fake = FakeCluster("gpu2").install(monkeypatch)
    node = _sleeper()
    now = timezone.now()
    # the first pass starts its idle clock, a pass before idle_after leaves it awake
    assert sleep_idle(now) == [] and sleep_idle(now + timedelta(seconds=59)) == []
    assert Node.objects.get(pk=node.pk).status == Node.Status.HEALTHY
    # when it has been idle for idle_after, its sleep command runs through its agent
    lines = sleep_idle(now + timedelta(seconds=61))
    assert ("exec", {"argv": ["systemctl", "suspend"]}) in fake["gpu2"].requests
    node.refresh_from_db()
    assert node.status == Node.Status.ASLEEP and lines[0].startswith("gpu2 asleep since")
    # not DOWN, no alert; its history says asleep
    assert not Alert.objects.exists()
    assert HealthSample.objects.filter(node=node, status=Node.Status.ASLEEP).count() == 1


def test_a_node_holding_a_job_or_a_service_stays_awake_and_its_idle_clock_stops(monkeypatch):
    FakeCluster("gpu2").install(monkeypatch)
    node = _sleeper()
    now = timezone.now()
    sleep_idle(now)
    Allocation.objects.create(node=node, gpu_index=-1, holder="serve:chat/0")
    assert sleep_idle(now + timedelta(hours=1)) == []
    node.refresh_from_db()
    assert node.status == Node.Status.HEALTHY and node.idle_since is None


def test_a_sleep_command_that_fails_leaves_the_node_awake_with_an_alert_naming_its_error(monkeypatch):
    fake = FakeCluster("gpu2").install(monkeypatch)
    fake["gpu2"].exec_answer = {"rc": 1, "stdout": "", "stderr": "Failed to suspend system: Access denied\n"}
    node = _sleeper()
    now = timezone.now()
    sleep_idle(now)
    (line,) = sleep_idle(now + timedelta(seconds=61))
    node.refresh_from_db()
    assert node.status == Node.Status.HEALTHY
    alert = Alert.objects.get(node=node, key="sleep", resolved_at__isnull=True)
    assert alert.message == line == ("gpu2 did not go to sleep: systemctl suspend exited 1: "
                                     "Failed to suspend system: Access denied")  # fmt: skip


def test_the_controllers_own_machine_is_never_put_to_sleep(monkeypatch):
    FakeCluster("here").install(monkeypatch)
    node = _node("here", "127.0.0.1", power={**power.parse_power(WOL, "10.0.0.9", "ssh")})  # set past the checks
    with pytest.raises(power.PowerError, match="controller's own machine"):
        power.put_to_sleep(node, "test")
    assert Node.objects.get(pk=node.pk).status == Node.Status.HEALTHY


def test_a_minute_asleep_stays_asleep_when_raw_samples_are_rolled_up():
    node = _sleeper()
    minute = (timezone.now() - timedelta(hours=25)).replace(second=0, microsecond=0)
    for s in (5, 45):
        HealthSample.objects.create(node=node, time=minute + timedelta(seconds=s), ok=False, status="asleep",
                                    error="asleep")  # fmt: skip
    HealthSample.objects.create(node=node, time=minute + timedelta(minutes=1), ok=False, status="down", error="x")
    monitor.prune_samples()
    rolled = HealthSample.objects.filter(node=node, kind=HealthSample.Kind.MINUTE).order_by("time")
    assert [(r.status, r.samples) for r in rolled] == [("asleep", 2), ("down", 1)]


# -- the queue wakes them -----------------------------------------------------------------------------------------


def test_a_job_that_fits_only_with_an_asleep_node_wakes_it_and_waits_with_the_waking_reason(monkeypatch):
    FakeCluster("gpu1", "gpu2").install(monkeypatch)
    sent = []
    monkeypatch.setattr(power, "send_magic_packet", lambda *a: sent.append(a))
    _node("gpu1", "10.9.9.1", role="master")
    gpu2 = _sleeper()
    Node.objects.filter(pk=gpu2.pk).update(status=Node.Status.ASLEEP)
    # a job on one node starts on the awake one: nothing is woken
    first = create_job(LaunchRequest(name="one", count=1))
    assert scheduler.place_queued() == [first] and sent == []
    # a second job fits only with gpu2: the pass wakes it, and the job waits with the reason
    second = create_job(LaunchRequest(name="two", count=1))
    assert scheduler.place_queued() == []
    assert sent == [(MAC, "255.255.255.255", 9)]
    assert Node.objects.get(pk=gpu2.pk).status == Node.Status.WAKING
    assert waiting_reason(second) == "(waking): waking gpu2 (0 s)"
    # 40 s on, it says so, and no second wake is sent
    Node.objects.filter(pk=gpu2.pk).update(power_since=timezone.now() - timedelta(seconds=40))
    assert waiting_reason(second) == "(waking): waking gpu2 (40 s)"
    scheduler.place_queued()
    assert len(sent) == 1
    # when its probe answers, the job starts there
    Node.objects.filter(pk=gpu2.pk).update(status=Node.Status.HEALTHY)
    assert scheduler.place_queued() == [second]


def test_a_wake_command_that_fails_makes_the_node_down_with_an_alert(monkeypatch):
    FakeCluster("gpu2").install(monkeypatch)
    node = _sleeper(wake="command", wake_command="false", mac=None)
    Node.objects.filter(pk=node.pk).update(status=Node.Status.ASLEEP)
    node.refresh_from_db()
    with pytest.raises(power.PowerError, match="the wake failed: false exited 1"):
        power.wake(node, "test")
    node.refresh_from_db()
    assert node.status == Node.Status.DOWN and Alert.objects.filter(node=node, key="down").exists()


def test_a_node_that_answers_again_is_awake_and_one_that_never_wakes_is_down(monkeypatch):
    FakeCluster("gpu2", "gpu3").install(monkeypatch)
    woke, probed = [], []
    power.on_awake(woke.extend)
    monkeypatch.setattr(monitor, "poll_once", lambda nodes, force=False: probed.extend(n.name for n in nodes))
    gpu2, gpu3 = _sleeper(), _sleeper("gpu3", "10.9.9.3")
    long_ago = timezone.now() - timedelta(seconds=121)
    Node.objects.filter(pk=gpu2.pk).update(status=Node.Status.ASLEEP, power_since=long_ago)  # woken by hand
    Node.objects.filter(pk=gpu3.pk).update(status=Node.Status.WAKING, power_since=long_ago)  # never answers
    monkeypatch.setattr(power, "_knock", lambda node: node.name == "gpu2")
    try:
        lines = power.watch()
    finally:
        power._awake_hooks.remove(woke.extend)
    assert lines[0].startswith("gpu2 is awake (woken outside UGRO) after 12")
    assert lines[1] == "gpu3 did not wake within 120 s: DOWN"
    assert Node.objects.get(pk=gpu2.pk).status == Node.Status.UNKNOWN and probed == ["gpu2"] and woke == [gpu2]
    gpu3.refresh_from_db()
    assert gpu3.status == Node.Status.DOWN and gpu3.status_reason == "did not wake within 120 s"
    assert Alert.objects.get(node=gpu3, key="down").message == "gpu3 is DOWN: did not wake within 120 s"


def test_the_monitor_does_not_probe_an_asleep_node_and_its_history_shows_asleep(monkeypatch):
    fake = FakeCluster("gpu2").install(monkeypatch)
    node = _sleeper()
    Node.objects.filter(pk=node.pk).update(status=Node.Status.ASLEEP, last_poll_at=None)
    monkeypatch.setattr(power, "_knock", lambda node: False)
    assert monitor.poll_once(force=True) == [] and fake["gpu2"].requests == []
    power.watch()
    power.watch()  # within ASLEEP_SAMPLE_EVERY_S: one sample, not one per tick
    (sample,) = HealthSample.objects.filter(node=node)
    assert sample.status == "asleep" and sample.error == "asleep"
    assert Node.objects.get(pk=node.pk).status == Node.Status.ASLEEP and not Alert.objects.exists()


def test_health_shows_an_asleep_node_as_resting_and_exits_0_from_the_command_and_the_client(monkeypatch):
    import io

    from django.core.management import call_command

    from ugro_client import cli

    FakeCluster("gpu2").install(monkeypatch)
    node = _sleeper()
    Node.objects.filter(pk=node.pk).update(status=Node.Status.ASLEEP, status_reason="asleep since 03:00 (idle 30 min)")
    monkeypatch.setattr("cluster.management.commands.health.scheduler_alive", lambda: True)
    out = io.StringIO()
    call_command("health", stdout=out)  # raises CommandError (exit 1) were the asleep node a failure
    assert "○ gpu2" in out.getvalue() and "ASLEEP: asleep since 03:00 (idle 30 min)" in out.getvalue()
    # the client reads the API's rows: the same mark, exit 0; a DOWN node still fails it
    rows = [{"name": "gpu2", "enabled": True, "gpu": "", "status": "asleep", "reason": "", "checks": []}]
    answers = {"health": rows, "controller": {"problem": ""}}
    monkeypatch.setattr(cli.Client, "get", lambda self, path, **kw: answers[path])
    shown = io.StringIO()
    monkeypatch.setattr("sys.stdout", shown)
    monkeypatch.setenv("UGRO_TOKEN", "t")
    assert cli.run(["health"]) == 0 and "○ gpu2" in shown.getvalue()
    rows[0]["status"] = "down"
    assert cli.run(["health"]) != 0


# -- by hand: ugro node sleep / wake (operators) --------------------------------------------------------------------


def test_node_sleep_and_wake_by_hand_through_the_command_the_api_and_the_client(monkeypatch):
    import io

    from django.contrib.auth.models import Group, User
    from django.core.management import CommandError, call_command
    from django.test import Client as DjangoClient

    from accounts.tokens import create_token
    from ugro_client import cli

    fake = FakeCluster("gpu2").install(monkeypatch)
    sent = []
    monkeypatch.setattr(power, "send_magic_packet", lambda *a: sent.append(a))
    node = _sleeper()
    olga = User.objects.create_user("olga")
    olga.groups.add(Group.objects.get(name="operator"))
    lars = User.objects.create_user("lars")
    lars.groups.add(Group.objects.get(name="launcher"))
    # an operator puts it to sleep with the command: its sleep command runs, it is ASLEEP
    out = io.StringIO()
    call_command("node_sleep", "gpu2", "--as", "olga", stdout=out)
    assert out.getvalue().startswith("gpu2 asleep since") and "(asked by olga)" in out.getvalue()
    assert ("exec", {"argv": ["systemctl", "suspend"]}) in fake["gpu2"].requests
    assert Node.objects.get(pk=node.pk).status == Node.Status.ASLEEP
    # a second sleep is refused in one line, and so is a launcher
    with pytest.raises(CommandError, match="^gpu2 is asleep: only an awake node is put to sleep$"):
        call_command("node_sleep", "gpu2", "--as", "olga")
    with pytest.raises(CommandError, match="not allowed to manage nodes"):
        call_command("node_wake", "gpu2", "--as", "lars")
    # through the API: a launcher is refused, an operator wakes it
    _, op_token = create_token(olga, "ops", "operate")
    _, l_token = create_token(lars, "cli", "launch")
    web = DjangoClient()
    assert web.post("/api/v1/nodes/gpu2/wake", HTTP_AUTHORIZATION=f"Bearer {l_token}").status_code == 403
    answer = web.post("/api/v1/nodes/gpu2/wake", HTTP_AUTHORIZATION=f"Bearer {op_token}")
    assert answer.status_code == 200 and answer.json()["status"] == "waking" and sent == [(MAC, "255.255.255.255", 9)]
    assert answer.json()["lines"][0].endswith("(asked by olga): awake when it answers (wake_timeout 120 s)")
    # a node that holds a service is not put to sleep: 409, one line
    Node.objects.filter(pk=node.pk).update(status=Node.Status.HEALTHY)
    Allocation.objects.create(node=node, gpu_index=-1, holder="serve:chat/0")
    refused = web.post("/api/v1/nodes/gpu2/sleep", HTTP_AUTHORIZATION=f"Bearer {op_token}")
    assert refused.status_code == 409
    assert refused.json()["error"] == "gpu2 holds a job's or a service's GPUs: not put to sleep"
    # and through the client, which prints the line
    Allocation.objects.all().delete()

    def post(self, path, body=None):
        got = web.post(f"/api/v1/{path}", body or {}, content_type="application/json",
                       HTTP_AUTHORIZATION=f"Bearer {op_token}")  # fmt: skip
        assert got.status_code == 200, got.content
        return got.json()

    monkeypatch.setattr(cli.Client, "post", post)
    monkeypatch.setenv("UGRO_TOKEN", op_token)
    shown = io.StringIO()
    monkeypatch.setattr("sys.stdout", shown)
    assert cli.run(["node", "sleep", "gpu2"]) == 0
    assert shown.getvalue().startswith("gpu2 asleep since")


# -- end to end: a real sshd node that sleeps and a magic packet that wakes it ------------------------------------


@pytest.mark.e2e
def test_an_idle_node_sleeps_and_a_queued_job_wakes_it_by_magic_packet_and_starts(db, fast_settings, tmp_path):
    """Covers: the sleep command run through a real node's agent (it stops that node's own sshd), the knock finding
    it asleep, a queued job that fits only with it sending a real magic packet over UDP, the node coming back and
    the job launched there once its probe answers."""
    import threading

    from cluster.links import pool
    from jobs.models import Job

    from .conftest import cluster_yaml
    from .loopback import LoopbackCluster

    lab = LoopbackCluster(tmp_path / "sleeper", count=1, first_octet=77).start()
    node = lab.nodes[0]
    (node.workdir / "hello.py").write_text("print('awake and running')\n")
    pidfile = lab.root / f"{node.name}.pid"
    card = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # the node's network card, on an address of its own
    card.bind(("127.0.0.78", 0))
    card.settimeout(0.2)
    packets: list[bytes] = []
    stop = threading.Event()

    def listen() -> None:  # a valid magic packet for its MAC powers the machine on: its sshd starts again
        while not stop.is_set():
            try:
                data = card.recv(200)
            except OSError:
                continue
            packets.append(data)
            if data == power.magic_packet(MAC):
                node.start()

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    try:
        doc = yaml.safe_load(cluster_yaml(lab, 1))
        doc["nodes"][node.name]["power"] = {
            "sleep": f"sh -c 'kill $(cat {pidfile})'", "wake": "wol", "mac": MAC, "broadcast": "127.0.0.78",
            "port": card.getsockname()[1], "idle_after": "1s", "wake_timeout": "20s",
        }  # fmt: skip
        import_cluster(yaml.safe_dump(doc))
        monitor.poll_once(force=True)
        row = Node.objects.get(name=node.name)
        assert row.status == Node.Status.HEALTHY and row.power["broadcast"] == "127.0.0.78"
        # given the node idle past idle_after, it is put to sleep: its sshd is gone, and it is ASLEEP
        now = timezone.now()
        sleep_idle(now)
        (line,) = sleep_idle(now + timedelta(seconds=2))
        assert line.startswith(f"{node.name} asleep since"), line
        assert not node.running and Node.objects.get(pk=row.pk).status == Node.Status.ASLEEP
        assert power.watch() == [] and not Alert.objects.exists()  # the knock finds nobody: still asleep
        # when a job that needs it is queued, the scheduler wakes it with a magic packet and the job waits
        job = create_job(LaunchRequest(name="wakeup", count=1, script="hello.py"))
        assert scheduler.schedule() == []
        assert waiting_reason(job).startswith(f"(waking): waking {node.name} (")
        for _ in range(100):  # bounded: the card starts the sshd when the packet arrives
            if node.running:
                break
            threading.Event().wait(0.1)
        assert packets == [power.magic_packet(MAC)] and node.running
        # then the next knock finds it awake, it is probed, and the job starts on it
        assert power.watch()[0].startswith(f"{node.name} woke after")
        assert Node.objects.get(pk=row.pk).status == Node.Status.HEALTHY
        assert scheduler.schedule() == [job]
        job.refresh_from_db()
        assert job.state == Job.State.RUNNING
    finally:
        stop.set()
        listener.join(timeout=2)
        card.close()
        pool.close_all()
        lab.stop()
