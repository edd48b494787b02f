//! The encoder's passes between (and around) the matrix products: the row-blocked linear layer,
//! residual add + layer norm, softmax, bias + GELU, and the exp/erf they use (attention, which
//! picks its products by the dense layers' format, is `crate::attention`).
//!
//! Each wide kernel is compiled three times by the `multiversion` attribute, the portable build,
//! one for AVX2 and FMA and one for AVX-512, and the widest the CPU has is picked at run time:
//! the kernels are plain loops written so the compiler vectorises them, which gives them 8- or
//! 16-wide registers without raising the binary's minimum CPU. (AVX-512 bought 1.08× on the
//! whole bf16 encoder on a Zen 4 VM, which splits 512-bit operations in two: fewer instructions.) Helpers they call must be `#[inline(always)]` to be compiled
//! wide too.

use gemm::Parallelism;
use multiversion::multiversion;
use rayon::prelude::*;

/// The first `len` elements of `buf`, growing it if needed (never shrinking, so a buffer is
/// allocated once per high-water mark rather than once per layer).
pub(crate) fn grow(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if buf.len() < len {
        buf.resize(len, 0.0);
    }
    &mut buf[..len]
}

/// `out = x · wᵀ (+ b)`, with `x` of `(rows, k)`, `w` PyTorch's `(n, k)`, `out` of `(rows, n)`.
///
/// The rows are split into blocks ([`block_rows`]), each a single-threaded product: on two
/// cores this beats the product's own threading, which synchronises its threads inside every
/// call.
///
/// Panics unless the shapes agree: the product below writes through raw pointers, so these
/// checks are what keeps it inside the slices, in release builds too.
pub(crate) fn linear(x: &[f32], k: usize, w: &[f32], b: Option<&[f32]>, out: &mut [f32]) {
    assert!(
        k > 0 && x.len().is_multiple_of(k) && w.len().is_multiple_of(k),
        "linear: inner size {k}"
    );
    let n = w.len() / k;
    let m = x.len() / k;
    assert_eq!(out.len(), m * n, "linear: output of {m}x{n}");
    assert!(b.is_none_or(|b| b.len() == n), "linear: bias of {n}");
    let block = block_rows(m, n * k, 16, F32_BLOCK_ROWS);
    out.par_chunks_mut(block * n)
        .zip(x.par_chunks(block * k))
        .for_each(|(out, x)| linear_block(x, k, w, b, out));
}

/// The widest instructions the `gemm` crate picks at run time on this CPU, as it picks them
/// (stable Rust builds it without its AVX-512 kernels).
pub(crate) fn gemm_instructions() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            "AVX2/FMA (gemm crate)"
        } else {
            "SSE (gemm crate)"
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        "NEON (gemm crate)"
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        "scalar (gemm crate)"
    }
}

/// Most rows in one f32 block, as `MC` is for bf16: a large batch still cuts into blocks the
/// pool can share out. Not much smaller, since each block packs the weights once.
const F32_BLOCK_ROWS: usize = 256;

/// Blocks a thread takes of a product over the whole pool: enough that when another process
/// preempts one thread, the others take its remaining blocks instead of waiting at the end of
/// the product for it (with one block per thread, every interruption of one core left the other
/// idle: with another process taking a tenth of one core, the encoder lost 8% of its speed
/// alone with one block per thread and 5% with four).
const BLOCKS_PER_THREAD: usize = 4;

/// Least multiply-adds in one block (tens of microseconds on one core): below it, handing the
/// block to another thread costs more than it saves (a tiny model's products).
pub(crate) const MIN_BLOCK_MACS: usize = 1 << 20;

/// Rows per block for a product over `m` rows of `row_macs` multiply-adds each: about
/// [`BLOCKS_PER_THREAD`] blocks per pool thread but not less than [`MIN_BLOCK_MACS`] of work, a
/// multiple of `step` (the kernel's row tile, so only the last block has a tail), at least one
/// tile and at most `most` rows rounded down to whole tiles.
pub(crate) fn block_rows(m: usize, row_macs: usize, step: usize, most: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    let step = step.max(1);
    let most = (most / step).max(1) * step;
    let rows = m
        .div_ceil(threads * BLOCKS_PER_THREAD)
        .max(MIN_BLOCK_MACS.div_ceil(row_macs.max(1)));
    (rows.div_ceil(step) * step).clamp(step, most)
}

fn linear_block(x: &[f32], k: usize, w: &[f32], b: Option<&[f32]>, out: &mut [f32]) {
    let n = w.len() / k;
    let m = x.len() / k;
    if let Some(b) = b {
        out.chunks_exact_mut(n).for_each(|r| r.copy_from_slice(b));
    }
    // SAFETY: every pointer and stride describes a matrix inside its slice: x is (m, k)
    // row-major, w read as its transpose (k, n) with strides (1, k), out (m, n) row-major.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            b.is_some(),
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            1.0,
            1.0,
            false,
            false,
            false,
            Parallelism::None,
        );
    }
}

/// `x = layer_norm(x + add + bias)`, row by row: the residual connection, the bias of the
/// product `add`, and the layer norm in one pass.
pub(crate) fn add_layer_norm(
    x: &mut [f32],
    add: &[f32],
    bias: &[f32],
    w: &[f32],
    b: &[f32],
    eps: f32,
) {
    let h = bias.len();
    x.par_chunks_mut(h)
        .zip(add.par_chunks(h))
        .for_each(|(row, a)| add_layer_norm_row(row, a, bias, w, b, eps));
}

