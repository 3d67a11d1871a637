"""LoRA fine-tuning of a 1.1B-parameter Llama-shaped model (TinyLlama's shape, built from a config, fresh weights)
at sequence 1024 on this machine: the frozen base in bf16, rank-16 adapters on q, k, v and o trained by AdamW.
Prints the parameter counts, each step's loss and time, and the process's peak resident memory (ru_maxrss, which
covers building the f32 model before the base is converted to bf16).

    python bench/lora_1b.py [--steps 2] [--seq 1024] [--base-dtype bfloat16] [--bf16] [--out bench/results/lora_1b.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import resource
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "build" / "python"))
import fusetrain  # noqa: E402

CONFIG = {  # TinyLlama-1.1B's shape
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 2048,
    "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
}


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--base-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--bf16", action="store_true", help="bf16 matmuls (bf16 dot products with AVX512-BF16, widened to f32 elsewhere)")
    parser.add_argument("--recompute", action="store_true", help="activation checkpointing per layer")
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args()

    started = time.perf_counter()
    model = fusetrain.Model.from_config(CONFIG, seed=0)
    total = model.num_parameters
    rss_built = peak_rss_gib()
    model.enable_lora(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      base_dtype=args.base_dtype)
    model.bf16 = args.bf16
    model.recompute = args.recompute
    opt = fusetrain.AdamW(model, lr=1e-4, weight_decay=0.0)
    print(f"{total:,} parameters; {model.num_parameters:,} trainable (LoRA r=16 on q,k,v,o), base in "
          f"{args.base_dtype}; built in {time.perf_counter() - started:.0f} s, peak RSS so far {rss_built:.2f} GiB",
          flush=True)
    rng = np.random.default_rng(0)
    steps = []
    for step in range(args.steps):
        ids = rng.integers(0, CONFIG["vocab_size"], size=(args.batch, args.seq)).astype(np.int64)
        t0 = time.perf_counter()
        loss, _ = model.loss_and_grads(input_ids=ids, labels=ids)
        opt.step()
        steps.append({"loss": loss, "seconds": time.perf_counter() - t0, "peak_rss_gib": peak_rss_gib()})
        print(f"step {step + 1}: loss {loss:.4f}, {steps[-1]['seconds']:.1f} s, peak RSS {steps[-1]['peak_rss_gib']:.2f} GiB",
              flush=True)
    result = {"config": CONFIG, "parameters": total, "trainable": model.num_parameters, "seq": args.seq,
              "batch": args.batch, "base_dtype": args.base_dtype, "bf16": args.bf16, "recompute": args.recompute,
              "steps": steps, "peak_rss_gib": peak_rss_gib(), "peak_rss_after_build_gib": rss_built,
              "machine": platform.processor() or platform.machine(), "cpu_features": fusetrain.cpu_features()
              if hasattr(fusetrain, "cpu_features") else None}
    print(json.dumps({k: result[k] for k in ("parameters", "trainable", "peak_rss_gib")}))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
