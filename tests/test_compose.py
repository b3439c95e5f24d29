"""docker-compose.yml and the Dockerfile, validated by docker-compose itself (no daemon needed for `config`)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import yaml

from .conftest import REPO

CONTROLLER = ("web", "worker")


@pytest.fixture(scope="module")
def compose() -> dict:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed (apt-get install docker-compose; .ci/run does)")
    done = subprocess.run([binary, "-f", str(REPO / "docker-compose.yml"), "config"], cwd=REPO,
                          env={**os.environ, "HOME": os.environ.get("HOME", "/root")},
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)


def test_controller_services_share_one_built_image_and_install_nothing_at_start(compose):
    services = compose["services"]
    images = {services[name]["image"] for name in CONTROLLER}
    assert len(images) == 1
    for name in CONTROLLER:
        service = services[name]
        assert service["build"]["context"] == str(REPO)
        command = " ".join(service["command"]) if isinstance(service["command"], list) else service["command"]
        assert "pip" not in command, f"{name} installs at start: {command}"
        assert service["restart"] == "unless-stopped"
        assert "/app" not in [v.split(":")[1] for v in service.get("volumes", [])], "code comes from the image"


def test_the_schedule_runs_in_the_worker_with_no_beat_service_to_lose(compose):
    services = compose["services"]
    assert "beat" not in services
    assert not any("beat" in " ".join(s.get("command") or []) for s in services.values())
    assert services["worker"]["command"] == ["bin/worker"]


def test_databases_have_health_checks_and_the_controller_waits_for_them(compose):
    services = compose["services"]
    for name in ("redis", "postgres"):
        assert services[name]["healthcheck"]["test"], name
        assert services[name]["restart"] == "unless-stopped"
    for name in (*CONTROLLER, "migrate"):
        depends = services[name]["depends_on"]
        assert depends["redis"]["condition"] == "service_healthy", name
        assert depends["postgres"]["condition"] == "service_healthy", name
    # migrations run once, before web and worker start, and that one-shot is not restarted
    assert "migrate" in " ".join(services["migrate"]["command"])
    assert services["migrate"]["restart"] == "no"
    for name in CONTROLLER:
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"


def test_dockerfile_is_slim_non_root_and_installs_requirements_at_build():
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")  # one line per instruction
    lines = [x.strip() for x in text.splitlines() if x.strip() and not x.startswith("#")]
    assert lines[0].startswith("FROM python:3.1") and lines[0].endswith("-slim")
    steps = [x.split()[0] for x in lines]
    install = next(i for i, x in enumerate(lines) if x.startswith("RUN") and "pip install -r" in x)
    copy_code = steps.index("COPY", steps.index("COPY") + 1)
    assert steps.index("COPY") < install < copy_code, "requirements install before the code is copied (cached)"
    user = next(x for x in lines if x.startswith("USER "))
    assert user.split()[1] not in ("root", "0")
    assert lines.index(user) > install and "CMD" in steps and steps.index("CMD") > lines.index(user)
    assert ".venv" in (REPO / ".dockerignore").read_text().split()
