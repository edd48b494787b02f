#!/usr/bin/env python3
"""The peer of `spotinfer publish` on a Parquet input: what a user writes with Google's official
Python client (google-cloud-pubsub) and pyarrow. Reads the table a record batch at a time, makes
each row the same message spotinfer sends ({"id", "text", "job"}), publishes it with the
client's default batching and a flow control that blocks at the same byte bound spotinfer holds
(256 MiB), waits for every publish, and prints one JSON line: rows, seconds, rows_per_s.

    python bench/publish_peer.py TABLE.parquet PROJECT TOPIC [JOB]

PUBSUB_EMULATOR_HOST points the client at the emulator.
"""
import json
import sys
import time

import pyarrow.parquet as pq
from google.cloud import pubsub_v1
from google.cloud.pubsub_v1.types import LimitExceededBehavior, PublishFlowControl, PublisherOptions


def main(path, project, topic, job="bench"):
    flow = PublishFlowControl(message_limit=1_000_000, byte_limit=256 << 20,
                              limit_exceeded_behavior=LimitExceededBehavior.BLOCK)
    publisher = pubsub_v1.PublisherClient(publisher_options=PublisherOptions(flow_control=flow))
    name = publisher.topic_path(project, topic)
    started = time.monotonic()
    futures, rows = [], 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=10_000, columns=["doc_id", "body"]):
        for doc_id, body in zip(batch.column("doc_id").to_pylist(), batch.column("body").to_pylist()):
            data = json.dumps({"id": str(doc_id), "text": body, "job": job}, ensure_ascii=False)
            futures.append(publisher.publish(name, data.encode()))
            rows += 1
        # Settle what is done, so the list of futures does not hold the whole input.
        if len(futures) > 50_000:
            for f in futures:
                f.result()
            futures = []
    for f in futures:
        f.result()
    seconds = time.monotonic() - started
    print(json.dumps({"rows": rows, "seconds": round(seconds, 3),
                      "rows_per_s": round(rows / seconds, 1)}))


if __name__ == "__main__":
    main(*sys.argv[1:])
