#!/usr/bin/env python3
"""Exports a sentence-transformers model folder's Transformer to ONNX fp32, for the ONNX Runtime
peer (bench/ort_encode.py, `bench/py_worker.py --engine ort`).

    python bench/ort_export.py [--model DIR] [--out PATH] [--exporter torchscript|dynamo] [--force]

- what is exported: the folder's transformers model (the Transformer module of its modules.json)
  as sentence-transformers loads it, in eval mode, fp32: inputs input_ids, attention_mask and
  token_type_ids (int64, batch x sequence), output last_hidden_state (batch x sequence x
  hidden). Both axes are dynamic. Pooling and normalisation stay outside the graph (numpy, in
  ort_encode.py), so the graph is the same whatever the folder's pooling is;
- how: `torch.onnx.export`, opset 17, with the TorchScript exporter by default (what Hugging
  Face Optimum's ONNX export uses, and the graph ONNX Runtime's CPU fusions ran faster here);
  `--exporter dynamo` takes torch.export's instead. The example batch has a padded row, so the
  attention mask's path is what gets traced;
- where: --out, default .cache/bench/onnx/<model folder name>/model.onnx, weights inside the
  file, with export.json beside it naming what it was made from. A file newer than the weights
  and made from the same folder, weights, torch version, opset and exporter is kept (--force
  exports anyway);
- the check, after each export: ONNX Runtime's last_hidden_state against PyTorch's on a few
  texts (padded together, and each alone), on the real tokens, and the pooled vectors of
  ort_encode.py against sentence-transformers' `encode`; the largest absolute differences are
  printed, and more than 1e-4 in either fails the export (the file is removed).

PyTorch and sentence-transformers are imported only to export: a caller that finds the file up
to date (`ensure`) loads neither.
"""
import argparse
import json
import os
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OPSET = 17
INPUTS = ["input_ids", "attention_mask", "token_type_ids"]
OUTPUT = "last_hidden_state"
TOLERANCE = 1e-4
EXPORTERS = ("torchscript", "dynamo")
# A few texts for the check: short, mixed, and one past the 256-token limit (truncated).
CHECK_TEXTS = [
    "a",
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings are written to PostgreSQL after the batch commits; the messages are acked last.",
    "naïve café résumé: 東京は日本の首都です。 emoji 🚀 and symbols ≥ ≤ → 3.14159 0xFF",
    "fn main() { println!(\"{}\", 1 + 2); } SELECT id FROM embeddings WHERE job = 'a';",
    " ".join(["the worker pulls a batch of records, embeds them and commits the rows"] * 40),
]


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def default_output(model_dir):
    name = os.path.basename(os.path.normpath(os.path.abspath(model_dir)))
    return os.path.join(ROOT, ".cache", "bench", "onnx", name, "model.onnx")


def weights_file(model_dir):
    for name in ("model.safetensors", "pytorch_model.bin"):
        path = os.path.join(model_dir, name)
        if os.path.exists(path):
            return path
    raise SystemExit(f"{model_dir}: no model.safetensors or pytorch_model.bin")


def stamp(model_dir, exporter):
    """What an exported file was made from; a file whose stamp differs is made again."""
    import importlib.metadata as md

    weights = weights_file(model_dir)
    st = os.stat(weights)
    return {"model": os.path.abspath(model_dir), "weights": os.path.basename(weights),
            "weights_bytes": st.st_size, "weights_mtime_ns": st.st_mtime_ns,
            "torch": md.version("torch"), "opset": OPSET, "exporter": exporter,
            "inputs": INPUTS, "output": OUTPUT}


def up_to_date(model_dir, out, exporter):
    side = os.path.join(os.path.dirname(out), "export.json")
    if not (os.path.exists(out) and os.path.exists(side)):
        return False
    if os.path.getmtime(out) <= os.path.getmtime(weights_file(model_dir)):
        return False
    try:
        with open(side) as f:
            return json.load(f) == stamp(model_dir, exporter)
    except (OSError, ValueError):
        return False


