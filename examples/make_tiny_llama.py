"""Writes a small Llama-shaped model directory from a config: config.json, fresh weights (model.safetensors, drawn as
transformers initialises LlamaForCausalLM) and a Llama-2-style tokenizer.json (BPE with byte fallback, "▁" for
spaces, <s> prepended) trained by the `tokenizers` library on a text file. Nothing is downloaded.

    python examples/make_tiny_llama.py --text ../shared/datasets/tinyshakespeare/input.txt --output /tmp/tiny-llama
"""

from __future__ import annotations

import argparse
import json
import pathlib

from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers


def llama2_tokenizer(text_files: pathlib.Path | list[pathlib.Path], vocab_size: int) -> Tokenizer:
    """A tokenizer built as Llama 2's tokenizer.json is: Prepend("▁") + Replace(" ", "▁") normalizers, BPE with byte
    fallback (<0x00>..<0xFF> in the vocabulary), <s> added in front, decoded by Replace, ByteFallback, Fuse, Strip."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials + byte_tokens, show_progress=False)
    files = text_files if isinstance(text_files, list) else [text_files]
    tok.train([str(f) for f in files], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok


def main() -> None:
    import fusetrain

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text", required=True, type=pathlib.Path, nargs="+", help="text to train the tokenizer on")
    parser.add_argument("--output", required=True, type=pathlib.Path)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--intermediate-size", type=int, default=688)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    args.output.mkdir(parents=True, exist_ok=True)
    tok = llama2_tokenizer(args.text, args.vocab_size)
    tok.save(str(args.output / "tokenizer.json"))
    (args.output / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "pad_token": "</s>", "add_bos_token": True, "add_eos_token": False, "model_max_length": 4096}, indent=2) + "\n")
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": tok.get_vocab_size(),
        "hidden_size": args.hidden_size, "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads, "intermediate_size": args.intermediate_size, "hidden_act": "silu",
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "initializer_range": 0.02,
        "tie_word_embeddings": False, "bos_token_id": tok.token_to_id("<s>"), "eos_token_id": tok.token_to_id("</s>"),
        "pad_token_id": tok.token_to_id("</s>"), "attention_bias": False, "mlp_bias": False,
    }
    model = fusetrain.Model.from_config(config, seed=args.seed)
    model.save_pretrained(args.output)
    print(f"wrote {args.output}: LlamaForCausalLM, {model.num_parameters:,} parameters, "
          f"vocabulary {tok.get_vocab_size()}")


if __name__ == "__main__":
    main()
