#!/usr/bin/env bash
# The main job end to end on a fresh machine: fetch the model, start the Pub/Sub emulator, create
# the topic/subscription and the SQLite database, publish examples/sample.jsonl, run one worker
# until the batch is done, and print the job's summary.
#
#   scripts/quickstart.sh [FILE.jsonl]
set -euo pipefail
cd "$(dirname "$0")/.."
input=${1:-examples/sample.jsonl}
scripts/build-deps.sh
scripts/fetch-model.sh
export PUBSUB_EMULATOR_HOST=${PUBSUB_EMULATOR_HOST:-127.0.0.1:8085}
scripts/pubsub-emulator.sh start "$PUBSUB_EMULATOR_HOST"
export DATABASE_URL=${DATABASE_URL:-sqlite://spotinfer.db}
export SPOTINFER_MODEL=${SPOTINFER_MODEL:-$PWD/models/all-MiniLM-L6-v2}
cargo build --quiet
bin=$(scripts/cargo-bin.sh spotinfer)
$bin setup
# --republish: run again, the same records go out again (and are UPSERTed: nothing doubles).
$bin publish "$input" --job sample --republish
$bin work --exit-when-idle 3s
$bin status --job sample
