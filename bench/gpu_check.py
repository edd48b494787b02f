#!/usr/bin/env python3
"""The GPU check of the unpadded encoder (issue 51) and the paged decoder (issue 52);
bench/gpu-check.sh makes the shapes and calls it.

    python3 bench/gpu_check.py --bin BIN --device cuda|cpu --shapes DIR,DIR --out DIR \
        [--records 10000] [--batch-sizes 64,256] [--rounds 2] [--minutes 7.5]

1. kernels: `spotinfer models kernels` on each shape: every operation on the device against its
   CPU reference, f32/f16/bf16; a failure fails the check.
2. vectors: the unpadded encoder's f32 and f16 vectors, f16 with CUDA graphs per bucket
   (`--backend unpadded-graphs`), and the default CUDA path's f16, against
   sentence-transformers fp32 on the same GPU (on the CPU, where CI has no PyTorch: against the
   padded candle encoder's f32); f32 must reach cosine 0.99999 and f16 0.9999 on every text.
3. image towers: `spotinfer models kernels` on the repository's random-weight CLIP and ViT
   fixtures: their image towers on the unpadded operations (`--backend unpadded`) on the device
   in f32 and f16 against candle's towers in f32 on the CPU, over generated probe pictures
   (largest difference relative to the largest output: 1e-5 in f32, 1e-2 in f16).
4. paged KV cache (issue 52's GPU decoder, its first parts): `spotinfer models kernels --paged`:
   the cache's writes (exact) and attention against their CPU references at the SmolLM2-135M and
   Qwen2-0.5B shapes, and one sequence's outputs read whole, in chunks and decoded beside others
   on the device itself (bit for bit); the paged decoder on the repository's random-weight
   Llama, Qwen2 and Qwen3 fixtures in f32 on the device: greedy tokens against transformers'
   (models.json), and 64 prompts' logits, and the next step's, alone against the same in one
   batch and in chunks of 17 (bit for bit).
5. speed: the default path (`--backend candle`), `--backend unpadded`, `--backend
   unpadded-graphs` and, on a GPU,
   sentence-transformers fp16, alternated, medians of tokens/s and the GPU's busy share
   (nvidia-smi), and one profiled unpadded run (`--profile-device`). Runs past `--minutes` are
   left out and named as unmeasured, so the whole check stays within its time.
6. generation speed (run before step 5, so the time left goes to the encoders):
   `spotinfer bench --backend paged` beside transformers bf16 (bench/gpu_llm.py)
   greedy at each batch size, and sampled on the device at the largest (its cost beside greedy)
   on random-weight SmolLM2-135M and Qwen2-0.5B shapes at batches 1, 64 and 256, 128 new tokens
   (on the CPU: the fixture Llama at batches 1 and 4, 8 new tokens, spotinfer alone).
7. the paged decoder's teacher-forced top-1 agreement: on a GPU with transformers bf16
   on the same GPU (16 prompts, 64 tokens: `spotinfer models agree`), reported; on the CPU with
   the fixtures' transformers f32 greedy tokens, where every one must agree.
8. the default decoder: `spotinfer bench` on the first generation shape without `--backend`,
   8 records of which 4 are constrained by a regular expression: the paged decoder must load
   on CUDA (the CPU decoder on the CPU), and no record may be refused.
9. a generation job with SIGTERMs mid-answer (bench/gpu_job.py): the first generation shape
   answers 200 prompts of up to 128 new tokens (on the CPU: the fixture Llama on the paged
   decoder, 24 of up to 256) through the worker, the Pub/Sub emulator and SQLite, once
   uninterrupted and once with workers SIGTERMed mid-answer; every answer must be the
   uninterrupted one and at least one must have resumed from a checkpoint. On a machine
   without Java the emulator runs from an unpacked `scripts/pubsub-emulator.sh pack`
   (`--emulator-dir`); where none starts, the job is unmeasured.
Writes OUT/gpu-check.json with the issue's targets, each met, missed or unmeasured.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu import GpuMemory, corpus, fixture_texts, read_embeddings, varied_texts, write_jsonl  # noqa: E402

STARTED = time.monotonic()


class NoGpu:
    """GpuMemory's figures where there is no GPU: none."""
    mib = None
    utilisation = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


