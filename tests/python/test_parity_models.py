"""Parity with transformers for every supported architecture and head: logits
(padded and unpadded batches), loss and every gradient, and config variants.
Architecture-specific checks live in test_parity_<architecture>.py."""

import pytest

import hf_models as hf

MODEL_TYPES = ["bert", "roberta", "distilbert", "gpt2"]
CASES = [case for model_type in MODEL_TYPES for case in hf.cases(model_type)]
HEADS = [case for case in CASES if case.task != "base"]
VARIANTS = [case for model_type in MODEL_TYPES for case in hf.variant_cases(model_type)]


@pytest.mark.parametrize("padding", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_logits(case, padding):
    hf.check_logits(case, padding=padding)


@pytest.mark.parametrize("case", HEADS, ids=lambda case: case.id)
def test_loss_and_gradients(case):
    hf.check_loss_and_grads(case)


@pytest.mark.parametrize("case", VARIANTS, ids=lambda case: case.id)
def test_config_variants(case):
    hf.check_variant(case)