def hidden_states(auto_model):
    """The transformers model with positional inputs and one output, as the graph takes them."""
    import torch

    class HiddenStates(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.model(input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids).last_hidden_state

    return HiddenStates(auto_model).eval()


def export(model_dir, out, exporter="torchscript"):
    """Writes `out` (and export.json beside it) from the folder's Transformer; returns seconds."""
    import torch
    from st_model import load_model

    torch.manual_seed(0)
    started = time.perf_counter()
    st = load_model(model_dir)
    auto = st[0].auto_model.float().eval()
    wrapper = hidden_states(auto)
    # Two rows of 16 tokens, the second padded from position 9: the mask's path is traced.
    vocab = auto.config.vocab_size
    input_ids = torch.arange(100, 132, dtype=torch.long).reshape(2, 16) % vocab
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 9:] = 0
    token_type_ids = torch.zeros_like(input_ids)
    example = (input_ids, attention_mask, token_type_ids)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = f"{out}.tmp-{os.getpid()}"
    with torch.no_grad(), warnings.catch_warnings():
        # The tracer's notes on Python booleans and the TorchScript exporter's deprecation: the
        # check below is what says whether the graph is right.
        warnings.simplefilter("ignore")
        if exporter == "torchscript":
            axes = {name: {0: "batch", 1: "sequence"} for name in INPUTS + [OUTPUT]}
            torch.onnx.export(wrapper, example, tmp, input_names=INPUTS, output_names=[OUTPUT],
                              opset_version=OPSET, dynamo=False, dynamic_axes=axes,
                              do_constant_folding=True)
        elif exporter == "dynamo":
            batch = torch.export.Dim("batch", min=1, max=65536)
            seq = torch.export.Dim("sequence", min=1, max=auto.config.max_position_embeddings)
            shapes = {name: {0: batch, 1: seq} for name in INPUTS}
            torch.onnx.export(wrapper, example, tmp, input_names=INPUTS, output_names=[OUTPUT],
                              opset_version=OPSET, dynamo=True, dynamic_shapes=shapes,
                              external_data=False, verbose=False)
        else:
            raise SystemExit(f"unknown exporter {exporter!r}: one of {', '.join(EXPORTERS)}")
    os.replace(tmp, out)
    with open(os.path.join(os.path.dirname(out), "export.json"), "w") as f:
        json.dump(stamp(model_dir, exporter), f, indent=2)
    return time.perf_counter() - started


def check(model_dir, onnx_path, texts=CHECK_TEXTS):
    """Largest absolute differences of ONNX Runtime against PyTorch: (hidden states on real
    tokens, pooled vectors of ort_encode.py against sentence-transformers' encode)."""
    import numpy as np
    import torch
    from ort_encode import OrtEncoder
    from st_model import load_model

    st = load_model(model_dir)
    wrapper = hidden_states(st[0].auto_model.float().eval())
    enc = OrtEncoder(model_dir, onnx_path)
    hidden = 0.0
    # Padded together, then each text alone (a batch with no padding at all).
    for group in [texts] + [[t] for t in texts]:
        feeds = enc.feeds(enc.tokenize(group))
        out = enc.session.run([OUTPUT], feeds)[0]
        with torch.no_grad():
            ref = wrapper(*(torch.from_numpy(feeds[name]) for name in INPUTS)).numpy()
        mask = feeds["attention_mask"].astype(bool)
        hidden = max(hidden, float(np.abs(out[mask] - ref[mask]).max()))
    ref = st.encode(texts, batch_size=len(texts), convert_to_numpy=True)
    vectors = float(np.abs(enc.encode(texts, batch_size=len(texts)) - ref).max())
    return hidden, vectors


def ensure(model_dir, out=None, exporter="torchscript", force=False):
    """The exported file for `model_dir`, exported and checked first when missing or stale."""
    out = out or default_output(model_dir)
    if not force and up_to_date(model_dir, out, exporter):
        return out
    log(f"exporting {model_dir} to {out} ({exporter}, opset {OPSET})")
    seconds = export(model_dir, out, exporter)
    hidden, vectors = check(model_dir, out)
    log(f"exported in {seconds:.1f} s; ONNX Runtime vs PyTorch max abs diff: last_hidden_state "
        f"{hidden:.3g}, pooled vectors {vectors:.3g} (tolerance {TOLERANCE:g})")
    if not (hidden <= TOLERANCE and vectors <= TOLERANCE):
        os.remove(out)
        raise SystemExit(f"{out}: ONNX Runtime differs from PyTorch by more than {TOLERANCE:g}")
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="sentence-transformers model folder (default: the package's)")
    p.add_argument("--out", help="ONNX file (default: .cache/bench/onnx/<folder name>/model.onnx)")
    p.add_argument("--exporter", choices=EXPORTERS, default="torchscript")
    p.add_argument("--force", action="store_true", help="export even when the file is up to date")
    p.add_argument("--check", action="store_true", help="check an up-to-date file too")
    a = p.parse_args()
    from st_model import default_model

    model = a.model or default_model()
    out = a.out or default_output(model)
    if not a.force and up_to_date(model, out, a.exporter):
        log(f"{out} is up to date")
        if a.check:
            hidden, vectors = check(model, out)
            log(f"ONNX Runtime vs PyTorch max abs diff: last_hidden_state {hidden:.3g}, "
                f"pooled vectors {vectors:.3g} (tolerance {TOLERANCE:g})")
            if not (hidden <= TOLERANCE and vectors <= TOLERANCE):
                raise SystemExit(f"{out}: ONNX Runtime differs from PyTorch by more than {TOLERANCE:g}")
    else:
        ensure(model, out, a.exporter, force=True)
    print(out)


if __name__ == "__main__":
    main()
