//! The block product on AVX2: per 32-weight sub-block, `vpmaddubsw` multiplies the weights
//! (unsigned as they are, signed ones by magnitude with their signs moved onto the activations;
//! exact: no pair exceeds 16 bits), `vpmaddwd` applies the integer scales, and one fused
//! multiply-add per sub-block scales the eight 32-bit sums into f32 lanes. The float scale and
//! the minimum's coefficient are multiplied by the activation block's scale and scaled sum in one
//! two-lane product, and the minimums' terms summed in the second lane. `unpack::dot` is the
//! same algorithm in portable Rust.

use super::{unpack, ActivationRow, BlockFormat, Unpacked, BLOCK};
use std::arch::x86_64::*;

/// `(factor · scale, minimum · scaled sum)` in the low two lanes: one product for both.
#[inline(always)]
unsafe fn pair_product(factor_minimum: *const [f32; 2], scales: *const [f32; 2]) -> __m128 {
    let w = _mm_castpd_ps(_mm_load_sd(factor_minimum.cast()));
    let a = _mm_castpd_ps(_mm_load_sd(scales.cast()));
    _mm_mul_ps(w, a)
}

/// The sub-block's 32-bit sums: values times activations, pairs scaled by `scales`.
#[inline(always)]
unsafe fn integer_sums(values: __m256i, q: __m256i, scales: __m256i, unsigned: bool) -> __m256i {
    let pairs = if unsigned {
        _mm256_maddubs_epi16(values, q)
    } else {
        _mm256_maddubs_epi16(_mm256_abs_epi8(values), _mm256_sign_epi8(q, values))
    };
    _mm256_madd_epi16(pairs, scales)
}

/// Adds one sub-block: `lanes += sums · factor·scale`, `minimums += minimum·scaled sum` (lane 1).
#[inline(always)]
unsafe fn accumulate(
    lanes: &mut __m256,
    minimums: &mut __m128,
    sums: __m256i,
    pair: __m128,
    has_minimum: bool,
) {
    *lanes = _mm256_fmadd_ps(
        _mm256_cvtepi32_ps(sums),
        _mm256_broadcastss_ps(pair),
        *lanes,
    );
    if has_minimum {
        *minimums = _mm_add_ps(*minimums, pair);
    }
}

/// The eight lanes summed as `((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))`, plus the minimums' lane.
#[inline(always)]
unsafe fn total(lanes: __m256, minimums: __m128) -> f32 {
    let half = _mm_add_ps(
        _mm256_castps256_ps128(lanes),
        _mm256_extractf128_ps(lanes, 1),
    );
    let pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
    let sum = _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
    sum + _mm_cvtss_f32(_mm_shuffle_ps(minimums, minimums, 1))
}

/// The unpacked weight row `w` times one activation row.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn dot(w: &Unpacked, a: ActivationRow<'_>) -> f32 {
    let subs = a.scales.len();
    check(w, a, subs);
    let (mut lanes, mut minimums) = (_mm256_setzero_ps(), _mm_setzero_ps());
    for s in 0..subs {
        let values = _mm256_loadu_si256(w.w.as_ptr().add(s * BLOCK).cast());
        let q = _mm256_loadu_si256(a.q.as_ptr().add(s * BLOCK).cast());
        let scales = _mm256_loadu_si256(w.scales.as_ptr().add(s * 16).cast());
        let sums = integer_sums(values, q, scales, w.has_minimum);
        let pair = pair_product(w.factor_minimum.as_ptr().add(s), a.scales.as_ptr().add(s));
        accumulate(&mut lanes, &mut minimums, sums, pair, w.has_minimum);
    }
    total(lanes, minimums)
}

/// What the kernels read past their slices' checks.
fn check(w: &Unpacked, a: ActivationRow<'_>, subs: usize) {
    assert!(
        a.q.len() >= subs * BLOCK
            && w.w.len() >= subs * BLOCK
            && w.scales.len() >= subs * 16
            && w.factor_minimum.len() >= subs,
        "block product: sub-blocks"
    );
}

