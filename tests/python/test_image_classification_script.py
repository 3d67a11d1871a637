"""examples/run_image_classification.py (transformers' run_image_classification.py form) as users run it: once as
written, with `from fusetrain import Trainer, TrainingArguments` after its transformers import, and once without that
line, on transformers' Trainer, for a small ConvNeXt and a small Swin built from configs, on a generated image folder
(datasets' imagefolder, torchvision's random crops and flips, or examples/image_transforms.py's where torchvision has
no build for the installed torch). Both runs write the same files and the same metric
keys; the losses agree within 1e-3 relative (the logged figures' rounding and six steps of f32 summation-order
differences, as test_capture.py's trainer tests) and the accuracies are equal: the examples come in order
(sequential sampling) and the random crops draw from torch's generator, seeded alike, in the same order in both runs.
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
Image = pytest.importorskip("PIL.Image")

from cli_support import env_finding_fusetrain, without_import_line  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "run_image_classification.py"
MAX_STEPS = "6"
IMPORT_LINE = "from fusetrain import Trainer, TrainingArguments\n"
CLASSES = ("red", "green", "blue")


def image_folder(root: pathlib.Path, per_class: int, seed: int) -> pathlib.Path:
    """40x40 PNGs, one folder per class, each image noise over its class's dominant colour channel."""
    rng = np.random.default_rng(seed)
    for channel, label in enumerate(CLASSES):
        (root / label).mkdir(parents=True)
        for k in range(per_class):
            pixels = rng.integers(0, 120, size=(40, 40, 3))
            pixels[..., channel] += 100
            Image.fromarray(pixels.astype(np.uint8)).save(root / label / f"{k}.png")
    return root


def model_dir(tmp_path: pathlib.Path, arch: str) -> pathlib.Path:
    directory = tmp_path / arch
    torch.manual_seed(0)
    if arch == "convnext":
        config = transformers.ConvNextConfig(num_channels=3, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1],
                                             image_size=32, num_labels=3, drop_path_rate=0.0)
        model = transformers.ConvNextForImageClassification(config)
    else:
        config = transformers.SwinConfig(image_size=32, patch_size=4, num_channels=3, embed_dim=12, depths=[2, 1],
                                         num_heads=[2, 3], window_size=4, drop_path_rate=0.0,
                                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)
        model = transformers.SwinForImageClassification(config)
    model.save_pretrained(directory)
    transformers.ViTImageProcessor(size={"height": 32, "width": 32}, image_mean=[0.5] * 3,
                                   image_std=[0.5] * 3).save_pretrained(directory)
    return directory


def run(script: pathlib.Path, model: pathlib.Path, data: dict, output: pathlib.Path) -> subprocess.CompletedProcess:
    args = [sys.executable, str(script), "--model_name_or_path", str(model), "--train_dir", str(data["train"]),
            "--validation_dir", str(data["validation"]), "--output_dir", str(output), "--do_train", "--do_eval",
            "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "8", "--max_steps", MAX_STEPS,
            "--learning_rate", "3e-3", "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none",
            "--use_cpu", "--seed", "42", "--dataloader_num_workers", "0", "--remove_unused_columns", "False",
            # the examples in order: fusetrain's shuffle draws from its own generator, not torch's RandomSampler
            "--train_sampling_strategy", "sequential"]
    env = env_finding_fusetrain()  # and examples/ (image_transforms.py) for the copy without the fusetrain line
    env["PYTHONPATH"] = str(SCRIPT.parent) + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=900)


def without_fusetrain(tmp_path: pathlib.Path) -> pathlib.Path:
    """The script without its fusetrain import line: transformers' Trainer trains it."""
    return without_import_line(SCRIPT, IMPORT_LINE, tmp_path)


# Swin's run is marked slow (~25 s): CI keeps ConvNeXt's; test_capture.py checks Swin's loss and gradients.
@pytest.mark.parametrize("arch", ["convnext", pytest.param("swin", marks=pytest.mark.slow)])
def test_the_image_classification_script_runs_on_fusetrain_as_on_transformers(arch, tmp_path):
    model = model_dir(tmp_path, arch)
    data = {"train": image_folder(tmp_path / "images" / "train", 16, seed=1),
            "validation": image_folder(tmp_path / "images" / "validation", 4, seed=2)}
    theirs = run(without_fusetrain(tmp_path), model, data, tmp_path / "theirs")
    assert theirs.returncode == 0, theirs.stderr[-3000:]
    ours = run(SCRIPT, model, data, tmp_path / "ours")
    assert ours.returncode == 0, ours.stderr[-3000:]
    assert "transformers' own loop" not in ours.stderr  # the engine trained it
    listing = lambda d: sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())  # noqa: E731
    assert listing(tmp_path / "ours") == listing(tmp_path / "theirs")
    ours_results = json.loads((tmp_path / "ours" / "all_results.json").read_text())
    theirs_results = json.loads((tmp_path / "theirs" / "all_results.json").read_text())
    assert ours_results.keys() == theirs_results.keys() and "eval_accuracy" in ours_results
    for key in ("train_loss", "eval_loss"):
        np.testing.assert_allclose(ours_results[key], theirs_results[key], rtol=1e-3, err_msg=key)
    assert ours_results["eval_accuracy"] == theirs_results["eval_accuracy"], (ours_results, theirs_results)
