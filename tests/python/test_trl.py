"""fusetrain.trl's SFTTrainer against TRL's own SFTTrainer on PyTorch: the same script, data and order (sequential
sampling), one import apart; their logged losses and mean token entropies agree within 1e-4 relative over 10 steps
(f32 sums in another order leave ~1e-6 per step, compounding through the AdamW updates), the token accuracies
to f32 rounding and the token counts exactly, with the same metric keys; padded, packed (bin-fitting, padding-free
rows) and padding-free, full fine-tune and LoRA, and completion-only loss on prompt/completion pairs.

A small Llama (odd sizes, grouped-query attention) with a byte-level BPE tokenizer trained on Tiny Shakespeare,
examples of 3 to 60 lines."""

from __future__ import annotations

import pathlib
import warnings

import numpy as np
import pytest
import torch
import transformers

pytest.importorskip("trl")
import datasets  # noqa: E402
import trl  # noqa: E402

import hf_models as hf  # noqa: E402

fusetrain = hf.fusetrain_module()
from fusetrain import trl as ft_trl  # noqa: E402

SHAKESPEARE = pathlib.Path(__file__).resolve().parents[3] / "shared" / "datasets" / "tinyshakespeare" / "input.txt"
STEPS = 10


def shakespeare_tokenizer(vocab_size: int, special: list[str], pad: str, eos: str):
    """A byte-level BPE tokenizer trained on Tiny Shakespeare's first 4,000 lines: (the tokenizers object, the
    transformers tokenizer wrapping it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(SHAKESPEARE.read_text().splitlines()[:4000], trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return bpe, transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token=pad, eos_token=eos)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("llama-sft")
    bpe, tokenizer = shakespeare_tokenizer(301, ["<pad>", "<eos>"], pad="<pad>", eos="<eos>")
    config = transformers.LlamaConfig(vocab_size=bpe.get_vocab_size(), hidden_size=72, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=2, intermediate_size=100,
                                      max_position_embeddings=1024, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def text_dataset(n: int = 48, seed: int = 0) -> datasets.Dataset:
    lines = SHAKESPEARE.read_text().splitlines()
    rng = np.random.default_rng(seed)
    texts = []
    for _ in range(n):
        start, count = int(rng.integers(0, 20000)), int(rng.integers(3, 60))
        texts.append("\n".join(lines[start:start + count]))
    return datasets.Dataset.from_dict({"text": texts})


def prompt_completion_dataset(n: int = 48, seed: int = 1) -> datasets.Dataset:
    """Prompt/completion pairs: TRL trains on the completions only (completion_only_loss, its default for them)."""
    lines = SHAKESPEARE.read_text().splitlines()
    rng = np.random.default_rng(seed)
    rows = {"prompt": [], "completion": []}
    for _ in range(n):
        start = int(rng.integers(0, 20000))
        rows["prompt"].append("\n".join(lines[start:start + int(rng.integers(1, 8))]))
        rows["completion"].append("\n".join(lines[start + 8:start + 8 + int(rng.integers(2, 40))]))
    return datasets.Dataset.from_dict(rows)


def run(trainer_class, config_class, model_dir, tmp_path, peft: bool = False, completion: bool = False,
        quantization=None, **settings) -> list[dict]:
    args = config_class(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=4,
                        learning_rate=1e-3, logging_steps=1, report_to="none", use_cpu=True, bf16=False,
                        gradient_checkpointing=False, train_sampling_strategy="sequential", save_strategy="no",
                        seed=0, **{"max_length": 512, **settings})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager",
                                                              quantization_config=quantization,
                                                              device_map="cpu" if quantization else None)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    peft_config = None
    if peft:
        import peft as peft_lib
        peft_config = peft_lib.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    data = prompt_completion_dataset() if completion else text_dataset()
    trainer = trainer_class(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                            peft_config=peft_config)
    trainer.train()
    if trainer_class is ft_trl.SFTTrainer:
        assert trainer._engine_model is not None  # trained on the engine (a fallback would have warned)
    return [entry for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize("case", [
    pytest.param({}, id="padded"),
    pytest.param({"packing": True}, id="packed"),
    pytest.param({"padding_free": True, "max_length": None}, id="padding-free"),  # TRL truncates only when packing
    pytest.param({"packing": True, "peft": True}, id="packed-lora"),
    pytest.param({"packing": True, "completion": True}, id="packed-completion-only"),
])
def test_sft_losses_match_trl_over_ten_steps(case, model_dir, tmp_path):
    settings = dict(case)
    peft, completion = settings.pop("peft", False), settings.pop("completion", False)
    theirs = run(trl.SFTTrainer, trl.SFTConfig, model_dir, tmp_path / "trl", peft, completion, **settings)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fusetrain: training runs with")  # a fallback fails the test
        ours = run(ft_trl.SFTTrainer, ft_trl.SFTConfig, model_dir, tmp_path / "ours", peft, completion, **settings)
    assert len(ours) == len(theirs) == STEPS
    want = np.array([e["loss"] for e in theirs])
    got = np.array([e["loss"] for e in ours])
    rel = np.abs(got - want) / np.abs(want)
    assert rel.max() < 1e-4, f"worst relative loss error {rel.max():.3g} at step {int(rel.argmax())}: {got} vs {want}"
    assert [e["num_tokens"] for e in ours] == [e["num_tokens"] for e in theirs]
    # The token statistics TRL logs: the mean entropy (f32 sums, as the loss) and the top-1 accuracy (a count: a
    # logit that rounding moved past another would change a count: none does here, so the ratios agree to f32).
    entropy = np.array([[e["entropy"] for e in run] for run in (ours, theirs)])
    assert np.abs(entropy[0] - entropy[1]).max() <= 1e-4 * np.abs(entropy[1]).max(), entropy
    accuracy = np.array([[e["mean_token_accuracy"] for e in run] for run in (ours, theirs)])
    assert np.abs(accuracy[0] - accuracy[1]).max() <= 1e-6, accuracy  # float32 ratios of equal counts
    assert set(ours[0]) == set(theirs[0])  # the same metric keys
    assert want[-1] < want[0]  # it trains


@pytest.fixture(scope="module")
def quantisable_model_dir(tmp_path_factory) -> pathlib.Path:
    """The SFT model with widths whose weight rows are whole blocks of 64 (bitsandbytes' CPU kernel restarts its
    blocks at each row where its quantiser and the engine count them over the flattened weight: test_quant.py)."""
    out = tmp_path_factory.mktemp("llama-sft-4bit")
    bpe, tokenizer = shakespeare_tokenizer(301, ["<pad>", "<eos>"], pad="<pad>", eos="<eos>")
    config = transformers.LlamaConfig(vocab_size=bpe.get_vocab_size(), hidden_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                                      max_position_embeddings=1024, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_sft_on_a_4bit_base_matches_trl(quant_type, quantisable_model_dir, tmp_path):
    """QLoRA through TRL: the model loaded 4-bit by bitsandbytes (double-quantised absmax, float32 compute), LoRA
    from SFTConfig's peft_config, packed. fusetrain.trl.SFTTrainer reads bitsandbytes' codes as they are and trains
    on the engine; its losses follow TRL's on PyTorch + bitsandbytes within 1e-4 over 10 steps, as for a full-precision
    base (the dequantised weights are bit-identical; what differs is the order of f32 sums)."""
    quantization = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                                   bnb_4bit_use_double_quant=True,
                                                   bnb_4bit_compute_dtype=torch.float32)
    theirs = run(trl.SFTTrainer, trl.SFTConfig, quantisable_model_dir, tmp_path / "trl", peft=True,
                 quantization=quantization, packing=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fusetrain: training runs with")  # a fallback fails the test
        ours = run(ft_trl.SFTTrainer, ft_trl.SFTConfig, quantisable_model_dir, tmp_path / "ours", peft=True,
                   quantization=quantization, packing=True)
    assert len(ours) == len(theirs) == STEPS
    want = np.array([e["loss"] for e in theirs])
    got = np.array([e["loss"] for e in ours])
    rel = np.abs(got - want) / np.abs(want)
    assert rel.max() < 1e-4, f"worst relative loss error {rel.max():.3g} at step {int(rel.argmax())}: {got} vs {want}"
    assert [e["num_tokens"] for e in ours] == [e["num_tokens"] for e in theirs]
    assert want[-1] < want[0]


# ---------------------------------------------------------------- TRL's own script

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chat_model_dir(root: pathlib.Path) -> pathlib.Path:
    """A small Qwen2 with a ChatML template in its tokenizer, as chat models ship."""
    out = root / "qwen2-chat"
    bpe, tokenizer = shakespeare_tokenizer(311, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], pad="<|endoftext|>",
                                           eos="<|im_end|>")
    tokenizer.chat_template = CHATML
    config = transformers.Qwen2Config(vocab_size=bpe.get_vocab_size(), hidden_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                                      max_position_embeddings=1024, pad_token_id=0, eos_token_id=2)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def chat_data_dir(root: pathlib.Path) -> pathlib.Path:
    """train.jsonl of conversations (a dataset directory load_dataset reads as it is)."""
    import json

    out = root / "chat-data"
    out.mkdir()
    lines = SHAKESPEARE.read_text().splitlines()
    rng = np.random.default_rng(0)
    with open(out / "train.jsonl", "w") as f:
        for _ in range(40):
            start = int(rng.integers(0, 20000))
            messages = [{"role": "user", "content": " ".join(lines[start:start + int(rng.integers(1, 4))])},
                        {"role": "assistant", "content": "\n".join(lines[start + 4:start + int(rng.integers(6, 30))])}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return out


def run_trl_script(script: str, args: list[str], cwd: pathlib.Path) -> None:
    import os
    import subprocess
    import sys

    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(cwd / "hf_datasets"),
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    result = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, env=env, cwd=cwd,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def test_trl_sft_script_runs_with_one_import_line_changed(tmp_path):
    """TRL's own trl/scripts/sft.py (as TRL ships it, read from the installed package), once as it is and once with
    its `from trl import ...` line naming fusetrain.trl: both train a small chat model on local JSON Lines
    conversations with packing, and write the same files and metric keys."""
    import json

    source = pathlib.Path(trl.__file__).parent / "scripts" / "sft.py"
    text = source.read_text()
    line = "from trl import SFTTrainer, get_dataset, get_peft_config, get_quantization_config"
    assert text.count(line) == 1
    ours = tmp_path / "sft_fusetrain.py"
    ours.write_text(text.replace(line, line.replace("from trl import", "from fusetrain.trl import")))
    model, data = chat_model_dir(tmp_path), chat_data_dir(tmp_path)
    outputs = {}
    for name, script in (("trl", str(source)), ("fusetrain", str(ours))):
        out = tmp_path / f"out-{name}"
        result = run_trl_script(script, [
            "--model_name_or_path", str(model), "--dataset_name", str(data), "--output_dir", str(out),
            "--packing", "--max_length", "256", "--per_device_train_batch_size", "2", "--max_steps", "6",
            "--learning_rate", "1e-3", "--logging_steps", "2", "--save_steps", "6", "--use_cpu", "--bf16", "False",
            "--report_to", "none", "--seed", "0", "--use_peft", "--lora_r", "8", "--lora_alpha", "16"], tmp_path)
        if name == "fusetrain":
            assert "runs with transformers' own loop" not in result.stderr  # no fallback
        state = json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())
        outputs[name] = (sorted(p.name for p in out.iterdir()), sorted(p.name for p in (out / "checkpoint-6").iterdir()),
                         [sorted(e) for e in state["log_history"]], state["log_history"])
    ours_files, theirs_files = outputs["fusetrain"], outputs["trl"]
    assert ours_files[0] == theirs_files[0]  # the output directory
    # A checkpoint also holds the engine's own state (fusetrain_state.json: its dropout stream and fp16 loss scale).
    assert ours_files[1] == sorted(theirs_files[1] + ["fusetrain_state.json"])
    assert ours_files[2] == theirs_files[2]  # the metric keys of every log entry
    assert "adapter_model.safetensors" in outputs["fusetrain"][0]
    logs = outputs["fusetrain"][3]
    assert {"loss", "entropy", "mean_token_accuracy", "num_tokens", "grad_norm", "learning_rate"} <= set(logs[0])
    losses = [(a["loss"], b["loss"]) for a, b in zip(outputs["fusetrain"][3], outputs["trl"][3]) if "loss" in a]
    assert losses and all(np.isfinite(a) for a, _ in losses)


# ---------------------------------------------------------------- the command line

def test_command_line_sft_trains_from_json_lines(tmp_path):
    """`python -m fusetrain train --task sft` (the pip-installed `fusetrain` is the same entry point): a chat model's
    directory and JSON Lines conversations, packed, with LoRA; TRL's files come out. Bad input is one error."""
    import json
    import os
    import subprocess
    import sys

    model, data = chat_model_dir(tmp_path), chat_data_dir(tmp_path)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "hf_datasets"),
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = tmp_path / "out"
    command = [sys.executable, "-m", "fusetrain", "train", "--task", "sft", "--model", str(model), "--train-file",
               str(data / "train.jsonl"), "--output-dir", str(out), "--packing", "--max-seq-length", "256",
               "--max-steps", "3", "--logging-steps", "1", "--per-device-train-batch-size", "2", "--lora-r", "8"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["global_step"] == 3 and np.isfinite(summary["train_loss"])
    assert {"adapter_config.json", "adapter_model.safetensors", "chat_template.jinja"} <= {p.name for p in out.iterdir()}
    assert "runs with transformers' own loop" not in result.stderr

    (tmp_path / "bad.jsonl").write_text(json.dumps({"question": "no text field"}) + "\n")
    for args, message in (
            (["--train-file", str(tmp_path / "bad.jsonl")], 'each line needs "messages"'),
            (["--train-file", str(data / "train.jsonl"), "--lora-r", "-1"], "--lora-r must be 0"),
            (["--train-file", str(tmp_path / "data.tsv")], "reads JSON Lines")):
        bad = [sys.executable, "-m", "fusetrain", "train", "--task", "sft", "--model", str(model), *args]
        result = subprocess.run(bad, capture_output=True, text=True, env=env, timeout=600)
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr[-2000:])
        assert "Traceback" not in result.stderr


