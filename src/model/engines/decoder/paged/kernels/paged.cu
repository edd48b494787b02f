// Attention over the paged KV cache, and the cache's writes. The references are
// `PagedAttention::cpu_fwd` and `WriteCache::cpu_fwd` (decoder/paged/attention.rs), which
// compute in the same order: each key's score a sum over the head in order; keys in tiles of 32
// in order; within a tile, the weights added to the running sum and each value added to the
// output key by key. Every query row is computed alone, so a row's output does not depend on the
// rest of the batch. Compiled with --fmad=false.

#define TILE 32
#define MAX_PER_LANE 4  // heads up to 128 wide
#define MAX_HEAD (TILE * MAX_PER_LANE)

// Elements of a 16-byte load.
template <typename T> struct Vec { enum { value = 16 / sizeof(typename T::raw) }; };

// Key `k`'s score against `query` (floats), a sum over the head in order: read 16 bytes at a
// time where the row allows it (head width a multiple of a load, row aligned), else element by
// element. The same products added in the same order either way.
template <typename T>
__device__ __forceinline__ float key_score(const float* query, const typename T::raw* k,
                                           int head_dim) {
    const int vec = Vec<T>::value;
    float dot = 0.0f;
    if (head_dim % vec == 0 && ((unsigned long)k & 15) == 0) {
        const uint4* k4 = reinterpret_cast<const uint4*>(k);
#pragma unroll 8
        for (int c = 0; c < head_dim / vec; ++c) {
            union { uint4 v; typename T::raw e[Vec<T>::value]; } u;
            u.v = __ldg(k4 + c);
#pragma unroll
            for (int e = 0; e < vec; ++e) dot += query[c * vec + e] * load(u.e[e], T());
        }
    } else {
        for (int i = 0; i < head_dim; ++i) dot += query[i] * load(k[i], T());
    }
    return dot;
}

