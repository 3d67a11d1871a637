#!/usr/bin/env python3
"""Generates src/data/unicode_tables.inc: the Unicode data fusetrain's tokenizer needs.

    python3 scripts/gen_unicode_tables.py [--match-tokenizers] [-o src/data/unicode_tables.inc]

Every table is computed from Python's `unicodedata`. With --match-tokenizers (how the
committed file is made) the sets that Hugging Face `tokenizers` takes from Rust crates
carrying their own, older or newer, Unicode tables are then measured on the installed
`tokenizers` package, one code point at a time, so that fusetrain splits and normalizes
exactly as the library does:

  letter, number       Oniguruma's \\p{L} and \\p{N} (GPT-2's ByteLevel pattern)
  control              BertNormalizer clean_text's "is_other" (removed characters)
  punctuation          BertPreTokenizer / Punctuation (ASCII punctuation or Unicode P*)
  mark_nonspacing      BertNormalizer strip_accents ("Mn", as the unicode_categories crate has it)
  combining_mark       StripAccents (is_combining_mark: any M*, as unicode-normalization has it)
  word                 the regex crate's \\w (Whitespace pre-tokenizer)
  numeric              char::is_numeric (Digits pre-tokenizer)
  lowercase            char::to_lowercase
  NFD / NFKD           unicode-normalization-alignments (and which marks it knows to reorder)

Output layout (all sorted, all ranges, so the file stays small):
  kFlagRuns       {first code point, flags}: flags hold up to the next run's start
  kLowerRuns      {first, count, delta, stride}: lower(cp) = cp + delta for cp in the run
  kLowerSpecial   code points that lower-case to more than one character
  kDecomp*        full decompositions (canonical, then compatibility where different)
  kCccRuns        canonical combining classes
  kCompositions   primary composites for NFC/NFKC (Hangul is algorithmic in unicode.cpp)
"""

import argparse
import pathlib
import sys
import unicodedata

FLAG_LETTER = 1 << 0
FLAG_NUMBER = 1 << 1
FLAG_WHITESPACE = 1 << 2
FLAG_CONTROL = 1 << 3
FLAG_PUNCTUATION = 1 << 4
FLAG_MARK_NONSPACING = 1 << 5
FLAG_WORD = 1 << 6
FLAG_NUMERIC = 1 << 7
FLAG_CJK = 1 << 8
FLAG_COMBINING_MARK = 1 << 9

# The Unicode White_Space property (stable since Unicode 6.3; unicodedata does not expose it).
WHITE_SPACE = [0x9, 0xA, 0xB, 0xC, 0xD, 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029,
               0x202F, 0x205F, 0x3000]
# BertNormalizer's "Chinese characters" (the CJK ideograph blocks, as BERT's original code lists them).
CJK_RANGES = [(0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
              (0x2B920, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F)]
ASCII_PUNCTUATION = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"
HANGUL_FIRST, HANGUL_LAST = 0xAC00, 0xD7A3

ALL = [cp for cp in range(0x110000) if not 0xD800 <= cp <= 0xDFFF]


def category(cp):
    return unicodedata.category(chr(cp))


def base_sets():
    white = set(WHITE_SPACE)
    sets = {
        "letter": {cp for cp in ALL if category(cp)[0] == "L"},
        "number": {cp for cp in ALL if category(cp)[0] == "N"},
        "control": {cp for cp in ALL if category(cp) in ("Cc", "Cf", "Co") and cp not in (9, 10, 13)} | {0, 0xFFFD},
        "punctuation": {cp for cp in ALL if category(cp)[0] == "P"} | {ord(c) for c in ASCII_PUNCTUATION},
        "mark_nonspacing": {cp for cp in ALL if category(cp) == "Mn"},
        "combining_mark": {cp for cp in ALL if category(cp)[0] == "M"},
        "word": {cp for cp in ALL if category(cp)[0] in "LM" or category(cp) in ("Nd", "Nl", "Pc")}
        | {0x200C, 0x200D},
        "numeric": {cp for cp in ALL if category(cp)[0] == "N"},
    }
    sets["whitespace"] = white
    return sets


def measured_sets():
    """The same sets, measured on the installed `tokenizers` package."""
    from tokenizers import normalizers, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    clean = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=False, strip_accents=False,
                                       lowercase=False)
    bert = pre_tokenizers.BertPreTokenizer()
    strip = normalizers.StripAccents()
    bert_strip = normalizers.BertNormalizer(clean_text=False, handle_chinese_chars=False, strip_accents=True,
                                            lowercase=False)
    whitespace = pre_tokenizers.Whitespace()
    digits = pre_tokenizers.Digits(individual_digits=False)
    white = set(WHITE_SPACE)

    def one_piece(pre, text):
        return len(pre.pre_tokenize_str(text)) == 1

    sets = {"letter": set(), "number": set(), "control": set(), "punctuation": set(), "mark_nonspacing": set(),
            "combining_mark": set(), "word": set(), "numeric": set(), "whitespace": white}
    for cp in ALL:
        ch = chr(cp)
        if cp not in white:
            if one_piece(byte_level, "a" + ch):
                sets["letter"].add(cp)
            elif one_piece(byte_level, "1" + ch):
                sets["number"].add(cp)
            if len(bert.pre_tokenize_str("a" + ch + "a")) == 3:
                sets["punctuation"].add(cp)
            if one_piece(whitespace, "a" + ch):
                sets["word"].add(cp)
        if clean.normalize_str(ch) == "":
            sets["control"].add(cp)
        if bert_strip.normalize_str(ch) == "":
            sets["mark_nonspacing"].add(cp)
        if strip.normalize_str(ch) == "":
            sets["combining_mark"].add(cp)
        if one_piece(digits, "1" + ch):
            sets["numeric"].add(cp)
    return sets


