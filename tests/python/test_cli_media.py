"""The command line's image and audio tasks: `fusetrain train --task image-cls | audio-cls | ctc` on an image folder,
an audio folder and a table of clips with transcriptions (metadata.jsonl), against transformers' Trainer trained on
the same examples, preprocessed by the model directory's own image processor or feature extractor (as transformers'
run_image_classification.py, run_audio_classification.py and run_speech_recognition_ctc.py preprocess them: per
example, then padded per batch).

Each step is one batch of the whole training set, so the samplers' orders cannot make the steps differ. Tolerances:
logged losses within 1e-3 relative (transformers logs 4 significant digits), weights after three AdamW steps within
1e-3 norm-wise (test_capture.assert_trained_alike says why); evaluation accuracy equal.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("onnxscript")
Image = pytest.importorskip("PIL.Image")
soundfile = pytest.importorskip("soundfile")

from cli_support import error_line, run  # noqa: E402
from test_audio import wav2vec2  # noqa: E402
from test_image_classification_script import image_folder  # noqa: E402  (one subfolder per class, 40x40 PNGs)
from test_capture import assert_trained_alike, cli  # noqa: E402

T = transformers
CLASSES = ("blue", "green", "red")  # sorted: the class ids datasets' imagefolder and the command line give
RATE = 16000
STEPS = 3
COMMON = ["--learning-rate", "3e-3", "--max-steps", str(STEPS), "--logging-steps", "1", "--lr-scheduler-type",
          "constant", "--weight-decay", "0.01", "--seed", "0", "--save-strategy", "no"]


def vit_dir(path: pathlib.Path, labels: tuple[str, ...] | None = CLASSES) -> pathlib.Path:
    """A small ViT (odd sizes: 3 heads of 8) with the ViT image processor at 32x32; `labels` named in config.json."""
    torch.manual_seed(0)
    named = {} if labels is None else {"num_labels": len(labels), "id2label": dict(enumerate(labels)),
                                       "label2id": {n: k for k, n in enumerate(labels)}}
    config = T.ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=24, num_hidden_layers=2,
                         num_attention_heads=3, intermediate_size=40, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0, **named)
    T.ViTForImageClassification(config).save_pretrained(path)
    T.ViTImageProcessor(size={"height": 32, "width": 32}, image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(path)
    return path


def folder_examples(root: pathlib.Path, read) -> list[tuple[pathlib.Path, int]]:
    return [(f, k) for k, name in enumerate(CLASSES) for f in sorted((root / name).iterdir()) if read(f)]


def accuracy(p):
    return {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())}


def reference_run(model, data, eval_data, collator, output: pathlib.Path, metrics=accuracy):
    """transformers' Trainer with the command line's arguments, one whole-set batch per step."""
    args = T.TrainingArguments(output_dir=str(output), per_device_train_batch_size=len(data),
                               per_device_eval_batch_size=len(eval_data) if eval_data else 8, learning_rate=3e-3,
                               max_steps=STEPS, logging_steps=1, lr_scheduler_type="constant", weight_decay=0.01,
                               seed=0, report_to=[], save_strategy="no", use_cpu=True)
    trainer = T.Trainer(model=model, args=args, train_dataset=data, data_collator=collator,
                        compute_metrics=metrics)
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return losses, trainer.evaluate(eval_data) if eval_data else {}


def logged(output: pathlib.Path) -> tuple[list[float], dict]:
    entries = [json.loads(line) for line in (output / "log.jsonl").read_text().splitlines()]
    return [e["loss"] for e in entries if "loss" in e], next((e for e in entries if "eval_loss" in e), {})


def test_cli_trains_an_image_classifier_from_a_folder_as_transformers_does(tmp_path):
    model_dir = vit_dir(tmp_path / "vit")
    train, dev = image_folder(tmp_path / "train", 3, seed=1), image_folder(tmp_path / "dev", 2, seed=2)
    out = tmp_path / "out"
    run = cli("train", "--model", str(model_dir), "--task", "image-cls", "--train-file", str(train), "--eval-file",
              str(dev), "--output-dir", str(out), "--per-device-train-batch-size", "9",
              "--per-device-eval-batch-size", "6", *COMMON, cache=tmp_path / "cache")
    assert run.returncode == 0, run.stderr
    ours, ours_eval = logged(out)

    processor = T.AutoImageProcessor.from_pretrained(model_dir, backend="pil")

    def examples(root):
        return [{"pixel_values": processor(images=Image.open(f).convert("RGB"), return_tensors="np")["pixel_values"][0],
                 "labels": k} for f, k in folder_examples(root, lambda f: True)]

    fresh = lambda: T.ViTForImageClassification.from_pretrained(model_dir)  # noqa: E731
    theirs_model = fresh()
    theirs, theirs_eval = reference_run(theirs_model, examples(train), examples(dev), T.default_data_collator,
                                        tmp_path / "theirs")
    assert len(ours) == len(theirs) == STEPS
    np.testing.assert_allclose(ours, theirs, rtol=1e-3)
    np.testing.assert_allclose(ours_eval["eval_loss"], theirs_eval["eval_loss"], rtol=1e-3)
    assert ours_eval["eval_accuracy"] == theirs_eval["eval_accuracy"]
    # The saved directory is a transformers model directory with the trained weights and the processor.
    assert (out / "preprocessor_config.json").is_file()
    feed = T.default_data_collator(examples(train))
    assert_trained_alike(T.ViTForImageClassification.from_pretrained(out), theirs_model, fresh, feed)


def test_cli_remakes_the_head_for_the_folders_classes_then_evaluates_and_predicts(tmp_path):
    """A model whose config.json names two generic classes trains on a folder of three: the head is made for the
    folder's classes (sorted names, as run_image_classification passes num_labels, id2label and label2id), saved
    with them, and the saved model evaluates and predicts from the command line."""
    model_dir = vit_dir(tmp_path / "vit", labels=None)
    train, dev = image_folder(tmp_path / "train", 2, seed=1), image_folder(tmp_path / "dev", 1, seed=2)
    out, cache = tmp_path / "out", tmp_path / "cache"
    run = cli("train", "--model", str(model_dir), "--task", "image-cls", "--train-file", str(train),
              "--output-dir", str(out), "--per-device-train-batch-size", "6", *COMMON, cache=cache)
    assert run.returncode == 0, run.stderr
    saved = T.ViTForImageClassification.from_pretrained(out)
    assert saved.config.id2label == dict(enumerate(CLASSES)) and saved.classifier.out_features == 3
    evaluated = cli("evaluate", "--model", str(out), "--task", "image-cls", "--eval-file", str(dev), cache=cache)
    assert evaluated.returncode == 0, evaluated.stderr
    metrics = json.loads(evaluated.stdout[evaluated.stdout.index("{"):])
    # Against transformers' model on the same pixels: the evaluation is the saved model's.
    processor = T.AutoImageProcessor.from_pretrained(out, backend="pil")
    files = folder_examples(dev, lambda f: True)
    pixels = torch.from_numpy(processor(images=[Image.open(f).convert("RGB") for f, _ in files],
                                        return_tensors="np")["pixel_values"])
    with torch.no_grad():
        logits = saved.eval()(pixel_values=pixels).logits
    labels = torch.tensor([k for _, k in files])
    np.testing.assert_allclose(metrics["eval_loss"], torch.nn.functional.cross_entropy(logits, labels).item(),
                               rtol=1e-4)
    predicted = cli("predict", "--model", str(out), "--task", "image-cls", "--test-file", str(dev), "--output",
                    str(tmp_path / "pred.tsv"), cache=cache)
    assert predicted.returncode == 0, predicted.stderr
    rows = (tmp_path / "pred.tsv").read_text().splitlines()
    assert rows[0] == "index\tprediction" and [int(r.split("\t")[1]) for r in rows[1:]] == logits.argmax(-1).tolist()


def speech_dir(path: pathlib.Path, head: str, **overrides) -> pathlib.Path:
    """test_audio's small Wav2Vec2 with a feature extractor (16 kHz, per-clip normalisation) and, for CTC, a
    character tokenizer of its 13 classes (0 the blank, "|" between words)."""
    model = wav2vec2(head, **overrides)
    if head != "ctc":
        model.config.id2label, model.config.label2id = dict(enumerate(CLASSES)), {n: k for k, n in enumerate(CLASSES)}
    model.save_pretrained(path)
    T.Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=RATE, padding_value=0.0, do_normalize=True,
                               return_attention_mask=False).save_pretrained(path)
    if head == "ctc":
        vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "|": 4, **{c: 5 + k for k, c in enumerate("abcdefgh")}}
        (path / "vocab.json").write_text(json.dumps(vocab))
        T.Wav2Vec2CTCTokenizer(str(path / "vocab.json"), pad_token="<pad>", unk_token="<unk>",
                               word_delimiter_token="|").save_pretrained(path)
    return path


TEXTS = ("abc", "bad cafe", "face", "head bag", "dab", "egg")


def clips(root: pathlib.Path, head: str, count: int, seed: int) -> pathlib.Path:
    """WAV clips of 900 to 1400 samples (float, so nothing is lost to quantisation): for audio-cls in one
    subfolder per class, for ctc beside a metadata.jsonl naming each file and its transcription."""
    rng = np.random.default_rng(seed)
    rows = []
    for k in range(count):
        wave = (0.3 * rng.standard_normal(int(rng.integers(900, 1400)))).astype(np.float32)
        folder = root / (CLASSES[k % 3] if head != "ctc" else "")
        folder.mkdir(parents=True, exist_ok=True)
        soundfile.write(folder / f"{k}.wav", wave, RATE, subtype="FLOAT")
        rows.append({"file_name": f"{k}.wav", "text": TEXTS[k % len(TEXTS)]})
    if head == "ctc":
        (root / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def transcription_rates(tokenizer):
    """run_speech_recognition_ctc.py's compute_metrics: greedy ids decoded by the tokenizer (grouped), references
    with -100 as padding decoded ungrouped, WER and CER by jiwer."""
    jiwer = pytest.importorskip("jiwer")

    def compute(p):
        labels = p.label_ids.copy()
        labels[labels == -100] = tokenizer.pad_token_id
        predicted = tokenizer.batch_decode(np.argmax(p.predictions, axis=-1))
        reference = tokenizer.batch_decode(labels, group_tokens=False)
        return {"wer": jiwer.wer(reference=reference, hypothesis=predicted),
                "cer": jiwer.cer(reference=reference, hypothesis=predicted)}
    return compute


def padded_collator(head: str):
    """Pads input_values with 0 to the batch's longest clip and CTC labels with -100 (DataCollatorCTCWithPadding)."""
    def collate(examples):
        longest = max(e["input_values"].size for e in examples)
        values = np.zeros((len(examples), longest), np.float32)
        for row, e in enumerate(examples):
            values[row, :e["input_values"].size] = e["input_values"]
        if head != "ctc":
            return {"input_values": torch.from_numpy(values), "labels": torch.tensor([e["labels"] for e in examples])}
        width = max(len(e["labels"]) for e in examples)
        labels = np.full((len(examples), width), -100, np.int64)
        for row, e in enumerate(examples):
            labels[row, :len(e["labels"])] = e["labels"]
        return {"input_values": torch.from_numpy(values), "labels": torch.from_numpy(labels)}
    return collate


