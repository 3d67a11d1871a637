"""Sliding-window attention against full causal attention: one forward + backward (Model.loss_and_grads) of two
Mistral-shaped models that differ only in `sliding_window` (none, and --window), at one long sequence.

    python bench/bench_sliding_window.py [--seq 2048] [--window 256] [--rounds 5]

The two models are timed alternately, --rounds times each after one warm-up call; prints the median of each and
their ratio. With a window, the attention kernel skips the tiles outside it, so its work grows as T·window rather
than T²/2; the rest of the step (projections, MLP, head) is the same in both.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not 0 < args.window < args.seq or args.rounds < 1:
        parser.error(f"need 0 < --window < --seq and --rounds >= 1, found {args.window}, {args.seq}, {args.rounds}")
    sys.path.insert(0, str(ROOT / "build" / "python"))
    import fusetrain
    import torch
    import transformers

    shape = dict(vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                 intermediate_size=512, max_position_embeddings=args.seq, pad_token_id=0)
    models = {}
    for window in (None, args.window):
        torch.manual_seed(0)
        path = tempfile.mkdtemp(prefix="fusetrain-window-")
        transformers.MistralForCausalLM(transformers.MistralConfig(**shape, sliding_window=window)).save_pretrained(path)
        models[window] = fusetrain.Model.from_pretrained(path)
    ids = np.random.default_rng(0).integers(1, shape["vocab_size"], size=(1, args.seq)).astype(np.int64)
    batch = dict(input_ids=ids, attention_mask=np.ones_like(ids), labels=ids)
    times = {window: [] for window in models}
    for model in models.values():
        model.loss_and_grads(**batch)
    for _ in range(args.rounds):
        for window, model in models.items():
            start = time.perf_counter()
            model.loss_and_grads(**batch)
            times[window].append(time.perf_counter() - start)
    full, windowed = (1e3 * float(np.median(times[w])) for w in (None, args.window))
    print(f"sequence {args.seq}: full causal {full:.1f} ms, window {args.window} {windowed:.1f} ms "
          f"(median of {args.rounds}), ratio {windowed / full:.3f}")


if __name__ == "__main__":
    main()
