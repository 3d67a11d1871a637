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
