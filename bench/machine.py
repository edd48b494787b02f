"""The CPU a benchmark ran on, for its results: a figure means little without the CPU class."""
import platform

# The instruction-set extensions that decide which kernels run (docs/performance.md).
KERNEL_FLAGS = ["avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx_vnni",
                "amx_int8", "amx_bf16", "asimddp", "bf16"]


def cpu_model():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith(("model name", "Model")):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def cpu_flags():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    return set()


def describe():
    """The CPU's model and which of KERNEL_FLAGS it has."""
    flags = cpu_flags()
    return {"model": cpu_model(), "flags": [f for f in KERNEL_FLAGS if f in flags]}
