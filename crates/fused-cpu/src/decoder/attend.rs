//! The decoder's attention: the query heads that share one key/value head, against that head's
//! cached keys and values, one row (one position of one sequence) at a time.
//!
//! **Every number is summed in one fixed order**, whatever the CPU's vector width, the row's
//! neighbours or how many query heads go together, so a sequence's attention is the same bits
//! alone, in a batch, read whole or resumed (the decoder's invariance, `super`'s doc):
//! - a score is `q·k` in eight lane sums (lane `i` adds the products of inputs `i, i + 8, …`
//!   in order), added as the tree `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))`, then the
//!   products of a head width's last `hd mod 8` inputs one by one, then scaled;
//! - the softmax is `crate::kernels::softmax_row`'s;
//! - each output is `Σ pⱼ vⱼ` over the positions in order, from zero.
//!
//! The keys and values are f32 or f16 (`super::kv`); an f16 is widened exactly before any
//! arithmetic, so the type changes what is read, never how it is summed. Beside f16 keys and
//! values the query and the softmax's weights are rounded to the nearest f16 first, as llama.cpp
//! does beside its f16 cache (its products convert their f32 operand to the cache's type): the
//! f16 cache is the GGUF blocks' path, whose reference is llama.cpp, and without these roundings
//! its greedy tokens agreed with llama.cpp's measurably less often than f32's (docs/generate.md,
//! Exactness).
//!
//! On AVX2 (with F16C, which every AVX2 CPU has) the scores of eight positions are computed side
//! by side and their trees added by `vhaddps` (which adds exactly those pairs), and the weighted
//! sums keep 32 outputs in registers while the positions pass; the portable build computes the
//! same sums one by one (an f16 head widened into f32 rows first). Before (a 16-lane sum stored
//! and added one lane at a time per score, every output loaded and stored again per position,
//! each query head reading the cache alone), a job of 16 chat requests sharing a 500-token
//! system prompt spent 57% of its cycles here on a Zen 4, 44% after, and ran 83.3 tokens/s
//! against 71.5. What is left is arithmetic, not memory: keeping the keys and values in f16
//! did not move that share.

use half::f16;

/// A number as the cache holds it.
pub(super) trait Element: Copy {
    /// The number as f32 (exact).
    fn widen(self) -> f32;

    /// Eight numbers from `at`, widened.
    ///
    /// # Safety
    /// The CPU has AVX2 and F16C; eight numbers from `at` can be read.
    #[cfg(target_arch = "x86_64")]
    unsafe fn eight(at: *const Self) -> std::arch::x86_64::__m256;
}

impl Element for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn eight(at: *const Self) -> std::arch::x86_64::__m256 {
        std::arch::x86_64::_mm256_loadu_ps(at)
    }
}

impl Element for f16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn eight(at: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        _mm256_cvtph_ps(_mm_loadu_si128(at.cast()))
    }
}

/// One sequence's cached keys and values for one key/value head, as the cache holds them.
#[derive(Clone, Copy)]
pub(super) enum KvHead<'a> {
    F32(Rows<'a, f32>),
    F16(Rows<'a, f16>),
}

/// Keys and values in rows of `kv_dim`, the head's numbers at `offset` in each, the first `len`
/// rows attended to.
#[derive(Clone, Copy)]
pub(super) struct Rows<'a, T> {
    pub keys: &'a [T],
    pub values: &'a [T],
    pub len: usize,
    pub kv_dim: usize,
    pub offset: usize,
}

impl<T: Element> Rows<'_, T> {
    /// Position `j`'s key (`hd` wide).
    fn key(&self, j: usize, hd: usize) -> &[T] {
        &self.keys[j * self.kv_dim + self.offset..][..hd]
    }
}

