"""A Hugging Face Trainer run as users write it: tiny models built from configs, data made here, CPU.

Used to record tests/data/frameworks/hf_* (see record.sh) and by the end-to-end test. Nothing is
downloaded: the models come from configs and the data is random tokens.

    torchrun --nproc-per-node 2 hf_trainer.py --max-steps 30 --logging-steps 5 --eval-steps 10
    torchrun --nproc-per-node 2 hf_trainer.py --seq2seq --max-steps 20 --logging-steps 5
"""

from __future__ import annotations

import argparse
import os
import sys
import threading

import torch
import transformers
from torch.utils.data import Dataset
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    T5Config,
    T5ForConditionalGeneration,
    Trainer,
    TrainingArguments,
)


class RandomTokens(Dataset):
    """Token sequences from a fixed generator: the same data on every rank and every run."""

    def __init__(self, count: int, length: int, vocab: int, seq2seq: bool, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        # A repeating pattern the model can learn, so the loss really falls.
        base = torch.randint(0, vocab, (8,), generator=g)
        self.items = []
        for i in range(count):
            ids = base.roll(i % 8).repeat(length // 8 + 1)[:length]
            if seq2seq:
                self.items.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.flip(0)})
            else:
                self.items.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


class FailAt(transformers.TrainerCallback):
    """Raise once training reaches a step (a crash to resume from)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            raise RuntimeError(f"injected failure at step {state.global_step}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-steps", type=int, default=30)
    # the train_production.py interface a cluster's configured defaults arrive in (a model is built from a config)
    p.add_argument("--model-name", default="tiny")
    p.add_argument("--dataset-name", default="random")
    p.add_argument("--num-epochs", type=float, default=1.0, help="used when --max-steps is 0")
    p.add_argument("--logging-steps", type=int, default=5)
    p.add_argument("--eval-steps", type=int, default=0, help="0: no evaluation")
    p.add_argument("--seq2seq", action="store_true", help="a tiny T5 with Seq2SeqTrainer")
    p.add_argument("--output-dir", default=os.path.join("outputs", os.environ.get("UGRO_JOB_NAME", "hf")))
    p.add_argument("--save-steps", type=int, default=0, help="0: no checkpoints")
    p.add_argument("--resume_from_checkpoint", default=None, help="a checkpoint-<N> directory")
    p.add_argument("--fail-at-step", type=int, default=0, help="raise at this step unless resuming (tests)")
    args = p.parse_args()

    torch.manual_seed(0)
    vocab = 64
    if args.seq2seq:
        config = T5Config(vocab_size=vocab, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2,
                          decoder_start_token_id=0, pad_token_id=0)  # fmt: skip
        model = T5ForConditionalGeneration(config)
    else:
        config = GPT2Config(vocab_size=vocab, bos_token_id=0, eos_token_id=0, n_positions=32, n_embd=32, n_layer=1,
                            n_head=2)  # fmt: skip
        model = GPT2LMHeadModel(config)
    train = RandomTokens(160, 16, vocab, args.seq2seq, seed=1)
    evaluation = RandomTokens(16, 16, vocab, args.seq2seq, seed=2)
    common = dict(
        output_dir=args.output_dir,
        max_steps=args.max_steps if args.max_steps > 0 else -1,
        num_train_epochs=args.num_epochs,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        learning_rate=3e-3,
        logging_steps=args.logging_steps,
        eval_strategy="steps" if args.eval_steps else "no",
        eval_steps=args.eval_steps or None,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        dataloader_num_workers=0,
        disable_tqdm=False,
        seed=0,
    )
    if args.seq2seq:
        trainer = Seq2SeqTrainer(
            model=model, args=Seq2SeqTrainingArguments(**common), train_dataset=train, eval_dataset=evaluation
        )
    else:
        trainer = Trainer(model=model, args=TrainingArguments(**common), train_dataset=train, eval_dataset=evaluation)
    if args.fail_at_step and not args.resume_from_checkpoint:
        trainer.add_callback(FailAt(args.fail_at_step))
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"transformers {transformers.__version__} torch {torch.__version__}", flush=True)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model(args.output_dir)
    # Leave the process group together, as scripts should: a rank that exits while its peer's gloo
    # threads still talk to it can abort ("terminate called without an active exception").
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        # destroy_process_group now and then never returns under gloo (pytorch/pytorch#75097; a whole CI run's
        # rank 1 sat in it past the 60 s hang limit): bounded, then out without the C++ teardown, as
        # train/train_production.py leaves
        closer = threading.Thread(target=torch.distributed.destroy_process_group, daemon=True)
        closer.start()
        closer.join(20)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
