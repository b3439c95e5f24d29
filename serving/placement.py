"""Where a service's replicas run: GPUs held through jobs.Allocation, the scheduler's own constraint.

A replica takes `gpus_per_replica` GPUs of one node, or a whole node without GPUs (as a job does there), each GPU
with at least the service's min_vram_mb: its share of the checkpoint's weights with some headroom, as the
scheduler's VRAM fit does for a job's --min-vram. Replicas of one service go to different nodes first (a node
that fails takes fewer of them along).
"""

from __future__ import annotations

import math
import re

from django.db import IntegrityError, transaction

from cluster.fanout import node_request
from cluster.models import GPU, Node
from jobs.models import Allocation, Checkpoint

from .models import Replica, Service


def _slots(min_vram_mb: int | None = None) -> dict[int, list[int]]:
    """node id -> its slots: GPU indices, or [-1] for a node without GPUs (every node, free or not). With
    min_vram_mb only the GPUs that have that much (one of unknown size has not, as for a job's --min-vram): a
    node whose GPUs are all too small has no slot, it is not a node without GPUs."""
    out: dict[int, list[int]] = {n: [] for n in Node.objects.values_list("pk", flat=True)}
    with_gpus = set()
    for node_id, index, vram in GPU.objects.order_by("node_id", "index").values_list("node_id", "index", "vram_mb"):
        with_gpus.add(node_id)
        if not min_vram_mb or vram >= min_vram_mb:
            out[node_id].append(index)
    return {n: slots if n in with_gpus else [Allocation.WHOLE_NODE] for n, slots in out.items()}


def _fits(slots: list[int], gpus: int) -> int:
    """How many replicas of `gpus` GPUs these slots of one node hold."""
    if slots == [Allocation.WHOLE_NODE]:
        return 1
    return len(slots) // gpus if gpus else 0


# Weights need room beside them: the CUDA context, activations and at least some KV cache (vLLM and SGLang then
# take a share of what is left for their cache).
VRAM_HEADROOM = 1.2
WEIGHT_FILES = re.compile(r"^(model|pytorch_model|adapter_model)([-.].*)?\.(safetensors|bin)$")


def weights_mb(checkpoint: Checkpoint) -> int | None:
    """The size of the checkpoint's weight files (what save_pretrained writes: model*.safetensors,
    pytorch_model*.bin), read from its node; None when it lists none (a custom engine's own format)."""
    entries = node_request(checkpoint.node, "listdir", timeout=10, path=checkpoint.path)["entries"]
    total = sum(e["size"] for e in entries if WEIGHT_FILES.match(e["name"]))
    return math.ceil(total / 2**20) if total else None


def min_vram_mb(checkpoint: Checkpoint, gpus: int) -> int | None:
    """What each of a replica's `gpus` GPUs needs: its share of the weights, with VRAM_HEADROOM."""
    weights = weights_mb(checkpoint) if gpus else None
    return math.ceil(weights * VRAM_HEADROOM / gpus) if weights else None


def capacity_problem(replicas: int, gpus: int, min_vram_mb: int | None = None) -> str | None:
    """Why the cluster could never hold this many replicas (one line), or None. Busy GPUs count: a replica
    waits for them, as a job does; GPUs that do not exist, or are too small for the weights, are refused."""
    nodes = Node.objects.filter(enabled=True)
    slots = _slots(min_vram_mb)
    room = sum(_fits(slots[n.pk], gpus) for n in nodes)
    if room >= replicas:
        return None
    gpu_nodes = sum(1 for n in nodes if slots[n.pk] != [Allocation.WHOLE_NODE])
    have = sum(len(slots[n.pk]) for n in nodes if slots[n.pk] != [Allocation.WHOLE_NODE])
    if gpus and min_vram_mb:
        largest = max(GPU.objects.filter(node__enabled=True).values_list("vram_mb", flat=True), default=0)
        return (
            f"{replicas} replicas of {gpus} GPUs each with at least {min_vram_mb / 1024:.1f} GB (the checkpoint's "
            f"weights, {VRAM_HEADROOM:g}x, split over {gpus}) do not fit: the enabled nodes hold at most {room} "
            f"({have} such GPUs; the largest GPU has {largest / 1024:.1f} GB)"
        )
    return (
        f"{replicas} replicas of {gpus} GPUs each do not fit: the enabled nodes hold at most {room} "
        f"({have} GPUs on {gpu_nodes} nodes, {nodes.count() - gpu_nodes} nodes without GPUs)"
    )


def place(replica: Replica) -> bool:
    """Hold free GPUs for a pending replica (STARTING is the caller's to set); False if none fit now."""
    service = replica.service
    slots = _slots(service.min_vram_mb)
    busy = set(Allocation.objects.filter(active=True).values_list("node_id", "gpu_index"))
    mine = list(Replica.objects.filter(service=service, state__in=Replica.HOLDING).values_list("node_id", flat=True))
    nodes = [n for n in Node.objects.filter(enabled=True).exclude(status__in=Node.NOT_ANSWERING)]
    nodes.sort(key=lambda n: (mine.count(n.pk), n.placement_key()))
    for node in nodes:
        free = [i for i in slots[node.pk] if (node.pk, i) not in busy]
        if free == [Allocation.WHOLE_NODE]:
            take = free
        elif service.gpus_per_replica and len(free) >= service.gpus_per_replica and free[0] >= 0:
            take = free[: service.gpus_per_replica]
        else:
            continue
        if claim(replica, node, take):
            return True
    return False


def claim(replica: Replica, node: Node, indices: list[int]) -> bool:
    """Hold these slots of the node for the replica; False if another holder took one first (the database's
    one-active-allocation-per-GPU constraint)."""
    try:
        with transaction.atomic():
            Allocation.objects.bulk_create(
                [Allocation(job=None, holder=replica.holder, node=node, gpu_index=i) for i in indices]
            )
    except IntegrityError:
        return False
    replica.node = node
    replica.gpu_indices = [i for i in indices if i >= 0]
    Replica.objects.filter(pk=replica.pk).update(node=node, gpu_indices=replica.gpu_indices)
    return True


def release(replica: Replica) -> int:
    """Free every slot the replica holds; how many were held."""
    return Allocation.objects.filter(holder=replica.holder, active=True).update(active=False)


def held(service: Service) -> list[str]:
    """node:gpu of every slot the service's replicas hold now."""
    prefix = f"serve:{service.name}/"
    rows = Allocation.objects.filter(holder__startswith=prefix, active=True).select_related("node")
    return [a.node.name if a.gpu_index < 0 else f"{a.node.name}:{a.gpu_index}" for a in rows]