def test_evaluation_reports_trls_metrics(model_dir, tmp_path):
    """evaluate() on the engine: the loss and TRL's token metrics of the evaluation set, as TRL's own reports them
    (the same model, no training; tolerances as for the training losses)."""
    results = {}
    for name, trainer_class, config_class in (("trl", trl.SFTTrainer, trl.SFTConfig),
                                              ("ours", ft_trl.SFTTrainer, ft_trl.SFTConfig)):
        args = config_class(output_dir=str(tmp_path / name), per_device_eval_batch_size=4, report_to="none",
                            use_cpu=True, bf16=False, max_length=512, seed=0)
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        trainer = trainer_class(model=model, args=args, train_dataset=text_dataset(8), eval_dataset=text_dataset(12, 3),
                                processing_class=tokenizer)
        results[name] = trainer.evaluate()
        if name == "ours":
            assert trainer._engine_model is not None  # the forward ran on the engine
    ours, theirs = results["ours"], results["trl"]
    keys = {"eval_loss", "eval_entropy", "eval_mean_token_accuracy", "eval_num_tokens"}
    assert keys <= set(ours) and set(ours) == set(theirs), (ours, theirs)
    for key in ("eval_loss", "eval_entropy"):
        assert abs(ours[key] - theirs[key]) <= 1e-4 * abs(theirs[key]), (key, ours[key], theirs[key])
    assert abs(ours["eval_mean_token_accuracy"] - theirs["eval_mean_token_accuracy"]) <= 1e-6
    assert ours["eval_num_tokens"] == theirs["eval_num_tokens"]
