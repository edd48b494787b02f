#!/usr/bin/env python3
"""spotinfer against PyTorch, ONNX Runtime and a Python worker, side by side in one run.

    bench/run.sh [options]        # installs and starts what this needs, then runs it

Prints, for each target of docs/benchmarks.md, both sides' figures and their ratio, and writes
them all to --out as JSON. Each comparison alternates the sides over --rounds rounds on the
same corpus (the order rotated each round) and reports medians, so a noisy neighbour hits all.
Before each timed run it waits for the machine to be quiet (`settle`), so that what one side
left running (PostgreSQL writing back, the emulator collecting garbage) is not charged to the next.

- model:  `spotinfer bench` vs sentence-transformers `encode(batch_size=32)` (PyTorch) and vs
          the model exported to ONNX fp32 run by ONNX Runtime (bench/ort_encode.py), records/s;
          and what a CPU with AVX2 only runs (AMD's Zen 2 and 3): spotinfer --cpu-kernels avx2
          against both peers under bench/avx2_only.c, which hides AVX-512 from their CPUID;
- accuracy: `spotinfer embed` and ONNX Runtime's vectors for every record of the corpus, by
          cosine with sentence-transformers fp32 on the CPU (bench/accuracy.py): worst and mean;
- e2e:    `spotinfer work` vs bench/py_worker.py (PyTorch in arrival order, PyTorch over a
          length-sorted window, ONNX Runtime over a length-sorted window) through the Pub/Sub
          emulator and PostgreSQL, records/s from the first committed row to the last, and peak
          RSS (VmHWM);
- overhead: spotinfer's end-to-end records/s over its own `bench` records/s;
- pipeline: the same ratio alone: `spotinfer bench` then at once `spotinfer work`, each round;
- cold:   `spotinfer work` process start to the first committed row, with a backlog waiting;
- pull:   the emulator's own ceiling: examples/pull_ceiling.rs acking every message as it
          arrives (nothing behind it), with 8 streams and with 1, messages/s.

--model is every side's model: spotinfer's, sentence-transformers', the ONNX export's (made by
bench/ort_export.py before the first round, untimed, and reused while it is up to date) and the
Python workers'; e.g. a 1-layer random-weight folder from bench/make_shape.py shows the
pipeline's ceiling when the model costs little.
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

from machine import describe

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

    def py(self, script, *args, env=None):
        """One of bench/'s Python scripts, its output captured; its stderr shown if it fails."""
        out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), *args],
                             env=env or self.env, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"bench/{script} exited {out.returncode}:\n{out.stderr[-4000:]}")
        return out

    # --- the ONNX export ------------------------------------------------------------------
    def onnx(self):
        """The model exported to ONNX fp32 (bench/ort_export.py: made and checked against
        PyTorch when missing or stale, else reused), before anything is timed."""
        if getattr(self, "onnx_path", None) is None:
            out = self.py("ort_export.py", "--model", self.a.model)
            for line in out.stderr.splitlines():
                if "max abs diff" in line:
                    log(f"onnx export: {line.strip()}")
            self.onnx_path = out.stdout.strip().splitlines()[-1]
            with open(os.path.join(os.path.dirname(self.onnx_path), "export.json")) as f:
                self.onnx_info = dict(json.load(f), path=self.onnx_path)
        return self.onnx_path

    # --- peers held to AVX2 -------------------------------------------------------------------
    def avx2_env(self):
        """The environment that runs a Python peer as on a CPU without AVX-512, AVX-VNNI or AMX
        (bench/avx2_only.c, preloaded), or None where this machine cannot hide them (no CPUID
        faulting). Checked: PyTorch under it must report AVX2 as its CPU capability."""
        if not hasattr(self, "_avx2_env"):
            self._avx2_env = None
            lib = os.path.join(self.work, "avx2_only.so")
            src = os.path.join(ROOT, "bench", "avx2_only.c")
            subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", lib, src], check=True)
            env = dict(self.env, LD_PRELOAD=lib)
            probe = subprocess.run(
                [sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                env=env, capture_output=True, text=True)
            got = probe.stdout.strip()
            if probe.returncode == 0 and got == "AVX2":
                self._avx2_env = env
                log("peers held to AVX2: PyTorch reports AVX2 under bench/avx2_only.c")
            else:
                log(f"peers not held to AVX2 (PyTorch reports {got!r}): {probe.stderr.strip()[-300:]}")
        return self._avx2_env

    # --- corpus ---------------------------------------------------------------------------
    def corpus(self):
        """--corpus real: bench/real_corpus.py (fortunes in eight languages, WordNet glosses,
        man pages); synthetic: scripts/make-corpus.py (generated English sentences)."""
        path = os.path.join(self.work,
                            f"corpus-{self.a.corpus}-{self.a.records}-{self.a.seed}.jsonl")
        script = {"real": os.path.join(ROOT, "bench", "real_corpus.py"),
                  "synthetic": os.path.join(ROOT, "scripts", "make-corpus.py")}[self.a.corpus]
        with open(path, "w", encoding="utf-8") as f:
            subprocess.run([sys.executable, script, str(self.a.records), str(self.a.seed)],
                           stdout=f, check=True)
        words = [len(json.loads(l)["text"].split()) for l in open(path, encoding="utf-8")]
        words.sort()
        self.corpus_info = {"source": self.a.corpus, "records": len(words), "seed": self.a.seed,
                            "words_min": words[0], "words_median": words[len(words) // 2],
                            "words_max": words[-1]}
        return path

    # --- 1: model throughput ----------------------------------------------------------------
    def bench_cmd(self, corpus):
        """`spotinfer bench` on the corpus as every model-rate side runs it (--bench-arg apart)."""
        return ["bench", "--model", self.a.model, "--input", corpus,
                "--batch-size", str(self.a.batch_size), "--device", "cpu"]

    def model(self, corpus, rounds=None):
        out = {"spotinfer": [], "spotinfer-f32": [], "spotinfer-avx2": [],
               "spotinfer-avx2-f32": [], "pytorch": [], "ort": [], "pytorch-avx2": [],
               "ort-avx2": [], "candle": []}
        bench = self.bench_cmd(corpus)
        py = ["--model", self.a.model, "--input", corpus, "--batch-size", str(self.a.batch_size)]
        onnx = self.onnx()
        run = {
            "spotinfer": lambda: last_json(self.spot(*bench, *self.a.bench_arg).stdout),
            # The default picks int8 (or bf16) where the CPU has it; this side forces f32.
            "spotinfer-f32": lambda: last_json(
                self.spot(*bench, *self.a.bench_arg, "--precision", "f32").stdout),
            # What a CPU with AVX2 but neither AVX-512 nor AVX-VNNI runs (AMD's Zen 2 and 3):
            # the default precision, and f32 forced.
            "spotinfer-avx2": lambda: last_json(
                self.spot(*bench, *self.a.bench_arg, "--cpu-kernels", "avx2").stdout),
            "spotinfer-avx2-f32": lambda: last_json(
                self.spot(*bench, *self.a.bench_arg, "--cpu-kernels", "avx2",
                          "--precision", "f32").stdout),
            "pytorch": lambda: last_json(self.py("st_encode.py", *py).stdout),
            "ort": lambda: last_json(self.py("ort_encode.py", *py, "--onnx", onnx).stdout),
        }
        if self.avx2_env():
            # The peers as they run on such a CPU: no setting of theirs does this.
            run["pytorch-avx2"] = lambda: last_json(
                self.py("st_encode.py", *py, env=self.avx2_env()).stdout)
            run["ort-avx2"] = lambda: last_json(
                self.py("ort_encode.py", *py, "--onnx", onnx, env=self.avx2_env()).stdout)
        names = {"spotinfer": "spotinfer", "spotinfer-f32": "spotinfer f32",
                 "spotinfer-avx2": "spotinfer AVX2", "spotinfer-avx2-f32": "spotinfer AVX2 f32",
                 "pytorch": "PyTorch", "ort": "ONNX Runtime", "pytorch-avx2": "PyTorch AVX2",
                 "ort-avx2": "ONNX Runtime AVX2"}
        sides = list(run)
        for r in (range(self.a.rounds) if rounds is None else rounds):
            if self.a.with_candle:
                c = last_json(self.spot(*bench, "--backend", "candle").stdout)
                log(f"model round {r + 1}: spotinfer --backend candle {c['records_per_s']:.1f} rec/s")
                out["candle"].append(c)
            k = r % len(sides)
            for side in sides[k:] + sides[:k]:
                settle()
                out[side].append(run[side]())
            log(f"model round {r + 1}: " + ", ".join(
                f"{names[side]} {out[side][-1]['records_per_s']:.1f} rec/s" for side in sides))
        return out

    # --- accuracy ---------------------------------------------------------------------------
    def accuracy(self, corpus):
        """spotinfer's and ONNX Runtime's vectors for every record, against sentence-transformers
        fp32 on the CPU."""
        spot = os.path.join(self.work, "accuracy-spotinfer.jsonl")
        spot32 = os.path.join(self.work, "accuracy-spotinfer-f32.jsonl")
        avx2 = os.path.join(self.work, "accuracy-spotinfer-avx2.jsonl")
        ort = os.path.join(self.work, "accuracy-ort.jsonl")
        embed = ["embed", "--input", corpus, "--model", self.a.model, "--device", "cpu",
                 "--batch-size", str(self.a.batch_size), *self.a.embed_arg]
        self.spot(*embed, "--output", spot)
        self.spot(*embed, "--output", spot32, "--precision", "f32")
        self.spot(*embed, "--output", avx2, "--cpu-kernels", "avx2")
        self.py("ort_encode.py", "--model", self.a.model, "--input", corpus, "--batch-size",
                str(self.a.batch_size), "--onnx", self.onnx(), "--vectors", ort)
        out = self.py("accuracy.py", "--model", self.a.model, "--input", corpus,
                      "--batch-size", str(self.a.batch_size), f"spotinfer={spot}",
                      f"spotinfer-f32={spot32}", f"spotinfer-avx2={avx2}", f"ort={ort}")
        table = out.stderr[out.stderr.find("reference:"):] if "reference:" in out.stderr else ""
        log(table.rstrip())
        return last_json(out.stdout)

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
            # batching, as spotinfer's batcher does; python-plain batches in arrival order;
            # python-sorted-ort: the sorted peer with ONNX Runtime for PyTorch.
            window = 256 if side.startswith("python-sorted") else self.a.batch_size
            cmd = [sys.executable, os.path.join(ROOT, "bench", "py_worker.py"),
                   "--subscription", sub, "--database-url", url, "--model", self.a.model,
                   "--batch-size", str(self.a.batch_size), "--window", str(window)]
            if side.endswith("-ort"):
                cmd += ["--engine", "ort", "--onnx", self.onnx()]
        logf = open(os.path.join(self.work, f"{side}-worker.log"), "w")
        settle()
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
                    first_at, first_count, cpu_first = now, got, cpu_seconds(proc.pid)
                if got >= n:
                    done_at, cpu_done = now, cpu_seconds(proc.pid)
                    break
                # Fine-grained until the first commit (the start-up figure), then slow: each
                # count scans the table, PostgreSQL CPU that the worker being timed would lose.
                time.sleep(0.02 if first_at is None else 0.25)
            if done_at is not None:
                # The rate from the commits' own times: every side's rows take now(), the start
                # of the transaction that wrote them.
                span, first_rows = c.execute(
                    "SELECT extract(epoch FROM max(processed_at) - min(processed_at))::float8,"
                    " count(*) FILTER (WHERE processed_at = (SELECT min(processed_at)"
                    " FROM embeddings)) FROM embeddings").fetchone()
        peak = max(peak, vm_hwm(proc.pid))
        proc.send_signal(signal.SIGTERM)
        sigterm = time.perf_counter()
        code = proc.wait(timeout=30)
        exit_s = time.perf_counter() - sigterm
        if done_at is None:
            raise RuntimeError(f"{side} worker did not finish {n} records in {self.a.timeout}s")
        result = {
            "records": n,
            "records_per_s": (n - first_rows) / span,
            "records_per_s_polled": (n - first_count) / (done_at - first_at),
            "first_commit_s": first_at - started,
            "total_s": done_at - started,
            "peak_rss_mib": peak / 1024,
            "exit_code": code,
            "sigterm_exit_s": exit_s,
            # The worker process's own CPU (user + system) per record, first commit to last.
            "cpu_us_per_record": (cpu_done - cpu_first) * 1e6 / max(n - first_count, 1),
        }
        log(f"e2e {side}: {result['records_per_s']:.1f} rec/s, first commit "
            f"{result['first_commit_s']:.2f} s, peak RSS {result['peak_rss_mib']:.0f} MiB, "
            f"exit {code} in {exit_s:.2f} s")
        # Each run's database goes once measured: a few runs a day would otherwise fill the disk.
        with psycopg.connect(self.a.pg_url, autocommit=True) as c:
            c.execute(f"DROP DATABASE IF EXISTS {url.rsplit('/', 1)[1]}")
        return result

    def pipeline(self, corpus):
        """Figure 3 alone: each round `spotinfer bench`, then at once `spotinfer work` on the same
        corpus through the emulator and PostgreSQL, so each end-to-end rate is compared with the
        model rate measured just before it, not minutes apart among other sides."""
        out = {"model": [], "e2e": []}
        bench = self.bench_cmd(corpus)
        for r in range(self.a.rounds):
            settle()
            out["model"].append(last_json(self.spot(*bench, *self.a.bench_arg).stdout))
            out["e2e"].append(self.run_worker("spotinfer", corpus))
            log(f"pipeline round {r + 1}: model {out['model'][-1]['records_per_s']:.1f} rec/s, "
                f"end to end {out['e2e'][-1]['records_per_s']:.1f} rec/s")
        return out

    def pull(self, corpus):
        """The emulator's own delivery rate: examples/pull_ceiling.rs acks every message of the
        corpus as it arrives (no parsing, model or database), with the streams the worker picks
        for a fast model (8) and with one."""
        out = {"8": [], "1": []}
        for r in range(self.a.rounds):
            for streams in (["8", "1"] if r % 2 == 0 else ["1", "8"]):
                tag = uuid.uuid4().hex[:8]
                self.spot("setup", "--topic", f"pull-{tag}", "--subscription", f"pull-{tag}",
                          "--skip-db")
                self.spot("publish", "--topic", f"pull-{tag}", corpus)
                settle()
                res = last_json(subprocess.run(
                    [self.a.pull_ceiling, "--subscription", f"pull-{tag}", "--streams", streams,
                     "--messages", str(self.a.records)],
                    env=self.env, check=True, capture_output=True, text=True,
                    timeout=self.a.timeout).stdout)
                log(f"pull round {r + 1}: {streams} stream(s) {res['messages_per_s']:.0f} msg/s")
                out[streams].append(res)
        return out

    def e2e(self, corpus, rounds=None):
        sides = self.a.e2e_sides.split(",")
        out = {s: [] for s in sides}
        for r in (range(self.a.rounds) if rounds is None else rounds):
            k = r % len(sides)
            for side in sides[k:] + sides[:k]:
                out[side].append(self.run_worker(side, corpus))
        return out


# Issue 51's GPU target for the MiniLM shape, in records/s on texts of the ~53 tokens it was
# measured on: 2,000,000 tokens/s.
GPU_TARGET_RECORDS_PER_S = 2_000_000 / 53
# The vCPUs GKE gives a node with one L4 (g2-standard-8) and with one H100 (a3-highgpu-1g).
GPU_NODE_VCPUS = [(8, "L4"), (26, "H100")]


def gpu_node_headroom(cpu_us_per_record):
    """Whether the pipeline keeps up with a GPU: the records/s the worker's CPU per record (pull
    to ack, with a model that costs next to nothing: the ceiling suite) allows on a GPU node's
    vCPUs, if every vCPU ran the pipeline, against the rate the GPU target needs. An upper bound:
    one worker's scaling across cores is not measured here."""
    return [(f"8 records/s the worker's CPU allows on {n} vCPUs ({gpu} node) / needed at "
             f"2M tokens/s", n * 1e6 / cpu_us_per_record, GPU_TARGET_RECORDS_PER_S,
             n * 1e6 / cpu_us_per_record / GPU_TARGET_RECORDS_PER_S, 1.0, ".0f")
            for n, gpu in GPU_NODE_VCPUS]


def settle(idle=0.9, most_s=20.0):
    """Waits until the machine is quiet (at least `idle` of its CPU time idle over half a
    second) before a timed run, at most `most_s`: what the run before left behind (PostgreSQL
    writing back a peer's rows, the emulator collecting garbage, a Python process exiting) would
    otherwise be charged to whichever side runs next."""
    def busy_idle():
        with open("/proc/stat") as f:
            t = [int(x) for x in f.readline().split()[1:]]
        return sum(t), t[3] + t[4]
    deadline = time.perf_counter() + most_s
    while True:
        t0, i0 = busy_idle()
        time.sleep(0.5)
        t1, i1 = busy_idle()
        if (i1 - i0) >= idle * max(t1 - t0, 1):
            return
        if time.perf_counter() > deadline:
            log(f"settle: the machine was still busy after {most_s:.0f} s; timing anyway")
            return


def cpu_seconds(pid):
    """User + system CPU seconds of a process so far (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


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
    p.add_argument("--corpus", choices=["real", "synthetic"], default="real",
                   help="real text (bench/real_corpus.py) or generated (scripts/make-corpus.py)")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--only", default="model,accuracy,e2e",
                   help="comma-separated: model, accuracy, e2e, pipeline, pull")
    p.add_argument("--with-candle", action="store_true",
                   help="also time `spotinfer bench --backend candle` (the unfused reference)")
    p.add_argument("--spot-arg", action="append", default=[], help="extra `spotinfer work` flag")
    p.add_argument("--bench-arg", action="append", default=[], help="extra `spotinfer bench` flag")
    p.add_argument("--embed-arg", action="append", default=[],
                   help="extra `spotinfer embed` flag (accuracy), e.g. --embed-arg=--precision=f32")
    p.add_argument("--e2e-sides", default="python-sorted,spotinfer,python-sorted-ort,python-plain",
                   help="the workers the e2e section runs (spotinfer and python-sorted-ort always)")
    p.add_argument("--pull-ceiling", default=os.path.join(ROOT, "target", "release", "examples",
                                                          "pull_ceiling"),
                   help="examples/pull_ceiling.rs, built (for --only pull)")
    p.add_argument("--out", default=os.path.join(ROOT, ".cache", "bench", "results.json"))
    a = p.parse_args()
    only = set(a.only.split(","))
    unknown = only - {"model", "accuracy", "e2e", "pipeline", "pull"}
    for side in ("spotinfer", "python-sorted-ort"):
        if side not in a.e2e_sides.split(","):
            a.e2e_sides += f",{side}"
    if unknown:
        p.error(f"--only: unknown {', '.join(sorted(unknown))}")
    b = Bench(a)
    corpus = b.corpus()
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "corpus": b.corpus_info,
           "rounds": a.rounds, "batch_size": a.batch_size, "cpus": os.cpu_count(),
           "model_dir": os.path.abspath(a.model), "cpu": describe()}
    log(f"CPU: {res['cpu']['model']}, {os.cpu_count()} CPUs; {' '.join(res['cpu']['flags'])}")
    b.onnx()  # exported (or found up to date) before anything is timed
    res["onnx"] = b.onnx_info
    lines = []  # (figure, spotinfer, peer, ratio, target[, number format])
    interleaved = None
    if "model" in only and "e2e" in only:
        # Each round's end-to-end runs right after its model runs, so the pipeline ratio (3)
        # compares neighbours: the VM's speed drifts by 10-15% over a quarter of an hour.
        interleaved = ({}, {})
        for r in range(a.rounds):
            for part, got in zip(interleaved, (b.model(corpus, [r]), b.e2e(corpus, [r]))):
                for side, runs in got.items():
                    part.setdefault(side, []).extend(runs)
    if "model" in only:
        m = interleaved[0] if interleaved else b.model(corpus)
        res["model"] = m
        s, t = med(m["spotinfer"], "records_per_s"), med(m["pytorch"], "records_per_s")
        lines.append(("1 model records/s (spotinfer bench / PyTorch)", s, t, s / t, 1.25))
        o = med(m["ort"], "records_per_s")
        lines.append(("1 model records/s (spotinfer / ONNX Runtime fp32)", s, o, s / o, 1.5))
        f = med(m["spotinfer-f32"], "records_per_s")
        lines.append(("  model records/s (spotinfer --precision f32 / ONNX Runtime fp32)",
                      f, o, f / o, 1.0))
        lines.append(("  model records/s (spotinfer --precision f32 / PyTorch)", f, t, f / t, 1.0))
        v, v32 = med(m["spotinfer-avx2"], "records_per_s"), med(m["spotinfer-avx2-f32"], "records_per_s")
        if m["ort-avx2"]:
            oa, ta = med(m["ort-avx2"], "records_per_s"), med(m["pytorch-avx2"], "records_per_s")
            lines.append(("  AVX2 only: records/s (spotinfer auto / ONNX Runtime fp32, both AVX2)",
                          v, oa, v / oa, 1.0))
            lines.append(("  AVX2 only: records/s (spotinfer auto / PyTorch, both AVX2)",
                          v, ta, v / ta, 1.0))
            lines.append(("  AVX2 only: records/s (spotinfer f32 / ONNX Runtime fp32, both AVX2)",
                          v32, oa, v32 / oa, None))
            lines.append(("  AVX2 only: records/s (spotinfer f32 / PyTorch, both AVX2)",
                          v32, ta, v32 / ta, None))
        lines.append(("  records/s (spotinfer AVX2 auto / ONNX Runtime fp32 on all it has)",
                      v, o, v / o, None))
        if m["candle"]:
            c = med(m["candle"], "records_per_s")
            lines.append(("  candle BertModel records/s (/ PyTorch)", c, t, c / t, None))
        lines.append(("  CPU system s (spotinfer / PyTorch)", med(m["spotinfer"], "cpu_sys_s"),
                      med(m["pytorch"], "cpu_sys_s"), None, None))
        lines.append(("  CPU system s (spotinfer / ONNX Runtime)", med(m["spotinfer"], "cpu_sys_s"),
                      med(m["ort"], "cpu_sys_s"), None, None))
    if "accuracy" in only:
        acc = b.accuracy(corpus)
        res["accuracy"] = acc
        s, o = acc["candidates"]["spotinfer"], acc["candidates"]["ort"]
        lines.append(("6 worst cosine vs PyTorch fp32 (spotinfer / ONNX Runtime), at least",
                      s["worst_cosine"], o["worst_cosine"], None, 0.999, ".7f"))
        lines.append(("  mean cosine vs PyTorch fp32 (spotinfer / ONNX Runtime)",
                      s["mean_cosine"], o["mean_cosine"], None, None, ".7f"))
        lines.append(("  records below cosine 0.999 (spotinfer / ONNX Runtime)",
                      s["below_0_999"], o["below_0_999"], None, None, ".0f"))
        f = acc["candidates"]["spotinfer-f32"]
        lines.append(("  worst cosine (spotinfer --precision f32 / ONNX Runtime)",
                      f["worst_cosine"], o["worst_cosine"], None, None, ".7f"))
        v = acc["candidates"]["spotinfer-avx2"]
        lines.append(("  worst cosine (spotinfer AVX2 auto / ONNX Runtime), at least",
                      v["worst_cosine"], o["worst_cosine"], None, 0.999, ".7f"))
        lines.append(("  mean cosine (spotinfer AVX2 auto / ONNX Runtime)",
                      v["mean_cosine"], o["mean_cosine"], None, None, ".7f"))
        lines.append(("  records below cosine 0.999 (spotinfer AVX2 auto / ONNX Runtime)",
                      v["below_0_999"], o["below_0_999"], None, None, ".0f"))
    if "e2e" in only:
        e = interleaved[1] if interleaved else b.e2e(corpus)
        res["e2e"] = e
        s = med(e["spotinfer"], "records_per_s")
        if e.get("python-sorted"):
            t = med(e["python-sorted"], "records_per_s")
            lines.append(("2 end-to-end records/s (spotinfer / Python, length-sorted)",
                          s, t, s / t, 2.0))
        o = med(e["python-sorted-ort"], "records_per_s")
        lines.append(("2 end-to-end records/s (spotinfer / Python sorted+ONNX Runtime)",
                      s, o, s / o, 3.0))
        if e.get("python-plain"):
            p = med(e["python-plain"], "records_per_s")
            lines.append(("  end-to-end records/s (spotinfer / Python, arrival order)",
                          s, p, s / p, 2.0))
        if "model" in only:
            raw = med(res["model"]["spotinfer"], "records_per_s")
            per_round = statistics.median(
                x["records_per_s"] / y["records_per_s"]
                for x, y in zip(e["spotinfer"], res["model"]["spotinfer"]))
            lines.append(("3 pipeline: end-to-end / raw model, median of per-round ratios",
                          s, raw, per_round, 0.95))
        peer = "python-sorted" if e.get("python-sorted") else "python-sorted-ort"
        s, t = med(e["spotinfer"], "peak_rss_mib"), med(e[peer], "peak_rss_mib")
        lines.append((f"4 peak RSS MiB (spotinfer / {peer}), at most", s, t, s / t, 0.5))
        o = med(e["python-sorted-ort"], "peak_rss_mib")
        lines.append(("  peak RSS MiB (spotinfer / Python sorted+ONNX Runtime)", s, o, s / o, None))
        s, t = med(e["spotinfer"], "first_commit_s"), med(e[peer], "first_commit_s")
        lines.append((f"5 start to first commit s (spotinfer / {peer}), at most 3 s",
                      s, t, None, 3.0))
        o = med(e["python-sorted-ort"], "first_commit_s")
        lines.append(("  start to first commit s (spotinfer / Python+ONNX Runtime)", s, o, None, None))
        s, o = med(e["spotinfer"], "cpu_us_per_record"), med(e["python-sorted-ort"], "cpu_us_per_record")
        lines.append(("  worker CPU us/record (spotinfer / Python sorted+ONNX Runtime)",
                      s, o, s / o, None, ".0f"))
        lines += gpu_node_headroom(s)
    if "pipeline" in only:
        pp = b.pipeline(corpus)
        res["pipeline"] = pp
        ratios = [e["records_per_s"] / m["records_per_s"] for m, e in zip(pp["model"], pp["e2e"])]
        log("pipeline per-round ratios: " + ", ".join(f"{x:.3f}" for x in ratios))
        lines.append(("3 pipeline, adjacent runs: end-to-end / model, median of per-round ratios",
                      med(pp["e2e"], "records_per_s"), med(pp["model"], "records_per_s"),
                      statistics.median(ratios), 0.95))
        lines.append(("  worker CPU us/record end to end / bench's CPU us/record",
                      med(pp["e2e"], "cpu_us_per_record"),
                      statistics.median(
                          (m["cpu_user_s"] + m["cpu_sys_s"]) * 1e6 / m["records"] for m in pp["model"]),
                      None, None, ".0f"))
    if "pull" in only:
        pl = b.pull(corpus)
        res["pull"] = pl
        c8, c1 = med(pl["8"], "messages_per_s"), med(pl["1"], "messages_per_s")
        lines.append(("7 emulator ceiling msg/s, pull + ack only (8 streams / 1 stream)",
                      c8, c1, c8 / c1, None, ".0f"))
        if "e2e" in only:
            s = med(res["e2e"]["spotinfer"], "records_per_s")
            lines.append(("  spotinfer end-to-end / emulator ceiling (8 streams)",
                          s, c8, s / c8, None, ".0f"))
    res["summary"] = [dict(zip(("figure", "spotinfer", "peer", "ratio", "target"), l)) for l in lines]
    with open(a.out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"\ncorpus: {b.corpus_info}; medians of {a.rounds} rounds; batch size {a.batch_size}")
    print(f"model: {a.model}")
    for name, s, t, ratio, target, *fmt in lines:
        fmt = fmt[0] if fmt else ".2f"
        r = f"{ratio:6.2f}x" if ratio is not None else "       "
        tg = f"(target {target})" if target is not None else ""
        print(f"{name:68} {s:10{fmt}} {t:10{fmt}} {r} {tg}")
    print(f"written to {a.out}")


if __name__ == "__main__":
    main()
