"""LoRA against PEFT: a PEFT model (peft.get_peft_model) handed to fusetrain gives the same loss, logits and adapter
gradients; the frozen base gets no gradient and no optimizer state; adapters trained by fusetrain save in PEFT's
format, load with peft.PeftModel.from_pretrained and merge as merge_and_unload does; fusetrain.Trainer trains a PEFT
model as transformers' Trainer does; the CLI's --lora-r run writes adapters that PEFT evaluates to the same loss.

Tolerances are the parity tests' (hf_models): logits 1e-4, loss 1e-5, every gradient 1e-4 norm-wise; the adapters'
sums run in another order than torch's (measured ~1e-7). bf16 base weights: see test_bf16_base_weights."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers

import cli_support
from cli_support import tiny_llama  # noqa: F401  (a fixture)
import hf_models as hf

peft = pytest.importorskip("peft")
fusetrain = hf.fusetrain_module()
from fusetrain.trainer import engine_model  # noqa: E402

REPO = cli_support.ROOT
SHAKESPEARE = cli_support.SHAKESPEARE
LLAMA = dict(vocab_size=101, hidden_size=72, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
             intermediate_size=100, max_position_embeddings=64, pad_token_id=0)
GPT2 = dict(vocab_size=101, n_embd=48, n_layer=2, n_head=4, n_positions=64, pad_token_id=0)
BERT = dict(vocab_size=101, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=80,
            max_position_embeddings=64, pad_token_id=0)
# case: (transformers class, config, LoraConfig arguments)
CASES = {
    "llama-q-v-down": ("LlamaForCausalLM", transformers.LlamaConfig(**LLAMA),
                       dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])),
    "llama-all-linear-rslora": ("LlamaForCausalLM", transformers.LlamaConfig(**LLAMA, tie_word_embeddings=True),
                                dict(r=3, lora_alpha=5, target_modules="all-linear", use_rslora=True)),
    "qwen2-biases": ("Qwen2ForCausalLM", transformers.Qwen2Config(**LLAMA),
                     dict(r=4, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])),
    "llama-seq-cls": ("LlamaForSequenceClassification", transformers.LlamaConfig(**LLAMA, num_labels=3),
                      dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="SEQ_CLS")),
    "gpt2-conv1d": ("GPT2LMHeadModel", transformers.GPT2Config(**GPT2),
                    dict(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True)),
    "bert-seq-cls": ("BertForSequenceClassification", transformers.BertConfig(**BERT, num_labels=2),
                     dict(r=4, lora_alpha=8, target_modules=["query", "value"], task_type="SEQ_CLS")),
}
B, T = 3, 12


def peft_model(case: str, seed: int = 0, base_dir: pathlib.Path | None = None):
    """A PEFT model of the case, its lora_B drawn non-zero (PEFT starts it at zero, which would leave lora_A's
    gradient zero and the check blind); the base model is first saved to `base_dir` when given."""
    architecture, config, lora = CASES[case]
    torch.manual_seed(seed)
    base = getattr(transformers, architecture)(config)
    hf.perturb_(base, seed, scale=0.02)
    base.config._attn_implementation = "eager"
    if base_dir is not None:
        base.save_pretrained(base_dir)
    model = peft.get_peft_model(base, peft.LoraConfig(lora_dropout=0.0, **lora))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model.eval()  # no dropout: the engine's forward and loss_and_grads run without it


def batch(architecture: str, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, 101, size=(B, T)).astype(np.int64)
    mask = np.ones((B, T), dtype=np.int64)
    ids[1, 9:] = 0
    mask[1, 9:] = 0
    if "SequenceClassification" in architecture:
        labels = rng.integers(0, 3 if "Llama" in architecture else 2, size=B).astype(np.int64)
    else:
        labels = np.where(mask == 1, ids, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def peft_trainable_grads(model) -> dict[str, np.ndarray]:
    """PEFT's trainable parameters' gradients under the engine's names."""
    out = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        engine = name.replace("base_model.model.", "", 1).replace(".default", "").replace(".modules_to_save", "")
        out[engine] = p.grad.numpy() if p.grad is not None else None
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_adapter_gradients_match_peft(case):
    model = peft_model(case)
    architecture = CASES[case][0]
    data = batch(architecture)
    out = model(**{k: torch.from_numpy(v) for k, v in data.items()})
    out.loss.backward()
    want = peft_trainable_grads(model)
    engine = engine_model(model)
    assert engine.lora is not None
    assert sorted(engine.trainable_names()) == sorted(want), "the trainable parameters differ from PEFT's"
    loss, grads = engine.loss_and_grads(**data)
    hf.assert_loss_matches(loss, out.loss.item(), case)
    assert set(grads) == set(want), "gradients for parameters PEFT freezes"
    errors = hf.grad_errors(grads, want)
    assert not errors, f"{case}: " + "\n  ".join(errors)
    logits = engine.forward(input_ids=data["input_ids"], attention_mask=data["attention_mask"])["logits"]
    keep = data["attention_mask"].astype(bool) if logits.ndim == 3 else slice(None)
    np.testing.assert_allclose(logits[keep], out.logits.detach().numpy()[keep], rtol=1e-4, atol=1e-5)


