#!/usr/bin/env bash
# The llama.cpp peer of the generation benchmark: llama-cpp-python (pinned in
# tests/fixtures/llm/requirements.txt), built from source into .cache/llm-venv once (minutes on
# two cores), then reused. Prints the venv's python.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.cache/llm-venv
if ! "$venv/bin/python" -c "import llama_cpp, numpy" 2>/dev/null; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet -r tests/fixtures/llm/requirements.txt numpy >&2
fi
echo "$venv/bin/python"
