#!/usr/bin/env python3
"""Writes a JSONL corpus of real text nobody here wrote, deterministic for a given N and SEED.

    python bench/real_corpus.py N [SEED] > records.jsonl

Sources, all Debian packages fetched with `apt-get download` and unpacked once under
.cache/bench/real-text:
- fortunes in eight languages (`fortunes` English, `-de`, `-es`, `-it`, `-ru`, `-pl`, `-cs`,
  `-zh`): half the records, spread evenly over the languages (a language with too few fortunes
  is topped up from English);
- WordNet 3.0's glosses (`wordnet-base`): a quarter, one synset's definition and examples each;
- man pages (`manpages`: the Linux man-pages project's sections 2-7), their roff markup
  stripped: the rest, one paragraph of at least 20 words each, so some run past the model's
  256-token limit.

Each record is {"id", "text"}; the id names its source (e.g. `fortunes-de-000042`).

    python bench/real_corpus.py --languages N [SEED] > records.jsonl

A multilingual corpus instead, for checking a reduced precision script by script: up to N
records of each language, from the fortunes above (and `-bg`, `-br`, `-eo`), the translated man
pages (`manpages-de`, `-fr`, `-ja`, `-ru`, `-el`, `-zh`, `-uk`, `-pl`, `-es`, `-tr`, `-vi`: one
paragraph each) and, for scripts neither has (Arabic, Hebrew, Persian, Devanagari, Bengali,
Tamil, Thai, Georgian, Korean, Armenian), the translated messages of GLib, GTK 2 and PackageKit
(`libglib2.0-data`, `libgtk2.0-common`, `packagekit`: one to twelve consecutive messages of a
catalog each, so lengths run from a word to past 256 tokens). The id starts with the language:
`ar-gettext-000012`, `ja-man-000003`, `ru-fortunes-000140`.
"""
import glob
import gzip
import json
import os
import random
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORK = os.path.join(ROOT, ".cache", "bench", "real-text")
FORTUNES = ["fortunes", "fortunes-de", "fortunes-es", "fortunes-it", "fortunes-ru",
            "fortunes-pl", "fortunes-cs", "fortunes-zh"]


def unpacked(package):
    """The package's files, fetched and unpacked once."""
    root = os.path.join(WORK, package)
    if not os.path.isdir(os.path.join(root, "usr")):
        os.makedirs(root, exist_ok=True)
        subprocess.run(["apt-get", "download", package], cwd=root, check=True,
                       stdout=subprocess.DEVNULL)
        deb = next(f for f in os.listdir(root) if f.endswith(".deb"))
        subprocess.run(["dpkg-deb", "-x", deb, "."], cwd=root, check=True)
    return root


def fortunes(package):
    """Every fortune of the package that is valid UTF-8, whitespace collapsed."""
    out = []
    pattern = os.path.join(unpacked(package), "usr", "share", "games", "fortunes", "**", "*")
    for path in sorted(glob.glob(pattern, recursive=True)):
        if os.path.islink(path) or not os.path.isfile(path) or path.endswith((".dat", ".u8")):
            continue
        with open(path, "rb") as f:
            raw = f.read()
        for entry in re.split(rb"\n%\n", raw):
            try:
                # Control characters (terminal escapes in a few fortunes) become spaces.
                text = re.sub(r"[\x00-\x1f\x7f]", " ", entry.decode("utf-8"))
                text = " ".join(text.split())
            except UnicodeDecodeError:
                continue
            if len(text) >= 10:
                out.append(text)
    return out


