//! The column layout's product ([`super::columns`]) on x86-64: AVX-512 VNNI's `vpdpbusd` on
//! 256-bit registers (four unsigned weights by four signed activations added into each output's
//! 32-bit sum, one instruction), or AVX2's `vpmaddubsw`/`vpmaddwd` where there is no VNNI. Both
//! compute each block's integer sums exactly and then the portable definition's f32 operations
//! in its order.

use super::columns::{group_block_bytes, offset, values_bytes, GroupTile, COLUMNS};
use super::{BlockFormat, BLOCK};
use std::arch::x86_64::*;

/// Rows one call multiplies: each row keeps an i32 and an f32 register, so AVX2's sixteen
/// registers hold four rows and AVX-512's thirty-two hold eight (each block's weights are then
/// loaded and unpacked once per eight rows: on a Zen 4, a batch-32 run took ~4% less CPU time
/// than with four).
pub(super) const fn tile_rows(vnni: bool) -> usize {
    if vnni {
        8
    } else {
        4
    }
}

/// Runs the kernel for `format` on the tile's `rows` rows (1..=[`tile_rows`]).
///
/// # Safety
/// As [`super::columns::group`]; with `vnni`, the CPU has AVX-512 VNNI and VL, else AVX2; both
/// need FMA and F16C.
pub(super) unsafe fn group(format: BlockFormat, t: &GroupTile, rows: usize, vnni: bool) {
    macro_rules! rows {
        ($f:literal) => {
            match (rows, vnni) {
                (8, true) => group_vnni::<$f, 8>(t),
                (7, true) => group_vnni::<$f, 7>(t),
                (6, true) => group_vnni::<$f, 6>(t),
                (5, true) => group_vnni::<$f, 5>(t),
                (4, true) => group_vnni::<$f, 4>(t),
                (3, true) => group_vnni::<$f, 3>(t),
                (2, true) => group_vnni::<$f, 2>(t),
                (_, true) => group_vnni::<$f, 1>(t),
                (4, false) => group_avx2::<$f, 4>(t),
                (3, false) => group_avx2::<$f, 3>(t),
                (2, false) => group_avx2::<$f, 2>(t),
                (_, false) => group_avx2::<$f, 1>(t),
            }
        };
    }
    match format {
        BlockFormat::Q4_0 => rows!(0),
        BlockFormat::Q4_1 => rows!(1),
        BlockFormat::Q8_0 => rows!(4),
        other => unreachable!("{other:?} is not laid out in columns"),
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn group_avx2<const F: usize, const R: usize>(t: &GroupTile) {
    body::<F, R, false>(t)
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn group_vnni<const F: usize, const R: usize>(t: &GroupTile) {
    body::<F, R, true>(t)
}

/// The kernel for `BlockFormat::ALL[F]` and `R` rows, inlined into each instruction set's
/// wrapper.
#[inline(always)]
unsafe fn body<const F: usize, const R: usize, const VNNI: bool>(t: &GroupTile) {
    let format = BlockFormat::ALL[F];
    let (values, group) = (values_bytes(format), group_block_bytes(format));
    let minimum = format == BlockFormat::Q4_1;
    // AVX2 multiplies Q8_0's values signed (`sums_q8`), so only VNNI's sums carry its offset.
    let offset = match format {
        BlockFormat::Q8_0 if !VNNI => 0,
        _ => offset(format),
    };
    let stride = t.blocks * BLOCK;
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..t.blocks {
        let w = t.weights.add(b * group);
        // Four activations of row `r` from input `i`, in every 32-bit lane.
        let a = |r: usize, i: usize| {
            _mm256_set1_epi32(std::ptr::read_unaligned(
                t.q.add(r * stride + b * BLOCK + i).cast::<i32>(),
            ))
        };
        let sums = if format == BlockFormat::Q8_0 {
            sums_q8::<R, VNNI>(w, a)
        } else {
            sums_q4::<R, VNNI>(w, a)
        };
        let d = _mm256_cvtph_ps(_mm_loadu_si128(w.add(values).cast()));
        let m = _mm256_cvtph_ps(_mm_loadu_si128(w.add(values + 16).cast()));
        for r in 0..R {
            let mut s = sums[r];
            if offset != 0 {
                let row_sum = *t.sums.add(r * t.blocks + b);
                s = _mm256_sub_epi32(s, _mm256_set1_epi32(offset * row_sum));
            }
            let [scale, scaled_sum] = *t.scales.add(r * t.blocks + b);
            let both = _mm256_mul_ps(d, _mm256_set1_ps(scale));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), both, acc[r]);
            if minimum {
                acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(scaled_sum), acc[r]);
            }
        }
    }
    store::<R>(t, &acc);
}

