"""QLoRA on the engine: a transformers model loaded 4-bit or 8-bit by bitsandbytes (BitsAndBytesConfig, as users load
one) and wrapped by PEFT trains on the engine, which reads bitsandbytes' packed weights as they are (no
re-quantisation); the CLI's --base-dtype nf4|int8 quantises a checkpoint itself, as bitsandbytes would.

Against PEFT + bitsandbytes on PyTorch, a small Llama (grouped-query attention): the engine mirrors bitsandbytes'
arithmetic (the dequantised weight rounded to the compute dtype; with bf16 compute x rounded to bf16 for the product,
which comes back rounded to bf16, and the input gradient a bf16 product), so what differs is the order of f32 sums.
With float32 compute that leaves ~1e-7: loss and every adapter gradient within 1e-5 relative. With bf16 compute the
loss still agrees within 1e-5, but each bf16-rounded product whose two f32 sums straddle a rounding boundary rounds
one bf16 step (2^-8 relative) apart; flowing back through the layers these flips leave adapter gradients ~1e-4
(last layer) to ~2e-3 (first layer) apart, so they are compared within 5e-3. The model's sizes are odd where bitsandbytes allows (vocabulary 211, grouped-query attention);
each weight row is a whole number of blocks (see model_dir)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import transformers

pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")

import cli_support  # noqa: E402
from cli_support import tiny_llama  # noqa: E402,F401  (a fixture)
import hf_models as hf  # noqa: E402

fusetrain = hf.fusetrain_module()
from fusetrain.trainer import engine_model, hf_parameter  # noqa: E402


@pytest.fixture(autouse=True)
def bitsandbytes_layout(monkeypatch):
    """On a CPU with AVX512-BF16, bitsandbytes' Linear4bit repacks its weight at the first forward into a layout of
    its own CPU kernel (absmax regrouped, 4-bit codes interleaved) and computes there; the reference here is the
    layout bitsandbytes saves and loads and every other device computes in, so that repacking is switched off."""
    import bitsandbytes.nn.modules as modules

    monkeypatch.setattr(modules, "has_avx512bf16", lambda: False)


SAVED_LAYOUT = "import bitsandbytes.nn.modules as m; m.has_avx512bf16 = lambda: False; "


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("llama-qlora")
    # Rows of whole blocks of 64 (128 and 192 wide): bitsandbytes' CPU kernel restarts its blocks at each row, where
    # its quantize_4bit (and the engine) count them over the flattened weight (test_quant.py), as every real model's
    # widths allow.
    config = transformers.LlamaConfig(vocab_size=211, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=192, max_position_embeddings=256)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    return out


def quantised(model_dir, quant_type="nf4", double=True, compute=torch.bfloat16, targets=("q_proj", "v_proj")):
    bnb_config = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                                 bnb_4bit_use_double_quant=double, bnb_4bit_compute_dtype=compute)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=bnb_config,
                                                              device_map="cpu", attn_implementation="eager")
    torch.manual_seed(1)  # PEFT draws lora_A from torch's generator
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=list(targets),
                                                       lora_dropout=0.0))
    for name, p in model.named_parameters():  # B starts at zero: give the adapters a gradient through B too
        if "lora_B" in name:
            p.data.normal_(0, 0.05)
    return model


@pytest.mark.parametrize("quant_type,double,compute", [
    ("nf4", True, torch.bfloat16), ("nf4", False, torch.float32), ("fp4", True, torch.float32),
    ("fp4", False, torch.bfloat16)], ids=["nf4-double-bf16", "nf4-f32", "fp4-double-f32", "fp4-bf16"])
def test_loss_and_every_adapter_gradient_match_peft_and_bitsandbytes(model_dir, quant_type, double, compute):
    model = quantised(model_dir, quant_type, double, compute, targets=("q_proj", "k_proj", "v_proj", "o_proj",
                                                                      "gate_proj", "up_proj", "down_proj"))
    ids = torch.randint(0, 211, (3, 24), generator=torch.Generator().manual_seed(2))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    engine = engine_model(model)
    lora = engine.lora
    assert lora["quant_type"] == quant_type and lora["quant_bf16"] == (compute == torch.bfloat16)
    assert len(lora["quantized"]) == 2 * 7  # every projection of both layers; the LM head stays full precision
    engine.train()
    loss, grads = engine.loss_and_grads(input_ids=ids.numpy(), labels=ids.numpy())
    assert abs(loss - out.loss.item()) <= 1e-5 * out.loss.item(), (loss, out.loss.item())
    assert len(grads) == 2 * 7 * 2
    tolerance = 5e-3 if compute == torch.bfloat16 else 1e-5
    for name, grad in grads.items():
        want = hf_parameter(model, name).grad.float().numpy()
        err = np.linalg.norm(grad - want) / np.linalg.norm(want)
        assert err < tolerance, (name, err)


def int8_model(model_dir, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, quantization_config=transformers.BitsAndBytesConfig(load_in_8bit=True), device_map="cpu",
        attn_implementation="eager")
    torch.manual_seed(1)
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=list(targets),
                                                       lora_dropout=0.0))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.05)
    return model


def test_an_int8_base_trains_on_the_engine_with_its_dequantised_weight(model_dir):
    """LLM.int8 (load_in_8bit): the engine reads bitsandbytes' int8 codes and row absmax (CB, SCB) and computes with
    the weight int8_vectorwise_dequant gives, in float32. The reference is PEFT on a float32 model holding exactly
    that dequantised weight: loss and adapter gradients within 1e-5 (the order of f32 sums). bitsandbytes' own int8
    forward also rounds the activations to int8 (float16 outlier columns past its threshold), so against it the loss
    is compared within 1e-3 and the gradients within 5e-2, the distance that rounding leaves (measured 5e-5 and
    1.8e-2 on this model)."""
    import bitsandbytes.functional as F

    from fusetrain.trainer import _int8_scales, _is_bnb

    model = int8_model(model_dir)
    ids = torch.randint(0, 211, (3, 24), generator=torch.Generator().manual_seed(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MatMul8bitLt's note that it casts float32 inputs to float16
        theirs = model(input_ids=ids, labels=ids)
    theirs.loss.backward()
    engine = engine_model(model)
    assert engine.lora["quant_type"] == "int8" and not engine.lora["quant_bf16"]
    assert len(engine.lora["quantized"]) == 2 * 7
    engine.train()
    loss, grads = engine.loss_and_grads(input_ids=ids.numpy(), labels=ids.numpy())

    reference = transformers.LlamaForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    state = reference.state_dict()
    for name, module in model.base_model.model.named_modules():
        if _is_bnb(module, "Linear8bitLt"):
            state[name.replace(".base_layer", "") + ".weight"] = F.int8_vectorwise_dequant(module.weight.data,
                                                                                          _int8_scales(module))
    reference.load_state_dict(state)
    reference = peft.get_peft_model(reference, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                               target_modules=list(model.peft_config["default"]
                                                                                   .target_modules)))
    reference.load_state_dict({k: v for k, v in model.state_dict().items() if "lora_" in k}, strict=False)
    want = reference(input_ids=ids, labels=ids)
    want.loss.backward()
    assert abs(loss - want.loss.item()) <= 1e-5 * want.loss.item(), (loss, want.loss.item())
    assert abs(loss - theirs.loss.item()) <= 1e-3 * theirs.loss.item(), (loss, theirs.loss.item())
    assert len(grads) == 2 * 7 * 2
    for name, grad in grads.items():
        exact = hf_parameter(reference, name).grad.numpy()
        assert np.linalg.norm(grad - exact) / np.linalg.norm(exact) < 1e-5, name
        bnb_grad = hf_parameter(model, name).grad.float().numpy()
        assert np.linalg.norm(grad - bnb_grad) / np.linalg.norm(bnb_grad) < 5e-2, name


def test_the_check_can_fail(model_dir):
    """The engine reads the weights' own codes: with one block's absmax doubled the loss differs."""
    model = quantised(model_dir)
    ids = torch.randint(0, 211, (2, 16), generator=torch.Generator().manual_seed(3))
    engine = engine_model(model)
    loss = engine.forward(input_ids=ids.numpy(), labels=ids.numpy())["loss"]
    name = engine.lora["quantized"][0] + ".absmax"
    state = engine.state_dict()
    absmax = state[name].copy()
    absmax[:8] *= 4
    engine.load_state_dict({name: absmax}, strict=False)
    assert abs(engine.forward(input_ids=ids.numpy(), labels=ids.numpy())["loss"] - loss) > 1e-4


def test_trainer_trains_a_quantised_model(model_dir, tmp_path):
    """fusetrain.Trainer on a bitsandbytes-loaded PEFT model: the steps run on the engine (no fallback), the first
    step's loss is PEFT + bitsandbytes' loss on the batch it trained on (1e-5, as above), the loss falls, and the
    adapters written back and saved load onto the quantised base with PEFT and give the engine's loss there."""
    import datasets

    rng = np.random.default_rng(0)
    data = datasets.Dataset.from_dict({"input_ids": [rng.integers(0, 211, size=int(n)).tolist()
                                                     for n in rng.integers(8, 40, size=8)]})  # 8 to memorise
    batches = []

    def collate(rows):
        length = max(len(r["input_ids"]) for r in rows)
        ids = torch.tensor([r["input_ids"] + [0] * (length - len(r["input_ids"])) for r in rows])
        mask = torch.tensor([[1] * len(r["input_ids"]) + [0] * (length - len(r["input_ids"])) for r in rows])
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
        return batches[-1]

    model = quantised(model_dir)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=12, learning_rate=5e-3,
                                          per_device_train_batch_size=4, logging_steps=1, report_to="none",
                                          use_cpu=True, save_strategy="no", seed=0)
    trainer = fusetrain.Trainer(model=model, args=args, train_dataset=data, data_collator=collate)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="fusetrain: training runs with")
        trainer.train()
    assert trainer._engine_model is not None
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 12 and np.mean(losses[-4:]) < np.mean(losses[:4]) - 0.1, losses
    with torch.no_grad():
        fresh = quantised(model_dir)
        first = [fresh(**b).loss.item() for b in batches[:4]]
    assert abs(losses[0] - first[0]) <= 1e-5 * first[0], (losses[0], first)
    model.save_pretrained(tmp_path / "adapter")
    base = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, device_map="cpu", attn_implementation="eager",
        quantization_config=transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                            bnb_4bit_use_double_quant=True,
                                                            bnb_4bit_compute_dtype=torch.bfloat16))
    reloaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    batch = {k: v.numpy() for k, v in batches[-1].items()}
    with torch.no_grad():
        theirs = reloaded(**batches[-1]).loss.item()
    ours = trainer._engine_model.forward(**batch)["loss"]
    assert abs(ours - theirs) <= 1e-5 * theirs, (ours, theirs)


