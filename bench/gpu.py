#!/usr/bin/env python3
"""The GPU checks: a `--features cuda` spotinfer binary against sentence-transformers on the
same GPU, for correctness and for speed. Runs on the GPU machine (CUDA, PyTorch and
sentence-transformers there; no Rust toolchain needed: build with scripts/build-cuda.sh, copy the
binary and the model over).

    python3 bench/gpu.py --bin target/cuda/release/spotinfer --model models/all-MiniLM-L6-v2 \
        [--records 20000] [--rounds 3] [--batch-sizes 64,256] [--out DIR] \
        [--shapes DIR,DIR] [--pin-cpus 8,26]

Correctness: every vector of the embeddings fixture's texts, a few thousand varied texts
(scripts/make-corpus.py plus unicode, code, numbers and whitespace oddities), embedded by
`spotinfer embed --device cuda` in f32 and in f16 (the CUDA default), compared by cosine with
sentence-transformers fp32 on the same GPU; sentence-transformers fp16 is measured the same way
beside it. Speed: `spotinfer bench --device cuda` (f16) against sentence-transformers fp16 on the
same corpus and batch size, alternated, medians of records/s and tokens/s, and each process's
peak GPU memory and GPU utilisation (nvidia-smi, sampled every 50 ms: memory less the idle
figure; utilisation the mean over the samples between the first and the last busy one, so model
load and process start are left out), and the share of the run spotinfer's model thread computed
(`model_busy` of its bench report), and one profiled run's device stages (`--profile-device`).
`--pin-cpus 8,26` adds spotinfer runs under `taskset` to the
first 8 and 26 CPUs (the vCPUs GKE gives one L4 and one H100), alternated with the rest, each
against the unpinned median. `--shapes` adds model folders of other shapes (bench/make_shape.py:
12 layers at 384 and at 768 wide) to the speed runs and the f16-against-f32 cosines. Prints a
table and writes everything to OUT/gpu-report.json, with the issue's targets checked.
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
    """Peak `memory.used` of GPU 0 while a block runs, less what it was before; and
    `utilization.gpu` over the busy part of the block."""

    def __enter__(self):
        self.idle = self._read()[0]
        self.peak = self.idle
        self.busy = []
        self.stop = False
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop = True
        self.thread.join()

    def _poll(self):
        while not self.stop:
            used, util = self._read()
            self.peak = max(self.peak, used)
            self.busy.append(util)
            time.sleep(0.05)

    @staticmethod
    def _read():
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,utilization.gpu",
                              "--format=csv,noheader,nounits", "-i", "0"], capture_output=True, text=True)
        fields = [f.strip() for f in (out.stdout.strip() or "0, 0").split(",")]
        return int(fields[0]), int(fields[1])

    @property
    def mib(self):
        return self.peak - self.idle

    @property
    def utilisation(self):
        """Mean utilisation (0-1) from the first busy sample to the last."""
        on = [i for i, u in enumerate(self.busy) if u > 0]
        if not on:
            return 0.0
        window = self.busy[on[0]:on[-1] + 1]
        return sum(window) / len(window) / 100.0


def run_spotinfer(args, extra, pin=None):
    cmd = [args.bin] + extra
    if pin:
        cmd = ["taskset", "-c", f"0-{pin - 1}"] + cmd
    with GpuMemory() as mem:
        out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return out, mem


def bench_row(out, mem):
    return dict(json.loads(out.stdout.strip().splitlines()[-1]), gpu_mib=mem.mib,
                gpu_utilisation=mem.utilisation)


def check_correctness(args, st_model_dir, model):
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    texts = fixture_texts() + varied_texts(1500) + corpus(2500, seed=3)
    path = os.path.join(args.out, "check.jsonl")
    write_jsonl(path, texts)
    ids = [f"t{i:07d}" for i in range(len(texts))]
    # .float(): transformers 5 loads a checkpoint in its stored dtype, and an f16 checkpoint would
    # make the "fp32" reference an fp16 one.
    # `model` stays the folder spotinfer is given; the peer gets its own name (rebinding `model`
    # and deleting it made the spotinfer runs below fail with UnboundLocalError).
    st = SentenceTransformer(st_model_dir, device="cuda").float()
    st.max_seq_length = 256
    assert next(st.parameters()).dtype == torch.float32
    reference = st.encode(texts, batch_size=64, normalize_embeddings=True, convert_to_numpy=True)
    st16 = st.half().encode(texts, batch_size=64, normalize_embeddings=True, convert_to_numpy=True)
    del st
    torch.cuda.empty_cache()
    result = {"texts": len(texts), "sentence_transformers_fp16": summary(cosines(st16, reference))}
    for precision in ["f32", "f16"]:
        out = os.path.join(args.out, f"spotinfer-{precision}.jsonl")
        run_spotinfer(args, ["embed", "--input", path, "--output", out, "--model", model,
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


def speed(args, model):
    """Each batch size: spotinfer (and its pinned and no-budget variants) against
    sentence-transformers fp16, alternated, `args.rounds` rounds, medians."""
    texts = corpus(args.records, seed=7)
    path = os.path.join(args.out, "bench.jsonl")
    write_jsonl(path, texts)
    rows = []
    for batch_size in args.batch_sizes:
        bench = ["bench", "--input", path, "--model", model, "--device", "cuda",
                 "--batch-size", str(batch_size)]
        variants = {"spotinfer": (bench, None)}
        for cpus in args.pin_cpus:
            variants[f"spotinfer_pinned_{cpus}"] = (bench, cpus)
        if args.compare_budget:
            variants["spotinfer_no_token_budget"] = (bench + ["--max-batch-tokens", "0"], None)
        runs = {name: [] for name in variants}
        runs["sentence_transformers"] = []
        for _ in range(args.rounds):
            for name, (cmd, pin) in variants.items():
                runs[name].append(bench_row(*run_spotinfer(args, cmd, pin)))
            cmd = [sys.executable, __file__, "st-bench", os.path.abspath(model), path, str(batch_size)]
            with GpuMemory() as mem:
                out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            runs["sentence_transformers"].append(bench_row(out, mem))
        row = {"model": os.path.basename(model.rstrip("/")), "batch_size": batch_size,
               "records": len(texts)}
        for side, rs in runs.items():
            keys = ["records_per_s", "tokens_per_s", "gpu_mib", "seconds", "gpu_utilisation",
                    "model_busy", "cpu_user_s"]
            row[side] = {k: statistics.median(r[k] for r in rs) for k in keys if k in rs[0]}
            row[side]["runs_records_per_s"] = [round(r["records_per_s"], 1) for r in rs]
        row["ratio"] = row["spotinfer"]["records_per_s"] / row["sentence_transformers"]["records_per_s"]
        # One profiled run (`--profile-device`: the device synchronised after each stage), for
        # where a batch's time goes: inputs to the device, the layers, results back.
        profiled = bench_row(*run_spotinfer(args, bench + ["--profile-device"]))
        row["spotinfer_profile"] = {k: profiled.get(k) for k in
                                    ["device_stages", "model_busy", "tokenize_seconds", "seconds"]}
        for cpus in args.pin_cpus:
            pinned = row[f"spotinfer_pinned_{cpus}"]
            pinned["of_unpinned"] = pinned["records_per_s"] / row["spotinfer"]["records_per_s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def targets(report):
    """The issue's targets, each with the figure it was judged on."""
    out = []
    for row in report.get("speed", []):
        where = f"{row['model']} batch {row['batch_size']}"
        out.append((f"{where}: >= 10x sentence-transformers fp16", row["ratio"], row["ratio"] >= 10))
        for key, side in row.items():
            if key.startswith("spotinfer_pinned_"):
                out.append((f"{where}: pinned to {key.rsplit('_', 1)[1]} CPUs, GPU utilisation >= 0.8",
                            side.get("gpu_utilisation"), side.get("gpu_utilisation", 0) >= 0.8))
                out.append((f"{where}: pinned to {key.rsplit('_', 1)[1]} CPUs, within 10% of unpinned",
                            side["of_unpinned"], side["of_unpinned"] >= 0.9))
    for model, c in report.get("correctness", {}).items():
        worst = c["spotinfer_f16"]["worst"]
        out.append((f"{model}: f16 worst cosine against fp32 >= 0.9999", worst, worst >= 0.9999))
    return [{"target": t, "figure": f, "met": bool(m)} for t, f, m in out]


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
    p.add_argument("--shapes", default="",
                   help="comma list of more model folders (bench/make_shape.py) to run beside --model")
    p.add_argument("--pin-cpus", default="",
                   help="comma list of CPU counts to also run spotinfer pinned to (taskset)")
    args = p.parse_args()
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.pin_cpus = [int(c) for c in args.pin_cpus.split(",") if c]
    models = [args.model] + [m for m in args.shapes.split(",") if m]
    os.makedirs(args.out, exist_ok=True)
    report = {"gpu": subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True).stdout.strip(),
              "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count()}
    if "correctness" not in args.skip:
        report["correctness"] = {}
        for model in models:
            name = os.path.basename(model.rstrip("/"))
            report["correctness"][name] = check_correctness(args, os.path.abspath(model), model)
            print(name, json.dumps(report["correctness"][name], indent=1), flush=True)
    if "speed" not in args.skip:
        report["speed"] = [row for model in models for row in speed(args, model)]
    report["targets"] = targets(report)
    for t in report["targets"]:
        print(("MET   " if t["met"] else "MISSED"), t["target"], t["figure"])
    with open(os.path.join(args.out, "gpu-report.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
