#!/usr/bin/env python3
"""The Python peer `bench/compare.py` measures `spotinfer work` against: the same job, done well.

    python bench/py_worker.py --subscription S --database-url postgres://... [--model DIR]
        [--engine torch|ort]

- google-cloud-pubsub streaming pull with flow control (at most --max-outstanding messages
  leased; the client extends their leases);
- up to --window messages (what arrived within --max-wait) sorted by length and cut into
  batches of --batch-size, so each batch pads little, embedded by sentence-transformers
  (PyTorch, CPU; mean pooling + L2 norm, the same vectors as spotinfer), or with --engine ort
  by the model exported to ONNX and run by ONNX Runtime (bench/ort_encode.py's encoder: the same
  tokenizer, pooling and normalisation, so the same vectors; exported first by
  bench/ort_export.py when .cache/bench/onnx has no up-to-date copy, before pulling starts);
- one transaction per batch: a psycopg UPSERT keyed by record id, newest publish wins;
- ack only after the commit; a failed commit NACKs the batch;
- SIGTERM/SIGINT: stop pulling, NACK every message not committed, exit 0.

Malformed records (bad JSON, no id, empty text) are written to failed_records and acked, like
spotinfer does. The emulator is used when PUBSUB_EMULATOR_HOST is set (the client reads it).
"""
import argparse
import hashlib
import json
import logging
import os
import queue
import signal
import sys
import threading
import time

import psycopg
from google.cloud import pubsub_v1
from st_model import default_model

SCHEMA = """
CREATE TABLE IF NOT EXISTS embeddings (
    record_id       text PRIMARY KEY,
    embedding       real[] NOT NULL,
    model           text NOT NULL,
    dim             integer NOT NULL,
    job             text,
    input_sha256    text NOT NULL,
    message_id      text NOT NULL,
    publish_time_us bigint NOT NULL,
    processed_at    timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS failed_records (
    message_id      text PRIMARY KEY,
    error           text NOT NULL,
    payload         bytea NOT NULL,
    failed_at       timestamptz NOT NULL DEFAULT now()
);
"""

UPSERT = """
INSERT INTO embeddings (record_id, embedding, model, dim, job, input_sha256, message_id,
                        publish_time_us)
VALUES (%s, %s, %s, %s, %s, %s, %s, %s)
ON CONFLICT (record_id) DO UPDATE SET
    embedding = EXCLUDED.embedding, model = EXCLUDED.model, dim = EXCLUDED.dim,
    job = EXCLUDED.job, input_sha256 = EXCLUDED.input_sha256, message_id = EXCLUDED.message_id,
    publish_time_us = EXCLUDED.publish_time_us, processed_at = now()
WHERE embeddings.publish_time_us <= EXCLUDED.publish_time_us
"""

FAILED = """
INSERT INTO failed_records (message_id, error, payload) VALUES (%s, %s, %s)
ON CONFLICT (message_id) DO NOTHING
"""


