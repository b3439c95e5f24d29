"""A tiny training loop that fails the way a real one does, for tests/data/failures/record.py.

Usage (under torchrun): worker.py MODE. The rank that fails is RANK == REC_FAIL_RANK (default 1), or
every rank of the node started with REC_FAIL_NODE=1. Other ranks keep all-reducing, so they see the
failure as a peer that went away, as they would in a real job.
"""

import os
import signal
import sys
import time
import traceback

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

GIB_OOM = (
    "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 7.79 GiB total capacity; 5.12 GiB already allocated; "
    "1.20 GiB free; 5.50 GiB reserved in total by PyTorch)"
)
TORCH_OOM = (
    "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 7.66 GiB of which 3.25 MiB is "
    "free. Including non-PyTorch memory, this process has 7.65 GiB memory in use. Of the allocated memory 7.40 GiB "
    "is allocated by PyTorch, and 52.31 MiB is reserved by PyTorch but unallocated."
)
HIP_OOM = (
    "HIP out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 15.98 GiB of which 512.00 MiB is "
    "free. Of the allocated memory 14.90 GiB is allocated by PyTorch, and 301.00 MiB is reserved by PyTorch but "
    "unallocated."
)
MPS_OOM = (
    "MPS backend out of memory (MPS allocated: 17.00 GB, other allocations: 1.20 GB, max allowed: 18.13 GB). "
    "Tried to allocate 256.00 MB on private pool. Use PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper limit "
    "for memory allocations (may cause system failure)."
)
NCCL_ERROR = (
    "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, unhandled system error "
    "(run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5\n"
    "ncclSystemError: System call (e.g. socket, malloc) or external library call failed or device error. \n"
    "Last error:\n"
    "socket.c:484 NCCL WARN socketStartConnect: Connect to 10.0.0.2<43231> failed : Software caused connection abort"
)


def fail(mode: str) -> None:
    if mode == "oom_exit3":
        try:
            raise RuntimeError(GIB_OOM)
        except RuntimeError:
            traceback.print_exc()
            sys.exit(3)
    if mode == "oom_raise":
        raise RuntimeError(GIB_OOM)
    if mode == "torch_oom":
        raise torch.OutOfMemoryError(TORCH_OOM)
    if mode == "hip_oom":
        raise torch.OutOfMemoryError(HIP_OOM)
    if mode == "mps_oom":
        raise RuntimeError(MPS_OOM)
    if mode in ("value_error", "store_host_first", "store_host_mid_run"):
        raise ValueError("learning rate must be positive, got -0.1")
    if mode == "nccl":
        raise dist.DistBackendError(NCCL_ERROR)
    if mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.5)  # give a signal time to land before the loop goes on


def main() -> None:
    mode = sys.argv[1]
    rank = int(os.environ["RANK"])
    print(f"GROUP_RANK={os.environ['GROUP_RANK']} RANK={rank} LOCAL_RANK={os.environ['LOCAL_RANK']}", flush=True)
    fails_here = os.environ.get("REC_FAIL_NODE") == "1" or str(rank) == os.environ.get("REC_FAIL_RANK", "1")
    distributed = int(os.environ["WORLD_SIZE"]) > 1
    if distributed:
        dist.init_process_group("gloo")
    if mode == "store_host_first":
        dist.barrier()
        if fails_here:
            time.sleep(1.0)  # the others finish first and wait for this node's agent, which then dies
            fail(mode)
        dist.destroy_process_group()
        print("done", flush=True)
        return
    if mode == "store_host_mid_run":
        dist.barrier()
        if fails_here:
            fail(mode)
        time.sleep(4.0)  # still running when the store host dies: this node's agent loses the store
        print("done", flush=True)
        return
    loss = torch.tensor([2.5])
    for step in range(1, 60):
        if distributed:
            dist.all_reduce(loss)
            loss /= int(os.environ["WORLD_SIZE"])
        loss *= 0.9
        print(f"step {step} loss {loss.item():.4f}", flush=True)
        if mode != "ok" and fails_here and step == 3:
            fail(mode)
        if mode == "ok" and step == 5:
            break
        time.sleep(0.2)
    if distributed:
        dist.destroy_process_group()
    print("done", flush=True)


if __name__ == "__main__":
    if os.environ.get("REC_RECORD") == "1":
        record(main)()
    else:
        main()