# CI runs the ctc case (the audio path and the transcription metrics); FUSETRAIN_RUN_SLOW=1 audio-cls too.
@pytest.mark.parametrize("head", [pytest.param("audio-cls", marks=pytest.mark.slow), "ctc"])
def test_cli_trains_a_speech_model_from_audio_files_as_transformers_does(head, tmp_path):
    model_dir = speech_dir(tmp_path / "w2v", head)
    train, dev = clips(tmp_path / "train", head, 6, seed=1), clips(tmp_path / "dev", head, 3, seed=2)
    out = tmp_path / "out"
    run = cli("train", "--model", str(model_dir), "--task", head, "--train-file", str(train), "--eval-file", str(dev),
              "--output-dir", str(out), "--per-device-train-batch-size", "6", "--per-device-eval-batch-size", "3",
              *COMMON, cache=tmp_path / "cache")
    assert run.returncode == 0, run.stderr
    ours, ours_eval = logged(out)

    extractor = T.AutoFeatureExtractor.from_pretrained(model_dir)
    tokenizer = T.AutoTokenizer.from_pretrained(model_dir) if head == "ctc" else None

    def examples(root):
        if head == "ctc":
            rows = [json.loads(line) for line in (root / "metadata.jsonl").read_text().splitlines()]
            files = [(root / r["file_name"], tokenizer(r["text"]).input_ids) for r in rows]
        else:
            files = folder_examples(root, lambda f: f.suffix == ".wav")
        return [{"input_values": extractor(soundfile.read(f, dtype="float32")[0], sampling_rate=RATE,
                                           return_tensors="np")["input_values"][0], "labels": label}
                for f, label in files]

    cls = T.Wav2Vec2ForCTC if head == "ctc" else T.Wav2Vec2ForSequenceClassification
    fresh = lambda: cls.from_pretrained(model_dir)  # noqa: E731
    theirs_model = fresh()
    theirs, theirs_eval = reference_run(theirs_model, examples(train), examples(dev), padded_collator(head),
                                        tmp_path / "theirs",
                                        metrics=transcription_rates(tokenizer) if head == "ctc" else accuracy)
    assert len(ours) == len(theirs) == STEPS
    np.testing.assert_allclose(ours, theirs, rtol=1e-3)
    np.testing.assert_allclose(ours_eval["eval_loss"], theirs_eval["eval_loss"], rtol=1e-3)
    for metric in ("eval_wer", "eval_cer") if head == "ctc" else ("eval_accuracy",):
        assert ours_eval[metric] == pytest.approx(theirs_eval[metric], abs=1e-12), metric
    assert (out / "preprocessor_config.json").is_file()
    assert_trained_alike(cls.from_pretrained(out), theirs_model, fresh, padded_collator(head)(examples(train)))


