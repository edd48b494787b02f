#!/usr/bin/env bash
# The GPU check of the unpadded encoder (issue 51), one run, one report. On a GPU machine:
#
#   bench/gpu-check.sh --bin ./spotinfer --device cuda --out "$OUT" [--minutes 7.5] [--llm-only]
#
# makes the MiniLM (6x384), BERT-base (12x768) and BERT-large (24x1024) shapes with random
# weights (bench/make_shape.py, from the all-MiniLM-L6-v2 folder's tokenizer), then runs
# bench/gpu_check.py: every kernel against its CPU reference (`spotinfer models kernels`), the
# unpadded encoder's f32 and f16 vectors against sentence-transformers fp32 on the same GPU, and
# the speed of the default CUDA path (padded candle), of the unpadded one and of
# sentence-transformers fp16, with the GPU's busy share; and CLIP's and ViT's image towers on the
# unpadded operations against candle's, on the fixture photographs; and the paged decoder (issue
# 52): its kernels, its invariance and its greedy tokens on the LLM fixtures, and its speed beside
# transformers bf16 on random-weight SmolLM2-135M and Qwen2-0.5B shapes (bench/gpu_llm.py);
# `--llm-only` runs that part alone; `--no-peer-speed` does not time transformers again (after a
# change, with its figures on the same GPU in hand). Writes OUT/gpu-check.json; exits 1 if a kernel or a vector
# check fails. Sized to finish in under 8 minutes on an H100.
#
# CI runs it with `--device cpu` on a tiny shape (2 layers, 64 wide), where the reference vectors
# are the padded encoder's f32 ones (no PyTorch in CI) and the speeds are the CPU's, so that on a
# GPU only GPU behaviour can fail.
set -euo pipefail
cd "$(dirname "$0")/.."
device=cpu bin= out=${OUT:-target/gpu-check} source=${SPOTINFER_MODEL:-models/all-MiniLM-L6-v2}
minutes=7.5 llm_only= peers=
while [[ $# -gt 0 ]]; do
    case $1 in
        --bin) bin=$2; shift 2 ;;
        --device) device=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        --model) source=$2; shift 2 ;;
        --minutes) minutes=$2; shift 2 ;;
        --llm-only) llm_only=--llm-only; shift ;;
        --no-peer-speed) peers=--no-peer-speed; shift ;;
        *) echo "gpu-check: unknown argument $1" >&2; exit 2 ;;
    esac
done
if [[ -z "$bin" ]]; then
    cargo build --quiet --bin spotinfer
    bin=$(scripts/cargo-bin.sh spotinfer)
fi
mkdir -p "$out"
shapes=()
make() { # name layers hidden heads intermediate
    python3 bench/make_shape.py --from "$source" --out "$out/$1" --layers "$2" --hidden "$3" \
        --heads "$4" --intermediate "$5" >/dev/null
    shapes+=("$out/$1")
}
if [[ $device == cuda ]]; then
    if [[ -z $llm_only ]]; then
        make minilm 6 384 12 1536
        make bert-base 12 768 12 3072
        make bert-large 24 1024 16 4096
    fi
    python3 bench/gpu_llm.py make "$out/smollm2-135m" smollm2-135m
    python3 bench/gpu_llm.py make "$out/qwen2-0.5b" qwen2-0.5b
    python3 bench/gpu_check.py --bin "$bin" --device cuda --out "$out" --records 20000 \
        --minutes "$minutes" $llm_only $peers \
        --batch-sizes 64,256 --shapes "$(IFS=,; echo "${shapes[*]}")" \
        --llm-shapes "$out/smollm2-135m,$out/qwen2-0.5b"
else
    make tiny 2 64 2 128
    python3 bench/gpu_check.py --bin "$bin" --device cpu --out "$out" --records 48 \
        --batch-sizes 16 --rounds 1 --shapes "$(IFS=,; echo "${shapes[*]}")"
fi
