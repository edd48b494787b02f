#!/usr/bin/env python3
"""The GPU checks: a `--features cuda` spotinfer binary against sentence-transformers on the
same GPU, for correctness and for speed. Runs on the GPU machine (CUDA, PyTorch and
sentence-transformers there; no Rust toolchain needed: build with scripts/build-cuda.sh, copy the
binary and the model over).

    python3 bench/gpu.py --bin target/cuda/release/spotinfer --model models/all-MiniLM-L6-v2 \
        [--records 20000] [--rounds 3] [--batch-sizes 64,256] [--out DIR]

Correctness: every vector of the embeddings fixture's texts, a few thousand varied texts
(scripts/make-corpus.py plus unicode, code, numbers and whitespace oddities), embedded by
`spotinfer embed --device cuda` in f32 and in f16 (the CUDA default), compared by cosine with
sentence-transformers fp32 on the same GPU; sentence-transformers fp16 is measured the same way
beside it. Speed: `spotinfer bench --device cuda` (f16) against sentence-transformers fp16 on the
same corpus and batch size, alternated, medians of records/s and tokens/s, and each process's
peak GPU memory (nvidia-smi, sampled every 50 ms, less the idle figure). Prints a table and
writes everything to OUT/gpu-report.json.
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def varied_texts(n, seed=11):
    """Texts a real corpus has and a synthetic English one lacks."""
    rng = random.Random(seed)
    pieces = [
        "naïve café résumé Ünïcödé", "東京は日本の首都です。", "Москва — столица России.",
        "emoji 🚀🔥✨ and symbols ∑ ≥ ≤ → ←", "fn main() { println!(\"{}\", 1 + 2); }",
        "SELECT id, embedding FROM embeddings WHERE job = 'a';", "3.14159 2.71828 1e-9 0xFF",
        "https://example.com/path?query=1&x=y#frag", "tabs\tand\nnewlines\r\n  spaces   ",
        "ALL CAPS SHOUTING TEXT", "a", "?", "الْعَرَبِيَّة", "हिन्दी भाषा", "한국어 문장입니다.",
        "don't won't can't it's", "e-mail: someone@example.org", "#hashtag @mention",
    ]
    words = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read().split()
    out = []
    for _ in range(n):
        k = rng.choice([1, 2, 4, 8, 32, 120, 400])
        parts = [rng.choice(pieces) if rng.random() < 0.3 else rng.choice(words) for _ in range(k)]
        out.append(" ".join(parts))
    return out


def corpus(records, seed=7):
    """make-corpus.py's deterministic English records."""
    lines = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make-corpus.py"),
                            str(records), str(seed)], check=True, capture_output=True, text=True)
    return [json.loads(line)["text"] for line in lines.stdout.splitlines() if line.strip()]


def fixture_texts():
    with open(os.path.join(ROOT, "tests", "fixtures", "reference_embeddings.json")) as f:
        return [r["text"] for r in json.load(f)["records"]]


def write_jsonl(path, texts):
    with open(path, "w", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"id": f"t{i:07d}", "text": t}) + "\n")


def read_embeddings(path):
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    return {r["id"]: r["embedding"] for r in rows}


def cosines(a, b):
    import numpy as np
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    num = (a * b).sum(1)
    return num / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def summary(c):
    return {"n": int(len(c)), "worst": float(c.min()), "mean": float(c.mean()),
            "below_0_999": int((c < 0.999).sum())}


class GpuMemory:
    """Peak `memory.used` of GPU 0 while a block runs, less what it was before."""

    def __enter__(self):
        self.idle = self._read()
        self.peak = self.idle
        self.stop = False
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop = True
        self.thread.join()

    def _poll(self):
        while not self.stop:
            self.peak = max(self.peak, self._read())
            time.sleep(0.05)

    @staticmethod
    def _read():
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                              "-i", "0"], capture_output=True, text=True)
        return int(out.stdout.strip() or 0)

    @property
    def mib(self):
        return self.peak - self.idle


def run_spotinfer(args, extra):
    cmd = [args.bin] + extra
    with GpuMemory() as mem:
        out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return out, mem.mib


