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
//! On AVX2 the scores of eight positions are computed side by side and their trees added by
//! `vhaddps` (which adds exactly those pairs), and the weighted sums keep 32 outputs in
//! registers while the positions pass; the portable build computes the same sums one by one.
//! On a Zen 4, a batch-32 step of a Qwen2.5-0.5B shape spent 6.6% of its time here before
//! (a 16-lane sum stored and added one lane at a time per score, every output loaded and stored
//! again per position).

/// One sequence's cached keys and values for one key/value head: rows of `kv_dim`, the head's
/// values at `offset` in each, the first `len` rows attended to.
#[derive(Clone, Copy)]
pub(super) struct KvHead<'a> {
    pub keys: &'a [f32],
    pub values: &'a [f32],
    pub len: usize,
    pub kv_dim: usize,
    pub offset: usize,
}

impl KvHead<'_> {
    /// Position `j`'s key (`hd` wide).
    fn key(&self, j: usize, hd: usize) -> &[f32] {
        &self.keys[j * self.kv_dim + self.offset..][..hd]
    }
}

/// [`attend`] on AVX2 where the CPU has it, else as the crate is built (SSE2 on x86-64): the
/// same sums either way (module doc), so the same bits.
pub(super) fn attend_best(queries: &[f32], hd: usize, kv: KvHead<'_>, scale: f32, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { attend_avx2(queries, hd, kv, scale, out) };
    }
    attend::<false>(queries, hd, kv, scale, out)
}

/// [`attend`] compiled for AVX2.
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn attend_avx2(queries: &[f32], hd: usize, kv: KvHead<'_>, scale: f32, out: &mut [f32]) {
    attend::<true>(queries, hd, kv, scale, out)
}

/// The attention of the query heads in `queries` (each `hd` wide, side by side) that share the
/// key/value head `kv`: per query head, softmax of the scaled scores, then the values' weighted
/// sum into its part of `out`. The positions are taken a block at a time for all the heads, so
/// a block's keys and values come from memory once for the heads that share them (a batch's
/// caches are far larger than the core's caches). `AVX2`: eight scores at a time by
/// [`eight_scores_avx2`] (only from [`attend_avx2`]).
#[inline(always)]
fn attend<const AVX2: bool>(
    queries: &[f32],
    hd: usize,
    kv: KvHead<'_>,
    scale: f32,
    out: &mut [f32],
) {
    let (heads, len) = (queries.len() / hd, kv.len);
    out.fill(0.0);
    if len == 0 {
        return;
    }
    // What `eight_scores_avx2` reads through pointers lies within the keys.
    assert!(
        (len - 1) * kv.kv_dim + kv.offset + hd <= kv.keys.len(),
        "attention: {len} positions, keys too short"
    );
    // The thread's buffer taken and put back (no closure: one would be compiled apart from this
    // function, without its AVX2).
    let mut scores = SCORES.take();
    scores.clear();
    scores.resize(heads * len, 0.0);
    let whole = scores_by_eight::<AVX2>(queries, hd, &kv, scale, &mut scores);
    for j in whole..len {
        for (h, q) in queries.chunks_exact(hd).enumerate() {
            scores[h * len + j] = score(q, kv.key(j, hd)) * scale;
        }
    }
    for row in scores.chunks_exact_mut(len) {
        crate::kernels::softmax_row(row);
    }
    for first in (0..len).step_by(VALUE_BLOCK) {
        let block = first..(first + VALUE_BLOCK).min(len);
        for (h, out) in out.chunks_exact_mut(hd).enumerate() {
            weighted_sums(&scores[h * len..][block.clone()], &kv, first, out);
        }
    }
    SCORES.set(scores);
}

/// Positions whose values are added into every head's sums before the next: 16 rows of a
/// 128-wide head are 8 KiB, which stay in the first-level cache while the heads pass.
const VALUE_BLOCK: usize = 16;

/// The scores of the first positions, eight at a time for every head, where that is faster
/// (AVX2, a head width a multiple of eight), into `scores` (a row of `kv.len` per head); returns
/// how many positions it scored.
#[inline(always)]
fn scores_by_eight<const AVX2: bool>(
    queries: &[f32],
    hd: usize,
    kv: &KvHead<'_>,
    scale: f32,
    scores: &mut [f32],
) -> usize {
    #[cfg(target_arch = "x86_64")]
    if AVX2 && hd.is_multiple_of(8) {
        let whole = kv.len / 8 * 8;
        for j in (0..whole).step_by(8) {
            for (h, q) in queries.chunks_exact(hd).enumerate() {
                let eight = &mut scores[h * kv.len + j..][..8];
                // SAFETY: only `attend_avx2`, on a CPU with AVX2, asks for it; positions up to
                // `kv.len` exist (`attend`'s assert).
                unsafe { eight_scores_avx2(q, kv, j, scale, eight) };
            }
        }
        return whole;
    }
    let _ = (queries, hd, kv, scale, scores);
    0
}