/// The attention of the query heads in `queries` (each `hd` wide, side by side) that share the
/// key/value head `kv`, into `out`: on AVX2 and F16C where the CPU has them, else as the crate
/// is built (SSE2 on x86-64, NEON on Arm); the same sums either way (module doc), so the same
/// bits.
pub(super) fn attend_best(queries: &[f32], hd: usize, kv: KvHead<'_>, scale: f32, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    let avx2 =
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c");
    match kv {
        KvHead::F32(rows) => {
            #[cfg(target_arch = "x86_64")]
            if avx2 {
                // SAFETY: the CPU has AVX2 and F16C (checked above).
                return unsafe { attend_avx2(queries, hd, rows, scale, false, out) };
            }
            attend::<f32, false>(queries, hd, rows, scale, false, out)
        }
        KvHead::F16(rows) => {
            // The queries as llama.cpp multiplies them beside f16 keys (module doc).
            let mut halved = HALVED.take();
            halved.clear();
            halved.extend_from_slice(queries);
            round_to_f16(&mut halved);
            match () {
                // SAFETY: the CPU has AVX2 and F16C (checked above).
                #[cfg(target_arch = "x86_64")]
                () if avx2 => unsafe { attend_avx2(&halved, hd, rows, scale, true, out) },
                () => attend_widened(&halved, hd, rows, scale, out),
            }
            HALVED.set(halved);
        }
    }
}

/// Each number rounded to the nearest f16 (ties to even) and widened back, as llama.cpp converts
/// an f32 operand for a product with an f16 one; `half`'s slice conversions use the CPU's
/// conversion instructions where there are some, the same roundings either way.
fn round_to_f16(numbers: &mut [f32]) {
    use half::slice::HalfFloatSliceExt;
    let mut narrow = [half::f16::ZERO; 64];
    for chunk in numbers.chunks_mut(64) {
        let narrow = &mut narrow[..chunk.len()];
        narrow.convert_from_f32_slice(chunk);
        narrow.convert_to_f32_slice(chunk);
    }
}

/// [`attend`] compiled for AVX2 and F16C.
///
/// # Safety
/// The CPU has AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn attend_avx2<T: Element>(
    queries: &[f32],
    hd: usize,
    rows: Rows<'_, T>,
    scale: f32,
    f16_weights: bool,
    out: &mut [f32],
) {
    attend::<T, true>(queries, hd, rows, scale, f16_weights, out)
}

/// The portable build's attention over f16 keys and values: the head's rows widened into f32
/// rows of its own first (by `half`'s slice conversion, which uses the CPU's conversion
/// instructions where there are some), then [`attend`] on those.
fn attend_widened(queries: &[f32], hd: usize, rows: Rows<'_, f16>, scale: f32, out: &mut [f32]) {
    use half::slice::HalfFloatSliceExt;
    let len = rows.len;
    let mut wide = WIDE.take();
    wide.clear();
    wide.resize(2 * len * hd, 0.0);
    let (keys, values) = wide.split_at_mut(len * hd);
    for j in 0..len {
        let at = j * rows.kv_dim + rows.offset;
        rows.keys[at..][..hd].convert_to_f32_slice(&mut keys[j * hd..][..hd]);
        rows.values[at..][..hd].convert_to_f32_slice(&mut values[j * hd..][..hd]);
    }
    let widened = Rows {
        keys,
        values,
        len,
        kv_dim: hd,
        offset: 0,
    };
    attend::<f32, false>(queries, hd, widened, scale, true, out);
    WIDE.set(wide);
}

/// The attention of the query heads in `queries` (each `hd` wide, side by side) that share the
/// key/value head `rows`: per query head, softmax of the scaled scores, then the values'
/// weighted sum into its part of `out`. The positions are taken a block at a time for all the
/// heads, so a block's keys and values come from memory once for the heads that share them (a
/// batch's caches are far larger than the core's caches). `AVX2`: eight scores at a time by
/// [`eight_scores_avx2`] and the weighted sums by [`weighted_avx2`] (only from
/// [`attend_avx2`]). `f16_weights`: the softmax's weights rounded to f16 before the values'
/// sums, as beside f16 values (module doc).
#[inline(always)]
fn attend<T: Element, const AVX2: bool>(
    queries: &[f32],
    hd: usize,
    rows: Rows<'_, T>,
    scale: f32,
    f16_weights: bool,
    out: &mut [f32],
) {
    let (heads, len) = (queries.len() / hd, rows.len);
    out.fill(0.0);
    if len == 0 {
        return;
    }
    // What the AVX2 functions read through pointers lies within the keys and values.
    let last = (len - 1) * rows.kv_dim + rows.offset + hd;
    assert!(
        last <= rows.keys.len() && last <= rows.values.len(),
        "attention: {len} positions, keys or values too short"
    );
    // The thread's buffer taken and put back (no closure: one would be compiled apart from this
    // function, without its AVX2).
    let mut scores = SCORES.take();
    scores.clear();
    scores.resize(heads * len, 0.0);
    let whole = scores_by_eight::<T, AVX2>(queries, hd, &rows, scale, &mut scores);
    for j in whole..len {
        for (h, q) in queries.chunks_exact(hd).enumerate() {
            scores[h * len + j] = score(q, rows.key(j, hd)) * scale;
        }
    }
    for row in scores.chunks_exact_mut(len) {
        crate::kernels::softmax_row(row);
        if f16_weights {
            round_to_f16(row);
        }
    }
    for first in (0..len).step_by(VALUE_BLOCK) {
        let block = first..(first + VALUE_BLOCK).min(len);
        for (h, out) in out.chunks_exact_mut(hd).enumerate() {
            weighted_sums::<T, AVX2>(&scores[h * len..][block.clone()], &rows, first, out);
        }
    }
    SCORES.set(scores);
}

