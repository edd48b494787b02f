#!/usr/bin/env python3
"""Writes a deterministic JSONL corpus of records with realistic, varied lengths.

    scripts/make-corpus.py N [SEED] > records.jsonl

Texts run from a few words to about 300 words, built from plain English sentences, so they
exercise truncation (256 tokens) as well as short-batch padding. The same N and SEED always
give the same file.
"""
import json
import random
import sys

SUBJECTS = ["The worker", "A spot node", "The scheduler", "Our team", "The model", "This batch",
            "The database", "A user", "The pipeline", "Every message", "The cluster", "A request",
            "The storage bucket", "The embedding", "The report", "An engineer"]
VERBS = ["processes", "drops", "retries", "embeds", "commits", "acknowledges", "loses", "reads",
         "writes", "measures", "restarts", "drains", "publishes", "receives", "ignores", "checks"]
OBJECTS = ["the records", "a large file", "every sentence", "the results", "its lease",
           "the transaction", "a preemption notice", "the subscription", "twenty thousand rows",
           "the vectors", "a slow query", "the metrics", "the queue", "a poison message",
           "the cache", "the tokenizer output"]
TAILS = ["before the deadline.", "without losing anything.", "after a short pause.",
         "in under a second.", "when the node disappears.", "while the GPU is busy.",
         "at three in the morning.", "for the second time today.", "as fast as it can.",
         "because the budget is tight.", "and then it waits.", "on cheap capacity."]


def sentence(rng):
    return " ".join([rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS), rng.choice(TAILS)])


def text(rng):
    # Mostly short and medium texts, with a long tail past the 256-token limit.
    target = int(min(300, max(3, rng.lognormvariate(3.4, 0.9))))
    words = []
    while len(words) < target:
        words.extend(sentence(rng).split())
    return " ".join(words[:target])


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 7
    rng = random.Random(seed)
    for i in range(n):
        print(json.dumps({"id": f"rec-{seed}-{i:06d}", "text": text(rng), "job": "sample"}))


if __name__ == "__main__":
    main()
