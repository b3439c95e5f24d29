#!/usr/bin/env python3
"""UGRO reference training script.

A small byte-level causal transformer language model trained on a text file
shipped in ``train/data/``.  It runs either as a single process
(``python train_production.py ...``) or under ``torchrun`` on one or more
machines (RANK / WORLD_SIZE / LOCAL_RANK are read from the environment).

Output contract (stdout; each line is written with one write(2) call):
  * every ``--log-every`` steps each rank prints exactly one line that is a JSON
    object: {"step", "epoch", "loss", "lr", "tokens_per_sec", "grad_norm", "rank",
    "compute_s", "sync_wait_s"}
      - step: global optimizer step, 1-based (number of steps completed)
      - epoch: 0-based index of the epoch the step belongs to
      - loss: this rank's mean training loss since the previous log line
      - tokens_per_sec: this rank's throughput since the previous log line
      - compute_s: this rank's own time per step (everything but waiting for the
        other ranks in the gradient all-reduce), mean since the previous log line:
        a slow rank has the highest compute_s, while every rank's tokens_per_sec
        drops to the slowest one's
      - sync_wait_s: time per step spent waiting in the gradient all-reduce
  * every other line (banner, notices, "saved checkpoint ...",
    "training complete: ...") is plain text, never a JSON object.

Checkpoints: rank 0 writes ``<output-dir>/checkpoint_step<N>.pt`` atomically
every ``--save-every`` steps, at the end of every epoch and at the end of
training.  ``--resume-from PATH|latest`` restores model, optimizer and step;
the rank that has the file reads it and broadcasts it, so other machines need
no copy (ranks follow join order: rank 0 may be on any machine).

Resuming gives the same result as not stopping: the model, the optimizer, the
step and the data position are restored (the data order is a function of seed
and epoch, the model has no randomness after its seeded initialisation).

SIGUSR1 makes every rank print all its threads' stacks (faulthandler): UGRO
sends it when a job hangs and py-spy is not installed on the node.

Options for tests inject failures: --fail-at-step STEP (an error),
--sleep-at-step STEP:SECONDS (a hang),
--slow-rank RANK:SECONDS (a straggler), --oom-at-step STEP:MAX_BATCH (CUDA out
of memory while the per-rank batch is larger than MAX_BATCH).

Only the standard library, torch and numpy are used.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import math
import os
import re
import signal
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

DATA_DIR = Path(__file__).resolve().parent / "data"
DEFAULT_DATASET = "gpl-3"
VOCAB_SIZE = 256  # byte level: any text file works, no tokenizer needed

MODEL_PRESETS = {
    "tiny": {"d_model": 64, "n_layers": 2, "n_heads": 4},
    "small": {"d_model": 128, "n_layers": 4, "n_heads": 4},
}
DEFAULT_MODEL = "tiny"

CHECKPOINT_RE = re.compile(r"^checkpoint_step(\d+)\.pt$")


# --------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="UGRO reference training script")
    p.add_argument(
        "--model-name",
        default=DEFAULT_MODEL,
        help="model preset: tiny or small (anything else maps to tiny)",
    )
    p.add_argument(
        "--dataset-name",
        default=DEFAULT_DATASET,
        help="stem of a text file in train/data/ (or a path to a text file)",
    )
    p.add_argument("--num-epochs", type=int, default=1)
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--job-id", default=os.environ.get("UGRO_JOB_NAME", "local"), help="default: $UGRO_JOB_NAME")
    p.add_argument("--output-dir", default=None, help="default: ./outputs/<job-id>")
    p.add_argument(
        "--resume-from",
        default=None,
        help="checkpoint file, or 'latest' for the newest one in output-dir",
    )
    p.add_argument(
        "--max-steps",
        type=int,
        default=0,
        help="stop after this global step (0 = no limit)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=16,
        help="per-rank batch size (an even split; UGRO_LOCAL_BATCH in the environment overrides it per rank)",
    )
    p.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        help="micro-batches of --batch-size per optimizer step (same data per step as "
        "one batch of batch-size x grad-accum)",
    )
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument(
        "--save-every",
        type=int,
        default=100,
        help="checkpoint every N steps (0 = only at epoch ends / the end)",
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--step-sleep",
        type=float,
        default=0.0,
        help="seconds to sleep after every step (for tests)",
    )
    p.add_argument("--sleep-at-step", default="", help="STEP:SECONDS, sleep once (tests: a hang)")
    p.add_argument("--fail-at-step", type=int, default=0, help="raise an error before STEP (tests)")
    p.add_argument("--slow-rank", default="", help="RANK:SECONDS, extra sleep per step on that rank")
    p.add_argument(
        "--oom-at-step",
        default="",
        help="STEP:MAX_BATCH, CUDA out of memory at STEP while --batch-size > MAX_BATCH",
    )
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--grad-clip", type=float, default=1.0)
    return p


def validate_args(args: argparse.Namespace) -> None:
    positive = ("num_epochs", "batch_size", "seq_len", "log_every", "grad_accum")
    for name in positive:
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0")
    for name in ("max_steps", "save_every", "step_sleep", "fail_at_step"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
    if args.learning_rate <= 0:
        raise ValueError("--learning-rate must be > 0")
    for name in ("sleep_at_step", "slow_rank", "oom_at_step"):
        pair(getattr(args, name), f"--{name.replace('_', '-')}")


def pair(text: str, what: str) -> tuple[int, float] | None:
    """'A:B' -> (int A, float B); None for ''."""
    if not text:
        return None
    a, sep, b = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(a), float(b)
    except ValueError:
        raise ValueError(f"{what} must be N:SECONDS (got {text!r})") from None


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------
def emit(line: str) -> None:
    """Write one whole line with a single write(2) and no buffering.

    Several ranks share the launcher's stdout; print() issues the text and
    the newline as separate writes, which lets lines of different ranks
    interleave.  A single os.write of a short line to a pipe is atomic.
    """
    data = (line + "\n").encode("utf-8", "replace")
    try:
        sys.stdout.flush()
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        print(line, flush=True)
        return
    while data:
        data = data[os.write(fd, data) :]


# --------------------------------------------------------------------------
# Distributed helpers
# --------------------------------------------------------------------------
def under_torchrun() -> bool:
    """Whether this process is a torchrun worker (torchrun sets RANK and WORLD_SIZE)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


