//! The exact dense layers on AVX-512 F (16 f32 multiply-adds per FMA, twice the `gemm` crate's
//! 256-bit kernels on a core with two 512-bit FMA units; see the module above for why ours)
//! and on AVX2/FMA (the same tile on 256-bit registers, for CPUs without AVX-512).

#[cfg(target_arch = "x86_64")]
use super::Tile;

/// The registers an f32 product runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fma {
    /// 512-bit, AVX-512 F.
    Avx512,
    /// 256-bit, AVX2 and FMA (AMD's Zen 2 and 3, Intel before Skylake-SP).
    Avx2,
}

impl Fma {
    /// The widest this CPU runs, within AVX2 when `avx2_only`; `None` off x86-64 (where the
    /// `gemm` crate's kernels run).
    pub(crate) fn best(avx2_only: bool) -> Option<Self> {
        [Self::Avx512, Self::Avx2]
            .into_iter()
            .filter(|f| !avx2_only || *f == Self::Avx2)
            .find(|f| f.supported())
    }

    /// Whether this CPU has these instructions, checked at run time.
    pub(crate) fn supported(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            match self {
                Self::Avx512 => has!("avx512f"),
                Self::Avx2 => has!("avx2") && has!("fma"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = self;
            false
        }
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
/// [`Fma::Avx512`] is supported, and the tile's pointers cover its `R` rows, its steps and its
/// `P` panels.
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

/// As [`kernel`] on 256-bit registers: R × 2P registers of sums (a panel's step is two), then
/// bias and store.
///
/// # Safety
/// [`Fma::Avx2`] is supported, and the tile's pointers cover its `R` rows, its steps and its `P`
/// panels.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn kernel_avx2<const R: usize, const P: usize>(t: &Tile) {
    use std::arch::x86_64::*;
    let mut acc = [[[_mm256_setzero_ps(); 2]; P]; R];
    let stride = t.steps * super::PANEL;
    for s in 0..t.steps {
        let mut w = [[_mm256_setzero_ps(); 2]; P];
        for (j, w) in w.iter_mut().enumerate() {
            let at = t.weights.add(j * stride + s * super::PANEL).cast::<f32>();
            *w = [_mm256_loadu_ps(at), _mm256_loadu_ps(at.add(8))];
        }
        for (i, acc) in acc.iter_mut().enumerate() {
            let a = _mm256_set1_ps(f32::from_bits(*t.rows.add(i * t.steps + s)));
            // Indexed: constant bounds LLVM unrolls, every sum kept in a register.
            for j in 0..P {
                for h in 0..2 {
                    acc[j][h] = _mm256_fmadd_ps(a, w[j][h], acc[j][h]);
                }
            }
        }
    }
    let mut out = [[[0f32; super::PANEL]; P]; R];
    for i in 0..R {
        for j in 0..P {
            _mm256_storeu_ps(out[i][j].as_mut_ptr(), acc[i][j][0]);
            _mm256_storeu_ps(out[i][j].as_mut_ptr().add(8), acc[i][j][1]);
        }
    }
    super::store::lanes(t, &out);
}
