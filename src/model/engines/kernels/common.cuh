// Prepended to every kernel file by kernels.rs (NVRTC is handed one source, no include path).
// Loads and stores of the three element types the unpadded encoder runs in, through PTX
// conversions so the kernels need no CUDA header (NVRTC compiles them as they are). Arithmetic is
// always f32.

struct F32 { typedef float raw; };
struct F16 { typedef unsigned short raw; };
struct BF16 { typedef unsigned short raw; };

__device__ __forceinline__ float load(float v, F32) { return v; }
__device__ __forceinline__ float load(unsigned short v, F16) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
    return f;
}
__device__ __forceinline__ float load(unsigned short v, BF16) {
    return __uint_as_float(((unsigned int)v) << 16);
}
__device__ __forceinline__ float store(float f, F32) { return f; }
__device__ __forceinline__ unsigned short store(float f, F16) {
    unsigned short v;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(v) : "f"(f));
    return v;
}
__device__ __forceinline__ unsigned short store(float f, BF16) {
    unsigned short v;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(v) : "f"(f));
    return v;
}

// No math header under NVRTC: minus infinity by its bits.
#define NEG_INF __int_as_float(0xff800000)
