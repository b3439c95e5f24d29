"""The quickstart's helpers: a local demo node and a first admin."""

from __future__ import annotations

import getpass
import io
import sys
import types

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command

from cluster.models import Node

pytestmark = pytest.mark.django_db


def test_demo_node_is_added_once(settings):
    out = io.StringIO()
    call_command("demo_node", stdout=out)
    node = Node.objects.get()
    assert node.transport == Node.Transport.LOCAL and node.role == Node.Role.MASTER
    assert "added demo node 'local'" in out.getvalue()
    call_command("demo_node", stdout=out)
    assert Node.objects.count() == 1


def test_first_admin_is_created_with_a_printed_password(settings, tmp_path):
    settings.DATA_DIR = tmp_path
    get_user_model().objects.filter(username=getpass.getuser()).delete()  # a fresh install: no account yet
    out = io.StringIO()
    call_command("ensure_admin", stdout=out)
    # named like the OS user, so the README's manage.py commands run as it without --as
    user = get_user_model().objects.get(username=getpass.getuser())
    password = (tmp_path / "admin_password.txt").read_text().split()[1]
    assert user.is_superuser and user.check_password(password) and password in out.getvalue()
    call_command("ensure_admin", stdout=out)
    assert get_user_model().objects.filter(is_superuser=True).count() == 1


def _fake_torchrun(directory) -> str:
    directory.mkdir(parents=True)
    exe = directory / "torchrun"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    return str(exe)


def test_demo_node_is_repointed_when_its_venv_moved(settings, tmp_path):
    # given the demo node was made with a training env that has since moved away
    old_env = tmp_path / "old-venv" / "bin"
    call_command("demo_node", "--torchrun", _fake_torchrun(old_env), stdout=io.StringIO())
    (old_env / "torchrun").rename(tmp_path / "moved-torchrun")
    # when bin/start runs demo_node again
    out = io.StringIO()
    call_command("demo_node", stdout=out)
    # then the node points at the torchrun found now (the repo's node env), and says so
    node = Node.objects.get()
    expected = settings.BASE_DIR / ".venv-node" / "bin" / "torchrun"
    assert expected.exists(), "the test needs the node env (bin/setup --node-env)"
    assert node.torchrun_command == str(expected)
    assert f"torchrun_command {old_env / 'torchrun'} -> {expected}" in out.getvalue()
    assert Node.objects.count() == 1


def test_demo_node_keeps_a_torchrun_that_still_runs_and_fixes_a_moved_workdir(settings, tmp_path):
    # given a demo node whose torchrun the user chose (and which still exists), in a repo dir now gone
    mine = _fake_torchrun(tmp_path / "mine" / "bin")
    call_command("demo_node", "--torchrun", mine, stdout=io.StringIO())
    Node.objects.update(workdir=str(tmp_path / "old-checkout"))
    # when demo_node runs again
    out = io.StringIO()
    call_command("demo_node", stdout=out)
    # then the torchrun is kept and the working dir is the repo again
    node = Node.objects.get()
    assert node.torchrun_command == mine
    assert node.workdir == str(settings.BASE_DIR)
    assert "torchrun_command" not in out.getvalue() and "workdir" in out.getvalue()


class FakeNVML(types.ModuleType):
    """pynvml as nvidia-ml-py has it, with `count` GPUs (None: the driver library cannot be loaded)."""

    def __init__(self, count: int | None) -> None:
        super().__init__("pynvml")
        self.count = count

    def nvmlInit(self) -> None:  # noqa: N802 (NVML's names)
        if self.count is None:
            raise OSError("NVML Shared Library Not Found")

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return self.count

    def nvmlShutdown(self) -> None:  # noqa: N802
        pass


def _fake_nvidia_smi(directory, gpus: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    exe = directory / "nvidia-smi"
    lines = "".join(f"echo 'GPU {i}: NVIDIA H200 (UUID: GPU-{i})'\n" for i in range(gpus))
    exe.write_text(f'#!/bin/sh\n[ "$1" = -L ] || exit 2\n{lines}')
    exe.chmod(0o755)


@pytest.mark.parametrize(
    ("nvml", "smi_lines", "expected"),
    [(8, 2, 8), (0, 2, 0), (None, 2, 2), (None, None, 0)],
    ids=["nvml-counts", "nvml-says-none", "no-nvml-smi-lines", "neither"],
)
def test_demo_node_counts_gpus_with_nvml_else_nvidia_smi_lines(monkeypatch, tmp_path, nvml, smi_lines, expected):
    # given NVML answering (or failing) and nvidia-smi listing some GPUs (or missing)
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML(nvml))
    if smi_lines is not None:
        _fake_nvidia_smi(tmp_path / "bin", smi_lines)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")
    # when demo_node adds this machine
    out = io.StringIO()
    call_command("demo_node", stdout=out)
    # then the node has the GPUs NVML counted, else the lines nvidia-smi -L printed, else none
    assert Node.objects.get().gpu_count == expected
    assert f"{expected} GPU(s)" in out.getvalue()
