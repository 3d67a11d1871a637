"""examples/run_translation.py (transformers' run_translation.py form) as users run it: once as written, with
`from fusetrain import Seq2SeqTrainer, Seq2SeqTrainingArguments` after its transformers import, and once without that
line, on transformers' Seq2SeqTrainer, for a small T5 and a small Marian built from configs with a word-level tokenizer
built with `tokenizers`. Both runs write the same files and the same metric keys; the losses agree within 1e-3
relative (the logged figures' rounding and six steps of f32 summation-order differences, see test_seq2seq.py) and
BLEU and generation lengths match, the generations coming from weights that agree to ~1e-4.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("onnxscript")
pytest.importorskip("sacrebleu")

from cli_support import env_finding_fusetrain, without_import_line  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "run_translation.py"
IMPORT_LINE = "from fusetrain import Seq2SeqTrainer, Seq2SeqTrainingArguments\n"
WORDS = [f"w{i}" for i in range(4, 60)]


def tokenizer_of(directory: pathlib.Path, model: str = "WordLevel"):
    """A word-level tokenizer (<pad> 0, </s> 1, <unk> 2, then the words) that ends every sequence with </s>; its model
    `tokenizers.models.WordLevel`, or `WordPiece` (the same ids for whole words), which the engine's tokenizer reads."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(getattr(models, model)(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                                     unk_token="<unk>")
    tokenizer.save_pretrained(directory)
    return tokenizer


def model_dir(tmp_path: pathlib.Path, arch: str) -> pathlib.Path:
    directory = tmp_path / arch
    tokenizer = tokenizer_of(directory)
    vocab = len(tokenizer)
    torch.manual_seed(0)
    if arch == "t5":
        config = transformers.T5Config(vocab_size=vocab, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                                       relative_attention_num_buckets=8, relative_attention_max_distance=16,
                                       dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
        model = transformers.T5ForConditionalGeneration(config)
    else:
        config = transformers.MarianConfig(vocab_size=vocab, d_model=32, encoder_layers=2, decoder_layers=2,
                                           encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48,
                                           decoder_ffn_dim=48, max_position_embeddings=64, dropout=0.0,
                                           attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0,
                                           eos_token_id=1, decoder_start_token_id=0, forced_eos_token_id=1)
        model = transformers.MarianMTModel(config)
    model.save_pretrained(directory)
    return directory


def pairs(path: pathlib.Path, count: int, seed: int) -> pathlib.Path:
    """"Translations" a model can learn: each source word shifted by one in the word list, the order reversed."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(count):
            words = rng.choice(len(WORDS) - 1, size=int(rng.integers(3, 8)))
            source = " ".join(WORDS[i] for i in words)
            target = " ".join(WORDS[i + 1] for i in words[::-1])
            f.write(json.dumps({"translation": {"en": source, "xx": target}}) + "\n")
    return path


def run(script: pathlib.Path, model: pathlib.Path, data: dict, output: pathlib.Path) -> subprocess.CompletedProcess:
    args = [sys.executable, str(script), "--model_name_or_path", str(model), "--train_file", str(data["train"]),
            "--validation_file", str(data["dev"]), "--source_lang", "en", "--target_lang", "xx",
            "--output_dir", str(output), "--do_train", "--do_eval", "--predict_with_generate",
            "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "8", "--max_steps", "6",
            "--learning_rate", "3e-3", "--logging_steps", "2", "--save_strategy", "no", "--report_to", "none",
            "--use_cpu", "--seed", "42", "--val_max_target_length", "10", "--dataloader_num_workers", "0",
            # the examples in order: fusetrain's shuffle draws from its own generator, not torch's RandomSampler
            "--train_sampling_strategy", "sequential"]
    return subprocess.run(args, capture_output=True, text=True, env=env_finding_fusetrain(), timeout=900)


def without_fusetrain(tmp_path: pathlib.Path) -> pathlib.Path:
    """The script without its fusetrain import line: transformers' Seq2SeqTrainer trains it."""
    return without_import_line(SCRIPT, IMPORT_LINE, tmp_path)


@pytest.mark.parametrize("arch", ["t5", "marian"])
def test_the_translation_script_runs_on_fusetrain_as_on_transformers(arch, tmp_path):
    model = model_dir(tmp_path, arch)
    data = {"train": pairs(tmp_path / "train.jsonl", 48, seed=1), "dev": pairs(tmp_path / "dev.jsonl", 12, seed=2)}
    theirs = run(without_fusetrain(tmp_path), model, data, tmp_path / "theirs")
    assert theirs.returncode == 0, theirs.stderr[-3000:]
    ours = run(SCRIPT, model, data, tmp_path / "ours")
    assert ours.returncode == 0, ours.stderr[-3000:]
    assert "transformers' own loop" not in ours.stderr  # the engine trained it
    listing = lambda d: sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())  # noqa: E731
    assert listing(tmp_path / "ours") == listing(tmp_path / "theirs")
    ours_results = json.loads((tmp_path / "ours" / "all_results.json").read_text())
    theirs_results = json.loads((tmp_path / "theirs" / "all_results.json").read_text())
    assert ours_results.keys() == theirs_results.keys() and "eval_bleu" in ours_results
    for key in ("train_loss", "eval_loss"):
        np.testing.assert_allclose(ours_results[key], theirs_results[key], rtol=1e-3, err_msg=key)
    for key in ("eval_bleu", "eval_gen_len"):
        assert ours_results[key] == pytest.approx(theirs_results[key], abs=1e-6), (key, ours_results, theirs_results)


