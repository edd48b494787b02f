#!/usr/bin/env bash
# The benchmarks of docs/benchmarks.md, from a fresh machine: installs the Python side
# (bench/setup.sh), fetches the model, builds spotinfer in release mode, starts PostgreSQL and
# the Pub/Sub emulator, then runs bench/compare.py, which prints every figure side by side.
#
#   bench/run.sh [compare.py options]      e.g. bench/run.sh --records 1000 --rounds 3
set -euo pipefail
cd "$(dirname "$0")/.."
python=$(bench/setup.sh | tail -n1)
scripts/fetch-model.sh
cargo build --release --bin spotinfer
pg_url=$(scripts/postgres.sh start | tail -n1)
emulator=${SPOTINFER_BENCH_EMULATOR:-127.0.0.1:8087}
scripts/pubsub-emulator.sh start "$emulator"
exec "$python" bench/compare.py --spotinfer "$(scripts/cargo-bin.sh spotinfer release)" \
    --pg-url "$pg_url" --emulator "$emulator" "$@"