def test_cli_draws_spec_augment_for_ctc(tmp_path):
    """With mask_time_prob and mask_feature_prob set, the command line's CTC training steps read masks it draws (the
    engine's generator, transformers' span rule): the first step's loss (before any update, dropout off) is not the
    unmasked loss `evaluate` gives on the same clips in one batch, and a second run repeats the first bit for bit
    (the draws are a function of the seed and the batch: tests/data/test_features.cpp)."""
    train = clips(tmp_path / "train", "ctc", 6, seed=1)
    masked = speech_dir(tmp_path / "masked", "ctc", mask_time_prob=0.4, mask_time_length=2, mask_feature_prob=0.3,
                        mask_feature_length=4)
    cache = tmp_path / "cache"
    losses = {}
    for name in ("first", "again"):
        run = cli("train", "--model", str(masked), "--task", "ctc", "--train-file", str(train), "--output-dir",
                  str(tmp_path / name), "--per-device-train-batch-size", "6", "--max-steps", "1", *COMMON[:2],
                  *COMMON[4:], cache=cache)
        assert run.returncode == 0, run.stderr
        losses[name] = logged(tmp_path / name)[0]
    evaluated = cli("evaluate", "--model", str(masked), "--task", "ctc", "--eval-file", str(train),
                    "--per-device-eval-batch-size", "6", cache=cache)
    assert evaluated.returncode == 0, evaluated.stderr
    unmasked = json.loads(evaluated.stdout[evaluated.stdout.index("{"):])["eval_loss"]
    assert abs(losses["first"][0] - unmasked) > 1e-3 * unmasked, (losses, unmasked)
    assert losses["first"] == losses["again"]


