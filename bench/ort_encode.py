#!/usr/bin/env python3
"""The ONNX Runtime peer for `spotinfer bench`: the model exported to ONNX fp32 (bench/ort_export.py),
run by ONNX Runtime on the CPU, with the tokenizer, pooling and normalisation around it in Python.

    python bench/ort_encode.py --input corpus.jsonl [--batch-size 32] [--model DIR] [--onnx FILE]
        [--vectors OUT.jsonl]

- the session: ONNX Runtime's CPU provider, every graph optimisation (ORT_ENABLE_ALL), one
  intra-op thread per core (os.cpu_count()), sequential execution;
- tokenization: the model folder's tokenizer.json with the `tokenizers` library (the fast
  tokenizer sentence-transformers uses), truncated at the folder's max_seq_length, no padding;
- batching: every text tokenized, sorted by token count and cut into batches of --batch-size,
  each padded to its longest text only;
- pooling: what the folder's modules.json says (mean, CLS or max pooling from its Pooling
  config; Normalize if listed), in numpy; for all-MiniLM-L6-v2 that is the attention-masked mean
  and L2 normalisation, sentence-transformers' vectors for it. Folders with other modules
  (Dense, a default prompt) are refused rather than embedded differently.

Like bench/st_encode.py: reads the JSONL records, runs one untimed warm-up batch, then times the
whole encode (tokenization included) and prints one JSON object shaped like `spotinfer bench`'s
last line. --vectors writes {"id", "embedding"} per record, in input order, after the timing.
Without --onnx the model is exported first when .cache/bench/onnx has no up-to-date copy (not
timed; the session's creation is load_seconds).
"""
import argparse
import json
import os
import resource
import time

import numpy as np


def pooling_config(model_dir):
    """(max_seq_length, do_lower_case, pooling mode, normalize) from the folder's files, as
    sentence-transformers reads them."""
    with open(os.path.join(model_dir, "modules.json")) as f:
        modules = json.load(f)
    kinds = [m["type"].rsplit(".", 1)[-1] for m in modules]
    if kinds[:2] != ["Transformer", "Pooling"] or any(k != "Normalize" for k in kinds[2:]):
        raise SystemExit(f"{model_dir}: modules {kinds}: only Transformer, Pooling[, Normalize]")
    with open(os.path.join(model_dir, modules[1]["path"], "config.json")) as f:
        pool = json.load(f)
    modes = [m for m in ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens",
                         "weightedmean_tokens", "lasttoken") if pool.get(f"pooling_mode_{m}")]
    if len(modes) != 1 or modes[0] not in ("cls_token", "mean_tokens", "max_tokens"):
        raise SystemExit(f"{model_dir}: pooling {modes}: only one of cls, mean, max")
    with open(os.path.join(model_dir, "sentence_bert_config.json")) as f:
        sbert = json.load(f)
    st_path = os.path.join(model_dir, "config_sentence_transformers.json")
    if os.path.exists(st_path):
        with open(st_path) as f:
            if json.load(f).get("default_prompt_name"):
                raise SystemExit(f"{model_dir}: a default prompt is not supported here")
    return (int(sbert["max_seq_length"]), bool(sbert.get("do_lower_case", False)),
            modes[0], "Normalize" in kinds)


def make_session(onnx_path, threads=None):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = threads or os.cpu_count()
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(onnx_path, so, providers=["CPUExecutionProvider"])


class OrtEncoder:
    """Texts in, pooled vectors out, the way sentence-transformers' encode gives them."""

    def __init__(self, model_dir, onnx_path=None, threads=None):
        from tokenizers import Tokenizer

        if onnx_path is None:
            import ort_export

            onnx_path = ort_export.ensure(model_dir)
        self.max_seq_length, self.lower, self.mode, self.normalize = pooling_config(model_dir)
        self.tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        padding = self.tokenizer.padding  # the file's own settings (fixed 128 for this model)
        self.pad_id = padding["pad_id"] if padding else 0
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(self.max_seq_length)
        self.threads = threads or os.cpu_count()
        self.session = make_session(onnx_path, self.threads)
        self.inputs = {i.name for i in self.session.get_inputs()}
        self.tokens = 0  # real tokens of every text encoded so far

    def tokenize(self, texts):
        return self.tokenizer.encode_batch([t.lower() if self.lower else t for t in texts])

    def feeds(self, encodings):
        """One batch padded to its longest text: the session's int64 inputs."""
        n, width = len(encodings), max(len(e.ids) for e in encodings)
        ids = np.full((n, width), self.pad_id, dtype=np.int64)
        mask = np.zeros((n, width), dtype=np.int64)
        types = np.zeros((n, width), dtype=np.int64)
        for i, e in enumerate(encodings):
            k = len(e.ids)
            ids[i, :k] = e.ids
            mask[i, :k] = 1
            types[i, :k] = e.type_ids
        feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        return {k: v for k, v in feeds.items() if k in self.inputs}

    def pool(self, hidden, mask):
        if self.mode == "cls_token":
            v = hidden[:, 0]
        elif self.mode == "max_tokens":
            v = np.where(mask[:, :, None] > 0, hidden, np.float32(-1e9)).max(axis=1)
        else:
            m = mask.astype(np.float32)
            v = np.matmul(m[:, None, :], hidden)[:, 0] / np.maximum(m.sum(1, keepdims=True), 1e-9)
        if self.normalize:
            v = v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
        return v.astype(np.float32, copy=False)

    def encode(self, texts, batch_size=32):
        """Vectors for `texts`, in their order: all tokenized, sorted by token count (longest
        first), cut into batches of `batch_size`, each padded to its longest."""
        encodings = self.tokenize(texts)
        order = sorted(range(len(texts)), key=lambda i: -len(encodings[i].ids))
        out = None
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            feeds = self.feeds([encodings[i] for i in idx])
            hidden = self.session.run(["last_hidden_state"], feeds)[0]
            vectors = self.pool(hidden, feeds["attention_mask"])
            if out is None:
                out = np.empty((len(texts), vectors.shape[1]), dtype=np.float32)
            out[idx] = vectors
        self.tokens += sum(len(e.ids) for e in encodings)
        return out if out is not None else np.empty((0, 0), dtype=np.float32)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", help="sentence-transformers model folder (default: the package's)")
    p.add_argument("--onnx", help="exported model (default: bench/ort_export.py's, made if stale)")
    p.add_argument("--input", required=True)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--vectors", help="write {id, embedding} JSON lines here, in input order")
    args = p.parse_args()

    import onnxruntime

    model_dir = args.model
    if model_dir is None:
        from st_model import default_model

        model_dir = default_model()
    onnx_path = args.onnx
    if onnx_path is None:
        import ort_export

        onnx_path = ort_export.ensure(model_dir)
    t0 = time.perf_counter()
    enc = OrtEncoder(model_dir, onnx_path)
    load_seconds = time.perf_counter() - t0
    with open(args.input, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    texts = [r["text"] for r in records]

    enc.encode(texts[: args.batch_size], batch_size=args.batch_size)  # warm-up
    enc.tokens = 0
    before = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    vectors = enc.encode(texts, batch_size=args.batch_size)
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    tokens = enc.tokens

    if args.vectors:
        with open(args.vectors, "w", encoding="utf-8") as f:
            for r, v in zip(records, vectors):
                f.write(json.dumps({"id": r["id"], "embedding": v.tolist()}) + "\n")
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
        "threads": enc.threads,
        "onnxruntime": onnxruntime.__version__,
    }))


if __name__ == "__main__":
    main()
