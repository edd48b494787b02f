#!/usr/bin/env bash
# Installs the benchmarks' Python side (bench/requirements.txt) into a virtualenv and prints the
# path of its python. The virtualenv is .cache/bench-venv unless SPOTINFER_BENCH_VENV names
# another. PyTorch from PyPI is large (about 6 GB with its CUDA libraries); it runs on the CPU here.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${SPOTINFER_BENCH_VENV:-.cache/bench-venv}
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
"$venv/bin/pip" install --quiet --disable-pip-version-check -r bench/requirements.txt >&2
echo "$venv/bin/python"