/// `q·k` in the module doc's order.
#[inline(always)]
fn score(q: &[f32], k: &[f32]) -> f32 {
    let mut l = [0f32; 8];
    let (cq, ck) = (q.chunks_exact(8), k.chunks_exact(8));
    let (rq, rk) = (cq.remainder(), ck.remainder());
    for (x, y) in cq.zip(ck) {
        for i in 0..8 {
            l[i] += x[i] * y[i];
        }
    }
    let mut s = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
    for (x, y) in rq.iter().zip(rk) {
        s += x * y;
    }
    s
}

/// [`score`] of positions `j..j + 8` (the head width a multiple of 8), scaled, into `out`.
///
/// # Safety
/// The CPU has AVX2; positions `j..j + 8` of `kv` exist.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn eight_scores_avx2(q: &[f32], kv: &KvHead<'_>, j: usize, scale: f32, out: &mut [f32]) {
    use std::arch::x86_64::*;
    assert!(
        out.len() == 8 && q.len().is_multiple_of(8),
        "eight scores: shapes"
    );
    let keys = kv.keys.as_ptr().add(j * kv.kv_dim + kv.offset);
    let mut lanes = [_mm256_setzero_ps(); 8];
    for c in (0..q.len()).step_by(8) {
        let x = _mm256_loadu_ps(q.as_ptr().add(c));
        for (p, l) in lanes.iter_mut().enumerate() {
            let y = _mm256_loadu_ps(keys.add(p * kv.kv_dim + c));
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

/// `out[i] += Σⱼ p[j] · v_{first + j}[i]`, positions in order: 32 outputs at a time (four
/// registers' worth of independent sums while the positions pass), then 8, then one. Each sum
/// goes on from where the previous block left it, so the blocks change no bit.
#[inline(always)]
fn weighted_sums(p: &[f32], kv: &KvHead<'_>, first: usize, out: &mut [f32]) {
    let mut at = 0;
    while at < out.len() {
        let left = out.len() - at;
        at += if left >= 32 {
            weighted::<32>(p, kv, first, at, &mut out[at..])
        } else if left >= 8 {
            weighted::<8>(p, kv, first, at, &mut out[at..])
        } else {
            weighted::<1>(p, kv, first, at, &mut out[at..])
        };
    }
}

/// Outputs `at..at + W` of [`weighted_sums`] in `out[..W]`; returns `W`.
#[inline(always)]
fn weighted<const W: usize>(
    p: &[f32],
    kv: &KvHead<'_>,
    first: usize,
    at: usize,
    out: &mut [f32],
) -> usize {
    let mut acc = [0f32; W];
    acc.copy_from_slice(&out[..W]);
    for (j, &p) in p.iter().enumerate() {
        let v = &kv.values[(first + j) * kv.kv_dim + kv.offset + at..][..W];
        for i in 0..W {
            acc[i] += p * v[i];
        }
    }
    out[..W].copy_from_slice(&acc);
    W
}

thread_local! {
    /// A thread's attention scores, kept between calls: one per row and key/value head of every
    /// layer of every step was an allocation from the kernels' threads, which wait on each
    /// other's where all threads share one glibc arena (as a worker generating on the CPU sets).
    static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The AVX2 build of attention gives the portable build's bits, over head widths and lengths
    /// that leave every tail (positions past a multiple of eight, inputs past a multiple of
    /// eight, outputs past 32 and 8), three query heads attended together give what each gives
    /// alone, and the result is the module doc's sums, written out plainly.
    #[test]
    fn attention_on_avx2_and_by_groups_is_each_heads_plain_sums_bit_for_bit() {
        let mut seed = 17u32;
        let mut random = |count: usize| -> Vec<f32> {
            (0..count)
                .map(|_| {
                    seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    (seed >> 8) as f32 / (1u32 << 24) as f32 * 4.0 - 2.0
                })
                .collect()
        };
        let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for (hd, len) in [(64, 1), (64, 37), (80, 130), (72, 9), (12, 17), (128, 8)] {
            let (kv_dim, group) = (3 * hd, 3);
            let (queries, keys, values) = (
                random(group * hd),
                random(len * kv_dim),
                random(len * kv_dim),
            );
            let kv = KvHead {
                keys: &keys,
                values: &values,
                len,
                kv_dim,
                offset: hd,
            };
            let mut best = vec![0f32; group * hd];
            attend_best(&queries, hd, kv, 0.125, &mut best);
            for h in 0..group {
                let q = &queries[h * hd..][..hd];
                let mut alone = vec![0f32; hd];
                attend::<false>(q, hd, kv, 0.125, &mut alone);
                let what = format!("head {h} of {hd}, {len} positions");
                assert_eq!(bits(&alone), bits(&best[h * hd..][..hd]), "{what}");
                assert_eq!(bits(&alone), bits(&plain(q, &kv, hd)), "{what}: plain");
            }
        }
    }

    /// The module doc's sums, one number at a time.
    fn plain(q: &[f32], kv: &KvHead<'_>, hd: usize) -> Vec<f32> {
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
        (0..hd)
            .map(|i| {
                scores.iter().enumerate().fold(0f32, |o, (j, p)| {
                    o + p * kv.values[j * kv.kv_dim + kv.offset + i]
                })
            })
            .collect()
    }
}