class Dist:
    def __init__(self) -> None:
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.enabled = under_torchrun()
        if torch.cuda.is_available():
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
            self.backend = "nccl"
        else:
            self.device = torch.device("cpu")
            self.backend = "gloo"
        if self.enabled:
            kwargs = {"backend": self.backend}
            if self.backend == "nccl":
                kwargs["device_id"] = self.device
            dist.init_process_group(**kwargs)
            # trust the process group over the environment
            self.rank = dist.get_rank()
            self.world_size = dist.get_world_size()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def log(self, msg: str) -> None:
        """Plain text line, rank 0 only."""
        if self.is_main:
            emit(msg)

    def broadcast_object(self, obj, src: int = 0):
        if not self.enabled or self.world_size == 1:
            return obj
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def all_gather_object(self, obj) -> list:
        if not self.enabled or self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.enabled and self.world_size > 1:
            dist.barrier()

    def close(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()


# --------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------
def resolve_dataset(name: str) -> tuple[Path, str | None]:
    """Return (path, notice).  notice is a log line when we fell back."""
    candidate = Path(name)
    if candidate.is_file():
        return candidate, None
    available = {p.stem: p for p in sorted(DATA_DIR.glob("*.txt"))}
    if name in available:
        return available[name], None
    default = available.get(DEFAULT_DATASET)
    if default is None:
        raise FileNotFoundError(
            f"default dataset {DEFAULT_DATASET}.txt missing from {DATA_DIR}"
        )
    return default, (
        f"dataset '{name}' not found in {DATA_DIR} "
        f"(available: {', '.join(available)}); using '{DEFAULT_DATASET}'"
    )


def load_tokens(path: Path) -> torch.Tensor:
    data = np.frombuffer(path.read_bytes(), dtype=np.uint8).astype(np.int64)
    return torch.from_numpy(data)


class StridedBatches:
    """Non-overlapping windows, shuffled per epoch, strided across ranks.

    Every rank gets the same number of batches per epoch and different
    windows; the order is a pure function of (seed, epoch), so a resumed run
    continues exactly where the checkpoint left off.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        seq_len: int,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        split: BatchSplit | None = None,
    ) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.split = split
        per_step = split.global_batch if split else batch_size * world_size
        n_windows = (len(tokens) - 1 - (seq_len - 1)) // seq_len
        self.steps_per_epoch = n_windows // per_step
        if self.steps_per_epoch < 1:
            raise ValueError(
                f"dataset too small: {len(tokens)} tokens give {n_windows} windows of "
                f"{seq_len}, need at least one global batch = {per_step}"
            )

    def _starts(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, epoch])
        offset = int(rng.integers(0, self.seq_len))
        n = (len(self.tokens) - 1 - offset) // self.seq_len
        starts = offset + self.seq_len * np.arange(n)
        return rng.permutation(starts)

    def epoch_batches(self, epoch: int, skip: int = 0, accum: int = 1):
        """Per step, `accum` micro-batches of batch_size // accum windows (the same
        windows as one batch of batch_size: a smaller batch with more
        accumulation sees the same data per step)."""
        starts = self._starts(epoch)
        split = self.split
        per_step = split.global_batch if split else self.batch_size * self.world_size
        for i in range(skip, self.steps_per_epoch):
            chunk = starts[i * per_step : (i + 1) * per_step]
            # the same global batch either way; an uneven split gives each rank its own share of it
            if split:
                mine = chunk[split.offset : split.offset + split.local]
            else:
                mine = chunk[self.rank :: self.world_size]
            idx = (
                torch.from_numpy(mine)[:, None]
                + torch.arange(self.seq_len + 1)[None, :]
            )
            window = self.tokens[idx]
            micro = max(1, len(mine) // accum)
            yield [
                (window[j : j + micro, :-1], window[j : j + micro, 1:])
                for j in range(0, micro * accum, micro)
            ]


class BatchSplit:
    """This rank's share of the global batch when GPUs are uneven (UGRO_LOCAL_BATCH / UGRO_BATCH_WEIGHT).

    UGRO gives each rank a local batch in proportion to its GPU's speed; the global batch stays that of
    the even split. Each rank scales its mean loss by its weight (local batch / even batch), so that
    DDP's gradient averaging yields exactly the gradient of the global batch's mean loss.
    """

    def __init__(self, local: int, offset: int, global_batch: int, world_size: int) -> None:
        self.local = local
        self.offset = offset
        self.global_batch = global_batch
        self.weight = local * world_size / global_batch  # what UGRO_BATCH_WEIGHT says

    @classmethod
    def from_env(cls, d: Dist) -> BatchSplit | None:
        raw = os.environ.get("UGRO_LOCAL_BATCH")
        if not raw:
            return None
        local = int(raw)
        if local < 1:
            raise ValueError(f"UGRO_LOCAL_BATCH must be >= 1, got {raw!r}")
        sizes = [local]
        if d.enabled and d.world_size > 1:
            sizes = [None] * d.world_size
            dist.all_gather_object(sizes, local)
        offset = sum(sizes[: d.rank])
        return cls(local, offset, sum(sizes), d.world_size)


# --------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        shape = (b, t, self.n_heads, c // self.n_heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(
        self, vocab_size: int, max_len: int, d_model: int, n_layers: int, n_heads: int
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))[None]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


# --------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------
def find_latest_checkpoint(output_dir: Path) -> Path | None:
    best: tuple[int, Path] | None = None
    if output_dir.is_dir():
        for p in output_dir.iterdir():
            m = CHECKPOINT_RE.match(p.name)
            if m and p.is_file() and (best is None or int(m.group(1)) > best[0]):
                best = (int(m.group(1)), p)
    return best[1] if best else None


def save_checkpoint(output_dir: Path, state: dict, step: int) -> Path:
    output_dir.mkdir(parents=True, exist_ok=True)
    final = output_dir / f"checkpoint_step{step}.pt"
    tmp = output_dir / f".{final.name}.tmp.{os.getpid()}"
    try:
        torch.save(state, tmp)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            tmp.unlink()
    return final


def load_resume_state(d: Dist, resume_from: str | None, output_dir: Path):
    """The rank that has the checkpoint reads it and broadcasts it to every rank.

    Ranks follow join order under torchrun's c10d rendezvous, so global rank 0
    may be on any machine: every rank says whether it has the file (for
    'latest': its newest step there) and the lowest rank with it (the newest)
    reads it.  Returns (state or None, plain notice line or None).  A missing
    explicit path is an error on every rank, so none of them hangs.
    """
    if not resume_from:
        return None, None
    if resume_from == "latest":
        found = find_latest_checkpoint(output_dir)
        m = CHECKPOINT_RE.match(found.name) if found else None
        mine = (int(m.group(1)) if m else -1, str(found) if found else None)
    else:
        path = Path(resume_from)
        mine = (0 if path.is_file() else -1, str(path) if path.is_file() else None)
    offers = d.all_gather_object(mine)
    best = max(range(len(offers)), key=lambda r: (offers[r][0], -r))
    step, path = offers[best]
    if path is None:
        if resume_from == "latest":
            return None, f"no checkpoint in {output_dir}; starting from scratch"
        raise RuntimeError(f"--resume-from: no such checkpoint file: {resume_from}")
    payload = None
    if d.rank == best:
        try:
            payload = {
                "state": torch.load(path, map_location="cpu", weights_only=True),
                "notice": f"resuming from {path}"
                + (f" (on rank {best})" if best else ""),
            }
        except Exception as exc:  # noqa: BLE001 - forwarded to all ranks
            payload = {"error": f"{type(exc).__name__}: {exc}"}
    payload = d.broadcast_object(payload, src=best)
    if "error" in payload:
        raise RuntimeError(payload["error"])
    return payload["state"], payload["notice"]


# --------------------------------------------------------------------------
# Timing the gradient all-reduce (per-rank compute time for straggler scores)
# --------------------------------------------------------------------------
def timed_allreduce(state: dict, bucket):
    """DDP's default all-reduce (divide by world size, sum), timed: when this rank
    arrived with its gradients, and when the other ranks' had all come in."""
    now = time.perf_counter()
    if state["arrived"] is None:
        state["arrived"] = now
    group = dist.group.WORLD
    tensor = bucket.buffer()
    tensor.div_(dist.get_world_size(group))
    fut = dist.all_reduce(tensor, group=group, async_op=True).get_future()

    def done(f):
        state["synced"] = time.perf_counter()
        return f.value()[0]

    return fut.then(done)


