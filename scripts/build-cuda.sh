#!/usr/bin/env bash
# Builds the release binary with `--features cuda` on a machine with no GPU and no CUDA install:
# the CUDA 13.0 toolchain comes from PyPI (pinned and hash-checked in cuda-requirements.txt).
#
#   scripts/build-cuda.sh            # -> target/cuda/release/spotinfer
#   scripts/build-cuda.sh --check    # type-check the CUDA code paths only (cargo check, no link)
#   scripts/build-cuda.sh --debug    # -> target/cuda-debug/spotinfer, CI's build (see below)
#
# Two things the PyPI packages lack, and a link needs, are made here:
# - unversioned library names (libcublas.so -> libcublas.so.13, ...): candle links cudarc
#   dynamically (-lcublas, -lcurand, ...) and the wheels ship only the versioned files;
# - a stub libcuda.so carrying the driver's soname (libcuda.so.1), as the CUDA toolkit's stubs/
#   does: it defines every driver function cudarc declares, each answering CUDA_ERROR_NO_DEVICE.
#   At run time the binary finds the node's real libcuda.so.1 by that soname; on a machine with
#   no driver, the same stub (target/cuda/release/cuda-fallback/) lets it start and report that
#   CUDA is unavailable instead of failing to load.
# Settings: CUDA_COMPUTE_CAP (default 90, H100/H200; 80 for A100, 89 for L4), CARGO_TARGET_DIR
# (default target/cuda), SPOTINFER_CUDA_TOOLCHAIN (default target/cuda-toolchain).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
toolchain=${SPOTINFER_CUDA_TOOLCHAIN:-$root/target/cuda-toolchain}
requirements=$root/scripts/cuda-requirements.txt
stamp=$toolchain/requirements.sha256

# 1. The toolchain, reinstalled only when the pinned list changes.
want=$(sha256sum "$requirements" | cut -d' ' -f1)
if [[ "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
    rm -rf "$toolchain"
    mkdir -p "$toolchain"
    python3 -m pip install --quiet --disable-pip-version-check --no-deps --require-hashes --no-cache-dir \
        --target "$toolchain/site" -r "$requirements"
    echo "$want" >"$stamp"
fi
cuda=$toolchain/site/nvidia/cu13

# 2. What the linker needs: unversioned names and the driver stub, in one directory.
link=$toolchain/link
mkdir -p "$link"
for lib in cudart cublas cublasLt curand nvrtc; do
    versioned=$(find "$cuda/lib" -maxdepth 1 -name "lib$lib.so.*" ! -name "*.alt.*" | sort | head -n1)
    [[ -n "$versioned" ]] || { echo "build-cuda: lib$lib.so.* missing from $cuda/lib" >&2; exit 1; }
    ln -sf "$versioned" "$link/lib$lib.so"
done
"$root/scripts/build-deps.sh"
cargo fetch --quiet
cudarc=$(cargo metadata --format-version 1 --features cuda 2>/dev/null | python3 -c '
import json, sys
meta = json.load(sys.stdin)
print(next(p["manifest_path"] for p in meta["packages"] if p["name"] == "cudarc").rsplit("/", 1)[0])')
{
    echo '/* Every CUDA driver function cudarc declares: CUDA_ERROR_NO_DEVICE (100). */'
    grep -ohE 'pub unsafe fn cu[A-Za-z0-9_]+\(' "$cudarc/src/driver/sys/mod.rs" |
        sed -E 's/pub unsafe fn (.*)\(/\1/' | grep -vE '^cuGetError(String|Name)$' | sort -u |
        sed -E 's/.*/int &(void) { return 100; }/'
    echo 'int cuGetErrorString(int e, const char **s) { *s = e == 100 ? "no CUDA driver on this machine (spotinfer fallback libcuda)" : "CUDA error"; return 0; }'
    echo 'int cuGetErrorName(int e, const char **s) { *s = e == 100 ? "CUDA_ERROR_NO_DEVICE" : "CUDA_ERROR_UNKNOWN"; return 0; }'
} >"$link/cuda-stub.c"
cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$link/libcuda.so" "$link/cuda-stub.c"

# 3. The build. cudarc reads the version from `nvcc --version`; candle's kernels are compiled for
# CUDA_COMPUTE_CAP (there is no GPU here to ask).
export PATH=$cuda/bin:$PATH
export CUDA_ROOT=$cuda CUDA_PATH=$cuda
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
# candle-kernels' build compiles its quantised-matmul kernels with nvcc one file at a time
# unless told otherwise (15 of a cold build's 21 minutes on a 2-core EPYC).
export CUDAFORGE_THREADS=${CUDAFORGE_THREADS:-$(nproc)}
export LIBRARY_PATH=$link${LIBRARY_PATH:+:$LIBRARY_PATH}
# The stub also runs: beside the binary as libcuda.so.1, for machines without a driver (see
# docs/deploy.md, "The GPU build": the binary then starts, refuses --device cuda and falls back
# with --device auto).
place() { # built-binary destination-directory
    mkdir -p "$2/cuda-fallback"
    [[ "$1" -ef "$2/spotinfer" ]] || cp "$1" "$2/spotinfer"
    cp "$link/libcuda.so" "$2/cuda-fallback/libcuda.so.1"
    echo "$2/spotinfer"
}
if [[ "${1:-}" == --debug ]]; then
    # CI's build: the dev profile in the test build's own target directory, so that only what the
    # cuda feature changes (candle's crates, cudarc, spotinfer) is compiled again: a cold release
    # build in a directory of its own took longer than the rest of CI on a 2-core EPYC. No
    # RUSTFLAGS here (a change there rebuilds every crate the test build shares): the linker
    # finds $link through LIBRARY_PATH. The binary is copied out, since the CPU build's next
    # `cargo build` puts its own back at target/debug/spotinfer.
    target=${CARGO_TARGET_DIR:-$root/target}
    cargo build --features cuda --bin spotinfer
    place "$target/debug/spotinfer" "$root/target/cuda-debug"
    exit
fi
export RUSTFLAGS="${RUSTFLAGS:-} -L native=$link"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target/cuda}
if [[ "${1:-}" == --check ]]; then
    exec cargo check --features cuda --workspace --all-targets
fi
cargo build --release --features cuda --bin spotinfer
place "$CARGO_TARGET_DIR/release/spotinfer" "$CARGO_TARGET_DIR/release"
