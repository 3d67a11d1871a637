"""GPT-2-specific parity checks: the pooled token of sequence classification and explicit position ids."""

import numpy as np
import pytest

import hf_models as hf


def test_sequence_classification_reads_the_last_real_token():
    """Rows of different lengths pool different positions; the padding after the
    last real token must not matter (only the mask and pad ids mark it)."""
    case = hf.Case("GPT2ForSequenceClassification", "odd", "single")
    batch = hf.without_labels(hf.make_batch(case))
    hf_out = hf.hf_outputs(hf.reference_model(case), batch)
    ft_model = hf.ft_from_reference(case)
    hf.assert_logits_match(case, ft_model.forward(**batch), hf_out)
    # Each row alone, unpadded, classifies the same.
    lengths = batch["attention_mask"].sum(axis=1)
    for row, n in enumerate(lengths):
        alone = {"input_ids": batch["input_ids"][row:row + 1, :n]}
        got = np.asarray(ft_model.forward(**alone)["logits"])
        np.testing.assert_allclose(got[0], hf_out["logits"][row], rtol=hf.LOGITS_RTOL, atol=hf.LOGITS_ATOL,
                                   err_msg=f"row {row} ({n} tokens) alone")


def test_explicit_position_ids():
    case = hf.Case("GPT2LMHeadModel", "small")
    batch = hf.without_labels(hf.make_batch(case))
    batch["position_ids"] = np.tile(np.arange(hf.SEQ, dtype=np.int64) + 5, (hf.BATCH, 1))
    hf_out = hf.hf_outputs(hf.reference_model(case), batch)
    hf.assert_logits_match(case, hf.ft_from_reference(case).forward(**batch), hf_out)
