#!/usr/bin/env bash
# The images benchmark of docs/benchmarks.md ("Images"), from a fresh machine: installs the
# Python side (bench/setup.sh), makes a CLIP ViT-B/32-shaped model with random weights and the
# photographs (bench/image_peer.py), 12-megapixel versions of them for the memory run, builds
# spotinfer, the load test and examples/image_speed.rs in release mode, then runs
# bench/images.py, which prints every figure. Extra options go to bench/images.py.
#
#   bench/images.sh [--rounds 5] [--out bench/results/images-DATE.json]
set -euo pipefail
cd "$(dirname "$0")/.."
python=$(bench/setup.sh | tail -n1)
model=.cache/bench/clip-b32
photos=.cache/bench/image-photos
large=.cache/bench/image-large
[ -f "$model/model.safetensors" ] || "$python" bench/image_peer.py --make-model "$model"
[ -d "$photos" ] || "$python" bench/image_peer.py --make-photos "$photos"
[ -d "$large" ] || "$python" bench/image_peer.py --make-large "$photos" "$large"
cargo build --release --bin spotinfer --example image_speed
cargo build --release -p spotinfer-loadtest
"$python" bench/images.py --image-speed "$(scripts/cargo-bin.sh examples/image_speed release)" \
    --loadtest "$(scripts/cargo-bin.sh spotinfer-loadtest release)" \
    --model "$model" --photos "$photos" --large "$large" --large-pixels 12000000 "$@"
