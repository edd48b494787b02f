#!/usr/bin/env python3
"""The PyTorch baseline for `spotinfer bench`: sentence-transformers on the CPU.

    python bench/st_encode.py --input corpus.jsonl [--batch-size 32] [--model DIR] [--bf16]

Reads the same JSONL records, runs one untimed warm-up batch, then times
`model.encode(texts, batch_size=32, normalize_embeddings=True)` (which sorts by length itself)
and prints one JSON object with the figures, shaped like `spotinfer bench`'s last line.
`--bf16` casts the model to bfloat16 first, as a PyTorch user on an AMX Xeon would (oneDNN
then multiplies on AMX tiles; `ONEDNN_VERBOSE=1` shows which kernels ran).
"""
import argparse
import json
import resource
import time

from st_model import default_model, load_model


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", help="sentence-transformers model folder (default: the package's)")
    p.add_argument("--input", required=True)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--bf16", action="store_true", help="cast the model to bfloat16 first")
    args = p.parse_args()

    import torch

    t0 = time.perf_counter()
    model = load_model(args.model or default_model())
    if args.bf16:
        model = model.to(torch.bfloat16)
    load_seconds = time.perf_counter() - t0
    with open(args.input, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]

    model.encode(texts[: args.batch_size], batch_size=args.batch_size)  # warm-up
    before = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    model.encode(texts, batch_size=args.batch_size)
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF)

    features = model.tokenize(texts)
    tokens = int(features["attention_mask"].sum())
    print(json.dumps({
        "records": len(texts),
        "tokens": tokens,
        "seconds": seconds,
        "records_per_s": len(texts) / seconds,
        "tokens_per_s": tokens / seconds,
        "load_seconds": load_seconds,
        "batch_size": args.batch_size,
        "cpu_user_s": after.ru_utime - before.ru_utime,
        "cpu_sys_s": after.ru_stime - before.ru_stime,
        "peak_rss_mib": after.ru_maxrss / 1024,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "dtype": "bfloat16" if args.bf16 else "float32",
    }))


if __name__ == "__main__":
    main()
