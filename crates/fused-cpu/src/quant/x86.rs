//! The block product on AVX2: per 32-weight sub-block, `vpmaddubsw` multiplies the weights'
//! magnitudes by the activations carrying the weights' signs (exact: no pair exceeds 16 bits),
//! `vpmaddwd` applies the integer scales, and one fused multiply-add per sub-block scales the
//! eight 32-bit sums into f32 lanes. `unpack::dot` is the same algorithm in portable Rust.

use super::{unpack, ActivationRow, BlockFormat, Unpacked, BLOCK};
use std::arch::x86_64::*;

/// `R` weight rows' sums of products with one activation row, into `out`: each row's sum
/// computed exactly as alone (its own lanes, in block order); interleaving `R` of them hides the
/// multiply-adds' latency and shares each activation load.
///
/// # Safety
/// The CPU must have AVX2 and FMA; every row of `w` and `a` must hold the same sub-blocks.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn dots<const R: usize>(w: &[Unpacked], a: ActivationRow<'_>, out: &mut [f32]) {
    let subs = a.scale.len();
    assert!(
        w.len() >= R
            && out.len() >= R
            && a.q.len() >= subs * BLOCK
            && w[..R].iter().all(|w| {
                w.w.len() >= subs * BLOCK
                    && w.magnitude.len() >= subs * BLOCK
                    && w.scales.len() >= subs * 16
                    && w.factor.len() >= subs
                    && w.minimum.len() >= subs
            }),
        "block product: sub-blocks"
    );
    let mut lanes = [_mm256_setzero_ps(); R];
    let mut minimums = [0f32; R];
    for s in 0..subs {
        let q = _mm256_loadu_si256(a.q.as_ptr().add(s * BLOCK).cast());
        let scale = *a.scale.get_unchecked(s);
        let scaled_sum = *a.scaled_sum.get_unchecked(s);
        for r in 0..R {
            let w = w.get_unchecked(r);
            let values = _mm256_loadu_si256(w.w.as_ptr().add(s * BLOCK).cast());
            let magnitude = _mm256_loadu_si256(w.magnitude.as_ptr().add(s * BLOCK).cast());
            let scales = _mm256_loadu_si256(w.scales.as_ptr().add(s * 16).cast());
            let pairs = if w.has_minimum {
                _mm256_maddubs_epi16(magnitude, q)
            } else {
                _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(q, values))
            };
            let sums = _mm256_madd_epi16(pairs, scales);
            let both = _mm256_set1_ps(*w.factor.get_unchecked(s) * scale);
            lanes[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), both, lanes[r]);
            if w.has_minimum {
                minimums[r] += *w.minimum.get_unchecked(s) * scaled_sum;
            }
        }
    }
    for r in 0..R {
        out[r] = hsum(lanes[r]) + minimums[r];
    }
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
        let magnitude = _mm256_abs_epi8(values);
        _mm256_storeu_si256(out.magnitude.as_mut_ptr().add(s * BLOCK).cast(), magnitude);
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

/// The f16 at `at`, widened.
#[inline(always)]
unsafe fn f16_at(at: *const u8) -> f32 {
    let h = _mm_cvtsi32_si128(i32::from(u16::from_le_bytes([*at, *at.add(1)])));
    _mm_cvtss_f32(_mm_cvtph_ps(h))
}

/// Sub-block `j` of the block at `at`: its integer scales (as the 16 lanes of `vpmaddwd`), float
/// scale and minimum's coefficient, as `unpack::meta` gives them.
#[inline(always)]
unsafe fn sub_meta(format: BlockFormat, at: *const u8, j: usize) -> (__m256i, f32, f32) {
    match format {
        BlockFormat::Q4_0 | BlockFormat::Q8_0 => (_mm256_set1_epi16(1), f16_at(at), 0.0),
        BlockFormat::Q4_1 => (_mm256_set1_epi16(1), f16_at(at), f16_at(at.add(2))),
        BlockFormat::Q4K | BlockFormat::Q5K => {
            let (sc, mn) = unpack::scale_min_k4(j, std::slice::from_raw_parts(at.add(4), 12));
            let minimum = -(f16_at(at.add(2)) * f32::from(mn));
            (_mm256_set1_epi16(i16::from(sc)), f16_at(at), minimum)
        }
        BlockFormat::Q6K => {
            let sc = at.add(192 + 8 * (j / 4) + 2 * (j % 4));
            let (first, second) = (i16::from(*sc as i8), i16::from(*sc.add(1) as i8));
            let scales = _mm256_set_m128i(_mm_set1_epi16(second), _mm_set1_epi16(first));
            (scales, f16_at(at.add(208)), 0.0)
        }
    }
}