class Hung(Exception):
    """A run past RUN_SECONDS: killed, so that one hung path cannot spend the whole check."""


# Longest one process of the check may take. On an H200 (2026-11-27) `embed --backend
# unpadded-graphs` on 4,000 texts did not end within the ~4 minutes left of the check, which
# then timed out with nothing written: now that run is reported as hung and the check goes on.
RUN_SECONDS = 150
# The `--backend`s that hung once: their later runs are skipped as hung at once.
HUNG = set()


def run(args, cmd, env=None):
    backend = cmd[cmd.index("--backend") + 1] if "--backend" in cmd else None
    if backend in HUNG:
        raise Hung(f"--backend {backend} skipped: it hung earlier in this check")
    try:
        with (GpuMemory() if args.device == "cuda" else NoGpu()) as mem:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_SECONDS,
                                 env=None if env is None else dict(os.environ, **env))
    except subprocess.TimeoutExpired:
        if backend:
            HUNG.add(backend)
        raise Hung(f"{' '.join(cmd[:2])} --backend {backend} ran past {RUN_SECONDS} s and was killed")
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return out, mem


def kernels(args, *target):
    out = subprocess.run([args.bin, "models", "kernels", *target, "--device", args.device],
                         capture_output=True, text=True)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    if not rows:
        raise SystemExit(f"models kernels printed nothing:\n{out.stderr[-4000:]}")
    return rows


def cosine_summary(a, b):
    """Worst and mean cosine of paired rows, and how many fall below 0.999 (no numpy: CI's
    Python has none)."""
    cs = []
    for x, y in zip(a, b):
        dot = sum(p * q for p, q in zip(x, y))
        cs.append(dot / ((sum(p * p for p in x) * sum(q * q for q in y)) ** 0.5 or 1.0))
    return {"n": len(cs), "worst": min(cs), "mean": sum(cs) / len(cs),
            "below_0_999": sum(c < 0.999 for c in cs)}


def vectors(args, shape):
    # On the CPU the unpadded ops are their references, written plainly (and unoptimised in the
    # debug build CI runs): a few dozen texts prove the path there.
    n = 4000 if args.device == "cuda" else 40
    texts = fixture_texts() + varied_texts(n // 2) + corpus(n // 2, seed=3)
    path = os.path.join(args.out, "vectors.jsonl")
    write_jsonl(path, texts)
    ids = [f"t{i:07d}" for i in range(len(texts))]

    def spotinfer(backend, precision, device):
        out = os.path.join(args.out, f"{backend}-{precision}.jsonl")
        run(args, [args.bin, "embed", "--input", path, "--output", out, "--model", shape,
                   "--device", device, "--backend", backend, "--precision", precision,
                   "--batch-size", "64"])
        got = read_embeddings(out)
        return [got[i] for i in ids]

    if args.device == "cuda":
        import torch
        from sentence_transformers import SentenceTransformer
        st = SentenceTransformer(os.path.abspath(shape), device="cuda").float()
        st.max_seq_length = 256
        reference = st.encode(texts, batch_size=64, normalize_embeddings=True,
                              convert_to_numpy=True).tolist()
        del st
        torch.cuda.empty_cache()
        against = "sentence-transformers fp32 (same GPU)"
    else:
        reference = spotinfer("candle", "f32", "cpu")
        against = "the padded candle encoder, f32 (CPU)"
    result = {"texts": len(texts), "against": against}
    sides = [("unpadded", "f32"), ("unpadded", "f16"), ("unpadded-graphs", "f16")]
    if args.device == "cuda":
        sides.append(("candle", "f16"))
    for backend, precision in sides:
        try:
            result[f"{backend}_{precision}"] = cosine_summary(spotinfer(backend, precision, args.device),
                                                              reference)
        except Hung as e:
            result[f"{backend}_{precision}"] = {"worst": 0.0, "hung": str(e)}
        print(f"vectors {backend} {precision}: {json.dumps(result[f'{backend}_{precision}'])}",
              flush=True)
    return result


LLM_FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "llm")
IMAGES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "images")