# --------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------
def lr_at(step: int, base_lr: float, total_steps: int) -> float:
    """Short linear warmup, then cosine decay to 10% of base_lr."""
    warmup = min(20, max(1, total_steps // 20))
    if step < warmup:
        return base_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return base_lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def train(args: argparse.Namespace, unknown: list[str], d: Dist) -> int:
    t_start = time.time()
    torch.manual_seed(args.seed)
    output_dir = Path(args.output_dir or os.path.join("outputs", args.job_id))

    if unknown:
        d.log(f"ignoring unknown arguments: {' '.join(unknown)}")
    preset = args.model_name
    if preset not in MODEL_PRESETS:
        d.log(
            f"model '{args.model_name}' is not a known preset "
            f"({', '.join(MODEL_PRESETS)}); using '{DEFAULT_MODEL}'"
        )
        preset = DEFAULT_MODEL
    data_path, notice = resolve_dataset(args.dataset_name)
    if notice:
        d.log(notice)

    tokens = load_tokens(data_path)
    split = BatchSplit.from_env(d)
    local_batch = split.local if split else args.batch_size
    if split:
        d.log(
            f"uneven split: global batch {split.global_batch}, rank 0 takes {split.local} "
            f"(weight {split.weight:.3f}); the loss is the global batch's mean"
        )
    # A step takes batch_size x grad_accum windows per rank, in grad_accum micro-batches.
    batches = StridedBatches(
        tokens,
        args.seq_len,
        args.batch_size * args.grad_accum,
        d.rank,
        d.world_size,
        args.seed,
        split,
    )
    steps_per_epoch = batches.steps_per_epoch
    total_steps = steps_per_epoch * args.num_epochs
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)

    model_cfg = dict(MODEL_PRESETS[preset], vocab_size=VOCAB_SIZE, max_len=args.seq_len)
    model = TinyLM(**model_cfg).to(d.device)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=args.learning_rate,
        weight_decay=args.weight_decay,
        betas=(0.9, 0.95),
    )

    state, notice = load_resume_state(d, args.resume_from, output_dir)
    if notice:
        d.log(notice)
    step = 0
    if state is not None:
        if state.get("model_config") != model_cfg:
            raise RuntimeError(
                f"checkpoint model config {state.get('model_config')} "
                f"does not match this run's {model_cfg}"
            )
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = int(state["step"])

    ddp_model = model
    timing = {"arrived": None, "synced": None}
    if d.enabled:
        ddp_model = DDP(
            model, device_ids=[d.local_rank] if d.device.type == "cuda" else None
        )
        if d.world_size > 1:
            ddp_model.register_comm_hook(timing, timed_allreduce)

    d.log(
        f"UGRO train_production: job={args.job_id} world_size={d.world_size} "
        f"backend={d.backend if d.enabled else 'none'} device={d.device} "
        f"model={preset} params={n_params} dataset={data_path.name} "
        f"tokens={len(tokens)} steps_per_epoch={steps_per_epoch} "
        f"total_steps={total_steps} start_step={step} output_dir={output_dir}"
    )

    if d.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)

    def checkpoint(at_step: int, epoch: int) -> None:
        if not d.is_main:
            return
        path = save_checkpoint(
            output_dir,
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "step": at_step,
                "epoch": epoch,
                "args": vars(args),
                "model_config": model_cfg,
            },
            at_step,
        )
        emit(f"saved checkpoint {path} (step {at_step})")

    last_saved = step
    last_loss = float("nan")
    # a slower GPU, simulated on CPU (tests and bench/uneven_batch.py): seconds per sample of this rank
    sample_sleep = float(os.environ.get("TRAIN_SAMPLE_SLEEP", "0") or 0)
    # The run's final loss is the last loss it logged (rank 0's line): UGRO's pages and CLI show the same.
    logged_loss = float("nan")
    tokens_per_step = local_batch * args.grad_accum * args.seq_len
    sleep_at = pair(args.sleep_at_step, "--sleep-at-step")
    slow = pair(args.slow_rank, "--slow-rank")
    oom_at = pair(args.oom_at_step, "--oom-at-step")
    interval_compute = 0.0
    interval_wait = 0.0
    ddp_model.train()
    interval_losses: list[float] = []
    interval_t0 = time.time()
    interval_steps = 0

    while step < total_steps:
        epoch = step // steps_per_epoch
        skip = step % steps_per_epoch
        for micro_batches in batches.epoch_batches(epoch, skip=skip, accum=args.grad_accum):
            if step >= total_steps:
                break
            t_step = time.perf_counter()
            timing["arrived"] = timing["synced"] = None
            if args.fail_at_step and step + 1 == args.fail_at_step:
                raise RuntimeError(f"injected failure before step {step + 1} (--fail-at-step)")
            if oom_at and step + 1 >= oom_at[0] and args.batch_size > oom_at[1]:
                raise RuntimeError(
                    f"CUDA out of memory. Tried to allocate {args.batch_size * 64} MiB "
                    f"(injected by --oom-at-step at step {step + 1}, batch size {args.batch_size})"
                )
            lr = lr_at(step, args.learning_rate, total_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.zero_grad(set_to_none=True)
            loss_sum = 0.0
            # an uneven split weighs this rank's gradients by its share (DDP divides the sum by world_size)
            scale = split.weight if split else 1.0
            for j, (x, y) in enumerate(micro_batches):
                x = x.to(d.device, non_blocking=True)
                y = y.to(d.device, non_blocking=True)
                last_micro = j == len(micro_batches) - 1
                sync = contextlib.nullcontext()
                if not last_micro and ddp_model is not model:
                    sync = ddp_model.no_sync()  # gradients are all-reduced once per step
                with sync:
                    logits = ddp_model(x)
                    loss = F.cross_entropy(
                        logits.reshape(-1, logits.size(-1)), y.reshape(-1)
                    )
                    (loss * scale / len(micro_batches)).backward()
                loss_sum += loss.item()
            loss = torch.tensor(loss_sum / len(micro_batches))
            if split:
                share = (loss * split.local / split.global_batch).reshape(1)
                if d.enabled and d.world_size > 1:
                    dist.all_reduce(share)
                loss = share[0]  # the global batch's mean loss, the same on every rank
            if args.grad_clip > 0:
                grad_norm = torch.nn.utils.clip_grad_norm_(
                    model.parameters(), args.grad_clip
                )
            else:
                grad_norm = torch.linalg.vector_norm(
                    torch.stack(
                        [
                            torch.linalg.vector_norm(p.grad)
                            for p in model.parameters()
                            if p.grad is not None
                        ]
                    )
                )
            optimizer.step()
            step += 1
            interval_steps += 1
            last_loss = loss.item()
            if not math.isfinite(last_loss):
                raise RuntimeError(f"non-finite loss {last_loss} at step {step}")
            interval_losses.append(last_loss)
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if sample_sleep:
                time.sleep(sample_sleep * local_batch)
            if slow and slow[0] == d.rank:
                time.sleep(slow[1])
            wait = 0.0
            if timing["arrived"] is not None and timing["synced"] is not None:
                wait = max(0.0, timing["synced"] - timing["arrived"])
            interval_wait += wait
            interval_compute += time.perf_counter() - t_step - wait

            if step % args.log_every == 0 or step == total_steps:
                elapsed = max(time.time() - interval_t0, 1e-9)
                logged_loss = round(sum(interval_losses) / len(interval_losses), 6)
                emit(
                    json.dumps(
                        {
                            "step": step,
                            "epoch": epoch,
                            "loss": logged_loss,
                            "lr": float(f"{lr:.6g}"),
                            "tokens_per_sec": round(
                                interval_steps * tokens_per_step / elapsed, 2
                            ),
                            "grad_norm": round(float(grad_norm), 6),
                            "rank": d.rank,
                            "compute_s": round(interval_compute / interval_steps, 6),
                            "sync_wait_s": round(interval_wait / interval_steps, 6),
                        }
                    )
                )
                interval_losses = []
                interval_compute = interval_wait = 0.0
                interval_steps = 0
                interval_t0 = time.time()

            if sleep_at and sleep_at[0] == step:
                d.log(f"sleeping {sleep_at[1]:g}s after step {step} (--sleep-at-step)")
                time.sleep(sleep_at[1])

            epoch_end = step % steps_per_epoch == 0
            if (args.save_every and step % args.save_every == 0) or epoch_end:
                checkpoint(step, epoch)
                last_saved = step

    if last_saved != step:
        checkpoint(step, (step - 1) // steps_per_epoch if step else 0)
    d.barrier()
    d.log(
        f"training complete: job={args.job_id} steps={step} "
        f"epochs={step / steps_per_epoch:.2f} final_loss={logged_loss:.6g} "
        f"elapsed={time.time() - t_start:.1f}s output_dir={output_dir}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args, unknown = build_parser().parse_known_args(argv)
    try:
        validate_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    # a crash in native code (SIGSEGV, SIGABRT from a C++ std::terminate) prints every thread's Python stack,
    # so the log says where it happened
    faulthandler.enable(all_threads=True)
    if hasattr(signal, "SIGUSR1"):
        # every thread's stack to stderr on SIGUSR1 (UGRO's hang dump without py-spy)
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    d = None
    try:
        d = Dist()
        return train(args, unknown, d)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        return 130
    except Exception:  # noqa: BLE001
        rank = d.rank if d is not None else os.environ.get("RANK", "0")
        print(f"error on rank {rank}:", file=sys.stderr, flush=True)
        traceback.print_exc()
        sys.stderr.flush()
        return 1
    finally:
        if d is not None:
            with contextlib.suppress(Exception):
                d.close()


def leave(rc: int) -> None:
    """Exit a torchrun worker without the interpreter's and the C++ runtime's teardown.

    gloo's threads outlive destroy_process_group (torch's C++ side keeps the group), and that teardown now
    and then destroys one of them still running: "terminate called without an active exception", SIGABRT,
    after a run that succeeded (it failed a CI run once; not reproduced on demand). Everything the run wrote
    is closed and flushed by now; nothing else is left to do.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(rc)


if __name__ == "__main__":
    code = main()
    if under_torchrun():
        leave(code)
    sys.exit(code)
