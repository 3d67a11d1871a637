"""config.json fields are checked as transformers 5 checks them: what transformers refuses, fusetrain refuses, with one
line naming the file and the field (rope types and their required keys, key/value heads, head_dim, sliding_window,
epsilons, initializer_range, integer and float field types).

Each refused config is first shown to be refused by transformers itself: building its config from config.json (as
from_pretrained does), building the model, or the model's first forward and backward on a short batch (transformers
builds some broken configs, a window of 0 or key/value heads that do not divide the heads, and fails only when it
runs them). Where fusetrain refuses a config transformers takes, the case says why, and its test shows transformers
taking it, so the difference is on record. Configs fusetrain read differently from transformers until these checks
(llama3 without original_max_position_embeddings, both rope dicts, a head size rounded down) are compared with
transformers' logits."""

from __future__ import annotations

import copy
import json
import math
import pathlib

import numpy as np
import pytest
import torch
import transformers

import cli_support
import hf_models as hf

fusetrain = hf.fusetrain_module()

LLAMA = dict(model_type="llama", vocab_size=101, hidden_size=72, num_hidden_layers=2, num_attention_heads=6,
             num_key_value_heads=2, intermediate_size=100, max_position_embeddings=64)
MISTRAL = {**LLAMA, "model_type": "mistral"}
QWEN2 = {**LLAMA, "model_type": "qwen2"}
BERT = dict(model_type="bert", vocab_size=101, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=40, max_position_embeddings=64)
GPT2 = dict(model_type="gpt2", vocab_size=101, n_embd=32, n_layer=1, n_head=2, n_positions=64)
ARCHITECTURE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "bert": "BertForMaskedLM", "gpt2": "GPT2LMHeadModel"}
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=16)


def rope(key: str = "rope_scaling", base: dict = LLAMA, **parameters) -> dict:
    return {**base, key: parameters}


def llama3_without(key: str, field: str = "rope_scaling") -> dict:
    return {**LLAMA, field: {k: v for k, v in LLAMA3.items() if k != key}}


