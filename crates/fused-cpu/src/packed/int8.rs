//! The dense layers in int8: the quantisation every int8 kernel shares, and the AVX-512 VNNI
//! kernel, where `vpdpbusd` multiplies 64 pairs of bytes (unsigned by signed) and adds each
//! group of four products into 16 i32 sums: four times the multiply-adds per instruction of an
//! f32 FMA, at the same rate. The other instruction sets' kernels ([`Dot`]) read the same
//! packed lanes: [`super::int8_x86`] (AVX-VNNI, AVX2) and [`super::int8_arm`] (`sdot`).
//!
//! How it stays close to f32 (each step measured on all-MiniLM-L6-v2 over real text: with
//! none of them, int8 vectors fall to a cosine of 0.99 of f32's; see docs/performance.md):
//!
//! - **groups along the inputs**: weights and activations carry one scale per [`GROUP`]
//!   inputs, not one per row, so an outlier costs precision only in its own group. The kernel
//!   sums each group in i32 and adds it to f32 sums scaled by the row's and the column's
//!   scales for that group.
//! - **activations asymmetric**: each row's group maps its own `[min, max]` (with 0) onto
//!   0..255 with a zero point, which the unsigned side of `vpdpbusd` takes as is; a GELU
//!   output, nearly all positive, keeps all 256 levels. The zero point's share of each sum
//!   (zero point × the column's weight sum) is taken off in f32.
//! - **weights symmetric** per (output column, group), quantised once at load.
//! - **smoothing** (SmoothQuant): inputs whose range, recorded over calibration texts, dwarfs
//!   their weights' are divided down and their weights multiplied up by the same factor
//!   ([`smoothing`]), which leaves the product unchanged.
//!
//! Bias, attention, softmax, layer norm, GELU and the residual stream stay f32. Whether a
//! model's vectors survive this is checked at load, on probe texts against f32.

#[cfg(target_arch = "x86_64")]
use super::Tile;
use super::PANEL;

/// The integer dot-product instructions an int8 product runs on: every kernel reads the same
/// packed lanes (four bytes of one column per 32-bit lane), so this chooses only the kernel,
/// the activations' range ([`Dot::levels`]) and how rows are converted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dot {
    /// `vpdpbusd` on 512-bit registers (Intel since Cascade Lake, AMD since Zen 4).
    Avx512Vnni,
    /// `vpdpbusd` on 256-bit registers, for CPUs with AVX-VNNI but no AVX-512 (Intel's hybrid
    /// cores from Alder Lake on).
    AvxVnni,
    /// `vpmaddubsw` then `vpmaddwd` on plain AVX2 (AMD's Zen 2 and 3, Intel's Haswell to Ice
    /// Lake client): two instructions per four products, and the first adds pairs of products
    /// into 16 bits with saturation, so activations take 0..=127 ([`Dot::levels`]) to keep
    /// every pair (at most 2 × 127 × 127) from saturating. (Halving the activations' levels
    /// rather than the weights' keeps all-MiniLM-L6-v2's vectors closer to f32; the model still
    /// keeps its feed-forward output in f32 on this kernel's CPUs: see `Layer::formats`.)
    Avx2,
    /// `sdot` on Arm (Armv8.2 dotprod: Neoverse N1 and later, Graviton 2+, Ampere): signed by
    /// signed, so a row's unsigned bytes are stored less 128 and the zero point moved to match.
    Sdot,
}

impl Dot {
    /// The fastest this CPU runs, within AVX2 when `avx2_only` (what a CPU without AVX-512 or
    /// AVX-VNNI runs); `None` where it has none of them.
    pub(crate) fn best(avx2_only: bool) -> Option<Self> {
        [Self::Avx512Vnni, Self::AvxVnni, Self::Avx2, Self::Sdot]
            .into_iter()
            .filter(|d| !avx2_only || matches!(d, Self::Avx2 | Self::Sdot))
            .find(|d| d.supported())
    }

    /// Whether this CPU has this kernel's instructions, checked at run time.
    pub(crate) fn supported(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            match self {
                Self::Avx512Vnni => has!("avx512f") && has!("avx512bw") && has!("avx512vnni"),
                Self::AvxVnni => has!("avx2") && has!("fma") && has!("avxvnni"),
                Self::Avx2 => has!("avx2") && has!("fma"),
                Self::Sdot => false,
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            self == Self::Sdot && std::arch::is_aarch64_feature_detected!("dotprod")
        }
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        {
            false
        }
    }