def test_frozen_base_has_no_gradient_and_no_optimizer_state():
    model = engine_model(peft_model("llama-q-v-down"))
    adapters = [n for n in model.state_dict_names() if ".lora_" in n]
    assert sorted(model.trainable_names()) == sorted(adapters)
    assert model.num_parameters == sum(model.state_dict()[n].size for n in adapters)
    _, grads = model.loss_and_grads(**batch("LlamaForCausalLM"))
    assert sorted(grads) == sorted(adapters)  # the frozen base has no gradient buffer to report
    before = model.state_dict()
    opt = fusetrain.AdamW(model, lr=1e-2, weight_decay=0.0)
    for seed in range(3):
        model.loss_and_grads(**batch("LlamaForCausalLM", seed))
        opt.step()
    after = model.state_dict()
    moved = [n for n in before if not np.array_equal(before[n], after[n])]
    assert sorted(moved) == sorted(adapters), f"the optimizer changed frozen weights: {sorted(set(moved) - set(adapters))}"


def test_bf16_base_weights():
    """Frozen projection weights kept in bf16 are the f32 weights rounded to 8 significant bits (relative error
    ≤ 2⁻⁹ each), so loss and gradients move by about that much: 1e-2 relative bounds it with margin."""
    peft_m = peft_model("llama-q-v-down")
    data = batch("LlamaForCausalLM")
    f32 = engine_model(peft_m)
    settings = f32.lora
    bf16 = fusetrain.Model.from_config({**peft_m.get_base_model().config.to_dict(),
                                        "architectures": ["LlamaForCausalLM"]})
    bf16.load_state_dict({k: v for k, v in f32.state_dict().items() if ".lora_" not in k}, strict=False)
    bf16.enable_lora(**{k: v for k, v in settings.items() if k != "base_dtype"}, base_dtype="bfloat16")
    bf16.load_state_dict({k: v for k, v in f32.state_dict().items() if ".lora_" in k}, strict=False)
    w = "model.layers.0.self_attn.q_proj.weight"
    rounded = torch.from_numpy(f32.state_dict()[w]).bfloat16().float().numpy()
    np.testing.assert_array_equal(bf16.state_dict()[w], rounded)  # stored as bf16, read back exactly
    loss32, grads32 = f32.loss_and_grads(**data)
    loss16, grads16 = bf16.loss_and_grads(**data)
    assert abs(loss16 - loss32) <= 1e-2 * abs(loss32)
    errors = hf.grad_errors(grads16, grads32, rtol=1e-2)
    assert not errors, "\n  ".join(errors)