def test_cli_media_refusals_name_what_was_expected(tmp_path, capsys):
    from fusetrain import features

    vit = vit_dir(tmp_path / "vit")
    cache = tmp_path / "cache"
    images = image_folder(tmp_path / "train", 1, seed=1)

    def refused(*args):
        run = cli(*args, cache=cache)
        assert run.returncode != 0, run.stdout
        assert "Traceback" not in run.stderr, run.stderr
        return run.stderr

    def unreadable(task, model, *files):
        """fusetrain.features' refusal (what the command prints and exits 1 on), in this process."""
        names = ("--train-file", "--eval-file")
        argv = ["--task", task, "--model", str(model), *(a for k, f in zip(names, files) for a in (k, str(f)))]
        assert features.main(argv) == 1
        error = capsys.readouterr().err
        assert error.startswith("fusetrain: error: ") and len(error.splitlines()) == 1, error
        return error

    # Through the command: the child's error is the command's, without a traceback.
    no_processor = tmp_path / "bare"
    T.ViTForImageClassification(T.ViTConfig.from_pretrained(vit)).save_pretrained(no_processor)
    assert "preprocessor_config.json" in refused("train", "--model", str(no_processor), "--task", "image-cls",
                                                 "--train-file", str(images))
    flat = tmp_path / "flat"
    flat.mkdir()
    assert "one subfolder per class" in unreadable("image-cls", vit, flat)
    (tmp_path / "bad.png").write_bytes(b"not an image")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"image": "bad.png", "label": "red"}) + "\n")
    assert "Pillow cannot read" in unreadable("image-cls", vit, tmp_path / "bad.jsonl")
    (tmp_path / "missing.jsonl").write_text(json.dumps({"image": "nowhere.png", "label": "red"}) + "\n")
    assert "does not exist" in unreadable("image-cls", vit, tmp_path / "missing.jsonl")
    dev = image_folder(tmp_path / "dev", 1, seed=2)
    (dev / "purple").mkdir()
    Image.new("RGB", (8, 8)).save(dev / "purple" / "0.png")
    assert "'purple' is not one of" in unreadable("image-cls", vit, images, dev)
    audio = tmp_path / "audio"
    audio.mkdir()
    assert "metadata.jsonl" in unreadable("ctc", vit, audio)
    w2v = speech_dir(tmp_path / "w2v", "ctc")
    speech = clips(tmp_path / "speech", "ctc", 2, seed=3)
    assert "a CTC model's predictions are transcriptions" in refused("predict", "--model", str(w2v), "--task", "ctc",
                                                                     "--test-file", str(speech), "--output",
                                                                     str(tmp_path / "p.tsv"))
    # The engine's binary itself, which decodes nothing: the tasks name the command that does, and a table of text
    # is refused for ctc.
    assert "decodes and preprocesses" in error_line(run("train", "--model", str(vit), "--task", "image-cls",
                                                        "--train-file", str(images)))
    (tmp_path / "text.tsv").write_text("text\tlabel\nabc\t0\n")
    assert "--task ctc reads audio" in error_line(run("train", "--model", str(vit), "--task", "ctc", "--train-file",
                                                      str(tmp_path / "text.tsv")))


def test_audio_at_another_rate_is_resampled_to_the_extractors(tmp_path):
    """A clip at 8 kHz becomes twice as many samples at the extractor's 16 kHz (SciPy's polyphase filter), as
    datasets' Audio(sampling_rate=16000) resamples it."""
    from safetensors import safe_open

    from fusetrain import features

    model_dir = speech_dir(tmp_path / "w2v", "audio-cls")
    (tmp_path / "data" / "blue").mkdir(parents=True)
    soundfile.write(tmp_path / "data" / "blue" / "0.wav", np.sin(np.arange(800) / 5).astype(np.float32), 8000,
                    subtype="FLOAT")
    path, _ = features.write("audio-cls", model_dir, tmp_path / "data", list(CLASSES), input_column=None,
                             label_column=None)
    with safe_open(str(path), "numpy") as f:
        assert f.get_tensor("feature_offsets").tolist() == [0, 1600]
        assert f.get_tensor("labels").tolist() == [0]
        meta = json.loads(f.metadata()["fusetrain.features"])
    assert meta["input"] == "input_values" and meta["shape"] == [-1] and meta["sampling_rate"] == RATE
