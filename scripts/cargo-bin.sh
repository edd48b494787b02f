#!/usr/bin/env bash
# Prints where cargo puts a binary of this workspace: NAME under the target directory cargo
# reports (which honours CARGO_TARGET_DIR and .cargo/config), for PROFILE (debug or release).
#
#   scripts/cargo-bin.sh spotinfer [debug|release]
set -euo pipefail
cd "$(dirname "$0")/.."
name=${1:?usage: scripts/cargo-bin.sh NAME [debug|release]}
profile=${2:-debug}
target=$(cargo metadata --format-version 1 --no-deps |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
echo "$target/$profile/$name"