def generation(args, shapes):
    """The paged decoder's speed (step 6 of the module comment): `spotinfer bench --backend
    paged` at each batch size beside transformers bf16 on the same GPU, on each shape."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_llm.py")
    path = os.path.join(args.out, "llm-prompts.jsonl")
    cuda = args.device == "cuda"
    batches, new = ([1, 64, 256], 128) if cuda else ([1, 4], 8)
    sampled_path = os.path.join(args.out, "llm-prompts-sampled.jsonl")
    subprocess.run([sys.executable, script, "prompts", path, str(max(batches))], check=True)
    subprocess.run([sys.executable, script, "prompts", sampled_path, str(max(batches)), "sampled"],
                   check=True)
    rows = []
    # The largest batch first (the floors), each batch on every shape before the next;
    # then the largest once more with every prompt sampled on the device (temperature, top-p,
    # top-k): what the device sampler costs beside greedy choice.
    runs = [(b, path) for b in sorted(batches, reverse=True)] + [(max(batches), sampled_path)]
    for b, prompts in runs:
        for shape in shapes:
            row = {"model": os.path.basename(shape.rstrip("/")), "batch_size": b, "new_tokens": new,
                   "sampled": prompts == sampled_path}
            if time.monotonic() - STARTED > args.minutes * 60:
                row["unmeasured"] = "past the check's time"
                rows.append(row)
                continue
            try:
                # As many prompts as transformers reads (its one batch), at least 4: one batch of
                # b, or four answers one after another at batch 1.
                some = first_lines(prompts, max(b, 4))
                out, mem = run(args, paged_bench(args, shape, some, b, new),
                               env={"RUST_LOG": "warn,spotinfer::paged::step=debug"})
                bench = json.loads(out.stdout.strip().splitlines()[-1])[0]
                row["spotinfer"] = dict(bench["bench"], device=bench["device"],
                                        gpu_busy=mem.utilisation, steps=step_times(out.stderr))
                if bench["bench"]["refused"]:
                    row["spotinfer"]["log_tail"] = out.stderr[-1500:]
                if cuda and not row["sampled"] and not args.no_peer_speed:
                    out, _ = run(args, [sys.executable, script, "transformers", shape, path, str(b),
                                        str(new)])
                    row["transformers_bf16"] = json.loads(out.stdout.strip().splitlines()[-1])
            except Hung as e:
                row["hung"] = str(e)
            rows.append(row)
            print(json.dumps(row), flush=True)
    for shape in shapes:
        rows.append(profile(args, shape, first_lines(path, max(batches)), max(batches), new))
        print(json.dumps(rows[-1]), flush=True)
    return rows


STAGES = ["plan", "rows", "attention", "out", "feed_forward", "head", "choose"]


def profile(args, shape, prompts, b, new):
    """One more greedy run at batch `b`, its steps profiled (the device synchronised after each
    stage, so slower than the plain run): the seconds each stage took over all its steps."""
    row = {"model": os.path.basename(shape.rstrip("/")), "batch_size": b, "new_tokens": new,
           "profiled": True}
    if time.monotonic() - STARTED > args.minutes * 60:
        return dict(row, unmeasured="past the check's time")
    try:
        out, _ = run(args, paged_bench(args, shape, prompts, b, new),
                     env={"RUST_LOG": "warn,spotinfer::paged::stages=trace"})
    except Hung as e:
        return dict(row, hung=str(e))
    seconds = {s: sum(int(v) for v in re.findall(rf'\b{s}_us"?[:=](\d+)', out.stderr)) / 1e6
               for s in STAGES}
    return dict(row, steps=len(re.findall(r"\bplan_us", out.stderr)), stage_seconds=seconds)


def paged_bench(args, shape, prompts, b, new):
    """`spotinfer bench` of the paged decoder on `prompts` at batch `b`, `new` tokens each."""
    return [args.bin, "bench", "--input", prompts, "--model", shape, "--backend", "paged",
            "--device", args.device, "--batch-sizes", str(b), "--max-new-tokens", str(new),
            "--max-batch-tokens", str(131072 if args.device == "cuda" else 4096)]


def first_lines(path, n):
    """A file of `path`'s first `n` lines, beside it."""
    short = f"{path}.{n}"
    with open(path) as f, open(short, "w") as out:
        out.writelines(line for _, line in zip(range(n), f))
    return short


