#!/usr/bin/env python3
"""Pair scoring (reranking) speed and accuracy: spotinfer's fused CPU encoder against ONNX Runtime
fp32 on a cross-encoder of ms-marco-MiniLM-L-6-v2's shape, side by side in one run.

    python bench/rerank.py [--spotinfer target/release/spotinfer] [--pairs 2000] [--rounds 5]
        [--batch-size 32] [--out .cache/bench/rerank.json]

(bench/rerank.sh installs what it needs and runs it.)

- the model: BertForSequenceClassification with one logit, 6 layers x 384, 12 heads, feed-forward
  1536, 512 positions, the uncased BERT vocabulary: ms-marco-MiniLM-L-6-v2's shape. No hub is
  reachable, so by default (--weights trained) its encoder is models/all-MiniLM-L6-v2's trained
  weights (the same MiniLM-L6-H384 architecture and vocabulary ms-marco-MiniLM-L-6-v2 was
  fine-tuned from) and its head random (transformers' init, seed 0) and widened so that the
  logits spread with a standard deviation of 1 over the first 64 pairs: the activations a
  reduced precision must hold are a trained encoder's, and the scores differ from pair to pair
  by more than rounding. --weights random: every weight random (transformers' init, seed 0),
  whose scores all sit within a hundredth of 0.5. Saved as a sentence-transformers 6.2
  CrossEncoder (Sigmoid);
- the pairs: real text nobody here wrote, Debian's `fortunes` package (fetched with
  apt-get download, unpacked under .cache/bench): a query (a fortune's first line, at most 12
  words) and a passage (the following fortunes) cut so that each pair lands at, or a token or
  two under, a length drawn uniformly from 64-256 tokens; deterministic for a seed;
- spotinfer: `spotinfer bench` (fused encoder, --precision f32, then bf16 where the CPU has
  AVX-512 BF16 and int8 where it has AVX-512 VNNI, one line each), tokenization included, pairs
  sorted by length into batches;
- ONNX Runtime: the model exported with torch.onnx.export (TorchScript exporter, opset 17,
  logits output), every graph optimisation, one intra-op thread per core; tokenization by the
  same fast tokenizer (pairs, longest_first) included in the time, pairs sorted by length into
  batches padded to their longest, sigmoid in numpy;
- ONNX Runtime int8: the same export through onnxruntime.quantization.quantize_dynamic (QInt8
  weights, activations quantised at run time), the peer's own int8, timed the same way;
- rounds alternate the sides (spotinfer, ORT, ORT int8, spotinfer, ...); each figure is the
  median;
- accuracy: every pair's score from `spotinfer embed` and from ONNX Runtime against
  CrossEncoder.predict (PyTorch fp32): largest and mean absolute difference, and the share of
  the pairs of records that both order alike (what a reranker's user sees).

Prints the CPU model, the kernels and precision each side ran, and the figures; writes them as
JSON to --out.
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from machine import cpu_flags, cpu_model
from real_corpus import unpacked

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORK = os.path.join(ROOT, ".cache", "bench", "rerank")


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def fortunes():
    """Every fortune of Debian's `fortunes` package (fetched once by bench/real_corpus.py)."""
    data = os.path.join(unpacked("fortunes"), "usr", "share", "games", "fortunes")
    out = []
    for name in sorted(os.listdir(data)):
        path = os.path.join(data, name)
        if "." in name or os.path.islink(path) or not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            for item in f.read().split("\n%\n"):
                text = " ".join(item.split())
                if len(text.split()) >= 4:
                    out.append(text)
    return out


def make_pairs(tokenizer, n, seed):
    rng = random.Random(seed)
    items = fortunes()
    pairs = []
    while len(pairs) < n:
        target = rng.randint(64, 256)
        i = rng.randrange(len(items))
        query = " ".join(items[i].split()[:12])
        words = []
        j = i + 1
        while True:
            words += items[j % len(items)].split()
            j += 1
            count = len(tokenizer(query, " ".join(words))["input_ids"])
            if count >= target:
                break
        # Drop words from the end until the pair fits its target.
        while len(words) > 1 and len(tokenizer(query, " ".join(words))["input_ids"]) > target:
            words.pop()
        pairs.append((query, " ".join(words)))
    return pairs