// One warp per (new token, head). plan: per token (table row, position), then the block tables
// (rows of `width`). rows: (tokens, stride), the query at q_at. cache: (2, slots, kv_heads,
// head_dim). out: (tokens, heads * head_dim).
//
// Lane j scores key j of a tile, over the head in order (`key_score`: its row 16 bytes a load;
// element by element, each of a lane's loads fell on a line of its own, 32 lines an instruction,
// 64 instructions a tile for 64-wide heads). The query is kept in shared memory as floats.
template <typename T>
__device__ void paged_attention(const typename T::raw* rows, const typename T::raw* cache,
                                const unsigned int* plan, typename T::raw* out, int tokens,
                                int stride, int q_at, int heads, int kv_heads, int head_dim,
                                int block_size, int width, long slots, float scale) {
    __shared__ float query[MAX_HEAD];
    const int t = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
    const unsigned int row = plan[2 * t], position = plan[2 * t + 1];
    const unsigned int* table = plan + 2 * (long)tokens + (long)row * width;
    const int kv_head = h / (heads / kv_heads);
    const long kv_width = (long)kv_heads * head_dim;
    const typename T::raw* q = rows + (long)t * stride + q_at + (long)h * head_dim;
    for (int i = lane; i < head_dim; i += TILE) query[i] = load(q[i], T());
    float acc[MAX_PER_LANE];
    for (int r = 0; r < MAX_PER_LANE; ++r) acc[r] = 0.0f;
    float m = NEG_INF, l = 0.0f;
    const int keys = position + 1;
    for (int tile = 0; tile < keys; tile += TILE) {
        const int n = min(TILE, keys - tile);
        long slot = 0;
        if (lane < n) {
            int p = tile + lane;
            slot = (long)table[p / block_size] * block_size + p % block_size;
        }
        __syncwarp();  // the query is in shared memory
        float s = NEG_INF;
        if (lane < n) {
            const typename T::raw* k = cache + slot * kv_width + (long)kv_head * head_dim;
            s = key_score<T>(query, k, head_dim) * scale;
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

// The rotary embedding of a step's rows (decoder/paged/rotary.rs, `RotaryRows::cpu_fwd`): one
// block per token; rows (tokens, (heads + 2 kv_heads) * head_dim), queries then keys then values;
// cos and sin (tokens, head_dim / 2). Each query and key head's pair (i, i + half) rotated in f32
// and rounded once; the values copied.
template <typename T>
__device__ void rotary_rows(const typename T::raw* rows, const typename T::raw* cos,
                            const typename T::raw* sin, typename T::raw* out, int heads,
                            int kv_heads, int head_dim) {
    const int t = blockIdx.x, half = head_dim / 2;
    const long width = (long)(heads + 2 * kv_heads) * head_dim;
    const typename T::raw* row = rows + t * width;
    typename T::raw* target = out + t * width;
    const int pairs = (heads + kv_heads) * half;
    for (int j = threadIdx.x; j < pairs; j += blockDim.x) {
        const int at = (j / half) * head_dim + j % half, i = j % half;
        const float x1 = load(row[at], T()), x2 = load(row[at + half], T());
        const float c = load(cos[(long)t * half + i], T()), s = load(sin[(long)t * half + i], T());
        target[at] = store(x1 * c - x2 * s, T());
        target[at + half] = store(x1 * s + x2 * c, T());
    }
    const int values_at = (heads + kv_heads) * head_dim;
    for (int j = threadIdx.x; j < kv_heads * head_dim; j += blockDim.x)
        target[values_at + j] = row[values_at + j];
}

#define INSTANTIATE_ROTARY(SUFFIX, T)                                                         \
    extern "C" __global__ void rotary_rows_##SUFFIX(const T::raw* rows, const T::raw* cos,   \
                                                    const T::raw* sin, T::raw* out,          \
                                                    int heads, int kv_heads, int head_dim) { \
        rotary_rows<T>(rows, cos, sin, out, heads, kv_heads, head_dim);                      \
    }
INSTANTIATE_ROTARY(f32, F32)
INSTANTIATE_ROTARY(f16, F16)
INSTANTIATE_ROTARY(bf16, BF16)

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

// Constrained rows (`paged/mask.rs`, `MaskRows::cpu_fwd`): each logit widened to f32, or −∞
// where its row's mask does not allow its id (id at or past `allowed`, or bit id % 32 of word
// id / 32 clear). One thread an element, a row `blockIdx.y`.
template <typename T>
__device__ void mask_rows(const typename T::raw* logits, const unsigned int* masks, float* out,
                          int vocab, int words, int allowed) {
    const int id = blockIdx.x * blockDim.x + threadIdx.x;
    if (id >= vocab) return;
    const long at = (long)blockIdx.y * vocab + id;
    const unsigned int* mask = masks + (long)blockIdx.y * words;
    const bool allows = id < allowed && id / 32 < words && ((mask[id / 32] >> (id % 32)) & 1u);
    out[at] = allows ? load(logits[at], T()) : NEG_INF;
}

#define INSTANTIATE_MASK(SUFFIX, T)                                                           \
    extern "C" __global__ void mask_rows_##SUFFIX(const T::raw* logits,                       \
                                                  const unsigned int* masks, float* out,      \
                                                  int vocab, int words, int allowed) {        \
        mask_rows<T>(logits, masks, out, vocab, words, allowed);                              \
    }
INSTANTIATE_MASK(f32, F32)
INSTANTIATE_MASK(f16, F16)
INSTANTIATE_MASK(bf16, BF16)

// Sampling (`paged/sample.rs`, `sampling.rs`): one block of SAMPLE_THREADS a row. Every value
// that decides the token is an integer (rank keys, weights in 32-bit fixed point, their sums),
// or an f32/f64 operation spelled out with its rounding (no fused multiply-add), so the token is
// the CPU sampler's whatever order the threads add in. `__launch_bounds__(SAMPLE_THREADS, 1)`
// lets ptxas use 64 registers a thread: with the default it kept 32 for sm_80 and sm_90 and
// spilled 40–56 bytes.
#define SAMPLE_THREADS 1024

__device__ __forceinline__ unsigned long long order_key(float z, unsigned int id) {
    if (z != z) return 0ull;
    unsigned int bits = __float_as_uint(z);
    unsigned int ordered = (bits >> 31) ? ~bits : (bits | 0x80000000u);
    return ((unsigned long long)ordered << 32) | (unsigned long long)(0xffffffffu - id);
}

__device__ double exp_nonpositive(double x) {
    if (x != x || x < -40.0) return 0.0;
    const double LOG2E = 1.4426950408889634;
    const double LN2_HI = 6.93147180369123816490e-01;
    const double LN2_LO = 1.90821492927058770002e-10;
    double n = (double)__double2ll_rd(__dadd_rn(__dmul_rn(x, LOG2E), 0.5));
    double r = __dsub_rn(__dsub_rn(x, __dmul_rn(n, LN2_HI)), __dmul_rn(n, LN2_LO));
    const double factorials[12] = {39916800.0, 3628800.0, 362880.0, 40320.0, 5040.0, 720.0,
                                   120.0,      24.0,      6.0,      2.0,     1.0,    1.0};
    double p = __ddiv_rn(1.0, 479001600.0);
#pragma unroll
    for (int i = 0; i < 12; i++) p = __dadd_rn(__dmul_rn(p, r), __ddiv_rn(1.0, factorials[i]));
    long long e = (long long)n + 1023;
    return __dmul_rn(p, __longlong_as_double(e << 52));
}

__device__ __forceinline__ unsigned long long token_weight(float z, float max) {
    if (z != z) return 0ull;
    float x = __fsub_rn(z, max);
    if (x != x) return 4294967296ull;
    return __double2ull_rz(__dmul_rn(exp_nonpositive((double)x), 4294967296.0));
}

// The block's sum (or, with `take_max`, maximum) of one value a thread, given to every thread.
__device__ unsigned long long block_reduce(unsigned long long v, unsigned long long* shared,
                                           bool take_max) {
    __syncthreads();
    shared[threadIdx.x] = v;
    __syncthreads();
    for (int stride = SAMPLE_THREADS / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) {
            unsigned long long other = shared[threadIdx.x + stride];
            unsigned long long mine = shared[threadIdx.x];
            shared[threadIdx.x] = take_max ? (other > mine ? other : mine) : mine + other;
        }
        __syncthreads();
    }
    return shared[0];
}

