"""A PyTorch Lightning run as users write it: a tiny model, data made here, CPU, gloo DDP under torchrun.

Used to record tests/data/frameworks/lightning_* (see record.sh) and by the end-to-end test. It logs
with CSVLogger and TensorBoardLogger into lightning_logs/ (or --log-dir) and draws the progress bar
Lightning picks: the rich bar when `rich` is installed and --bar rich, else tqdm.

    torchrun --nproc-per-node 2 lightning_train.py --bar tqdm --epochs 2
"""

from __future__ import annotations

import argparse
import os
import time

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import RichProgressBar, TQDMProgressBar
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TinyRegressor(pl.LightningModule):
    def __init__(self, step_sleep: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.step_sleep = step_sleep

    def training_step(self, batch, batch_idx):
        if self.step_sleep:
            time.sleep(self.step_sleep)  # a model's pace: 1, 10 or 100 steps a second
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def data(count: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(count, 8, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True) * 0.5)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bar", choices=["tqdm", "rich"], default="tqdm")
    # the train_production.py interface a cluster's configured defaults arrive in (a model is built from a config)
    p.add_argument("--model-name", default="tiny")
    p.add_argument("--dataset-name", default="random")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batches", type=int, default=20, help="training batches per epoch and rank")
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--log-dir", default=".")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds each training step sleeps")
    p.add_argument("--max-steps", type=int, default=-1)
    # "default": the logger and checkpoints Lightning sets up by itself (TensorBoardLogger when tensorboard is
    # installed, else CSVLogger; ModelCheckpoint under lightning_logs/version_N/checkpoints), as most scripts
    # leave them; "both": CSVLogger and TensorBoardLogger, no checkpoints (the recordings)
    p.add_argument("--loggers", choices=["both", "default"], default="both")
    p.add_argument("--ckpt-path", default=None, help="resume from this checkpoint (Trainer.fit's ckpt_path)")
    args = p.parse_args()

    pl.seed_everything(0, verbose=False)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    train = DataLoader(data(args.batches * 4 * world, 1), batch_size=4)
    val = DataLoader(data(8 * world, 2), batch_size=4)
    bar = RichProgressBar() if args.bar == "rich" else TQDMProgressBar()
    trainer = pl.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", "1")),
        strategy="ddp" if world > 1 else "auto",
        max_steps=args.max_steps,
        log_every_n_steps=args.log_every,
        logger=True if args.loggers == "default" else [CSVLogger(args.log_dir), TensorBoardLogger(args.log_dir)],
        callbacks=[bar],
        enable_checkpointing=args.loggers == "default",
        enable_model_summary=False,
    )
    trainer.fit(TinyRegressor(args.step_sleep), train, val, ckpt_path=args.ckpt_path)
    if torch.distributed.is_initialized():  # leave the process group together (see hf_trainer.py)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
