"""`node add` and `node probe` (cluster/provision.py): a machine added by probing it, its host key pinned, its GPUs,
CPUs, RAM, disk, Python environments (torch/CUDA/NCCL) and route recorded, refusals in one line with nothing recorded,
a probe that says what changed; through manage.py, the API (operators only), the client and the admin action.
Local agents for the logic; one end-to-end test on a loopback sshd node."""

from __future__ import annotations

import io
import json
import socket
import subprocess
from pathlib import Path

import pytest
import yaml
from django.contrib.auth.models import Group, User
from django.core.management import CommandError, call_command
from django.test import Client as DjangoClient

from cluster import provision
from cluster.links import Endpoint, pool
from cluster.models import Node

from .conftest import NODE_ENV

GPU = {"name": "NVIDIA GeForce RTX 4090", "mem_total_mb": 24564, "mem_used_mb": 10, "driver": "550.54"}


def workdir_with_torch(root: Path) -> Path:
    """A working directory holding a venv with torch (a link to the repo's node env), as `uv venv` would leave it."""
    root.mkdir(parents=True, exist_ok=True)
    (root / ".venv-node").symlink_to(NODE_ENV)
    return root


def operator(name: str = "olga") -> User:
    user = User.objects.create_user(name)
    user.groups.add(Group.objects.get(name="operator"))
    return user


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_bad_targets_unsafe_or_taken_names_and_silent_hosts_are_refused_in_one_line_recording_nothing(db, tmp_path):
    operator()
    Node.objects.create(name="taken", address="10.9.9.9", ssh_port=2222, transport="ssh")
    refusals = {
        ("alice@10.0.0.5;reboot",): "is not a DNS name or an IP address",
        ("$(id)@10.0.0.5",): "user '$(id)' is not allowed",
        ("10.0.0.5:70000",): "is not a number from 1 to 65535",
        ("10.0.0.5", "--name", "a b"): "node name 'a b' is not allowed",
        ("::1",): "choose one with --name",
        ("10.0.0.5", "--name", "taken"): "node name 'taken' is taken (by 10.9.9.9:2222)",
        ("bob@10.9.9.9:2222",): "10.9.9.9:2222 is already node taken",
        ("10.0.0.5", "--key", str(tmp_path / "nokey")): "is not a file on the controller",
        (f"127.0.0.1:{free_port()}",): "cannot reach 127.0.0.1 (127.0.0.1:",
    }
    for args, said in refusals.items():
        with pytest.raises(CommandError) as info:
            call_command("node_add", *args, "--as", "olga")
        assert said in str(info.value) and "\n" not in str(info.value), (args, str(info.value))
    assert list(Node.objects.values_list("name", flat=True)) == ["taken"]


def test_a_node_without_python_38_is_refused_and_the_first_python_that_runs_the_agent_is_taken(monkeypatch):
    ep = Endpoint(name="n", address="127.0.0.1", transport="local")
    # a node with no python3 where UGRO looks: refused in one line, naming what was tried
    with pytest.raises(provision.ProvisionError) as info:
        provision._open_agent(ep, ["/nonexistent/python3"])
    assert "n (local) has no Python >= 3.8 to run UGRO's agent (/nonexistent/python3:" in str(info.value)
    # the first that runs the agent is taken
    link, hello = provision._open_agent(ep, ["/nonexistent/python3", "/usr/bin/python3"])
    link.close()
    assert hello["executable"].startswith("/usr/bin/python3")
    # one that runs but is older than the minimum is refused with its version
    monkeypatch.setattr(provision, "MIN_PYTHON", (99, 0))
    with pytest.raises(provision.ProvisionError, match=r"/usr/bin/python3 is 3\.\d+"):
        provision._open_agent(ep, ["/usr/bin/python3"])


def test_the_node_interface_holding_the_address():
    addrs = [["lo", "127.0.0.1/8"], ["eth0", "10.0.0.5/24"], ["wg0", "10.8.0.2/24"], ["eth0", "fe80::1/64"]]
    assert provision._node_interface("10.8.0.2", addrs) == "wg0"
    assert provision._node_interface("127.0.0.3", addrs) == "lo"  # a loopback node: lo holds 127/8
    assert provision._node_interface("192.168.1.9", addrs) == ""
    assert provision._node_interface("10.0.0.5", None) == ""


