"""DistilBERT parity with transformers (no token types; pre_classifier + ReLU head)."""

import pytest

import hf_models as hf

CASES = hf.cases("distilbert")
HEADS = [case for case in CASES if case.task != "base"]


@pytest.mark.parametrize("padding", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_logits(case, padding):
    hf.check_logits(case, padding=padding)


@pytest.mark.parametrize("case", HEADS, ids=lambda case: case.id)
def test_loss_and_gradients(case):
    hf.check_loss_and_grads(case)


@pytest.mark.parametrize("case", hf.variant_cases("distilbert"), ids=lambda case: case.id)
def test_config_variants(case):
    hf.check_variant(case)
