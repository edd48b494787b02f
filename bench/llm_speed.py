#!/usr/bin/env python3
"""llama.cpp's generation speed on a GGUF, batched the way its `batched`/`parallel` examples
batch: B sequences in one llama_batch per step (each prompt whole on its first step, then one
token each), greedy, every sequence stopping at its end token or after N new tokens.

    .cache/llm-venv/bin/python bench/llm_speed.py GGUF PROMPTS.json B N THREADS [split]

PROMPTS.json: {"cases": [{"prompt_ids": [...]}, ...]} (bench/llm_greedy.py writes one; ids
tokenized by llama.cpp). Runs the first B prompts once together and prints one JSON line:
generated tokens, seconds (prompt processing included) and tokens/s. KV cache f16, llama.cpp's
default; one unified cache for all sequences (every sequence's attention masked over it), or
with `split` a cache of its own per sequence (`kv_unified` off, as llama-server runs slots).
"""
import ctypes
import json
import sys
import time

import llama_cpp
import numpy as np


@llama_cpp.llama_log_callback
def quiet(level, text, user_data):
    """llama.cpp's log, kept to errors (level 4)."""
    if level == 4:
        sys.stderr.write(text.decode("utf-8", "replace"))


def main():
    gguf, prompts, b, n, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    split = sys.argv[6:] == ["split"]
    cases = json.load(open(prompts))["cases"][:b]
    llama_cpp.llama_log_set(quiet, ctypes.c_void_p())
    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(gguf.encode(), mparams)
    vocab = llama_cpp.llama_model_get_vocab(model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    eos = llama_cpp.llama_vocab_eos(vocab)
    longest = max(len(c["prompt_ids"]) + n for c in cases)
    total = sum(len(c["prompt_ids"]) + n for c in cases)
    cparams = llama_cpp.llama_context_default_params()
    # Split: each sequence gets n_ctx / n_seq_max positions, so n_ctx fits the longest b times.
    cparams.n_ctx = (longest * b if split else total) + 64
    cparams.n_batch = total + 64
    cparams.n_ubatch = 512
    cparams.n_seq_max = b
    cparams.kv_unified = not split
    cparams.n_threads = threads
    cparams.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    batch = llama_cpp.llama_batch_init(total + 64, 0, b)
    pos = [0] * len(cases)
    last = [None] * len(cases)
    done = [False] * len(cases)
    generated = [0] * len(cases)
    started = time.perf_counter()
    first = True
    while not all(done):
        batch.n_tokens = 0
        rows = []
        for s, c in enumerate(cases):
            if done[s]:
                continue
            toks = c["prompt_ids"] if first else [last[s]]
            for j, t in enumerate(toks):
                i = batch.n_tokens
                batch.token[i] = t
                batch.pos[i] = pos[s] + j
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = s
                batch.logits[i] = j == len(toks) - 1
                batch.n_tokens += 1
            pos[s] += len(toks)
            rows.append((s, batch.n_tokens - 1))
        first = False
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")
        for s, i in rows:
            ptr = llama_cpp.llama_get_logits_ith(ctx, i)
            logits = np.ctypeslib.as_array(ptr, shape=(n_vocab,))
            tok = int(np.argmax(logits))
            last[s] = tok
            generated[s] += 1
            if tok == eos or generated[s] >= n:
                done[s] = True
    seconds = time.perf_counter() - started
    tokens = sum(generated)
    print(json.dumps({"side": "llama.cpp", "llama_cpp_python": llama_cpp.__version__, "batch": b,
                      "threads": threads, "tokens": tokens, "seconds": seconds,
                      "tokens_per_s": tokens / seconds, "kv": "f16",
                      "cache": "per sequence" if split else "unified"}))
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)


if __name__ == "__main__":
    main()
