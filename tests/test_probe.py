"""Tests of the node probe (cluster/node/probe.py), in-process and through the real local agent.

No machine here has a GPU: GPU readings come from the fixture reader, recorded nvidia-smi output,
a fake nvidia-smi on PATH, or a fake pynvml module.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from cluster.links import AGENT_FILES, AgentRequestError, Endpoint, NodeLink

REPO_ROOT = Path(__file__).resolve().parents[1]
PROBE_PATH = REPO_ROOT / "cluster" / "node" / "probe.py"
SMI_DATA = Path(__file__).resolve().parent / "data" / "nvidia_smi"
GPU_KEYS = {"index", "name", "uuid", "util_percent", "mem_used_mb", "mem_total_mb", "temp_c", "power_w", "driver",
            "energy_mj"}  # fmt: skip
SAMPLE_KEYS = {
    "time",
    "hostname",
    "uptime_s",
    "load",
    "cpu_percent",
    "ram_percent",
    "ram_total_mb",
    "disk_percent",
    "disk_free_gb",
    "gpus",
    "gpu_source",
    "gpu_error",
    "rapl",
    "rapl_error",
    "job_procs",
    "workdir_id",
}
FIXTURE_GPUS = [
    {
        "index": 0,
        "name": "NVIDIA GeForce RTX 4070",
        "uuid": "GPU-5f2a9c1e-3b7d-4e21-9a0c-8d6f1b2e4c73",
        "util_percent": 37,
        "mem_used_mb": 2113,
        "mem_total_mb": 12282,
        "temp_c": 54,
        "power_w": 41.23,
        "driver": None,  # the recorded query predates driver_version; the fixture file has none either
        "energy_mj": None,  # nvidia-smi has no energy counter
    },
    {
        "index": 1,
        "name": "NVIDIA GeForce RTX 4070",
        "uuid": "GPU-0e9b2f6d-47a1-c3e8-5d92-b16f08a7c43e",
        "util_percent": 0,
        "mem_used_mb": 4,
        "mem_total_mb": 12282,
        "temp_c": 33,
        "power_w": None,
        "driver": None,
        "energy_mj": None,
    },
]
# The python the local agent runs under: the node default when this machine has it.
NODE_PYTHON = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
WAIT_S = 15.0
CAT = shutil.which("cat") or "/bin/cat"  # fake nvidia-smi scripts run with a PATH of their own


def _no_gpu_here() -> bool:
    return shutil.which("nvidia-smi") is None and not Path("/dev/nvidiactl").exists()


@pytest.fixture(scope="module")
def probe() -> types.ModuleType:
    """probe.py loaded as a module of its own (it is plain python, not a package module)."""
    spec = importlib.util.spec_from_file_location("ugro_node_probe", PROBE_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture()
def fixture_file(tmp_path: Path) -> Path:
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps(FIXTURE_GPUS))
    return path


@pytest.fixture()
def no_gpu_tools(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, probe: types.ModuleType) -> None:
    """No pynvml importable and no nvidia-smi on PATH, whatever this machine has."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(probe, "_probe_nvml", None)


