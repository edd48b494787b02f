//! The dense layers in bf16 with f32 sums, on AVX-512 BF16.
//!
//! `vdpbf16ps` multiplies 32 pairs of bf16 numbers and adds each pair's two products into 16
//! f32 sums: twice the multiply-adds per instruction of an f32 FMA. Whether that is twice the
//! rate depends on the core: Zen 4 issues it as fast as its (split) 512-bit FMAs, while Intel's
//! cores issue it at half their FMA rate, where it gains nothing over the f32 kernel. The
//! weights are rounded to bf16 once, at load; the activations per product. Everything else
//! (sums, bias, softmax, layer norm, GELU, pooling, the residual stream) stays f32, which is
//! what keeps the vectors within a cosine of 0.999 of the f32 encoder's.

#[cfg(target_arch = "x86_64")]
use super::Tile;

/// Whether this CPU runs the bf16 kernel (AVX-512 F, BW and BF16), checked at run time.
pub fn supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `row` rounded to bf16 (nearest even, as the weights), two per lane (the even input in the
/// low half), the odd tail padded with zero.
pub(crate) fn convert(row: &[f32], dst: &mut [u32]) {
    #[cfg(target_arch = "x86_64")]
    let done = if supported() {
        // SAFETY: the instructions were just checked; to_bf16_wide stays within row and dst.
        unsafe { to_bf16_wide(row, dst) }
    } else {
        0
    };
    #[cfg(not(target_arch = "x86_64"))]
    let done = 0;
    let bits = |i: usize| -> u32 {
        row.get(i)
            .map_or(0, |v| u32::from(half::bf16::from_f32(*v).to_bits()))
    };
    for (j, d) in dst.iter_mut().enumerate().skip(done / 2) {
        *d = bits(2 * j) | bits(2 * j + 1) << 16;
    }
}

/// The whole 32-input chunks of `row` rounded into `dst`; returns how many inputs it wrote.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn to_bf16_wide(row: &[f32], dst: &mut [u32]) -> usize {
    use std::arch::x86_64::*;
    let chunks = row.len() / 32;
    assert!(
        dst.len() * 2 >= chunks * 32,
        "to_bf16: row of {}",
        row.len()
    );
    for c in 0..chunks {
        let lo = _mm512_loadu_ps(row.as_ptr().add(c * 32));
        let hi = _mm512_loadu_ps(row.as_ptr().add(c * 32 + 16));
        let v: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
        _mm512_storeu_si512(dst.as_mut_ptr().add(c * 16).cast(), v);
    }
    chunks * 32
}

/// R × P registers of sums over every input pair; then bias and store.
///
/// # Safety
/// [`supported`], and the tile's pointers cover its `R` rows, its steps and its `P` panels.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(crate) unsafe fn kernel<const R: usize, const P: usize>(t: &Tile) {
    use super::PANEL;
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); P]; R];
    let stride = t.steps * PANEL;
    for s in 0..t.steps {
        let mut w = [_mm512_setzero_ps(); P];
        for (j, w) in w.iter_mut().enumerate() {
            *w = _mm512_loadu_ps(t.weights.add(j * stride + s * PANEL).cast());
        }
        for (i, acc) in acc.iter_mut().enumerate() {
            let a = _mm512_set1_epi32(*t.rows.add(i * t.steps + s) as i32);
            let a: __m512bh = std::mem::transmute(a);
            for (acc, w) in acc.iter_mut().zip(&w) {
                *acc = _mm512_dpbf16_ps(*acc, a, std::mem::transmute::<__m512, __m512bh>(*w));
            }
        }
    }
    super::store::sums(t, &acc);
}