/// A Q4 block's integer sums: four 32-byte runs, each two runs of nibbles.
#[inline(always)]
unsafe fn sums_q4<const R: usize, const VNNI: bool>(
    w: *const u8,
    a: impl Fn(usize, usize) -> __m256i,
) -> [__m256i; R] {
    let low = _mm256_set1_epi8(0x0F);
    let mut sums = [_mm256_setzero_si256(); R];
    // AVX2: 16-bit pair sums, at most 8 × 2 × 15 × 127 = 30,480 in magnitude, widened once.
    let mut pairs = [_mm256_setzero_si256(); R];
    for h in 0..4 {
        let v = _mm256_loadu_si256(w.add(32 * h).cast());
        let lo = _mm256_and_si256(v, low);
        let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for r in 0..R {
            if VNNI {
                sums[r] = _mm256_dpbusd_epi32(sums[r], lo, a(r, 4 * h));
                sums[r] = _mm256_dpbusd_epi32(sums[r], hi, a(r, 16 + 4 * h));
            } else {
                pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(lo, a(r, 4 * h)));
                pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(hi, a(r, 16 + 4 * h)));
            }
        }
    }
    if !VNNI {
        let ones = _mm256_set1_epi16(1);
        for r in 0..R {
            sums[r] = _mm256_madd_epi16(pairs[r], ones);
        }
    }
    sums
}

/// A Q8_0 block's integer sums: eight runs of offset bytes. AVX2 multiplies the signed values
/// (magnitudes by signed activations: each pair at most 2 × 128 × 127, no saturation).
#[inline(always)]
unsafe fn sums_q8<const R: usize, const VNNI: bool>(
    w: *const u8,
    a: impl Fn(usize, usize) -> __m256i,
) -> [__m256i; R] {
    let (flip, ones) = (_mm256_set1_epi8(-128), _mm256_set1_epi16(1));
    let mut sums = [_mm256_setzero_si256(); R];
    for h in 0..8 {
        let v = _mm256_loadu_si256(w.add(32 * h).cast());
        if VNNI {
            for (r, sum) in sums.iter_mut().enumerate() {
                *sum = _mm256_dpbusd_epi32(*sum, v, a(r, 4 * h));
            }
        } else {
            let signed = _mm256_xor_si256(v, flip);
            let magnitude = _mm256_abs_epi8(signed);
            for (r, sum) in sums.iter_mut().enumerate() {
                let pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(a(r, 4 * h), signed));
                *sum = _mm256_add_epi32(*sum, _mm256_madd_epi16(pairs, ones));
            }
        }
    }
    sums
}

/// Adds the bias and stores the group's outputs that exist.
#[inline(always)]
unsafe fn store<const R: usize>(t: &GroupTile, acc: &[__m256; R]) {
    for (r, &v) in acc.iter().enumerate() {
        let out = t.out.add(r * t.n);
        if t.cols == COLUMNS {
            let v = match t.bias {
                Some(b) => _mm256_add_ps(v, _mm256_loadu_ps(b)),
                None => v,
            };
            _mm256_storeu_ps(out, v);
        } else {
            let mut lanes = [0f32; COLUMNS];
            _mm256_storeu_ps(lanes.as_mut_ptr(), v);
            for (c, &v) in lanes.iter().enumerate().take(t.cols) {
                *out.add(c) = t.bias.map_or(v, |b| v + *b.add(c));
            }
        }
    }
}
