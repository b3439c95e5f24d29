"""The GPU model and memory the probe reads are what `health`, `ugro health`, the node page, the topology and
Prometheus show. No GPU exists here: readings come from the probe's `fixture:<path>` reader, or are
recorded as the monitor records them (cluster.gpus.record_readings)."""

from __future__ import annotations

import io
import json
import re

import pytest
from django.contrib.auth.models import Group, User
from django.core.management import CommandError, call_command
from django.test import Client
from django.urls import reverse

from cluster.gpus import record_readings
from cluster.models import Node

H200 = {"index": 0, "name": "NVIDIA H200", "uuid": "GPU-h200", "util_percent": 0, "mem_used_mb": 1,
        "mem_total_mb": 143771, "temp_c": 30, "power_w": 80.0}  # fmt: skip
A100 = {**H200, "index": 1, "name": "NVIDIA A100-SXM4-80GB", "uuid": "GPU-a100", "mem_total_mb": 81920}
HEALTH_LINE = re.compile(r"^[✓✗] local +(?P<gpu>.+?) - ")


@pytest.fixture
def local_node(transactional_db, fast_settings, tmp_path):
    """This machine as a node (no SSH) declaring 2 GPUs of no known model; the probe reads an H200 and an A100."""
    readings = tmp_path / "gpus.json"
    readings.write_text(json.dumps([H200, A100]))
    return Node.objects.create(name="local", address="127.0.0.1", transport=Node.Transport.LOCAL, gpu_count=2,
                               workdir=str(tmp_path), gpu_reader=f"fixture:{readings}")  # fmt: skip


@pytest.mark.e2e
def test_health_names_each_gpu_model_and_its_memory_as_the_probe_read_it(local_node):
    """Covers: the probe's GPU readings carried by a real agent (local transport, no SSH) into `health` and the API's
    words; about a second.
    """
    # when `manage.py health` probes the node
    out = io.StringIO()
    try:
        call_command("health", stdout=out)
    except CommandError:
        pass  # a busy shared machine may leave the node degraded: its line is what this test reads
    # then its line names each model with its memory, as NVML reported them
    line = out.getvalue().splitlines()[0]
    assert HEALTH_LINE.match(line)["gpu"] == "1× NVIDIA H200 140 GB, 1× NVIDIA A100-SXM4-80GB 80 GB", line
    # and `ugro health` (the API) carries the same words
    user = User.objects.create_user("bob")
    user.groups.add(Group.objects.get(name="launcher"))
    client = Client()
    client.force_login(user)
    (node,) = client.get("/api/v1/health").json()
    assert node["gpu"] == "1× NVIDIA H200 140 GB, 1× NVIDIA A100-SXM4-80GB 80 GB"


@pytest.mark.parametrize(
    ("declared", "readings", "text"),
    [
        ({"gpu_count": 1, "gpu_model": "RTX 5070 Ti", "gpu_vram_gb": 12}, [], "1× RTX 5070 Ti 12 GB"),
        ({"gpu_count": 1}, [H200], "1× NVIDIA H200 140 GB"),
        ({"gpu_count": 2, "gpu_model": "H200"}, [H200, {**H200, "index": 1}], "2× NVIDIA H200 140 GB"),
        ({"gpu_count": 2}, [H200], "1× NVIDIA H200 140 GB, 1× GPU"),
        ({"gpu_count": 0}, [], "no GPU"),
    ],
)
def test_a_nodes_gpu_label_is_the_probes_reading_else_what_was_declared(db, declared, readings, text):
    node = Node.objects.create(name="n1", address="10.0.0.1", **declared)
    record_readings({"n1": readings}, [node])
    assert Node.objects.get(pk=node.pk).gpu_label == text


def test_node_page_topology_and_prometheus_name_the_gpu_escaped(admin_client, db, settings):
    # given a node whose probe read an H200, and a second GPU whose name carries markup
    node = Node.objects.create(name="gpu-a", address="10.0.0.1", role=Node.Role.MASTER, gpu_count=2)
    record_readings({"gpu-a": [H200, {**A100, "name": "<b>x</b>"}]}, [node])
    # then the node page and the topology name them, escaped
    for url in (reverse("node-detail", args=["gpu-a"]), reverse("cluster-overview")):
        html = admin_client.get(url).content.decode()
        assert "1× NVIDIA H200 140 GB, 1× &lt;b&gt;x&lt;/b&gt; 80 GB" in html, url
        assert "<b>x</b>" not in html
    # and Prometheus has one info series per GPU, labelled with its model
    settings.UGRO_PROMETHEUS_TOKEN = "t0ken"
    text = admin_client.get("/metrics", headers={"Authorization": "Bearer t0ken"}).content.decode()
    assert 'ugro_gpu_info{gpu="0",name="NVIDIA H200",node="gpu-a"} 1.0' in text
    assert 'ugro_gpu_info{gpu="1",name="<b>x</b>",node="gpu-a"} 1.0' in text
