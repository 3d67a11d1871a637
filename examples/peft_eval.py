"""Evaluates LoRA adapters with PEFT and transformers alone (no fusetrain): loads the base model, applies the adapter
directory with peft.PeftModel.from_pretrained, and prints the causal-LM loss on a text file cut into blocks as
`fusetrain train --task clm` cuts a .txt file: every non-empty line tokenized (with the tokenizer's special tokens),
all of them concatenated, and the concatenation cut into whole blocks (the remainder dropped); the loss is the
mean of the batches' losses, as transformers' Trainer.evaluate reports it. The ids come from the
`tokenizers` library reading the model's tokenizer.json. `--quantize nf4|fp4|int8` loads the base as bitsandbytes
quantises it (BitsAndBytesConfig: 4-bit blocks of 64 computed in float32, or LLM.int8), the base of a
`fusetrain train --base-dtype nf4|fp4|int8` run.

    python examples/peft_eval.py --model /tmp/tiny-llama --adapter out/lora --eval-file eval.txt --block-size 256
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import peft
import tokenizers
import torch
import transformers


def blocks(tokenizer: tokenizers.Tokenizer, lines: list[str], block_size: int) -> np.ndarray:
    ids = [i for line in lines if line for i in tokenizer.encode(line).ids]
    return np.asarray([ids[k:k + block_size] for k in range(0, len(ids) - block_size + 1, block_size)], dtype=np.int64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--adapter", required=True)
    parser.add_argument("--eval-file", required=True)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--quantize", choices=["nf4", "fp4", "int8"], help="load the base quantised by bitsandbytes")
    args = parser.parse_args()

    tokenizer = tokenizers.Tokenizer.from_file(f"{args.model}/tokenizer.json")
    with open(args.eval_file, encoding="utf-8") as f:
        lines = f.read().splitlines()
    data = blocks(tokenizer, lines, args.block_size)
    quantization = None
    if args.quantize == "int8":
        quantization = transformers.BitsAndBytesConfig(load_in_8bit=True)
    elif args.quantize:
        quantization = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=args.quantize,
                                                       bnb_4bit_compute_dtype=torch.float32)
    base = transformers.AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="eager",
                                                             quantization_config=quantization,
                                                             device_map="cpu" if quantization else None)
    model = peft.PeftModel.from_pretrained(base, args.adapter).eval()
    losses = []
    with torch.no_grad():
        for start in range(0, len(data), args.batch_size):
            ids = torch.from_numpy(data[start:start + args.batch_size])
            losses.append((model(input_ids=ids, labels=ids).loss.item(), len(ids)))
    # each batch weighs the batch size, a last smaller one too, as transformers' Trainer.evaluate weighs them (it
    # repeats each batch's loss per_device_eval_batch_size times): the mean of the batches' losses
    loss = sum(value for value, _ in losses) / len(losses)
    print(json.dumps({"eval_loss": loss, "eval_perplexity": math.exp(loss), "blocks": len(data)}))


if __name__ == "__main__":
    main()
