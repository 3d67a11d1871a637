"""The optimizer step alone: fusetrain's AdamW with gradient clipping (one call over the flat parameter, gradient and
moment buffers) against torch.optim.AdamW with foreach=True and fused=True (each after clip_grad_norm_), on the
parameters of a bert-base-uncased configuration (about 110M), all starting from the same weights and the same real
gradients (one small batch's).

    python bench/bench_optimizer.py [--threads 2] [--steps 20]

Prints the median step time of each over --steps timed steps (after 3 warm-up steps) and the effective memory
bandwidth: an AdamW step with clipping reads parameters, gradients and both moments and writes parameters and
moments, 7 float32 values per parameter, plus one read of the gradients for the norm.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "build" / "python"))


def bert_base_config() -> dict:
    return {"architectures": ["BertForMaskedLM"], "model_type": "bert", "vocab_size": 30522, "hidden_size": 768,
            "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072, "hidden_act": "gelu",
            "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "max_position_embeddings": 512,
            "type_vocab_size": 2, "initializer_range": 0.02, "layer_norm_eps": 1e-12, "pad_token_id": 0}


def timed(step, steps: int) -> list[float]:
    for _ in range(3):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    import numpy as np
    import torch
    import fusetrain

    torch.set_num_threads(args.threads)
    model = fusetrain.Model.from_config(bert_base_config())
    model.set_num_threads(args.threads)
    model.train()
    ids = np.random.default_rng(0).integers(1000, 2000, (2, 16))
    _, grads = model.loss_and_grads(ids, labels=ids)  # real gradients, the same for every optimizer
    optimizer = fusetrain.AdamW(model, lr=1e-4, weight_decay=0.01)
    n = model.num_parameters
    results = {"fusetrain AdamW + clipping": timed(lambda: optimizer.clip_and_step(1.0), args.steps)}

    weights = model.state_dict()
    del model, optimizer
    for variant in ("foreach", "fused"):
        params = []
        for name, value in weights.items():
            params.append(torch.nn.Parameter(torch.from_numpy(value.copy())))
            params[-1].grad = torch.from_numpy(grads[name].copy())
        torch_optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, **{variant: True})

        def step():
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
            torch_optimizer.step()

        results[f"torch.optim.AdamW({variant}=True) + clip_grad_norm_"] = timed(step, args.steps)

    bytes_per_step = 8 * 4 * n
    print(f"{n / 1e6:.1f}M parameters, {args.threads} threads, median of {args.steps} steps\n")
    print("| optimizer step | median (ms) | effective GB/s | vs fusetrain |\n|---|---|---|---|")
    ours = statistics.median(next(iter(results.values())))
    for name, times in results.items():
        median = statistics.median(times)
        print(f"| {name} | {1e3 * median:.1f} | {bytes_per_step / median / 1e9:.1f} | {median / ours:.2f}x |")


if __name__ == "__main__":
    main()
