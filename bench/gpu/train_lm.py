"""A small causal LM trained with HF Trainer and saved with its tokenizer, so `ugro serve` can serve its checkpoint.

GPT-2 shape (12 layers, 768 wide: about 90M parameters with this vocabulary) from a config; the tokenizer is a
byte-level BPE trained here on a few sentences, and the data are random tokens: nothing is downloaded. bf16 and
NCCL on a GPU, fp32 and gloo on a CPU (--tiny shrinks the model for a CPU rehearsal).
    torchrun train_lm.py --max-steps 100 [--tiny]
"""

import argparse

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast, Trainer, TrainingArguments

TEXT = ["the cluster trains a model on three nodes", "a node has a gpu and the gpu runs the job",
        "the service answers with the words it learned"] * 50  # fmt: skip


def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<unk>", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(TEXT, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<|endoftext|>",
                                   eos_token="<|endoftext|>", pad_token="<|endoftext|>")  # fmt: skip
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant:{% endif %}")  # fmt: skip
    return fast


class Tokens(torch.utils.data.Dataset):
    def __init__(self, vocab: int, n: int = 20000, length: int = 256):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(2, vocab, (n, length), generator=g)  # no <unk>/<eos>: generation runs its length

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-steps", type=int, default=100)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default="outputs/lm")
    a, _ = ap.parse_known_args()
    tok = tokenizer()
    cuda = torch.cuda.is_available()
    shape = dict(n_embd=64, n_layer=2, n_head=2) if a.tiny else {}
    config = GPT2Config(vocab_size=len(tok), n_positions=1024, bos_token_id=tok.bos_token_id,
                        eos_token_id=tok.eos_token_id, **shape)  # fmt: skip
    model = GPT2LMHeadModel(config)
    model.generation_config.pad_token_id = tok.pad_token_id
    args = TrainingArguments(output_dir=a.out, max_steps=a.max_steps, learning_rate=3e-4, logging_steps=10,
                             per_device_train_batch_size=16 if cuda else 2, save_steps=a.max_steps, report_to=[],
                             bf16=cuda, use_cpu=not cuda, ddp_backend="nccl" if cuda else "gloo",
                             dataloader_num_workers=0)  # fmt: skip
    Trainer(model=model, args=args, train_dataset=Tokens(len(tok)), processing_class=tok).train()


if __name__ == "__main__":
    main()
