#!/usr/bin/env python3
"""Images: spotinfer against transformers (PyTorch) on this CPU, then the worker's pipeline and
its memory. Run by bench/images.sh, which builds the binaries and makes the inputs.

1. The model alone, side by side, alternated, medians: examples/image_speed (the CPU image tower
   in f32 and, asked for, int8; then candle) and bench/image_peer.py (Pillow + the PIL processor + PyTorch fp32), each over the
   same photographs, with the share of decode, preprocess and network.
2. The pipeline: `spotinfer loadtest --images` on the same model, no faults: Pub/Sub in,
   decode and preprocess on the model stage's blocking threads, the database out; images/s
   against the model alone says whether decoding starves the model.
3. Memory: the worker's peak RSS on a window of the largest images allowed (`--max-image-pixels`
   at their size) against the same run on the ordinary photographs.

    python bench/images.py --image-speed BIN --loadtest BIN --model DIR --photos DIR \
        --large DIR --large-pixels N [--rounds 5] [--out FILE]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def run_json(cmd, env=None):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def side_by_side(a, rounds):
    """Median figures of each side over `rounds` alternated runs."""
    sides = {
        "spotinfer": [a.image_speed, "--backend", "auto", "--precision", "f32"],
        "spotinfer-int8": [a.image_speed, "--backend", "auto", "--precision", "int8"],
        "spotinfer-candle": [a.image_speed, "--backend", "candle"],
        "pytorch": [sys.executable, str(ROOT / "bench" / "image_peer.py")],
    }
    common = ["--model", a.model, "--photos", a.photos, "--rounds", "4", "--batch", "16"]
    runs = {name: [] for name in sides}
    for r in range(rounds):
        for name, cmd in sides.items():
            d = run_json(cmd + common)
            runs[name].append(d)
            print(f"round {r + 1} {name:17} {d['images_per_s']:6.2f} images/s", file=sys.stderr)
    out = {}
    for name, ds in runs.items():
        med = lambda k: statistics.median(d[k] for d in ds)  # noqa: E731
        total = med("seconds")
        out[name] = {
            "images_per_s": med("images_per_s"),
            "decode_share": med("decode_s") / total,
            "preprocess_share": med("preprocess_s") / total,
            "network_share": med("network_s") / total,
            "network_images_per_s": statistics.median(d["images"] / d["network_s"] for d in ds),
            "engine": ds[0].get("engine") or f"PyTorch {ds[0]['torch']} fp32, "
                                               f"transformers {ds[0]['transformers']}",
            "runs": [d["images_per_s"] for d in ds],
        }
    return out


def loadtest(a, photos, records, extra):
    """One fault-free loadtest run of the model on `photos`; its report."""
    with tempfile.TemporaryDirectory() as work:
        report = Path(work) / "report.json"
        cmd = [a.loadtest, "--images", photos, "--records", str(records), "--poison", "0",
               "--workers", "1", "--chaos-interval", "0s", "--verify-sample", "8",
               "--workdir", work, "--report", str(report)]
        cmd += [f"--worker-arg={x}" for x in extra]
        env = dict(os.environ, SPOTINFER_MODEL=a.model, RUST_LOG="warn")
        env.pop("PUBSUB_EMULATOR_HOST", None)
        subprocess.run(cmd, check=True, env=env, stdout=sys.stderr)
        return json.loads(report.read_text())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--image-speed", required=True)
    p.add_argument("--loadtest", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--photos", required=True)
    p.add_argument("--large", required=True)
    p.add_argument("--large-pixels", type=int, required=True)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--records", type=int, default=600)
    p.add_argument("--out")
    p.add_argument("--keep-model-alone", action="store_true",
                   help="reuse the model-alone figures of --out (an earlier run on this machine) "
                        "and run only the pipeline and memory parts")
    a = p.parse_args()
    result = {"machine": machine.describe(), "cores": os.cpu_count(), "model": a.model}
    if a.keep_model_alone:
        result["model_alone"] = json.loads(Path(a.out).read_text())["model_alone"]
    else:
        result["model_alone"] = side_by_side(a, a.rounds)
    batch = ["--batch-size=16"]
    pipe = loadtest(a, a.photos, a.records, batch)
    result["pipeline"] = {"images_per_s": pipe["records_per_s"],
                          "worker_peak_rss_mib": pipe["worker_peak_rss_mib"],
                          "worker_running_rss_mib": pipe["worker_running_rss_mib"],
                          "ok": pipe["ok"]}
    large = loadtest(a, a.large, 64, batch + [f"--max-image-pixels={a.large_pixels}"])
    result["largest_images"] = {"pixels": a.large_pixels, "records": 64,
                                "images_per_s": large["records_per_s"],
                                "worker_peak_rss_mib": large["worker_peak_rss_mib"],
                                "worker_running_rss_mib": large["worker_running_rss_mib"],
                                "ok": large["ok"]}
    m = result["model_alone"]
    print(f"CPU: {result['machine']['model']} ({result['cores']} cores; "
          f"{' '.join(result['machine']['flags'])})")
    for name, d in m.items():
        print(f"{name:17} {d['images_per_s']:6.2f} images/s (network alone "
              f"{d['network_images_per_s']:6.2f}); decode {d['decode_share']:.1%}, "
              f"preprocess {d['preprocess_share']:.1%}, network {d['network_share']:.1%}; "
              f"{d['engine']}")
    for side in ("spotinfer", "spotinfer-int8"):
        print(f"{side} / PyTorch: {m[side]['images_per_s'] / m['pytorch']['images_per_s']:.2f}x "
              f"(network alone {m[side]['network_images_per_s'] / m['pytorch']['network_images_per_s']:.2f}x)")
    print(f"pipeline (Pub/Sub, decode on the model stage's threads, SQLite): "
          f"{pipe['records_per_s']:.2f} images/s = "
          f"{pipe['records_per_s'] / m['spotinfer']['network_images_per_s']:.0%} of the network alone; "
          f"worker RSS while committing {pipe['worker_running_rss_mib']:.0f} MiB "
          f"(peak with the model's load {pipe['worker_peak_rss_mib']:.0f} MiB)")
    print(f"largest images ({a.large_pixels:,} pixels each, --max-image-pixels at their size): "
          f"worker RSS while committing {large['worker_running_rss_mib']:.0f} MiB "
          f"(peak with the model's load {large['worker_peak_rss_mib']:.0f} MiB), "
          f"{large['records_per_s']:.2f} images/s")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
