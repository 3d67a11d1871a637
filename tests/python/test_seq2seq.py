"""Encoder-decoders (T5, BART, Marian) captured into the engine and trained by fusetrain.Seq2SeqTrainer
(fusetrain_require_engine=True), against transformers' Seq2SeqTrainer on the same weights and batches.

Tolerances: the loss of one step within 1e-5 relative and every gradient within 1e-4 norm-wise of PyTorch's
(hf_models.grad_errors); fusetrain and PyTorch sum the same f32 products in different orders (measured: ~1e-7
relative on the loss). Trainer losses within 1e-4 relative plus 1e-4 absolute: both trainers log each loss rounded to
4 decimals. Weights after three steps within 1e-3 norm-wise (test_capture.assert_trained_alike says why). Dropout is
off in every config (the engine's dropout masks are its own).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("onnxscript")  # the dynamo exporter

import fusetrain  # noqa: E402
import hf_models as hf  # noqa: E402
from fusetrain import capture  # noqa: E402
from test_capture import assert_bf16_like_autocast, assert_trained_alike  # noqa: E402

T = transformers
VOCAB = 101
# Odd sizes: 3 heads of 12, a decoder deeper than the encoder (T5), feed-forward widths not multiples of 16.
_BART_LIKE = dict(vocab_size=VOCAB, d_model=36, encoder_layers=2, decoder_layers=2, encoder_attention_heads=3,
                  decoder_attention_heads=3, encoder_ffn_dim=52, decoder_ffn_dim=52, max_position_embeddings=64,
                  dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
CONFIGS = {
    # relative position buckets, no scaling, a gated-free ReLU MLP, tied embeddings rescaled before the head
    "t5": lambda: T.T5Config(vocab_size=VOCAB, d_model=36, d_kv=12, d_ff=52, num_layers=2, num_decoder_layers=3,
                             num_heads=3, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                             dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1),
    # learned positions offset by 2, final_logits_bias (a buffer of the top-level model)
    "bart": lambda: T.BartConfig(**_BART_LIKE, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                                 decoder_start_token_id=2),
    # frozen sinusoidal positions, the decoder starting from the padding id (a row without gradient)
    "marian": lambda: T.MarianConfig(**_BART_LIKE, pad_token_id=VOCAB - 1, eos_token_id=0,
                                     decoder_start_token_id=VOCAB - 1),
}
CLASSES = {"t5": T.T5ForConditionalGeneration, "bart": T.BartForConditionalGeneration, "marian": T.MarianMTModel}


@pytest.fixture(autouse=True)
def capture_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("FUSETRAIN_CACHE", str(tmp_path_factory.getbasetemp() / "capture-cache"))


def model_of(arch: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    config = CONFIGS[arch]()
    config.update(overrides)
    model = CLASSES[arch](config)
    hf.perturb_(model, seed, scale=0.02)  # no two weights equal: a mix-up of names cannot pass
    return model.float()


def batch(model, seed: int = 0, rows: int = 4, source: int = 11, target: int = 7) -> dict[str, np.ndarray]:
    """Source rows (the first padded), target labels (the second ending in -100) and the decoder inputs the model
    makes of them."""
    rng = np.random.default_rng(seed)
    pad = model.config.pad_token_id
    ids = rng.integers(3, VOCAB - 1, size=(rows, source))
    mask = np.ones_like(ids)
    mask[0, source - 3:] = 0
    ids[0, source - 3:] = pad
    labels = rng.integers(3, VOCAB - 1, size=(rows, target))
    labels[1, target - 2:] = -100
    decoder = model.prepare_decoder_input_ids_from_labels(labels=torch.from_numpy(labels)).numpy()
    return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": decoder, "labels": labels}


def torch_loss_and_grads(model, data: dict[str, np.ndarray]) -> tuple[float, dict[str, np.ndarray]]:
    model.train()
    model.zero_grad()
    out = model(**{k: torch.from_numpy(v) for k, v in data.items()})
    out.loss.backward()
    return out.loss.item(), {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_captured_encoder_decoder_loss_and_every_gradient_match_pytorch(arch):
    model = model_of(arch)
    engine = capture.capture(model)
    assert [(row["name"], row["shape"]) for row in engine.inputs] == [
        ("input_ids", "int64 (batch, sequence)"), ("attention_mask", "int64 (batch, sequence)"),
        ("decoder_input_ids", "int64 (batch, target sequence)"),
        ("decoder_attention_mask", "int64 (batch, target sequence)")]
    data = batch(model)
    want_loss, _ = torch_loss_and_grads(model, data)
    engine.train()
    loss, grads = engine.loss_and_grads(**data)
    hf.assert_loss_matches(loss, want_loss, arch, rtol=1e-5)
    # Tied weights are one parameter under one of their names (the LM head and the shared embeddings).
    want = {name: model.get_parameter(name).grad.numpy() for name in grads}
    covered = {id(model.get_parameter(name)) for name in grads}
    assert covered == {id(p) for p in model.parameters() if p.requires_grad}, "a parameter the engine does not train"
    errors = hf.grad_errors(grads, want)
    assert not errors, f"{arch}: {len(errors)} gradient mismatches:\n  " + "\n  ".join(errors)


def test_a_decoder_attention_mask_and_other_lengths_match_pytorch():
    """decoder_attention_mask masks the decoder's own keys; a second batch of other source and target lengths runs
    on the same engine model (each length pair its own program)."""
    model = model_of("bart")
    engine = capture.capture(model)
    engine.train()
    for seed, (source, target) in enumerate([(11, 7), (6, 13)]):
        data = batch(model, seed=seed, source=source, target=target)
        data["decoder_attention_mask"] = np.ones_like(data["decoder_input_ids"])
        data["decoder_attention_mask"][2, target - 3:] = 0
        data["labels"][2, target - 3:] = -100
        want_loss, want = torch_loss_and_grads(model, data)
        loss, grads = engine.loss_and_grads(**data)
        hf.assert_loss_matches(loss, want_loss, f"bart {source}x{target}", rtol=1e-5)
        errors = hf.grad_errors(grads, {name: model.get_parameter(name).grad.numpy() for name in grads})
        assert not errors, "\n".join(errors)


def test_frozen_weights_and_buffers_take_the_models_values_not_the_caches():
    """A second model of the same config reads the cached graph, whose frozen weights (Marian's positions, here
    changed) and buffers (final_logits_bias) are the first model's: the engine uses the second model's values and
    keeps them fixed, as transformers' optimizer does."""
    capture.capture(model_of("marian", seed=0))
    model = model_of("marian", seed=1)
    with torch.no_grad():
        model.model.encoder.embed_positions.weight.mul_(0.5)
        model.final_logits_bias.normal_(0, 0.5)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {"model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight"}
    engine = capture.capture(model)
    assert not frozen & set(engine.trainable_names()) and "final_logits_bias" not in engine.trainable_names()
    data = batch(model, seed=3)
    want_loss, _ = torch_loss_and_grads(model, data)
    engine.train()
    loss, _ = engine.loss_and_grads(**data)
    hf.assert_loss_matches(loss, want_loss, "marian, second model", rtol=1e-5)


