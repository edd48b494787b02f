#!/usr/bin/env bash
# The pair-scoring figures of docs/benchmarks.md, from a fresh machine: installs the Python side
# (bench/setup.sh), fetches the model whose vocabulary the cross-encoder uses, builds spotinfer
# in release mode, then runs bench/rerank.py (spotinfer against ONNX Runtime, alternated).
#
#   bench/rerank.sh [--pairs 2000] [--rounds 5] [--batch-size 32]
set -euo pipefail
cd "$(dirname "$0")/.."
python=$(bench/setup.sh | tail -n1)
scripts/fetch-model.sh
cargo build --release --bin spotinfer
"$python" bench/rerank.py --spotinfer "$(scripts/cargo-bin.sh spotinfer release)" "$@"
