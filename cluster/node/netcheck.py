# UGRO's network measurement (`ugro netcheck`, a multi-node launch's pre-flight: jobs/network.py). One process per
# node, run by the python of the node's training env with its own torch (`python -c <this> <config JSON>`), never
# installed there. It runs the collective the job will use (NCCL on GPUs, else gloo): all_reduce at the given sizes
# for the whole group and for each given pair, each timed over as many repeats as fit a small budget. Stdlib and
# torch only, Python >= 3.8. Every rank prints one JSON line; rank 0's holds the figures.
import json
import os
import sys
import time
from datetime import timedelta


def _figures(pg, nbytes, budget_s, max_iters, device, sync):
    """One all_reduce of nbytes timed on pg: seconds per op (the slowest member's), bus bandwidth (bytes/s)."""
    import torch
    import torch.distributed as dist

    n = pg.size()
    data = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)

    def reduce(tensor, op):
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        pg.allreduce([tensor], opts).wait()

    reduce(data, dist.ReduceOp.SUM)  # the first one sets up connections and buffers: not timed
    sync()
    t0 = time.perf_counter()
    reduce(data, dist.ReduceOp.SUM)
    sync()
    once = time.perf_counter() - t0
    # every member must run the same number of ops: the count is the smallest any member asks for
    count = torch.tensor([max(1, min(max_iters, int(budget_s / max(once, 1e-6))))], dtype=torch.float64, device=device)
    reduce(count, dist.ReduceOp.MIN)
    iters = int(count.item())
    t0 = time.perf_counter()
    for _ in range(iters):
        reduce(data, dist.ReduceOp.SUM)
    sync()
    spent = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
    reduce(spent, dist.ReduceOp.MAX)
    per_op = float(spent.item()) / iters
    size = data.numel() * 4
    algbw = size / per_op
    return {"bytes": size, "seconds": per_op, "iters": iters, "algbw": algbw, "busbw": algbw * 2 * (n - 1) / n}


def _measure(pg, sizes, cfg, device, sync):
    small = _figures(pg, 8, cfg["budget_s"], cfg["latency_iters"], device, sync)
    return {
        "latency_us": small["seconds"] * 1e6,
        "sizes": [_figures(pg, s, cfg["budget_s"], cfg["max_iters"], device, sync) for s in sizes],
    }


def main(cfg):
    import torch
    import torch.distributed as dist

    rank, world, backend = cfg["rank"], cfg["world"], cfg["backend"]
    timeout = timedelta(seconds=cfg["timeout_s"])
    store = dist.TCPStore(cfg["master"], cfg["port"], world, rank == 0, timeout=timeout)
    if backend == "nccl":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)

        def sync():
            torch.cuda.synchronize(device)
    else:
        device = torch.device("cpu")

        def sync():
            pass

    def group(prefix, members):
        here = dist.PrefixStore(prefix, store)
        if backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            return dist.ProcessGroupNCCL(here, members.index(rank), len(members), opts)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        # bound to this node's address on its chosen interface, as the job's ranks are by GLOO_SOCKET_IFNAME
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=cfg["address"])]
        return dist.ProcessGroupGloo(here, members.index(rank), len(members), opts)

    everyone = group("all", list(range(world)))
    figures = _measure(everyone, cfg["sizes"], cfg, device, sync)
    for a, b in cfg["pairs"]:
        if rank in (a, b):  # the others wait in the barrier: no traffic of theirs meets the pair's
            pair = _measure(group("pair-%d-%d" % (a, b), [a, b]), cfg["pair_sizes"], cfg, device, sync)
            if rank == a:
                store.set("result-%d-%d" % (a, b), json.dumps(pair))
        everyone.barrier().wait()
    out = {"ok": True, "rank": rank, "torch": torch.__version__}
    if rank == 0:
        pairs = [dict(json.loads(store.get("result-%d-%d" % (a, b))), a=a, b=b) for a, b in cfg["pairs"]]
        out.update(group=figures, pairs=pairs)
    everyone.barrier().wait()  # rank 0 hosts the store: nobody leaves before it has read every pair
    return out


if __name__ == "__main__":
    try:
        result = main(json.loads(sys.argv[1]))
    except Exception as exc:  # one line back to the controller, whatever torch raised
        result = {"ok": False, "error": ("%s: %s" % (type(exc).__name__, exc)).splitlines()[0][:500]}
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0 if result.get("ok") else 1)  # no process-group teardown: it can hang once a peer is gone
