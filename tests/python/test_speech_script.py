"""examples/run_speech_recognition_seq2seq.py (transformers' run_speech_recognition_seq2seq.py form) as users run
it: once as written, with `from fusetrain import Seq2SeqTrainer, Seq2SeqTrainingArguments` after its transformers
import, and once without that line, on transformers' Seq2SeqTrainer, for a small Whisper built from a config, its
feature extractor making log-mel features of generated clips (a tone per word) and a word-level tokenizer built with
`tokenizers`. Both runs write the same files and the same metric keys; the losses agree within 1e-3 relative (the
logged figures' rounding and six steps of f32 summation-order differences, as test_translation_script.py) and the
word error rates and generation lengths are equal, the generations coming from weights that agree to ~1e-4.
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
pytest.importorskip("datasets")

from cli_support import env_finding_fusetrain, without_import_line  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "run_speech_recognition_seq2seq.py"
IMPORT_LINE = "from fusetrain import Seq2SeqTrainer, Seq2SeqTrainingArguments\n"
WORDS = [f"w{i}" for i in range(12)]
RATE = 1600  # samples a second: 3 s clips are 4800 samples, 24 frames of 200


def model_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    directory = tmp_path / "whisper"
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, "<s>": 3, **{w: i + 4 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 3), ("</s>", 1)])
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                                     bos_token="<s>", unk_token="<unk>")
    tokenizer.save_pretrained(directory)
    transformers.WhisperFeatureExtractor(feature_size=8, sampling_rate=RATE, hop_length=200, chunk_length=3,
                                         n_fft=400).save_pretrained(directory)
    config = transformers.WhisperConfig(
        vocab_size=len(vocab), num_mel_bins=8, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, d_model=32, encoder_ffn_dim=48, decoder_ffn_dim=48, max_source_positions=12,
        max_target_positions=16, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0,
        bos_token_id=3, eos_token_id=1, decoder_start_token_id=3, suppress_tokens=[], begin_suppress_tokens=[])
    torch.manual_seed(0)
    model = transformers.WhisperForConditionalGeneration(config)
    model.generation_config.forced_decoder_ids = None
    model.save_pretrained(directory)
    return directory


def clips(path: pathlib.Path, count: int, seed: int) -> pathlib.Path:
    """Clips of 2 to 5 words, each word a 0.5 s tone of its own pitch, with noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(RATE // 2) / RATE
    with open(path, "w") as f:
        for _ in range(count):
            words = rng.choice(len(WORDS), size=int(rng.integers(2, 6)))
            wave = np.concatenate([np.sin(2 * np.pi * (60 + 40 * w) * t) for w in words])
            wave = 0.5 * wave + 0.05 * rng.standard_normal(wave.shape)
            f.write(json.dumps({"audio": {"array": np.round(wave, 4).tolist(), "sampling_rate": RATE},
                                "text": " ".join(WORDS[w] for w in words)}) + "\n")
    return path


def run(script: pathlib.Path, model: pathlib.Path, data: dict, output: pathlib.Path) -> subprocess.CompletedProcess:
    args = [sys.executable, str(script), "--model_name_or_path", str(model), "--train_file", str(data["train"]),
            "--validation_file", str(data["dev"]), "--output_dir", str(output), "--do_train", "--do_eval",
            "--predict_with_generate", "--generation_max_length", "8", "--per_device_train_batch_size", "8",
            "--per_device_eval_batch_size", "8", "--max_steps", "6", "--learning_rate", "3e-3", "--logging_steps",
            "2", "--save_strategy", "no", "--report_to", "none", "--use_cpu", "--seed", "42",
            "--dataloader_num_workers", "0", "--remove_unused_columns", "False",
            # the examples in order: fusetrain's shuffle draws from its own generator, not torch's RandomSampler
            "--train_sampling_strategy", "sequential"]
    return subprocess.run(args, capture_output=True, text=True, env=env_finding_fusetrain(), timeout=900)


def without_fusetrain(tmp_path: pathlib.Path) -> pathlib.Path:
    """The script without its fusetrain import line: transformers' Seq2SeqTrainer trains it."""
    return without_import_line(SCRIPT, IMPORT_LINE, tmp_path)


def test_the_speech_script_runs_on_fusetrain_as_on_transformers(tmp_path):
    model = model_dir(tmp_path)
    data = {"train": clips(tmp_path / "train.jsonl", 48, seed=1), "dev": clips(tmp_path / "dev.jsonl", 8, seed=2)}
    theirs = run(without_fusetrain(tmp_path), model, data, tmp_path / "theirs")
    assert theirs.returncode == 0, theirs.stderr[-3000:]
    ours = run(SCRIPT, model, data, tmp_path / "ours")
    assert ours.returncode == 0, ours.stderr[-3000:]
    assert "transformers' own loop" not in ours.stderr  # the engine trained it
    listing = lambda d: sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())  # noqa: E731
    assert listing(tmp_path / "ours") == listing(tmp_path / "theirs")
    ours_results = json.loads((tmp_path / "ours" / "all_results.json").read_text())
    theirs_results = json.loads((tmp_path / "theirs" / "all_results.json").read_text())
    assert ours_results.keys() == theirs_results.keys() and "eval_wer" in ours_results
    for key in ("train_loss", "eval_loss"):
        np.testing.assert_allclose(ours_results[key], theirs_results[key], rtol=1e-3, err_msg=key)
    assert ours_results["eval_wer"] == pytest.approx(theirs_results["eval_wer"], abs=1e-6), (ours_results,
                                                                                               theirs_results)