def check_correctness(args, st_model_dir):
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    texts = fixture_texts() + varied_texts(1500) + corpus(2500, seed=3)
    path = os.path.join(args.out, "check.jsonl")
    write_jsonl(path, texts)
    ids = [f"t{i:07d}" for i in range(len(texts))]
    # .float(): transformers 5 loads a checkpoint in its stored dtype, and an f16 checkpoint would
    # make the "fp32" reference an fp16 one.
    model = SentenceTransformer(st_model_dir, device="cuda").float()
    model.max_seq_length = 256
    assert next(model.parameters()).dtype == torch.float32
    reference = model.encode(texts, batch_size=64, normalize_embeddings=True, convert_to_numpy=True)
    st16 = model.half().encode(texts, batch_size=64, normalize_embeddings=True, convert_to_numpy=True)
    del model
    torch.cuda.empty_cache()
    result = {"texts": len(texts), "sentence_transformers_fp16": summary(cosines(st16, reference))}
    for precision in ["f32", "f16"]:
        out = os.path.join(args.out, f"spotinfer-{precision}.jsonl")
        run_spotinfer(args, ["embed", "--input", path, "--output", out, "--model", args.model,
                             "--device", "cuda", "--precision", precision, "--batch-size", "64"])
        got = read_embeddings(out)
        vectors = np.asarray([got[i] for i in ids], dtype=np.float32)
        result[f"spotinfer_{precision}"] = summary(cosines(vectors, reference))
    return result


def st_bench(model_dir, input_path, batch_size):
    """One sentence-transformers fp16 run, in this process; prints bench JSON."""
    import torch
    from sentence_transformers import SentenceTransformer

    with open(input_path, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    model = SentenceTransformer(model_dir, device="cuda").half()
    model.max_seq_length = 256
    model.encode(texts[: batch_size * 4], batch_size=batch_size)  # warm-up
    torch.cuda.synchronize()
    started = time.perf_counter()
    model.encode(texts, batch_size=batch_size, normalize_embeddings=True)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    tokens = int(model.tokenize(texts)["attention_mask"].sum())
    print(json.dumps({"records": len(texts), "tokens": tokens, "seconds": seconds,
                      "records_per_s": len(texts) / seconds, "tokens_per_s": tokens / seconds,
                      "torch": torch.__version__}))


def speed(args, st_model_dir):
    texts = corpus(args.records, seed=7)
    path = os.path.join(args.out, "bench.jsonl")
    write_jsonl(path, texts)
    rows = []
    for batch_size in args.batch_sizes:
        runs = {"spotinfer": [], "sentence_transformers": []}
        if args.compare_budget:
            runs["spotinfer_no_token_budget"] = []
        for _ in range(args.rounds):
            bench = ["bench", "--input", path, "--model", args.model, "--device", "cuda",
                     "--batch-size", str(batch_size)]
            out, mib = run_spotinfer(args, bench)
            runs["spotinfer"].append(dict(json.loads(out.stdout.strip().splitlines()[-1]), gpu_mib=mib))
            if args.compare_budget:
                out, mib = run_spotinfer(args, bench + ["--max-batch-tokens", "0"])
                runs["spotinfer_no_token_budget"].append(
                    dict(json.loads(out.stdout.strip().splitlines()[-1]), gpu_mib=mib))
            cmd = [sys.executable, __file__, "st-bench", st_model_dir, path, str(batch_size)]
            with GpuMemory() as mem:
                out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            runs["sentence_transformers"].append(dict(json.loads(out.stdout.strip().splitlines()[-1]),
                                                      gpu_mib=mem.mib))
        row = {"batch_size": batch_size, "records": len(texts)}
        for side, rs in runs.items():
            row[side] = {k: statistics.median(r[k] for r in rs)
                         for k in ["records_per_s", "tokens_per_s", "gpu_mib", "seconds"]}
            row[side]["runs_records_per_s"] = [round(r["records_per_s"], 1) for r in rs]
        row["ratio"] = row["spotinfer"]["records_per_s"] / row["sentence_transformers"]["records_per_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "st-bench":
        return st_bench(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    p = argparse.ArgumentParser()
    p.add_argument("--bin", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--records", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch-sizes", default="64,256")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--skip", default="", help="comma list of steps to skip: correctness,speed")
    p.add_argument("--compare-budget", action="store_true",
                   help="also run spotinfer with --max-batch-tokens 0 (no token budget)")
    args = p.parse_args()
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    os.makedirs(args.out, exist_ok=True)
    st_model_dir = os.path.abspath(args.model)
    report = {"gpu": subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True).stdout.strip(),
              "date": time.strftime("%Y-%m-%d")}
    if "correctness" not in args.skip:
        report["correctness"] = check_correctness(args, st_model_dir)
        print(json.dumps(report["correctness"], indent=1), flush=True)
    if "speed" not in args.skip:
        report["speed"] = speed(args, st_model_dir)
    with open(os.path.join(args.out, "gpu-report.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
