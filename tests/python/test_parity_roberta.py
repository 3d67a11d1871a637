"""RoBERTa-specific parity checks: padding inside the sequence and explicit position ids."""

import numpy as np
import pytest

import hf_models as hf


def test_padding_tokens_inside_the_sequence():
    """A padding id in the middle of a row (no mask) takes position padding_idx and
    shifts the positions of the tokens after it, as create_position_ids_from_input_ids does."""
    case = hf.Case("RobertaForTokenClassification", "small")
    batch = hf.without_labels(hf.make_batch(case, padding=False))
    batch["input_ids"][:, 4] = hf.pad_token_id("roberta")
    hf_out = hf.hf_outputs(hf.reference_model(case), batch)
    hf.assert_logits_match(case, hf.ft_from_reference(case).forward(**batch), hf_out)


def test_explicit_position_ids():
    case = hf.Case("RobertaForMaskedLM", "small")
    batch = hf.without_labels(hf.make_batch(case))
    batch["position_ids"] = np.tile(np.arange(hf.SEQ, dtype=np.int64) + 2, (hf.BATCH, 1))
    hf_out = hf.hf_outputs(hf.reference_model(case), batch)
    hf.assert_logits_match(case, hf.ft_from_reference(case).forward(**batch), hf_out)
