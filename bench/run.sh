#!/usr/bin/env bash
# The benchmarks of docs/benchmarks.md, from a fresh machine: installs the Python side
# (bench/setup.sh), fetches the model, builds spotinfer and examples/pull_ceiling.rs in release
# mode, starts PostgreSQL and the Pub/Sub emulator, then runs bench/compare.py, which prints
# every figure side by side.
#
#   bench/run.sh                     # both suites below
#   bench/run.sh model [options]     # all-MiniLM-L6-v2: model speed against PyTorch and ONNX
#                                    # Runtime, accuracy over the corpus, end to end (3,000 texts)
#   bench/run.sh ceiling [options]   # the pipeline's ceiling: a 1-layer, 32-wide random-weight
#                                    # model (bench/make_shape.py), end to end and the emulator's
#                                    # own pull rate (20,000 texts)
#
# Extra options go to compare.py, e.g. bench/run.sh model --rounds 5 --records 1000.
set -euo pipefail
cd "$(dirname "$0")/.."
suite=${1:-all}
[ $# -gt 0 ] && shift
python=$(bench/setup.sh | tail -n1)
scripts/fetch-model.sh
cargo build --release --bin spotinfer --example pull_ceiling
pg_url=$(scripts/postgres.sh start | tail -n1)
emulator=${SPOTINFER_BENCH_EMULATOR:-127.0.0.1:8087}
scripts/pubsub-emulator.sh start "$emulator"
compare() {
    "$python" bench/compare.py --spotinfer "$(scripts/cargo-bin.sh spotinfer release)" \
        --pull-ceiling "$(scripts/cargo-bin.sh examples/pull_ceiling release)" \
        --pg-url "$pg_url" --emulator "$emulator" "$@"
}
if [ "$suite" = all ] || [ "$suite" = model ]; then
    compare --records 3000 --only model,accuracy,e2e --out .cache/bench/model.json "$@"
fi
if [ "$suite" = all ] || [ "$suite" = ceiling ]; then
    tiny=.cache/bench/tiny-bert
    [ -f "$tiny/model.safetensors" ] || python3 bench/make_shape.py --from models/all-MiniLM-L6-v2 \
        --out "$tiny" --layers 1 --hidden 32 --heads 2 --intermediate 64 >&2
    compare --model "$tiny" --records 20000 --only e2e,pull --out .cache/bench/ceiling.json "$@"
fi
