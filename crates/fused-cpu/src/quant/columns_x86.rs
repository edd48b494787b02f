//! The column layout's product ([`super::columns`]) on x86-64: AVX-512 VNNI's `vpdpbusd` on
//! 256-bit registers (four unsigned weights by four signed activations added into each output's
//! 32-bit sum, one instruction), or AVX2's `vpmaddubsw`/`vpmaddwd` where there is no VNNI. Both
//! compute each sub-block's integer sums exactly and then the portable definition's f32
//! operations in its order.

use super::columns::{
    group_block_bytes, high_bits, offset, sub_bytes, subs, values_bytes, GroupTile, COLUMNS,
    K_SCALES, MINIMUMS, Q6K_SCALES,
};
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
/// As [`super::columns::group`]; with `vnni`, the CPU has AVX-512 VNNI, BW and VL, else AVX2;
/// both need FMA and F16C.
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
    // `BlockFormat::ALL`'s order.
    match format {
        BlockFormat::Q4_0 => rows!(0),
        BlockFormat::Q4_1 => rows!(1),
        BlockFormat::Q5_0 => rows!(2),
        BlockFormat::Q5_1 => rows!(3),
        BlockFormat::Q8_0 => rows!(4),
        BlockFormat::Q4K => rows!(5),
        BlockFormat::Q5K => rows!(6),
        BlockFormat::Q6K => rows!(7),
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn group_avx2<const F: usize, const R: usize>(t: &GroupTile) {
    body::<F, R, false>(t)
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn group_vnni<const F: usize, const R: usize>(t: &GroupTile) {
    body::<F, R, true>(t)
}

/// Eight f16 at `at` as f32.
#[inline(always)]
unsafe fn f16s(at: *const u8) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(at.cast()))
}

/// Eight bytes at `at` as f32 (unsigned) or i32 (signed).
#[inline(always)]
unsafe fn bytes_f32(at: *const u8) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(at.cast())))
}

#[inline(always)]
unsafe fn bytes_i32(at: *const u8) -> __m256i {
    _mm256_cvtepi8_epi32(_mm_loadl_epi64(at.cast()))
}

/// The kernel for `BlockFormat::ALL[F]` and `R` rows, inlined into each instruction set's
/// wrapper.
#[inline(always)]
unsafe fn body<const F: usize, const R: usize, const VNNI: bool>(t: &GroupTile) {
    let format = BlockFormat::ALL[F];
    let (subs, group, values) = (
        subs(format),
        group_block_bytes(format),
        values_bytes(format),
    );
    let k_format = matches!(format, BlockFormat::Q4K | BlockFormat::Q5K);
    // AVX2 multiplies Q8_0's values signed (`sums_q8`), so only VNNI's sums carry its offset.
    let offset = match format {
        BlockFormat::Q8_0 if !VNNI => 0,
        BlockFormat::Q6K => 0,
        _ => offset(format),
    };
    let stride = t.blocks * BLOCK;
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..t.blocks / subs {
        let w = t.weights.add(b * group);
        let head = w.add(values);
        let d = f16s(head);
        let m = if format.has_minimum() {
            f16s(head.add(MINIMUMS))
        } else {
            _mm256_setzero_ps()
        };
        for s in 0..subs {
            let ab = b * subs + s;
            // Four activations of row `r` from input `i`, in every 32-bit lane.
            let a = |r: usize, i: usize| {
                _mm256_set1_epi32(std::ptr::read_unaligned(
                    t.q.add(r * stride + ab * BLOCK + i).cast::<i32>(),
                ))
            };
            let v = w.add(s * sub_bytes(format));
            let sums = match format {
                BlockFormat::Q8_0 => [sums_q8::<R, VNNI>(v, a), [_mm256_setzero_si256(); R]],
                BlockFormat::Q6K => sums_nibbles::<R, VNNI, 2>(v, a),
                _ if high_bits(format) == 1 => sums_nibbles::<R, VNNI, 1>(v, a),
                _ => sums_nibbles::<R, VNNI, 0>(v, a),
            };
            // Per sub-block and output: Q4_K/Q5_K's `d · scale` and `dmin · minimum`; Q6_K's
            // two scales.
            let (factor, minimum) = if k_format {
                let scales = head.add(K_SCALES + 8 * s);
                (
                    _mm256_mul_ps(d, bytes_f32(scales)),
                    _mm256_mul_ps(m, bytes_f32(scales.add(64))),
                )
            } else {
                (d, m)
            };
            let q6k_scales = head.add(Q6K_SCALES + 16 * s);
            for r in 0..R {
                let at = r * t.blocks + ab;
                let [scale, scaled_sum] = *t.scales.add(at);
                let sum = if format == BlockFormat::Q6K {
                    let (total, first) = (*t.sums.add(at), *t.halves.add(at));
                    let low = _mm256_sub_epi32(sums[0][r], _mm256_set1_epi32(32 * first));
                    let high =
                        _mm256_sub_epi32(sums[1][r], _mm256_set1_epi32(32 * (total - first)));
                    _mm256_add_epi32(
                        _mm256_mullo_epi32(low, bytes_i32(q6k_scales)),
                        _mm256_mullo_epi32(high, bytes_i32(q6k_scales.add(8))),
                    )
                } else if offset != 0 {
                    let row_sum = *t.sums.add(at);
                    _mm256_sub_epi32(sums[0][r], _mm256_set1_epi32(offset * row_sum))
                } else {
                    sums[0][r]
                };
                let both = _mm256_mul_ps(factor, _mm256_set1_ps(scale));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), both, acc[r]);
                if k_format {
                    acc[r] = _mm256_fnmadd_ps(minimum, _mm256_set1_ps(scaled_sum), acc[r]);
                } else if format.has_minimum() {
                    acc[r] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(scaled_sum), acc[r]);
                }
            }
        }
    }
    store::<R>(t, &acc);
}

