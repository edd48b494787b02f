#!/usr/bin/env python3
"""The generation benchmark of docs/benchmarks.md ("Generation"): bench/llm.sh runs it.

Three parts, each printed and written to the JSON given with --out:

1. Exactness on the SmolLM2-135M-Instruct GGUF against llama.cpp: examples/gguf_greedy.rs on
   llama.cpp's greedy continuations (bench/llm_greedy.py, KV cache in f32).
2. Speed, side by side, alternated, medians of --rounds: generated tokens/s (prompt reading
   included), each side in its own process on the same prompts (real texts as chat turns):
   - spotinfer (examples/llm_speed.rs) against llama.cpp (bench/llm_speed.py, with its cache
     unified and per sequence: the better one counts) on the GGUF, at batch 1, 8 and 32;
   - spotinfer against transformers (bench/llm_transformers.py, f32) on a random-weight
     SmolLM2-135M-shaped Llama folder, at batch 1 and 8.
3. Resumption: a job of --resume-prompts prompts run by one worker that gets a SIGTERM every
   --sigterm-every seconds and is started again, against the same job run without SIGTERMs:
   at the SIGTERMs, the tokens the interrupted answers held and those generated since their
   last checkpoint (starting over would generate at least these again; with resumption none
   is), and whether every completion equals the uninterrupted one.

--parts picks which of exactness, speed and resumption run; with --out naming an existing
file, the parts not run keep their earlier figures.
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import machine  # noqa: E402

GGUF = ROOT / "models" / "SmolLM2-135M-Instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def json_line(cmd, env=None):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def speed(a, prompts):
    rows = {}
    sides = {
        "spotinfer": lambda m, b: json_line([a.llm_speed, str(m), prompts, str(b), str(a.new_tokens)]),
        "llama.cpp unified": lambda m, b: json_line([a.llm_python, "bench/llm_speed.py", str(m), prompts, str(b), str(a.new_tokens), "2"]),
        "llama.cpp per sequence": lambda m, b: json_line([a.llm_python, "bench/llm_speed.py", str(m), prompts, str(b), str(a.new_tokens), "2", "split"]),
        "transformers": lambda m, b: json_line([a.bench_python, "bench/llm_transformers.py", str(m), prompts, str(b), str(a.new_tokens)]),
    }
    plan = [(GGUF, b, ["spotinfer", "llama.cpp unified", "llama.cpp per sequence"]) for b in (1, 8, 32)]
    plan += [(Path(a.random_model), b, ["spotinfer", "transformers"]) for b in (1, 8)]
    for r in range(a.rounds):
        for model, b, names in plan:
            for name in names:
                got = sides[name](model, b)
                key = f"{model.name} batch {b} {name}"
                rows.setdefault(key, []).append(got["tokens_per_s"])
                print(f"round {r + 1}: {key}: {got['tokens_per_s']:.1f} tokens/s", file=sys.stderr)
    medians = {k: statistics.median(v) for k, v in rows.items()}
    return {"runs": rows, "median_tokens_per_s": medians}


def worker_env(db, name, model):
    env = dict(os.environ)
    env.update({"DATABASE_URL": db, "SPOTINFER_TOPIC": f"t-{name}", "SPOTINFER_SUBSCRIPTION": f"s-{name}",
                "GOOGLE_CLOUD_PROJECT": "spotinfer-bench", "SPOTINFER_MODEL": str(model), "RUST_LOG": "info"})
    return env


def run_job(a, lines, name, sigterm_every):
    """Runs the job to completion, a SIGTERM every `sigterm_every` seconds (0: none); returns the
    export's rows by id and what the worker logs said about checkpoints."""
    work = tempfile.mkdtemp()
    db = f"sqlite:{work}/g.db"
    env = worker_env(db, name, GGUF)
    spot = [a.spotinfer]
    subprocess.run(spot + ["setup"], env=env, check=True, capture_output=True)
    path = Path(work) / "in.jsonl"
    path.write_text("".join(json.dumps(l) + "\n" for l in lines))
    subprocess.run(spot + ["publish", str(path), "--job", name], env=env, check=True, capture_output=True)
    held = new = resumed = sigterms = 0
    started = time.perf_counter()
    while True:
        log = Path(work) / f"worker-{sigterms}.log"
        with open(log, "w") as err:
            p = subprocess.Popen(spot + ["work", "--batch-size", str(a.batch), "--exit-when-job-complete", name,
                                         "--job-poll", "1s"], env=env, stdout=subprocess.DEVNULL, stderr=err)
            try:
                p.wait(timeout=sigterm_every or None)
                done = True
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGTERM)
                p.wait()
                sigterms += 1
                done = False
        for line in log.read_text().splitlines():
            if "generations interrupted by the shutdown" in line:
                held += int(line.split("tokens_held=")[1].split()[0])
                new += int(line.split("tokens_new=")[1].split()[0])
            if "resuming generations" in line:
                resumed += int(line.split("records=")[1].split()[0])
        if done:
            break
    seconds = time.perf_counter() - started
    out = Path(work) / "out.jsonl"
    subprocess.run(spot + ["export", "--job", name, "--output", str(out)], env=env, check=True, capture_output=True)
    rows = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    return rows, {"sigterms": sigterms, "tokens_held_at_sigterms": held,
                  "tokens_new_since_last_checkpoint": new, "resumptions": resumed, "seconds": seconds}


