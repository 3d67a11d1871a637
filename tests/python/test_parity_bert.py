"""BERT-specific parity checks: explicit position ids, default token types, int32 inputs."""

import numpy as np
import pytest

import hf_models as hf


@pytest.mark.parametrize("case", [hf.Case("BertForMaskedLM", "odd"), hf.Case("BertModel", "small")],
                         ids=lambda case: case.id)
def test_explicit_position_ids(case):
    """Positions passed by the caller replace the default 0..T-1."""
    batch = hf.without_labels(hf.make_batch(case))
    batch["position_ids"] = np.tile(np.arange(hf.SEQ, dtype=np.int64)[::-1] + 3, (hf.BATCH, 1))
    hf_out = hf.hf_outputs(hf.reference_model(case), batch)
    hf.assert_logits_match(case, hf.ft_from_reference(case).forward(**batch), hf_out)
    default = hf.hf_outputs(hf.reference_model(case), {k: v for k, v in batch.items() if k != "position_ids"})
    assert not np.allclose(default.get("logits", default.get("last_hidden_state")),
                           hf_out.get("logits", hf_out.get("last_hidden_state")), atol=1e-3)


def test_token_type_ids_default_to_zero():
    case = hf.Case("BertForSequenceClassification", "small", "single")
    batch = hf.without_labels(hf.make_batch(case))
    del batch["token_type_ids"]
    hf_out = hf.hf_outputs(hf.reference_model(case), batch)
    hf.assert_logits_match(case, hf.ft_from_reference(case).forward(**batch), hf_out)


def test_int32_inputs():
    """Any numpy integer array is accepted: int32 ids give the int64 result."""
    case = hf.Case("BertForTokenClassification", "small")
    batch = hf.without_labels(hf.make_batch(case))
    hf_out = hf.hf_outputs(hf.reference_model(case), batch)
    batch32 = {k: v.astype(np.int32) for k, v in batch.items()}
    hf.assert_logits_match(case, hf.ft_from_reference(case).forward(**batch32), hf_out)


@pytest.mark.parametrize("architecture", ["BertForSequenceClassification", "RobertaForSequenceClassification",
                                          "DistilBertForSequenceClassification"])
def test_mostly_padding_runs_unpadded_with_the_same_results(architecture):
    """A batch that is mostly padding runs unpadded (Model.unpad, on by default): the token-wise layers compute the
    kept tokens only, in a smaller arena, and logits, loss and every gradient still match transformers."""
    case = hf.Case(architecture, "small", "single")
    batch = hf.make_batch(case, batch=8, seq=24)
    lengths = np.array([24, 3, 5, 9, 4, 12, 6, 2])
    mask = (np.arange(24)[None, :] < lengths[:, None]).astype(np.int64)
    batch["attention_mask"] = mask
    batch["input_ids"][mask == 0] = hf.pad_token_id(case.model_type)
    hf_model = hf.reference_model(case)
    hf_out = hf.hf_outputs(hf_model, batch)
    hf_loss, hf_grads = hf.hf_loss_and_grads(hf_model, batch)
    peaks = {}
    for unpad in (False, True):
        ft = hf.ft_from_reference(case)
        assert ft.unpad
        ft.unpad = unpad
        out = ft.forward(**batch)
        hf.assert_loss_matches(float(out["loss"]), hf_out["loss"], f"{case.id} unpad={unpad} forward")
        hf.assert_logits_match(case, out, hf_out, mask=mask)
        loss, grads = ft.loss_and_grads(**batch)
        peaks[unpad] = ft.last_memory_report()["activation_peak_bytes"]
        hf.assert_loss_matches(float(loss), hf_loss, f"{case.id} unpad={unpad} loss_and_grads")
        grads = {name: np.array(g, dtype=np.float32, copy=True) for name, g in grads.items()}
        hf.assert_grads_match(case.id, grads, hf_grads, allowed_extra=hf.tied_names(hf_model))
    assert peaks[True] < peaks[False], peaks