struct Tokens {
    unsigned long long count, mass;
};

// Tokens ranked above `key` (or, with `inclusive`, at it and above) and their weight.
template <typename T>
__device__ Tokens above(const typename T::raw* row, int vocab, float t, float max,
                        unsigned long long key, bool inclusive, unsigned long long* shared) {
    unsigned long long count = 0, mass = 0;
    for (int i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) {
        float z = __fdiv_rn(load(row[i], T()), t);
        unsigned long long k = order_key(z, i);
        if (k > key || (inclusive && k == key)) {
            count += 1;
            mass += token_weight(z, max);
        }
    }
    Tokens r;
    r.count = block_reduce(count, shared, false);
    r.mass = block_reduce(mass, shared, false);
    return r;
}

// The lowest key in [low, top] whose tokens above pass: fewer than `k` of them (when `k` is below
// the vocabulary) and, when `threshold` is set, less weight than it. Bisection, as `lowest_kept`.
template <typename T>
__device__ unsigned long long lowest_kept(const typename T::raw* row, int vocab, float t,
                                          float max, unsigned long long low,
                                          unsigned long long top, unsigned long long k,
                                          bool use_threshold, unsigned long long threshold,
                                          unsigned long long* shared) {
    unsigned long long high = top;
    while (low < high) {
        unsigned long long mid = low + (high - low) / 2;
        Tokens a = above<T>(row, vocab, t, max, mid, false, shared);
        bool keeps = (k >= (unsigned long long)vocab || a.count < k) &&
                     (!use_threshold || a.mass < threshold);
        if (keeps) high = mid;
        else low = mid + 1;
    }
    return high;
}