def test_unsupported_quantised_bases_are_refused_by_name(model_dir):
    model = quantised(model_dir, compute=torch.float16)
    with pytest.raises(TypeError, match="a 4-bit base computing in float16"):
        engine_model(model)
    engine = engine_model(quantised(model_dir))
    with pytest.raises(ValueError, match="merge_lora: the base weights are quantised"):
        engine.merge_lora()


REPO = cli_support.ROOT
SHAKESPEARE = cli_support.SHAKESPEARE


@pytest.mark.parametrize("quant", ["nf4", "int8"])
def test_cli_quantises_the_base_as_bitsandbytes_does(tiny_llama, tmp_path, quant):
    """`fusetrain train --base-dtype nf4|int8` quantises every projection of the checkpoint as it maps it in, with
    bitsandbytes' codes (bit for bit: test_quant.py), trains the adapters with gradient checkpointing on, and the
    adapters it saves give, under PEFT on the base bitsandbytes quantises itself (BitsAndBytesConfig), the eval loss
    the engine reported: within 1e-5 for NF4 computed in float32 (the order of f32 sums; measured 6.5e-6 through the
    mean over 68 blocks), 5e-5 for int8, whose bitsandbytes forward also rounds activations to int8 (measured
    7e-6)."""
    lines = SHAKESPEARE.read_text().splitlines()
    (tmp_path / "train.txt").write_text("\n".join(lines[:1500]) + "\n")
    (tmp_path / "eval.txt").write_text("\n".join(lines[1500:1800]) + "\n")
    binary = cli_support.BUILD / "fusetrain"
    out = tmp_path / "out"
    common = ["--model", str(tiny_llama), "--task", "clm", "--train-file", str(tmp_path / "train.txt"),
              "--max-seq-length", "64", "--lora-r", "8", "--lora-alpha", "16", "--base-dtype", quant]
    run = subprocess.run([str(binary), "train", *common, "--eval-file", str(tmp_path / "eval.txt"),
                          "--per-device-train-batch-size", "8", "--learning-rate", "5e-3", "--max-steps", "12",
                          "--logging-steps", "4", "--output-dir", str(out), "--save-strategy", "no"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert f"{quant} base: 14 projections quantised" in run.stderr, run.stderr
    losses = [json.loads(line)["loss"] for line in run.stderr.splitlines() if line.startswith('{"') and '"loss"' in line]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    ours = json.loads(run.stdout[run.stdout.rindex("{"):run.stdout.rindex("}") + 1])["eval_loss"]
    # The script runs with bitsandbytes' layout as the fixture above sets it (its AVX512-BF16 repacking also fails on
    # this model's 96-wide projections: "shape '[64, 1]' is invalid for input of size 96").
    script = REPO / "examples" / "peft_eval.py"
    by_peft = subprocess.run([sys.executable, "-c", SAVED_LAYOUT + f"import runpy; runpy.run_path({str(script)!r}, "
                              "run_name='__main__')", "--model", str(tiny_llama), "--adapter", str(out), "--eval-file",
                              str(tmp_path / "eval.txt"), "--block-size", "64", "--quantize", quant],
                             capture_output=True, text=True)
    assert by_peft.returncode == 0, by_peft.stderr
    theirs = json.loads(by_peft.stdout.strip().splitlines()[-1])["eval_loss"]
    hf.assert_loss_matches(ours, theirs, f"eval loss under PEFT on bitsandbytes' {quant} base",
                           rtol=1e-5 if quant == "nf4" else 5e-5)
    refused = subprocess.run([str(binary), "train", *common, "--output-dir", str(tmp_path / "merged"),
                              "--merge-lora"], capture_output=True, text=True)
    assert refused.returncode != 0 and "--merge-lora: the base is quantised" in refused.stderr, refused.stderr
    inspected = subprocess.run([str(binary), "inspect", "--model", str(tiny_llama), "--task", "clm",
                                "--max-seq-length", "32", "--lora-r", "8", "--base-dtype", quant],
                               capture_output=True, text=True)
    assert inspected.returncode == 0, inspected.stderr
    assert "pass recompute: 2 layers" in inspected.stdout, inspected.stdout  # checkpointing on for a quantised base