/// One unpacked weight row times four activation rows, into `out`: each sum computed exactly
/// as [`dot`] computes it alone; the four interleaved share each weight load and hide the
/// multiply-adds' latency (written out, so the sums stay in registers).
///
/// # Safety
/// As [`dot`], for the four rows of `a`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn dots_by_four(w: &Unpacked, a: [ActivationRow<'_>; 4], out: &mut [f32; 4]) {
    let subs = a[0].scales.len();
    for a in a {
        assert_eq!(a.scales.len(), subs, "block product: rows");
        check(w, a, subs);
    }
    let zero = _mm256_setzero_ps();
    let (mut l0, mut l1, mut l2, mut l3) = (zero, zero, zero, zero);
    let mut m = [_mm_setzero_ps(); 4];
    let unsigned = w.has_minimum;
    for s in 0..subs {
        let values = _mm256_loadu_si256(w.w.as_ptr().add(s * BLOCK).cast());
        let scales = _mm256_loadu_si256(w.scales.as_ptr().add(s * 16).cast());
        let fm = w.factor_minimum.as_ptr().add(s);
        macro_rules! row {
            ($lanes:ident, $t:literal) => {
                let q = _mm256_loadu_si256(a[$t].q.as_ptr().add(s * BLOCK).cast());
                let sums = integer_sums(values, q, scales, unsigned);
                let pair = pair_product(fm, a[$t].scales.as_ptr().add(s));
                accumulate(&mut $lanes, &mut m[$t], sums, pair, unsigned);
            };
        }
        row!(l0, 0);
        row!(l1, 1);
        row!(l2, 2);
        row!(l3, 3);
    }
    for (t, lanes) in [l0, l1, l2, l3].into_iter().enumerate() {
        out[t] = total(lanes, m[t]);
    }
}

/// A weight row (GGUF bytes, `format`) times one activation row, unpacking each sub-block in
/// registers: no buffer, for a decoding step's one row. The sum is computed exactly as [`dot`]
/// computes it from the unpacked row (the same integers, products and order).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_packed(format: BlockFormat, row: &[u8], a: ActivationRow<'_>) -> f32 {
    match format {
        BlockFormat::Q4_0 => fused::<0>(row, a),
        BlockFormat::Q4_1 => fused::<1>(row, a),
        BlockFormat::Q5_0 => fused::<2>(row, a),
        BlockFormat::Q5_1 => fused::<3>(row, a),
        BlockFormat::Q8_0 => fused::<4>(row, a),
        BlockFormat::Q4K => fused::<5>(row, a),
        BlockFormat::Q5K => fused::<6>(row, a),
        BlockFormat::Q6K => fused::<7>(row, a),
    }
}

/// The two f16 at `at`, widened, in lanes 0 and 1.
#[inline(always)]
unsafe fn two_f16(at: *const u8) -> __m128 {
    _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(
        at.cast::<i32>(),
    )))
}

/// [`dot_packed`] for the format `BlockFormat::ALL[F]`, so its branches fold away.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fused<const F: usize>(row: &[u8], a: ActivationRow<'_>) -> f32 {
    let format = BlockFormat::ALL[F];
    let (per, bytes) = (format.block_weights() / BLOCK, format.block_bytes());
    let subs = a.scales.len();
    assert!(
        a.q.len() >= subs * BLOCK && row.len() >= subs / per * bytes,
        "block product: sub-blocks"
    );
    let (blocks, q, activation_scales) = (subs / per, a.q.as_ptr(), a.scales.as_ptr());
    let row = row.as_ptr();
    let has_minimum = format.has_minimum();
    let ones = _mm256_set1_epi16(1);
    let (mut lanes, mut minimums) = (_mm256_setzero_ps(), _mm_setzero_ps());
    for b in 0..blocks {
        let block = row.add(b * bytes);
        // Lane 0 the block's scale, lane 1 its minimum (Q4_1) or the K formats' dmin.
        let head = match format {
            BlockFormat::Q6K => {
                let d = std::ptr::read_unaligned(block.add(208).cast::<u16>());
                _mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(d)))
            }
            _ => two_f16(block),
        };
        for j in 0..per {
            let s = b * per + j;
            let (scales, fm) = match format {
                BlockFormat::Q4_0
                | BlockFormat::Q4_1
                | BlockFormat::Q5_0
                | BlockFormat::Q5_1
                | BlockFormat::Q8_0 => (ones, head),
                BlockFormat::Q4K | BlockFormat::Q5K => {
                    let k4 = std::slice::from_raw_parts(block.add(4), 12);
                    let (sc, m) = unpack::scale_min_k4(j, k4);
                    let dmin = _mm_cvtss_f32(_mm_shuffle_ps(head, head, 1));
                    let minimum = -(dmin * f32::from(m));
                    let fm = _mm_setr_ps(_mm_cvtss_f32(head), minimum, 0.0, 0.0);
                    (_mm256_set1_epi16(i16::from(sc)), fm)
                }
                BlockFormat::Q6K => {
                    let sc = block.add(192 + 8 * (j / 4) + 2 * (j % 4));
                    let (first, second) = (i16::from(*sc as i8), i16::from(*sc.add(1) as i8));
                    let scales = _mm256_set_m128i(_mm_set1_epi16(second), _mm_set1_epi16(first));
                    (scales, head)
                }
            };
            let activation = _mm_castpd_ps(_mm_load_sd(activation_scales.add(s).cast()));
            let pair = _mm_mul_ps(fm, activation);
            let qa = _mm256_loadu_si256(q.add(s * BLOCK).cast());
            let sums = integer_sums(values(format, block, j), qa, scales, has_minimum);
            accumulate(&mut lanes, &mut minimums, sums, pair, has_minimum);
        }
    }
    total(lanes, minimums)
}