template <typename T>
__device__ void sample_rows(const typename T::raw* logits, const unsigned int* params,
                            unsigned int* out, int vocab) {
    __shared__ unsigned long long shared[SAMPLE_THREADS];
    __shared__ unsigned long long prefix[SAMPLE_THREADS];
    __shared__ float maxima[SAMPLE_THREADS];
    const typename T::raw* row = logits + (long)blockIdx.x * vocab;
    const unsigned int* p = params + blockIdx.x * 8;
    const float t = __uint_as_float(p[0]);
    const float top_p = __uint_as_float(p[1]);
    const unsigned long long seed = (unsigned long long)p[3] | ((unsigned long long)p[4] << 32);
    const unsigned long long position = (unsigned long long)p[5] | ((unsigned long long)p[6] << 32);
    unsigned long long k = p[2] == 0 ? (unsigned long long)vocab : (unsigned long long)p[2];
    if (k > (unsigned long long)vocab) k = vocab;

    // 1. The largest z that is not a NaN, whether there is one, and the top rank key.
    float max = NEG_INF;
    unsigned long long numbers = 0, top = 0;
    for (int i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) {
        float z = __fdiv_rn(load(row[i], T()), t);
        if (z == z) {
            numbers += 1;
            if (z > max) max = z;
        }
        unsigned long long key = order_key(z, i);
        if (key > top) top = key;
    }
    maxima[threadIdx.x] = max;
    __syncthreads();
    for (int stride = SAMPLE_THREADS / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride && maxima[threadIdx.x + stride] > maxima[threadIdx.x])
            maxima[threadIdx.x] = maxima[threadIdx.x + stride];
        __syncthreads();
    }
    max = maxima[0];
    numbers = block_reduce(numbers, shared, false);
    top = block_reduce(top, shared, true);
    if (numbers == 0) {
        if (threadIdx.x == 0) out[blockIdx.x] = 0;
        return;
    }

    // 2. The lowest key top-k keeps, then top-p.
    unsigned long long from = 0;
    if (k < (unsigned long long)vocab)
        from = lowest_kept<T>(row, vocab, t, max, 0, top, k, false, 0, shared);
    if (top_p < 1.0f) {
        Tokens kept = above<T>(row, vocab, t, max, from, true, shared);
        unsigned long long threshold =
            __double2ull_rz(__dmul_rn(__ull2double_rn(kept.mass), (double)top_p));
        from = lowest_kept<T>(row, vocab, t, max, from, top, k, true, threshold, shared);
    }

    // 3. The draw: the kept tokens in id order cover [0, total); thread j holds a contiguous
    // chunk, the block's exclusive prefix sums place the chunks, and the one holding the target
    // walks its chunk.
    unsigned long long total = above<T>(row, vocab, t, max, from, true, shared).mass;
    unsigned long long bits = seed ^ ((position + 1ull) * 0x9E3779B97F4A7C15ull);
    bits = (bits ^ (bits >> 30)) * 0xBF58476D1CE4E5B9ull;
    bits = (bits ^ (bits >> 27)) * 0x94D049BB133111EBull;
    bits = (bits ^ (bits >> 31)) >> 11;
    const unsigned long long target = (__umul64hi(bits, total) << 11) | ((bits * total) >> 53);
    const int chunk = (vocab + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
    const int begin = threadIdx.x * chunk;
    const int end = begin + chunk < vocab ? begin + chunk : vocab;
    unsigned long long mine = 0;
    for (int i = begin; i < end; i++) {
        float z = __fdiv_rn(load(row[i], T()), t);
        if (order_key(z, i) >= from) mine += token_weight(z, max);
    }
    __syncthreads();
    prefix[threadIdx.x] = mine;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned long long running = 0;
        for (int j = 0; j < SAMPLE_THREADS; j++) {
            unsigned long long m = prefix[j];
            prefix[j] = running;
            running += m;
        }
    }
    __syncthreads();
    unsigned long long at = prefix[threadIdx.x];
    if (mine > 0 && at <= target && target < at + mine) {
        for (int i = begin; i < end; i++) {
            float z = __fdiv_rn(load(row[i], T()), t);
            if (order_key(z, i) >= from) {
                at += token_weight(z, max);
                if (target < at) {
                    out[blockIdx.x] = i;
                    break;
                }
            }
        }
    }
}

#define INSTANTIATE_SAMPLE(SUFFIX, T)                                                         \
    extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS, 1) sample_rows_##SUFFIX(     \
        const T::raw* logits, const unsigned int* params, unsigned int* out, int vocab) {     \
        sample_rows<T>(logits, params, out, vocab);                                           \
    }
INSTANTIATE_SAMPLE(f32, F32)
INSTANTIATE_SAMPLE(f16, F16)
INSTANTIATE_SAMPLE(bf16, BF16)