def test_seq2seq_batches_of_the_wrong_shape_are_one_clear_error():
    model = model_of("t5")
    engine = capture.capture(model)
    data = batch(model)
    engine.train()
    with pytest.raises(ValueError, match="needs decoder_input_ids, int64 \\(batch, target sequence\\)"):
        engine.loss_and_grads(**{k: v for k, v in data.items() if k != "decoder_input_ids"})
    with pytest.raises(ValueError, match="labels have shape \\(4, 6\\).*int64 \\(batch, target sequence\\) like "
                                         "decoder_input_ids: \\(4, 7\\)"):
        engine.loss_and_grads(**{**data, "labels": data["labels"][:, :6]})
    with pytest.raises(ValueError, match="decoder_attention_mask has shape \\(4, 5\\), expected \\(4, 7\\) like "
                                         "decoder_input_ids"):
        engine.loss_and_grads(**data, decoder_attention_mask=np.ones((4, 5), dtype=np.int64))


# ---- Seq2SeqTrainer ---------------------------------------------------------------------------------------------


def run_trainer(trainer_cls, args_cls, model, data, tmp_path, collator=None, tokenizer=None, **extra):
    settings = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, learning_rate=3e-3, max_steps=3,
                    logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0,
                    lr_scheduler_type="constant", weight_decay=0.01)
    args = args_cls(**{**settings, **extra})
    trainer = trainer_cls(model=model, args=args, train_dataset=data, eval_dataset=data, data_collator=collator,
                          processing_class=tokenizer)
    trainer.train()
    return trainer, [e["loss"] for e in trainer.state.log_history if "loss" in e]