def test_probe_records_gpus_pythons_and_torchrun_says_what_changed_on_every_surface(db, tmp_path, monkeypatch):
    from accounts.tokens import create_token
    from cluster.config_yaml import export_cluster
    from ugro_client import cli

    # the local agent's PATH: the system's pythons only (a developer's pyenv shims each cost a process per survey)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    fixture = tmp_path / "gpus.json"
    fixture.write_text(json.dumps([dict(GPU, index=0), dict(GPU, index=1)]))
    workdir = workdir_with_torch(tmp_path / "wd")
    node = Node.objects.create(name="box", address="127.0.0.1", transport="local", workdir=str(workdir),
                               agent_python="/usr/bin/python3", gpu_reader=f"fixture:{fixture}")  # fmt: skip
    operator()
    try:
        # when an operator probes it for the first time
        out = io.StringIO()
        call_command("node_probe", "box", "--as", "olga", stdout=out)
        text = out.getvalue()
        node.refresh_from_db()
        # then its GPUs, its torch env and the torchrun next to it are recorded, and shown one per line
        assert (node.gpu_count, node.gpu_model, node.gpu_vram_gb) == (2, GPU["name"], 24.0)
        assert [g.model for g in node.gpus.all()] == [GPU["name"]] * 2
        torchrun = str(workdir / ".venv-node" / "bin" / "torchrun")
        assert node.torchrun_command == torchrun and node.probed["torchrun"] == torchrun
        env = next(p for p in node.probed["pythons"] if p["path"] == str(workdir / ".venv-node" / "bin" / "python"))
        assert env["torch"] and env["python"].startswith("3.") and env["kind"] == "venv"
        assert node.probed["cpus"] >= 1 and node.probed["ram_gb"] > 0 and node.probed["disk_free_gb"] > 0
        assert "box: GPUs: 2× NVIDIA GeForce RTX 4090 24 GB (fixture)" in text
        assert f"box: python {env['path']}: {env['python']}, torch {env['torch']}" in text
        assert "box: first probe recorded" in text
        # and export_cluster writes it back in cluster.yaml's terms
        exported = yaml.safe_load(export_cluster())["nodes"]["box"]
        assert (exported["gpu"], exported["vram_gb"], exported["gpus"], exported["torchrun"]) == (
            GPU["name"], 24, 2, torchrun)  # fmt: skip

        # when the machine changes (a card pulled) and it is probed through the API: operators only
        fixture.write_text(json.dumps([dict(GPU, index=0, name="NVIDIA RTX A6000", mem_total_mb=49140)]))
        _, op_token = create_token(User.objects.get(username="olga"), "ops", "operate")
        launcher = User.objects.create_user("lars")
        launcher.groups.add(Group.objects.get(name="launcher"))
        _, l_token = create_token(launcher, "cli", "launch")
        web = DjangoClient()
        denied = web.post("/api/v1/nodes/box/probe", HTTP_AUTHORIZATION=f"Bearer {l_token}")
        assert denied.status_code == 403 and "not allowed to manage nodes" in denied.json()["error"]
        assert web.post("/api/v1/nodes", {"target": "10.0.0.5"}, content_type="application/json",
                        HTTP_AUTHORIZATION=f"Bearer {l_token}").status_code == 403  # fmt: skip
        refused = web.post("/api/v1/nodes", {"target": f"127.0.0.1:{free_port()}", "name": "quiet"},
                           content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {op_token}")  # fmt: skip
        assert refused.status_code == 409 and refused.json()["error"].startswith("cannot reach quiet (127.0.0.1:")
        assert not Node.objects.filter(name="quiet").exists()
        answer = web.post("/api/v1/nodes/box/probe", HTTP_AUTHORIZATION=f"Bearer {op_token}")
        assert answer.status_code == 200, answer.content
        # then it says what changed, and the node's GPUs follow
        assert answer.json()["changed"] == [
            "GPUs: 2× NVIDIA GeForce RTX 4090 24 GB (fixture) -> 1× NVIDIA RTX A6000 48 GB (fixture)"
        ]
        node.refresh_from_db()
        assert (node.gpu_count, node.gpu_model, node.gpu_vram_gb) == (1, "NVIDIA RTX A6000", 48.0)

        # when probed through the client with nothing changed: it prints the same kind of lines
        def post(self, path, body=None):
            got = web.post(f"/api/v1/{path}", body or {}, content_type="application/json",
                           HTTP_AUTHORIZATION=f"Bearer {op_token}")  # fmt: skip
            assert got.status_code in (200, 201), got.content
            return got.json()

        monkeypatch.setattr(cli.Client, "post", post)
        monkeypatch.setenv("UGRO_TOKEN", op_token)
        shown = io.StringIO()
        monkeypatch.setattr("sys.stdout", shown)
        assert cli.run(["node", "probe", "box"]) == 0
        assert "box: GPUs: 1× NVIDIA RTX A6000 48 GB (fixture)" in shown.getvalue()
        assert "box: nothing changed since" in shown.getvalue()

        # and a torchrun set by hand is kept by a probe
        Node.objects.filter(pk=node.pk).update(torchrun_command="pixi run torchrun")
        call_command("node_probe", "box", "--as", "olga", stdout=io.StringIO())
        assert Node.objects.get(pk=node.pk).torchrun_command == "pixi run torchrun"

        # and GPUs that cannot be read at all (a driver that fails) leave the declared ones in place
        fixture.write_text("not json")
        out = io.StringIO()
        call_command("node_probe", "box", "--as", "olga", stdout=out)
        assert Node.objects.get(pk=node.pk).gpu_count == 1 and "box: GPUs not read (cannot read GPU fixture" in (
            out.getvalue())  # fmt: skip

        # and the admin's "Probe selected nodes" does the same for staff operators
        admin_user = User.objects.create_superuser("ada", password="pw")
        web.force_login(admin_user)
        fixture.write_text(json.dumps([]))
        page = web.post("/admin/cluster/node/", {"action": "probe_nodes", "_selected_action": [node.pk]}, follow=True)
        assert page.status_code == 200
        said = [str(m) for m in page.context["messages"]]
        assert said[0].startswith("box probed: GPUs: none found (cannot read GPU fixture") and said[0].endswith(
            "-> none found"), said  # fmt: skip
        assert Node.objects.get(pk=node.pk).gpu_count == 0
        # and an unknown node is one line
        with pytest.raises(CommandError, match="no node named 'nope'"):
            call_command("node_probe", "nope", "--as", "olga")
    finally:
        pool.close_all()


@pytest.mark.e2e
def test_node_add_over_ssh_pins_the_key_finds_torch_records_and_exports_the_node(
    loopback, db, fast_settings, tmp_path, monkeypatch
):
    """Covers: `node add USER@HOST:PORT --key K` against a real sshd: the host key read, shown and pinned, the agent
    started over SSH with the node's own python3, the survey and the controller's route (`ip route get`) of an SSH
    node, the row recorded and exported, a second machine added through the `ugro` client and the API (201, the
    same lines, audited), and a port where no sshd listens or a key the sshd refuses refused with nothing
    recorded."""
    fast_settings.UGRO = {**fast_settings.UGRO, "KNOWN_HOSTS": str(tmp_path / "known_hosts")}
    lb = loopback.nodes[0]
    operator()
    workdir = workdir_with_torch(tmp_path / "wd")
    target = f"{loopback.user}@{lb.address}:{lb.port}"
    out = io.StringIO()
    try:
        # when an operator adds the machine
        call_command("node_add", target, "--key", str(loopback.client_key), "--workdir", str(workdir),
                     "--name", "gpu-box", "--as", "olga", stdout=out)  # fmt: skip
    finally:
        pool.close_all()
    text = out.getvalue()
    node = Node.objects.get(name="gpu-box")
    # then its host key is the one OpenSSH prints for the sshd's key, shown and pinned
    pub = subprocess.run(["ssh-keygen", "-lf", f"{loopback.host_key}.pub"], capture_output=True, text=True, check=True)
    expected = pub.stdout.split()[1]
    assert node.host_key_fingerprint == expected and node.host_key_source == "node add"
    assert text.splitlines()[0] == f"gpu-box: host key {expected} (ssh-ed25519) pinned"
    # and the row says how to reach it, the python that runs the agent, and the torch env's torchrun
    assert (node.address, node.ssh_port, node.user, node.key_path, node.workdir) == (
        lb.address, lb.port, loopback.user, str(loopback.client_key), str(workdir))  # fmt: skip
    torchrun = str(workdir / ".venv-node" / "bin" / "torchrun")
    assert node.agent_python.startswith("/") and node.torchrun_command == torchrun
    env = next(p for p in node.probed["pythons"] if p["torchrun"] == torchrun)
    assert env["torch"] and f"gpu-box: python {env['path']}: {env['python']}, torch {env['torch']}" in text
    # and the route: the controller reaches 127.0.0.x on lo, which holds it on the node too
    assert node.probed["route"]["controller_dev"] == "lo" and node.probed["route"]["node_interface"] == "lo"
    assert text.splitlines()[-1].startswith(f"node gpu-box added ({target}, no GPU, working directory {workdir})")
    exported = yaml.safe_load(call_command_out("export_cluster"))["nodes"]["gpu-box"]
    assert (exported["ip"], exported["ssh_port"], exported["torchrun"], exported["gpus"]) == (
        lb.address, lb.port, torchrun, 0)  # fmt: skip

    # when an operator adds a second machine with the `ugro` client, through the API
    from accounts.models import AuditEvent
    from accounts.tokens import create_token
    from ugro_client import cli

    _, token = create_token(User.objects.get(username="olga"), "ops", "operate")
    web = DjangoClient()
    answers = []

    def post(self, path, body=None):
        got = web.post(f"/api/v1/{path}", body or {}, content_type="application/json",
                       HTTP_AUTHORIZATION=f"Bearer {token}")  # fmt: skip
        answers.append(got.status_code)
        assert got.status_code in (200, 201), got.content
        return got.json()

    monkeypatch.setattr(cli.Client, "post", post)
    monkeypatch.setenv("UGRO_TOKEN", token)
    second = f"{loopback.user}@{loopback.nodes[1].address}:{lb.port}"
    plain = tmp_path / "wd2"
    plain.mkdir()
    shown = io.StringIO()
    monkeypatch.setattr("sys.stdout", shown)
    try:
        code = cli.run(["node", "add", second, "--key", str(loopback.client_key), "--workdir", str(plain), "--name",
                        "box-two"])  # fmt: skip
    finally:
        monkeypatch.undo()
        pool.close_all()
    lines = shown.getvalue().splitlines()
    assert code == 0 and answers == [201], shown.getvalue()
    two = Node.objects.get(name="box-two")
    assert (two.address, two.workdir, two.host_key_fingerprint) == (loopback.nodes[1].address, str(plain), expected)
    assert lines[0] == f"box-two: host key {expected} (ssh-ed25519) pinned"
    assert lines[-1].startswith(f"node box-two added ({second}, no GPU, working directory {plain})")
    assert AuditEvent.objects.filter(action="node_add", target="box-two", outcome="ok", username="olga").exists()

    # when a port where nothing listens is added: one line, nothing recorded
    port = free_port()
    with pytest.raises(CommandError) as info:
        call_command("node_add", f"{loopback.user}@{lb.address}:{port}", "--key", str(loopback.client_key),
                     "--name", "nobody", "--as", "olga")  # fmt: skip
    assert "cannot reach nobody" in str(info.value) and "\n" not in str(info.value)
    # and so is a key the node does not accept
    stranger = tmp_path / "stranger"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True)
    with pytest.raises(CommandError) as info:
        call_command("node_add", f"{loopback.user}@{loopback.nodes[2].address}:{lb.port}", "--key", str(stranger),
                     "--name", "nobody", "--as", "olga")  # fmt: skip
    assert "cannot reach nobody" in str(info.value) and "\n" not in str(info.value)
    assert not Node.objects.filter(name="nobody").exists()


def call_command_out(*args) -> str:
    out = io.StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()
