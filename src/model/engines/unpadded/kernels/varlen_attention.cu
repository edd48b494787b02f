// Attention over unpadded sequences: qkv is (tokens, 3·heads·head_dim), each row [q | k | v] with
// head h at h·head_dim in each third; cu_seqlens (sequences + 1) gives each sequence's first row.
// Grid (sequences, query blocks, heads); a block of 4 warps takes QUERIES consecutive queries of
// one sequence and one head, each warp QUERIES / 4 of them. Keys are read in tiles of 32, in
// order, one key a lane; the softmax is online (running maximum and sum, rescaled per tile).
//
// The reference is `VarlenAttention::cpu_fwd` (ops.rs), the same steps in the same order: a
// score is the in-order dot product over head_dim times the scale; per tile, the running
// maximum, the correction exp(old − new), then the sum and each output element updated as
// x·correction + p_0·… + p_1·… in key order (the probabilities broadcast from lane j in turn).
// Compiled with --fmad=false so the products and sums round as the reference's; only expf may
// differ from the reference's exp in the last place.

#define TILE 32
#define QUERIES 16
#define WARPS 4
#define MAX_HEAD_DIM 128
#define PER_LANE (MAX_HEAD_DIM / 32)

template <typename T>
__device__ void varlen_attention(const typename T::raw* qkv, const unsigned int* cu_seqlens,
                                 typename T::raw* out, int heads, int head_dim, float scale) {
    __shared__ float q_s[QUERIES][MAX_HEAD_DIM];
    __shared__ float k_s[TILE][MAX_HEAD_DIM + 1];
    __shared__ float v_s[TILE][MAX_HEAD_DIM + 1];
    const int seq = blockIdx.x, head = blockIdx.z;
    const int first = cu_seqlens[seq], len = cu_seqlens[seq + 1] - first;
    const int q0 = blockIdx.y * QUERIES;
    if (q0 >= len) return;
    const int width = heads * head_dim, stride = 3 * width;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int e = threadIdx.x; e < QUERIES * head_dim; e += blockDim.x) {
        int qi = e / head_dim, d = e % head_dim;
        q_s[qi][d] = q0 + qi < len
            ? load(qkv[(long)(first + q0 + qi) * stride + head * head_dim + d], T()) : 0.0f;
    }
    const int mine = QUERIES / WARPS;
    float m[QUERIES / WARPS], l[QUERIES / WARPS], acc[QUERIES / WARPS][PER_LANE];
    for (int i = 0; i < mine; ++i) {
        m[i] = NEG_INF;
        l[i] = 0.0f;
        for (int r = 0; r < PER_LANE; ++r) acc[i][r] = 0.0f;
    }
    for (int k0 = 0; k0 < len; k0 += TILE) {
        const int keys = min(TILE, len - k0);
        __syncthreads();
        for (int e = threadIdx.x; e < TILE * head_dim; e += blockDim.x) {
            int j = e / head_dim, d = e % head_dim;
            long row = (long)(first + k0 + j) * stride + head * head_dim + d;
            k_s[j][d] = j < keys ? load(qkv[row + width], T()) : 0.0f;
            v_s[j][d] = j < keys ? load(qkv[row + 2 * width], T()) : 0.0f;
        }
        __syncthreads();
        for (int i = 0; i < mine; ++i) {
            const int qi = warp * mine + i;
            float s = 0.0f;
            for (int d = 0; d < head_dim; ++d) s += q_s[qi][d] * k_s[lane][d];
            s = lane < keys ? s * scale : NEG_INF;
            float tile_max = s;
            for (int o = 16; o > 0; o >>= 1) tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, o));
            const float m_new = fmaxf(m[i], tile_max);
            const float correction = expf(m[i] - m_new);
            const float p = lane < keys ? expf(s - m_new) : 0.0f;
            l[i] = l[i] * correction;
            for (int r = 0; r < PER_LANE; ++r) acc[i][r] = acc[i][r] * correction;
            for (int j = 0; j < keys; ++j) {
                const float pj = __shfl_sync(0xffffffffu, p, j);
                l[i] = l[i] + pj;
                for (int r = 0; r < PER_LANE; ++r) {
                    int d = lane + 32 * r;
                    if (d < head_dim) acc[i][r] = acc[i][r] + pj * v_s[j][d];
                }
            }
            m[i] = m_new;
        }
    }
    for (int i = 0; i < mine; ++i) {
        const int q = q0 + warp * mine + i;
        if (q >= len) continue;
        for (int r = 0; r < PER_LANE; ++r) {
            int d = lane + 32 * r;
            if (d < head_dim)
                out[(long)(first + q) * width + head * head_dim + d] = store(acc[i][r] / l[i], T());
        }
    }
}

#define INSTANTIATE(NAME, T)                                                                  \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) NAME(                            \
        const T::raw* qkv, const unsigned int* cu_seqlens, T::raw* out, int heads,            \
        int head_dim, float scale) {                                                          \
        varlen_attention<T>(qkv, cu_seqlens, out, heads, head_dim, scale);                   \
    }
INSTANTIATE(varlen_attention_f32, F32)
INSTANTIATE(varlen_attention_f16, F16)
INSTANTIATE(varlen_attention_bf16, BF16)