def make_model(out, weights, pairs):
    import torch
    import transformers
    from sentence_transformers import CrossEncoder

    if os.path.isfile(os.path.join(out, "model.safetensors")):
        return
    torch.manual_seed(0)
    minilm = os.path.join(ROOT, "models", "all-MiniLM-L6-v2")
    tok = transformers.AutoTokenizer.from_pretrained(minilm)
    tok.model_max_length = 512
    if weights == "trained":
        model = transformers.BertForSequenceClassification.from_pretrained(minilm, num_labels=1)
        x = tok([q for q, _ in pairs[:64]], [d for _, d in pairs[:64]], padding=True,
                truncation="longest_first", return_tensors="pt")
        with torch.no_grad():
            logits = model(**x).logits[:, 0]
            model.classifier.weight.mul_(1.0 / logits.std())
            model.classifier.bias.sub_((logits.mean() / logits.std()).item())
    else:
        config = transformers.BertConfig(vocab_size=tok.vocab_size, hidden_size=384,
                                         num_hidden_layers=6, num_attention_heads=12,
                                         intermediate_size=1536, max_position_embeddings=512,
                                         num_labels=1)
        model = transformers.BertForSequenceClassification(config)
    base = out + ".base"
    model.save_pretrained(base)
    tok.save_pretrained(base)
    CrossEncoder(base, device="cpu").save(out)
    subprocess.run(["rm", "-rf", base], check=True)


def export_onnx(model_dir, path):
    import torch
    import transformers

    if os.path.isfile(path):
        return
    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    x = tok(["a short query", "another"], ["a passage that is a little longer", "x"],
            padding=True, return_tensors="pt")
    with torch.no_grad():
        torch.onnx.export(model, (x["input_ids"], x["attention_mask"], x["token_type_ids"]), path,
                          input_names=["input_ids", "attention_mask", "token_type_ids"],
                          output_names=["logits"], opset_version=17, dynamo=False,
                          dynamic_axes={k: {0: "batch", 1: "sequence"} for k in
                                        ["input_ids", "attention_mask", "token_type_ids"]})


class OrtScorer:
    def __init__(self, model_dir, onnx_path):
        import onnxruntime as ort
        from tokenizers import Tokenizer

        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.intra_op_num_threads = os.cpu_count()
        self.session = ort.InferenceSession(onnx_path, opts, providers=["CPUExecutionProvider"])
        self.tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        self.tok.enable_truncation(512, strategy="longest_first")
        self.tok.no_padding()
        self.version = ort.__version__

    def score(self, pairs, batch_size):
        encs = self.tok.encode_batch(pairs)
        order = sorted(range(len(pairs)), key=lambda i: len(encs[i].ids))
        out = np.zeros(len(pairs), dtype=np.float32)
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            width = max(len(encs[i].ids) for i in idx)
            ids = np.zeros((len(idx), width), dtype=np.int64)
            types = np.zeros_like(ids)
            mask = np.zeros_like(ids)
            for row, i in enumerate(idx):
                e = encs[i]
                ids[row, :len(e.ids)] = e.ids
                types[row, :len(e.ids)] = e.type_ids
                mask[row, :len(e.ids)] = 1
            logits = self.session.run(["logits"], {"input_ids": ids, "attention_mask": mask,
                                                   "token_type_ids": types})[0][:, 0]
            out[idx] = 1.0 / (1.0 + np.exp(-logits))
        return out


def agreement(scores, reference):
    """How far `scores` are from the reference's: the largest and mean absolute difference, and,
    since a reranker's output is an order, the share of the pairs of pairs (every two of the
    records) that both put in the same order (Kendall's tau = 2 x share - 1), ties counted
    half."""
    diff = np.abs(scores - reference)
    a = np.sign(scores[:, None] - scores[None, :])
    b = np.sign(reference[:, None] - reference[None, :])
    upper = np.triu_indices(len(scores), 1)
    same = (a[upper] * b[upper] + 1) / 2
    return {"max": float(diff.max()), "mean": float(diff.mean()),
            "pairs_ordered_alike": float(same.mean())}


