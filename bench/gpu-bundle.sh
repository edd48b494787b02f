#!/usr/bin/env bash
# What a GPU machine with no Rust toolchain, no Java and no network needs to run the GPU check,
# in one folder that travels beside the repository (a GPU machine may be sent 64 MB in all):
#
#   bench/gpu-bundle.sh DIR [--bin BIN]
#
# - DIR/spotinfer.xz: BIN (default: `scripts/build-cuda.sh --debug`'s, built if missing), stripped
#   and xz-compressed: 25 MB for 170 MB. For timings build it with the spotinfer crate optimised
#   (`CARGO_PROFILE_DEV_OPT_LEVEL=2 scripts/build-cuda.sh --debug`, a cold build): the step's
#   host side is what bounds one answer at a time on a GPU.
# - DIR/cuda-fallback/libcuda.so.1: scripts/build-cuda.sh's stub driver, for a machine with none
#   (CI runs the check on the bundle, on the CPU).
# - DIR/emulator.tar.xz: `scripts/pubsub-emulator.sh pack`, 20 MB (a Java runtime and the cut
#   emulator jar, for bench/gpu_job.py's job with SIGTERMs).
#
# There: bench/gpu-check.sh --bundle DIR --device cuda --out OUT [--llm-only]
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:?usage: bench/gpu-bundle.sh DIR [--bin BIN]}
bin=
if [[ ${2:-} == --bin ]]; then bin=${3:?--bin needs a path}; fi
if [[ -z $bin ]]; then
    bin=target/cuda-debug/spotinfer
    [[ -x $bin ]] || scripts/build-cuda.sh --debug >/dev/null
fi
if ! readelf -d "$bin" | grep -q 'libcublas'; then
    echo "gpu-bundle: $bin is not a --features cuda build" >&2
    exit 1
fi
mkdir -p "$dir/cuda-fallback"
cp "$(dirname "$bin")/cuda-fallback/libcuda.so.1" "$dir/cuda-fallback/"
strip -o "$dir/spotinfer" "$bin"
xz -T0 -6 -f "$dir/spotinfer"
scripts/pubsub-emulator.sh pack "$dir/emulator.tar.xz" >/dev/null
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
bundle=$(du -cb "$dir" | tail -1 | cut -f1)
echo "gpu-bundle: $dir: $((bundle >> 20)) MiB, with the repository's files $(((bundle + tree) >> 20)) MiB"
