#!/usr/bin/env python3
"""A generation job with SIGTERMs mid-answer, on whatever device the worker runs (issue 52's
"200-prompt job" on a GPU; in CI on the CPU with the fixture model). One report line.

    python3 bench/gpu_job.py --bin BIN --model DIR --device cuda|cpu [--backend paged]
        [--prompts 200] [--new-tokens 128] [--sigterms 4] [--batch-size 64] --out DIR

What it does, through the real worker, the Pub/Sub emulator (scripts/pubsub-emulator.sh, which
also runs from an unpacked `pack`, for a machine without Java) and SQLite:
- the reference: the prompts published as one job and answered by one worker, never interrupted;
- the job: the same prompts as another job on another topic and database; a worker is started
  and SIGTERMed when a growing share of the job is done, `--sigterms` times, and after each exit
  the checkpoints it left (answers cut mid-way) are read; then a last worker finishes the job;
- every answer of the job must equal the reference's (text, finish reason, token count), every
  SIGTERM must exit 0 within Spot's 15 s, at least one must have come mid-answer (some answers
  resumed from checkpoints) and no checkpoint may be left at the end.

Prompts are the LLM fixtures' conversations, numbered (bench/gpu_llm.py prompts); every third
is sampled (temperature 0.8, top-p 0.95, top-k 50, its own seed), and each asks for its own
number of new tokens (a quarter to all of --new-tokens), so answers end at different steps and
a SIGTERM finds some half written. Exits 1 on any difference, 3 where the emulator does not
start; the last line is the JSON report.
"""
import argparse
import json
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_llm  # noqa: E402

# Spot's notice: a worker must be gone within it after SIGTERM.
SPOT_NOTICE_S = 15.0
# The longest any one worker may take (to its share of the job, or to the job's end).
WAIT_S = 600


