// out = LayerNorm(x + residual) · gamma + beta, one block of THREADS threads per row, f32 sums;
// the _sum kernels also write x + residual to sum_out (a pre-LayerNorm layer's residual stream;
// a template argument, so the plain kernels keep their registers).
// The reference is `AddNorm::cpu_fwd` (ops.rs), which adds in the same order: thread t sums the
// row's elements t, t + THREADS, … in turn; each warp folds its lanes by xor-shuffles of 16, 8,
// 4, 2, 1; the warps' sums are added in warp order. Compiled with --fmad=false, so every product
// and sum is rounded as the reference rounds it.

#define THREADS 128
#define MAX_PER_THREAD 16  // rows up to 2048 wide

__device__ float block_sum(float v, float* warp_sums) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();  // warp_sums may still be read from the previous sum
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < THREADS / 32; ++w) total += warp_sums[w];
    return total;
}

template <typename T, bool KEEP_SUM>
__device__ void add_layer_norm(const typename T::raw* x, const typename T::raw* residual,
                               const typename T::raw* gamma, const typename T::raw* beta,
                               typename T::raw* out, typename T::raw* sum_out, int width,
                               float eps) {
    __shared__ float warp_sums[THREADS / 32];
    const long row = blockIdx.x;
    const typename T::raw* xr = x + row * width;
    const typename T::raw* rr = residual + row * width;
    float v[MAX_PER_THREAD];
    float sum = 0.0f;
    for (int r = 0; r < MAX_PER_THREAD; ++r) {
        int i = threadIdx.x + r * THREADS;
        v[r] = i < width ? load(xr[i], T()) + load(rr[i], T()) : 0.0f;
        sum += v[r];
    }
    const float mean = block_sum(sum, warp_sums) / (float)width;
    float squares = 0.0f;
    for (int r = 0; r < MAX_PER_THREAD; ++r) {
        int i = threadIdx.x + r * THREADS;
        float d = i < width ? v[r] - mean : 0.0f;
        squares += d * d;
    }
    const float variance = block_sum(squares, warp_sums) / (float)width;
    const float inv = 1.0f / sqrtf(variance + eps);
    for (int r = 0; r < MAX_PER_THREAD; ++r) {
        int i = threadIdx.x + r * THREADS;
        if (i < width) {
            float y = (v[r] - mean) * inv * load(gamma[i], T()) + load(beta[i], T());
            out[row * width + i] = store(y, T());
            if (KEEP_SUM) sum_out[row * width + i] = store(v[r], T());
        }
    }
}

#define INSTANTIATE(NAME, T, KEEP_SUM)                                                        \
    extern "C" __global__ void __launch_bounds__(THREADS) NAME(                               \
        const T::raw* x, const T::raw* residual, const T::raw* gamma, const T::raw* beta,      \
        T::raw* out, T::raw* sum_out, int width, float eps) {                                 \
        add_layer_norm<T, KEEP_SUM>(x, residual, gamma, beta, out, sum_out, width, eps);     \
    }
INSTANTIATE(add_layer_norm_f32, F32, false)
INSTANTIATE(add_layer_norm_f16, F16, false)
INSTANTIATE(add_layer_norm_bf16, BF16, false)
INSTANTIATE(add_layer_norm_sum_f32, F32, true)
INSTANTIATE(add_layer_norm_sum_f16, F16, true)
INSTANTIATE(add_layer_norm_sum_bf16, BF16, true)
