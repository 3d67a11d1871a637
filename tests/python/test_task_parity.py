"""fusetrain's token-classification and question-answering features against the preprocessing of transformers'
run_ner.py (tokenize_and_align_labels) and run_qa.py (prepare_train_features), feature by feature: input ids, token
type ids, aligned tag labels, answer start/end positions and the example each window came from.

Data is made from SST-2 dev sentences: token classification tags each word by a rule (capitalised, a number,
punctuation, other, with B-/I- pairs); question answering takes runs of sentences as contexts, a span of words in
them as the answer and other words as the question, with contexts long enough to need several windows.
Tokenizers: all-MiniLM-L6-v2's BERT WordPiece and a RoBERTa-style byte-level BPE (prefix space, trimmed offsets).
fusetrain's side is the `fusetrain_features` program in $FUSETRAIN_BUILD_DIR (default build/).
"""

import json
import os
import pathlib
import random
import subprocess

import pytest

transformers = pytest.importorskip("transformers")

from test_tokenizer_parity import (  # noqa: E402
    BUILD_DIR, SST2_DEV, minilm_tokenizer_json, missing, sst2_sentences, train_roberta_style)

BINARY = BUILD_DIR / "fusetrain_features"


@pytest.fixture(scope="module")
def binary():
    if not BINARY.exists():
        missing(f"{BINARY} is not built (build the fusetrain_features target, or set FUSETRAIN_BUILD_DIR)")
    return BINARY


@pytest.fixture(scope="module")
def sentences():
    if not SST2_DEV.exists():
        missing(f"SST-2 not found at {SST2_DEV} (set FUSETRAIN_DATASETS)")
    return sst2_sentences()


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
    """Model directories holding only a tokenizer.json, for fusetrain, and the matching transformers tokenizers."""
    root = tmp_path_factory.mktemp("task_tokenizers")
    bert = root / "bert"
    bert.mkdir()
    (bert / "tokenizer.json").write_bytes(minilm_tokenizer_json().read_bytes())
    roberta = root / "roberta"
    roberta.mkdir()
    train_roberta_style(roberta / "tokenizer.json")
    from transformers import PreTrainedTokenizerFast
    hf_bert = PreTrainedTokenizerFast(tokenizer_file=str(bert / "tokenizer.json"), unk_token="[UNK]",
                                      sep_token="[SEP]", pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]")
    hf_roberta = PreTrainedTokenizerFast(tokenizer_file=str(roberta / "tokenizer.json"), bos_token="<s>",
                                         eos_token="</s>", sep_token="</s>", cls_token="<s>", unk_token="<unk>",
                                         pad_token="<pad>", mask_token="<mask>")
    return {"bert": (bert, hf_bert), "roberta": (roberta, hf_roberta)}


def features(binary, task, model_dir, rows, tmp_path, *options):
    data = tmp_path / f"{task}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    result = subprocess.run([str(binary), task, str(model_dir), str(data), *options], capture_output=True, check=False)
    assert result.returncode == 0, result.stderr.decode()
    return [json.loads(line) for line in result.stdout.decode("utf-8").splitlines()]


def tag_of(word, previous):
    kind = "NUM" if any(c.isdigit() for c in word) else "CAP" if word[:1].isupper() else \
        "PUNCT" if not any(c.isalnum() for c in word) else None
    if kind is None:
        return "O"
    return ("I-" if previous is not None and previous.endswith(kind) else "B-") + kind


def ner_rows(sentences):
    rows = []
    for sentence in sentences:
        words, tags = sentence.split(), []
        for word in words:
            tags.append(tag_of(word, tags[-1] if tags else None))
        if words:
            rows.append({"tokens": words, "ner_tags": tags})
    return rows


def run_ner_features(tokenizer, rows, max_length, label_all_tokens):
    """run_ner.py's tokenize_and_align_labels with its sorted label list and b_to_i_label."""
    labels = sorted({tag for row in rows for tag in row["ner_tags"]})
    label_to_id = {label: i for i, label in enumerate(labels)}
    b_to_i = [labels.index("I-" + label[2:]) if label.startswith("B-") and "I-" + label[2:] in labels else i
              for i, label in enumerate(labels)]
    encoded = tokenizer([row["tokens"] for row in rows], truncation=True, max_length=max_length,
                        is_split_into_words=True, return_token_type_ids=True)
    out = []
    for i, row in enumerate(rows):
        word_ids, previous, label_ids = encoded.word_ids(batch_index=i), None, []
        for word in word_ids:
            if word is None:
                label_ids.append(-100)
            elif word != previous:
                label_ids.append(label_to_id[row["ner_tags"][word]])
            else:
                label_ids.append(b_to_i[label_to_id[row["ner_tags"][word]]] if label_all_tokens else -100)
            previous = word
        out.append({"input_ids": encoded["input_ids"][i], "token_type_ids": encoded["token_type_ids"][i],
                    "labels": label_ids})
    return out


