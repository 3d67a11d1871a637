"""W11: preference tuning. fusetrain.trl.DPOTrainer against TRL's DPOTrainer on PyTorch eager, both on W4's 134M
Llama with LoRA r=16 on q, k, v, o (sigmoid loss, the reference the base with the adapters off): prompts of 256
tokens, chosen and rejected responses of 256 (the EOS included), 4 pairs a step (8 sequences of 512 tokens).

    python bench/dpo.py [--steps 5] [--warmup 2] [--rounds 1] [--dtype fp32|bf16]
    python bench/dpo.py --vocab-memory     # the step's activation arena at vocabulary 32k and 152k

Each (framework, round) runs in its own process, alternating. A step is timed by a trainer callback
(on_step_begin to on_step_end): the policy's forward and backward and the reference's forward, in both; the first
`warmup` steps are dropped and the median of the rest reported. Tokens per second count the 8 sequences' tokens;
peak memory is the process's peak resident set (the model, its LoRA state, data and the step's activations).
Figures go to bench/results/w11.json and bench/RESULTS.md takes them from there."""

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

FRAMEWORKS = ("trl", "fusetrain")
PAIRS, PROMPT, RESPONSE = 4, 256, 256
EXAMPLES = 64


def dataset():
    """Words t<id> separated by spaces (a word-level tokenizer maps each to its id): the prompt ends with a space,
    and each response holds RESPONSE - 1 words and a space, so TRL's appended EOS makes RESPONSE tokens."""
    import datasets
    import numpy as np

    rng = np.random.default_rng(0)

    def words(n):
        return "".join(f"t{int(i)} " for i in rng.integers(2, LLAMA_W4["vocab_size"], size=n))

    rows = [{"prompt": words(PROMPT), "chosen": words(RESPONSE - 1), "rejected": words(RESPONSE - 1)}
            for _ in range(EXAMPLES)]
    return datasets.Dataset.from_list(rows)


def tokenizer():
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, LLAMA_W4["vocab_size"])}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>")


def worker(framework: str, steps: int, warmup: int, threads: int, dtype: str) -> dict:
    import peft
    import torch
    import transformers

    torch.set_num_threads(threads)
    if framework == "trl":
        import trl
        trainer_class, config_class = trl.DPOTrainer, trl.DPOConfig
    else:
        from fusetrain import trl as ft_trl
        trainer_class, config_class = ft_trl.DPOTrainer, ft_trl.DPOConfig
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_W4, pad_token_id=0, eos_token_id=1))
    args = config_class(output_dir=str(ROOT / "bench" / ".compare-work" / "w11" / framework),
                        max_steps=warmup + steps, per_device_train_batch_size=PAIRS, learning_rate=1e-4,
                        logging_steps=1, report_to="none", use_cpu=True, bf16=dtype == "bf16",
                        gradient_checkpointing=False, save_strategy="no", max_length=PROMPT + RESPONSE, seed=0,
                        dataloader_num_workers=0, disable_tqdm=True)
    trainer = trainer_class(model=model, args=args, train_dataset=dataset(), processing_class=tokenizer(),
                            peft_config=peft.LoraConfig(**LORA, lora_dropout=0.0))
    shapes = []
    collate = trainer.data_collator

    def recording(examples):
        out = collate(examples)
        shapes.append(tuple(out["input_ids"].shape))
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
    tokens = sum(b * t for b, t in shapes[warmup:warmup + steps])
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return {"framework": framework, "median_step_s": statistics.median(measured), "step_times_s": measured,
            "tokens_per_s": tokens / sum(measured), "batch_shape": list(shapes[-1]), "losses": losses,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "engine": framework == "fusetrain" and getattr(trainer, "_engine_model", None) is not None}


def vocab_memory(threads: int) -> dict:
    """The planned activation arena of one DPO training step of W4's shape with LoRA, 8,192 tokens (4 pairs of
    1,024-token sequences), at a 32,000- and a 152,064-word vocabulary (untied head): the chunked log-probabilities
    keep the (8192 x V) logits from ever existing whole."""
    import numpy as np

    import fusetrain

    out = {}
    rng = np.random.default_rng(0)
    for vocab in (32000, 152064):
        config = dict(LLAMA_W4, vocab_size=vocab, architectures=["LlamaForCausalLM"], model_type="llama")
        model = fusetrain.Model.from_config(config)
        model.set_num_threads(threads)
        model.enable_lora(r=LORA["r"], lora_alpha=LORA["lora_alpha"], target_modules=LORA["target_modules"])
        model.set_preference("sigmoid", 0.1)
        ids = rng.integers(2, vocab, size=(2 * PAIRS, 1024))
        labels = ids.copy()
        labels[:, :512] = -100  # prompts of 512 tokens, completions of 512
        model.train()
        model.loss_and_grads(input_ids=ids, labels=labels, ref_logps=np.zeros(2 * PAIRS, np.float32))
        report = model.last_memory_report()
        out[vocab] = report["activation_peak_bytes"] / 2**20
        print(f"vocabulary {vocab}: activation arena {out[vocab]:.1f} MiB", flush=True)
    return {"activation_arena_mib": out, "growth": out[152064] / out[32000] - 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--output", default=str(ROOT / "bench" / "results" / "w11.json"))
    parser.add_argument("--worker")
    parser.add_argument("--vocab-memory", action="store_true")
    args = parser.parse_args()
    if args.vocab_memory:
        result = vocab_memory(args.threads)
        print(f"152k vs 32k: {100 * result['growth']:+.1f}%")
        path = pathlib.Path(args.output).with_name("w11_vocab_memory.json")
        path.write_text(json.dumps({"cpu": cpu_name(), **result}, indent=2))
        return
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.steps, args.warmup, args.threads, args.dtype)))
        return
    runs: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for framework in FRAMEWORKS:
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
            "peak_rss_mb": max(r["peak_rss_mb"] for r in rs), "engine": all(r["engine"] for r in rs), "runs": rs}
    base = summary["trl"]
    print(f"W11 on {cpu_name()}, {args.dtype}, {args.threads} threads, {PAIRS} pairs of {PROMPT} + {RESPONSE} tokens")
    print("| framework | tokens/s | vs TRL | step (median) | peak RSS | vs TRL |")
    print("|---|---|---|---|---|---|")
    for framework, s in summary.items():
        print(f"| {framework} | {s['tokens_per_s']:.0f} | {s['tokens_per_s'] / base['tokens_per_s']:.2f}x | "
              f"{s['median_step_s']:.2f} s | {s['peak_rss_mb']:.0f} MiB | {s['peak_rss_mb'] / base['peak_rss_mb']:.2f}x |")
    pathlib.Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.output).write_text(json.dumps({"cpu": cpu_name(), "dtype": args.dtype, "threads": args.threads,
                                                     "steps": args.steps, "warmup": args.warmup,
                                                     "rounds": args.rounds, "results": summary}, indent=2))


if __name__ == "__main__":
    main()
