"""Wav2Vec2 captured into the engine from raw audio (input_values): speech recognition with the CTC loss
(Wav2Vec2ForCTC) and audio classification (Wav2Vec2ForSequenceClassification), trained by fusetrain.Trainer
(fusetrain_require_engine=True) against transformers' Trainer on the same weights and batches.

Tolerances: the loss of one step within 1e-5 relative and every gradient within 1e-4 norm-wise of PyTorch's
(hf_models.grad_errors); fusetrain and PyTorch sum the same f32 products in different orders, and the CTC lattice
is summed in double by fusetrain and in f32 by PyTorch (measured: ~1e-7 relative on the loss). Trainer losses within
1e-3 relative (transformers logs 4 significant digits); weights after three steps within 1e-3 norm-wise
(test_capture.assert_trained_alike says why). Dropout and layer drop are off in every config (the engine's dropout
masks are its own).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("onnxscript")  # the dynamo exporter

import fusetrain  # noqa: E402
import hf_models as hf  # noqa: E402
from fusetrain import capture  # noqa: E402
from test_capture import assert_trained_alike, both_trainers  # noqa: E402

T = transformers
VOCAB = 13  # CTC classes: 0 the blank (pad_token_id), 1-12 characters


@pytest.fixture(autouse=True)
def capture_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("FUSETRAIN_CACHE", str(tmp_path_factory.getbasetemp() / "capture-cache"))


def wav2vec2(head: str = "ctc", seed: int = 0, **overrides):
    """A small Wav2Vec2: a 3-layer convolutional feature encoder (kernels 10, 3, 3; strides 5, 2, 2: a frame every 20
    samples) whose first layer has GroupNorm over each channel, a weight-normed grouped positional convolution of
    even width (its last output dropped), 2 post-norm layers of 3 heads of 12; no SpecAugment, dropout or layer
    drop unless `overrides` set them."""
    settings = dict(vocab_size=VOCAB, hidden_size=36, num_hidden_layers=2, num_attention_heads=3,
                    intermediate_size=40, conv_dim=(16, 16, 16), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3),
                    num_conv_pos_embeddings=6, num_conv_pos_embedding_groups=3, pad_token_id=0, num_labels=3,
                    mask_time_prob=0.0, layerdrop=0.0, hidden_dropout=0.0, attention_dropout=0.0,
                    activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0)
    settings.update(overrides)
    torch.manual_seed(seed)
    cls = T.Wav2Vec2ForCTC if head == "ctc" else T.Wav2Vec2ForSequenceClassification
    model = cls(T.Wav2Vec2Config(**settings))
    hf.perturb_(model, seed, scale=0.02)  # no two weights equal: a mix-up of names cannot pass
    return model.float()


def audio(seed: int, rows: int, samples: int, head: str) -> dict[str, np.ndarray]:
    """Raw audio and labels: CTC label sequences of different lengths padded with -100 (one with a -100 inside, which
    transformers' masked_select skips too), or one class per clip."""
    rng = np.random.default_rng(seed)
    out = {"input_values": rng.standard_normal((rows, samples)).astype(np.float32)}
    if head == "ctc":
        labels = rng.integers(1, VOCAB, size=(rows, 7))
        labels[0, 4:] = -100
        labels[-1, 2] = -100
        out["labels"] = labels
    else:
        out["labels"] = rng.integers(0, 3, size=rows)
    return out


def assert_step_matches(model, engine, batch, what: str) -> None:
    """One training step's loss and every gradient as PyTorch's, every parameter trained."""
    model.zero_grad()
    model.train()
    out = model(**{k: torch.from_numpy(v) for k, v in batch.items()})
    out.loss.backward()
    engine.train()
    loss, grads = engine.loss_and_grads(**batch)
    hf.assert_loss_matches(loss, out.loss.item(), what, rtol=1e-5)
    torch_grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert set(torch_grads) <= set(grads), what
    for name in set(grads) - set(torch_grads):  # masked_spec_embed when nothing is masked: PyTorch's grad is None
        assert not grads[name].any(), f"{what}: {name} has a gradient where PyTorch has none"
    errors = hf.grad_errors(grads, {name: g.numpy() for name, g in torch_grads.items()})
    assert not errors, f"{what}: gradient mismatches:\n  " + "\n  ".join(errors)


@pytest.mark.parametrize("head, reduction", [("ctc", "sum"), ("ctc", "mean"), ("audio-cls", None)])
def test_a_captured_wav2vec2_matches_pytorch(head, reduction):
    """Loss and every gradient of a training step, at two audio lengths: the captured graph's length axis is dynamic,
    so each length is another program of one capture (1000 samples: 49 frames; 1237: 60)."""
    overrides = {"ctc_loss_reduction": reduction} if reduction else {}
    model = wav2vec2(head, **overrides)
    engine = capture.capture(model)
    assert [(row["name"], row["shape"]) for row in engine.inputs] == [("input_values", "float32 (batch, any)")]
    for seed, samples in ((0, 1000), (1, 1237)):
        assert_step_matches(model, engine, audio(seed, 3, samples, head), f"{head} {reduction} {samples} samples")
    # Evaluation: the logits of a batch without labels.
    engine.eval()
    model.eval()
    clip = audio(2, 2, 1111, head)["input_values"]
    with torch.no_grad():
        want = model(input_values=torch.from_numpy(clip)).logits.numpy()
    np.testing.assert_allclose(engine.forward(input_values=clip)["logits"], want, rtol=1e-4, atol=1e-5)


def test_ctc_impossible_alignments_are_infinite_or_zeroed_as_in_pytorch():
    """A target longer than the frames has no alignment: the loss is inf (torch's ctc_loss), or with
    config.ctc_zero_infinity that example's loss and gradient are 0 and the others train as in PyTorch."""
    batch = audio(3, 3, 1000, "ctc")  # 49 frames
    batch["labels"] = np.concatenate([batch["labels"], np.full((3, 60), -100)], axis=1)
    batch["labels"][1, :] = np.arange(batch["labels"].shape[1]) % (VOCAB - 1) + 1  # 67 labels in 49 frames
    engine = capture.capture(wav2vec2("ctc"))
    engine.train()
    assert np.isinf(engine.loss_and_grads(**batch)[0])
    model = wav2vec2("ctc", ctc_zero_infinity=True)
    assert_step_matches(model, capture.capture(model), batch, "zero_infinity")


def test_spec_augment_masks_are_drawn_and_applied_as_in_pytorch():
    """SpecAugment (mask_time_prob, mask_feature_prob): the masks are float inputs of the captured graph, drawn with
    the model's own _compute_mask_indices on NumPy's generator in the order its forward draws them (time, then
    features); masked frames take masked_spec_embed, which trains. The same seed gives PyTorch's loss and gradients
    exactly; without the masks nothing is masked (evaluation)."""
    model = wav2vec2("ctc", mask_time_prob=0.3, mask_time_length=2, mask_feature_prob=0.2, mask_feature_length=3)
    engine = capture.capture(model)
    assert [row["name"] for row in engine.inputs] == ["input_values", "mask_time_indices", "mask_feature_indices"]
    batch = audio(4, 3, 1000, "ctc")
    np.random.seed(7)
    masked = capture.draw_spec_augment(model, batch)
    assert masked["mask_time_indices"].shape == (3, 49) and masked["mask_feature_indices"].shape == (3, 36)
    assert masked["mask_time_indices"].any() and masked["mask_feature_indices"].any()
    np.random.seed(7)  # PyTorch's forward draws the same masks
    model.zero_grad()
    model.train()
    out = model(**{k: torch.from_numpy(v) for k, v in batch.items()})
    out.loss.backward()
    engine.train()
    loss, grads = engine.loss_and_grads(**masked)
    hf.assert_loss_matches(loss, out.loss.item(), "spec augment", rtol=1e-5)
    assert "wav2vec2.masked_spec_embed" in grads
    errors = hf.grad_errors(grads, {name: model.get_parameter(name).grad.numpy() for name in grads})
    assert not errors, "spec augment: gradient mismatches:\n  " + "\n  ".join(errors)
    # Without masks: as PyTorch with SpecAugment off.
    model.config.apply_spec_augment = False
    assert_step_matches(model, engine, batch, "no masks")


def test_layerdrop_is_refused_naming_the_setting():
    """LayerDrop (Wav2Vec2's default 0.1) skips layers at random each step: capture refuses it with one clear error,
    which fusetrain.Trainer turns into a fallback to transformers' loop (an error under fusetrain_require_engine)."""
    with pytest.raises(capture.CaptureError, match=r"config.layerdrop is 0.1: LayerDrop skips whole layers"):
        capture.capture(wav2vec2("ctc", layerdrop=0.1))


def test_bad_ctc_labels_are_one_clear_error():
    engine = capture.capture(wav2vec2("ctc"))
    engine.train()
    batch = audio(5, 2, 1000, "ctc")
    batch["labels"][0, 0] = VOCAB
    with pytest.raises(ValueError, match=rf"labels: value {VOCAB} at position 0 is outside \[0, {VOCAB}\)"):
        engine.loss_and_grads(**batch)
    batch["labels"] = np.abs(batch["labels"]).astype(np.float32)
    with pytest.raises(ValueError, match=r"a CTC head needs integer label sequences of shape \(batch, L\)"):
        engine.loss_and_grads(**batch)
    batch["labels"] = np.ones(2, dtype=np.int64)
    with pytest.raises(ValueError, match=r"a CTC head needs integer label sequences of shape \(batch, L\)"):
        engine.loss_and_grads(**batch)


def collate_ctc(rows: list[dict]) -> dict:
    """DataCollatorCTCWithPadding's batch for equal-length clips: the audio stacked, the label sequences padded with
    -100."""
    longest = max(len(row["labels"]) for row in rows)
    return {"input_values": torch.tensor(np.stack([row["input_values"] for row in rows])),
            "labels": torch.tensor([list(row["labels"]) + [-100] * (longest - len(row["labels"])) for row in rows])}


@pytest.mark.parametrize("head", ["ctc", "audio-cls"])
def test_trainer_trains_wav2vec2_as_transformers_does(head, tmp_path):
    """Three AdamW steps of fusetrain.Trainer on the engine against transformers' Trainer: the same losses and the
    same weights after. One batch of 4 clips a step (label sequences of 3 to 6 labels for CTC)."""
    rng = np.random.default_rng(6)
    clips = rng.standard_normal((4, 1000)).astype(np.float32)
    if head == "ctc":
        data = [{"input_values": clips[i], "labels": rng.integers(1, VOCAB, 3 + i).tolist()} for i in range(4)]
        collator = collate_ctc
    else:
        data = [{"input_values": clips[i], "labels": int(rng.integers(0, 3))} for i in range(4)]
        collator = None
    ours_model, theirs_model = both_trainers(lambda: wav2vec2(head), data, tmp_path, data_collator=collator)
    feed = {k: v for k, v in collate_ctc(data).items()} if head == "ctc" else {
        "input_values": torch.from_numpy(clips), "labels": torch.tensor([row["labels"] for row in data])}
    assert_trained_alike(ours_model, theirs_model, lambda: wav2vec2(head), feed)


def test_trainer_draws_spec_augment_as_transformers_does(tmp_path):
    """With SpecAugment on, each training step's masks are the ones transformers' forward draws (NumPy's generator,
    seeded by both Trainers from args.seed): the same losses and weights. The four rows of the batch are one clip,
    so the rows' order (each sampler's own) cannot make the steps differ; the masks differ row by row."""
    rng = np.random.default_rng(8)
    clip, labels = rng.standard_normal(1000).astype(np.float32), rng.integers(1, VOCAB, 5).tolist()
    data = [{"input_values": clip, "labels": labels} for _ in range(4)]

    def fresh():
        return wav2vec2("ctc", mask_time_prob=0.3, mask_time_length=2, mask_feature_prob=0.2, mask_feature_length=3)

    ours_model, theirs_model = both_trainers(fresh, data, tmp_path, data_collator=collate_ctc)
    assert_trained_alike(ours_model, theirs_model, fresh, collate_ctc(data))


def test_a_collators_audio_attention_mask_is_refused_unless_it_masks_nothing(tmp_path):
    """A captured audio model reads input_values alone: a batch whose attention_mask marks padding is one clear error
    (its masking cannot be honoured), an all-ones mask is dropped, and label sequences are padded to a multiple of 8
    with -100 (no change to the loss)."""
    from fusetrain import data

    rng = np.random.default_rng(9)
    batch = {"input_values": torch.from_numpy(rng.standard_normal((2, 1000)).astype(np.float32)),
             "attention_mask": torch.ones(2, 1000, dtype=torch.long), "labels": torch.tensor([[1, 2, 3], [4, -100, -100]])}
    padded = data.pad_batch(batch, pad_id=0)
    assert "attention_mask" not in padded and padded["labels"].shape == (2, 8)
    assert (padded["labels"][:, 3:] == -100).all() and (padded["labels"][:, :3] == batch["labels"].numpy()).all()
    batch["attention_mask"][1, 900:] = 0
    with pytest.raises(ValueError, match="attention_mask that marks padding in audio"):
        data.pad_batch(batch, pad_id=0)