# id: (config.json, what fusetrain's one line says)
REFUSED = {
    # The user's report: these trained unscaled.
    "linear-without-factor": (rope(rope_type="linear"),
                              'config.json: "rope_scaling" of type "linear" needs "factor" (a number >= 1), as '
                              'transformers requires; it has none'),
    "linear-as-type-without-factor": (rope(type="linear"), '"rope_scaling" of type "linear" needs "factor"'),
    "dynamic-without-factor": (rope("rope_parameters", rope_type="dynamic"),
                               '"rope_parameters" of type "dynamic" needs "factor" (a number >= 1)'),
    "llama3-without-factor": (llama3_without("factor"), '"rope_scaling" of type "llama3" needs "factor"'),
    "llama3-without-low_freq_factor": (llama3_without("low_freq_factor", "rope_parameters"),
                                       '"rope_parameters" of type "llama3" needs "low_freq_factor" (a number > 0)'),
    "llama3-without-high_freq_factor": (llama3_without("high_freq_factor"),
                                        '"rope_scaling" of type "llama3" needs "high_freq_factor" (a number > '
                                        'low_freq_factor)'),
    "linear-factor-string": (rope(rope_type="linear", factor="2"),
                             '"rope_scaling" "factor" is "2", expected a number >= 1 (transformers fails on it too)'),
    "linear-factor-null": (rope(rope_type="linear", factor=None), '"rope_scaling" "factor" is null, expected a number'),
    "llama3-low_freq_factor-string": (rope(**{**LLAMA3, "low_freq_factor": "1"}),
                                      '"rope_scaling" "low_freq_factor" is "1", expected a number > 0'),
    "llama3-original-string": (rope(**{**LLAMA3, "original_max_position_embeddings": "16"}),
                               '"rope_scaling" "original_max_position_embeddings" is "16", expected a positive'),
    "llama3-top-level-original-null": ({**rope(**LLAMA3), "original_max_position_embeddings": None},
                                       '"original_max_position_embeddings" is null, expected a positive number'),
    "unknown-rope-type": (rope(rope_type="bogus", factor=2.0),
                          '"rope_scaling" "rope_type" is "bogus", which fusetrain does not support (supported: '
                          'default, linear, dynamic, llama3)'),
    "rope-type-null": (rope(rope_type=None, factor=2.0), '"rope_scaling" "rope_type" is null, expected the name'),
    "rope_scaling-not-an-object": ({**LLAMA, "rope_scaling": "linear"},
                                   'config.json: "rope_scaling" should be an object, found "linear"'),
    "rope_theta-string": ({**LLAMA, "rope_theta": "1e4"}, '"rope_theta" is "1e4", expected a number > 0'),
    "rope_theta-null-in-rope_parameters": (rope("rope_parameters", rope_type="default", rope_theta=None),
                                           '"rope_parameters" "rope_theta" is null, expected a number > 0'),
    "partial-rotation-with-linear": (rope(rope_type="linear", factor=2.0, partial_rotary_factor=0.5),
                                     '"partial_rotary_factor" 0.5 rotates part of each head, which llama does not'),
    "kv-heads-not-dividing-heads": ({**LLAMA, "num_key_value_heads": 4},
                                    'config.json: "num_attention_heads" 6 is not a multiple of "num_key_value_heads" '
                                    '4'),
    "kv-heads-above-heads": ({**MISTRAL, "num_key_value_heads": 12}, '"num_key_value_heads" 12'),
    "kv-heads-zero": ({**QWEN2, "num_key_value_heads": 0}, '"num_key_value_heads" must be positive, found 0'),
    "kv-heads-float": ({**LLAMA, "num_key_value_heads": 2.0},
                       '"num_key_value_heads" should be an integer, found 2.0 (transformers refuses a float'),
    "llama-hidden-not-divided-beside-head_dim": ({**LLAMA, "hidden_size": 70, "head_dim": 12},
                                                 '"hidden_size" is 70 but "num_attention_heads" 6 does not divide '
                                                 'it (transformers\' LlamaConfig refuses it too'),
    "head_dim-zero": ({**LLAMA, "head_dim": 0}, '"head_dim" must be positive, found 0'),
    "qwen2-head_dim-zero": ({**QWEN2, "head_dim": 0}, '"head_dim" must be positive, found 0'),
    "head_dim-negative": ({**MISTRAL, "head_dim": -2}, '"head_dim" must be positive, found -2'),
    "head_dim-odd": ({**LLAMA, "head_dim": 7}, "the head size 7 must be even for rotary embeddings"),
    "head_dim-odd-small": ({**LLAMA, "head_dim": 3}, "the head size 3 must be even"),
    "head_dim-float": ({**LLAMA, "head_dim": 12.0}, '"head_dim" should be an integer, found 12.0'),
    "mistral-sliding_window-zero": ({**MISTRAL, "sliding_window": 0},
                                    'config.json: "sliding_window" must be positive, found 0'),
    "mistral-sliding_window-negative": ({**MISTRAL, "sliding_window": -1}, '"sliding_window" must be positive'),
    "qwen2-sliding_window-zero": ({**QWEN2, "use_sliding_window": True, "sliding_window": 0, "max_window_layers": 0},
                                  '"sliding_window" must be positive, found 0'),
    "mistral-sliding_window-float": ({**MISTRAL, "sliding_window": 2.5}, '"sliding_window" should be an integer'),
    "llama-rms_norm_eps-integer-zero": ({**LLAMA, "rms_norm_eps": 0},
                                        'config.json: "rms_norm_eps" is 0, expected a positive number written as a '
                                        'float: transformers types it `float` and refuses an integer for it too'),
    "mistral-rms_norm_eps-integer": ({**MISTRAL, "rms_norm_eps": 1}, '"rms_norm_eps" is 1, expected a positive'),
    "qwen2-rms_norm_eps-null": ({**QWEN2, "rms_norm_eps": None},
                                '"rms_norm_eps" is null, expected a positive number written as a float: transformers '
                                'types it `float` and refuses null for it too'),
    "llama-rms_norm_eps-string": ({**LLAMA, "rms_norm_eps": "1e-5"}, '"rms_norm_eps" should be a number, found "1e-5"'),
    "bert-layer_norm_eps-integer-zero": ({**BERT, "layer_norm_eps": 0}, '"layer_norm_eps" is 0, expected a positive'),
    "bert-layer_norm_eps-negative-integer": ({**BERT, "layer_norm_eps": -1}, '"layer_norm_eps" is -1, expected a'),
    "bert-layer_norm_eps-null": ({**BERT, "layer_norm_eps": None}, '"layer_norm_eps" is null'),
    "gpt2-layer_norm_epsilon-integer-zero": ({**GPT2, "layer_norm_epsilon": 0}, '"layer_norm_epsilon" is 0, expected'),
    "gpt2-layer_norm_epsilon-null": ({**GPT2, "layer_norm_epsilon": None}, '"layer_norm_epsilon" is null'),
    "llama-initializer_range-above-1": ({**LLAMA, "initializer_range": 2.0},
                                        '"initializer_range" is 2, expected at most 1 (LlamaConfig\'s interval'),
    "gpt2-initializer_range-integer": ({**GPT2, "initializer_range": 0}, '"initializer_range" is 0, expected a '
                                       'standard deviation >= 0 written as a float'),
    "bert-initializer_range-negative": ({**BERT, "initializer_range": -0.5},
                                        '"initializer_range" is -0.5, expected a standard deviation >= 0'),
    "bert-hidden_size-float": ({**BERT, "hidden_size": 32.0}, '"hidden_size" should be an integer, found 32.0'),
}