@pytest.mark.parametrize("name,label_all_tokens", [("bert", False), ("bert", True), ("roberta", False)])
def test_token_classification_matches_run_ner(binary, sentences, tokenizer_dirs, tmp_path, name, label_all_tokens):
    model_dir, hf = tokenizer_dirs[name]
    rows = ner_rows(sentences)
    options = ["--max-length", "48"] + (["--label-all-tokens"] if label_all_tokens else [])
    ours = features(binary, "token-cls", model_dir, rows, tmp_path, *options)
    theirs = run_ner_features(hf, rows, 48, label_all_tokens)
    assert len(ours) == len(theirs) == len(rows) > 800
    truncated = sum(len(f["input_ids"]) == 48 for f in theirs)
    assert truncated > 0, "no row was long enough to be truncated"
    for number, (got, want) in enumerate(zip(ours, theirs)):
        if name == "roberta":  # fusetrain leaves RoBERTa's type ids at 0
            want["token_type_ids"] = [0] * len(want["input_ids"])
        for key in ("input_ids", "token_type_ids", "labels"):
            assert got[key] == want[key], f"row {number} {key}: {rows[number]['tokens']}"


def squad_rows(sentences, seed=7):
    """Contexts of 4-8 sentences, answers a run of 1-4 words inside them, questions 3-8 words from elsewhere."""
    rng = random.Random(seed)
    rows = []
    i = 0
    while i + 8 < len(sentences) and len(rows) < 150:
        count = rng.randint(4, 8)
        context = " ".join(sentences[i:i + count])
        i += count
        words = context.split(" ")
        first = rng.randrange(len(words) - 4)
        answer = " ".join(words[first:first + rng.randint(1, 4)])
        start = len(" ".join(words[:first])) + (1 if first else 0)
        assert context[start:start + len(answer)] == answer
        question_words = rng.choice(sentences).split()[:rng.randint(3, 8)]
        rows.append({"question": " " * rng.randint(0, 2) + " ".join(question_words), "context": context,
                     "answers": {"text": [answer], "answer_start": [start]}})
    return rows


def run_qa_features(tokenizer, rows, max_length, doc_stride):
    """run_qa.py's prepare_train_features (pad_on_right, no padding), with one fix: the walk to the answer's first
    token stops at the context's last token. run_qa's walk runs on over the closing separator (whose offsets are
    (0, 0)) when the answer starts at a window's last context token, labelling the separator as the start."""
    encoded = tokenizer([row["question"].lstrip() for row in rows], [row["context"] for row in rows],
                        truncation="only_second", max_length=max_length, stride=doc_stride,
                        return_overflowing_tokens=True, return_offsets_mapping=True, return_token_type_ids=True)
    out = []
    for i, offsets in enumerate(encoded["offset_mapping"]):
        input_ids = encoded["input_ids"][i]
        cls_index = input_ids.index(tokenizer.cls_token_id)
        sequence_ids = encoded.sequence_ids(i)
        example = encoded["overflow_to_sample_mapping"][i]
        answers = rows[example]["answers"]
        start_char = answers["answer_start"][0]
        end_char = start_char + len(answers["text"][0])
        token_start = 0
        while sequence_ids[token_start] != 1:
            token_start += 1
        token_end = len(input_ids) - 1
        while sequence_ids[token_end] != 1:
            token_end -= 1
        context_end = token_end
        if not (offsets[token_start][0] <= start_char and offsets[token_end][1] >= end_char):
            start = end = cls_index
        else:
            while token_start <= context_end and offsets[token_start][0] <= start_char:
                token_start += 1
            start = token_start - 1
            while offsets[token_end][1] >= end_char:
                token_end -= 1
            end = token_end + 1
        types = encoded["token_type_ids"][i] if "token_type_ids" in encoded else [0] * len(input_ids)
        out.append({"example": example, "input_ids": input_ids, "token_type_ids": types, "start_position": start,
                    "end_position": end})
    return out


@pytest.mark.parametrize("name", ["bert", "roberta"])
def test_question_answering_matches_run_qa(binary, sentences, tokenizer_dirs, tmp_path, name):
    model_dir, hf = tokenizer_dirs[name]
    rows = squad_rows(sentences)
    ours = features(binary, "qa", model_dir, rows, tmp_path, "--max-length", "96", "--doc-stride", "32")
    theirs = run_qa_features(hf, rows, 96, 32)
    assert len(ours) == len(theirs)
    assert len(theirs) > 2 * len(rows), "contexts should need several windows"
    inside = sum(f["start_position"] != 0 for f in theirs)
    assert inside >= len(rows), "most answers should lie inside some window"
    for number, (got, want) in enumerate(zip(ours, theirs)):
        if name == "roberta":
            want["token_type_ids"] = [0] * len(want["input_ids"])
        assert got == want, f"feature {number} (example {want['example']})"
