"""Build a tiny GPT-2 checkpoint directory (save_pretrained: config, weights, tokenizer) with nothing
downloaded: the tokenizer is trained here on a few sentences. Run with the node env's python:
    python tiny_gpt2.py OUT_DIR"""

import json
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

TEXT = [
    "the cluster trains a model on three nodes",
    "a node has a gpu and the gpu runs the job",
    "the service answers with the words it learned",
] * 20


def main(out: Path) -> None:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<|endoftext|>",
                                   eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(fast), n_positions=64, n_embd=32, n_layer=1, n_head=2,
                        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id)
    model = GPT2LMHeadModel(config)
    model.generation_config.pad_token_id = fast.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    fast.save_pretrained(out)
    (out / "trainer_state.json").write_text(json.dumps({"global_step": 10}))  # as a Trainer's checkpoint-N/ holds


if __name__ == "__main__":
    main(Path(sys.argv[1]))
