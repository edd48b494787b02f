#!/usr/bin/env bash
# Structured outputs' effect and cost (issue 56), from a fresh machine: N extraction prompts over
# real texts (bench/real_corpus.py) with the nested schema of
# tests/fixtures/llm/extraction_schema.json on the SmolLM2 GGUF, constrained greedy, unconstrained
# greedy and constrained seeded sampling (examples/constrained.rs prints tokens/s), then every
# answer parsed and validated by Python's jsonschema (scripts/pyarrow.sh's environment).
#
#   bench/constrained.sh [N=200] [B=32] [ROUNDS=1] [f32|gguf]
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-200} b=${2:-32} rounds=${3:-1} precision=${4:-f32}
scripts/fetch-llm.sh >&2
python=$(scripts/pyarrow.sh | tail -n1)
mkdir -p .cache/bench
records=.cache/bench/constrained-records-$n.jsonl
[ -s "$records" ] || python3 bench/real_corpus.py "$n" >"$records"
cargo build --release --example constrained
out=$(mktemp)
python3 -c 'import sys; sys.path.insert(0, "bench"); import machine; print("cpu:", machine.cpu_model(), "flags:", " ".join(f for f in machine.KERNEL_FLAGS if f in machine.cpu_flags()))'
"$(scripts/cargo-bin.sh examples/constrained release)" \
    models/SmolLM2-135M-Instruct/SmolLM2-135M-Instruct.Q4_1.gguf "$records" "$n" "$b" "$out" \
    "$precision" "$rounds"
"$python" - "$out" <<'PY'
import json, sys, jsonschema
d = json.load(open(sys.argv[1]))
for kind in ["constrained", "sampled", "unconstrained"]:
    parsed = valid = 0
    for text in d[kind]:
        try:
            value = json.loads(text)
        except ValueError:
            continue
        parsed += 1
        try:
            jsonschema.validate(value, d["schema"])
            valid += 1
        except jsonschema.ValidationError:
            pass
    print(json.dumps({"kind": kind, "answers": len(d[kind]), "parse": parsed, "valid": valid}))
PY
rm -f "$out"
