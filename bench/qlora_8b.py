"""QLoRA of an 8B Llama-3-shaped model on this machine: `fusetrain train --base-dtype nf4` on a checkpoint with
Llama 3 8B's config (hidden 4,096, 32 layers, 8 key/value heads, vocabulary 128,256; fresh weights drawn as
transformers initialises them, stored in bf16, 16 GB), rank-16 adapters on q, k, v, o, gate, up and down, batch 1,
on Tiny Shakespeare. The CLI maps the checkpoint and quantises each projection as it loads it (the full-precision
model never exists in memory), keeps the embeddings and the LM head in bf16, and recomputes each layer's
activations in backward. Prints each step's loss and time and the run's peak resident memory (the CLI process's
ru_maxrss: loading, quantising and training).

    python bench/qlora_8b.py --model /tmp/llama3-8b [--seq 1024] [--steps 5] [--out bench/results/qlora_8b.json]

The checkpoint is written first if `--model` does not hold one (about 16 GB of disk and a few minutes)."""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import resource
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT.parent / "shared" / "datasets" / "tinyshakespeare" / "input.txt"

CONFIG = {  # Llama 3 8B's shape
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "initializer_range": 0.02, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}


def write_checkpoint(out: pathlib.Path) -> None:
    """config.json, a Llama-2-style tokenizer trained on Tiny Shakespeare, and the weights in bf16, one shard per
    layer (normal(0, 0.02) as transformers draws them, RMSNorm weights one), with model.safetensors.index.json."""
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(ROOT / "examples"))
    from make_tiny_llama import llama2_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tok = llama2_tokenizer(SHAKESPEARE, 8000)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizerFast",
                                                           "bos_token": "<s>", "eos_token": "</s>",
                                                           "unk_token": "<unk>", "model_max_length": 8192}))
    torch.manual_seed(0)
    h, i, v = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["vocab_size"]
    kv = h // CONFIG["num_attention_heads"] * CONFIG["num_key_value_heads"]

    def normal(*shape):
        return torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, CONFIG["initializer_range"])

    shards = {"model-embed.safetensors": {"model.embed_tokens.weight": normal(v, h)},
              "model-head.safetensors": {"lm_head.weight": normal(v, h),
                                         "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}}
    index = {}
    for name, tensors in shards.items():
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        index.update({k: name for k in tensors})
    for layer in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        tensors = {p + "self_attn.q_proj.weight": normal(h, h), p + "self_attn.k_proj.weight": normal(kv, h),
                   p + "self_attn.v_proj.weight": normal(kv, h), p + "self_attn.o_proj.weight": normal(h, h),
                   p + "mlp.gate_proj.weight": normal(i, h), p + "mlp.up_proj.weight": normal(i, h),
                   p + "mlp.down_proj.weight": normal(h, i),
                   p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                   p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)}
        name = f"model-layer{layer:02d}.safetensors"
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        index.update({k: name for k in tensors})
        print(f"wrote layer {layer + 1}/{CONFIG['num_hidden_layers']}", flush=True)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}, indent=1))
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2))  # last: a directory with a config is complete


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=pathlib.Path, required=True)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--base-dtype", default="nf4", choices=["nf4", "fp4", "int8"])
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args()
    if not (args.model / "config.json").exists():
        write_checkpoint(args.model)
    binary = ROOT / "build" / "fusetrain"
    info = subprocess.run([str(binary), "info"], capture_output=True, text=True, check=True).stdout
    command = [str(binary), "train", "--model", str(args.model), "--task", "clm", "--train-file", str(SHAKESPEARE),
               "--max-seq-length", str(args.seq), "--lora-r", "16", "--lora-alpha", "32", "--lora-target-modules",
               "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "--base-dtype", args.base_dtype,
               "--per-device-train-batch-size", "1", "--max-steps", str(args.steps), "--logging-steps", "1",
               "--learning-rate", str(args.lr), "--lr-scheduler-type", "constant", "--save-strategy", "no",
               "--train-sampling-strategy", "sequential", "--disable-tqdm",
               "--output-dir", str(args.model.parent / (args.model.name + "-qlora"))]
    print(" ".join(command), flush=True)
    started = time.perf_counter()
    run = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    losses, stamps, lines = [], [], []
    for line in run.stderr:
        lines.append(line)
        sys.stderr.write(line)
        if line.startswith('{"') and '"loss"' in line and '"train_loss"' not in line:
            losses.append(json.loads(line)["loss"])
            stamps.append(time.perf_counter() - started)
    run.wait()
    wall = time.perf_counter() - started
    peak_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB on Linux
    if run.returncode != 0:
        sys.exit(f"fusetrain train failed ({run.returncode})")
    frozen = next((re.search(r"([\d.]+) MiB of frozen weights", l).group(1) for l in lines
                   if "MiB of frozen weights" in l), None)
    step_seconds = [b - a for a, b in zip(stamps, stamps[1:])]
    result = {"cpu": info.strip().splitlines()[1:3], "config": CONFIG, "seq": args.seq, "batch": 1,
              "base_dtype": args.base_dtype, "lora": "r=16, alpha 32, q,k,v,o,gate,up,down", "losses": losses,
              "seconds_to_first_step_logged": stamps[0] if stamps else None, "step_seconds": step_seconds,
              "wall_seconds": wall, "peak_rss_gib": peak_gib, "frozen_weights_mib": float(frozen) if frozen else None}
    print(json.dumps({k: result[k] for k in ("losses", "step_seconds", "peak_rss_gib", "frozen_weights_mib")}))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