def both_seq2seq_trainers(arch, data, tmp_path, collator_of=None, tokenizer=None, overrides=None, make=None, **extra):
    make = make or (lambda: model_of(arch, **(overrides or {})))
    ours_model, theirs_model = make(), make()
    ours, ours_losses = run_trainer(fusetrain.Seq2SeqTrainer, fusetrain.Seq2SeqTrainingArguments, ours_model, data,
                                    tmp_path / "ours", collator_of and collator_of(ours_model), tokenizer,
                                    fusetrain_require_engine=True, **extra)
    theirs, theirs_losses = run_trainer(T.Seq2SeqTrainer, T.Seq2SeqTrainingArguments, theirs_model, data,
                                        tmp_path / "theirs", collator_of and collator_of(theirs_model), tokenizer,
                                        **extra)
    assert len(ours_losses) == len(theirs_losses) == 3
    np.testing.assert_allclose(ours_losses, theirs_losses, rtol=1e-4, atol=1e-4)
    return ours, theirs


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_seq2seq_trainer_trains_as_transformers_does(arch, tmp_path):
    """Three AdamW steps of fusetrain.Seq2SeqTrainer on the engine against transformers' Seq2SeqTrainer, each with
    its default collator (the decoder inputs made from the labels by the model): the same losses, and the same
    weights after, written back into the user's model object."""
    rows = batch(model_of(arch), seed=1)
    del rows["decoder_input_ids"]
    rows["attention_mask"][0] = 1  # equal rows: transformers' default collator stacks them as they are
    data = [{k: v[i] for k, v in rows.items()} for i in range(4)]
    ours, theirs = both_seq2seq_trainers(arch, data, tmp_path)
    feed = {k: torch.from_numpy(v) for k, v in rows.items()}
    assert_trained_alike(ours.model, theirs.model, lambda: model_of(arch), feed)


def word_tokenizer(pad: str = "<pad>"):
    """A word-level tokenizer of the test vocabulary: "w3 w17 ..." is ids 3, 17, ...; id 0 is <pad>, 1 </s>."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return T.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=pad, eos_token="</s>",
                                     unk_token="<unk>")


def ragged_examples(seed: int, count: int = 8) -> list[dict]:
    """Examples of different source and target lengths, as a tokenized translation dataset holds them."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        source = rng.integers(3, VOCAB - 1, size=int(rng.integers(4, 12))).tolist()
        target = rng.integers(3, VOCAB - 1, size=int(rng.integers(3, 9))).tolist()
        out.append({"input_ids": source, "attention_mask": [1] * len(source), "labels": target})
    return out


def test_seq2seq_trainer_with_its_collator_pads_evaluates_and_generates(tmp_path):
    """DataCollatorForSeq2Seq (given the model: it makes decoder_input_ids) over examples of different lengths:
    the same training losses as transformers' Seq2SeqTrainer, the same eval_loss from the engine's forward, and
    with predict_with_generate the same metric keys, generating with the trained weights."""
    tokenizer = word_tokenizer()
    data = ragged_examples(seed=4, count=4)

    def collator(model):
        return T.DataCollatorForSeq2Seq(tokenizer, model=model)

    # as many decoder layers as encoder layers: transformers' generate cannot cache T5's others (an IndexError)
    ours, theirs = both_seq2seq_trainers("t5", data, tmp_path, collator, tokenizer, {"num_decoder_layers": 2})
    ours_eval, theirs_eval = ours.evaluate(), theirs.evaluate()
    assert ours_eval.keys() == theirs_eval.keys()
    np.testing.assert_allclose(ours_eval["eval_loss"], theirs_eval["eval_loss"], rtol=1e-3)
    ours.args.predict_with_generate = theirs.args.predict_with_generate = True
    ours_out = ours.predict(data, max_length=6)
    theirs_out = theirs.predict(data, max_length=6)
    assert ours_out.metrics.keys() == theirs_out.metrics.keys()
    assert ours_out.predictions.shape == theirs_out.predictions.shape  # padded as transformers pads them
    # the generation ran on the trained weights the model object holds
    with torch.no_grad():
        generated = ours.model.generate(input_ids=torch.tensor([data[0]["input_ids"]]), max_length=6)
    np.testing.assert_array_equal(ours_out.predictions[0, :generated.shape[1]], generated[0].numpy())


