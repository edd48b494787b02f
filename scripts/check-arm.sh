#!/usr/bin/env bash
# The encoder on aarch64, as CI checks it without an Arm machine: cross-build the encoder crate
# for aarch64-unknown-linux-gnu and run its tests under qemu-user, twice:
#   - on an emulated CPU with Arm's dotprod (`-cpu max`): f32 on the gemm crate's NEON kernels,
#     int8 on sdot, both checked against the vectors sentence-transformers recorded on x86-64
#     (crates/fused-cpu/tests/reference.rs);
#   - on a Cortex-A72 (Graviton 1's core: NEON, no dotprod): f32 as above, int8 refused.
# Installs what it needs: the Rust target, Debian's aarch64 cross compiler and qemu-user.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-model.sh >/dev/null
target=aarch64-unknown-linux-gnu
rustup target list --installed | grep -qx "$target" || rustup target add "$target"
if ! command -v aarch64-linux-gnu-gcc >/dev/null || ! command -v qemu-aarch64 >/dev/null; then
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends gcc-aarch64-linux-gnu libc6-dev-arm64-cross \
        qemu-user >/dev/null
fi
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export SPOTINFER_MODEL=$PWD/models/all-MiniLM-L6-v2 RUST_BACKTRACE=0
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# Release: the emulator runs a debug build of the encoder too slowly for a real model.
for cpu in "max:NEON dotprod (sdot)" "cortex-a72:none"; do
    export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -cpu ${cpu%%:*} -L /usr/aarch64-linux-gnu"
    export SPOTINFER_EXPECT_INT8=${cpu#*:}
    echo "check-arm: aarch64 under qemu -cpu ${cpu%%:*} (int8 kernels expected: $SPOTINFER_EXPECT_INT8)"
    if ! cargo test -p spotinfer-fused-cpu --release --target "$target" -- --nocapture \
        >"$log" 2>&1; then
        tail -n 60 "$log" >&2
        echo "check-arm: the encoder's tests failed under qemu -cpu ${cpu%%:*}" >&2
        exit 1
    fi
    grep -E "worst cosine|refused|test result: ok. [1-9]" "$log"
done