def spotinfer_bench(binary, model, pairs_file, batch_size, precision):
    out = subprocess.run([binary, "bench", "--model", model, "--input", pairs_file,
                          "--batch-size", str(batch_size), "--backend", "fused",
                          "--precision", precision], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def spotinfer_scores(binary, model, pairs_file, precision):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "scores.jsonl")
        subprocess.run([binary, "embed", "--model", model, "--input", pairs_file, "--output", out,
                        "--backend", "fused", "--precision", precision], check=True,
                       capture_output=True)
        with open(out) as f:
            return np.array([json.loads(line)["score"] for line in f], dtype=np.float64)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--spotinfer", default=os.path.join(ROOT, "target", "release", "spotinfer"))
    p.add_argument("--pairs", type=int, default=2000)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--weights", choices=["trained", "random"], default="trained")
    p.add_argument("--out", default=os.path.join(ROOT, ".cache", "bench", "rerank.json"))
    a = p.parse_args()
    os.makedirs(WORK, exist_ok=True)
    import transformers
    from sentence_transformers import CrossEncoder

    tok = transformers.AutoTokenizer.from_pretrained(os.path.join(ROOT, "models", "all-MiniLM-L6-v2"))
    tok.model_max_length = 512
    pairs = make_pairs(tok, a.pairs, a.seed)
    name = "ms-marco-MiniLM-L-6-v2-shape" + ("" if a.weights == "random" else "-trained-encoder")
    model = os.path.join(WORK, name)
    make_model(model, a.weights, pairs)
    onnx_path = os.path.join(WORK, name + ".onnx")
    export_onnx(model, onnx_path)
    lengths = [len(tok(q, d)["input_ids"]) for q, d in pairs]
    pairs_file = os.path.join(WORK, f"pairs-{a.pairs}-{a.seed}.jsonl")
    with open(pairs_file, "w") as f:
        for i, (q, d) in enumerate(pairs):
            f.write(json.dumps({"id": f"p{i}", "text": q, "text_pair": d}) + "\n")
    log(f"{len(pairs)} pairs, {min(lengths)}-{max(lengths)} tokens (mean {statistics.mean(lengths):.0f})")

    reference = CrossEncoder(model, device="cpu").predict(pairs, batch_size=a.batch_size)
    ort = OrtScorer(model, onnx_path)
    ort_scores = ort.score(pairs, a.batch_size)
    # ONNX Runtime's own int8: its dynamic quantisation (int8 weights per tensor, activations
    # quantised per tensor at run time), the peer's answer to spotinfer's int8.
    from onnxruntime.quantization import QuantType, quantize_dynamic
    onnx_int8 = os.path.join(WORK, name + "-int8.onnx")
    if not os.path.isfile(onnx_int8):
        quantize_dynamic(onnx_path, onnx_int8, weight_type=QuantType.QInt8)
    ort8 = OrtScorer(model, onnx_int8)
    flags = cpu_flags()
    precisions = (["f32"] + (["bf16"] if "avx512_bf16" in flags else [])
                  + (["int8"] if "avx512_vnni" in flags else []))
    scores = {"onnxruntime": ort_scores, "onnxruntime-int8": ort8.score(pairs, a.batch_size)}
    for prec in precisions:
        scores[f"spotinfer-{prec}"] = spotinfer_scores(a.spotinfer, model, pairs_file, prec)
    accuracy = {k: agreement(v, reference) for k, v in scores.items()}

    runs = {f"spotinfer-{prec}": [] for prec in precisions}
    runs["onnxruntime"] = []
    runs["onnxruntime-int8"] = []
    ort.score(pairs[: a.batch_size], a.batch_size)  # warm-up
    device = {}
    for r in range(a.rounds):
        for prec in precisions:
            report = spotinfer_bench(a.spotinfer, model, pairs_file, a.batch_size, prec)
            runs[f"spotinfer-{prec}"].append(report["records_per_s"])
            device[f"spotinfer-{prec}"] = report["device"]
        for side, scorer in [("onnxruntime", ort), ("onnxruntime-int8", ort8)]:
            started = time.perf_counter()
            scorer.score(pairs, a.batch_size)
            runs[side].append(len(pairs) / (time.perf_counter() - started))
        log(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in runs.items()))
    device["onnxruntime"] = f"onnxruntime {ort.version} CPUExecutionProvider fp32, " \
                            f"{os.cpu_count()} intra-op threads"
    device["onnxruntime-int8"] = f"onnxruntime {ort.version} CPUExecutionProvider, " \
                                 f"quantize_dynamic QInt8, {os.cpu_count()} intra-op threads"
    median = {k: statistics.median(v) for k, v in runs.items()}
    result = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "pairs": len(pairs),
        "tokens": {"min": min(lengths), "max": max(lengths), "mean": statistics.mean(lengths)},
        "batch_size": a.batch_size,
        "rounds": a.rounds,
        "records_per_s_median": median,
        "records_per_s": runs,
        "ran": device,
        "vs_onnxruntime": {k: median[k] / median["onnxruntime"] for k in median if k != "onnxruntime"},
        "reference_scores": {"min": float(reference.min()), "max": float(reference.max()),
                             "std": float(reference.std())},
        "vs_crossencoder": accuracy,
    }
    print(f"CPU: {result['cpu']} ({result['cores']} cores); CrossEncoder's scores "
          f"{reference.min():.3f}-{reference.max():.3f}, std {reference.std():.3f}")
    for k in median:
        acc = accuracy[k]
        ratio = "" if k == "onnxruntime" else f"  {result['vs_onnxruntime'][k]:.2f}x ONNX Runtime fp32"
        print(f"{k:16} {median[k]:8.1f} pairs/s{ratio}  |score - CrossEncoder| max {acc['max']:.1e} "
              f"mean {acc['mean']:.1e}, pairs ordered alike {acc['pairs_ordered_alike']:.4f}  "
              f"({device[k]})")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
