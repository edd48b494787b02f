#!/bin/sh
# Entry point of the CUDA image. On a GPU node the node's driver (libcuda.so.1) is used. On a
# node without one, the fallback libcuda.so.1 that scripts/build-cuda.sh builds (every call
# answers CUDA_ERROR_NO_DEVICE) is put on the library path instead, so the worker starts, refuses
# `--device cuda` with a clear error, and runs on the CPU with `--device auto`, rather than
# failing to load.
fallback=${SPOTINFER_CUDA_FALLBACK_DIR:-/usr/local/lib/spotinfer/cuda-fallback}
has_driver() {
    old_ifs=$IFS
    IFS=:
    for dir in ${LD_LIBRARY_PATH:-} /usr/local/nvidia/lib64; do
        if [ -n "$dir" ] && [ "$dir" != "$fallback" ] && [ -e "$dir/libcuda.so.1" ]; then
            IFS=$old_ifs
            return 0
        fi
    done
    IFS=$old_ifs
    ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1 '
}
if ! has_driver; then
    LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$fallback"
    export LD_LIBRARY_PATH
fi
exec "${SPOTINFER_BIN:-/usr/local/bin/spotinfer}" "$@"