# id: (config, what fusetrain says, why fusetrain refuses a config transformers builds and runs)
STRICTER = {
    "linear-factor-below-1": (rope(rope_type="linear", factor=0.5), '"rope_scaling" "factor" is 0.5, expected a number '
                              '>= 1', "transformers' own rule, which it only warns about for old checkpoints"),
    "dynamic-factor-below-1": (rope("rope_parameters", rope_type="dynamic", factor=0.5), '"factor" is 0.5',
                               "transformers' own rule, which it only warns about"),
    "llama3-factor-zero": (rope(**{**LLAMA3, "factor": 0}), '"factor" is 0, expected a number >= 1',
                           "a factor of 0 divides the frequencies by zero"),
    "llama3-high-equal-low": (rope(**{**LLAMA3, "high_freq_factor": 1.0}),
                              'needs 0 < "low_freq_factor" < "high_freq_factor"',
                              "transformers warns; its smoothing divides by high - low = 0"),
    "rope_theta-zero": ({**LLAMA, "rope_theta": 0.0}, '"rope_theta" is 0, expected > 0',
                        "a base of 0 makes infinite frequencies"),
    "mistral-head_dim-zero": ({**MISTRAL, "head_dim": 0}, '"head_dim" must be positive, found 0',
                              "transformers' Mistral reads 0 as unset (Python's `or`), a typo more likely than intent"),
    "rms_norm_eps-zero-float": ({**LLAMA, "rms_norm_eps": 0.0}, '"rms_norm_eps" is 0, expected a positive number',
                                "an epsilon of 0 makes NaN of every row of zero variance"),
    "layer_norm_eps-negative": ({**BERT, "layer_norm_eps": -1e-5}, '"layer_norm_eps" is -1e-05, expected a positive',
                                "a negative epsilon makes NaN wherever the variance is below it"),
    "layer_norm_epsilon-nan": ({**GPT2, "layer_norm_epsilon": math.nan}, '"layer_norm_epsilon" is nan, expected',
                               "the norm's every output would be NaN"),
    "rms_norm_eps-infinite": ({**LLAMA, "rms_norm_eps": math.inf}, '"rms_norm_eps" is inf, expected',
                              "the norm's every output would be 0"),
}


def transformers_error(config: dict, tmp_path: pathlib.Path) -> str | None:
    """What transformers raises for config.json `config`, from reading it, building the model, or a forward and
    backward on one short sequence; None when all of that works."""
    directory = tmp_path / "transformers"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    try:
        hf_config = transformers.AutoConfig.from_pretrained(directory)
        model = getattr(transformers, ARCHITECTURE[config["model_type"]])(hf_config)
        ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
        model(input_ids=ids, labels=ids).loss.backward()
    except Exception as error:  # noqa: BLE001 - any refusal counts: a KeyError, a TypeError, a failed forward
        return f"{type(error).__name__}: {error}"
    return None