def step_times(log):
    """The paged decoder's steps (its `paged step` debug events): how many, and the host's time
    to queue a step against its wait for the device, summed and at the median. A wait near 0
    says the host is what bounds the GPU."""
    queued = [int(m) for m in re.findall(r'queued_us"?[:=](\d+)', log)]
    waited = [int(m) for m in re.findall(r'waited_us"?[:=](\d+)', log)]
    if not queued or len(queued) != len(waited):
        return None
    return {"steps": len(queued), "queued_s": sum(queued) / 1e6, "waited_s": sum(waited) / 1e6,
            "median_queued_us": statistics.median(queued),
            "median_waited_us": statistics.median(waited)}


def default_decoder(args, shape):
    """`spotinfer bench` on a generation model without `--backend`: on CUDA the paged decoder
    must be what loads (the CPU decoder on the CPU), and records constrained by a regular
    expression, their masks computed on the host and applied on the device, run beside plain
    ones in the same steps without a refusal."""
    path = os.path.join(args.out, "llm-default.jsonl")
    cases = json.load(open(os.path.join(LLM_FIXTURES, "models.json")))["models"]["llama"]
    with open(path, "w") as f:
        for i in range(8):
            record = {"id": f"d{i}", "messages": cases[i % len(cases)]["messages"]}
            if i % 2:
                record["regex"] = "(yes|no), because [a-z ]{1,20}\\."
            f.write(json.dumps(record) + "\n")
    row = {"model": os.path.basename(shape.rstrip("/")), "records": 8, "constrained": 4}
    try:
        out, _ = run(args, [args.bin, "bench", "--input", path, "--model", shape, "--device",
                            args.device, "--batch-sizes", "8", "--max-new-tokens", "24"])
    except Hung as e:
        return dict(row, hung=str(e)), [f"default decoder: {e}"]
    bench = json.loads(out.stdout.strip().splitlines()[-1])[0]
    row.update(device=bench["device"], refused=bench["bench"]["refused"])
    paged = "paged decoder" in bench["device"]
    failures = []
    if paged != (args.device == "cuda"):
        failures.append(f"default decoder on {args.device}: {bench['device']}")
    if row["refused"]:
        failures.append(f"default decoder: {row['refused']} of 8 records refused")
        row["log_tail"] = out.stderr[-1500:]
    return row, failures


