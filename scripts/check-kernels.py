#!/usr/bin/env python3
"""Compiles every NVRTC kernel of the engines as the CUDA build compiles it at run time
(src/model/engines/kernels/common.cuh, then each kernel file of a `kernels` folder under
src/model/engines: the unpadded encoder's, the paged decoder's; --fmad=false) for
compute_80, compute_89 and compute_90, and assembles each PTX with `ptxas -v` for the matching
sm_XX. Fails on a compile error, on a ptxas error, or on any register spill. Needs no GPU and no
driver: NVRTC and ptxas come from the PyPI CUDA wheels (scripts/cuda-requirements.txt).

    scripts/check-kernels.py [--cuda DIR]   # DIR: the wheels' nvidia/cu13 folder
"""
import argparse
import ctypes
import glob
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINES = os.path.join(ROOT, "src/model/engines")
# The options nvrtc.rs passes (besides the device's own -arch at run time).
OPTIONS = ["--fmad=false"]
ARCHES = ["80", "89", "90"]


def nvrtc_compile(lib, source, name, arch):
    prog = ctypes.c_void_p()
    check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None))
    opts = [o.encode() for o in OPTIONS + [f"--gpu-architecture=compute_{arch}"]]
    argv = (ctypes.c_char_p * len(opts))(*opts)
    status = lib.nvrtcCompileProgram(prog, len(opts), argv)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    if status != 0:
        sys.exit(f"check-kernels: {name} for compute_{arch} does not compile:\n{log.value.decode()}")
    check(lib, lib.nvrtcGetPTXSize(prog, ctypes.byref(size)))
    ptx = ctypes.create_string_buffer(size.value)
    check(lib, lib.nvrtcGetPTX(prog, ptx))
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return ptx.value.decode()


def check(lib, status):
    if status != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        sys.exit(f"check-kernels: NVRTC: {lib.nvrtcGetErrorString(status).decode()}")


def main():
    parser = argparse.ArgumentParser()
    default = os.path.join(ROOT, "target/cuda-toolchain/site/nvidia/cu13")
    parser.add_argument("--cuda", default=os.environ.get("SPOTINFER_CUDA_DIR", default))
    args = parser.parse_args()
    # NVRTC opens its builtins library by name at compile time: loaded first, it is found.
    for builtins in glob.glob(os.path.join(args.cuda, "lib/libnvrtc-builtins.so.*")):
        ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(sorted(glob.glob(os.path.join(args.cuda, "lib/libnvrtc.so.*")))[0])
    ptxas = os.path.join(args.cuda, "bin/ptxas")
    common = open(os.path.join(ENGINES, "kernels", "common.cuh")).read()
    files = sorted(glob.glob(os.path.join(ENGINES, "**", "kernels", "*.cu"), recursive=True))
    if not files:
        sys.exit("check-kernels: no kernel files")
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for path in files:
            name = os.path.basename(path)
            source = common + "\n" + open(path).read()
            for arch in ARCHES:
                ptx = nvrtc_compile(lib, source, name, arch)
                ptx_path = os.path.join(tmp, f"{name}.{arch}.ptx")
                open(ptx_path, "w").write(ptx)
                run = subprocess.run([ptxas, "-v", f"-arch=sm_{arch}", "-o", os.devnull, ptx_path],
                                     capture_output=True, text=True)
                if run.returncode != 0:
                    sys.exit(f"check-kernels: ptxas failed on {name} sm_{arch}:\n{run.stderr}")
                for function, registers, spills in report(run.stderr):
                    status = "ok" if spills == (0, 0) else "SPILLS"
                    failed |= spills != (0, 0)
                    print(f"{name:24} sm_{arch} {function:28} {registers:3} registers, "
                          f"spill stores {spills[0]} B, loads {spills[1]} B  {status}")
    if failed:
        sys.exit("check-kernels: register spills (see above)")
    print(f"check-kernels: {len(files)} kernel files, compute_{'/'.join(ARCHES)}: compiled, assembled, no spills")


def report(text):
    """(function, registers, (spill stores, spill loads)) for each function ptxas describes."""
    function, spills = None, (0, 0)
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            function = m.group(1)
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            spills = (int(m.group(1)), int(m.group(2)))
        m = re.search(r"Used (\d+) registers", line)
        if m and function:
            yield function, int(m.group(1)), spills
            function, spills = None, (0, 0)


if __name__ == "__main__":
    main()