/// Byte `p` of the result is 16 where bit `p` of `word` is set, else 0 (Q5's fifth bits).
#[inline(always)]
unsafe fn fifth_bits<const VNNI: bool>(word: u32) -> __m256i {
    let sixteen = _mm256_set1_epi8(0x10);
    if VNNI {
        return _mm256_maskz_mov_epi8(word, sixteen);
    }
    // Each byte takes the word's byte holding its bit, then tests that bit.
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(word as i32),
        _mm256_setr_epi64x(
            0,
            0x0101_0101_0101_0101,
            0x0202_0202_0202_0202,
            0x0303_0303_0303_0303,
        ),
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201_u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    _mm256_and_si256(set, sixteen)
}

/// A nibble format's sub-block integer sums: four 32-byte runs, each two runs of nibbles (with
/// `HIGH` bits more from their planes). Q6_K's (HIGH 2) are kept per side (inputs 0–15 and
/// 16–31, each with its own scale); the others' sides are summed together.
#[inline(always)]
unsafe fn sums_nibbles<const R: usize, const VNNI: bool, const HIGH: u32>(
    v: *const u8,
    a: impl Fn(usize, usize) -> __m256i,
) -> [[__m256i; R]; 2] {
    let (low, ones) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi16(1));
    let split = HIGH == 2;
    let mut sums = [[_mm256_setzero_si256(); R]; 2];
    // AVX2: 16-bit pair sums of at most 2 · 127 · (2^(4 + HIGH) - 1) each, widened before
    // they can pass 32,767: Q4 after eight (30,480), Q5 after four (31,496), Q6 at once.
    let mut pairs = [_mm256_setzero_si256(); R];
    let planes = if HIGH == 2 {
        [
            _mm256_loadu_si256(v.add(128).cast()),
            _mm256_loadu_si256(v.add(160).cast()),
        ]
    } else {
        [_mm256_setzero_si256(); 2]
    };
    for h in 0..4 {
        let bytes = _mm256_loadu_si256(v.add(32 * h).cast());
        let mut side = [
            _mm256_and_si256(bytes, low),
            _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low),
        ];
        for (s, side) in side.iter_mut().enumerate() {
            let more = match HIGH {
                1 => fifth_bits::<VNNI>(std::ptr::read_unaligned(
                    v.add(128 + 4 * (2 * h + s)).cast::<u32>(),
                )),
                2 => {
                    // Bits 2h… of each byte moved to bits 4–5.
                    let p = planes[s];
                    let moved = match h {
                        0 => _mm256_slli_epi16(p, 4),
                        1 => _mm256_slli_epi16(p, 2),
                        2 => p,
                        _ => _mm256_srli_epi16(p, 2),
                    };
                    _mm256_and_si256(moved, _mm256_set1_epi8(0x30))
                }
                _ => continue,
            };
            *side = _mm256_or_si256(*side, more);
        }
        for r in 0..R {
            for (s, &side) in side.iter().enumerate() {
                let into = if split { s } else { 0 };
                let act = a(r, 16 * s + 4 * h);
                if VNNI {
                    sums[into][r] = _mm256_dpbusd_epi32(sums[into][r], side, act);
                } else if split {
                    let products = _mm256_madd_epi16(_mm256_maddubs_epi16(side, act), ones);
                    sums[into][r] = _mm256_add_epi32(sums[into][r], products);
                } else {
                    pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(side, act));
                }
            }
        }
        let widen = if HIGH == 1 { h % 2 == 1 } else { h == 3 };
        if !VNNI && !split && widen {
            for r in 0..R {
                sums[0][r] = _mm256_add_epi32(sums[0][r], _mm256_madd_epi16(pairs[r], ones));
                pairs[r] = _mm256_setzero_si256();
            }
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
