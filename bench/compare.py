#!/usr/bin/env python3
"""spotinfer against PyTorch and a Python worker, side by side in one run.

    bench/run.sh [options]        # installs and starts what this needs, then runs it

Prints, for each target of docs/benchmarks.md, both sides' figures and their ratio, and writes
them all to --out as JSON. Each comparison alternates the two sides over --rounds rounds on the
same corpus and reports medians, so a noisy neighbour hits both.

- model:  `spotinfer bench` vs sentence-transformers `encode(batch_size=32)`, records/s;
- e2e:    `spotinfer work` vs bench/py_worker.py through the Pub/Sub emulator and PostgreSQL,
          records/s from the first committed row to the last, and peak RSS (VmHWM);
- overhead: spotinfer's end-to-end records/s over its own `bench` records/s;
- cold:   `spotinfer work` process start to the first committed row, with a backlog waiting.
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid

import psycopg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def last_json(out):
    for line in reversed(out.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"no JSON line in output:\n{out[-2000:]}")


class Bench:
    def __init__(self, args):
        self.a = args
        self.env = dict(os.environ, PUBSUB_EMULATOR_HOST=args.emulator, RUST_LOG="warn",
                        HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="true")
        self.work = os.path.join(ROOT, ".cache", "bench")
        os.makedirs(self.work, exist_ok=True)

    def spot(self, *cmd, **kw):
        return subprocess.run([self.a.spotinfer, *cmd], env=self.env, check=True,
                              capture_output=True, text=True, **kw)

    # --- corpus ---------------------------------------------------------------------------
    def corpus(self):
        path = os.path.join(self.work, f"corpus-{self.a.records}-{self.a.seed}.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make-corpus.py"),
                            str(self.a.records), str(self.a.seed)], stdout=f, check=True)
        words = [len(json.loads(l)["text"].split()) for l in open(path, encoding="utf-8")]
        words.sort()
        self.corpus_info = {"records": len(words), "seed": self.a.seed,
                            "words_min": words[0], "words_median": words[len(words) // 2],
                            "words_max": words[-1]}
        return path

    # --- 1: model throughput ----------------------------------------------------------------
    def model(self, corpus):
        spot, py, candle = [], [], []
        for r in range(self.a.rounds):
            bench = ["bench", "--model", self.a.model, "--input", corpus,
                     "--batch-size", str(self.a.batch_size), "--device", "cpu"]
            if self.a.with_candle:
                c = last_json(self.spot(*bench, "--backend", "candle").stdout)
                log(f"model round {r + 1}: spotinfer --backend candle {c['records_per_s']:.1f} rec/s")
                candle.append(c)
            s = last_json(self.spot(*bench).stdout)
            p = last_json(subprocess.run(
                [sys.executable, os.path.join(ROOT, "bench", "st_encode.py"),
                 "--input", corpus, "--batch-size", str(self.a.batch_size)],
                env=self.env, check=True, capture_output=True, text=True).stdout)
            log(f"model round {r + 1}: spotinfer {s['records_per_s']:.1f} rec/s, "
                f"PyTorch {p['records_per_s']:.1f} rec/s")
            spot.append(s)
            py.append(p)
        return {"spotinfer": spot, "pytorch": py, "candle": candle}

    # --- 2-4: end to end --------------------------------------------------------------------
    def fresh(self, corpus):
        tag = uuid.uuid4().hex[:8]
        topic, sub, db = f"bench-{tag}", f"bench-{tag}", f"bench_{tag}"
        self.spot("setup", "--topic", topic, "--subscription", sub, "--skip-db")
        self.spot("publish", "--topic", topic, corpus)
        with psycopg.connect(self.a.pg_url, autocommit=True) as c:
            c.execute(f"CREATE DATABASE {db}")
        base = self.a.pg_url.rsplit("/", 1)[0]
        return sub, f"{base}/{db}"

    def run_worker(self, side, corpus):
        sub, url = self.fresh(corpus)
        if side.startswith("spotinfer"):
            cmd = [self.a.spotinfer, "work", "--subscription", sub, "--database-url", url,
                   "--model", self.a.model, "--device", "cpu",
                   "--batch-size", str(self.a.batch_size), *self.a.spot_arg]
        else:
            # python-sorted: the peer sorts what it holds (up to 256 messages) by length before
            # batching, as spotinfer's batcher does; python-plain batches in arrival order.
            window = 256 if side == "python-sorted" else self.a.batch_size
            cmd = [sys.executable, os.path.join(ROOT, "bench", "py_worker.py"),
                   "--subscription", sub, "--database-url", url,
                   "--batch-size", str(self.a.batch_size), "--window", str(window)]
        logf = open(os.path.join(self.work, f"{side}-worker.log"), "w")
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, env=self.env, stdout=logf, stderr=subprocess.STDOUT)
        n = self.a.records
        first_at, first_count, done_at, peak = None, 0, None, 0
        deadline = started + self.a.timeout
        with psycopg.connect(url, autocommit=True) as c:
            while time.perf_counter() < deadline:
                if proc.poll() is not None:
                    raise RuntimeError(f"{side} worker exited {proc.returncode}; see {logf.name}")
                try:
                    got = c.execute("SELECT count(*) FROM embeddings").fetchone()[0]
                except psycopg.errors.UndefinedTable:
                    got = 0
                now = time.perf_counter()
                peak = max(peak, vm_hwm(proc.pid))
                if got and first_at is None:
                    first_at, first_count = now, got
                if got >= n:
                    done_at = now
                    break
                time.sleep(0.02)
        peak = max(peak, vm_hwm(proc.pid))
        proc.send_signal(signal.SIGTERM)
        sigterm = time.perf_counter()
        code = proc.wait(timeout=30)
        exit_s = time.perf_counter() - sigterm
        if done_at is None:
            raise RuntimeError(f"{side} worker did not finish {n} records in {self.a.timeout}s")
        result = {
            "records": n,
            "records_per_s": (n - first_count) / (done_at - first_at),
            "first_commit_s": first_at - started,
            "total_s": done_at - started,
            "peak_rss_mib": peak / 1024,
            "exit_code": code,
            "sigterm_exit_s": exit_s,
        }
        log(f"e2e {side}: {result['records_per_s']:.1f} rec/s, first commit "
            f"{result['first_commit_s']:.2f} s, peak RSS {result['peak_rss_mib']:.0f} MiB, "
            f"exit {code} in {exit_s:.2f} s")
        return result

    def e2e(self, corpus):
        sides = ["python-sorted", "spotinfer", "python-plain"]
        out = {s: [] for s in sides}
        for r in range(self.a.rounds):
            for side in sides if r % 2 == 0 else sides[::-1]:
                out[side].append(self.run_worker(side, corpus))
        return out


def vm_hwm(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def med(xs, key):
    return statistics.median(x[key] for x in xs)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--spotinfer", default=os.path.join(ROOT, "target", "release", "spotinfer"))
    p.add_argument("--model", default=os.path.join(ROOT, "models", "all-MiniLM-L6-v2"))
    p.add_argument("--emulator", default=os.environ.get("PUBSUB_EMULATOR_HOST", "127.0.0.1:8087"))
    p.add_argument("--pg-url", required=True, help="PostgreSQL URL of a role that can CREATE DATABASE")
    p.add_argument("--records", type=int, default=1000)
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--only", default="model,e2e", help="comma-separated: model, e2e")
    p.add_argument("--with-candle", action="store_true",
                   help="also time `spotinfer bench --backend candle` (the unfused reference)")
    p.add_argument("--spot-arg", action="append", default=[], help="extra `spotinfer work` flag")
    p.add_argument("--out", default=os.path.join(ROOT, ".cache", "bench", "results.json"))
    a = p.parse_args()
    b = Bench(a)
    corpus = b.corpus()
    only = set(a.only.split(","))
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "corpus": b.corpus_info,
           "rounds": a.rounds, "batch_size": a.batch_size, "cpus": os.cpu_count()}
    lines = []
    if "model" in only:
        m = b.model(corpus)
        res["model"] = m
        s, t = med(m["spotinfer"], "records_per_s"), med(m["pytorch"], "records_per_s")
        lines.append(("1 model records/s (spotinfer bench / PyTorch)", s, t, s / t, 1.25))
        if m["candle"]:
            c = med(m["candle"], "records_per_s")
            lines.append(("  candle BertModel records/s (/ PyTorch)", c, t, c / t, None))
        lines.append(("  CPU system s (spotinfer / PyTorch)", med(m["spotinfer"], "cpu_sys_s"),
                      med(m["pytorch"], "cpu_sys_s"), None, None))
    if "e2e" in only:
        e = b.e2e(corpus)
        res["e2e"] = e
        s, t = med(e["spotinfer"], "records_per_s"), med(e["python-sorted"], "records_per_s")
        lines.append(("2 end-to-end records/s (spotinfer / Python, length-sorted)", s, t, s / t, 2.0))
        p = med(e["python-plain"], "records_per_s")
        lines.append(("  end-to-end records/s (spotinfer / Python, arrival order)", s, p, s / p, 2.0))
        if "model" in only:
            raw = med(res["model"]["spotinfer"], "records_per_s")
            lines.append(("3 pipeline: end-to-end / raw model records/s", s, raw, s / raw, 0.9))
        s, t = med(e["spotinfer"], "peak_rss_mib"), med(e["python-sorted"], "peak_rss_mib")
        lines.append(("4 peak RSS MiB (spotinfer / Python peer), at most", s, t, s / t, 0.5))
        s, t = med(e["spotinfer"], "first_commit_s"), med(e["python-sorted"], "first_commit_s")
        lines.append(("5 start to first commit s (spotinfer / Python), at most 3 s", s, t, None, 3.0))
    res["summary"] = [dict(zip(("figure", "spotinfer", "peer", "ratio", "target"), l)) for l in lines]
    with open(a.out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"\ncorpus: {b.corpus_info}; medians of {a.rounds} rounds; batch size {a.batch_size}")
    for name, s, t, ratio, target in lines:
        r = f"{ratio:6.2f}x" if ratio is not None else "       "
        tg = f"(target {target})" if target is not None else ""
        print(f"{name:58} {s:9.2f} {t:9.2f} {r} {tg}")
    print(f"written to {a.out}")


if __name__ == "__main__":
    main()
