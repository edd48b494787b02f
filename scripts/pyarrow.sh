#!/usr/bin/env bash
# Installs pyarrow, DuckDB, jsonschema and the openai client (pinned, hash-checked: scripts/pyarrow-requirements.txt) into its own virtual
# environment and prints that environment's python, for the suite's Parquet round trip.
#
#   scripts/pyarrow.sh            install if needed, print the python path
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/.cache/pyarrow-venv"
py="$venv/bin/python"
if [ -x "$py" ] && "$py" -c "import pyarrow, duckdb, jsonschema, openai" 2>/dev/null; then echo "$py"; exit 0; fi
python3 -m venv "$venv"
"$py" -m pip install --quiet --disable-pip-version-check --only-binary=:all: \
    --require-hashes -r "$root/scripts/pyarrow-requirements.txt" >&2
echo "$py"
