#!/usr/bin/env python3
"""The transformers side of the generation benchmark, on a random-weight Llama of SmolLM2-135M's
shape (30 layers, hidden 576, 9 heads over 3, feed-forward 1536; the fixtures' 600-token
tokenizer and chat template, so the output layer is small), in f32 on the CPU.

    python bench/llm_transformers.py --make DIR            # the model, saved by transformers
    python bench/llm_transformers.py DIR PROMPTS.json B N  # one timed run, one JSON line

A run generates N new tokens greedily for the first B prompts' chat turns in one batch (left
padding), end token ignored as in examples/llm_speed.rs' count, prefill included.
"""
import json
import shutil
import sys
import time
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "tests" / "fixtures" / "llm" / "models" / "llama"


def make(out):
    config = transformers.LlamaConfig(
        vocab_size=600, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=0,
        eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(out, safe_serialization=True)
    for f in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]:
        shutil.copy(TOKENIZER / f, Path(out) / f)


def run(path, prompts, b, n):
    torch.set_num_threads(2)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cases = json.load(open(prompts))["cases"][:b]
    texts = [tok.apply_chat_template(c["messages"], tokenize=False, add_generation_prompt=True)
             for c in cases]
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    seconds = time.perf_counter() - started
    tokens = (out.shape[1] - batch["input_ids"].shape[1]) * len(cases)
    print(json.dumps({"side": "transformers", "transformers": transformers.__version__,
                      "torch": torch.__version__.split("+")[0], "batch": b, "tokens": tokens,
                      "seconds": seconds, "tokens_per_s": tokens / seconds, "dtype": "float32",
                      "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    if sys.argv[1] == "--make":
        make(sys.argv[2])
    else:
        run(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
