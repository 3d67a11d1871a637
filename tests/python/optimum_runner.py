"""Runs an exported directory in Hugging Face Optimum's ONNX Runtime models (in .venv-optimum, whose transformers is
the 4.x that optimum-onnx supports). Called by test_onnx_optimum.py:

  python optimum_runner.py DIR ORT_CLASS inputs.npz outputs.npz   # the model on arrays; its outputs saved
  python optimum_runner.py DIR ORT_CLASS --pipeline TASK JSON     # a transformers pipeline on it; results as JSON
"""

import json
import sys

import numpy as np
import optimum.onnxruntime
import torch
import transformers


def main() -> None:
    directory, class_name = sys.argv[1], sys.argv[2]
    # The export has no past_key_values inputs: a causal LM runs without a cache.
    options = {"use_cache": False} if class_name == "ORTModelForCausalLM" else {}
    model = getattr(optimum.onnxruntime, class_name).from_pretrained(directory, **options)
    if sys.argv[3] == "--pipeline":
        task, inputs = sys.argv[4], json.loads(sys.argv[5])
        pipe = transformers.pipeline(task, model=model, tokenizer=transformers.AutoTokenizer.from_pretrained(directory))
        results = pipe(**inputs) if isinstance(inputs, dict) else pipe(inputs)
        print(json.dumps(results, default=lambda x: x.tolist() if hasattr(x, "tolist") else float(x)))
        return
    arrays = dict(np.load(sys.argv[3]))
    with torch.no_grad():
        out = model(**{k: torch.from_numpy(v) for k, v in arrays.items()})
    saved = {k: getattr(out, k).numpy() for k in ("logits", "start_logits", "end_logits", "last_hidden_state")
             if getattr(out, k, None) is not None}
    np.savez(sys.argv[4], **saved)


if __name__ == "__main__":
    main()
