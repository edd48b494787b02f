#!/usr/bin/env bash
# The llama.cpp peer of the generation benchmark: llama-cpp-python (pinned in
# tests/fixtures/llm/requirements.txt), built from source into .cache/llm-venv once (minutes on
# two cores), then reused, with gguf-py (bench/make_gguf_shape.py writes its files). Prints the
# venv's python.
#
#     bench/setup-llm.sh          # native: every instruction this CPU has, but AMX (below)
#     bench/setup-llm.sh avx2     # .cache/llm-venv-avx2: AVX2/FMA/F16C only, what an AVX2-only
#                                 # CPU (AMD Zen 2/3) runs, to compare that class on this one
#
# On a CPU with AMX the native build is made with AMX off (-mno-amx-*): built with it, it has
# crashed with a segmentation fault on the AMX Xeons this project measures on, so what it runs
# there is its AVX-512 VNNI code.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.cache/llm-venv
args=-DGGML_NATIVE=ON
flags=
if [[ ${1:-} == avx2 ]]; then
    venv=.cache/llm-venv-avx2
    args="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
    args+=" -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF"
    args+=" -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
elif grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
if ! "$venv/bin/python" -c "import llama_cpp, numpy" 2>/dev/null; then
    python3 -m venv "$venv"
    CMAKE_ARGS="$args" CFLAGS="$flags" CXXFLAGS="$flags" \
        "$venv/bin/pip" install --quiet --no-cache-dir --no-binary llama-cpp-python \
        -r tests/fixtures/llm/requirements.txt numpy gguf==0.19.0 >&2
fi
echo "$venv/bin/python"