/// Positions whose values are added into every head's sums before the next: 16 rows of a
/// 128-wide head are 8 KiB in f32, which stay in the first-level cache while the heads pass.
const VALUE_BLOCK: usize = 16;

/// The scores of the first positions, eight at a time for every head, where that is faster
/// (AVX2, a head width a multiple of eight), into `scores` (a row of `rows.len` per head);
/// returns how many positions it scored.
#[inline(always)]
fn scores_by_eight<T: Element, const AVX2: bool>(
    queries: &[f32],
    hd: usize,
    rows: &Rows<'_, T>,
    scale: f32,
    scores: &mut [f32],
) -> usize {
    #[cfg(target_arch = "x86_64")]
    if AVX2 && hd.is_multiple_of(8) {
        let whole = rows.len / 8 * 8;
        for j in (0..whole).step_by(8) {
            for (h, q) in queries.chunks_exact(hd).enumerate() {
                let eight = &mut scores[h * rows.len + j..][..8];
                // SAFETY: only `attend_avx2`, on a CPU with AVX2 and F16C, asks for it;
                // positions up to `rows.len` exist (`attend`'s assert).
                unsafe { eight_scores_avx2(q, rows, j, scale, eight) };
            }
        }
        return whole;
    }
    let _ = (queries, hd, rows, scale, scores);
    0
}

/// `q·k` in the module doc's order.
#[inline(always)]
fn score<T: Element>(q: &[f32], k: &[T]) -> f32 {
    let mut l = [0f32; 8];
    let (cq, ck) = (q.chunks_exact(8), k.chunks_exact(8));
    let (rq, rk) = (cq.remainder(), ck.remainder());
    for (x, y) in cq.zip(ck) {
        for i in 0..8 {
            l[i] += x[i] * y[i].widen();
        }
    }
    let mut s = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
    for (x, y) in rq.iter().zip(rk) {
        s += x * y.widen();
    }
    s
}

/// [`score`] of positions `j..j + 8` (the head width a multiple of 8), scaled, into `out`.
///
/// # Safety
/// The CPU has AVX2 and F16C; positions `j..j + 8` of `rows` exist.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn eight_scores_avx2<T: Element>(
    q: &[f32],
    rows: &Rows<'_, T>,
    j: usize,
    scale: f32,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    assert!(
        out.len() == 8 && q.len().is_multiple_of(8),
        "eight scores: shapes"
    );
    let keys = rows.keys.as_ptr().add(j * rows.kv_dim + rows.offset);
    let mut lanes = [_mm256_setzero_ps(); 8];
    for c in (0..q.len()).step_by(8) {
        let x = _mm256_loadu_ps(q.as_ptr().add(c));
        for (p, l) in lanes.iter_mut().enumerate() {
            let y = T::eight(keys.add(p * rows.kv_dim + c));
            *l = _mm256_add_ps(*l, _mm256_mul_ps(x, y));
        }
    }
    // Pairs (l0 + l1, l2 + l3 of each position), then pairs of those: each position's halves of
    // the tree, positions 0–3 in one register and 4–7 in the other.
    let pairs = |a, b| _mm256_hadd_ps(a, b);
    let low = pairs(pairs(lanes[0], lanes[1]), pairs(lanes[2], lanes[3]));
    let high = pairs(pairs(lanes[4], lanes[5]), pairs(lanes[6], lanes[7]));
    let sums = _mm256_add_ps(
        _mm256_permute2f128_ps::<0x20>(low, high),
        _mm256_permute2f128_ps::<0x31>(low, high),
    );
    _mm256_storeu_ps(out.as_mut_ptr(), _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
}

