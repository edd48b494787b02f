//! The column layout's product ([`super::columns`]) on Arm with the dotprod extension (Armv8.2+:
//! Neoverse N1/V1/N2/V2, Graviton 2 to 4, Ampere Altra, Axion): `sdot` multiplies four weights by
//! four activations into each output's 32-bit sum, four outputs a register, so a 32-byte run of
//! the layout is two `sdot`s. The stored values of the nibble formats (0–63) are signed bytes as
//! they are; Q8_0's are flipped back to signed, so its sums carry no offset (as in AVX2's
//! register kernel). Then the portable definition's f32 operations in its order (`fmla`, `fmls`:
//! fused), so it agrees with [`super::columns::group`] bit for bit.
//!
//! `sdot` is the encoder's ([`crate::packed::int8_arm::sdot`], inline assembly: its intrinsic is
//! unstable).

use super::columns::{
    group_block_bytes, high_bits, less_offset, offset, sub_bytes, values_bytes, GroupTile, COLUMNS,
    K_SCALES, MINIMUMS, Q6K_SCALES,
};
use super::{BlockFormat, BLOCK};
use crate::packed::int8_arm::sdot;
use std::arch::aarch64::*;

/// Rows one call multiplies: each row keeps two i32 and two f32 registers of eight outputs.
pub(super) const ROWS: usize = 4;

/// Eight outputs as two registers of four.
type Eight<T> = [T; 2];

/// Runs the kernel for `format` on the tile's `rows` rows (1..=[`ROWS`]).
///
/// # Safety
/// As [`super::columns::group`]; the CPU has NEON and dotprod.
pub(super) unsafe fn group(format: BlockFormat, t: &GroupTile, rows: usize) {
    match rows {
        4 => kernel::<4>(format, t),
        3 => kernel::<3>(format, t),
        2 => kernel::<2>(format, t),
        _ => kernel::<1>(format, t),
    }
}

#[target_feature(enable = "neon,dotprod")]
unsafe fn kernel<const R: usize>(format: BlockFormat, t: &GroupTile) {
    let acc = if format.is_k() {
        body_k::<R>(format, t)
    } else {
        body_32::<R>(format, t)
    };
    store::<R>(t, &acc);
}

/// Eight f16 at `at` as f32.
#[inline(always)]
unsafe fn f16s(at: *const u8) -> Eight<float32x4_t> {
    let v: [f32; 8] = std::array::from_fn(|c| {
        half::f16::from_le_bytes([*at.add(2 * c), *at.add(2 * c + 1)]).to_f32()
    });
    [vld1q_f32(v.as_ptr()), vld1q_f32(v.as_ptr().add(4))]
}

/// Eight bytes at `at` as i32, unsigned or signed.
#[inline(always)]
unsafe fn bytes_i32(at: *const u8, signed: bool) -> Eight<int32x4_t> {
    let v = vld1_u8(at);
    let wide = if signed {
        vmovl_s8(vreinterpret_s8_u8(v))
    } else {
        vreinterpretq_s16_u16(vmovl_u8(v))
    };
    [
        vmovl_s16(vget_low_s16(wide)),
        vmovl_s16(vget_high_s16(wide)),
    ]
}

/// Four activations of row `r` from input `i` of activation block `ab`, in every 32-bit lane.
#[inline(always)]
unsafe fn activations(t: &GroupTile, ab: usize) -> impl Fn(usize, usize) -> int8x16_t + '_ {
    let stride = t.blocks * BLOCK;
    move |r, i| {
        let four = std::ptr::read_unaligned(t.q.add(r * stride + ab * BLOCK + i).cast::<i32>());
        vreinterpretq_s8_s32(vdupq_n_s32(four))
    }
}