def fusetrain_error(config: dict) -> str:
    with pytest.raises(ValueError) as info:
        fusetrain.Model.from_config(copy.deepcopy(config), architecture=ARCHITECTURE[config["model_type"]])
    return str(info.value)


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_as_transformers_refuses_it(case, tmp_path):
    config, message = REFUSED[case]
    assert transformers_error(config, tmp_path) is not None, f"{case}: transformers takes this config"
    error = fusetrain_error(config)
    assert message in error, error
    assert error.startswith("config.json: ") and "\n" not in error, error


@pytest.mark.parametrize("case", list(STRICTER))
def test_refused_where_transformers_runs_it(case, tmp_path):
    config, message, why = STRICTER[case]
    if not any(isinstance(v, float) and not math.isfinite(v) for v in config.values()):  # no NaN in config.json
        assert transformers_error(config, tmp_path) is None, f"{case}: transformers refuses it now; move it to REFUSED"
    error = fusetrain_error(config)
    assert message in error, f"{case} ({why}): {error}"


def test_the_cli_names_the_missing_factor(tmp_path):
    """The user's report from the command line: a Llama directory whose linear rope scaling has no factor."""
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**{k: v for k, v in LLAMA.items() if k != "model_type"})
                                  ).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("rope_parameters", None)
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_scaling": {"type": "linear"}}))
    line = cli_support.error_line(cli_support.run("inspect", "--model", str(tmp_path), "--task", "clm"))
    assert line.endswith('config.json: "rope_scaling" of type "linear" needs "factor" (a number >= 1), as transformers '
                         'requires; it has none'), line


# ---- configs transformers builds, which fusetrain must read as it does --------------------------------------------

# id: config.json; each differs from what fusetrain read before these checks, or from a neighbouring reading.
READ_AS_TRANSFORMERS = {
    # original_max_position_embeddings: absent, max_position_embeddings (fusetrain took 8192); a top-level one
    # overrides the rope dict's (standardize_rope_params); a float is divided by as it is.
    "llama3-without-original": llama3_without("original_max_position_embeddings"),
    "llama3-top-level-original-wins": {**rope(**{**LLAMA3, "original_max_position_embeddings": 32}),
                                       "original_max_position_embeddings": 16},
    "llama3-original-float": rope("rope_parameters", **{**LLAMA3, "original_max_position_embeddings": 16.5}),
    # Both dicts: rope_scaling wins (convert_rope_params_to_dict), as does its missing theta over the other's.
    "rope_scaling-over-rope_parameters": {**LLAMA, "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                                       "rope_theta": 500.0},
                                          "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "linear-integer-factor": rope(rope_type="linear", factor=2),
    # The default type ignores a factor and a partial rotation.
    "default-ignores-factor-and-partial": {**rope(rope_type="default", factor=4.0), "partial_rotary_factor": 0.5},
    # Mistral and Qwen2 round hidden_size // heads down (Llama refuses it).
    "mistral-head-size-rounded-down": {**MISTRAL, "hidden_size": 76, "sliding_window": None},
    "qwen2-head-size-rounded-down": {**QWEN2, "hidden_size": 76},
}


@pytest.mark.parametrize("case", list(READ_AS_TRANSFORMERS))
def test_read_as_transformers_reads_it(case, tmp_path):
    config = READ_AS_TRANSFORMERS[case]
    architecture = ARCHITECTURE[config["model_type"]]
    (tmp_path / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    reference = getattr(transformers, architecture)(transformers.AutoConfig.from_pretrained(tmp_path))
    hf.perturb_(reference, 0, scale=0.02)
    reference.float().eval().save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": [architecture]}))  # not transformers'
    ids = np.random.default_rng(0).integers(1, 101, size=(2, 24)).astype(np.int64)
    with torch.no_grad():
        want = reference(input_ids=torch.from_numpy(ids)).logits.numpy()
    got = fusetrain.Model.from_pretrained(str(tmp_path)).forward(input_ids=ids)["logits"]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=case)
