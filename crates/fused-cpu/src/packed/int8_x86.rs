//! int8 on 256-bit registers, for x86-64 CPUs without AVX-512 VNNI: AVX-VNNI's `vpdpbusd` where
//! the CPU has it, else plain AVX2's `vpmaddubsw` (bytes into pairs of 16-bit sums) then
//! `vpmaddwd` (pairs into 32-bit sums). Both read the packed lanes of [`super::int8`] as two
//! registers per panel step, and scale each group's i32 sums into f32 sums as the AVX-512
//! kernel does, so the three give the same sums from the same quantised values.

use super::int8::GROUP_STEPS;
use super::{store, Tile, PANEL};
use std::arch::x86_64::*;

/// One kernel per instruction set, from one body: the body's intrinsics inline only into a
/// function compiled with their target features, so each kernel is its own such function.
macro_rules! kernel_256 {
    ($(#[$doc:meta])* $name:ident, $features:literal, $dot:expr) => {
        $(#[$doc])*
        #[target_feature(enable = $features)]
        pub(crate) unsafe fn $name<const R: usize, const P: usize>(t: &Tile) {
            let groups = t.steps.div_ceil(GROUP_STEPS);
            let stride = t.steps * PANEL;
            let mut sums = [[[_mm256_setzero_ps(); 2]; P]; R];
            for g in 0..groups {
                let mut acc = [[[_mm256_setzero_si256(); 2]; P]; R];
                for s in g * GROUP_STEPS..t.steps.min((g + 1) * GROUP_STEPS) {
                    let mut w = [[_mm256_setzero_si256(); 2]; P];
                    for (j, w) in w.iter_mut().enumerate() {
                        let at = t.weights.add(j * stride + s * PANEL);
                        *w = [_mm256_loadu_si256(at.cast()), _mm256_loadu_si256(at.add(8).cast())];
                    }
                    for (i, acc) in acc.iter_mut().enumerate() {
                        let a = _mm256_set1_epi32(*t.rows.add(i * t.steps + s) as i32);
                        // Indexed, not iterated: constant bounds that LLVM unrolls, keeping every
                        // sum in a register (flattened iterators kept them on the stack).
                        for j in 0..P {
                            for h in 0..2 {
                                acc[j][h] = $dot(acc[j][h], a, w[j][h]);
                            }
                        }
                    }
                }
                for j in 0..P {
                    for h in 0..2 {
                        let at = (j * groups + g) * PANEL + 8 * h;
                        let scale = _mm256_loadu_ps(t.col_scales.add(at));
                        let share = _mm256_loadu_ps(t.col_sums.add(at));
                        for i in 0..R {
                            let row = t.row_params.add(i * t.params_per_row + 2 * g);
                            let both = _mm256_mul_ps(scale, _mm256_set1_ps(*row));
                            let products = _mm256_cvtepi32_ps(acc[i][j][h]);
                            let sum = _mm256_fmadd_ps(products, both, sums[i][j][h]);
                            let zero = _mm256_set1_ps(*row.add(1));
                            sums[i][j][h] = _mm256_fnmadd_ps(zero, share, sum);
                        }
                    }
                }
            }
            let mut out = [[[0f32; PANEL]; P]; R];
            for (o, s) in out.iter_mut().flatten().zip(sums.iter().flatten()) {
                _mm256_storeu_ps(o.as_mut_ptr(), s[0]);
                _mm256_storeu_ps(o.as_mut_ptr().add(8), s[1]);
            }
            store::lanes(t, &out);
        }
    };
}

kernel_256!(
    /// AVX-VNNI: R × 2P registers of i32 sums per group, `vpdpbusd` on each.
    ///
    /// # Safety
    /// [`super::int8::Dot::AvxVnni`] is supported, and the tile's pointers cover its `R` rows
    /// (with their parameters), its steps and its `P` panels (with their column scales and
    /// sums).
    kernel_vnni,
    "avx2,fma,avxvnni",
    dot_vnni
);

kernel_256!(
    /// Plain AVX2: as [`kernel_vnni`], two instructions per four products (the activations'
    /// 0..=127 range keeps the 16-bit pair sums from saturating).
    ///
    /// # Safety
    /// [`super::int8::Dot::Avx2`] is supported; the tile as for [`kernel_vnni`].
    kernel_avx2,
    "avx2,fma",
    dot_avx2
);

/// `acc` plus, per 32-bit lane, the four products of `a`'s unsigned bytes by `w`'s signed ones.
#[target_feature(enable = "avx2,avxvnni")]
#[inline]
unsafe fn dot_vnni(acc: __m256i, a: __m256i, w: __m256i) -> __m256i {
    _mm256_dpbusd_avx_epi32(acc, a, w)
}

/// As [`dot_vnni`] in two steps: pairs of products into 16-bit sums (which saturate past
/// ±32767: the activations' range keeps them below), then pairs of those into 32-bit sums.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn dot_avx2(acc: __m256i, a: __m256i, w: __m256i) -> __m256i {
    let pairs = _mm256_maddubs_epi16(a, w);
    _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
}