def flag_runs(sets):
    masks = {"letter": FLAG_LETTER, "number": FLAG_NUMBER, "whitespace": FLAG_WHITESPACE, "control": FLAG_CONTROL,
             "punctuation": FLAG_PUNCTUATION, "mark_nonspacing": FLAG_MARK_NONSPACING, "word": FLAG_WORD,
             "numeric": FLAG_NUMERIC, "combining_mark": FLAG_COMBINING_MARK}
    flags = [0] * 0x110000
    for name, mask in masks.items():
        for cp in sets[name]:
            flags[cp] |= mask
    for first, last in CJK_RANGES:
        for cp in range(first, last + 1):
            flags[cp] |= FLAG_CJK
    runs = []
    for cp, value in enumerate(flags):
        if not runs or runs[-1][1] != value:
            runs.append((cp, value))
    return runs


def lowercase_maps(match_tokenizers):
    if match_tokenizers:
        from tokenizers import normalizers
        lower = normalizers.Lowercase().normalize_str
    else:
        lower = str.lower
    single, special = {}, {}
    for cp in ALL:
        out = lower(chr(cp))
        if out == chr(cp):
            continue
        if len(out) == 1:
            single[cp] = ord(out)
        else:
            special[cp] = [ord(c) for c in out]
    # Runs of code points at a fixed stride (1 or 2) sharing one delta.
    runs = []
    for cp in sorted(single):
        delta = single[cp] - cp
        if runs:
            first, count, run_delta, stride = runs[-1]
            last = first + (count - 1) * stride
            if run_delta == delta and (count == 1 and cp - last in (1, 2) or count > 1 and cp - last == stride):
                runs[-1] = (first, count + 1, delta, cp - last if count == 1 else stride)
                continue
        runs.append((cp, 1, delta, 1))
    return runs, special


def decompositions(match_tokenizers):
    if match_tokenizers:
        from tokenizers import normalizers
        nfd, nfkd = normalizers.NFD().normalize_str, normalizers.NFKD().normalize_str
    else:
        nfd = lambda s: unicodedata.normalize("NFD", s)  # noqa: E731
        nfkd = lambda s: unicodedata.normalize("NFKD", s)  # noqa: E731
    canonical, compat = {}, {}
    for cp in ALL:
        if HANGUL_FIRST <= cp <= HANGUL_LAST:
            continue
        ch = chr(cp)
        d = nfd(ch)
        if d != ch:
            canonical[cp] = [ord(c) for c in d]
        k = nfkd(ch)
        if k != ch and k != d:
            compat[cp] = [ord(c) for c in k]
    return canonical, compat


def ccc_runs(match_tokenizers):
    known = None
    if match_tokenizers:
        # Marks the (older) normalization tables do not know sort as starters there: measure which are reordered.
        from tokenizers import normalizers
        nfd = normalizers.NFD().normalize_str
        known = set()
        for cp in ALL:
            ccc = unicodedata.combining(chr(cp))
            if ccc == 0:
                continue
            x = chr(cp)
            if nfd(x) != x:
                known.add(cp)  # decomposes; its class never matters after decomposition
            elif ccc < 240:
                if nfd("\u0345" + x) == x + "\u0345":
                    known.add(cp)
            elif nfd(x + "\u0316") == "\u0316" + x:
                known.add(cp)
    runs = []
    for cp in ALL:
        ccc = unicodedata.combining(chr(cp))
        if ccc == 0 or (known is not None and cp not in known):
            continue
        if runs and runs[-1][1] == cp - 1 and runs[-1][2] == ccc:
            runs[-1] = (runs[-1][0], cp, ccc)
        else:
            runs.append((cp, cp, ccc))
    return runs


