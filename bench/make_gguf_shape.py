#!/usr/bin/env python3
"""Makes a random-weight GGUF of a Qwen2.5-0.5B-class shape in a llama.cpp quantisation type,
for speed figures of a model no hub can give us here (the generation benchmark's second model).

    .cache/llm-venv/bin/python bench/make_gguf_shape.py \\
        --tokenizer models/SmolLM2-135M-Instruct/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --out .cache/bench/qwen2-0.5b-shape.Q4_K_M.gguf --type Q4_K_M

The shape is Qwen2.5-0.5B's (qwen2 architecture: 24 layers, 896 wide, 14 query heads, 2 key/value
heads, 4,864 wide feed-forward, query/key/value biases, the embedding tied to the output, a
151,936-token vocabulary). The tokenizer and chat template are the given GGUF's (so the same
prompt ids serve both models), its vocabulary padded with tokens no text produces. Weights are
N(0, 0.02), norms 1; the end-of-text and other control tokens' embedding rows are zero, so greedy
decoding on random weights never picks them and every answer runs to the token limit on both
sides. The f16 file is then quantised by llama.cpp itself (`llama_model_quantize`, the
llama-cpp-python of bench/setup-llm.sh), which picks each tensor's type as for a real Qwen2.5
file (Q4_K_M: Q5_0 and Q8_0 where 896 inputs are not whole 256-blocks, Q4_K/Q6_K elsewhere).
The text means nothing; the work per token is a real model's of that shape.

With `--requantize GGUF` it makes no shape: llama.cpp requantises that file to the type asked
(for an agreement figure on real weights in a K format, e.g. SmolLM2's Q4_1 file as Q4_K_M;
what is lost in requantising is the file's own, and both sides read the same file).
"""
import argparse
import os
import tempfile

import gguf
import llama_cpp
import numpy as np

SHAPE = dict(layers=24, hidden=896, heads=14, kv_heads=2, ff=4864, vocab=151936)
TYPES = {"Q4_K_M": 15, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_K_M": 17, "Q6_K": 18}


def tokenizer_fields(path):
    """The source GGUF's tokenizer and chat template fields."""
    r = gguf.GGUFReader(path)
    f = {k: v.contents() for k, v in r.fields.items() if k.startswith("tokenizer.")}
    return f


def write_f16(out, tok, s, seed):
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(out, "qwen2")
    w.add_name("qwen2-0.5b-shape")
    w.add_block_count(s["layers"])
    w.add_context_length(32768)
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["ff"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(1)
    tokens = list(tok["tokenizer.ggml.tokens"])
    types = list(tok["tokenizer.ggml.token_type"])
    control = [i for i, t in enumerate(types) if t != 1]
    pad = s["vocab"] - len(tokens)
    tokens += [f"[PAD{i}]" for i in range(pad)]
    types += [1] * pad
    w.add_tokenizer_model(tok["tokenizer.ggml.model"])
    w.add_tokenizer_pre(tok["tokenizer.ggml.pre"])
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(list(tok["tokenizer.ggml.merges"]))
    for key in ["bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"]:
        if f"tokenizer.ggml.{key}" in tok:
            w.add_uint32(f"tokenizer.ggml.{key}", int(tok[f"tokenizer.ggml.{key}"]))
    w.add_add_bos_token(bool(tok.get("tokenizer.ggml.add_bos_token", False)))
    w.add_chat_template(tok["tokenizer.chat_template"])

    def normal(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    h, kv = s["hidden"], s["hidden"] // s["heads"] * s["kv_heads"]
    embedding = normal(s["vocab"], h)
    embedding[control] = 0
    w.add_tensor("token_embd.weight", embedding)
    ones = np.ones(h, dtype=np.float32)
    for n in range(s["layers"]):
        p = f"blk.{n}."
        w.add_tensor(p + "attn_norm.weight", ones)
        w.add_tensor(p + "attn_q.weight", normal(h, h))
        w.add_tensor(p + "attn_q.bias", normal(h).astype(np.float32))
        w.add_tensor(p + "attn_k.weight", normal(kv, h))
        w.add_tensor(p + "attn_k.bias", normal(kv).astype(np.float32))
        w.add_tensor(p + "attn_v.weight", normal(kv, h))
        w.add_tensor(p + "attn_v.bias", normal(kv).astype(np.float32))
        w.add_tensor(p + "attn_output.weight", normal(h, h))
        w.add_tensor(p + "ffn_norm.weight", ones)
        w.add_tensor(p + "ffn_gate.weight", normal(s["ff"], h))
        w.add_tensor(p + "ffn_up.weight", normal(s["ff"], h))
        w.add_tensor(p + "ffn_down.weight", normal(h, s["ff"]))
    w.add_tensor("output_norm.weight", ones)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def quantize(source, out, kind):
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = TYPES[kind]
    params.nthread = os.cpu_count() or 1
    params.allow_requantize = True
    if llama_cpp.llama_model_quantize(source.encode(), out.encode(), params) != 0:
        raise SystemExit(f"llama.cpp could not quantise {source} to {kind}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer")
    ap.add_argument("--requantize")
    ap.add_argument("--out", required=True)
    ap.add_argument("--type", default="Q4_K_M", choices=sorted(TYPES))
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.requantize:
        quantize(a.requantize, a.out, a.type)
    else:
        with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(a.out))) as tmp:
            f16 = os.path.join(tmp, "f16.gguf")
            write_f16(f16, tokenizer_fields(a.tokenizer), SHAPE, a.seed)
            quantize(f16, a.out, a.type)
    print(f"{a.out}: {os.path.getsize(a.out)} bytes")


if __name__ == "__main__":
    main()
