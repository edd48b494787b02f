#!/usr/bin/env python3
"""The CPU decoder in f32 against bf16 (AMX tiles, or AVX-512 BF16), side by side, alternated.

    python bench/llm_precision.py --llm-speed target/release/examples/llm_speed \
        --gguf-greedy target/release/examples/gguf_greedy [--rounds 3] [--batches 1,8,32]

Speed: examples/llm_speed.rs on the SmolLM2-135M-Instruct GGUF (scripts/fetch-llm.sh) and the
40 real chat prompts of tests/fixtures/llm/llama_cpp_greedy.json, 64 new tokens each, at each
batch size, f32 and bf16 alternated (the order swapped every round), medians of generated
tokens/s (reading the prompts included). Agreement: examples/gguf_greedy.rs in both precisions
against llama.cpp's greedy tokens for the same prompts (top-1 agreement over every position,
prompts whose 32 tokens are all identical). Prints the CPU, the kernels and precision each run
reported, and one JSON object last.
"""
import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import machine  # noqa: E402

GGUF = ROOT / "models" / "SmolLM2-135M-Instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = ROOT / "tests" / "fixtures" / "llm" / "llama_cpp_greedy.json"


def last_json(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--llm-speed", required=True)
    p.add_argument("--gguf-greedy", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--out")
    args = p.parse_args()
    precisions = ["f32", "bf16"]
    result = {"machine": machine.describe(), "speed": {}, "agreement": {}}
    print(f"cpu: {result['machine']}", flush=True)
    for precision in precisions:
        a = last_json([args.gguf_greedy, str(GGUF), str(PROMPTS), precision])
        result["agreement"][precision] = {
            k: a[k] for k in ("top1_agreement", "positions", "first_32_identical", "prompts",
                              "kernels", "precision")
        }
        print(f"agreement with llama.cpp, {precision}: {result['agreement'][precision]}", flush=True)
    for batch in [int(b) for b in args.batches.split(",")]:
        runs = {p: [] for p in precisions}
        for r in range(args.rounds):
            for precision in precisions if r % 2 == 0 else precisions[::-1]:
                s = last_json([args.llm_speed, str(GGUF), str(PROMPTS), str(batch),
                               str(args.new_tokens), precision])
                runs[precision].append(s["tokens_per_s"])
                print(f"batch {batch} round {r + 1} {precision} ({s['kernels']}): "
                      f"{s['tokens_per_s']:.1f} tokens/s", flush=True)
        medians = {p: statistics.median(v) for p, v in runs.items()}
        result["speed"][batch] = {"runs": runs, "median": medians,
                                  "bf16_over_f32": medians["bf16"] / medians["f32"]}
        print(f"batch {batch}: f32 {medians['f32']:.1f}, bf16 {medians['bf16']:.1f} tokens/s, "
              f"bf16 {medians['bf16'] / medians['f32']:.2f}x", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