def test_a_peft_model_on_a_bf16_base_keeps_its_base_in_bf16():
    """A PEFT model whose base was loaded in bf16 (transformers' dtype=torch.bfloat16, the usual way to halve a
    LoRA run's memory) keeps its frozen projections in bf16 in the engine too. The weights are the same bf16
    values either way, so loss and adapter gradients equal those of the same PEFT model on an f32 base holding
    those values; the 1e-5 relative bound allows only for the bf16 and f32 GEMMs summing in another order."""
    peft_m = peft_model("llama-q-v-down")
    data = batch("LlamaForCausalLM")
    with torch.no_grad():
        for p in peft_m.parameters():  # the f32 reference holds the values a bf16 base can hold
            if not p.requires_grad:
                p.copy_(p.bfloat16().float())
    f32 = engine_model(peft_m)
    assert f32.lora["base_dtype"] == "float32"
    for p in peft_m.parameters():
        if not p.requires_grad:
            p.data = p.data.bfloat16()
    bf16 = engine_model(peft_m)
    assert bf16.lora["base_dtype"] == "bfloat16"
    w = "model.layers.0.self_attn.q_proj.weight"
    np.testing.assert_array_equal(bf16.state_dict()[w], f32.state_dict()[w])
    loss32, grads32 = f32.loss_and_grads(**data)
    loss16, grads16 = bf16.loss_and_grads(**data)
    assert abs(loss16 - loss32) <= 1e-5 * abs(loss32)
    errors = hf.grad_errors(grads16, grads32, rtol=1e-5)
    assert not errors, "\n  ".join(errors)


def test_adapters_round_trip_through_peft_and_merge(tmp_path):
    base_dir = tmp_path / "base"
    peft_m = peft_model("llama-q-v-down", base_dir=base_dir)
    data = batch("LlamaForCausalLM")
    engine = engine_model(peft_m)
    opt = fusetrain.AdamW(engine, lr=1e-2, weight_decay=0.0)
    for seed in range(3):  # adapters of fusetrain's own training, not the ones PEFT drew
        engine.loss_and_grads(**batch("LlamaForCausalLM", seed))
        opt.step()
    engine.save_pretrained(tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["peft_type"] == "LORA" and saved["r"] == 4 and saved["task_type"] == "CAUSAL_LM"
    fresh_base = transformers.LlamaForCausalLM.from_pretrained(base_dir, attn_implementation="eager")
    loaded = peft.PeftModel.from_pretrained(fresh_base, tmp_path / "adapter").eval()
    torch_data = {k: torch.from_numpy(v) for k, v in data.items()}
    with torch.no_grad():
        want = loaded(**torch_data)
    got_loss = engine.forward(**data)["loss"]
    hf.assert_loss_matches(got_loss, want.loss.item(), "PEFT-loaded adapters")
    # fusetrain reads the adapter directory back too.
    reread = fusetrain.Model.from_pretrained(base_dir)
    reread.load_adapter(tmp_path / "adapter")
    hf.assert_loss_matches(reread.forward(**data)["loss"], want.loss.item(), "load_adapter")
    # Merged: the same function as PEFT's merge_and_unload, as a plain model.
    engine.merge_lora()
    assert engine.lora is None and "model.layers.0.self_attn.q_proj.weight" in engine.trainable_names()
    merged = loaded.merge_and_unload()
    with torch.no_grad():
        want_logits = merged(input_ids=torch_data["input_ids"]).logits.numpy()
    np.testing.assert_allclose(engine.forward(input_ids=data["input_ids"])["logits"], want_logits, rtol=1e-4,
                               atol=1e-5)


def test_lora_errors_name_the_problem(tmp_path):
    model = fusetrain.Model.from_config({**LLAMA, "model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ValueError, match="target modules not found in the model: nope"):
        model.enable_lora(r=4, target_modules=["q_proj", "nope"])
    with pytest.raises(ValueError, match="\"model.embed_tokens\" is not a linear layer"):
        model.enable_lora(r=4, target_modules=["embed_tokens"])
    with pytest.raises(ValueError, match="r must be a positive integer"):
        model.enable_lora(r=0, target_modules=["q_proj"])
    assert model.lora is None  # a refused call leaves the model as it was
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                              "target_modules": ["q_proj"], "use_dora": True}))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="\"use_dora\" is true; fusetrain does not implement DoRA"):
        model.load_adapter(tmp_path)
    with pytest.raises(ValueError, match="has no LoRA adapters"):
        model.merge_lora()