/// [`super::unpack::unpack`] with each sub-block's values taken apart in registers: the same
/// bytes out, several times faster (a decoding step unpacks every weight once).
///
/// # Safety
/// The CPU must have AVX2; `row` must hold `k` weights of `format`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn unpack(format: BlockFormat, row: &[u8], k: usize, out: &mut Unpacked) {
    unpack::prepare(format, k, out);
    for s in 0..k / BLOCK {
        let (block, within) = unpack::block_of(format, row, s);
        let values = values(format, block.as_ptr(), within);
        _mm256_storeu_si256(out.w.as_mut_ptr().add(s * BLOCK).cast(), values);
        unpack::put_meta(out, s, &unpack::meta(format, block, within));
    }
}

/// Sub-block `within` of the block at `at`: its 32 signed values, in order.
#[inline(always)]
unsafe fn values(format: BlockFormat, at: *const u8, within: usize) -> __m256i {
    let low = _mm256_set1_epi8(0xF);
    match format {
        BlockFormat::Q4_0 | BlockFormat::Q4_1 => {
            let qs = _mm_loadu_si128(
                at.add(if format == BlockFormat::Q4_0 { 2 } else { 4 })
                    .cast(),
            );
            let both = _mm256_set_m128i(_mm_srli_epi16(qs, 4), qs);
            let v = _mm256_and_si256(both, low);
            if format == BlockFormat::Q4_0 {
                _mm256_sub_epi8(v, _mm256_set1_epi8(8))
            } else {
                v
            }
        }
        BlockFormat::Q5_0 | BlockFormat::Q5_1 => {
            let bits_at = if format == BlockFormat::Q5_0 { 2 } else { 4 };
            let qs = _mm_loadu_si128(at.add(bits_at + 4).cast());
            let v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), low);
            // Bit e of the 32-bit word to byte e: each byte picks its word's byte, then tests
            // its own bit (llama.cpp's `bytes_from_bits_32`).
            let word = std::ptr::read_unaligned(at.add(bits_at).cast::<i32>());
            let spread = _mm256_shuffle_epi8(
                _mm256_set1_epi32(word),
                _mm256_set_epi64x(
                    0x0303030303030303,
                    0x0202020202020202,
                    0x0101010101010101,
                    0,
                ),
            );
            let others = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
            let set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, others), _mm256_set1_epi8(-1));
            let v = _mm256_or_si256(v, _mm256_and_si256(set, _mm256_set1_epi8(16)));
            if format == BlockFormat::Q5_0 {
                _mm256_sub_epi8(v, _mm256_set1_epi8(16))
            } else {
                v
            }
        }
        BlockFormat::Q8_0 => _mm256_loadu_si256(at.add(2).cast()),
        BlockFormat::Q4K | BlockFormat::Q5K => {
            let qs_at = if format == BlockFormat::Q4K { 16 } else { 48 };
            let qs = _mm256_loadu_si256(at.add(qs_at + 32 * (within / 2)).cast());
            let qs = if within % 2 == 1 {
                _mm256_srli_epi16(qs, 4)
            } else {
                qs
            };
            let v = _mm256_and_si256(qs, low);
            if format == BlockFormat::Q5K {
                let bit = _mm256_set1_epi8((1u8 << within) as i8);
                let qh = _mm256_loadu_si256(at.add(16).cast());
                let set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
                _mm256_or_si256(v, _mm256_and_si256(set, _mm256_set1_epi8(16)))
            } else {
                v
            }
        }
        BlockFormat::Q6K => {
            let (half, run) = (within / 4, within % 4);
            let ql = _mm256_loadu_si256(at.add(64 * half + 32 * (run % 2)).cast());
            let ql = if run >= 2 {
                _mm256_srli_epi16(ql, 4)
            } else {
                ql
            };
            let qh = _mm256_loadu_si256(at.add(128 + 32 * half).cast());
            let high = match run {
                0 => _mm256_slli_epi16(qh, 4),
                1 => _mm256_slli_epi16(qh, 2),
                2 => qh,
                _ => _mm256_srli_epi16(qh, 2),
            };
            let v = _mm256_or_si256(
                _mm256_and_si256(ql, low),
                _mm256_and_si256(high, _mm256_set1_epi8(0x30)),
            );
            _mm256_sub_epi8(v, _mm256_set1_epi8(32))
        }
    }
}
