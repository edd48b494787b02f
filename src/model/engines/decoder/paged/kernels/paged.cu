// Attention over the paged KV cache, and the cache's writes. The references are
// `PagedAttention::cpu_fwd` and `WriteCache::cpu_fwd` (decoder/paged/attention.rs), which
// compute in the same order: each key's score a sum over the head in order; keys in tiles of 32
// in order; within a tile, the weights added to the running sum and each value added to the
// output key by key. Every query row is computed alone, so a row's output does not depend on the
// rest of the batch. Compiled with --fmad=false.

#define TILE 32
#define MAX_PER_LANE 4  // heads up to 128 wide

// One warp per (new token, head). plan: per token (table row, position), then the block tables
// (rows of `width`). rows: (tokens, stride), the query at q_at. cache: (2, slots, kv_heads,
// head_dim). out: (tokens, heads * head_dim).
template <typename T>
__device__ void paged_attention(const typename T::raw* rows, const typename T::raw* cache,
                                const unsigned int* plan, typename T::raw* out, int tokens,
                                int stride, int q_at, int heads, int kv_heads, int head_dim,
                                int block_size, int width, long slots, float scale) {
    const int t = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
    const unsigned int row = plan[2 * t], position = plan[2 * t + 1];
    const unsigned int* table = plan + 2 * (long)tokens + (long)row * width;
    const int kv_head = h / (heads / kv_heads);
    const long kv_width = (long)kv_heads * head_dim;
    const typename T::raw* q = rows + (long)t * stride + q_at + (long)h * head_dim;
    float acc[MAX_PER_LANE];
    for (int r = 0; r < MAX_PER_LANE; ++r) acc[r] = 0.0f;
    float m = NEG_INF, l = 0.0f;
    const int keys = position + 1;
    for (int tile = 0; tile < keys; tile += TILE) {
        const int n = min(TILE, keys - tile);
        // Lane j scores key tile + j.
        float s = NEG_INF;
        long slot = 0;
        if (lane < n) {
            int p = tile + lane;
            slot = (long)table[p / block_size] * block_size + p % block_size;
            const typename T::raw* k = cache + slot * kv_width + (long)kv_head * head_dim;
            float dot = 0.0f;
            for (int i = 0; i < head_dim; ++i) dot += load(q[i], T()) * load(k[i], T());
            s = dot * scale;
        }
        float tile_max = s;
        for (int offset = 16; offset > 0; offset >>= 1)
            tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, offset));
        const float m_new = fmaxf(m, tile_max);
        const float correction = expf(m - m_new);
        l *= correction;
        for (int r = 0; r < MAX_PER_LANE; ++r) acc[r] *= correction;
        const float p_mine = lane < n ? expf(s - m_new) : 0.0f;
        for (int j = 0; j < n; ++j) {
            const float p = __shfl_sync(0xffffffffu, p_mine, j);
            const long v_slot = __shfl_sync(0xffffffffu, slot, j);
            const typename T::raw* v = cache + (slots + v_slot) * kv_width + (long)kv_head * head_dim;
            l += p;
            for (int r = 0; r < MAX_PER_LANE; ++r) {
                int i = lane + r * TILE;
                if (i < head_dim) acc[r] += p * load(v[i], T());
            }
        }
        m = m_new;
    }
    for (int r = 0; r < MAX_PER_LANE; ++r) {
        int i = lane + r * TILE;
        if (i < head_dim) out[((long)t * heads + h) * head_dim + i] = store(acc[r] / l, T());
    }
}

// One block per new token: its key and value copied from its row into its slot.
template <typename T>
__device__ void write_cache(typename T::raw* cache, const typename T::raw* rows,
                            const unsigned int* slot_of, int stride, int k_at, int v_at,
                            int kv_width, long slots) {
    const int t = blockIdx.x;
    const long slot = slot_of[t];
    const typename T::raw* row = rows + (long)t * stride;
    for (int i = threadIdx.x; i < kv_width; i += blockDim.x) {
        cache[slot * kv_width + i] = row[k_at + i];
        cache[(slots + slot) * kv_width + i] = row[v_at + i];
    }
}

#define INSTANTIATE(SUFFIX, T)                                                                \
    extern "C" __global__ void __launch_bounds__(TILE) paged_attention_##SUFFIX(              \
        const T::raw* rows, const T::raw* cache, const unsigned int* plan, T::raw* out,       \
        int tokens, int stride, int q_at, int heads, int kv_heads, int head_dim,             \
        int block_size, int width, long slots, float scale) {                                \
        paged_attention<T>(rows, cache, plan, out, tokens, stride, q_at, heads, kv_heads,    \
                           head_dim, block_size, width, slots, scale);                       \
    }                                                                                         \
    extern "C" __global__ void write_cache_##SUFFIX(T::raw* cache, const T::raw* rows,       \
                                                    const unsigned int* slot_of, int stride, \
                                                    int k_at, int v_at, int kv_width,        \
                                                    long slots) {                            \
        write_cache<T>(cache, rows, slot_of, stride, k_at, v_at, kv_width, slots);          \
    }
INSTANTIATE(f32, F32)
INSTANTIATE(f16, F16)
INSTANTIATE(bf16, BF16)

// One block of ARGMAX_THREADS per row: each thread scans its strided share in order keeping the
// first largest (strictly greater replaces), then the block keeps the larger value, or on a tie
// the lower index. A NaN first logit gives 0 and a NaN is never larger, as the decode loop's
// argmax (`sampling::argmax`) does.
#define ARGMAX_THREADS 256

template <typename T>
__device__ void argmax_rows(const typename T::raw* logits, unsigned int* out, int vocab) {
    __shared__ float best_value[ARGMAX_THREADS];
    __shared__ unsigned int best_index[ARGMAX_THREADS];
    const typename T::raw* row = logits + (long)blockIdx.x * vocab;
    const float first = load(row[0], T());
    float value = NEG_INF;
    unsigned int index = 0xffffffffu;
    for (int i = threadIdx.x; i < vocab; i += ARGMAX_THREADS) {
        float v = load(row[i], T());
        if (v > value || (index == 0xffffffffu && v == value)) {
            value = v;
            index = i;
        }
    }
    best_value[threadIdx.x] = value;
    best_index[threadIdx.x] = index;
    __syncthreads();
    for (int stride = ARGMAX_THREADS / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) {
            float v = best_value[threadIdx.x + stride];
            unsigned int j = best_index[threadIdx.x + stride];
            float u = best_value[threadIdx.x];
            unsigned int k = best_index[threadIdx.x];
            if (j != 0xffffffffu && (k == 0xffffffffu || v > u || (v == u && j < k))) {
                best_value[threadIdx.x] = v;
                best_index[threadIdx.x] = j;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = first != first ? 0u : best_index[0];
}

#define INSTANTIATE_ARGMAX(SUFFIX, T)                                                         \
    extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS)                              \
        argmax_rows_##SUFFIX(const T::raw* logits, unsigned int* out, int vocab) {            \
        argmax_rows<T>(logits, out, vocab);                                                   \
    }
INSTANTIATE_ARGMAX(f32, F32)
INSTANTIATE_ARGMAX(f16, F16)
INSTANTIATE_ARGMAX(bf16, BF16)
