"""`fusetrain train --task sft` and `--task dpo`: supervised fine-tuning and preference tuning from JSON Lines with
TRL's SFTTrainer and DPOTrainer on the engine.

    fusetrain train --task sft --model DIR --train-file chat.jsonl --output-dir out [--packing] [--lora-r 16]
                    [--eval-file dev.jsonl] [any SFTConfig field as --name VALUE or --name-with-dashes VALUE]
    fusetrain train --task dpo --model DIR --train-file pairs.jsonl --output-dir out [--lora-r 16] [--beta 0.1]
                    [any DPOConfig field]

DPO reads {"prompt": ..., "chosen": ..., "rejected": ...} per line (strings, or lists of chat messages rendered with
the tokenizer's chat template); with LoRA the reference is the base model, else a frozen copy of the model.

Each line of the data is one example in a form TRL reads: {"messages": [{"role": ..., "content": ...}, ...]}
(rendered with the chat template of the tokenizer in DIR, by transformers' Jinja2), {"prompt": ..., "completion": ...}
(the loss on the completion only, TRL's default), or {"text": ...}. The model directory holds config.json, the
weights and the tokenizer files. LoRA: --lora-r (0: full fine-tuning), --lora-alpha, --lora-dropout,
--lora-target-modules (comma-separated; default: PEFT's for the model type). The rest are TRL's SFTConfig and
transformers' TrainingArguments fields (--max-length, --num-train-epochs, --learning-rate, ...); --max-seq-length is
taken for --max-length, as the other tasks name it. Defaults that differ from TRL's for a CPU: use_cpu, bf16 off
(--bf16 turns it on), report_to none, and output_dir "sft_output".
"""

from __future__ import annotations

import json
import os
import sys


def _fail(message: str) -> int:
    print(f"fusetrain: error: {message}", file=sys.stderr)
    return 2


# Per task: the TRL trainer and config, the default output directory, and the example forms the data may take.
_TASKS = {"sft": ("SFTTrainer", "SFTConfig", "sft_output",
                  ({"messages"}, {"prompt", "completion"}, {"text"}),
                  '"messages", "prompt" and "completion", or "text"'),
          "dpo": ("DPOTrainer", "DPOConfig", "dpo_output", ({"prompt", "chosen", "rejected"}, {"chosen", "rejected"}),
                  '"prompt", "chosen" and "rejected"')}


def main(argv: list[str], task: str = "sft") -> int:
    """Runs `train --task sft` (or dpo) with these arguments (after the subcommand and --task); returns the exit
    status."""
    import transformers

    from fusetrain import trl as ft_trl

    trainer_name, config_name, output_dir, forms, form_text = _TASKS[task]

    own = {"--model": None, "--train-file": None, "--eval-file": None, "--lora-r": "0", "--lora-alpha": "8",
           "--lora-dropout": "0", "--lora-target-modules": None}
    rest, at = [], 0
    while at < len(argv):
        name, equals, value = argv[at].partition("=")
        name = "--max-length" if name == "--max-seq-length" else name
        if name in own:
            if not equals:
                if at + 1 == len(argv):
                    return _fail(f"{name} expects a value, found none")
                at += 1
                value = argv[at]
            own[name] = value
        else:
            rest.append(f"{name}={value}" if equals else name)
        at += 1
    if own["--model"] is None or not os.path.isfile(os.path.join(own["--model"], "config.json")):
        return _fail(f"--task {task} needs --model DIR with config.json, weights and tokenizer files; found "
                     f"{own['--model']!r}")
    if own["--train-file"] is None or not own["--train-file"].endswith(".jsonl"):
        return _fail(f"--task {task} reads JSON Lines (--train-file data.jsonl, a {form_text} example per line); "
                     f"found {own['--train-file']!r}")
    defaults = {"--output_dir": output_dir, "--use_cpu": "True", "--bf16": "False", "--report_to": "none"}
    given = {a.split("=", 1)[0].replace("-", "_").lstrip("_") for a in rest if a.startswith("--")}
    for name, value in defaults.items():
        if name.lstrip("-") not in given:
            rest += [name, value]
    try:
        (config,) = transformers.HfArgumentParser(getattr(ft_trl, config_name)).parse_args_into_dataclasses(rest)
        lora_r = int(own["--lora-r"])
        if lora_r < 0:
            raise ValueError(f"--lora-r must be 0 (full fine-tuning) or positive, found {lora_r}")
    except (ValueError, SystemExit) as error:
        return _fail(f"--task {task}: {error}") if not isinstance(error, SystemExit) else int(error.code or 2)

    import datasets

    files = {"train": own["--train-file"]}
    if own["--eval-file"]:
        files["eval"] = own["--eval-file"]
    try:
        data = datasets.load_dataset("json", data_files=files)
    except Exception as error:  # datasets raises its own types for unreadable JSON Lines
        return _fail(f"{own['--train-file']}: not JSON Lines that datasets can read: {error}")
    columns = set(data["train"].column_names)
    if not any(form <= columns for form in forms):
        return _fail(f"{own['--train-file']}: each line needs {form_text}; found the keys {sorted(columns)}")
    peft_config = None
    if lora_r > 0:
        import peft

        targets = own["--lora-target-modules"]
        peft_config = peft.LoraConfig(r=lora_r, lora_alpha=float(own["--lora-alpha"]),
                                      lora_dropout=float(own["--lora-dropout"]),
                                      target_modules=targets.split(",") if targets else None, task_type="CAUSAL_LM")
    if "eval" in data and config.eval_strategy == "no":
        config.eval_strategy = "epoch"
    trainer = getattr(ft_trl, trainer_name)(model=own["--model"], args=config, train_dataset=data["train"],
                                            eval_dataset=data.get("eval"), peft_config=peft_config)
    result = trainer.train()
    trainer.save_model(config.output_dir)
    print(json.dumps({"train_loss": result.training_loss, "global_step": result.global_step,
                      "output_dir": config.output_dir}))
    return 0