def test_the_command_line_trains_a_seq2seq_model_from_json_lines(tmp_path):
    """`fusetrain train --task seq2seq` on JSON Lines of source and target text (a small T5, captured): the logged
    losses and the evaluation loss are transformers' Seq2SeqTrainer's on the same examples in order
    (DataCollatorForSeq2Seq: labels padded with -100, the decoder inputs the labels shifted right after
    decoder_start_token_id), within 1e-3 relative (the logged figures' rounding and f32 summation order), and the
    output directory loads in transformers with the trained weights. The tokenizer is WordPiece over whole words (the
    same ids as tokenizer_of's) with the end-of-sequence template, which the engine's tokenizer reads."""
    from safetensors.numpy import load_file

    model = model_dir(tmp_path, "t5")
    tokenizer = tokenizer_of(model, "WordPiece")

    def rows(path: pathlib.Path, count: int, seed: int) -> pathlib.Path:
        lines = [json.loads(line)["translation"] for line in pairs(path, count, seed).read_text().splitlines()]
        path.write_text("".join(json.dumps({"source": r["en"], "target": r["xx"]}) + "\n" for r in lines))
        return path

    train, dev = rows(tmp_path / "train.jsonl", 48, seed=1), rows(tmp_path / "dev.jsonl", 12, seed=2)
    env = {**env_finding_fusetrain(), "FUSETRAIN_CACHE": str(tmp_path / "cache")}
    ours = subprocess.run(
        [sys.executable, "-m", "fusetrain", "train", "--model", str(model), "--task", "seq2seq", "--train-file",
         str(train), "--eval-file", str(dev), "--max-steps", "6", "--per-device-train-batch-size", "8",
         "--per-device-eval-batch-size", "8", "--learning-rate", "3e-3", "--logging-steps", "2",
         "--train-sampling-strategy", "sequential", "--eval-strategy", "steps", "--eval-steps", "6",
         "--output-dir", str(tmp_path / "ours"), "--disable-tqdm"], capture_output=True, text=True, env=env,
        timeout=900)
    assert ours.returncode == 0, ours.stderr[-3000:]
    log = [json.loads(line) for line in (tmp_path / "ours" / "log.jsonl").read_text().splitlines()]
    losses = [entry["loss"] for entry in log if "loss" in entry]
    eval_loss = [entry["eval_loss"] for entry in log if "eval_loss" in entry]

    import datasets

    def tokenized(path: pathlib.Path):
        data = datasets.load_dataset("json", data_files=str(path), split="train")
        return data.map(lambda b: tokenizer(b["source"], text_target=b["target"], truncation=True, max_length=128),
                        batched=True, remove_columns=["source", "target"])

    theirs_model = transformers.T5ForConditionalGeneration.from_pretrained(model)
    args = transformers.Seq2SeqTrainingArguments(
        output_dir=str(tmp_path / "theirs"), per_device_train_batch_size=8, per_device_eval_batch_size=8,
        learning_rate=3e-3, max_steps=6, logging_steps=2, train_sampling_strategy="sequential", eval_strategy="steps",
        eval_steps=6, save_strategy="no", report_to=[], use_cpu=True, seed=42)
    trainer = transformers.Seq2SeqTrainer(
        model=theirs_model, args=args, train_dataset=tokenized(train), eval_dataset=tokenized(dev),
        data_collator=transformers.DataCollatorForSeq2Seq(tokenizer, model=theirs_model))
    trainer.train()
    history = trainer.state.log_history
    np.testing.assert_allclose(losses, [e["loss"] for e in history if "loss" in e], rtol=1e-3)
    # the evaluation at step 6 and the one after training, of the same weights
    np.testing.assert_allclose(eval_loss, [e["eval_loss"] for e in history if "eval_loss" in e] * 2, rtol=1e-3)
    trained = load_file(tmp_path / "ours" / "model.safetensors")
    loaded = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "ours")
    for name, value in trained.items():
        np.testing.assert_array_equal(loaded.state_dict()[name].numpy(), value, err_msg=name)
    for name, p in theirs_model.named_parameters():
        if name in trained:
            assert np.linalg.norm(trained[name] - p.detach().numpy()) <= 1e-3 * np.linalg.norm(p.detach().numpy()), name