    /// The largest value a quantised activation takes (from 0).
    pub(crate) fn levels(self) -> f32 {
        match self {
            Self::Avx2 => 127.0,
            _ => 255.0,
        }
    }

    /// The instructions' name, for logs and benchmarks.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Avx512Vnni => "AVX-512 VNNI",
            Self::AvxVnni => "AVX-VNNI",
            Self::Avx2 => "AVX2 (vpmaddubsw; feed-forward output f32)",
            Self::Sdot => "NEON dotprod (sdot)",
        }
    }
}

/// Inputs that share one scale (and, for activations, one zero point): 16 lanes of four.
pub(crate) const GROUP: usize = 64;
/// Lanes per group.
pub(crate) const GROUP_STEPS: usize = GROUP / 4;

/// How far smoothing moves an input channel's range into its weights: SmoothQuant's α
/// (0: none, 1: all), the balance its authors found for BERT-like encoders, and the best of
/// 0.3, 0.5 and 0.7 on all-MiniLM-L6-v2.
const SMOOTHING: f32 = 0.5;

/// Groups in `k` inputs (the last may be short).
pub(crate) fn groups(k: usize) -> usize {
    k.div_ceil(GROUP)
}

/// The factors that smooth each input of a weight matrix `w` (`(n, k)`) whose inputs were seen
/// to reach `ranges` (largest magnitude per input, over calibration texts): input `j`'s is
/// `ranges[j]^α / max|w[:, j]|^(1-α)`, which brings the channel's largest input and largest
/// weight towards the same size (SmoothQuant, Xiao et al. 2023). 1 where either is zero.
pub(crate) fn smoothing(w: &[f32], k: usize, ranges: &[f32]) -> Vec<f32> {
    let mut wmax = vec![0f32; k];
    for col in w.chunks_exact(k) {
        for (m, v) in wmax.iter_mut().zip(col) {
            *m = m.max(v.abs());
        }
    }
    ranges
        .iter()
        .zip(&wmax)
        .map(|(&x, &w)| match x > 0.0 && w > 0.0 && x.is_finite() {
            true => x.powf(SMOOTHING) / w.powf(1.0 - SMOOTHING),
            false => 1.0,
        })
        .collect()
}

/// `w` (`(n, k)`) quantised per (column, group), symmetric, the group's largest magnitude at
/// 127: the values (row-major as `w`), and per column and group the scale and the scale × the
/// sum of the column's quantised values (what a zero point of 1 adds), both laid out
/// `[panel][group][lane]` for `padded` columns (1 and 0 beyond `n`).
pub(crate) fn quantise_columns(
    w: &[f32],
    k: usize,
    padded: usize,
) -> (Vec<i8>, Vec<f32>, Vec<f32>) {
    let groups = groups(k);
    let at = |col: usize, g: usize| (col / PANEL * groups + g) * PANEL + col % PANEL;
    let mut scales = vec![1.0f32; padded * groups];
    let mut sums = vec![0.0f32; padded * groups];
    let mut q = vec![0i8; w.len()];
    for (c, (col, q)) in w.chunks_exact(k).zip(q.chunks_exact_mut(k)).enumerate() {
        for (g, (part, q)) in col.chunks(GROUP).zip(q.chunks_mut(GROUP)).enumerate() {
            let amax = part.iter().fold(0f32, |a, v| a.max(v.abs()));
            if amax > 0.0 && amax.is_finite() {
                let inv = 127.0 / amax;
                for (q, v) in q.iter_mut().zip(part) {
                    *q = (v * inv).round_ties_even().clamp(-127.0, 127.0) as i8;
                }
                scales[at(c, g)] = amax / 127.0;
                sums[at(c, g)] = amax / 127.0 * q.iter().map(|&q| f32::from(q)).sum::<f32>();
            }
        }
    }
    (q, scales, sums)
}

/// Floats of quantisation parameters per row of `k` inputs: per group its scale and its scale ×
/// zero point.
pub(crate) fn row_params(k: usize) -> usize {
    2 * groups(k)
}

/// `row` quantised group by group into bytes, four per lane (the tail padded with the zero
/// point), and each group's `(scale, scale × zero point)` into `params`, for `dot`'s kernel
/// (for `sdot`, signed: each byte less 128 and the zero point with it). A row holding a NaN or
/// an infinity gets NaN parameters, so its sums are not finite either.
pub(crate) fn convert(row: &[f32], dst: &mut [u32], params: &mut [f32], dot: Dot) {
    let bytes = bytemuck_bytes(dst);
    for (g, (part, out)) in row.chunks(GROUP).zip(bytes.chunks_mut(GROUP)).enumerate() {
        let (scale, zero) = quantise_group(part, out, dot);
        params[2 * g] = scale;
        params[2 * g + 1] = match dot {
            Dot::Sdot => {
                out.iter_mut().for_each(|b| *b ^= 0x80);
                scale * (zero - 128.0)
            }
            _ => scale * zero,
        };
    }
}

