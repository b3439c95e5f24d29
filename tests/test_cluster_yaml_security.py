"""cluster.yaml hardening (issue 10): duplicate keys, alias bombs, size, non-UTF-8; nothing is
imported when anything is refused, and every refusal is one line."""

from __future__ import annotations

import io

import pytest
from django.core.management import CommandError, call_command

from cluster.config_yaml import MAX_BYTES, ConfigError, import_cluster
from cluster.models import ClusterSettings, Node

pytestmark = pytest.mark.django_db

GOOD = """\
cluster: {name: lab, master_ip: 10.0.0.1, master_port: 29500}
nodes:
  gpu1: {ip: 10.0.0.1, user: ob, gpu: RTX 4070, rank: 0, role: master}
  gpu2: {ip: 10.0.0.2, user: ob, gpu: RTX 4070, rank: 1}
paths: {project_base: ~/ai-cluster, scripts: ~/ai-cluster/scripts}
"""

DUPLICATE_NODE = """\
cluster: {name: lab}
nodes:
  gpu1:
    ip: 10.0.0.1
  gpu2:
    ip: 10.0.0.2
  gpu1:
    ip: 6.6.6.6
"""

# about 500 bytes: nine levels of nine aliases each, 9**9 (387 million) strings once expanded
BOMB = (
    "cluster: {name: lab}\n"
    "nodes:\n  gpu1: {ip: 10.0.0.1}\n"
    "training:\n"
    '  a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    + "".join(f"  {c}: &{c} [{','.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True))
)


def refused(text, match: str) -> str:
    with pytest.raises(ConfigError, match=match) as info:
        import_cluster(text)
    assert "\n" not in str(info.value)
    assert not Node.objects.exists()
    assert not ClusterSettings.objects.filter(name="lab").exists()
    return str(info.value)


def test_a_duplicate_node_key_is_refused_naming_both_lines():
    message = refused(DUPLICATE_NODE, "nodes.gpu1 is given twice")
    assert "lines 3 and 7" in message


def test_a_duplicate_key_inside_a_node_is_refused():
    refused(GOOD.replace("gpu1: {ip: 10.0.0.1,", "gpu1: {ip: 10.0.0.1, ip: 6.6.6.6,"), r"nodes.gpu1.ip is given twice")


def test_the_515_byte_alias_bomb_is_refused_before_anything_is_expanded():
    assert len(BOMB.encode()) < 600  # the size of the one in the finding
    refused(BOMB, "expands to more than")


def test_a_self_referencing_alias_is_refused_not_looped_on():
    refused(GOOD + "training: &t {x: *t}\n", "expands to more than|nests deeper")


def test_plain_anchors_and_merge_keys_still_work():
    text = (
        "cluster: {name: lab}\n"
        "nodes:\n"
        "  gpu1: &base {ip: 10.0.0.1, user: ob, gpu: RTX 4070}\n"
        "  gpu2: {<<: *base, ip: 10.0.0.2}\n"
    )
    import_cluster(text)
    assert set(Node.objects.values_list("address", flat=True)) == {"10.0.0.1", "10.0.0.2"}


def test_a_file_over_the_size_limit_is_refused():
    refused(GOOD + "#" * MAX_BYTES, "limit is|larger than")


def test_non_utf8_bytes_get_one_line_naming_the_line():
    refused(GOOD.encode() + b"training: {default_model: caf\xe9}\n", r"not UTF-8 text: byte 0xe9 on line 6")


def test_the_command_refuses_a_non_utf8_file_with_one_line_and_imports_nothing(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_bytes(b"\xff\xfe" + GOOD.encode("utf-16-le"))
    with pytest.raises(CommandError) as info:
        call_command("import_cluster", str(path), stdout=io.StringIO())
    assert "not UTF-8" in str(info.value) and "nothing was imported" in str(info.value)
    assert "\n" not in str(info.value)
    assert not Node.objects.exists()


def test_script_roots_come_from_paths_and_go_back_out():
    import_cluster(GOOD.replace("scripts: ~/ai-cluster/scripts}", "scripts: ~/s, script_roots: ['{workdir}', /opt/x]}"))
    assert ClusterSettings.load().script_roots == ["{workdir}", "/opt/x"]
    from cluster.config_yaml import export_cluster

    assert "script_roots" in export_cluster()
    refused_text = GOOD.replace("scripts: ~/ai-cluster/scripts}", "script_roots: [/opt/../etc]}")
    Node.objects.all().delete()
    ClusterSettings.objects.all().delete()
    refused(refused_text, "paths.script_roots: must be a list of directories")