def compositions():
    pairs = []
    for cp in ALL:
        d = unicodedata.decomposition(chr(cp))
        if not d or d.startswith("<"):
            continue
        parts = [int(x, 16) for x in d.split()]
        if len(parts) != 2:
            continue
        if unicodedata.normalize("NFC", chr(parts[0]) + chr(parts[1])) == chr(cp):
            pairs.append((parts[0], parts[1], cp))
    return sorted(pairs)


def wrap(lines, items, width=118):
    """Appends items separated by commas, in lines of at most `width` characters."""
    line = " "
    for item in items:
        if len(line) + len(item) + 1 > width:
            lines.append(line)
            line = " "
        line += item + ","
    if line.strip():
        lines.append(line)


def emit_decomposition(lines, name, table, pool):
    lines.append(f"static constexpr Decomposition {name}[] = {{  // {len(table)} code points")
    items = []
    for cp in sorted(table):
        seq = table[cp]
        items.append(f"{{0x{cp:X},{len(pool)},{len(seq)}}}")
        pool.extend(seq)
    wrap(lines, items)
    lines.append("};")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--match-tokenizers", action="store_true",
                        help="measure the quirky sets on the installed tokenizers package")
    parser.add_argument("-o", "--output", default=str(pathlib.Path(__file__).resolve().parents[1] / "src" / "data" /
                                                      "unicode_tables.inc"))
    args = parser.parse_args()

    source = f"Python unicodedata {unicodedata.unidata_version}"
    sets = base_sets()
    if args.match_tokenizers:
        import tokenizers
        measured = measured_sets()
        for name, values in measured.items():
            added, removed = len(values - sets[name]), len(sets[name] - values)
            print(f"{name}: {len(values)} code points (+{added} / -{removed} against unicodedata)", file=sys.stderr)
        sets = measured
        source += f", sets measured on tokenizers {tokenizers.__version__}"

    runs = flag_runs(sets)
    lower_runs, lower_special = lowercase_maps(args.match_tokenizers)
    canonical, compat = decompositions(args.match_tokenizers)
    ccc = ccc_runs(args.match_tokenizers)
    pairs = compositions()

    lines = [
        "// Generated by scripts/gen_unicode_tables.py -- do not edit.",
        f"// Source: {source}.",
        "// Included once, by src/data/unicode.cpp, which defines the row types.",
        "",
        f"static constexpr FlagRun kFlagRuns[] = {{  // {len(runs)} runs",
    ]
    wrap(lines, [f"{{0x{cp:X},0x{value:X}}}" for cp, value in runs])
    lines.append("};")
    lines.append(f"static constexpr CaseRun kLowerRuns[] = {{  // {len(lower_runs)} runs")
    wrap(lines, [f"{{0x{a:X},{n},{d},{s}}}" for a, n, d, s in lower_runs])
    lines.append("};")
    lines.append("static constexpr char32_t kLowerSpecial[][4] = {  // code point, then up to 3 lower-case ones")
    wrap(lines, ["{" + ",".join(f"0x{c:X}" for c in [cp] + seq + [0] * (3 - len(seq))) + "}"
                 for cp, seq in sorted(lower_special.items())], 4)
    lines.append("};")
    pool = []
    emit_decomposition(lines, "kDecompCanonical", canonical, pool)
    emit_decomposition(lines, "kDecompCompat", compat, pool)
    lines.append(f"static constexpr char32_t kDecompPool[] = {{  // {len(pool)} code points")
    wrap(lines, [f"0x{c:X}" for c in pool])
    lines.append("};")
    lines.append(f"static constexpr CccRun kCccRuns[] = {{  // {len(ccc)} runs")
    wrap(lines, [f"{{0x{a:X},0x{b:X},{c}}}" for a, b, c in ccc])
    lines.append("};")
    lines.append(f"static constexpr Composition kCompositions[] = {{  // {len(pairs)} pairs, sorted")
    wrap(lines, [f"{{0x{a:X},0x{b:X},0x{c:X}}}" for a, b, c in pairs])
    lines.append("};")
    pathlib.Path(args.output).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