/// One group of a row onto 0..=[`Dot::levels`] (see [`range`]); returns its scale and zero
/// point.
fn quantise_group(part: &[f32], out: &mut [u8], dot: Dot) -> (f32, f32) {
    #[cfg(target_arch = "x86_64")]
    if part.len() == GROUP {
        match dot {
            // SAFETY: the kernel runs, so the CPU has its instructions; both slices hold a
            // whole group.
            Dot::Avx512Vnni => return unsafe { quantise_group_wide(part, out) },
            // SAFETY: as above (both 256-bit kernels need AVX2 and FMA).
            Dot::AvxVnni | Dot::Avx2 => {
                return unsafe { quantise_group_avx2(part, out, dot.levels()) }
            }
            Dot::Sdot => {}
        }
    }
    let levels = dot.levels();
    let (scale, zero) = range(part.iter().copied(), levels);
    let inv = 1.0 / scale;
    for (o, v) in out
        .iter_mut()
        .zip(part.iter().chain(std::iter::repeat(&0.0)))
    {
        *o = ((v * inv).round_ties_even() + zero).clamp(0.0, levels) as u8;
    }
    (scale, zero)
}

/// A lane buffer as its bytes (little-endian: a lane's first input in its low byte).
fn bytemuck_bytes(dst: &mut [u32]) -> &mut [u8] {
    // SAFETY: u32 has no padding and u8 no alignment: the same memory, four bytes per lane.
    unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast(), dst.len() * 4) }
}

/// A group's scale and zero point: `[min, max]` stretched to hold 0, onto 0..=`levels`. NaN for a
/// group with a NaN or an infinity; scale 1, zero 0 for a group of zeros.
fn range(values: impl Iterator<Item = f32> + Clone, levels: f32) -> (f32, f32) {
    if !values.clone().all(f32::is_finite) {
        return (f32::NAN, f32::NAN);
    }
    let (lo, hi) = values.fold((0f32, 0f32), |(lo, hi), v| (lo.min(v), hi.max(v)));
    scale_and_zero(lo, hi, levels)
}

/// The scale and zero point mapping `[lo, hi]` (`lo ≤ 0 ≤ hi`) onto 0..=`levels`.
fn scale_and_zero(lo: f32, hi: f32, levels: f32) -> (f32, f32) {
    if hi - lo > 0.0 {
        let scale = (hi - lo) / levels;
        (scale, (-lo / scale).round_ties_even())
    } else {
        (1.0, 0.0)
    }
}

/// [`convert`] for one whole group on AVX-512: its range, then its 64 bytes. Returns the
/// group's scale and zero point.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn quantise_group_wide(part: &[f32], out: &mut [u8]) -> (f32, f32) {
    use std::arch::x86_64::*;
    assert!(
        part.len() == GROUP && out.len() >= GROUP,
        "quantise: group of {}",
        part.len()
    );
    let v: [__m512; 4] = std::array::from_fn(|i| _mm512_loadu_ps(part.as_ptr().add(16 * i)));
    let (mut lo, mut hi, mut bad) = (
        _mm512_setzero_ps(),
        _mm512_setzero_ps(),
        _mm512_setzero_ps(),
    );
    for v in v {
        lo = _mm512_min_ps(lo, v);
        hi = _mm512_max_ps(hi, v);
        // v - v is 0 for every finite v and NaN for a NaN or an infinity.
        bad = _mm512_add_ps(bad, _mm512_sub_ps(v, v));
    }
    if _mm512_reduce_add_ps(bad) != 0.0 {
        out[..GROUP].fill(0);
        return (f32::NAN, f32::NAN);
    }
    let (scale, zero) = scale_and_zero(_mm512_reduce_min_ps(lo), _mm512_reduce_max_ps(hi), 255.0);
    let (inv, z) = (_mm512_set1_ps(1.0 / scale), _mm512_set1_ps(zero));
    let (min, max) = (_mm512_setzero_ps(), _mm512_set1_ps(255.0));
    for (i, v) in v.into_iter().enumerate() {
        // Rounded to nearest even (the CPU's default), as the scalar path rounds.
        let q = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(v, inv),
        );
        let q = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(q, z), min), max);
        let b = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(q));
        _mm_storeu_si128(out.as_mut_ptr().add(16 * i).cast(), b);
    }
    (scale, zero)
}

