#!/usr/bin/env python3
"""llama.cpp's greedy continuations of chat prompts on the SmolLM2 GGUF, for
examples/gguf_greedy.rs to compare candle's quantised model against, token by token.

    .cache/llm-venv/bin/python bench/llm_greedy.py N OUT.json [GGUF] [KV]   # N prompts from bench/real_corpus.py

GGUF: another file of SmolLM2's vocabulary and chat format (default the Q4_1 file).
KV: the KV cache's type, f32 (default) or f16 (llama.cpp's own default, and what spotinfer keeps
beside a GGUF's blocks: the like-for-like reference for that path).

Each prompt is a real text (Debian's fortunes in eight languages, WordNet, man pages) as the user
turn of SmolLM2's chat format, with the system turn its template adds when none is given;
llama.cpp tokenizes it (special tokens on) and decodes 32 tokens greedily (temperature 0), its KV
cache in f32 as spotinfer's f32 path keeps it unless KV says f16. Beside each token it keeps llama.cpp's
eight highest logits at that step (`top`: [id, logit] pairs), so that where another engine picks
another token, the gap llama.cpp itself saw between the two can be read off (a near-tie or not).
"""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GGUF = ROOT / "models" / "SmolLM2-135M-Instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
NEW_TOKENS = 32
# ggml's type ids: llama.cpp keeps its KV cache in f16 unless told.
KV_TYPES = {"f32": 0, "f16": 1}


def main():
    import llama_cpp
    n, out = int(sys.argv[1]), sys.argv[2]
    gguf = sys.argv[3] if len(sys.argv) > 3 else str(GGUF)
    kv = KV_TYPES[sys.argv[4] if len(sys.argv) > 4 else "f32"]
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=2048, n_threads=2, verbose=False,
                          type_k=kv, type_v=kv)
    lines = subprocess.run([sys.executable, str(ROOT / "bench" / "real_corpus.py"), str(n), "31"],
                           check=True, capture_output=True, text=True).stdout.splitlines()
    cases = []
    for line in lines:
        text = " ".join(json.loads(line)["text"].split()[:120])
        prompt = (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n"
                  "<|im_start|>assistant\n")
        ids = llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=True)
        llm.reset()
        got, top = [], []
        for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            got.append(tok)
            top.append(highest(llm, tok))
            if len(got) == NEW_TOKENS:
                break
        cases.append({"messages": [{"role": "user", "content": text}], "prompt_ids": ids,
                      "greedy": got, "top": top})
    Path(out).write_text(json.dumps({"llama_cpp_python": llama_cpp.__version__,
                                     "kv_type": kv, "cases": cases}) + "\n")


def highest(llm, tok, k=8):
    """llama.cpp's k highest logits of the step that chose `tok` (the last evaluated row, read
    before the token is fed back), highest first."""
    import numpy as np
    row = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
    best = np.argsort(row)[-k:][::-1]
    if int(best[0]) != tok and row[best[0]] > row[tok]:
        raise SystemExit(f"llama.cpp's logits do not give its own greedy token {tok}")
    return [[int(i), float(row[i])] for i in best]


if __name__ == "__main__":
    main()