/// `R` weight rows (GGUF bytes, `format`) times one activation row, unpacking each sub-block
/// in registers: no buffer, for a decoding step's one row. Each sum is computed exactly as
/// [`dots`] computes it from the unpacked rows (the same integers, scales and order).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; every row must hold `a`'s weights in `format`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dots_packed<const R: usize>(
    format: BlockFormat,
    rows: &[&[u8]],
    a: ActivationRow<'_>,
    out: &mut [f32],
) {
    match format {
        BlockFormat::Q4_0 => fused::<R, 0>(rows, a, out),
        BlockFormat::Q4_1 => fused::<R, 1>(rows, a, out),
        BlockFormat::Q8_0 => fused::<R, 2>(rows, a, out),
        BlockFormat::Q4K => fused::<R, 3>(rows, a, out),
        BlockFormat::Q5K => fused::<R, 4>(rows, a, out),
        BlockFormat::Q6K => fused::<R, 5>(rows, a, out),
    }
}

/// [`dots_packed`] for the format `BlockFormat::ALL[F]`, so its branches fold away.
#[inline(always)]
unsafe fn fused<const R: usize, const F: usize>(
    rows: &[&[u8]],
    a: ActivationRow<'_>,
    out: &mut [f32],
) {
    let format = BlockFormat::ALL[F];
    let (per, bytes) = (format.block_weights() / BLOCK, format.block_bytes());
    let subs = a.scale.len();
    assert!(
        rows.len() >= R
            && out.len() >= R
            && a.q.len() >= subs * BLOCK
            && rows[..R].iter().all(|r| r.len() >= subs / per * bytes),
        "block product: sub-blocks"
    );
    let has_minimum = matches!(
        format,
        BlockFormat::Q4_1 | BlockFormat::Q4K | BlockFormat::Q5K
    );
    for r in 0..R {
        let row = rows[r].as_ptr();
        let mut lanes = _mm256_setzero_ps();
        let mut minimums = 0f32;
        for s in 0..subs {
            let (block, j) = (row.add(s / per * bytes), s % per);
            let q = _mm256_loadu_si256(a.q.as_ptr().add(s * BLOCK).cast());
            let (scales, factor, minimum) = sub_meta(format, block, j);
            let v = values(format, block, j);
            // Unsigned values (the formats with a minimum) multiply as they are; signed ones
            // by magnitude, the sign moved onto the activations. The same products either way.
            let pairs = if has_minimum {
                _mm256_maddubs_epi16(v, q)
            } else {
                _mm256_maddubs_epi16(_mm256_abs_epi8(v), _mm256_sign_epi8(q, v))
            };
            let sums = _mm256_madd_epi16(pairs, scales);
            let both = _mm256_set1_ps(factor * *a.scale.get_unchecked(s));
            lanes = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), both, lanes);
            if has_minimum {
                minimums += minimum * *a.scaled_sum.get_unchecked(s);
            }
        }
        out[r] = hsum(lanes) + minimums;
    }
}

/// The eight lanes summed as `((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))`.
#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    let half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
    _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)))
}

/// One unpacked weight row times four activation rows, into `out`: each sum computed exactly
/// as [`dots`] computes it alone; the four interleaved share each weight load and hide the
/// multiply-adds' latency (written out, so the sums stay in registers).
///
/// # Safety
/// As [`dots`], for the four rows of `a`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn dots_by_four(w: &Unpacked, a: [ActivationRow<'_>; 4], out: &mut [f32; 4]) {
    let subs = a[0].scale.len();
    assert!(
        a.iter().all(|a| a.q.len() >= subs * BLOCK
            && a.scale.len() >= subs
            && a.scaled_sum.len() >= subs)
            && w.w.len() >= subs * BLOCK
            && w.magnitude.len() >= subs * BLOCK
            && w.scales.len() >= subs * 16
            && w.factor.len() >= subs
            && w.minimum.len() >= subs,
        "block product: sub-blocks"
    );
    let (mut l0, mut l1, mut l2, mut l3) = (
        _mm256_setzero_ps(),
        _mm256_setzero_ps(),
        _mm256_setzero_ps(),
        _mm256_setzero_ps(),
    );
    let mut minimums = [0f32; 4];
    for s in 0..subs {
        let values = _mm256_loadu_si256(w.w.as_ptr().add(s * BLOCK).cast());
        let magnitude = _mm256_loadu_si256(w.magnitude.as_ptr().add(s * BLOCK).cast());
        let scales = _mm256_loadu_si256(w.scales.as_ptr().add(s * 16).cast());
        let factor = *w.factor.get_unchecked(s);
        macro_rules! row {
            ($lanes:ident, $t:literal) => {
                let q = _mm256_loadu_si256(a[$t].q.as_ptr().add(s * BLOCK).cast());
                let pairs = if w.has_minimum {
                    _mm256_maddubs_epi16(magnitude, q)
                } else {
                    _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(q, values))
                };
                let sums = _mm256_madd_epi16(pairs, scales);
                let both = _mm256_set1_ps(factor * *a[$t].scale.get_unchecked(s));
                $lanes = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), both, $lanes);
                if w.has_minimum {
                    minimums[$t] +=
                        *w.minimum.get_unchecked(s) * *a[$t].scaled_sum.get_unchecked(s);
                }
            };
        }
        row!(l0, 0);
        row!(l1, 1);
        row!(l2, 2);
        row!(l3, 3);
    }
    for (t, lanes) in [l0, l1, l2, l3].into_iter().enumerate() {
        out[t] = hsum(lanes) + minimums[t];
    }
}