def test_trainer_trains_a_peft_model_as_transformers_does(tmp_path):
    """fusetrain.Trainer given get_peft_model's output: the engine trains the adapters (it does not fall back), the
    losses track transformers' Trainer on the same model, and the base weights stay as they were."""
    # One batch of 8 equal-length rows per step, so the samplers' orders cannot make the steps differ.
    data = [dict(input_ids=row, labels=row) for row in np.random.default_rng(0).integers(1, 101, size=(8, 16))]
    common = dict(per_device_train_batch_size=8, learning_rate=5e-3, max_steps=8, logging_steps=1, report_to=[],
                  save_strategy="no", use_cpu=True, seed=0, lr_scheduler_type="constant", weight_decay=0.0)
    histories = {}
    for which, trainer_cls, args_cls in (("fusetrain", fusetrain.Trainer, fusetrain.TrainingArguments),
                                         ("transformers", transformers.Trainer, transformers.TrainingArguments)):
        model = peft_model("llama-q-v-down")
        base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
        extra = {"fusetrain_require_engine": True} if which == "fusetrain" else {}
        trainer = trainer_cls(model=model, args=args_cls(output_dir=str(tmp_path / which), **common, **extra),
                              train_dataset=data)
        trainer.train()
        histories[which] = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        for n, p in model.named_parameters():
            if not p.requires_grad:
                assert torch.equal(p, base_before[n]), f"{which} changed the frozen {n}"
    ours, theirs = np.array(histories["fusetrain"]), np.array(histories["transformers"])
    assert len(ours) == len(theirs) == 8
    # transformers logs each loss rounded to 4 significant digits; 1e-3 relative is that rounding plus f32 noise.
    np.testing.assert_allclose(ours, theirs, rtol=1e-3)
    assert ours[-1] < ours[0]


