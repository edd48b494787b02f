#!/usr/bin/env bash
# The whole test suite, from a fresh machine: fetches the models (all-MiniLM-L6-v2, the SmolLM2
# GGUF), starts PostgreSQL 15 (Debian's), PostgreSQL 16 with pgvector (from the pgserver wheel)
# and the Pub/Sub emulator (with the stream-cancel fix), installs the Cloud Storage emulator (the
# tests start it) and pyarrow (the Parquet round trip), then runs every test against them.
#
#   scripts/test.sh [extra cargo test args]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build-deps.sh
scripts/fetch-model.sh
scripts/fetch-llm.sh >/dev/null
pg_url=$(scripts/postgres.sh start | tail -n1)
pgvector_url=$(scripts/pgvector.sh start | tail -n1)
emulator=${SPOTINFER_TEST_EMULATOR:-127.0.0.1:8086}
scripts/pubsub-emulator.sh start "$emulator"
export SPOTINFER_FAKE_GCS_BIN=$(scripts/fake-gcs.sh | tail -n1)
export PUBSUB_EMULATOR_HOST=$emulator
export SPOTINFER_TEST_PG_URL=$pg_url
export SPOTINFER_TEST_PGVECTOR_URL=$pgvector_url
export SPOTINFER_TEST_PYTHON=$(scripts/pyarrow.sh | tail -n1)
export SPOTINFER_MODEL=$PWD/models/all-MiniLM-L6-v2
# No backtraces: CI keeps the tail of the output, and a page of frames would push the failing
# assertion's message out of it. Rerun one test with RUST_BACKTRACE=1 to see where it panicked.
export RUST_BACKTRACE=0
cargo test --workspace --all-targets "$@"