def test_seq2seq_trainer_saves_a_model_transformers_loads(tmp_path):
    model = model_of("bart")
    rows = batch(model, seed=2)
    data = [{k: v[i] for k, v in rows.items()} for i in range(4)]
    trainer = fusetrain.Seq2SeqTrainer(model=model, args=fusetrain.Seq2SeqTrainingArguments(
        output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, max_steps=2, learning_rate=1e-2,
        report_to=[], save_strategy="no", use_cpu=True, fusetrain_require_engine=True), train_dataset=data)
    trainer.train()
    trainer.save_model(str(tmp_path / "saved"))
    loaded = T.BartForConditionalGeneration.from_pretrained(tmp_path / "saved").eval()
    feed = {k: torch.from_numpy(rows[k]) for k in ("input_ids", "attention_mask", "decoder_input_ids")}
    with torch.no_grad():
        np.testing.assert_array_equal(loaded(**feed).logits.numpy(), model.eval()(**feed).logits.numpy())
    start = model_of("bart")
    assert not torch.equal(start.model.shared.weight, loaded.model.shared.weight)  # trained


def test_a_class_named_for_generation_that_is_no_encoder_decoder_falls_back_naming_why(tmp_path):
    class DecoderForConditionalGeneration(T.GPT2LMHeadModel):
        pass

    config = T.GPT2Config(n_embd=24, n_layer=1, n_head=2, vocab_size=VOCAB, n_positions=32)
    torch.manual_seed(0)
    model = DecoderForConditionalGeneration(config)
    data = [{"input_ids": np.arange(3, 9), "labels": np.arange(3, 9)}]
    with pytest.raises(ValueError, match="not an encoder-decoder of token sequences"):
        fusetrain.Seq2SeqTrainer(model=model, args=fusetrain.Seq2SeqTrainingArguments(
            output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=True, fusetrain_require_engine=True),
            train_dataset=data).train()


def test_t5_in_bf16_runs_every_product_in_bf16_as_autocast_does(tmp_path):
    """Under bf16 every product of T5's captured graph multiplies bf16 operands, as autocast's matmul does, and its
    ReLU reads the projection's result rounded to bf16, which backward keeps; its attention (the learned relative
    bias a differentiated score bias) runs in the fused kernel on bf16 q, k, v with no Transpose of k or of its
    gradient. `fusetrain inspect --profile-nodes` lists every planned node with its operands' dtypes."""
    from test_capture import cli

    graph = capture.captured_path(model_of("t5"), "seq2seq")
    shown = cli("inspect", "--model", str(graph), "--task", "seq2seq", "--max-seq-length", "16",
                "--max-target-length", "8", "--per-device-train-batch-size", "2", "--bf16", "--profile",
                "--profile-nodes", cache=tmp_path / "cache")
    assert shown.returncode == 0, shown.stderr
    assert "batch 2 x 16 (source) x 8 (target)" in shown.stdout
    nodes = [line.split(None, 2)[2] for line in shown.stdout.split("nodes (schedule order", 1)[1].splitlines()[1:]
             if line.strip()]
    products = [n for n in nodes if n.startswith("MatMul ")]
    assert products and all(n.split(" -> ")[0].count("bf16(") == 2 for n in products), products
    relus = [n for n in nodes if n.startswith(("Relu ", "ReluBackward "))]
    assert len(relus) == 2 * (2 + 3) and all("bf16(2, 16, 52)" in n or "bf16(2, 8, 52)" in n for n in relus), relus
    # no (B·H, S, D) -> (B·H, D, S) of k or of its gradient
    assert not [n for n in nodes if n.startswith("Transpose f32(6, ")], nodes
    attention = [n for n in nodes if n.startswith("Attention ")]
    assert len(attention) == 2 + 3 + 3 and all(n.count("bf16(") == 4 for n in attention), attention