def prompts(path, n, new_tokens):
    """The job's records: gpu_llm's numbered conversations, every third sampled, lengths varied."""
    records = gpu_llm.records(n, sampled=lambda i: i % 3 == 2)
    low = max(1, new_tokens // 4)
    for i, r in enumerate(records):
        r["max_new_tokens"] = low + (i * 29) % (new_tokens - low + 1)
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return records


class Job:
    """One job: its topic, subscription and SQLite database, and the worker command."""

    def __init__(self, args, name):
        self.args, self.name = args, name
        self.db = Path(args.out) / f"{name}.sqlite"
        self.db.unlink(missing_ok=True)
        self.env = dict(os.environ, PUBSUB_EMULATOR_HOST=args.emulator,
                        DATABASE_URL=f"sqlite://{self.db}?mode=rwc",
                        SPOTINFER_TOPIC=f"{name}-{os.getpid()}",
                        SPOTINFER_SUBSCRIPTION=f"{name}-{os.getpid()}-sub",
                        SPOTINFER_MODEL=args.model, SPOTINFER_DEVICE=args.device,
                        SPOTINFER_BATCH_SIZE=str(args.batch_size))
        if args.backend:
            self.env["SPOTINFER_BACKEND"] = args.backend
        if args.max_batch_tokens:
            self.env["SPOTINFER_MAX_BATCH_TOKENS"] = args.max_batch_tokens
        self.log = open(Path(args.out) / f"{name}.log", "w")

    def ok(self, *cmd):
        out = subprocess.run([self.args.bin, *cmd], env=self.env, capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"{self.name}: {' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
        return out.stdout

    def publish(self, path):
        self.ok("setup")
        self.ok("publish", str(path), "--job", self.name)

    def worker(self, *extra):
        return subprocess.Popen([self.args.bin, "work", *extra], env=self.env,
                                stdout=self.log, stderr=subprocess.STDOUT)

    def query(self, sql):
        """The rows of `sql` on the job's database, read-only (a worker may be writing)."""
        c = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True)
        try:
            return c.execute(sql).fetchall()
        finally:
            c.close()

    def done(self):
        """Answers committed, read from the database itself: a poll that spawned `status`
        lagged a CPU worker by a batch."""
        if not self.db.exists():
            return 0
        return self.query("SELECT COUNT(*) FROM predictions")[0][0]

    def period(self):
        """The median time between the worker's commits of answers (commits within 0.1 s of
        each other counted as one): about the time a batch takes to answer."""
        times = [datetime.fromisoformat(t.replace("Z", "+00:00")).timestamp()
                 for (t,) in self.query("SELECT processed_at FROM predictions ORDER BY 1")]
        starts = [t for i, t in enumerate(times) if i == 0 or t - times[i - 1] > 0.1]
        gaps = [b - a for a, b in zip(starts, starts[1:])]
        return statistics.median(gaps) if gaps else 0.5

    def checkpoints(self):
        """The record ids with a checkpoint, and the tokens the checkpoints hold."""
        rows = self.query("SELECT record_id, length(tokens) / 4 FROM generation_checkpoints")
        return {r for r, _ in rows}, sum(t for _, t in rows)

    def finish(self, timeout):
        w = self.worker("--exit-when-job-complete", self.name, "--job-poll", "500ms")
        try:
            code = w.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            w.kill()
            raise SystemExit(f"{self.name}: not complete in {timeout} s; log {self.log.name}")
        if code != 0:
            raise SystemExit(f"{self.name}: the last worker exited {code}; log {self.log.name}")

    def answers(self):
        out = Path(self.args.out) / f"{self.name}.jsonl"
        self.ok("export", "--job", self.name, "--output", str(out))
        rows = [json.loads(line) for line in open(out)]
        return {r["id"]: (r["text"], r["finish_reason"], r["completion_tokens"]) for r in rows}


def interrupted(job, total, sigterms, period):
    """Workers SIGTERMed at growing shares of the job, each a part of `period` (a batch's
    answering time) after a commit: right after one, the next batch is often not yet begun.
    Returns the ids they left checkpoints for, the tokens those held and the exit times."""
    resumed, held, exits = set(), 0, []
    # A SIGTERM between two answers leaves nothing to resume: up to four more are sent until
    # one comes mid-answer.
    k = 0
    while k < sigterms or (not resumed and k < sigterms + 4):
        done = job.done()
        if done == total:
            break
        # At least one more result than before: the worker has loaded and is answering.
        target = max(done + 1, total * (k + 1) // (sigterms + 2))
        w = job.worker()
        deadline = time.monotonic() + WAIT_S
        while job.done() < target:
            if w.poll() is not None or time.monotonic() > deadline:
                w.kill()
                raise SystemExit(f"{job.name}: {target} answers not done before SIGTERM {k + 1} "
                                 f"(worker exit {w.poll()}); log {job.log.name}")
            time.sleep(0.02)
        time.sleep(period * (0.3 + 0.4 * (k % 3) / 2))
        at = job.done()
        w.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        try:
            code = w.wait(timeout=60)
        except subprocess.TimeoutExpired:
            w.kill()
            raise SystemExit(f"{job.name}: SIGTERM {k + 1} not obeyed in 60 s; log {job.log.name}")
        exits.append(round(time.monotonic() - sent, 2))
        if code != 0:
            raise SystemExit(f"{job.name}: SIGTERM {k + 1} exited {code}")
        ids, tokens = job.checkpoints()
        resumed |= ids
        held += tokens
        print(f"SIGTERM {k + 1} at {at}/{total} done: exit {exits[-1]} s, "
              f"{len(ids)} answers checkpointed ({tokens} tokens)", flush=True)
        k += 1
    return resumed, held, exits


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--backend", default=None)
    p.add_argument("--prompts", type=int, default=200)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--sigterms", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--emulator", default="127.0.0.1:8093")
    p.add_argument("--emulator-dir", default=None,
                   help="an unpacked `scripts/pubsub-emulator.sh pack` (default: .cache/emulator)")
    p.add_argument("--max-batch-tokens", default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    started = time.monotonic()
    emulator = ROOT / "scripts" / "pubsub-emulator.sh"
    emulator_env = dict(os.environ)
    if args.emulator_dir:
        emulator_env["SPOTINFER_EMULATOR_DIR"] = str(Path(args.emulator_dir).resolve())
    started_emulator = subprocess.run([str(emulator), "start", args.emulator], env=emulator_env,
                                      capture_output=True, text=True)
    if started_emulator.returncode != 0:
        # Exit status 3: the job could not be run here (no Java and no unpacked pack).
        print(started_emulator.stderr, file=sys.stderr)
        print(json.dumps({"unmeasured": "the Pub/Sub emulator did not start: "
                          + started_emulator.stderr.strip()[-300:]}))
        raise SystemExit(3)
    try:
        path = Path(args.out) / "job-prompts.jsonl"
        records = prompts(path, args.prompts, args.new_tokens)
        reference = Job(args, "reference")
        reference.publish(path)
        reference.finish(timeout=WAIT_S)
        want = reference.answers()
        job = Job(args, "sigterms")
        job.publish(path)
        resumed, held, exits = interrupted(job, len(records), args.sigterms, reference.period())
        job.finish(timeout=WAIT_S)
        left = job.checkpoints()[0]
        got = job.answers()
    finally:
        subprocess.run([str(emulator), "stop", args.emulator], check=False, env=emulator_env)
    differ = sorted(i for i in want if got.get(i) != want[i])
    report = {"device": args.device, "prompts": len(records), "answers": len(got),
              "reference_answers": len(want), "differ": differ[:10], "differing": len(differ),
              "resumed": len(resumed), "resumed_equal": len(resumed - set(differ)),
              "checkpointed_tokens": held, "sigterm_exit_s": exits,
              "checkpoints_left": len(left), "minutes": round((time.monotonic() - started) / 60, 2)}
    failures = []
    if len(want) != len(records) or len(got) != len(records):
        failures.append(f"{len(want)} reference and {len(got)} job answers of {len(records)}")
    if differ:
        failures.append(f"{len(differ)} answers differ from the uninterrupted ones, e.g. {differ[:3]}")
    if not resumed:
        failures.append("no SIGTERM came mid-answer: nothing was resumed")
    if left:
        failures.append(f"{len(left)} checkpoints left after the job")
    if any(e > SPOT_NOTICE_S for e in exits):
        failures.append(f"a SIGTERMed worker took longer than {SPOT_NOTICE_S} s: {exits}")
    report["failures"] = failures
    print(json.dumps(report))
    if failures:
        raise SystemExit("gpu-job failed: " + "; ".join(failures))


if __name__ == "__main__":
    main()
