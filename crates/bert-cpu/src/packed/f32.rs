//! The exact dense layers on AVX-512 F: 16 f32 multiply-adds per FMA, twice the `gemm` crate's
//! 256-bit kernels on a core with two 512-bit FMA units (see the module above for why ours).

use super::Tile;

/// Whether this CPU runs the AVX-512 f32 kernel, checked at run time.
pub(crate) fn supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `row` as lanes (its bits, as is).
pub(crate) fn convert(row: &[f32], dst: &mut [u32]) {
    for (d, v) in dst.iter_mut().zip(row) {
        *d = v.to_bits();
    }
}

/// R × P registers of sums over every input, each row's input broadcast against the P panels'
/// registers; then bias and store.
///
/// # Safety
/// [`supported`], and the tile's pointers cover its `R` rows, its steps and its `P` panels.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn kernel<const R: usize, const P: usize>(t: &Tile) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); P]; R];
    let stride = t.steps * super::PANEL;
    for s in 0..t.steps {
        let mut w = [_mm512_setzero_ps(); P];
        for (j, w) in w.iter_mut().enumerate() {
            *w = _mm512_loadu_ps(t.weights.add(j * stride + s * super::PANEL).cast());
        }
        for (i, acc) in acc.iter_mut().enumerate() {
            let a = _mm512_set1_ps(f32::from_bits(*t.rows.add(i * t.steps + s)));
            for (acc, w) in acc.iter_mut().zip(&w) {
                *acc = _mm512_fmadd_ps(a, *w, *acc);
            }
        }
    }
    super::store::sums(t, &acc);
}
