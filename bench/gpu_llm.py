#!/usr/bin/env python3
"""The generation side of the GPU check (issue 52): random-weight decoder shapes, prompts, and
transformers' speed on the same GPU. bench/gpu_check.py calls it; spotinfer's side is
`spotinfer bench --backend paged`.

    python3 bench/gpu_llm.py make DIR smollm2-135m|qwen2-0.5b   # transformers saves the model
    python3 bench/gpu_llm.py prompts OUT.jsonl N [sampled]       # N chat prompts, one JSON a line
    python3 bench/gpu_llm.py transformers DIR PROMPTS.jsonl B N  # one timed bf16 run, one JSON line
    python3 bench/gpu_llm.py agree DIR PROMPTS.jsonl K N OUT.jsonl  # bf16 teacher-forced top-1 ids

The shapes are SmolLM2-135M's (30 layers, 576 wide, 9 heads over 3, feed-forward 1536) and
Qwen2-0.5B's (24 layers, 896 wide, 14 heads over 2, feed-forward 4864, Q/K/V biases), with
their vocabularies (49,152 and 151,936: the output layer and the device sampler are full size)
and the LLM fixtures' 600-token tokenizer and chat template (no hub is reachable there): ids past
the tokenizer's are generated and decode to nothing, on both sides alike. The prompts are the fixtures' real conversations, each
numbered so that no two are the same; `sampled` gives each a temperature of 0.8, top-p 0.95 and
top-k 50 (the device sampler's timing). transformers generates N new tokens greedily for B
prompts in one batch (left padding), the end token ignored, the prompts' reading included.
"""
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "llm"
SHAPES = {
    "smollm2-135m": dict(kind="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
                         tie_word_embeddings=True, vocab_size=49152),
    "qwen2-0.5b": dict(kind="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, rope_theta=1000000.0,
                       tie_word_embeddings=True, vocab_size=151936),
}


def make(out, shape):
    import torch
    import transformers
    s = dict(SHAPES[shape])
    kind = s.pop("kind")
    config_class = transformers.LlamaConfig if kind == "llama" else transformers.Qwen2Config
    config = config_class(max_position_embeddings=8192, rms_norm_eps=1e-6,
                          bos_token_id=0, eos_token_id=2, **s)
    torch.manual_seed(0)
    model_class = transformers.LlamaForCausalLM if kind == "llama" else transformers.Qwen2ForCausalLM
    model_class(config).eval().save_pretrained(out, safe_serialization=True)
    source = FIXTURES / "models" / kind
    for f in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]:
        shutil.copy(source / f, Path(out) / f)


# What a sampled prompt asks for (besides its seed, its number).
SAMPLED = dict(temperature=0.8, top_p=0.95, top_k=50)


def records(n, sampled=lambda i: False):
    """N chat records, the fixtures' conversations numbered; record i sampled if `sampled(i)`."""
    cases = [c for m in json.load(open(FIXTURES / "models.json"))["models"].values() for c in m]
    out = []
    for i in range(n):
        messages = [dict(m) for m in cases[i % len(cases)]["messages"]]
        messages[-1]["content"] = f"{i}. {messages[-1]['content']}"
        record = {"id": f"p{i:04}", "messages": messages}
        if sampled(i):
            record.update(SAMPLED, seed=i)
        out.append(record)
    return out


def prompts(out, n, sampled=False):
    with open(out, "w") as f:
        for record in records(n, lambda i: sampled):
            f.write(json.dumps(record) + "\n")


def run_transformers(path, prompts_path, b, n):
    import torch
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
    cases = [json.loads(line) for line in open(prompts_path)][:b]
    texts = [tok.apply_chat_template(c["messages"], tokenize=False, add_generation_prompt=True) for c in cases]
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to("cuda")
    with torch.no_grad():  # warm-up: kernels chosen, memory allocated
        model.generate(**batch, max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=tok.pad_token_id)
    torch.cuda.synchronize()
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    tokens = (out.shape[1] - batch["input_ids"].shape[1]) * len(cases)
    print(json.dumps({"side": "transformers", "transformers": transformers.__version__,
                      "torch": torch.__version__.split("+")[0], "batch": b, "tokens": tokens,
                      "seconds": seconds, "generated_tokens_per_s": tokens / seconds, "dtype": "bfloat16"}))


def agree_sequences(path, prompts_path, k, n, out):
    """transformers bf16's side of the teacher-forced agreement: for the first K prompts, N
    greedy tokens, then the whole sequence read in one pass and the argmax after each position
    from the prompt's last on; one line a sequence for `spotinfer models agree`."""
    import torch
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
    cases = [json.loads(line) for line in open(prompts_path)][:k]
    with open(out, "w") as f, torch.no_grad():
        for c in cases:
            text = tok.apply_chat_template(c["messages"], tokenize=False, add_generation_prompt=True)
            prompt = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"].to("cuda")
            full = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  pad_token_id=tok.pad_token_id)
            ids = full[0, :-1]
            top1 = model(ids[None]).logits[0, prompt.shape[1] - 1:].argmax(-1)
            f.write(json.dumps({"ids": ids.tolist(), "from": prompt.shape[1],
                                "top1": top1.tolist()}) + "\n")


if __name__ == "__main__":
    command = sys.argv[1]
    if command == "make":
        make(sys.argv[2], sys.argv[3])
    elif command == "prompts":
        prompts(sys.argv[2], int(sys.argv[3]), sys.argv[4:] == ["sampled"])
    elif command == "agree":
        agree_sequences(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    elif command == "transformers":
        run_transformers(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        raise SystemExit(f"gpu_llm.py: unknown command {command}")