/// [`quantise_group`] for one whole group on AVX2, as [`quantise_group_wide`] does it on
/// AVX-512 (the scalar loop took half of the AVX2 int8 encoder's time: its NaN-aware minimum
/// and maximum do not vectorise).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantise_group_avx2(part: &[f32], out: &mut [u8], levels: f32) -> (f32, f32) {
    use std::arch::x86_64::*;
    assert!(
        part.len() == GROUP && out.len() >= GROUP,
        "quantise: group of {}",
        part.len()
    );
    let v: [__m256; 8] = std::array::from_fn(|i| _mm256_loadu_ps(part.as_ptr().add(8 * i)));
    let (mut lo, mut hi, mut bad) = (
        _mm256_setzero_ps(),
        _mm256_setzero_ps(),
        _mm256_setzero_ps(),
    );
    for v in v {
        lo = _mm256_min_ps(lo, v);
        hi = _mm256_max_ps(hi, v);
        // v - v is 0 for every finite v and NaN for a NaN or an infinity.
        bad = _mm256_add_ps(bad, _mm256_sub_ps(v, v));
    }
    let lanes = |x: __m256| -> [f32; 8] { std::mem::transmute(x) };
    if lanes(bad).iter().any(|b| *b != 0.0) {
        out[..GROUP].fill(0);
        return (f32::NAN, f32::NAN);
    }
    let lo = lanes(lo).into_iter().fold(0f32, f32::min);
    let hi = lanes(hi).into_iter().fold(0f32, f32::max);
    let (scale, zero) = scale_and_zero(lo, hi, levels);
    let (inv, z) = (_mm256_set1_ps(1.0 / scale), _mm256_set1_ps(zero));
    let (min, max) = (_mm256_setzero_ps(), _mm256_set1_ps(levels));
    let mut q = [0i32; GROUP];
    for (i, v) in v.into_iter().enumerate() {
        // Rounded to nearest even, as the scalar path rounds.
        let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(v, inv),
        );
        let r = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(r, z), min), max);
        _mm256_storeu_si256(q.as_mut_ptr().add(8 * i).cast(), _mm256_cvtps_epi32(r));
    }
    for (o, q) in out.iter_mut().zip(q) {
        *o = q as u8;
    }
    (scale, zero)
}

/// Per group: R × P registers of i32 sums over its lanes, then added to R × P f32 sums, scaled
/// by the row's and the column's scales, less the zero point's share; then bias and store.
///
/// # Safety
/// [`Dot::Avx512Vnni`] is supported, and the tile's pointers cover its `R` rows (with their
/// parameters), its steps and its `P` panels (with their column scales and sums).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(crate) unsafe fn kernel<const R: usize, const P: usize>(t: &Tile) {
    use std::arch::x86_64::*;
    let groups = t.steps.div_ceil(GROUP_STEPS);
    let stride = t.steps * PANEL;
    let mut sums = [[_mm512_setzero_ps(); P]; R];
    for g in 0..groups {
        let mut acc = [[_mm512_setzero_si512(); P]; R];
        for s in g * GROUP_STEPS..t.steps.min((g + 1) * GROUP_STEPS) {
            let mut w = [_mm512_setzero_si512(); P];
            for (j, w) in w.iter_mut().enumerate() {
                *w = _mm512_loadu_si512(t.weights.add(j * stride + s * PANEL).cast());
            }
            for (i, acc) in acc.iter_mut().enumerate() {
                let a = _mm512_set1_epi32(*t.rows.add(i * t.steps + s) as i32);
                for (acc, w) in acc.iter_mut().zip(&w) {
                    *acc = _mm512_dpbusd_epi32(*acc, a, *w);
                }
            }
        }
        for j in 0..P {
            let at = (j * groups + g) * PANEL;
            let (scale, share) = (
                _mm512_loadu_ps(t.col_scales.add(at)),
                _mm512_loadu_ps(t.col_sums.add(at)),
            );
            for i in 0..R {
                let row = t.row_params.add(i * t.params_per_row + 2 * g);
                let both = _mm512_mul_ps(scale, _mm512_set1_ps(*row));
                let sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][j]), both, sums[i][j]);
                sums[i][j] = _mm512_fnmadd_ps(_mm512_set1_ps(*row.add(1)), share, sum);
            }
        }
    }
    super::store::sums(t, &sums);
}
