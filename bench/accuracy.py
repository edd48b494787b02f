#!/usr/bin/env python3
"""How close other encoders' vectors are to sentence-transformers fp32 on the CPU, record by record.

    python bench/accuracy.py --input corpus.jsonl [--model DIR] [--batch-size 32] \
        [LABEL=]VECTORS.jsonl ...

The corpus is JSON lines of {"id", "text"}; each candidate is JSON lines of {"id", "embedding"},
e.g. from `spotinfer embed --input corpus.jsonl --output out.jsonl --model DIR --device cpu` or
`bench/ort_encode.py --vectors out.jsonl`. The reference is sentence-transformers (PyTorch, fp32,
CPU; the folder's modules.json: pooling, Normalize, max_seq_length) over EVERY record of the
corpus. Each candidate must hold exactly the corpus's ids, once each, with vectors of the
reference's width: a missing, extra or repeated id, or a wrong width, fails the run.

For each candidate: records compared, the worst cosine with the reference and its record's id,
the mean cosine, and how many records fall below 0.999 (the contract spotinfer keeps). A table
goes to stderr; the last line on stdout is one JSON object with every figure.

    python bench/accuracy.py --input corpus.jsonl --reference-vectors F32.jsonl --by-language \
        [LABEL=]VECTORS.jsonl ...

`--reference-vectors` takes the reference from a file instead (spotinfer `--precision f32`,
which matches sentence-transformers fp32 to cosine 1.0000000; no PyTorch needed), to measure a
reduced precision's drift; `--by-language` adds each candidate's worst cosine per language, the
id's part before its first `-` (bench/real_corpus.py --languages names records so).
"""
import argparse
import json
import os
import sys
import time

import numpy as np

THRESHOLD = 0.999


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def read_corpus(path):
    ids, texts = [], []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                rec = json.loads(line)
                ids.append(rec["id"])
                texts.append(rec["text"])
    if len(set(ids)) != len(ids):
        raise SystemExit(f"{path}: repeated ids in the corpus")
    return ids, texts


def read_vectors(path, ids):
    """The candidate's vectors in the corpus's order; fails on any id mismatch."""
    got = {}
    repeated = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                if rec["id"] in got:
                    repeated.append(rec["id"])
                got[rec["id"]] = rec["embedding"]
    want = set(ids)
    missing = [i for i in ids if i not in got]
    extra = sorted(set(got) - want)
    if missing or extra or repeated:
        raise SystemExit(f"{path}: ids differ from the corpus: {len(missing)} missing "
                         f"{missing[:5]}, {len(extra)} extra {extra[:5]}, {len(repeated)} "
                         f"repeated {repeated[:5]}")
    widths = {len(got[i]) for i in ids}
    if len(widths) != 1:
        raise SystemExit(f"{path}: vectors of several widths {sorted(widths)}")
    out = np.asarray([got[i] for i in ids], dtype=np.float64)
    if not np.isfinite(out).all():
        raise SystemExit(f"{path}: non-finite values")
    return out


def cosines(a, b):
    num = (a * b).sum(1)
    den = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return num / np.maximum(den, 1e-300)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--input", required=True, help="corpus: JSON lines of {id, text}")
    p.add_argument("--model", help="sentence-transformers model folder (default: the package's)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--reference-vectors", help="the reference's {id, embedding} lines, instead "
                   "of running sentence-transformers")
    p.add_argument("--by-language", action="store_true",
                   help="each candidate's worst cosine per id prefix (before the first '-')")
    p.add_argument("candidates", nargs="+", help="[LABEL=]FILE of {id, embedding} lines")
    a = p.parse_args()
    ids, texts = read_corpus(a.input)
    candidates = []  # read and checked before the reference's minutes are spent
    for c in a.candidates:
        label, _, path = c.rpartition("=")
        candidates.append((label or os.path.basename(path), path, read_vectors(path, ids)))
    if a.reference_vectors:
        reference = read_vectors(a.reference_vectors, ids)
        report(ids, candidates, reference, a.by_language,
               {"records": len(ids), "reference": os.path.abspath(a.reference_vectors)})
        return

    from st_model import default_model, load_model
    import sentence_transformers
    import torch

    started = time.perf_counter()
    model_dir = a.model or default_model()
    model = load_model(model_dir)
    assert next(model.parameters()).dtype == torch.float32
    reference = model.encode(texts, batch_size=a.batch_size, convert_to_numpy=True,
                             show_progress_bar=False).astype(np.float64)
    log(f"reference: sentence-transformers {sentence_transformers.__version__} fp32 CPU, "
        f"{len(texts)} records in {time.perf_counter() - started:.1f} s")
    report(ids, candidates, reference, a.by_language,
           {"records": len(ids), "model": os.path.abspath(model_dir),
            "reference": f"sentence-transformers {sentence_transformers.__version__}, "
                         f"torch {torch.__version__}, fp32, CPU"})


def report(ids, candidates, reference, by_language, result):
    """Each candidate's cosines with the reference: the table on stderr, the JSON on stdout."""
    result.update({"threshold": THRESHOLD, "candidates": {}})
    for label, path, vectors in candidates:
        if vectors.shape[1] != reference.shape[1]:
            raise SystemExit(f"{path}: vectors of width {vectors.shape[1]}, the reference's "
                             f"are {reference.shape[1]}")
        c = cosines(vectors, reference)
        worst = int(c.argmin())
        result["candidates"][label] = {
            "file": path, "records": int(len(c)), "worst_cosine": float(c[worst]),
            "worst_id": ids[worst], "mean_cosine": float(c.mean()),
            "below_0_999": int((c < THRESHOLD).sum()),
        }
        if by_language:
            worst_by = {}
            for record, cos in zip(ids, c):
                language = record.split("-", 1)[0]
                worst_by[language] = min(worst_by.get(language, 1.0), float(cos))
            result["candidates"][label]["worst_by_language"] = worst_by
    log(f"{'candidate':24} {'records':>8} {'worst cosine':>16} {'mean cosine':>16} "
        f"{'< ' + str(THRESHOLD):>8}  worst id")
    for label, r in result["candidates"].items():
        log(f"{label:24} {r['records']:8} {r['worst_cosine']:16.12f} {r['mean_cosine']:16.12f} "
            f"{r['below_0_999']:8}  {r['worst_id']}")
        if "worst_by_language" in r:
            log("    " + ", ".join(f"{k} {v:.5f}" for k, v in sorted(
                r["worst_by_language"].items(), key=lambda kv: kv[1])))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