def test_cli_lora_run_writes_adapters_peft_evaluates_alike(tiny_llama, tmp_path):
    lines = SHAKESPEARE.read_text().splitlines()
    (tmp_path / "train.txt").write_text("\n".join(lines[:1500]) + "\n")
    (tmp_path / "eval.txt").write_text("\n".join(lines[1500:1800]) + "\n")
    binary = cli_support.BUILD / "fusetrain"
    out = tmp_path / "out"
    run = subprocess.run([str(binary), "train", "--model", str(tiny_llama), "--task", "clm", "--train-file",
                          str(tmp_path / "train.txt"), "--eval-file", str(tmp_path / "eval.txt"), "--max-seq-length",
                          "64", "--lora-r", "8", "--lora-alpha", "16", "--lora-target-modules", "q_proj,k_proj,v_proj,o_proj",
                          "--per-device-train-batch-size", "8", "--learning-rate", "5e-3", "--max-steps", "12",
                          "--logging-steps", "4", "--output-dir", str(out), "--save-strategy", "no",
                          "--merge-lora"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "LoRA r=8 alpha=16 on 8 modules" in run.stderr
    losses = [json.loads(line)["loss"] for line in run.stderr.splitlines() if line.startswith('{"') and '"loss"' in line]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    assert (out / "adapter_config.json").exists() and (out / "adapter_model.safetensors").exists()
    assert (out / "merged" / "model.safetensors").exists()
    evaluated = subprocess.run([str(binary), "evaluate", "--model", str(tiny_llama), "--adapter", str(out), "--task",
                                "clm", "--eval-file", str(tmp_path / "eval.txt"), "--max-seq-length", "64"],
                               capture_output=True, text=True)
    assert evaluated.returncode == 0, evaluated.stderr
    ours = json.loads(evaluated.stdout[evaluated.stdout.index("{"):])["eval_loss"]
    by_peft = subprocess.run([sys.executable, str(REPO / "examples" / "peft_eval.py"), "--model", str(tiny_llama),
                              "--adapter", str(out), "--eval-file", str(tmp_path / "eval.txt"), "--block-size", "64"],
                             capture_output=True, text=True)
    assert by_peft.returncode == 0, by_peft.stderr
    theirs = json.loads(by_peft.stdout.strip().splitlines()[-1])["eval_loss"]
    hf.assert_loss_matches(ours, theirs, "eval loss of the CLI's adapters under PEFT")
    merged = subprocess.run([str(binary), "evaluate", "--model", str(out / "merged"), "--task", "clm", "--eval-file",
                             str(tmp_path / "eval.txt"), "--max-seq-length", "64"], capture_output=True, text=True)
    assert merged.returncode == 0, merged.stderr
    hf.assert_loss_matches(json.loads(merged.stdout[merged.stdout.index("{"):])["eval_loss"], theirs, "merged model")


def test_cli_inspect_shows_the_lora_plan(tiny_llama):
    """`fusetrain inspect` with the LoRA flags plans what train would run: adapters alone train (r=8 on q, k, v, o
    of 2 layers of hidden 64 with 2 key/value heads of 16: 2 × (8·64 + 64·8 + 2 · (8·64 + 32·8) + 8·64 + 64·8) =
    7,168 parameters), the base is frozen (no gradient, no optimizer state) and --base-dtype bf16 halves what it
    keeps of the projections."""
    def inspect(*flags):
        result = subprocess.run([str(cli_support.BUILD / "fusetrain"), "inspect", "--model", str(tiny_llama),
                                 "--task", "clm", "--max-seq-length", "32", *flags], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        return result.stdout

    def mib(output, row):
        line = next((l for l in output.splitlines() if l.startswith(row)), None)
        if line is None:
            return None
        value, unit = line[len(row):].split()[:2]
        return float(value) * {"MiB": 1.0, "KiB": 1 / 1024}[unit]

    lora = ["--lora-r", "8", "--lora-alpha", "16", "--lora-target-modules", "q_proj,k_proj,v_proj,o_proj"]
    full, adapted, adapted_bf16 = inspect(), inspect(*lora), inspect(*lora, "--base-dtype", "bf16")
    assert mib(full, "frozen weights") is None
    assert ": 7168 trainable," in adapted.splitlines()[0], adapted.splitlines()[0]
    assert mib(adapted, "parameters") < mib(full, "parameters") / 10
    for out in (adapted, adapted_bf16):
        assert mib(out, "gradients") == mib(out, "parameters")
        assert mib(out, "optimizer state") == pytest.approx(2 * mib(out, "parameters"), abs=1e-4)
    # Every base weight is frozen, so frozen + trainable is the full model plus the adapters' 7,168 f32 values
    # (each buffer is padded to 64 bytes: a few KiB at most, under the 0.5% allowed).
    assert mib(adapted, "frozen weights") + mib(adapted, "parameters") == pytest.approx(
        mib(full, "parameters") + 7168 * 4 / 2**20, rel=5e-3)
    assert mib(adapted_bf16, "frozen weights") < mib(adapted, "frozen weights")
    refused = subprocess.run([str(cli_support.BUILD / "fusetrain"), "inspect", "--model", str(tiny_llama), "--task",
                              "clm", *lora, "--merge-lora"], capture_output=True, text=True)
    assert refused.returncode != 0 and "--merge-lora applies to train" in refused.stderr, refused.stderr


def test_cli_prompt_response_jsonl_labels_only_the_response(tiny_llama, tmp_path):
    """A clm .jsonl with "prompt" and "response": the loss is the response's and its </s>'s alone, as a
    transformers model computes it with the prompt's labels set to -100 (one example per batch, so the mean of the
    per-example losses is the eval loss)."""
    rows = [{"prompt": "Question: who speaks first?\nAnswer:", "response": " First Citizen."},
            {"prompt": "Say it in Shakespeare's words:", "response": " What light through yonder window breaks?"},
            {"prompt": "One word:", "response": " Verily"}]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = subprocess.run([str(cli_support.BUILD / "fusetrain"), "evaluate", "--model", str(tiny_llama), "--task", "clm",
                          "--eval-file", str(data), "--max-seq-length", "64", "--per-device-eval-batch-size", "1"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    ours = json.loads(run.stdout[run.stdout.index("{"):])["eval_loss"]
    # The ids oracle is the tokenizers library on tokenizer.json (transformers 5's LlamaTokenizer rebuilds the
    # pre-tokenizer and treats a leading space of its own way).
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_llama / "tokenizer.json"))
    eos = tokenizer.token_to_id("</s>")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, attn_implementation="eager").eval()
    losses = []
    for r in rows:
        prompt = tokenizer.encode(r["prompt"]).ids
        response = tokenizer.encode(r["response"], add_special_tokens=False).ids + [eos]
        ids = torch.tensor([prompt + response])
        labels = torch.tensor([[-100] * len(prompt) + response])
        with torch.no_grad():
            losses.append(model(input_ids=ids, labels=labels).loss.item())
    hf.assert_loss_matches(ours, float(np.mean(losses)), "prompt/response eval loss")
    # A prompt that leaves no room for its response is refused, naming the row.
    data.write_text(json.dumps({"prompt": "word " * 80, "response": "x"}) + "\n")
    run = subprocess.run([str(cli_support.BUILD / "fusetrain"), "evaluate", "--model", str(tiny_llama), "--task", "clm",
                          "--eval-file", str(data), "--max-seq-length", "16"], capture_output=True, text=True)
    assert run.returncode != 0 and "leaves no room for the response" in run.stderr


@pytest.mark.parametrize("row, expected", [
    ({"prompt": [{"role": "user", "content": "Who speaks first?"}], "response": " First Citizen."},
     'pairs.jsonl:2: "prompt" is a list of chat messages; expected a string. Format the conversation into text first '
     "(the tokenizer's chat template"),
    ({"prompt": "One word:", "response": None},
     'pairs.jsonl:2: "response" is null; expected a string (text is never made from null: an absent text is refused, '
     'not read as empty)'),
    ({"prompt": 42, "response": " Verily"}, 'pairs.jsonl:2: "prompt" is a number; expected a string'),
    ({"prompt": "One word:", "response": {"text": " Verily"}}, 'pairs.jsonl:2: "response" is a JSON object; expected'),
], ids=["chat-messages", "null-response", "number", "object"])
def test_cli_prompt_response_values_must_be_strings(tiny_llama, tmp_path, row, expected):
    """A list of chat messages was trained as its JSON text and a null response as an empty one: both are refused
    naming the line, before any training."""
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"prompt": "Say it:", "response": " Verily"}) + "\n" + json.dumps(row) + "\n")
    run = subprocess.run([str(cli_support.BUILD / "fusetrain"), "train", "--model", str(tiny_llama), "--task", "clm",
                          "--train-file", str(data), "--max-seq-length", "64", "--max-steps", "1",
                          "--output-dir", str(tmp_path / "out")], capture_output=True, text=True)
    lines = [line for line in run.stderr.splitlines() if line.startswith("fusetrain: error:")]
    assert run.returncode == 1 and len(lines) == 1, run.stderr
    assert expected in lines[0], lines[0]
    assert not (tmp_path / "out" / "adapter_model.safetensors").exists()
    assert not (tmp_path / "out" / "model.safetensors").exists()
