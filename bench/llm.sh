#!/usr/bin/env bash
# The generation benchmark of docs/benchmarks.md ("Generation"), from a fresh machine: fetches
# the SmolLM2 GGUF, builds llama-cpp-python (bench/setup-llm.sh, cached) and the transformers
# side (bench/setup.sh), makes a random-weight SmolLM2-shaped Llama folder, writes llama.cpp's
# greedy references of 40 real prompts, builds spotinfer and its examples in release mode and
# runs bench/llm.py, which prints every figure. Extra options go to bench/llm.py. Needs the
# Pub/Sub emulator for the resumption part (scripts/pubsub-emulator.sh start).
#
#   bench/llm.sh [--rounds 3] [--out bench/results/llm-DATE.json]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-llm.sh >&2
llm_python=$(bench/setup-llm.sh | tail -n1)
bench_python=$(bench/setup.sh | tail -n1)
random=.cache/bench/llm-random-135m
[ -f "$random/model.safetensors" ] || "$bench_python" bench/llm_transformers.py --make "$random"
prompts=.cache/bench/llm-prompts.json
[ -f "$prompts" ] || "$llm_python" bench/llm_greedy.py 40 "$prompts"
cargo build --release --bin spotinfer --example llm_speed --example gguf_greedy
export PUBSUB_EMULATOR_HOST=${PUBSUB_EMULATOR_HOST:-127.0.0.1:8086}
python3 bench/llm.py --spotinfer "$(scripts/cargo-bin.sh spotinfer release)" \
    --llm-speed "$(scripts/cargo-bin.sh examples/llm_speed release)" \
    --gguf-greedy "$(scripts/cargo-bin.sh examples/gguf_greedy release)" \
    --llm-python "$llm_python" --bench-python "$bench_python" \
    --random-model "$random" --prompts "$prompts" "$@"