/// `row = layer_norm(row + add + bias)`.
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+avx2+fma", "x86_64+avx2+fma"))]
fn add_layer_norm_row(row: &mut [f32], add: &[f32], bias: &[f32], w: &[f32], b: &[f32], eps: f32) {
    for ((x, a), c) in row.iter_mut().zip(add).zip(bias) {
        *x += a + c;
    }
    layer_norm_row(row, w, b, eps);
}

/// Layer norm of one row in place.
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+avx2+fma", "x86_64+avx2+fma"))]
pub(crate) fn layer_norm(row: &mut [f32], w: &[f32], b: &[f32], eps: f32) {
    layer_norm_row(row, w, b, eps)
}

/// Layer norm of one row in place, as PyTorch computes it (biased variance, two passes).
#[inline(always)]
pub(crate) fn layer_norm_row(row: &mut [f32], w: &[f32], b: &[f32], eps: f32) {
    let n = row.len() as f32;
    let mean = lane_sum(row) / n;
    let mut acc = [0f32; 8];
    let chunks = row.chunks_exact(8);
    let mut tail = 0.0;
    for v in chunks.remainder() {
        tail += (v - mean) * (v - mean);
    }
    for c in chunks {
        for i in 0..8 {
            acc[i] += (c[i] - mean) * (c[i] - mean);
        }
    }
    let var = (acc.iter().sum::<f32>() + tail) / n;
    let inv = 1.0 / (var + eps).sqrt();
    for ((v, w), b) in row.iter_mut().zip(w).zip(b) {
        *v = (*v - mean) * inv * w + b;
    }
}

/// Softmax of one row in place.
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+avx2+fma", "x86_64+avx2+fma"))]
pub(crate) fn softmax(row: &mut [f32]) {
    softmax_row(row)
}

#[inline(always)]
pub(crate) fn softmax_row(row: &mut [f32]) {
    let mut acc = [f32::NEG_INFINITY; 8];
    let chunks = row.chunks_exact(8);
    let mut max = chunks
        .remainder()
        .iter()
        .copied()
        .fold(f32::NEG_INFINITY, f32::max);
    for c in chunks {
        for i in 0..8 {
            acc[i] = if c[i] > acc[i] { c[i] } else { acc[i] };
        }
    }
    for a in acc {
        max = max.max(a);
    }
    for v in row.iter_mut() {
        *v = exp(*v - max);
    }
    let inv = 1.0 / lane_sum(row);
    row.iter_mut().for_each(|v| *v *= inv);
}

/// Sum with eight independent accumulators, which the compiler keeps in one vector register.
#[inline(always)]
fn lane_sum(xs: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = xs.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for i in 0..8 {
            acc[i] += c[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Bias, then exact (erf) GELU in place, as BERT's `"gelu"` activation: `x/2 · (1 + erf(x/√2))`.
pub(crate) fn bias_gelu(xs: &mut [f32], bias: &[f32]) {
    xs.par_chunks_mut(bias.len() * 4).for_each(|rows| {
        rows.chunks_exact_mut(bias.len())
            .for_each(|row| bias_gelu_row(row, bias))
    });
}

/// GELU of one row plus its bias, in place.
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+avx2+fma", "x86_64+avx2+fma"))]
fn bias_gelu_row(xs: &mut [f32], bias: &[f32]) {
    for (v, b) in xs.iter_mut().zip(bias) {
        let x = *v + b;
        *v = 0.5 * x * (1.0 + erf(x * std::f32::consts::FRAC_1_SQRT_2));
    }
}

/// Exact (erf) GELU in place, as ViT's `"gelu"` (its product's bias is already added).
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+avx2+fma", "x86_64+avx2+fma"))]
pub(crate) fn gelu(xs: &mut [f32]) {
    for v in xs.iter_mut() {
        let x = *v;
        *v = 0.5 * x * (1.0 + erf(x * std::f32::consts::FRAC_1_SQRT_2));
    }
}

/// CLIP's quick GELU in place: `x · sigmoid(1.702 x)`.
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+avx2+fma", "x86_64+avx2+fma"))]
pub(crate) fn quick_gelu(xs: &mut [f32]) {
    for v in xs.iter_mut() {
        let x = *v;
        *v = x / (1.0 + exp(-1.702 * x));
    }
}

/// erf to within 1.5e-7 (Abramowitz & Stegun 7.1.26), branch-free so it vectorises.
#[inline(always)]
pub(crate) fn erf(x: f32) -> f32 {
    let a = x.abs();
    let t = 1.0 / (1.0 + 0.327_591_1 * a);
    let poly = ((((1.061_405_4 * t - 1.453_152_1) * t + 1.421_413_8) * t - 0.284_496_74) * t
        + 0.254_829_6)
        * t;
    let y = 1.0 - poly * exp(-a * a);
    y.copysign(x)
}

/// e^x to about 2 ulp for the range softmax and GELU use, branch-free so it vectorises
/// (Cephes' expf: range reduction by ln 2, degree-6 polynomial, exponent bits).
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    // NaN passes through the clamp and comes out NaN. No float-to-int conversion is used (the
    // unchecked one is undefined for NaN; the checked `as` does not vectorise): integers are made
    // with the 1.5 * 2^23 rounding trick and read back from the float's bits.
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to a whole number
    let x = x.clamp(-87.0, 88.0);
    let y = x * std::f32::consts::LOG2_E + 0.5;
    let t = (y + ROUND) - ROUND;
    let n = if t > y { t - 1.0 } else { t }; // floor(y)
    let r = x - n * 0.693_359_4 + n * 2.121_944_4e-4;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let e = p * r * r + r + 1.0;
    // n + 127 is a whole number in [1, 255]: 2^23 + it holds it in the low mantissa bits.
    let biased = ((n + 127.0 + 8_388_608.0).to_bits() & 0xff) << 23;
    e * f32::from_bits(biased)
}