def _listener(address: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket()
    sock.bind((address, 0))
    sock.listen(8)
    return sock


def _closed_port() -> int:
    """A loopback port that nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_until(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting: {what}")
        time.sleep(0.05)


def _fake_smi(directory: Path, body: str) -> None:
    directory.mkdir(exist_ok=True)
    exe = directory / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\n{body}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)


# -- source constraints -----------------------------------------------------------------------


def test_probe_source_is_python38_and_concatenation_safe() -> None:
    # Given the probe source, which is sent to nodes with python >= 3.8 and concatenated
    source = PROBE_PATH.read_text()
    # Then it parses as 3.8 grammar and has no __future__ import (only legal at a file's top)
    ast.parse(source, feature_version=(3, 8))
    assert "from __future__" not in source
    assert AGENT_FILES.index("probe.py") < AGENT_FILES.index("agent.py")


def test_probe_module_globals_do_not_shadow_agent_names(probe: types.ModuleType) -> None:
    # Given the names both files define at module level
    agent_tree = ast.parse((PROBE_PATH.parent / "agent.py").read_text())
    agent_names = {n.name for n in agent_tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    probe_tree = ast.parse(PROBE_PATH.read_text())
    probe_names = {n.name for n in probe_tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    # Then no probe function is silently replaced by an agent one when concatenated
    assert not probe_names & agent_names
    assert set(probe.EXTRA_OPS) == {"probe", "port_check", "port_free", "listen", "workdir_id"}


# -- nvidia-smi parsing -------------------------------------------------------------------------


def test_parse_recorded_rtx4070(probe: types.ModuleType) -> None:
    # Given recorded output of the probe's query on a one-GPU RTX 4070 box
    text = (SMI_DATA / "rtx4070.csv").read_text()
    # When it is parsed
    gpus = probe.parse_nvidia_smi_csv(text)
    # Then every field is typed
    assert gpus == [FIXTURE_GPUS[0]]


def test_parse_recorded_two_gpus_with_na_power(probe: types.ModuleType) -> None:
    # Given a two-GPU box where one GPU reports its power draw as [N/A]
    gpus = probe.parse_nvidia_smi_csv((SMI_DATA / "two_gpu_power_na.csv").read_text())
    # Then both GPUs are read and the missing reading is None, not an error
    assert [g["index"] for g in gpus] == [0, 1]
    assert gpus[0]["power_w"] == 312.45 and gpus[0]["temp_c"] == 71
    assert gpus[0]["mem_used_mb"] == 22715 and gpus[0]["mem_total_mb"] == 24576
    assert gpus[1]["power_w"] is None
    assert gpus[1]["util_percent"] == 0 and gpus[1]["name"] == "NVIDIA GeForce RTX 3090"
    assert all(set(g) == GPU_KEYS for g in gpus)


def test_parse_not_supported_and_blank_lines(probe: types.ModuleType) -> None:
    # Given a GPU that does not support utilisation or power readings, and stray blank lines
    text = "\n0, Tesla T4, GPU-1, [Not Supported], 0, 15360, 41, [Not Supported]\n\n"
    # Then those fields are None
    (gpu,) = probe.parse_nvidia_smi_csv(text)
    assert gpu["util_percent"] is None and gpu["power_w"] is None
    assert gpu["temp_c"] == 41 and gpu["name"] == "Tesla T4"


def test_parse_rejects_unexpected_lines(probe: types.ModuleType) -> None:
    # Given output that is not the probe's query (e.g. an error message on stdout)
    # Then parsing fails loudly instead of inventing GPUs
    with pytest.raises(ValueError, match="unexpected nvidia-smi line"):
        probe.parse_nvidia_smi_csv("NVIDIA-SMI has failed, because it couldn't communicate, with the driver\n")


def test_parse_empty_output_is_no_gpus(probe: types.ModuleType) -> None:
    assert probe.parse_nvidia_smi_csv("") == []


# -- GPU readers through op_probe -----------------------------------------------------------------


def test_probe_fixture_reader(probe: types.ModuleType, fixture_file: Path) -> None:
    # Given a GPU fixture file on the node
    # When the probe is asked to read GPUs from it
    sample = probe.op_probe({"op": "probe", "gpu_reader": f"fixture:{fixture_file}"})
    # Then the sample carries those GPUs and every documented field
    assert set(sample) == SAMPLE_KEYS
    assert sample["gpus"] == FIXTURE_GPUS
    assert sample["gpu_source"] == "fixture" and sample["gpu_error"] is None
    json.dumps(sample)


def test_probe_fixture_fills_missing_keys(probe: types.ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "partial.json"
    path.write_text(json.dumps([{"index": 3, "temp_c": 90, "extra": "ignored"}]))
    (gpu,) = probe.op_probe({"gpu_reader": f"fixture:{path}"})["gpus"]
    assert set(gpu) == GPU_KEYS and gpu["index"] == 3 and gpu["temp_c"] == 90 and gpu["uuid"] is None


def test_probe_fixture_missing_file_reports_why(probe: types.ModuleType, tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    sample = probe.op_probe({"gpu_reader": f"fixture:{missing}"})
    assert sample["gpus"] == [] and sample["gpu_source"] == "none"
    assert str(missing) in sample["gpu_error"]


def test_probe_unknown_reader_fails(probe: types.ModuleType) -> None:
    with pytest.raises(Exception, match="unknown gpu_reader"):
        probe.op_probe({"gpu_reader": "magic"})


def test_probe_auto_without_gpu_tools_says_why(probe: types.ModuleType, no_gpu_tools: None) -> None:
    # Given a node with neither pynvml nor nvidia-smi
    # When the probe reads GPUs the default way
    sample = probe.op_probe({"op": "probe"})
    # Then it reports no GPUs, no source, and both reasons
    assert sample["gpus"] == [] and sample["gpu_source"] == "none"
    assert "pynvml" in sample["gpu_error"] and "nvidia-smi was not found" in sample["gpu_error"]


@pytest.mark.skipif(not _no_gpu_here(), reason="this machine has NVIDIA tools")
def test_probe_auto_on_this_machine_has_no_gpus(probe: types.ModuleType) -> None:
    # Given this GPU-less machine as it is (the controller venv has pynvml but no driver library)
    sample = probe.op_probe({})
    # Then there are no GPUs and the reason is given
    assert sample["gpus"] == [] and sample["gpu_source"] == "none"
    assert sample["gpu_error"] and "nvidia-smi" in sample["gpu_error"]


def test_probe_nvidia_smi_reader_runs_the_query(
    probe: types.ModuleType, no_gpu_tools: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a fake nvidia-smi that answers the probe's exact query with recorded output
    bin_dir = tmp_path / "bin"
    query = f"--query-gpu={probe.PROBE_SMI_FIELDS}"
    recorded = SMI_DATA / "two_gpu_power_na.csv"
    _fake_smi(
        bin_dir,
        f'[ "$1" = "{query}" ] && [ "$2" = "--format=csv,noheader,nounits" ] || exit 2\n{CAT} "{recorded}"',
    )
    monkeypatch.setenv("PATH", str(bin_dir))
    # When the probe falls back to it (pynvml is missing)
    sample = probe.op_probe({"gpu_reader": "auto"})
    # Then the GPUs come from nvidia-smi
    assert sample["gpu_source"] == "nvidia-smi" and sample["gpu_error"] is None
    assert sample["gpus"] == probe.parse_nvidia_smi_csv(recorded.read_text())


def test_probe_nvidia_smi_failure_is_reported(
    probe: types.ModuleType, no_gpu_tools: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given an nvidia-smi that cannot talk to the driver
    bin_dir = tmp_path / "bin"
    _fake_smi(bin_dir, 'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver."\nexit 9')
    monkeypatch.setenv("PATH", str(bin_dir))
    sample = probe.op_probe({"gpu_reader": "nvidia-smi"})
    # Then the probe still answers, with the driver's message as the GPU error
    assert sample["gpus"] == [] and sample["gpu_source"] == "none"
    assert "exited 9" in sample["gpu_error"] and "NVIDIA driver" in sample["gpu_error"]


class _NotSupported(Exception):
    pass


def _fake_pynvml() -> types.SimpleNamespace:
    def power(handle: int) -> int:
        if handle == 1:
            raise _NotSupported("Not Supported")
        return 41230

    def energy(handle: int) -> int:
        if handle == 1:
            raise _NotSupported("Not Supported")
        return 987_654_321  # millijoules since the driver loaded

    return types.SimpleNamespace(
        NVML_TEMPERATURE_GPU=0,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: b"NVIDIA GeForce RTX 4070",  # older pynvml returns bytes
        nvmlDeviceGetUUID=lambda h: FIXTURE_GPUS[h]["uuid"],
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=FIXTURE_GPUS[h]["util_percent"]),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(
            used=FIXTURE_GPUS[h]["mem_used_mb"] << 20, total=FIXTURE_GPUS[h]["mem_total_mb"] << 20
        ),
        nvmlDeviceGetTemperature=lambda h, sensor: FIXTURE_GPUS[h]["temp_c"],
        nvmlDeviceGetPowerUsage=power,
        nvmlDeviceGetTotalEnergyConsumption=energy,
        nvmlSystemGetDriverVersion=lambda: b"580.65.06",
    )


def test_probe_nvml_reader(probe: types.ModuleType, no_gpu_tools: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given an importable pynvml whose second GPU does not support power readings nor the energy counter
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    # When the probe reads GPUs the default way
    sample = probe.op_probe({})
    # Then NVML is the source, units match nvidia-smi's, and the unsupported field is None
    assert sample["gpu_source"] == "nvml" and sample["gpu_error"] is None
    energy = [987_654_321, None]
    assert sample["gpus"] == [dict(g, driver="580.65.06", energy_mj=energy[i]) for i, g in enumerate(FIXTURE_GPUS)]


def test_the_driver_version_is_read_from_nvidia_smi_too(probe: types.ModuleType) -> None:
    text = "0, NVIDIA H200, GPU-1, 0, 1, 143771, 30, 75.2, 570.133.20\n"
    (gpu,) = probe.parse_nvidia_smi_csv(text)
    assert gpu["driver"] == "570.133.20" and gpu["mem_total_mb"] == 143771


# -- system readings -------------------------------------------------------------------------------


def test_cpu_percent_uses_the_previous_reading(probe: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given scripted /proc/stat readings (busy, total jiffies) and a recorded sleep
    readings = iter([(100, 1000), (150, 1100), (250, 1300), (255, 1305), (258, 1308), (460, 1510)])
    sleeps: list[float] = []
    monkeypatch.setattr(probe, "_probe_cpu_times", lambda: next(readings))
    monkeypatch.setattr(probe.time, "sleep", sleeps.append)
    monkeypatch.setattr(probe, "_probe_cpu_last", None)
    monkeypatch.setattr(probe, "_probe_cpu_value", None)
    monkeypatch.setattr(probe, "PROBE_CPU_MIN_JIFFIES", 10)
    # When the first probe runs it takes a short sample
    assert probe._probe_cpu_percent() == 50.0
    assert sleeps == [0.1]
    # And a later probe uses the delta since the previous one, without sleeping
    assert probe._probe_cpu_percent() == 50.0
    # And probes moments apart (5, then 8 jiffies) repeat the last value, keeping the baseline
    assert probe._probe_cpu_percent() == 50.0
    assert probe._probe_cpu_percent() == 50.0
    # And the next one measures from that baseline: (460 - 250) / (1510 - 1300)
    assert probe._probe_cpu_percent() == 100.0
    assert sleeps == [0.1]


def test_system_fields_are_sane(probe: types.ModuleType, tmp_path: Path) -> None:
    # Given a workdir that does not exist yet (its filesystem is its nearest parent's)
    sample = probe.op_probe({"gpu_reader": "fixture:/nonexistent", "workdir": str(tmp_path / "a" / "b")})
    assert 0 <= sample["cpu_percent"] <= 100
    assert 0 < sample["ram_percent"] < 100 and sample["ram_total_mb"] > 0
    assert 0 <= sample["disk_percent"] <= 100 and sample["disk_free_gb"] >= 0
    assert sample["uptime_s"] > 0 and len(sample["load"]) == 3
    assert sample["hostname"] == socket.gethostname()


def test_job_procs_found_by_environment(probe: types.ModuleType) -> None:
    # Given a process started with a UGRO job tag in its environment
    env = {**os.environ, "UGRO_JOB": "job-probe-test", "UGRO_NODE": "n1"}
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "x" * 300], env=env)
    try:
        for _ in range(100):  # until it has exec'd: before that /proc shows the parent's environment
            if b"x" * 300 in Path(f"/proc/{proc.pid}/cmdline").read_bytes():
                break
            time.sleep(0.02)
        # When the probe runs
        procs = [p for p in probe.op_probe({"gpu_reader": "fixture:/x"})["job_procs"] if p["pid"] == proc.pid]
        # Then it is listed with its job, node and (truncated) command line
        assert len(procs) == 1
        assert procs[0]["job"] == "job-probe-test" and procs[0]["node"] == "n1"
        assert procs[0]["cmd"].startswith(sys.executable) and len(procs[0]["cmd"]) == 200
    finally:
        proc.kill()
        proc.wait()


# -- network ops -------------------------------------------------------------------------------------


def test_port_check_reaches_a_listener(probe: types.ModuleType) -> None:
    with _listener() as sock:
        result = probe.op_port_check({"host": "127.0.0.1", "port": sock.getsockname()[1], "timeout": 3})
    assert result["ok"] is True and result["error"] is None and result["ms"] >= 0


def test_port_check_refused(probe: types.ModuleType) -> None:
    result = probe.op_port_check({"host": "127.0.0.1", "port": _closed_port(), "timeout": 3})
    assert result["ok"] is False and "refused" in result["error"].lower()


def test_port_free(probe: types.ModuleType) -> None:
    # Given a port with a listener on it
    with _listener() as sock:
        port = sock.getsockname()[1]
        busy = probe.op_port_free({"port": port, "address": "127.0.0.1"})
    # Then it is not free while listened on, and free once released
    assert busy["free"] is False and busy["error"]
    assert probe.op_port_free({"port": port, "address": "127.0.0.1"}) == {"free": True, "error": None}


def test_listen_then_port_check(probe: types.ModuleType) -> None:
    # Given the probe listening on a free loopback port until one connection arrives
    res = probe.op_listen({"address": "127.0.0.1", "port": 0, "seconds": 30, "expect": 1})
    port = res["port"]
    assert res["listening"] is True
    # Then the port is taken and reachable
    assert probe.op_port_free({"port": port, "address": "127.0.0.1"})["free"] is False
    assert probe.op_port_check({"host": "127.0.0.1", "port": port, "timeout": 3})["ok"] is True
    # And after that connection the port is released for torchrun
    _wait_until(lambda: probe.op_port_free({"port": port, "address": "127.0.0.1"})["free"], "listener closed")


def test_listen_gives_up_after_seconds(probe: types.ModuleType) -> None:
    port = probe.op_listen({"address": "127.0.0.1", "port": 0, "seconds": 0.2})["port"]
    _wait_until(lambda: probe.op_port_free({"port": port, "address": "127.0.0.1"})["free"], "listener expired")


def test_listen_on_a_busy_port_fails(probe: types.ModuleType) -> None:
    with _listener() as sock:
        with pytest.raises(Exception, match="cannot listen"):
            probe.op_listen({"address": "127.0.0.1", "port": sock.getsockname()[1], "seconds": 1})


# -- the real agent over a local link --------------------------------------------------------------------


@pytest.fixture()
def link():
    node_link = NodeLink(Endpoint("local", "127.0.0.1", transport="local", python=NODE_PYTHON))
    yield node_link
    node_link.close()


def test_agent_probe_returns_fixture_gpus(link: NodeLink, fixture_file: Path) -> None:
    # Given the real agent (probe.py + agent.py) running under the node python
    # When the controller asks for a probe with the fixture reader
    sample = link.request("probe", gpu_reader=f"fixture:{fixture_file}")
    # Then the fixture GPUs come back over the link
    assert sample["gpus"] == FIXTURE_GPUS
    assert sample["gpu_source"] == "fixture" and set(sample) == SAMPLE_KEYS
    # And a second probe on the warm agent works too (cpu delta since the first)
    assert 0 <= link.request("probe", gpu_reader=f"fixture:{fixture_file}")["cpu_percent"] <= 100


@pytest.mark.skipif(not _no_gpu_here(), reason="this machine has NVIDIA tools")
def test_agent_probe_auto_without_gpus(link: NodeLink) -> None:
    sample = link.request("probe")
    assert sample["gpus"] == [] and sample["gpu_source"] == "none" and sample["gpu_error"]


def test_agent_network_ops_and_errors(link: NodeLink) -> None:
    port = link.request("listen", address="127.0.0.1", port=0, seconds=30, expect=1)["port"]
    assert link.request("port_free", address="127.0.0.1", port=port)["free"] is False
    assert link.request("port_check", host="127.0.0.1", port=port, timeout=3)["ok"] is True
    # A failing op comes back as the agent's error, without the exception class in front
    with pytest.raises(AgentRequestError, match=r"^unknown gpu_reader"):
        link.request("probe", gpu_reader="magic")


def test_agent_listener_not_kept_by_started_ranks(link: NodeLink, tmp_path: Path) -> None:
    # Given the agent listening on the rendezvous port while it starts a long-lived rank
    # (the rank wrapper is a fork of the agent and lives as long as the rank)
    port = link.request("listen", address="127.0.0.1", port=0, seconds=1)["port"]
    tag, node = f"probe-test-{os.getpid()}", "local"
    link.request(
        "start",
        argv=[sys.executable, "-c", "import time; time.sleep(60)"],
        cwd=str(tmp_path),
        log=str(tmp_path / "rank.log"),
        exit_file=str(tmp_path / "rank.exit"),
        env={"UGRO_JOB": tag, "UGRO_NODE": node},
    )
    try:
        assert link.request("procs", tag=tag, node=node)["pids"]
        # Then once the listen window ends the port is free for torchrun, rank still running
        _wait_until(lambda: link.request("port_free", address="127.0.0.1", port=port)["free"], "port released")
        assert link.request("procs", tag=tag, node=node)["pids"]
    finally:
        link.request("kill", tag=tag, node=node, signal=9)
