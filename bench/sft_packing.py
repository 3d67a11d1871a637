"""W10: supervised fine-tuning with packing. fusetrain.trl.SFTTrainer on packed rows of up to 2,048 tokens against
TRL's SFTTrainer on PyTorch eager with padded batches (its best CPU setting: TRL's padding-free mode needs
FlashAttention), both on W4's 134M Llama with LoRA r=16 on q, k, v, o, over examples of 50 to 1,000 tokens.

    python bench/sft_packing.py [--steps 6] [--warmup 2] [--rounds 1] [--dtype fp32|bf16]

Each (framework, round) runs in its own process, alternating. A step is timed by a trainer callback
(on_step_begin to on_step_end); the first `warmup` steps are dropped and the median of the rest reported.
Tokens per second count the examples' own tokens (TRL's num_tokens metric in both: the attention mask's tokens when
padded, the packed rows' length when packed); the padding share is the positions a step computes that hold no
example token (padding to the batch's longest example, or the engine's rounding of a packed row to 8 tokens).
Figures go to bench/results/w10.json and bench/RESULTS.md takes them from there."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from compare import LLAMA_W4, LORA, cpu_name  # noqa: E402

FRAMEWORKS = {
    "trl_padded": ("trl", {"packing": False}, 4),          # batches of 4 examples padded to the longest
    "fusetrain_packed": ("fusetrain", {"packing": True}, 1),  # one packed row of up to 2,048 tokens a step
    "fusetrain_padded": ("fusetrain", {"packing": False}, 4),
}
EXAMPLES = 400


def dataset():
    import datasets
    import numpy as np

    rng = np.random.default_rng(0)
    lengths = rng.integers(50, 1001, size=EXAMPLES)
    return datasets.Dataset.from_dict(
        {"input_ids": [rng.integers(2, LLAMA_W4["vocab_size"], size=int(n)).tolist() for n in lengths]})


def tokenizer():
    import transformers
    from tokenizers import Tokenizer, models

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, LLAMA_W4["vocab_size"])}}
    return transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")),
                                                pad_token="<pad>", eos_token="<eos>")


def worker(framework: str, steps: int, warmup: int, threads: int, dtype: str) -> dict:
    import peft
    import torch
    import transformers

    torch.set_num_threads(threads)
    kind, settings, batch = FRAMEWORKS[framework]
    if kind == "trl":
        import trl
        trainer_class, config_class = trl.SFTTrainer, trl.SFTConfig
    else:
        from fusetrain import trl as ft_trl
        trainer_class, config_class = ft_trl.SFTTrainer, ft_trl.SFTConfig
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_W4, pad_token_id=0, eos_token_id=1))
    args = config_class(output_dir=str(ROOT / "bench" / ".compare-work" / "w10" / framework), max_steps=warmup + steps,
                        per_device_train_batch_size=batch, learning_rate=1e-4, logging_steps=1, report_to="none",
                        use_cpu=True, bf16=dtype == "bf16", gradient_checkpointing=False, save_strategy="no",
                        max_length=2048, seed=0, dataloader_num_workers=0, disable_tqdm=True, **settings)
    trainer = trainer_class(model=model, args=args, train_dataset=dataset(), processing_class=tokenizer(),
                            peft_config=peft.LoraConfig(**LORA, lora_dropout=0.0))
    shapes = []  # (positions, example tokens) of each batch, in the order they are made
    collate = trainer.data_collator

    def recording(examples):
        out = collate(examples)
        positions = out["input_ids"].numel()
        if "attention_mask" not in out:  # packed: the engine rounds the row to a multiple of 8 tokens
            positions = -(-positions // 8) * 8 if kind == "fusetrain" else positions
        real = int(out["attention_mask"].sum()) if "attention_mask" in out else int(out["input_ids"].numel())
        shapes.append((positions, real))
        return out

    trainer.data_collator = recording
    times = []

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.start)

    trainer.add_callback(Timer())
    trainer.train()
    measured = times[warmup:warmup + steps]
    batches = shapes[warmup:warmup + steps]
    positions, real = sum(p for p, _ in batches), sum(r for _, r in batches)
    return {"framework": framework, "median_step_s": statistics.median(measured), "step_times_s": measured,
            "tokens_per_s": real / sum(measured), "padding_share": 1 - real / positions,
            "tokens_per_step": real / len(batches), "positions_per_step": positions / len(batches),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "engine": kind == "fusetrain" and getattr(trainer, "_engine_model", None) is not None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--frameworks", default="trl_padded,fusetrain_packed,fusetrain_padded")
    parser.add_argument("--output", default=str(ROOT / "bench" / "results" / "w10.json"))
    parser.add_argument("--worker")
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.steps, args.warmup, args.threads, args.dtype)))
        return
    runs: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for framework in args.frameworks.split(","):
            out = subprocess.run([sys.executable, __file__, "--worker", framework, "--steps", str(args.steps),
                                  "--warmup", str(args.warmup), "--threads", str(args.threads), "--dtype", args.dtype],
                                 capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
            line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"{framework} failed:\n{out.stderr[-3000:]}")
            runs.setdefault(framework, []).append(json.loads(line[len("RESULT "):]))
            print(framework, runs[framework][-1]["tokens_per_s"], flush=True)
    summary = {}
    for framework, rs in runs.items():
        summary[framework] = {
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
            "median_step_s": statistics.median(r["median_step_s"] for r in rs),
            "padding_share": statistics.median(r["padding_share"] for r in rs),
            "tokens_per_step": statistics.median(r["tokens_per_step"] for r in rs),
            "positions_per_step": statistics.median(r["positions_per_step"] for r in rs),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in rs), "engine": all(r["engine"] for r in rs), "runs": rs}
    base = summary.get("trl_padded", {}).get("tokens_per_s")
    print(f"W10 on {cpu_name()}, {args.dtype}, {args.threads} threads")
    print("| framework | tokens/s | vs TRL | step (median) | tokens/step | positions/step | padding | peak RSS |")
    print("|---|---|---|---|---|---|---|---|")
    for framework, s in summary.items():
        ratio = f"{s['tokens_per_s'] / base:.2f}x" if base else "-"
        print(f"| {framework} | {s['tokens_per_s']:.0f} | {ratio} | {s['median_step_s']:.2f} s | "
              f"{s['tokens_per_step']:.0f} | {s['positions_per_step']:.0f} | {100 * s['padding_share']:.1f}% | "
              f"{s['peak_rss_mb']:.0f} MiB |")
    pathlib.Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.output).write_text(json.dumps({"cpu": cpu_name(), "dtype": args.dtype, "threads": args.threads,
                                                     "steps": args.steps, "warmup": args.warmup,
                                                     "rounds": args.rounds, "results": summary}, indent=2))


if __name__ == "__main__":
    main()