def test_seq2seq_trainer_in_bf16_is_closer_to_autocast_than_f32_is(tmp_path):
    """Seq2SeqTrainingArguments(bf16=True) on a captured T5 trains on the engine in bf16: three steps log
    transformers' losses under CPU autocast within 5e-4 relative, closer to them than the f32 run's losses are (5.1e-4
    away). The bound is wider than the decoder-only models' 2e-4 because the fused attention keeps T5's scores, its
    relative position bias and the mask in f32 where PyTorch's CPU scaled_dot_product_attention under autocast takes
    them through its bf16 path (measured on a Zen 4 with AVX512-BF16: 3.3e-4; 4.0e-4 before the cross-attention was
    fused too, the decomposed attention that rounded as autocast's matmuls do: within 2e-4). On a CPU without
    AVX512-BF16 the engine's attention widens the bf16 q, k, v and keeps its tiles in f32 (no bf16 pairs rounding the
    probabilities as autocast's kernel does), so there the losses need not be closer than the f32 run's: they are
    held within 1e-3 of autocast's (measured 5.5e-4 with the kernels capped to AVX2 on that Zen 4, the f32 run
    5.1e-4) and must differ from the f32 run's (the bf16 products ran)."""
    rows = batch(model_of("t5"), seed=1)
    del rows["decoder_input_ids"]
    rows["attention_mask"][0] = 1
    data = [{k: v[i] for k, v in rows.items()} for i in range(4)]
    _, ours = run_trainer(fusetrain.Seq2SeqTrainer, fusetrain.Seq2SeqTrainingArguments, model_of("t5"), data,
                          tmp_path / "ours", fusetrain_require_engine=True, bf16=True)
    _, theirs = run_trainer(T.Seq2SeqTrainer, T.Seq2SeqTrainingArguments, model_of("t5"), data, tmp_path / "theirs",
                            bf16=True)
    _, f32 = run_trainer(fusetrain.Seq2SeqTrainer, fusetrain.Seq2SeqTrainingArguments, model_of("t5"), data,
                         tmp_path / "f32", fusetrain_require_engine=True)
    # the attention kernel's bf16 pairs: AVX512-BF16 on a CPU whose kernels FUSETRAIN_KERNELS does not cap
    if "avx512_bf16" in fusetrain.cpu_features().split() and not os.environ.get("FUSETRAIN_KERNELS"):
        assert_bf16_like_autocast(ours, theirs, f32, rtol=5e-4)
    else:
        np.testing.assert_allclose(ours, theirs, rtol=1e-3)
        assert not np.allclose(ours, f32, rtol=1e-6, atol=0), (ours, f32)


def test_seq2seq_trainer_accumulates_ragged_targets_as_transformers_does(tmp_path):
    """Gradient accumulation over micro-batches whose targets hold different numbers of labelled tokens: the engine
    weighs each micro-batch's mean loss as transformers' Seq2SeqTrainer does (by the step's labelled tokens where the
    model takes num_items_in_batch), so the logged losses and the weights after agree."""
    tokenizer = word_tokenizer()
    data = ragged_examples(seed=7, count=8)

    def collator(model):
        return T.DataCollatorForSeq2Seq(tokenizer, model=model)

    ours, theirs = both_seq2seq_trainers("bart", data, tmp_path, collator, tokenizer,
                                         per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                         train_sampling_strategy="sequential")  # one order for both samplers
    trained = dict(theirs.model.named_parameters())
    for name, p in ours.model.named_parameters():
        a, b = p.detach().numpy(), trained[name].detach().numpy()
        assert np.linalg.norm(a - b) <= 1e-3 * np.linalg.norm(b), name


