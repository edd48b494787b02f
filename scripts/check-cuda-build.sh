#!/usr/bin/env bash
# The CUDA build as CI checks it, on a machine without a GPU: build it (scripts/build-cuda.sh --debug),
# then run it as the CUDA image does on a node without a driver: through scripts/cuda-entrypoint.sh,
# with the CUDA runtime libraries on the path and no libcuda.so.1 but the fallback one:
#   - `--device cuda` must fail at start-up with a clear "CUDA requested but unavailable";
#   - `--device auto` must fall back to the CPU and embed examples/sample.jsonl, vectors equal to
#     within 1e-5 of the CPU-only build's (the debug binary, built if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-model.sh >/dev/null
# The dev profile, in the test build's target directory (build-cuda.sh --debug): what is checked
# here (the link, the fallback, the refusal) does not depend on the optimiser, and a cold
# release build of its own took longer than the rest of CI on a 2-core machine.
bin=$(scripts/build-cuda.sh --debug | tail -n1)
built=$(dirname "$bin")
cuda_libs=${SPOTINFER_CUDA_TOOLCHAIN:-$PWD/target/cuda-toolchain}/site/nvidia/cu13/lib
export LD_LIBRARY_PATH=$cuda_libs SPOTINFER_BIN=$bin SPOTINFER_CUDA_FALLBACK_DIR=$built/cuda-fallback
export SPOTINFER_MODEL=$PWD/models/all-MiniLM-L6-v2 RUST_BACKTRACE=0
if ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1 '; then
    echo "check-cuda-build: this machine has a CUDA driver; the no-driver check needs one without" >&2
    exit 1
fi
run() { scripts/cuda-entrypoint.sh "$@"; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if run embed --input examples/sample.jsonl --output "$work/cuda.jsonl" --device cuda 2>"$work/err"; then
    echo "check-cuda-build: --device cuda succeeded on a machine without a GPU" >&2
    exit 1
fi
grep -q "CUDA requested but unavailable" "$work/err" || {
    echo "check-cuda-build: unclear error for --device cuda:" >&2
    cat "$work/err" >&2
    exit 1
}
echo "--device cuda refused: $(head -n1 "$work/err")"

run embed --input examples/sample.jsonl --output "$work/auto.jsonl" --device auto
cargo build --quiet --bin spotinfer
"$(scripts/cargo-bin.sh spotinfer)" embed --input examples/sample.jsonl --output "$work/cpu.jsonl" --device cpu >/dev/null
python3 - "$work/auto.jsonl" "$work/cpu.jsonl" <<'PY'
import json, sys
a, b = ([json.loads(l) for l in open(p)] for p in sys.argv[1:3])
assert len(a) == len(b) == 200, (len(a), len(b))
worst = max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra["embedding"], rb["embedding"]))
assert all(ra["id"] == rb["id"] and len(ra["embedding"]) == 384 for ra, rb in zip(a, b))
assert worst < 1e-5, worst
print(f"--device auto fell back to the CPU: 200 vectors, largest difference from the CPU build {worst:.2e}")
PY
ls -l "$bin"
