#!/usr/bin/env python3
"""spotinfer's CPU precisions against sentence-transformers fp32 and bf16, side by side, alternated.

    python bench/amx.py --spotinfer target/release/spotinfer --input corpus.jsonl \
        [--model DIR] [--rounds 3] [--out result.json]

Each round runs, in an order rotated every round: `spotinfer bench` in f32, bf16 and int8, and
bench/st_encode.py (PyTorch) in fp32 and in bf16 (the model cast to bfloat16: oneDNN multiplies
on AMX tiles where the CPU has them). It prints the CPU model, whether it has AMX, the kernels
each spotinfer run reports, the median records/s of every side and their ratios, and the share
of the CPU's AMX bf16 peak the encoder's dense layers reach in spotinfer's bf16 run: dense
multiply-adds per token (from the model's config.json) × tokens/s over physical cores × 1,024
bf16 multiply-adds per cycle (one AMX unit's `tdpbf16ps` rate) × the clock /proc/cpuinfo reports.
The last line is one JSON object with every figure.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
AMX_BF16_MACS_PER_CYCLE = 1024


def cpu_facts():
    """Model name, AMX flags, clock (MHz), vCPUs and physical cores of this machine."""
    text = open("/proc/cpuinfo", encoding="utf-8").read()
    blocks = [
        {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in b.splitlines() if ":" in line)}
        for b in text.split("\n\n") if b.strip()
    ]
    first = blocks[0]
    cores = {(b.get("physical id"), b.get("core id")) for b in blocks}
    return {
        "cpu": first.get("model name", "?"),
        "amx": sorted(f for f in first.get("flags", "").split() if f.startswith("amx")),
        "mhz": float(first.get("cpu MHz", "0") or 0),
        "vcpus": len(blocks),
        "physical_cores": max(1, len(cores)),
    }


def dense_macs_per_token(model_dir):
    """Multiply-adds per token of a BERT-shaped encoder's dense layers (Q, K, V, O, the two
    feed-forward products), from its config.json."""
    config = json.load(open(os.path.join(model_dir, "config.json"), encoding="utf-8"))
    h, ff, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    return layers * (4 * h * h + 2 * h * ff)


def last_json(output):
    return json.loads(output.strip().splitlines()[-1])


def spotinfer(args, precision):
    cmd = [args.spotinfer, "bench", "--input", args.input, "--model", args.model,
           "--precision", precision, "--batch-size", str(args.batch_size)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return last_json(out)


def sentence_transformers(args, bf16):
    cmd = [args.python, os.path.join(HERE, "st_encode.py"), "--input", args.input,
           "--model", args.model, "--batch-size", str(args.batch_size)]
    if bf16:
        cmd.append("--bf16")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=HERE).stdout
    return last_json(out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--spotinfer", default=os.path.join(ROOT, "target", "release", "spotinfer"))
    p.add_argument("--python", default=os.path.join(ROOT, ".cache", "bench-venv", "bin", "python"))
    p.add_argument("--model", default=os.path.join(ROOT, "models", "all-MiniLM-L6-v2"))
    p.add_argument("--input", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--out")
    args = p.parse_args()

    facts = cpu_facts()
    print(f"cpu: {facts['cpu']} ({facts['vcpus']} vCPUs, {facts['physical_cores']} physical "
          f"cores, {facts['mhz']:.0f} MHz), AMX: {' '.join(facts['amx']) or 'none'}", file=sys.stderr)
    sides = {
        "spotinfer f32": lambda: spotinfer(args, "f32"),
        "spotinfer bf16": lambda: spotinfer(args, "bf16"),
        "spotinfer int8": lambda: spotinfer(args, "int8"),
        "sentence-transformers fp32": lambda: sentence_transformers(args, False),
        "sentence-transformers bf16": lambda: sentence_transformers(args, True),
    }
    names = list(sides)
    rates = {n: [] for n in names}
    reports = {}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            report = sides[name]()
            rates[name].append(report["records_per_s"])
            reports[name] = report
            kernels = report.get("device", report.get("dtype", ""))
            print(f"round {r}: {name}: {report['records_per_s']:.1f} records/s ({kernels})",
                  file=sys.stderr)
    medians = {n: statistics.median(v) for n, v in rates.items()}
    st16 = medians["sentence-transformers bf16"]
    tokens_per_s = reports["spotinfer bf16"].get("tokens_per_s")
    peak = facts["physical_cores"] * AMX_BF16_MACS_PER_CYCLE * facts["mhz"] * 1e6
    share = None
    if tokens_per_s and peak and facts["amx"]:
        share = tokens_per_s * dense_macs_per_token(args.model) / peak
    for n in names:
        print(f"{n}: {medians[n]:.1f} records/s median, {medians[n] / st16:.2f}x "
              f"sentence-transformers bf16", file=sys.stderr)
    if share is not None:
        print(f"spotinfer bf16's dense layers: {share:.1%} of the AMX bf16 peak "
              f"({facts['physical_cores']} cores x {AMX_BF16_MACS_PER_CYCLE} x "
              f"{facts['mhz']:.0f} MHz)", file=sys.stderr)
    result = {"machine": facts, "rounds": args.rounds, "records_per_s": rates,
              "median_records_per_s": medians, "amx_peak_share": share,
              "spotinfer_devices": {n: reports[n].get("device") for n in names
                                    if n.startswith("spotinfer")}}
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
