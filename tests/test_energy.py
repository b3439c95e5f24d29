"""Energy per job and attempt (jobs/energy.py, docs/power.md): GPU energy from NVML's counter or integrated power
samples, host CPU energy from RAPL, the cost at cluster.yaml's power.price_per_kwh, and where a GPU reports no
power, "not measured" (never 0)."""

from __future__ import annotations

import pytest

from cluster.config_yaml import ConfigError, export_cluster, import_cluster
from cluster.models import ClusterSettings, Node

pytestmark = pytest.mark.django_db

ONE_NODE = """\
nodes:
  gpu1:
    ip: 127.0.0.1
    user: ob
    gpu: RTX 4070
    vram_gb: 8
"""


def test_the_power_block_sets_the_price_and_round_trips():
    import_cluster(ONE_NODE + "power:\n  price_per_kwh: 0.31\n  currency: EUR\n")
    cs = ClusterSettings.load()
    assert (cs.price_per_kwh, cs.currency) == (0.31, "EUR")
    assert "price_per_kwh: 0.31" in export_cluster()
    import_cluster(export_cluster())
    assert ClusterSettings.load().price_per_kwh == 0.31


@pytest.mark.parametrize(
    "block, message",
    [
        ("  price_per_kwh: -0.2\n", r"^power\.price_per_kwh: must be a price per kWh from 0 to 1000.* \(line \d+\)$"),
        ("  price_per_kwh: cheap\n", r"^power\.price_per_kwh: must be int or float"),
        ("  price_per_kwh: .nan\n", r"^power\.price_per_kwh: must be a price"),
        ("  price_per_kwh: 0.3\n  currency: '<b>EUR</b>'\n", r"^power\.currency: must be a short label"),
        ("  price_per_kwh: 0.3\n  watts: 5\n", r"^power\.watts: unknown key \(known: currency, price_per_kwh\)"),
    ],
)
def test_a_bad_power_block_is_refused_in_one_line_and_nothing_is_imported(block, message):
    with pytest.raises(ConfigError, match=message) as err:
        import_cluster(ONE_NODE + "power:\n" + block)
    assert "\n" not in str(err.value)
    assert not Node.objects.exists() and not ClusterSettings.objects.exists()