def sigterm_job(args, shape):
    """Step 9: bench/gpu_job.py on `shape`, its report and the check's failures from it."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_job.py")
    cuda = args.device == "cuda"
    cmd = [sys.executable, script, "--bin", args.bin, "--model", shape, "--device", args.device,
           "--out", os.path.join(args.out, "job")]
    # On CUDA the default backend (the paged decoder, what a worker loads there); on the CPU the
    # paged decoder asked for, on the fixture, with answers long enough to be cut.
    cmd += (["--prompts", "200", "--new-tokens", "128", "--batch-size", "64",
             "--max-batch-tokens", "131072"] if cuda else
            ["--backend", "paged", "--prompts", "24", "--new-tokens", "256", "--batch-size", "8"])
    if args.emulator_dir:
        cmd += ["--emulator-dir", args.emulator_dir]
    row = {"model": os.path.basename(shape.rstrip("/"))}
    if time.monotonic() - STARTED > args.minutes * 60:
        return dict(row, unmeasured="past the check's time"), []
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return dict(row, hung="bench/gpu_job.py ran past 300 s"), ["sigterm job: hung"]
    last = out.stdout.strip().splitlines()[-1:] or [""]
    if out.returncode == 3:  # no emulator here: a pack was not carried
        return dict(row, **json.loads(last[0])), []
    if not last[0].startswith("{"):
        return dict(row, error=out.stderr[-1500:]), ["sigterm job: " + out.stderr[-300:]]
    row.update(json.loads(last[0]))
    return row, [f"sigterm job: {f}" for f in row["failures"]]


def agreement(args, shapes):
    """The paged decoder's teacher-forced greedy choices against another engine's, per shape: on
    a GPU against transformers bf16 on the same GPU (16 prompts, 64 tokens each, bench/gpu_llm.py
    agree), reported; on the CPU against the fixtures' transformers f32 greedy tokens
    (models.json), where all must agree."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_llm.py")
    rows = []
    for shape in shapes:
        name = os.path.basename(shape.rstrip("/"))
        path = os.path.join(args.out, f"agree-{name}.jsonl")
        row = {"model": name}
        if time.monotonic() - STARTED > args.minutes * 60:
            rows.append(dict(row, unmeasured="past the check's time"))
            continue
        try:
            if args.device == "cuda":
                run(args, [sys.executable, script, "agree", shape,
                           os.path.join(args.out, "llm-prompts.jsonl"), "16", "64", path])
                row["against"] = "transformers bf16, same GPU"
            else:
                cases = json.load(open(os.path.join(LLM_FIXTURES, "models.json")))["models"][name]
                with open(path, "w") as f:
                    for c in cases:
                        p, g = c["prompt_ids"], c["greedy"]
                        f.write(json.dumps({"ids": p + g[:-1], "from": len(p), "top1": g}) + "\n")
                row["against"] = "transformers f32 greedy (models.json)"
            out, _ = run(args, [args.bin, "models", "agree", shape, "--sequences", path,
                                "--backend", "paged", "--device", args.device])
            row.update(json.loads(out.stdout.strip().splitlines()[-1]))
        except Hung as e:
            row["hung"] = str(e)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def st_bench_row(args, model, path, batch_size):
    gpu = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu.py")
    out, mem = run(args, [sys.executable, gpu, "st-bench", os.path.abspath(model), path, str(batch_size)])
    return dict(json.loads(out.stdout.strip().splitlines()[-1]), gpu_utilisation=mem.utilisation)