/// The 32-weight formats: [`super::columns::add_block`].
#[inline(always)]
unsafe fn body_32<const R: usize>(format: BlockFormat, t: &GroupTile) -> [Eight<float32x4_t>; R] {
    let (group, values) = (group_block_bytes(format), values_bytes(format));
    // Q8_0's values are multiplied signed, so its sums carry no offset.
    let offset = if format == BlockFormat::Q8_0 {
        0
    } else {
        offset(format)
    };
    let mut acc = [[vdupq_n_f32(0.0); 2]; R];
    for b in 0..t.blocks {
        let (w, a) = (t.weights.add(b * group), activations(t, b));
        let sums = if format == BlockFormat::Q8_0 {
            sums_q8::<R>(w, a)
        } else {
            sums_nibbles::<R>(w, a, high_bits(format), None)
        };
        let d = f16s(w.add(values));
        let m = if format.has_minimum() {
            f16s(w.add(values + MINIMUMS))
        } else {
            [vdupq_n_f32(0.0); 2]
        };
        for (r, acc) in acc.iter_mut().enumerate() {
            let a = t.row_block(r, b);
            // What the offset takes off the sums, as computed when the activations were rounded.
            let less = match offset {
                0 => vdupq_n_s32(0),
                _ => vdupq_n_s32(-t.less_offset(r, b, less_offset(format))),
            };
            for half in 0..2 {
                let sum = vcvtq_f32_s32(vsubq_s32(sums[r][half], less));
                acc[half] = vfmaq_f32(acc[half], sum, vmulq_n_f32(d[half], a.scale));
            }
            if format.has_minimum() {
                for half in 0..2 {
                    acc[half] = vfmaq_f32(acc[half], m[half], vdupq_n_f32(a.scaled_sum));
                }
            }
        }
    }
    acc
}

/// The K formats: [`super::columns::add_k_block`], each row's integer totals kept per block.
#[inline(always)]
unsafe fn body_k<const R: usize>(format: BlockFormat, t: &GroupTile) -> [Eight<float32x4_t>; R] {
    let (group, values) = (group_block_bytes(format), values_bytes(format));
    let q6k = format == BlockFormat::Q6K;
    let mut acc = [[vdupq_n_f32(0.0); 2]; R];
    for b in 0..t.blocks / 8 {
        let w = t.weights.add(b * group);
        let head = w.add(values);
        let (mut total, mut minimums) = ([[vdupq_n_s32(0); 2]; R], [[vdupq_n_s32(0); 2]; R]);
        for s in 0..8 {
            let (ab, v) = (b * 8 + s, w.add(s * sub_bytes(format)));
            if q6k {
                for side in 0..2 {
                    let sums = sums_nibbles::<R>(v, activations(t, ab), 2, Some(side));
                    let scales = bytes_i32(head.add(Q6K_SCALES + 16 * s + 8 * side), true);
                    let at = less_offset(format) + side;
                    for (r, total) in total.iter_mut().enumerate() {
                        let less = -t.less_offset(r, ab, at);
                        for half in 0..2 {
                            let sum = vsubq_s32(sums[r][half], vdupq_n_s32(less));
                            total[half] = vmlaq_s32(total[half], sum, scales[half]);
                        }
                    }
                }
            } else {
                let sums = sums_nibbles::<R>(v, activations(t, ab), high_bits(format), None);
                let scales = bytes_i32(head.add(K_SCALES + 8 * s), false);
                let mins = bytes_i32(head.add(K_SCALES + 64 + 8 * s), false);
                for r in 0..R {
                    let count = t.row_block(r, ab).sum;
                    for half in 0..2 {
                        total[r][half] = vmlaq_s32(total[r][half], sums[r][half], scales[half]);
                        minimums[r][half] = vmlaq_n_s32(minimums[r][half], mins[half], count);
                    }
                }
            }
        }
        let (d, dmin) = (f16s(head), f16s(head.add(MINIMUMS)));
        for (r, acc) in acc.iter_mut().enumerate() {
            let scale = t.row_block(r, b * 8).scale;
            for half in 0..2 {
                let both = vmulq_n_f32(d[half], scale);
                acc[half] = vfmaq_f32(acc[half], vcvtq_f32_s32(total[r][half]), both);
                if !q6k {
                    let both = vmulq_n_f32(dmin[half], scale);
                    acc[half] = vfmsq_f32(acc[half], vcvtq_f32_s32(minimums[r][half]), both);
                }
            }
        }
    }
    acc
}