@pytest.mark.parametrize("arch", ["bart", "marian", "t5"])
def test_cross_attention_runs_in_the_attention_kernel(arch, tmp_path):
    """BART's, Marian's and T5's attention (encoder self, decoder causal self, and the decoder's cross-attention over
    the encoder, its queries the target's and its keys the source's, masked by the source's padding) is the fused
    Attention op in all three places: `fusetrain inspect` plans 6 for BART's and Marian's 2 + 2 layers, 8 for T5's
    2 + 3, and no Softmax. T5's self-attention adds its relative position bias (gathered from a trained table, the
    mask folded in by a Where) as the kernel's score bias, with its gradient; its cross-attention's mask spans the
    heads. Marian's padding id is the vocabulary's last, which the inspect batch's dummy token must avoid."""
    from test_capture import cli

    graph = capture.captured_path(model_of(arch), "seq2seq")
    shown = cli("inspect", "--model", str(graph), "--task", "seq2seq", "--max-seq-length", "16",
                "--max-target-length", "8", "--per-device-train-batch-size", "2", cache=tmp_path / "cache")
    assert shown.returncode == 0, shown.stderr
    ops = {line.split()[0]: line.split()[1:] for line in shown.stdout.splitlines() if line.startswith("  ")}
    count = "8" if arch == "t5" else "6"
    assert ops.get("Attention") == [count] * 2 and ops.get("AttentionBackward") == [count] * 2, shown.stdout
    assert "Softmax" not in ops and "SoftmaxBackward" not in ops, shown.stdout


def test_model_from_pretrained_keeps_a_directorys_frozen_weights_and_buffers_fixed(tmp_path):
    """fusetrain.Model.from_pretrained on a Marian directory (the command line's capture path: the graph prepared
    with the directory's weights, fusetrain_capture.json beside it) trains what transformers' from_pretrained model
    trains: final_logits_bias (a buffer, here not zero) stays fixed at the directory's values, and the padding row
    gets no embedding gradient; loss and every gradient match that model's. (transformers' from_pretrained leaves
    Marian's sinusoidal positions trainable, unlike a model built from its config.)"""
    model_of("marian", seed=2).save_pretrained(tmp_path / "start")
    reference = T.MarianMTModel.from_pretrained(tmp_path / "start")
    with torch.no_grad():
        reference.final_logits_bias.normal_(0, 0.5)
    reference.save_pretrained(tmp_path / "marian")
    engine = fusetrain.Model.from_pretrained(tmp_path / "marian")
    held = {name for name, p in reference.named_parameters() if not p.requires_grad}
    trainable = set(engine.trainable_names())
    assert "final_logits_bias" not in trainable and not held & trainable
    data = batch(reference, seed=5)
    want_loss, _ = torch_loss_and_grads(reference, data)
    engine.train()
    loss, grads = engine.loss_and_grads(**data)
    hf.assert_loss_matches(loss, want_loss, "marian from a directory", rtol=1e-5)
    errors = hf.grad_errors(grads, {name: reference.get_parameter(name).grad.numpy() for name in grads})
    assert not errors, "\n".join(errors)


def test_captured_t5_exports_to_onnx_and_runs_in_onnxruntime_as_on_the_engine(tmp_path):
    """A captured T5 (its attention the fused op with the relative position bias as a score bias, its cross-attention
    mask a key bias per head) exports to ONNX, the score bias written as an Add before the mask, and ONNX Runtime's
    logits match the engine's within test_onnx_export's 1e-4 (each sums the same f32 products in its own order)."""
    ort = pytest.importorskip("onnxruntime")
    model = capture.capture(model_of("t5"), "seq2seq")
    path = model.export_onnx(tmp_path / "model.onnx")
    rows = batch(model_of("t5"), seed=1)
    feeds = {k: np.asarray(v) for k, v in rows.items() if k != "labels"}
    feeds.setdefault("decoder_attention_mask", np.ones_like(feeds["decoder_input_ids"]))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    exported = dict(zip([o.name for o in session.get_outputs()],
                        session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})))
    ours = model.forward(**feeds)
    assert set(exported) == set(ours) == {"logits"}, (set(exported), set(ours))
    np.testing.assert_allclose(exported["logits"], ours["logits"], rtol=1e-4, atol=1e-4)


# ---- Whisper: log-mel features in, tokens out ----------------------------------------------------------------------


