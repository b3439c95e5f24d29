"""GPU rows: one per device of each node, the unit the scheduler allocates.

Rows follow the node's declared gpu_count (a node saved in admin, imported from cluster.yaml, or
created by a test); the health monitor's readings add each device's model, memory and uuid.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .models import GPU, Node


def gpu_text(node: Node, rows: Iterable[GPU]) -> str:
    """The node's GPUs as people read them: `1× NVIDIA H200 140 GB`; mixed models each with its count, in
    device order (`1× RTX 4070 8 GB, 1× RTX 3070 Ti 8 GB`). Rows hold what the probe read (NVML, else
    nvidia-smi) and the declared model and memory until a reading came."""
    if not node.gpu_count:
        return "no GPU"
    pairs = [(g.model, g.vram_mb) for g in rows] or [(node.gpu_model, node.gpu_vram_gb * 1024)] * node.gpu_count
    counts: dict[tuple[str, str], int] = {}
    for model, mb in pairs:
        key = (model or "GPU", _gb_text(mb))
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n}× {model}{' ' + gb if gb else ''}" for (model, gb), n in counts.items())


def _gb_text(mb: float) -> str:
    """`140 GB` (NVML's 143771 MiB), `8 GB` (8188 MiB): whole GB, as cards are sold; '' when unknown."""
    gb = (mb or 0) / 1024
    if gb <= 0:
        return ""
    return f"{gb:.0f} GB" if gb >= 1 else f"{gb:.1f} GB"


def sync_gpus(node: Node) -> None:
    """Make the node's GPU rows match its gpu_count: indices 0..count-1, declared model and VRAM
    where no reading said otherwise. Rows past the count are removed (allocations name the index,
    so a running job keeps its hold)."""
    have = {g.index: g for g in GPU.objects.filter(node=node)}
    declared_mb = float(node.gpu_vram_gb or 0) * 1024
    new = [
        GPU(node=node, index=i, model=node.gpu_model, vram_mb=declared_mb)
        for i in range(node.gpu_count)
        if i not in have
    ]
    GPU.objects.bulk_create(new)
    GPU.objects.filter(node=node, index__gte=node.gpu_count).delete()
    # a declared change (admin, cluster.yaml) applies to rows no reading has filled in
    GPU.objects.filter(node=node, uuid="").exclude(model=node.gpu_model, vram_mb=declared_mb).update(
        model=node.gpu_model, vram_mb=declared_mb
    )


def record_readings(readings: Mapping[str, Iterable[Mapping[str, Any]]], nodes: Iterable[Node]) -> int:
    """Take model, total memory and uuid of declared GPUs from probes' per-GPU readings (by node name).

    One read for all rows; a row is written only when a reading changed it. Returns rows changed.
    """
    by_name = {n.name: n for n in nodes if n.name in readings}
    rows = {(g.node_id, g.index): g for g in GPU.objects.filter(node__in=list(by_name.values()))}
    changed = 0
    for name, node in by_name.items():
        for pos, gpu in enumerate(readings[name] or []):
            if not isinstance(gpu, Mapping):
                continue
            index = gpu.get("index", pos)
            row = rows.get((node.pk, index)) if isinstance(index, int) else None
            if row is None:
                continue
            fields: dict[str, Any] = {}
            if isinstance(gpu.get("name"), str) and gpu["name"]:
                fields["model"] = gpu["name"][:100]
            total = gpu.get("mem_total_mb")
            if isinstance(total, int | float) and not isinstance(total, bool) and total > 0:
                fields["vram_mb"] = float(total)
            if isinstance(gpu.get("uuid"), str) and gpu["uuid"]:
                fields["uuid"] = gpu["uuid"][:100]
            if any(getattr(row, k) != v for k, v in fields.items()):
                GPU.objects.filter(pk=row.pk).update(**fields)
                changed += 1
    return changed
