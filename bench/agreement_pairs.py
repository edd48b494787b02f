#!/usr/bin/env python3
"""Two runs of examples/gguf_greedy.rs on the same references, compared position by position:
where only one of them agrees with llama.cpp's token, and whether that split could be chance.

    python3 bench/agreement_pairs.py A.json B.json

Each file is gguf_greedy's JSON line (its `agreed` marks). The positions where both agree or
both disagree say nothing about which is closer; of the others ("only A", "only B"), if neither
run were closer each would be A's with probability 1/2, so the exact two-sided binomial
probability of a split at least as uneven (McNemar's exact test) is printed beside the counts.
A top-1 agreement "not lower" than another's is then read as: B's count of only-B positions
not significantly below A's.
"""
import json
import sys
from math import comb


def marks(path):
    with open(path) as f:
        run = json.loads(f.read().strip().splitlines()[-1])
    return "".join(run["agreed"]), run


def main():
    (a, run_a), (b, run_b) = marks(sys.argv[1]), marks(sys.argv[2])
    if len(a) != len(b):
        sys.exit(f"the runs cover {len(a)} and {len(b)} positions: not the same references")
    only_a = sum(x == "1" and y == "0" for x, y in zip(a, b))
    only_b = sum(x == "0" and y == "1" for x, y in zip(a, b))
    n, low = only_a + only_b, min(only_a, only_b)
    p = min(1.0, 2 * sum(comb(n, k) for k in range(low + 1)) / 2**n) if n else 1.0
    print(json.dumps({
        "positions": len(a),
        "agreement": [a.count("1") / len(a), b.count("1") / len(b)],
        "precision": [run_a.get("precision"), run_b.get("precision")],
        "both": sum(x == y == "1" for x, y in zip(a, b)),
        "neither": sum(x == y == "0" for x, y in zip(a, b)),
        "only_a": only_a,
        "only_b": only_b,
        "p_two_sided": round(p, 4),
    }))


if __name__ == "__main__":
    main()