def resumption(a):
    cases = json.load(open(a.prompts))["cases"][: a.resume_prompts]
    lines = []
    for i, c in enumerate(cases):
        line = {"id": f"r-{i:03}", "messages": c["messages"], "max_new_tokens": a.resume_tokens}
        if i % 2:
            line.update({"temperature": 0.8, "top_p": 0.9})
        lines.append(line)
    plain, plain_stats = run_job(a, lines, f"plain{os.getpid()}", 0)
    plain_seconds = plain_stats["seconds"]
    cut, stats = run_job(a, lines, f"cut{os.getpid()}", a.sigterm_every)
    equal = sum(plain[k]["text"] == cut[k]["text"] for k in plain)
    generated = sum(r["completion_tokens"] for r in plain.values())
    stats.update({"records": len(lines), "completions_equal_to_uninterrupted": equal,
                  "tokens_generated": generated,
                  "uninterrupted_seconds": plain_seconds,
                  "new_tokens_saved_per_generated_token": stats["tokens_new_since_last_checkpoint"] / max(generated, 1)})
    print(f"resumption: {stats}", file=sys.stderr)
    return stats


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--spotinfer", required=True)
    p.add_argument("--llm-speed", required=True)
    p.add_argument("--gguf-greedy", required=True)
    p.add_argument("--llm-python", required=True)
    p.add_argument("--bench-python", required=True)
    p.add_argument("--random-model", required=True)
    p.add_argument("--prompts", required=True, help="bench/llm_greedy.py's output")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--resume-prompts", type=int, default=32)
    p.add_argument("--resume-tokens", type=int, default=96)
    p.add_argument("--sigterm-every", type=float, default=6.0)
    p.add_argument("--parts", default="exactness,speed,resumption")
    p.add_argument("--out")
    a = p.parse_args()
    parts = a.parts.split(",")
    result = json.loads(Path(a.out).read_text()) if a.out and Path(a.out).exists() else {}
    result.update({"machine": machine.describe(), "cores": os.cpu_count()})
    if "exactness" in parts:
        result["exactness"] = json_line([a.gguf_greedy, str(GGUF), a.prompts])
        print(f"exactness: { {k: v for k, v in result['exactness'].items() if k != 'first_disagreement_logit_gaps'} }", file=sys.stderr)
    if "speed" in parts:
        result["speed"] = speed(a, a.prompts)
    if "resumption" in parts:
        result["resumption"] = resumption(a)
    print(json.dumps(result, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
