#!/usr/bin/env python3
"""Makes a random-weight copy of a BERT sentence-transformers folder with another shape, for speed
figures of models no hub can give us here (a 12-layer all-MiniLM-L12-v2 shape, a BERT-base shape).

    python3 bench/make_shape.py --from models/all-MiniLM-L6-v2 --out /tmp/minilm-l12 --layers 12
    python3 bench/make_shape.py --from models/all-MiniLM-L6-v2 --out /tmp/bert-base \
        --layers 12 --hidden 768 --heads 12 --intermediate 3072

The tokenizer, pooling, modules and limits are the source folder's; config.json gets the new
sizes; model.safetensors holds N(0, 0.02) weights (layer norms 1 and 0), as BERT initialises. The
vectors mean nothing; the work per token is a real model's of that shape. Standard library only
(numpy, where present, draws the weights faster).
"""
import argparse
import array
import json
import random
import shutil
from pathlib import Path

try:
    import numpy
except ImportError:
    numpy = None


def tensors(c):
    h, i = c["hidden_size"], c["intermediate_size"]
    out = [
        ("embeddings.word_embeddings.weight", [c["vocab_size"], h]),
        ("embeddings.position_embeddings.weight", [c["max_position_embeddings"], h]),
        ("embeddings.token_type_embeddings.weight", [c["type_vocab_size"], h]),
        ("embeddings.LayerNorm.weight", [h]),
        ("embeddings.LayerNorm.bias", [h]),
    ]
    for n in range(c["num_hidden_layers"]):
        p = f"encoder.layer.{n}."
        for name, shape in [
            ("attention.self.query", [h, h]),
            ("attention.self.key", [h, h]),
            ("attention.self.value", [h, h]),
            ("attention.output.dense", [h, h]),
            ("intermediate.dense", [i, h]),
            ("output.dense", [h, i]),
        ]:
            out += [(p + name + ".weight", shape), (p + name + ".bias", [shape[0]])]
        for ln in ["attention.output.LayerNorm", "output.LayerNorm"]:
            out += [(p + ln + ".weight", [h]), (p + ln + ".bias", [h])]
    return out


def values(name, count, rng):
    if name.endswith("LayerNorm.weight"):
        return array.array("f", [1.0]) * count
    if name.endswith(".bias") or name.endswith("LayerNorm.bias"):
        return array.array("f", [0.0]) * count
    if numpy is not None:  # a BERT-large shape in seconds rather than minutes
        return numpy.random.default_rng(rng.getrandbits(32)).normal(0.0, 0.02, count).astype("<f4")
    return array.array("f", (rng.gauss(0.0, 0.02) for _ in range(count)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--from", dest="src", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--intermediate", type=int)
    a = ap.parse_args()
    src, out = Path(a.src), Path(a.out)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = a.layers
    for key, value in [("hidden_size", a.hidden), ("num_attention_heads", a.heads),
                       ("intermediate_size", a.intermediate)]:
        if value:
            config[key] = value
    (out / "config.json").write_text(json.dumps(config, indent=2))
    pooling = out / "1_Pooling" / "config.json"
    if pooling.exists():
        p = json.loads(pooling.read_text())
        p["word_embedding_dimension"] = config["hidden_size"]
        pooling.write_text(json.dumps(p, indent=2))
    rng = random.Random(0)
    header, blobs, offset = {}, [], 0
    for name, shape in tensors(config):
        count = 1
        for d in shape:
            count *= d
        data = values(name, count, rng).tobytes()
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(out / "model.safetensors", "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for b in blobs:
            f.write(b)
    print(out)


if __name__ == "__main__":
    main()