def glosses():
    """WordNet's glosses: a synset's definition and its examples, as the data files hold them."""
    out = []
    for path in sorted(glob.glob(os.path.join(unpacked("wordnet-base"), "usr", "share",
                                              "wordnet", "data.*"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.startswith("  ") and " | " in line:
                    out.append(line.split(" | ", 1)[1].strip())
    return out


NAMED = {"aq": "'", "cq": "'", "lq": '"', "rq": '"', "dq": '"', "em": "—", "en": "–",
         "ti": "~", "ha": "^", "rs": "\\", "bu": "•", "co": "©", "mc": "µ"}
ESCAPES = [(r"\\f(\[[^\]]*\]|\(..|.)", ""),
           (r"\\\[(\w+)\]", lambda m: NAMED.get(m.group(1), "")),
           (r"\\\(em", "—"), (r"\\\(en", "–"),
           (r"\\\((aq|cq)", "'"), (r"\\\((lq|rq|dq)", '"'), (r"\\-", "-"), (r"\\e", "\\\\"),
           (r"\\&", ""), (r"\\ ", " "), (r"\\\(..", ""), (r"\\\*\(..|\\\*.", "")]


def man_paragraphs(package="manpages", language=""):
    """Paragraphs of the man pages' text: macro lines end a paragraph (those that carry text,
    like .B or .I, add it), escapes become their characters or nothing. A paragraph of at least
    20 words or (in scripts written without spaces) 60 characters."""
    out = []
    pattern = os.path.join(unpacked(package), "usr", "share", "man", language, "man*", "*.gz")
    for path in sorted(glob.glob(pattern)):
        with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
        para = []
        for line in lines + [".PP"]:
            if line.startswith((".", "'")):
                macro, _, rest = line[1:].partition(" ")
                if macro in ("B", "I", "BR", "IR", "RB", "RI", "BI", "IB") and rest:
                    para.append(rest.replace('"', ""))
                    continue
                text = " ".join(" ".join(para).split())
                for pat, rep in ESCAPES:
                    text = re.sub(pat, rep, text)
                if len(text.split()) >= 20 or (language and len(text) >= 60):
                    out.append(text)
                para = []
            else:
                para.append(line)
    return out


LANGUAGE_FORTUNES = {"en": "fortunes", "de": "fortunes-de", "es": "fortunes-es",
                     "it": "fortunes-it", "ru": "fortunes-ru", "pl": "fortunes-pl",
                     "cs": "fortunes-cs", "zh": "fortunes-zh", "bg": "fortunes-bg",
                     "pt": "fortunes-br", "eo": "fortunes-eo"}
# Language: (package, the folder under usr/share/man).
LANGUAGE_MAN = {"de": ("manpages-de", "de"), "fr": ("manpages-fr", "fr"),
                "ja": ("manpages-ja", "ja"), "ru": ("manpages-ru", "ru"),
                "el": ("manpages-el", "el"), "zh": ("manpages-zh", "zh_CN"),
                "uk": ("manpages-uk", "uk"), "pl": ("manpages-pl", "pl"),
                "es": ("manpages-es", "es"), "tr": ("manpages-tr", "tr"),
                "vi": ("manpages-vi", "vi")}
CATALOGS = ["libglib2.0-data", "libgtk2.0-common", "packagekit"]
GETTEXT_LANGUAGES = ["ar", "he", "fa", "hi", "bn", "ta", "th", "ka", "ko", "hy"]


def mo_messages(path):
    """The translated messages of a gettext catalog (.mo), in catalog order, placeholders and
    accelerator marks kept as the translators wrote them."""
    import struct
    with open(path, "rb") as f:
        data = f.read()
    order = "<" if data[:4] == b"\xde\x12\x04\x95" else ">"
    count, original_at, translated_at = struct.unpack(order + "III", data[8:20])
    out = []
    for i in range(count):
        if struct.unpack(order + "I", data[original_at + 8 * i:][:4])[0] == 0:
            continue  # the catalog's header (its metadata), not a message
        length, offset = struct.unpack(order + "II", data[translated_at + 8 * i:][:8])
        for text in data[offset:offset + length].split(b"\0"):
            text = " ".join(text.decode("utf-8", errors="replace").split())
            if text:
                out.append(text)
    return out


def gettext_texts(language, rng):
    """One to twelve consecutive messages of one catalog at a time, over every catalog of
    CATALOGS in `language`."""
    out = []
    for package in CATALOGS:
        pattern = os.path.join(unpacked(package), "usr", "share", "locale", language,
                               "LC_MESSAGES", "*.mo")
        for path in sorted(glob.glob(pattern)):
            messages = mo_messages(path)
            i = 0
            while i < len(messages):
                take = rng.choice([1, 1, 2, 3, 5, 8, 12])
                out.append(" ".join(messages[i:i + take]))
                i += take
    return [t for t in out if len(t) >= 4]


def languages(n, seed):
    """Up to `n` records of each language, from every source that has the language."""
    rng = random.Random(seed)
    pools = {}
    for language, package in LANGUAGE_FORTUNES.items():
        pools.setdefault(language, []).append(("fortunes", fortunes(package)))
    for language, (package, folder) in LANGUAGE_MAN.items():
        pools.setdefault(language, []).append(("man", man_paragraphs(package, folder)))
    pools["en"].append(("man", man_paragraphs()))
    for language in GETTEXT_LANGUAGES:
        pools.setdefault(language, []).append(("gettext", gettext_texts(language, rng)))
    counts = {}
    for language, sources in sorted(pools.items()):
        sources = [(name, texts) for name, texts in sources if texts]
        for s, (name, texts) in enumerate(sources):
            share = (n - sum(counts.get((language, m), 0) for m, _ in sources)) // (len(sources) - s)
            for text in rng.sample(texts, min(share, len(texts))):
                key = (language, name)
                counts[key] = counts.get(key, 0) + 1
                print(json.dumps({"id": f"{language}-{name}-{counts[key]:06d}", "text": text},
                                 ensure_ascii=False))
    print("real_corpus: " + ", ".join(f"{l}-{s} {c}" for (l, s), c in sorted(counts.items())),
          file=sys.stderr)


def main():
    if sys.argv[1] == "--languages":
        languages(int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 11)
        return
    n = int(sys.argv[1])
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 11
    rng = random.Random(seed)
    per_language = n // 2 // len(FORTUNES)
    english = fortunes("fortunes")
    chosen = []
    for package in FORTUNES:
        pool = english if package == "fortunes" else fortunes(package)
        take = rng.sample(pool, min(per_language, len(pool)))
        chosen += [(package, t) for t in take]
    spare = [t for t in english if t not in {t for _, t in chosen}]
    chosen += [("fortunes", t) for t in rng.sample(spare, n // 2 - len(chosen))]
    chosen += [("wordnet", t) for t in rng.sample(glosses(), n // 4)]
    chosen += [("man", t) for t in rng.sample(man_paragraphs(), n - len(chosen))]
    rng.shuffle(chosen)
    counts = {}
    for source, text in chosen:
        counts[source] = counts.get(source, 0) + 1
        print(json.dumps({"id": f"{source}-{counts[source]:06d}", "text": text},
                         ensure_ascii=False))
    print(f"real_corpus: {n} records: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())),
          file=sys.stderr)


if __name__ == "__main__":
    main()
