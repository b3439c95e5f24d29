"""cluster.yaml import/export in the user's own format."""

from __future__ import annotations

import getpass
import io

import pytest
from django.core.management import CommandError, call_command

from cluster.config_yaml import ConfigError, export_cluster, import_cluster, parse_cluster_yaml
from cluster.models import ClusterSettings, Node

pytestmark = pytest.mark.django_db

USER_FILE = """\
cluster:
  name: "Home AI Lab Trondheim"
  master_ip: "192.168.1.100"
  master_port: 29500

nodes:
  gpu-master:
    ip: "192.168.1.100"
    user: "${USER}"
    hostname: "gpu-master"
    gpu: "RTX 5070 Ti"
    vram_gb: 12
    rank: 0
    role: "master"

  gpu1:
    ip: "192.168.1.101"
    user: "ob"
    hostname: "gpu1"
    gpu: "RTX 4070"
    vram_gb: 8
    rank: 1
    role: "worker"

  gpu2:
    ip: "192.168.1.102"
    user: "$(whoami)"
    hostname: "gpu2"
    gpu: "RTX 3070 Ti"
    vram_gb: 8
    rank: 2
    role: "worker"

training:
  batch_size_per_gpu: 1
  gradient_accumulation: 8
  default_model: "unsloth/tinyllama-bnb-4bit"
  default_dataset: "wikitext"

paths:
  project_base: "~/ai-cluster"
  scripts: "~/ai-cluster/scripts"
  results: "~/ugro/data/experiments"
"""


def test_the_users_file_imports_exactly():
    summary = import_cluster(USER_FILE)
    assert summary.created == ["gpu-master", "gpu1", "gpu2"]
    master = Node.objects.get(name="gpu-master")
    assert (master.address, master.role, master.gpu_model, master.gpu_vram_gb) == (
        "192.168.1.100", "master", "RTX 5070 Ti", 12.0)  # fmt: skip
    assert master.user == getpass.getuser()
    assert Node.objects.get(name="gpu2").user == getpass.getuser()
    assert Node.objects.get(name="gpu1").user == "ob"
    assert master.gpu_count == 1 and master.workdir == "~/ai-cluster"
    cs = ClusterSettings.load()
    assert cs.rendezvous_port == 29500 and cs.master_address == "192.168.1.100"
    assert cs.default_script == "~/ai-cluster/scripts/train_production.py"
    assert cs.training["default_model"] == "unsloth/tinyllama-bnb-4bit"


def test_reimport_updates_never_duplicates_and_a_fourth_node_is_one_edit():
    import_cluster(USER_FILE)
    grown = USER_FILE.replace(
        "training:", '  gpu3:\n    ip: "192.168.1.103"\n    gpu: "RTX 3060"\n    vram_gb: 12\n    rank: 3\n\ntraining:'
    ).replace("vram_gb: 8\n    rank: 1", "vram_gb: 9\n    rank: 1")
    summary = import_cluster(grown)
    assert summary.created == ["gpu3"] and sorted(summary.updated) == ["gpu-master", "gpu1", "gpu2"]
    assert Node.objects.count() == 4
    assert Node.objects.get(name="gpu1").gpu_vram_gb == 9


def test_a_node_dropped_from_the_file_is_disabled_not_deleted():
    import_cluster(USER_FILE)
    shrunk = USER_FILE.split("  gpu2:")[0] + "training:" + USER_FILE.split("training:")[1]
    summary = import_cluster(shrunk)
    assert summary.disabled == ["gpu2"]
    assert Node.objects.get(name="gpu2").enabled is False


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (("vram_gb: 12", "vram_gb: twelve"), r"nodes\.gpu-master\.vram_gb: must be int or float.*\(line 12\)"),
        (('role: "worker"\n\n  gpu2', 'role: "boss"\n\n  gpu2'), r"nodes\.gpu1\.role: must be 'master' or 'worker'"),
        (('ip: "192.168.1.101"', 'ipp: "192.168.1.101"'), r"nodes\.gpu1\.ipp: unknown key"),
        (("  gpu1:", "  gpu;1:"), r"nodes\.gpu;1: node name 'gpu;1' is not allowed"),
        (("master_port: 29500", "master_port: 99999"), r"cluster\.master_port: must be a port number"),
        (('role: "worker"\n\n  gpu2', 'role: "master"\n\n  gpu2'), r"more than one node has role master"),
        (("nodes:", "nodes: [\n"), r"not valid YAML \(line \d+\)"),
        (('user: "ob"', 'user: "ob; rm -rf /"'), r"nodes\.gpu1\.user: user .* is not allowed"),
        (('user: "ob"', 'user: "ob"\n    gpu_reader: "magic"'), r"nodes\.gpu1\.gpu_reader: must be auto"),
    ],
)
def test_a_bad_file_names_the_key_and_line_and_imports_nothing(edit, message):
    bad = USER_FILE.replace(*edit)
    assert bad != USER_FILE
    with pytest.raises(ConfigError, match=message):
        import_cluster(bad)
    assert not Node.objects.exists()
    assert not ClusterSettings.objects.exists()


def test_import_command_reports_one_line_and_changes_nothing_on_error(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(USER_FILE.replace("rank: 2", "rank: two"))
    with pytest.raises(CommandError) as err:
        call_command("import_cluster", str(path))
    assert "nodes.gpu2.rank: must be int" in str(err.value) and "nothing was imported" in str(err.value)
    assert "\n" not in str(err.value)
    assert not Node.objects.exists()
    with pytest.raises(CommandError, match="cannot read"):
        call_command("import_cluster", str(tmp_path / "missing.yaml"))


def test_export_round_trips(tmp_path):
    import_cluster(USER_FILE)
    text = export_cluster()
    settings_fields, nodes = parse_cluster_yaml(text)
    assert [n["name"] for n in nodes] == ["gpu-master", "gpu1", "gpu2"]
    assert nodes[1]["address"] == "192.168.1.101" and nodes[1]["gpu_vram_gb"] == 8
    out = io.StringIO()
    call_command("export_cluster", str(tmp_path / "out.yaml"), stdout=out)
    assert (tmp_path / "out.yaml").read_text() == text
    # re-importing the export changes nothing
    assert not import_cluster(text).created


def test_another_script_and_its_argument_template_come_from_training(tmp_path):
    from jobs.launch import LaunchRequest, create_job

    text = USER_FILE.replace(
        "training:\n", "training:\n  script: ft.py\n  args: ['--base', '{model}', '--steps', 100]\n"
    )
    import_cluster(text)
    job = create_job(LaunchRequest(name="ft1", model="llama"))
    assert job.script == "ft.py" and job.script_args == ["--base", "llama", "--steps", "100"]
    assert "args:" in export_cluster()
    with pytest.raises(ConfigError, match=r"training\.args: must be a list of strings"):
        import_cluster(USER_FILE.replace("training:\n", "training:\n  args: [{a: 1}]\n"))
