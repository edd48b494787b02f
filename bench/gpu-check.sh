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
# change, with its figures on the same GPU in hand); and a 200-prompt generation job with SIGTERMs
# mid-answer (bench/gpu_job.py) through the Pub/Sub emulator, which on a machine without Java
# runs from a pack unpacked into .cache/emulator or `--emulator-dir` (scripts/pubsub-emulator.sh
# pack). Writes OUT/gpu-check.json; exits 1 if a kernel, a vector or the job's answers fail.
# Sized to finish in under 8 minutes on an H100.
#
# `--bundle DIR` takes the worker and the emulator from bench/gpu-bundle.sh's folder (a machine
# with no toolchain and no Java): the CUDA libraries it links come from the Python CUDA wheels
# there (cuBLAS, NVRTC, cuRAND, the runtime), and the worker runs through
# scripts/cuda-entrypoint.sh, which takes the bundle's stub libcuda.so.1 (every call answering
# "no device") only where no driver is found. Without a bundle the emulator is the installed one.
#
# CI runs it with `--device cpu` on a tiny shape (2 layers, 64 wide), where the reference vectors
# are the padded encoder's f32 ones (no PyTorch in CI) and the speeds are the CPU's, so that on a
# GPU only GPU behaviour can fail; CI runs it on a bundle of the `--features cuda` build, so
# that the binary, the emulator pack and this unpacking are the ones a GPU machine gets.
set -euo pipefail
cd "$(dirname "$0")/.."
device=cpu bin= out=${OUT:-target/gpu-check} source=${SPOTINFER_MODEL:-models/all-MiniLM-L6-v2}
minutes=7.5 llm_only= peers= emulator_dir= bundle=
while [[ $# -gt 0 ]]; do
    case $1 in
        --bin) bin=$2; shift 2 ;;
        --device) device=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        --model) source=$2; shift 2 ;;
        --minutes) minutes=$2; shift 2 ;;
        --llm-only) llm_only=--llm-only; shift ;;
        --no-peer-speed) peers=--no-peer-speed; shift ;;
        --emulator-dir) emulator_dir=$2; shift 2 ;;
        --bundle) bundle=$2; shift 2 ;;
        *) echo "gpu-check: unknown argument $1" >&2; exit 2 ;;
    esac
done
# The folders of the libraries a `--features cuda` build links: from Python's CUDA wheels, from
# the folders given (e.g. scripts/build-cuda.sh's toolchain), else from a CUDA install.
cuda_libs() {
    python3 - "$@" <<'PY'
import glob, os, sys
want = ["libcublas.so.13", "libcublasLt.so.13", "libnvrtc.so.13", "libcudart.so.13", "libcurand.so.10"]
patterns = [os.path.join(p, "nvidia", "**") for p in sys.path + sys.argv[1:] if os.path.isdir(p)]
patterns += ["/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"]
found = {}
for pattern in patterns:
    for name in want:
        hits = [] if name in found else glob.glob(os.path.join(pattern, name), recursive=True)
        if hits:
            found[name] = os.path.dirname(hits[0])
missing = [n for n in want if n not in found]
if missing:
    sys.exit("gpu-check: not found in Python's nvidia packages or /usr/local/cuda: " + ", ".join(missing))
print(":".join(sorted(set(found.values()))))
PY
}
if [[ -n "$bundle" ]]; then
    mkdir -p target/bundle
    xz -dc "$bundle/spotinfer.xz" >target/bundle/spotinfer
    chmod +x target/bundle/spotinfer
    emulator_dir=target/bundle/emulator
    rm -rf "$emulator_dir" && mkdir -p "$emulator_dir"
    tar xJf "$bundle/emulator.tar.xz" -C "$emulator_dir"
    libs=$(cuda_libs "${SPOTINFER_CUDA_TOOLCHAIN:-target/cuda-toolchain}/site")
    export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$libs:/usr/local/nvidia/lib64
    # Run as the CUDA image runs it: the entry point puts the stub driver on the path only
    # where it finds no driver.
    export SPOTINFER_BIN=$PWD/target/bundle/spotinfer
    export SPOTINFER_CUDA_FALLBACK_DIR=$(cd "$bundle" && pwd)/cuda-fallback
    bin=$PWD/scripts/cuda-entrypoint.sh
fi
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
        --minutes "$minutes" $llm_only $peers ${emulator_dir:+--emulator-dir "$emulator_dir"} \
        --batch-sizes 64,256 --shapes "$(IFS=,; echo "${shapes[*]}")" \
        --llm-shapes "$out/smollm2-135m,$out/qwen2-0.5b"
else
    make tiny 2 64 2 128
    python3 bench/gpu_check.py --bin "$bin" --device cpu --out "$out" --records 48 \
        --batch-sizes 16 --rounds 1 --shapes "$(IFS=,; echo "${shapes[*]}")" \
        ${emulator_dir:+--emulator-dir "$emulator_dir"}
fi
