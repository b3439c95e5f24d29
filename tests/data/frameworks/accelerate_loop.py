"""A hand-written training loop on Hugging Face `accelerate`, printing the lines the no_trainer examples print.

Its lines (`epoch 0 step 5/40: loss: 2.31 lr: 0.0029`, `epoch 0: perplexity: 9.1 eval_loss: 2.2`) are no
framework's format: UGRO reads them through the job's metrics pattern (docs/curves.md). A tiny GPT-2
from a config and random tokens made here: nothing is downloaded.

    torchrun --nproc-per-node 2 accelerate_loop.py --steps-per-epoch 20 --epochs 2 --log-every 5
"""

from __future__ import annotations

import argparse
import math

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--steps-per-epoch", type=int, default=20)
    p.add_argument("--log-every", type=int, default=5)
    args = p.parse_args()

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    vocab = 64
    model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=32, n_embd=32, n_layer=1, n_head=2,
                                       bos_token_id=0, eos_token_id=0))  # fmt: skip
    base = torch.randint(0, vocab, (8,), generator=torch.Generator().manual_seed(1))
    count = args.steps_per_epoch * 4 * accelerator.num_processes
    rows = torch.stack([base.roll(i % 8).repeat(2) for i in range(count)])
    train = DataLoader(TensorDataset(rows), batch_size=4, shuffle=False)
    evaluation = DataLoader(TensorDataset(rows[:16]), batch_size=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    total = args.epochs * args.steps_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / total)
    # the scheduler stays unprepared: it steps once per optimizer step, as the schedule above counts them
    model, optimizer, train, evaluation = accelerator.prepare(model, optimizer, train, evaluation)

    step = 0
    for epoch in range(args.epochs):
        model.train()
        for (batch,) in train:
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            if step % args.log_every == 0:
                accelerator.print(
                    f"epoch {epoch} step {step}/{total}: loss: {loss.item():.4f} lr: {scheduler.get_last_lr()[0]:.6f}"
                )
        model.eval()
        losses = []
        with torch.no_grad():
            for (batch,) in evaluation:
                losses.append(accelerator.gather_for_metrics(model(input_ids=batch, labels=batch).loss.reshape(1)))
        eval_loss = torch.cat(losses).mean().item()
        accelerator.print(f"epoch {epoch}: perplexity: {math.exp(eval_loss):.4f} eval_loss: {eval_loss:.4f}")
    accelerator.print("training done")
    accelerator.wait_for_everyone()  # leave the process group together (see hf_trainer.py)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