def whisper_model(seed: int = 0):
    """A small Whisper: 8 mel bins over 24 frames (two convolutions, the second of stride 2, into 12 positions),
    2 + 2 layers of 3 heads of 12, sinusoidal encoder positions (frozen), learned decoder positions, tied output
    embedding; dropout off."""
    config = T.WhisperConfig(vocab_size=VOCAB, num_mel_bins=8, encoder_layers=2, decoder_layers=2,
                             encoder_attention_heads=3, decoder_attention_heads=3, d_model=36, encoder_ffn_dim=52,
                             decoder_ffn_dim=52, max_source_positions=12, max_target_positions=32, dropout=0.0,
                             attention_dropout=0.0, activation_dropout=0.0, pad_token_id=VOCAB - 1,
                             bos_token_id=VOCAB - 2, eos_token_id=VOCAB - 3, decoder_start_token_id=VOCAB - 4,
                             suppress_tokens=[], begin_suppress_tokens=[])
    torch.manual_seed(seed)
    model = T.WhisperForConditionalGeneration(config)
    hf.perturb_(model, seed, scale=0.02)
    return model.float()


def speech_batch(seed: int = 0, rows: int = 4, target: int = 7) -> dict[str, np.ndarray]:
    """Log-mel-like features and target labels (the second row ending in -100)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(3, VOCAB - 4, size=(rows, target))
    labels[1, target - 2:] = -100
    return {"input_features": rng.standard_normal((rows, 8, 24)).astype(np.float32), "labels": labels}


def test_captured_whisper_loss_and_every_gradient_match_pytorch(tmp_path):
    """Whisper's conv front end (the engine's Conv, GELU between) and its encoder-decoder: loss and every gradient
    of a step as PyTorch's, the decoder inputs the labels shifted right as Whisper's forward shifts them; all six
    attentions run in the fused kernel."""
    from test_capture import cli
    from transformers.models.whisper.modeling_whisper import shift_tokens_right

    model = whisper_model()
    engine = capture.capture(model)
    assert [(row["name"], row["shape"]) for row in engine.inputs] == [
        ("input_features", "float32 (batch, 8, 24)"), ("decoder_input_ids", "int64 (batch, target sequence)"),
        ("decoder_attention_mask", "int64 (batch, target sequence)")]
    data = speech_batch()
    want_loss, _ = torch_loss_and_grads(model, data)
    data["decoder_input_ids"] = shift_tokens_right(torch.from_numpy(data["labels"]), model.config.pad_token_id,
                                                   model.config.decoder_start_token_id).numpy()
    engine.train()
    loss, grads = engine.loss_and_grads(**data)
    hf.assert_loss_matches(loss, want_loss, "whisper", rtol=1e-5)
    assert {id(model.get_parameter(n)) for n in grads} == {id(p) for p in model.parameters() if p.requires_grad}
    errors = hf.grad_errors(grads, {name: model.get_parameter(name).grad.numpy() for name in grads})
    assert not errors, "whisper: gradient mismatches:\n  " + "\n  ".join(errors)
    graph = capture.captured_path(model, "seq2seq")
    shown = cli("inspect", "--model", str(graph), "--task", "seq2seq", "--max-target-length", "8",
                "--per-device-train-batch-size", "2", cache=tmp_path / "cache")
    assert shown.returncode == 0, shown.stderr
    ops = {line.split()[0]: line.split()[1:] for line in shown.stdout.splitlines() if line.startswith("  ")}
    assert ops.get("Attention") == ["6", "6"] and ops.get("Conv") == ["2", "2"], shown.stdout
    assert "Softmax" not in ops, shown.stdout


def test_seq2seq_trainer_trains_whisper_as_transformers_does(tmp_path):
    """Three AdamW steps of fusetrain.Seq2SeqTrainer on speech features against transformers' Seq2SeqTrainer, each
    with its default collator (the decoder inputs the model's shifted labels): the same losses and weights after."""
    rows = speech_batch(seed=5)
    data = [{k: v[i] for k, v in rows.items()} for i in range(4)]
    ours, theirs = both_seq2seq_trainers("whisper", data, tmp_path, make=whisper_model)
    assert_trained_alike(ours.model, theirs.model, whisper_model, {k: torch.from_numpy(v) for k, v in rows.items()})