def speed(args, shape):
    path = os.path.join(args.out, "bench.jsonl")
    write_jsonl(path, corpus(args.records, seed=7))
    rows = []
    for batch_size in args.batch_sizes:
        bench = [args.bin, "bench", "--input", path, "--model", shape, "--device", args.device,
                 "--batch-size", str(batch_size)]
        precision = ["--precision", "f16" if args.device == "cuda" else "f32"]
        sides = {"default": bench + ["--backend", "candle"] + precision,
                 "unpadded": bench + ["--backend", "unpadded"] + precision,
                 "unpadded_graphs": bench + ["--backend", "unpadded-graphs", "--precision", "f16"]}
        runs = {name: [] for name in sides}
        if args.device == "cuda":
            runs["sentence_transformers"] = []
        row = {"model": os.path.basename(shape.rstrip("/")), "batch_size": batch_size}
        for _ in range(args.rounds):
            if time.monotonic() - STARTED > args.minutes * 60:
                row["unmeasured"] = "past the check's time"
                break
            for name, cmd in sides.items():
                try:
                    out, mem = run(args, cmd)
                except Hung as e:
                    row.setdefault("hung", []).append(str(e))
                    continue
                runs[name].append(dict(json.loads(out.stdout.strip().splitlines()[-1]),
                                       gpu_utilisation=mem.utilisation))
            if "sentence_transformers" in runs:
                runs["sentence_transformers"].append(st_bench_row(args, shape, path, batch_size))
        for name, rs in runs.items():
            if rs:
                row[name] = {k: statistics.median(r[k] for r in rs) for k in
                             ["tokens_per_s", "records_per_s"]}
                busy = [r["gpu_utilisation"] for r in rs if r.get("gpu_utilisation") is not None]
                row[name]["gpu_busy"] = statistics.median(busy) if busy else None
        if runs["unpadded"]:
            out, _ = run(args, sides["unpadded"] + ["--profile-device"])
            row["unpadded_profile"] = json.loads(out.stdout.strip().splitlines()[-1]).get("device_stages")
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def targets(report):
    """The issue's GPU targets, each met, missed or unmeasured, with its figure."""
    out = []
    floors = {"bert-base": 1_000_000, "minilm": 2_000_000}
    for row in report["speed"]:
        name, where = row["model"], f"{row['model']} batch {row['batch_size']}"
        st = row.get("sentence_transformers")
        for side in ["unpadded", "unpadded_graphs"]:
            if name not in floors:
                continue
            got = row.get(side)
            figure = got["tokens_per_s"] if got else None
            out.append((f"{where}: {side} >= {floors[name]:,} tokens/s", figure,
                        None if figure is None else figure >= floors[name]))
            busy = got.get("gpu_busy") if got else None
            out.append((f"{where}: {side} GPU busy >= 90%", busy,
                        None if busy is None else busy >= 0.9))
            if row["batch_size"] == 64:
                ratio = got["tokens_per_s"] / st["tokens_per_s"] if got and st else None
                out.append((f"{where}: {side} >= 10x sentence-transformers fp16", ratio,
                            None if ratio is None else ratio >= 10))
    floors = {"smollm2-135m": 30_000, "qwen2-0.5b": 17_711}
    for row in report.get("generation", []):
        if (row["model"] in floors and row["batch_size"] == 256 and not row.get("sampled")
                and not row.get("profiled")):
            got = row.get("spotinfer", {}).get("generated_tokens_per_s")
            floor = floors[row["model"]]
            out.append((f"{row['model']} batch 256: paged decoder >= {floor:,} generated tokens/s",
                        got, None if got is None else got >= floor))
    job = report.get("sigterm_job")
    if job is not None:
        figure = None if "resumed" not in job else (
            f"{job['answers'] - job['differing']} of {job['prompts']} answers equal, "
            f"{job['resumed_equal']} of {job['resumed']} resumed")
        out.append((f"{job['model']}: a job with SIGTERMs mid-answer, every answer the "
                    f"uninterrupted one", figure, None if figure is None else not job["failures"]))
    for name, v in report["vectors"].items():
        for side in ["unpadded_f16", "unpadded-graphs_f16"]:
            if side in v:
                out.append((f"{name}: {side} worst cosine >= 0.9999", v[side]["worst"],
                            v[side]["worst"] >= 0.9999))
    return [{"target": t, "figure": f, "met": m} for t, f, m in out]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin", required=True)
    p.add_argument("--device", choices=["cuda", "cpu"], required=True)
    p.add_argument("--shapes", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--records", type=int, default=10000)
    p.add_argument("--batch-sizes", default="64,256")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--minutes", type=float, default=7.5)
    p.add_argument("--llm-shapes", default=os.path.join(LLM_FIXTURES, "models", "llama"),
                   help="generation model folders for the paged decoder's speed")
    p.add_argument("--llm-only", action="store_true",
                   help="the paged decoder's steps alone (4, 6, 7, 8): no encoder or image tower")
    p.add_argument("--emulator-dir", default=None,
                   help="an unpacked `scripts/pubsub-emulator.sh pack` for step 9's emulator")
    p.add_argument("--no-peer-speed", action="store_true",
                   help="transformers' generation speed not measured again (after a change, with "
                        "its figures on the same GPU in hand); the agreement still runs")
    args = p.parse_args()
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    shapes = [s for s in args.shapes.split(",") if s]
    os.makedirs(args.out, exist_ok=True)
    gpu = "none"
    if args.device == "cuda":
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip()
    report = {"device": args.device, "gpu": gpu, "date": time.strftime("%Y-%m-%d"),
              "kernels": {}, "vectors": {}, "speed": []}
    failures = []
    for shape in shapes:
        name = os.path.basename(shape.rstrip("/"))
        report["kernels"][name] = kernels(args, shape)
        for k in report["kernels"][name]:
            status = "ok" if k["passed"] else "PAST THE BAR"
            print(f"kernel {name:10} {k['op']:17} {k['dtype']:5} {k['shape']:34} "
                  f"{k['largest_difference']:.2e} (bar {k['bar']:.1e}) {status}", flush=True)
            if not k["passed"]:
                failures.append(f"kernel {k['op']} {k['dtype']} on {name}")
    for shape in shapes:
        name = os.path.basename(shape.rstrip("/"))
        v = report["vectors"][name] = vectors(args, shape)
        print(f"vectors {name}: {json.dumps(v)}", flush=True)
        if v["unpadded_f32"]["worst"] < 0.99999:
            failures.append(f"{name}: f32 vectors, worst cosine {v['unpadded_f32']['worst']}")
        for side in ["unpadded_f16", "unpadded-graphs_f16"]:
            if "hung" in v[side]:
                failures.append(f"{name}: {side} vectors: {v[side]['hung']}")
            elif v[side]["worst"] < 0.9999:
                failures.append(f"{name}: {side} vectors, worst cosine {v[side]['worst']}")
    report["image_towers"] = {}
    for name in [] if args.llm_only else ["clip", "vit"]:
        rows = report["image_towers"][name] = kernels(args, os.path.join(IMAGES, "models", name))
        for k in rows:
            status = "ok" if k["passed"] else "PAST THE BAR"
            print(f"image tower {k['op']:17} {k['dtype']:5} {k['shape']:48} "
                  f"{k['largest_difference']:.2e} (bar {k['bar']:.1e}) {status}", flush=True)
            if not k["passed"]:
                failures.append(f"{k['op']} {k['dtype']}")
    report["paged"] = kernels(args, "--paged", LLM_FIXTURES)
    for k in report["paged"]:
        status = "ok" if k["passed"] else "PAST THE BAR"
        print(f"paged {k['op']:27} {k['dtype']:5} {k['shape']:58} "
              f"{k['largest_difference']:.2e} (bar {k['bar']:.1e}) {status}", flush=True)
        if not k["passed"]:
            failures.append(f"paged {k['op']} {k['dtype']} {k['shape']}")
    # Generation before the encoders' speed: the paged decoder's figures are the open issue's,
    # and what runs past --minutes is left unmeasured.
    llm_shapes = [s for s in args.llm_shapes.split(",") if s]
    report["generation"] = generation(args, llm_shapes)
    report["agreement"] = agreement(args, llm_shapes)
    report["default_decoder"], failed = default_decoder(args, llm_shapes[0])
    print(f"default decoder: {json.dumps(report['default_decoder'])}", flush=True)
    failures += failed
    report["sigterm_job"], failed = sigterm_job(args, llm_shapes[0])
    print(f"sigterm job: {json.dumps(report['sigterm_job'])}", flush=True)
    failures += failed
    for row in report["agreement"]:
        if args.device == "cpu" and row.get("agree") != row.get("total"):
            failures.append(f"paged decoder top-1 on {row['model']}: {row}")
    for shape in shapes:
        report["speed"] += speed(args, shape)
    report["targets"] = targets(report)
    report["failures"] = failures
    report["minutes"] = (time.monotonic() - STARTED) / 60
    for t in report["targets"]:
        state = {True: "MET       ", False: "MISSED    ", None: "UNMEASURED"}[t["met"]]
        print(state, t["target"], t["figure"])
    with open(os.path.join(args.out, "gpu-check.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"gpu-check: {len(failures)} failures in {report['minutes']:.1f} min; "
          f"{os.path.join(args.out, 'gpu-check.json')}")
    if failures:
        raise SystemExit("gpu-check failed: " + "; ".join(failures))


if __name__ == "__main__":
    main()
