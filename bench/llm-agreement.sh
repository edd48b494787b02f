#!/usr/bin/env bash
# Top-1 agreement of the GGUF blocks and of f32 with llama.cpp's greedy tokens, teacher forced,
# over N real-text prompts × 32 tokens (docs/generate.md, Exactness), with llama.cpp's own
# yardsticks, from a fresh machine: SmolLM2's Q4_1 file and the same requantised to Q4_K_M;
# references from llama.cpp's native build with its cache in f16 and in f32
# (bench/llm_greedy.py); spotinfer's two paths on each (examples/gguf_greedy.rs); llama.cpp
# teacher forced on them (bench/llama_forced.py), natively and, with `avx2`, by its AVX2-only
# build too; then each pair of runs position by position (bench/agreement_pairs.py). About half
# an hour at N = 200 on 2 vCPUs, most of it llama.cpp writing its references.
#
#   bench/llm-agreement.sh [N=200] [avx2] [--out DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
n=200 avx2="" out=.cache/bench/agreement
while [ $# -gt 0 ]; do
    case $1 in
        avx2) avx2=1 ;;
        --out) out=$2; shift ;;
        *) n=$1 ;;
    esac
    shift
done
mkdir -p "$out"
scripts/fetch-llm.sh >&2
native=$(bench/setup-llm.sh | tail -n1)
builds=(native)
[ -z "$avx2" ] || { bench/setup-llm.sh avx2 >/dev/null; builds+=(avx2); }
q41=models/SmolLM2-135M-Instruct/SmolLM2-135M-Instruct.Q4_1.gguf
q4km=.cache/bench/smollm2.Q4_K_M.gguf
[ -f "$q4km" ] || "$native" bench/make_gguf_shape.py --requantize "$q41" --out "$q4km" --type Q4_K_M >&2
# The dev profile: the decoder's crate is optimised there too, and the figures are the same bits.
cargo build --example gguf_greedy >&2
greedy=$(scripts/cargo-bin.sh examples/gguf_greedy debug)
export RAYON_NUM_THREADS=${RAYON_NUM_THREADS:-2}
for file in Q4_1 Q4_K_M; do
    gguf=$q41
    [ $file = Q4_1 ] || gguf=$q4km
    for kv in f16 f32; do
        ref=$out/ref-$file-$kv-$n.json
        [ -s "$ref" ] || "$native" bench/llm_greedy.py "$n" "$ref" "$gguf" "$kv"
        for path in gguf f32; do
            "$greedy" "$gguf" "$ref" "$path" 2>/dev/null >"$out/$path-$file-$kv.json"
        done
        for build in "${builds[@]}"; do
            python=$native
            [ "$build" = native ] || python=.cache/llm-venv-avx2/bin/python
            "$python" bench/llama_forced.py "$gguf" "$ref" "$kv" >"$out/llama-$build-$file-$kv.json"
        done
        for run in "$out"/{gguf,f32}-$file-$kv.json "$out"/llama-*-$file-$kv.json; do
            python3 -c 'import json, sys; r = json.load(open(sys.argv[1]))
print(sys.argv[2], sys.argv[3], sys.argv[1].rsplit("/", 1)[1].split("-" + sys.argv[2])[0],
      "%.2f%%" % (100 * r["top1_agreement"]), r["first_32_identical"], "of", r["prompts"])' \
                "$run" "$file" "$kv"
        done
        echo "$file $kv blocks against f32: $(python3 bench/agreement_pairs.py "$out/gguf-$file-$kv.json" "$out/f32-$file-$kv.json")"
    done
done