/// Byte `p` of the result is 16 where bit `p` of `word` is set, else 0 (Q5's fifth bits).
#[inline(always)]
unsafe fn fifth_bits(word: u32) -> [uint8x16_t; 2] {
    const SPREAD: [[u8; 16]; 2] = [
        [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1],
        [2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3],
    ];
    const BITS: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];
    let bytes = vreinterpretq_u8_u32(vdupq_n_u32(word));
    SPREAD.map(|spread| {
        let spread = vqtbl1q_u8(bytes, vld1q_u8(spread.as_ptr()));
        vandq_u8(vtstq_u8(spread, vld1q_u8(BITS.as_ptr())), vdupq_n_u8(0x10))
    })
}

/// A nibble format's sub-block integer sums per row, outputs 0–3 and 4–7: four 32-byte runs of
/// two nibbles (with `high` bits more from their planes: Q5's fifth-bit words, Q6_K's two-bit
/// runs); both sides summed, or only `side` (Q6_K, whose halves have their own scales).
#[inline(always)]
unsafe fn sums_nibbles<const R: usize>(
    v: *const u8,
    a: impl Fn(usize, usize) -> int8x16_t,
    high: u32,
    only: Option<usize>,
) -> [Eight<int32x4_t>; R] {
    let low = vdupq_n_u8(0x0F);
    let mut sums = [[vdupq_n_s32(0); 2]; R];
    for h in 0..4 {
        for side in 0..2 {
            if only.is_some_and(|only| only != side) {
                continue;
            }
            let values: [uint8x16_t; 2] = std::array::from_fn(|half| {
                let bytes = vld1q_u8(v.add(32 * h + 16 * half));
                let nibbles = match side {
                    0 => vandq_u8(bytes, low),
                    _ => vshrq_n_u8(bytes, 4),
                };
                let more = match high {
                    2 => {
                        // Bits 2h… of the side's plane moved to bits 4–5.
                        let plane = vld1q_u8(v.add(128 + 32 * side + 16 * half));
                        let moved = match h {
                            0 => vshlq_n_u8(plane, 4),
                            1 => vshlq_n_u8(plane, 2),
                            2 => plane,
                            _ => vshrq_n_u8(plane, 2),
                        };
                        vandq_u8(moved, vdupq_n_u8(0x30))
                    }
                    _ => vdupq_n_u8(0),
                };
                vorrq_u8(nibbles, more)
            });
            let values = if high == 1 {
                let word = std::ptr::read_unaligned(v.add(128 + 4 * (2 * h + side)).cast::<u32>());
                let fifth = fifth_bits(word);
                [vorrq_u8(values[0], fifth[0]), vorrq_u8(values[1], fifth[1])]
            } else {
                values
            };
            for (r, sums) in sums.iter_mut().enumerate() {
                let act = a(r, 16 * side + 4 * h);
                for half in 0..2 {
                    sums[half] = sdot(sums[half], vreinterpretq_s8_u8(values[half]), act);
                }
            }
        }
    }
    sums
}

/// A Q8_0 block's integer sums: eight runs of offset bytes, flipped back to signed.
#[inline(always)]
unsafe fn sums_q8<const R: usize>(
    w: *const u8,
    a: impl Fn(usize, usize) -> int8x16_t,
) -> [Eight<int32x4_t>; R] {
    let flip = vdupq_n_u8(0x80);
    let mut sums = [[vdupq_n_s32(0); 2]; R];
    for h in 0..8 {
        let values: [int8x16_t; 2] = std::array::from_fn(|half| {
            vreinterpretq_s8_u8(veorq_u8(vld1q_u8(w.add(32 * h + 16 * half)), flip))
        });
        for (r, sums) in sums.iter_mut().enumerate() {
            let act = a(r, 4 * h);
            for half in 0..2 {
                sums[half] = sdot(sums[half], values[half], act);
            }
        }
    }
    sums
}

/// Adds the bias and stores the group's outputs that exist.
#[inline(always)]
unsafe fn store<const R: usize>(t: &GroupTile, acc: &[Eight<float32x4_t>; R]) {
    for (r, acc) in acc.iter().enumerate() {
        let mut lanes = [0f32; COLUMNS];
        vst1q_f32(lanes.as_mut_ptr(), acc[0]);
        vst1q_f32(lanes.as_mut_ptr().add(4), acc[1]);
        let out = t.out.add(r * t.n);
        for (c, &v) in lanes.iter().enumerate().take(t.cols) {
            *out.add(c) = t.bias.map_or(v, |b| v + *b.add(c));
        }
    }
}
