#!/usr/bin/env python3
"""llama.cpp teacher forced on greedy references (`bench/llm_greedy.py`), as
examples/gguf_greedy.rs forces spotinfer: each prompt and the reference's 32 tokens evaluated in
one pass, llama.cpp's argmax after each position compared with the reference's next token.

    .cache/llm-venv/bin/python bench/llama_forced.py GGUF REFERENCE.json [KV] > run.json

Why: it measures how far llama.cpp is from itself. Against references that the same build made
one token at a time, what is left is its batched evaluation (a prompt's rows go through other
kernels than one token's) against its one-token steps; against references of another build of
it (`bench/setup-llm.sh avx2`), its CPU builds' float orders. That is the scale on which an
engine's top-1 agreement with llama.cpp can be read at all. KV: the cache type, f32 (default)
or f16, as the references were made. The output is gguf_greedy's JSON fields that
`bench/agreement_pairs.py` reads (`agreed`: per prompt '1' where the argmax is the reference's).
"""
import json
import sys

import numpy as np

KV_TYPES = {"f32": 0, "f16": 1}


def main():
    import llama_cpp
    gguf, reference = sys.argv[1], sys.argv[2]
    kv = KV_TYPES[sys.argv[3] if len(sys.argv) > 3 else "f32"]
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=2048, n_threads=2, logits_all=True,
                          verbose=False, type_k=kv, type_v=kv)
    cases = json.loads(open(reference).read())["cases"]
    agreed, agree, positions, identical = [], 0, 0, 0
    for case in cases:
        prompt, want = case["prompt_ids"], case["greedy"]
        llm.reset()
        llm.eval(prompt + want)
        first = len(prompt) - 1
        rows = np.asarray(llm.scores[first:first + len(want)])
        marks = "".join("1" if int(np.argmax(r)) == t else "0" for r, t in zip(rows, want))
        agreed.append(marks)
        agree += marks.count("1")
        positions += len(marks)
        identical += "0" not in marks
    print(json.dumps({
        "side": "llama.cpp teacher forced",
        "llama_cpp_python": llama_cpp.__version__,
        "prompts": len(cases),
        "first_32_identical": identical,
        "top1_agreement": agree / max(positions, 1),
        "positions": positions,
        "precision": "llama.cpp",
        "agreed": agreed,
    }))


if __name__ == "__main__":
    main()
