//! int8 on Arm with the dotprod extension (Armv8.2+: Neoverse N1/V1/N2/V2, Graviton 2 to 4,
//! Ampere Altra): `sdot` multiplies 16 pairs of signed bytes and adds each group of four into
//! 4 i32 sums. It reads the packed lanes of [`super::int8`] as four registers per panel step;
//! the rows' bytes were stored less 128 and their zero points moved to match
//! ([`super::int8::convert`]), so the f32 sums come out as on x86-64.
//!
//! `sdot` is written as inline assembly: its intrinsic (`vdotq_s32`) is still unstable in Rust,
//! while `asm!` and the `dotprod` target feature are stable.

use super::int8::GROUP_STEPS;
use super::{store, Tile, PANEL};
use std::arch::aarch64::*;

/// `acc + Σ a·w` per 32-bit lane, four byte products each (the GGUF block products' too).
#[inline(always)]
pub(crate) unsafe fn sdot(mut acc: int32x4_t, w: int8x16_t, a: int8x16_t) -> int32x4_t {
    std::arch::asm!(
        "sdot {acc:v}.4s, {w:v}.16b, {a:v}.16b",
        acc = inout(vreg) acc,
        w = in(vreg) w,
        a = in(vreg) a,
        options(pure, nomem, nostack, preserves_flags)
    );
    acc
}

/// Per group: R × 4P registers of i32 sums, then scaled into f32 sums less the zero point's
/// share, as [`super::int8::kernel`] does; then bias and store.
///
/// # Safety
/// [`super::int8::Dot::Sdot`] is supported, and the tile's pointers cover its `R` rows (with
/// their parameters), its steps and its `P` panels (with their column scales and sums).
#[target_feature(enable = "neon,dotprod")]
pub(crate) unsafe fn kernel<const R: usize, const P: usize>(t: &Tile) {
    let groups = t.steps.div_ceil(GROUP_STEPS);
    let stride = t.steps * PANEL;
    let mut sums = [[[vdupq_n_f32(0.0); 4]; P]; R];
    for g in 0..groups {
        let mut acc = [[[vdupq_n_s32(0); 4]; P]; R];
        for s in g * GROUP_STEPS..t.steps.min((g + 1) * GROUP_STEPS) {
            let mut w = [[vdupq_n_s8(0); 4]; P];
            for (j, w) in w.iter_mut().enumerate() {
                let at = t.weights.add(j * stride + s * PANEL);
                for (q, w) in w.iter_mut().enumerate() {
                    *w = vld1q_s8(at.add(4 * q).cast());
                }
            }
            for (i, acc) in acc.iter_mut().enumerate() {
                let a = vreinterpretq_s8_u32(vdupq_n_u32(*t.rows.add(i * t.steps + s)));
                // Indexed, not iterated: constant bounds that LLVM unrolls, keeping every sum
                // in a register.
                for j in 0..P {
                    for q in 0..4 {
                        acc[j][q] = sdot(acc[j][q], w[j][q], a);
                    }
                }
            }
        }
        for j in 0..P {
            for q in 0..4 {
                let at = (j * groups + g) * PANEL + 4 * q;
                let scale = vld1q_f32(t.col_scales.add(at));
                let share = vld1q_f32(t.col_sums.add(at));
                for i in 0..R {
                    let row = t.row_params.add(i * t.params_per_row + 2 * g);
                    let both = vmulq_n_f32(scale, *row);
                    let sum = vfmaq_f32(sums[i][j][q], vcvtq_f32_s32(acc[i][j][q]), both);
                    sums[i][j][q] = vfmsq_f32(sum, share, vdupq_n_f32(*row.add(1)));
                }
            }
        }
    }
    let mut out = [[[0f32; PANEL]; P]; R];
    for (o, s) in out.iter_mut().flatten().zip(sums.iter().flatten()) {
        for (q, v) in s.iter().enumerate() {
            vst1q_f32(o.as_mut_ptr().add(4 * q), *v);
        }
    }
    store::lanes(t, &out);
}