/// `out[i] += Σⱼ p[j] · v_{first + j}[i]`, positions in order: on AVX2 32 outputs at a time
/// (four registers' worth of independent sums while the positions pass), then 8; the rest (all
/// of them in the portable build) as many at a time as the compiler vectorises. Each sum goes
/// on from where the previous block left it, so the blocks change no bit.
#[inline(always)]
fn weighted_sums<T: Element, const AVX2: bool>(
    p: &[f32],
    rows: &Rows<'_, T>,
    first: usize,
    out: &mut [f32],
) {
    let mut at = 0;
    #[cfg(target_arch = "x86_64")]
    if AVX2 {
        while out.len() - at >= 8 {
            let left = out.len() - at;
            // SAFETY: only `attend_avx2`, on a CPU with AVX2 and F16C, asks for it; the
            // positions of `p` exist (`attend`'s assert) and `out` holds the outputs.
            at += unsafe {
                match left {
                    32.. => weighted_avx2::<T, 4>(p, rows, first, at, &mut out[at..]),
                    _ => weighted_avx2::<T, 1>(p, rows, first, at, &mut out[at..]),
                }
            };
        }
    }
    while at < out.len() {
        let left = out.len() - at;
        at += if left >= 32 {
            weighted::<T, 32>(p, rows, first, at, &mut out[at..])
        } else if left >= 8 {
            weighted::<T, 8>(p, rows, first, at, &mut out[at..])
        } else {
            weighted::<T, 1>(p, rows, first, at, &mut out[at..])
        };
    }
}

/// Outputs `at..at + W` of [`weighted_sums`] in `out[..W]`; returns `W`.
#[inline(always)]
fn weighted<T: Element, const W: usize>(
    p: &[f32],
    rows: &Rows<'_, T>,
    first: usize,
    at: usize,
    out: &mut [f32],
) -> usize {
    let mut acc = [0f32; W];
    acc.copy_from_slice(&out[..W]);
    for (j, &p) in p.iter().enumerate() {
        let v = &rows.values[(first + j) * rows.kv_dim + rows.offset + at..][..W];
        for i in 0..W {
            acc[i] += p * v[i].widen();
        }
    }
    out[..W].copy_from_slice(&acc);
    W
}