def parse(message):
    try:
        rec = json.loads(message.data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, f"invalid record: {e}"
    if not isinstance(rec, dict) or not isinstance(rec.get("id"), str) or not rec["id"]:
        return None, "invalid record: missing id"
    if not isinstance(rec.get("text"), str) or not rec["text"].strip():
        return None, "invalid record: empty text"
    return rec, None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--project", default="spotinfer-local")
    p.add_argument("--subscription", required=True)
    p.add_argument("--database-url", required=True)
    p.add_argument("--model", help="sentence-transformers model folder (default: the package's)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-wait", type=float, default=0.05)
    p.add_argument("--max-outstanding", type=int, default=1000)
    p.add_argument("--window", type=int, default=256,
                   help="most messages sorted by length together before batching")
    p.add_argument("--engine", choices=["torch", "ort"], default="torch",
                   help="sentence-transformers on PyTorch, or the ONNX export on ONNX Runtime")
    p.add_argument("--onnx", help="with --engine ort: the exported model (default: made if stale)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s py_worker %(message)s")

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    model_dir = args.model or default_model()
    if args.engine == "ort":
        from ort_encode import OrtEncoder

        encoder = OrtEncoder(model_dir, args.onnx)  # PyTorch is not loaded unless it exports
        embed = lambda texts: encoder.encode(texts, batch_size=args.batch_size)
    else:
        from st_model import load_model

        model = load_model(model_dir)
        embed = lambda texts: model.encode(texts, batch_size=args.batch_size,
                                           show_progress_bar=False)
    # The folder's name, as spotinfer names the model it loaded.
    model_name = os.path.basename(os.path.normpath(model_dir))
    conn = psycopg.connect(args.database_url)
    conn.execute(SCHEMA)
    conn.commit()

    inbox = queue.Queue()
    subscriber = pubsub_v1.SubscriberClient()
    path = subscriber.subscription_path(args.project, args.subscription)
    future = subscriber.subscribe(
        path,
        callback=inbox.put,
        flow_control=pubsub_v1.types.FlowControl(max_messages=args.max_outstanding),
    )
    logging.info("pulling from %s (engine %s)", path, args.engine)

    batch = []
    window = []  # pulled, not yet committed: the lease window, processed shortest first
    stats = {"batches": 0, "records": 0, "wait_s": 0.0, "encode_s": 0.0, "commit_s": 0.0}
    while not stop.is_set():
        t_wait = time.monotonic()
        if not window:
            # Wait for a first message, then take everything that arrives within --max-wait
            # (up to --window): sorting that window by length keeps padding per batch small.
            try:
                window.append(inbox.get(timeout=0.1))
            except queue.Empty:
                continue
            deadline = time.monotonic() + args.max_wait
            while len(window) < args.window:
                left = deadline - time.monotonic()
                try:
                    window.append(inbox.get(timeout=left) if left > 0 else inbox.get_nowait())
                except queue.Empty:
                    if left <= 0:
                        break
            window.sort(key=lambda m: len(m.data), reverse=True)
        if stop.is_set():
            break
        batch = [window.pop() for _ in range(min(args.batch_size, len(window)))]
        t_encode = time.monotonic()
        stats["wait_s"] += t_encode - t_wait
        good, bad = [], []
        for m in batch:
            rec, err = parse(m)
            (good if rec else bad).append((m, rec or err))
        vectors = embed([r["text"] for _, r in good]) if good else []
        t_commit = time.monotonic()
        stats["encode_s"] += t_commit - t_encode
        try:
            with conn.transaction():
                with conn.cursor() as cur:
                    if good:
                        cur.executemany(UPSERT, [
                            (r["id"], v.tolist(), model_name, len(v), r.get("job"),
                             hashlib.sha256(r["text"].encode("utf-8")).hexdigest(), m.message_id,
                             int(m.publish_time.timestamp() * 1_000_000))
                            for (m, r), v in zip(good, vectors)])
                    if bad:
                        cur.executemany(FAILED, [(m.message_id, e, m.data) for m, e in bad])
        except psycopg.Error as e:
            logging.error("commit failed, nacking %d messages: %s", len(batch), e)
            for m in batch:
                m.nack()
            batch = []
            time.sleep(1)
            continue
        for m in batch:
            m.ack()
        stats["commit_s"] += time.monotonic() - t_commit
        stats["batches"] += 1
        stats["records"] += len(batch)
        batch = []

    # Shutdown: stop the stream, then NACK everything pulled but not committed.
    future.cancel()
    pending = list(batch) + window
    while True:
        try:
            pending.append(inbox.get_nowait())
        except queue.Empty:
            break
    for m in pending:
        m.nack()
    try:
        future.result(timeout=5)
    except Exception:  # the cancelled future raises; that is the expected end
        pass
    subscriber.close()
    logging.info("stopped, nacked %d; %s", len(pending), json.dumps(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
