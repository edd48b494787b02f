#!/usr/bin/env python3
"""llama.cpp's own products on a GGUF's blocks, for examples/ggml_products.rs to compare
spotinfer's against: for the first matrix of each block format in the file, ggml's `mul_mat`
(the CPU backend llama-cpp-python ships, through ctypes, two threads as the benchmarks run it)
of seeded activation rows, written beside the matrix's bytes.

    .cache/llm-venv/bin/python bench/ggml_products.py GGUF OUT_DIR [ROWS]

OUT_DIR gets index.json ([{"name", "format", "rows", "k", "m"}]) and, per matrix, NAME.w (its
GGUF bytes), NAME.x (m × k f32 activations) and NAME.y (ggml's m × rows f32 outputs).
Activations: normal, with one input in 64 scaled by 20 (a residual stream's outliers), so
blocks of very different ranges are rounded.
"""
import ctypes
import json
import os
import sys
from pathlib import Path

import numpy as np

FORMATS = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K",
           14: "Q6_K"}
F32 = 0


class InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p),
                ("no_alloc", ctypes.c_bool)]


def libraries():
    """ggml's base and CPU libraries as llama-cpp-python ships them, their signatures declared."""
    import llama_cpp
    lib = Path(llama_cpp.__file__).parent / "lib"
    base = ctypes.CDLL(str(lib / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(str(lib / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    p = ctypes.c_void_p
    base.ggml_init.restype, base.ggml_init.argtypes = p, [InitParams]
    base.ggml_new_tensor_2d.restype = p
    base.ggml_new_tensor_2d.argtypes = [p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    base.ggml_mul_mat.restype, base.ggml_mul_mat.argtypes = p, [p, p, p]
    base.ggml_new_graph.restype, base.ggml_new_graph.argtypes = p, [p]
    base.ggml_build_forward_expand.argtypes = [p, p]
    base.ggml_get_data.restype, base.ggml_get_data.argtypes = p, [p]
    base.ggml_nbytes.restype, base.ggml_nbytes.argtypes = ctypes.c_size_t, [p]
    base.ggml_free.argtypes = [p]
    cpu.ggml_graph_compute_with_ctx.argtypes = [p, p, ctypes.c_int]
    cpu.ggml_cpu_init()
    return base, cpu


def mul_mat(base, cpu, ggml_type, weights, rows, k, x):
    """ggml's `x · Wᵀ` for W (`rows × k` in `ggml_type`'s blocks) and f32 rows `x`."""
    need = 2 * (len(weights) + x.nbytes + x.shape[0] * rows * 4) + (64 << 20)
    ctx = base.ggml_init(InitParams(need, None, False))
    w = base.ggml_new_tensor_2d(ctx, ggml_type, k, rows)
    if base.ggml_nbytes(w) != len(weights):
        raise SystemExit(f"{rows}×{k} in type {ggml_type}: {len(weights)} bytes, ggml expects "
                         f"{base.ggml_nbytes(w)}")
    ctypes.memmove(base.ggml_get_data(w), weights, len(weights))
    xt = base.ggml_new_tensor_2d(ctx, F32, k, x.shape[0])
    ctypes.memmove(base.ggml_get_data(xt), x.ctypes.data, x.nbytes)
    y = base.ggml_mul_mat(ctx, w, xt)
    graph = base.ggml_new_graph(ctx)
    base.ggml_build_forward_expand(graph, y)
    cpu.ggml_graph_compute_with_ctx(ctx, graph, 2)
    out = np.frombuffer(ctypes.string_at(base.ggml_get_data(y), x.shape[0] * rows * 4),
                        dtype=np.float32).reshape(x.shape[0], rows).copy()
    base.ggml_free(ctx)
    return out


def main():
    from gguf import GGUFReader
    gguf, out = sys.argv[1], Path(sys.argv[2])
    m = int(sys.argv[3]) if len(sys.argv) > 3 else 40
    out.mkdir(parents=True, exist_ok=True)
    base, cpu = libraries()
    rng = np.random.default_rng(0)
    index, seen = [], set()
    for t in GGUFReader(gguf).tensors:
        fmt = FORMATS.get(int(t.tensor_type))
        if fmt is None or fmt in seen or len(t.shape) != 2:
            continue
        seen.add(fmt)
        k, rows = int(t.shape[0]), int(t.shape[1])
        weights = np.asarray(t.data).view(np.uint8).tobytes()
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[:, ::64] *= 20
        y = mul_mat(base, cpu, int(t.tensor_type), weights, rows, k, x)
        (out / f"{t.name}.w").write_bytes(weights)
        x.tofile(out / f"{t.name}.x")
        y.tofile(out / f"{t.name}.y")
        index.append({"name": t.name, "format": fmt, "rows": rows, "k": k, "m": m})
    (out / "index.json").write_text(json.dumps(index, indent=1) + "\n")
    print(json.dumps({"gguf": os.path.basename(gguf), "formats": sorted(seen)}))


if __name__ == "__main__":
    main()