/// [`weighted`] for `8 R` outputs in `R` registers; returns `8 R`.
///
/// # Safety
/// The CPU has AVX2 and F16C; the values of positions `first..first + p.len()` exist up to
/// output `at + 8 R` of the head.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn weighted_avx2<T: Element, const R: usize>(
    p: &[f32],
    rows: &Rows<'_, T>,
    first: usize,
    at: usize,
    out: &mut [f32],
) -> usize {
    use std::arch::x86_64::*;
    assert!(out.len() >= 8 * R, "weighted sums: outputs");
    let mut acc = [_mm256_setzero_ps(); R];
    for (r, acc) in acc.iter_mut().enumerate() {
        *acc = _mm256_loadu_ps(out.as_ptr().add(8 * r));
    }
    let values = rows
        .values
        .as_ptr()
        .add(first * rows.kv_dim + rows.offset + at);
    for (j, &p) in p.iter().enumerate() {
        let (p, v) = (_mm256_set1_ps(p), values.add(j * rows.kv_dim));
        for (r, acc) in acc.iter_mut().enumerate() {
            *acc = _mm256_add_ps(*acc, _mm256_mul_ps(p, T::eight(v.add(8 * r))));
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        _mm256_storeu_ps(out.as_mut_ptr().add(8 * r), *acc);
    }
    8 * R
}

thread_local! {
    /// A thread's attention scores, kept between calls: one per row and key/value head of every
    /// layer of every step was an allocation from the kernels' threads, which wait on each
    /// other's where all threads share one glibc arena (as a worker generating on the CPU sets).
    static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// A thread's f16 keys and values widened, for the portable build ([`attend_widened`]).
    static WIDE: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// A thread's queries rounded to f16 ([`attend_best`] beside f16 keys and values).
    static HALVED: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random numbers in [-2, 2), the same for the same seed.
    fn random(seed: &mut u32, count: usize) -> Vec<f32> {
        (0..count)
            .map(|_| {
                *seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (*seed >> 8) as f32 / (1u32 << 24) as f32 * 4.0 - 2.0
            })
            .collect()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|v| v.to_bits()).collect()
    }

    /// Attention on AVX2 gives the portable build's bits, over f32 and f16 keys and values and
    /// head widths and lengths that leave every tail (positions past a multiple of eight and of
    /// a value block, inputs past a multiple of eight, outputs past 32 and 8); three query heads
    /// attended together give what each gives alone; and the result is the module doc's sums,
    /// written out plainly over the keys and values widened (beside f16 ones, the query and the
    /// weights rounded to f16 one number at a time).
    #[test]
    fn attention_on_avx2_and_by_groups_is_each_heads_plain_sums_bit_for_bit() {
        let mut seed = 17u32;
        for (hd, len) in [(64, 1), (64, 37), (80, 130), (72, 9), (12, 17), (128, 8)] {
            let (kv_dim, group) = (3 * hd, 3);
            let queries = random(&mut seed, group * hd);
            let (keys, values) = (
                random(&mut seed, len * kv_dim),
                random(&mut seed, len * kv_dim),
            );
            let halve = |v: &[f32]| v.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>();
            let (keys16, values16) = (halve(&keys), halve(&values));
            let (wide_keys, wide_values): (Vec<f32>, Vec<f32>) = (
                keys16.iter().map(|x| x.to_f32()).collect(),
                values16.iter().map(|x| x.to_f32()).collect(),
            );
            fn rows<'a, T>(keys: &'a [T], values: &'a [T], len: usize, hd: usize) -> Rows<'a, T> {
                Rows {
                    keys,
                    values,
                    len,
                    kv_dim: 3 * hd,
                    offset: hd,
                }
            }
            let cases = [
                (
                    "f32",
                    KvHead::F32(rows(&keys, &values, len, hd)),
                    rows(&keys, &values, len, hd),
                ),
                (
                    "f16",
                    KvHead::F16(rows(&keys16, &values16, len, hd)),
                    rows(&wide_keys, &wide_values, len, hd),
                ),
            ];
            for (kind, kv, widened) in cases {
                let half = matches!(kv, KvHead::F16(_));
                let portable = |q: &[f32], out: &mut [f32]| match kv {
                    KvHead::F32(r) => attend::<f32, false>(q, hd, r, 0.125, false, out),
                    KvHead::F16(r) => {
                        let mut q = q.to_vec();
                        round_to_f16(&mut q);
                        attend_widened(&q, hd, r, 0.125, out)
                    }
                };
                let mut best = vec![0f32; group * hd];
                attend_best(&queries, hd, kv, 0.125, &mut best);
                for h in 0..group {
                    let q = &queries[h * hd..][..hd];
                    let mut alone = vec![0f32; hd];
                    portable(q, &mut alone);
                    let what = format!("{kind}: head {h} of {hd}, {len} positions");
                    assert_eq!(bits(&alone), bits(&best[h * hd..][..hd]), "{what}");
                    let plain = plain(q, &widened, hd, half);
                    assert_eq!(bits(&alone), bits(&plain), "{what}: plain");
                }
            }
        }
    }

    /// The module doc's sums, one number at a time; `half`: the query and the weights rounded to
    /// f16 first.
    fn plain(q: &[f32], kv: &Rows<'_, f32>, hd: usize, half: bool) -> Vec<f32> {
        let round = |x: f32| if half { f16::from_f32(x).to_f32() } else { x };
        let q: Vec<f32> = q.iter().map(|&x| round(x)).collect();
        let mut scores: Vec<f32> = (0..kv.len)
            .map(|j| {
                let k = kv.key(j, hd);
                let lane = |i: usize| {
                    (i..hd - hd % 8)
                        .step_by(8)
                        .fold(0f32, |s, n| s + q[n] * k[n])
                };
                let mut s = ((lane(0) + lane(1)) + (lane(2) + lane(3)))
                    + ((lane(4) + lane(5)) + (lane(6) + lane(7)));
                for n in hd - hd % 8..hd {
                    s += q[n] * k[n];
                }
                s * 0.125
            })
            .collect();
        crate::kernels::softmax_row(&mut scores);
        scores.iter_mut().for_each(|p| *p = round(*p));
        (0..hd)
            .map(|i| {
                scores.iter().enumerate().fold(0f32, |o, (j, p)| {
                    o + p * kv.values[j * kv.kv_dim + kv.offset + i]
                })
            })
            .collect()
    }
}
