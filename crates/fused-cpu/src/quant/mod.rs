//! Dense layers kept in a GGUF file's own block formats (llama.cpp's Q4_0, Q4_1, Q5_0, Q5_1,
//! Q8_0, Q4_K, Q5_K and Q6_K), multiplied without widening the weights: a 4-bit file stays
//! 4-bit in memory, and a decoding step streams a seventh of the bytes f32 weights would.
//!
//! **The product**, as llama.cpp computes it: each activation row is rounded to 8 bits per block
//! of 32 (llama.cpp's Q8_0 and Q8_1 schemes: scale `max |x| / 127` kept as f16, round half to
//! even, the scaled sum kept as f16 for the formats with a minimum), and each 32-weight
//! sub-block's integer products are summed exactly in 32 bits before one f32 multiply-add per
//! sub-block. So for Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 weights each block's sum is llama.cpp's.
//! For the K formats in the column layout the activations are rounded per 256 as llama.cpp
//! rounds them for those (Q8_K: an f32 scale, no f16), so their integer sums are llama.cpp's
//! too; the row layout keeps them per 32 (finer; on SmolLM2 requantised to Q4_K_M either
//! rounding agreed with llama.cpp's greedy tokens at 1,223 of 1,280 positions).
//!
//! **Two layouts.** On x86-64 with AVX2 and on Arm with dotprod every matrix is rearranged at
//! load eight outputs side by side ([`columns`]) and multiplied so (AMX-INT8's tiles by 16
//! rows, AVX-512 VNNI on 512-bit registers on Intel's cores and 256-bit ones on AMD's, AVX2 or
//! `sdot`): each sub-block's integer sum is kept per output and scaled once per eight outputs.
//! Elsewhere (an Arm core without dotprod, such as Graviton 1's Cortex-A72) matrices stay in
//! GGUF's row layout, multiplied output by output by a portable kernel ([`unpack`]), since the
//! portable column product is the other kernels' reference, not built for speed. A matrix's
//! layout is fixed at load, so its products never change algorithm with the number of rows.
//!
//! **A row's sums never depend on its batch.** Every (row, output) sum is accumulated over the
//! blocks in order, by the same code whatever the number of rows or the split between threads
//! (in the row layout, in eight f32 lanes summed in one fixed order at the end; in columns, one
//! f32 sum per output); so a sequence computes the same logits alone, in any batch, prefilled
//! whole or in chunks, and resumed. The column layout's portable kernel ([`columns::group`]) is
//! its x86 and Arm kernels' algorithm lane for lane (integer sums, fused multiply-adds, the same
//! order), so it is their reference and they agree bit for bit: the products' sums are the same
//! on x86-64 and on Arm with dotprod. The row layout's sums differ from them in their last bits.
//!
//! Why not candle's quantised products (`QMatMul`): measured on an AVX2-only EPYC, its Q4_1
//! product was 1.5–4.2× slower than f32 (no AVX2 kernel), and its Q6_K takes another path for
//! one row than for several, so a sequence's logits would depend on its batch.

mod columns;
#[cfg(target_arch = "x86_64")]
mod columns_amx;
#[cfg(target_arch = "aarch64")]
mod columns_arm;
#[cfg(target_arch = "x86_64")]
mod columns_avx2_pair;
#[cfg(target_arch = "x86_64")]
mod columns_x86;
#[cfg(target_arch = "x86_64")]
mod columns_zmm;
mod unpack;

use crate::packed::OutPtr;
use crate::Widest;
use multiversion::multiversion;
use rayon::prelude::*;
use std::sync::Arc;

/// Weights per block of the activations and per sub-block of every format.
pub(crate) const BLOCK: usize = 32;

/// A GGUF block format the products read directly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockFormat {
    /// 32 weights: an f16 scale and 4-bit values less 8.
    Q4_0,
    /// 32 weights: f16 scale and minimum, 4-bit values.
    Q4_1,
    /// 32 weights: an f16 scale and 5-bit values less 16 (the fifth bits in a 32-bit word).
    Q5_0,
    /// 32 weights: f16 scale and minimum, 5-bit values.
    Q5_1,
    /// 32 weights: an f16 scale and 8-bit values.
    Q8_0,
    /// 256 weights: f16 scale and minimum, 6-bit scales and minimums per 32, 4-bit values.
    Q4K,
    /// 256 weights: as Q4_K with a fifth bit per value.
    Q5K,
    /// 256 weights: an f16 scale, 8-bit scales per 16, 6-bit values less 32.
    Q6K,
}

impl BlockFormat {
    /// Every format, for tests and error messages.
    pub const ALL: [Self; 8] = [
        Self::Q4_0,
        Self::Q4_1,
        Self::Q5_0,
        Self::Q5_1,
        Self::Q8_0,
        Self::Q4K,
        Self::Q5K,
        Self::Q6K,
    ];

    /// Weights per block.
    pub fn block_weights(self) -> usize {
        match self {
            Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q5_1 | Self::Q8_0 => 32,
            Self::Q4K | Self::Q5K | Self::Q6K => 256,
        }
    }

    /// Whether it is one of the 256-weight K formats, whose activations llama.cpp rounds per
    /// 256 (Q8_K).
    pub fn is_k(self) -> bool {
        self.block_weights() == 256
    }

    /// Whether its weights are an unsigned value times a scale plus a minimum (so its products
    /// carry the activations' sums).
    pub fn has_minimum(self) -> bool {
        matches!(self, Self::Q4_1 | Self::Q5_1 | Self::Q4K | Self::Q5K)
    }

    /// Bytes per block, as GGUF stores it.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q8_0 => 34,
            Self::Q4K => 144,
            Self::Q5K => 176,
            Self::Q6K => 210,
        }
    }

    /// The name llama.cpp gives it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q5_0 => "Q5_0",
            Self::Q5_1 => "Q5_1",
            Self::Q8_0 => "Q8_0",
            Self::Q4K => "Q4_K",
            Self::Q5K => "Q5_K",
            Self::Q6K => "Q6_K",
        }
    }
}

/// A weight matrix `(rows, k)` in one block format: each row its blocks in GGUF's byte layout,
/// or (where a kernel multiplies them so) rearranged eight rows side by side ([`columns`]).
#[derive(Debug, Clone)]
pub struct BlockMatrix {
    format: BlockFormat,
    rows: usize,
    k: usize,
    data: Vec<u8>,
    /// Whether `data` is in the column layout.
    columns: bool,
}

impl BlockMatrix {
    /// The matrix from GGUF's bytes, or why they are not one of `rows × k` in `format`.
    pub fn new(format: BlockFormat, rows: usize, k: usize, data: Vec<u8>) -> Result<Self, String> {
        let per = format.block_weights();
        if !k.is_multiple_of(per) {
            return Err(format!(
                "{k} inputs per row are not whole {} blocks",
                format.name()
            ));
        }
        if data.len() != rows * k / per * format.block_bytes() {
            return Err(format!(
                "{} bytes are not {rows} × {k} weights in {}",
                data.len(),
                format.name()
            ));
        }
        Ok(Self {
            format,
            rows,
            k,
            data,
            columns: false,
        })
    }

    /// The matrix laid out for `kernel`'s products: in columns where it has a column kernel
    /// (done once, at load, in place: the same bytes but for Q4_K's and Q5_K's scales), else as
    /// it is.
    pub(crate) fn laid_out_for(self, kernel: Kernel) -> Self {
        if kernel.has_columns() {
            self.in_columns()
        } else {
            self
        }
    }

    /// The matrix in the column layout (any kernel multiplies it: the portable one by the
    /// layout's definition).
    fn in_columns(self) -> Self {
        if self.columns {
            return self;
        }
        let Self {
            format, rows, k, ..
        } = self;
        Self {
            data: columns::interleave(format, rows, k, self.data),
            columns: true,
            ..self
        }
    }

    /// Its format.
    pub fn format(&self) -> BlockFormat {
        self.format
    }

    /// Rows (outputs).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Inputs per row.
    pub fn k(&self) -> usize {
        self.k
    }

    fn row_bytes(&self) -> usize {
        self.k / self.format.block_weights() * self.format.block_bytes()
    }

    /// Row `r`'s GGUF bytes (row layout only).
    fn row(&self, r: usize) -> &[u8] {
        let n = self.row_bytes();
        &self.data[r * n..][..n]
    }

    /// Row `r`'s GGUF bytes in either layout (copied into `buffer` from columns).
    fn gguf_row<'a>(&'a self, r: usize, buffer: &'a mut Vec<u8>) -> &'a [u8] {
        if !self.columns {
            return self.row(r);
        }
        columns::gguf_row(self.format, self.k, &self.data, r, buffer);
        buffer
    }

    /// The same matrix with its rows reordered: row `to(r)` of the result is row `r` of this
    /// one (in the row layout).
    pub fn permute_rows(&self, to: impl Fn(usize) -> usize) -> Self {
        let n = self.row_bytes();
        let mut data = vec![0u8; self.rows * n];
        let mut buffer = Vec::new();
        for r in 0..self.rows {
            data[to(r) * n..][..n].copy_from_slice(self.gguf_row(r, &mut buffer));
        }
        Self {
            data,
            columns: false,
            ..*self
        }
    }

    /// Row `r` widened to f32 into `out` (`k` values), with the arithmetic of llama.cpp's
    /// reference dequantisation (and candle's), so the f32 path reads the values they read.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let mut buffer = Vec::new();
        unpack::dequantize(self.format, self.gguf_row(r, &mut buffer), out);
    }

    /// `out = x · selfᵀ` for `x` rows of `k`, on the kernel and layout this CPU runs (returned
    /// by name), as the decoder computes its products: for checking them against another
    /// engine's on the same blocks (`examples/ggml_products.rs`, llama.cpp's ggml).
    pub fn product(&self, x: &[f32], out: &mut [f32]) -> &'static str {
        let prepared = self.clone().prepared(Widest::All);
        prepared.apply(x, out);
        prepared.kernels()
    }

    /// The matrix laid out once for this CPU's best kernel within `widest`, to
    /// be multiplied many times as the decoder multiplies it: for timing the products apart from
    /// the decoder (`examples/block_products.rs`).
    pub fn prepared(self, widest: Widest) -> PreparedProduct {
        let kernel = Kernel::within(widest);
        PreparedProduct {
            kernel,
            matrix: Arc::new(self.laid_out_for(kernel)),
        }
    }

    /// The whole matrix widened to f32, row-major.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.k];
        for (r, o) in out.chunks_exact_mut(self.k.max(1)).enumerate() {
            self.dequantize_row(r, o);
        }
        out
    }
}

/// A [`BlockMatrix`] laid out for one kernel ([`BlockMatrix::prepared`]).
pub struct PreparedProduct {
    kernel: Kernel,
    matrix: Arc<BlockMatrix>,
}

impl PreparedProduct {
    /// `out = x · matrixᵀ` for `x` rows of `k`, on the pool's threads, as the decoder computes
    /// its products.
    pub fn apply(&self, x: &[f32], out: &mut [f32]) {
        linear(
            self.kernel,
            x,
            std::slice::from_ref(&self.matrix),
            None,
            out,
        );
    }

    /// The kernel's instructions, by name.
    pub fn kernels(&self) -> &'static str {
        self.kernel.name()
    }
}

/// A tensor as a reader hands it to a network: f32 values, or a matrix left in its blocks.
#[derive(Debug, Clone)]
pub enum Weights {
    /// f32 values, row-major.
    F32(Vec<f32>),
    /// A matrix in a block format.
    Blocks(BlockMatrix),
}

impl Weights {
    /// Values held.
    pub fn len(&self) -> usize {
        match self {
            Self::F32(v) => v.len(),
            Self::Blocks(m) => m.rows * m.k,
        }
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values as f32 (blocks widened).
    pub fn into_f32(self) -> Vec<f32> {
        match self {
            Self::F32(v) => v,
            Self::Blocks(m) => m.dequantize(),
        }
    }
}

/// 1.5 · 2^23: added to and taken from an f32 below 2^22 in magnitude, rounds it to an integer,
/// half to even.
const ROUNDER: f32 = 12_582_912.0;

/// Activation rows rounded to 8 bits per block of 32 (or, for the K formats in columns, per 256):
/// values, and per block of 32 its scale and its scale times its values' sum (for the formats
/// with a minimum), side by side so a kernel loads both at once, and its integer sums. The
/// vectors may run past the `m` rows held: a product's rows reuse the buffers of one before
/// ([`SPARE_ROWS`]).
#[derive(Default)]
pub(crate) struct QuantRows {
    k: usize,
    m: usize,
    q: Vec<i8>,
    scales: Vec<[f32; 2]>,
    /// Per block, its values' integer sum (what an offset in the weights' values multiplies),
    /// and its first 16 values' (Q6_K's offset applies per 16).
    sums: Vec<i32>,
    halves: Vec<i32>,
    /// Per block, what the offsets of Q4_0's, Q5_0's and Q8_0's stored values take off its
    /// sums, and Q6_K's off each 16 values' ([`columns::offset`] times minus the sum), for a
    /// kernel to start its sums from with one load ([`columns::less_offset`] says which).
    less_offsets: Vec<[i32; 5]>,
    /// Each value plus 128, as an unsigned byte, where asked for ([`QuantRows::new`]): what
    /// AVX2's many-rows kernels multiply (`columns_avx2_pair`). Else empty.
    unsigned: Vec<u8>,
}

impl QuantRows {
    /// `x`, rows of `k`, rounded as llama.cpp rounds to Q8_0 (and Q8_1's sums); with
    /// `unsigned`, the values also as unsigned bytes.
    pub(crate) fn new(x: &[f32], k: usize, unsigned: bool) -> Self {
        Self::round_rows(x, k, unsigned, |mut row, x| {
            for (b, block) in x.chunks_exact(BLOCK).enumerate() {
                let d = round_32(block, &mut row.q[b * BLOCK..][..BLOCK]);
                let sum = row.put_sums(b);
                row.scales[b] = [
                    half::f16::from_f32(d).to_f32(),
                    half::f16::from_f32(d * sum as f32).to_f32(),
                ];
            }
        })
    }

    /// `x`, rows of `k` (whole 256s), rounded as llama.cpp rounds them for its K formats
    /// (`quantize_row_q8_K_ref`): per 256, the value of largest magnitude `max` gives `iscale =
    /// -127 / max`, each value is `iscale · x` rounded half to even (at most 127), and the scale
    /// is `1 / iscale` in f32. Each block of 32 keeps that scale (and no scaled sum) beside its
    /// integer sums, so the K formats' integer sums are llama.cpp's.
    pub(crate) fn per_256(x: &[f32], k: usize, unsigned: bool) -> Self {
        Self::round_rows(x, k, unsigned, |mut row, x| {
            for (b, block) in x.chunks_exact(256).enumerate() {
                let d = round_256(block, &mut row.q[b * 256..][..256]);
                for at in 8 * b..8 * b + 8 {
                    row.put_sums(at);
                    row.scales[at] = [d, 0.0];
                }
            }
        })
    }

    /// `x`'s rows of `k` rounded by `round` in parallel, a few rows a task, into this thread's
    /// spare buffers if it has some: before each product of a step, where the other threads
    /// would otherwise wait (on a Zen 4, at 32 rows on the Qwen shape, rounding took ~4% of a
    /// step's samples and zeroing fresh buffers for it ~2%, on one thread of two). Every value
    /// the `m` rows hold is written; with `unsigned`, each also plus 128 as an unsigned byte.
    fn round_rows(
        x: &[f32],
        k: usize,
        unsigned: bool,
        round: impl Fn(RowParts<'_>, &[f32]) + Sync,
    ) -> Self {
        let (values, blocks, row_blocks) = (x.len(), x.len() / BLOCK, k / BLOCK);
        let mut rows = SPARE_ROWS
            .with(|spare| spare.borrow_mut().pop())
            .unwrap_or_default();
        (rows.k, rows.m) = (k, values / k);
        at_least(&mut rows.q, values);
        at_least(&mut rows.scales, blocks);
        at_least(&mut rows.sums, blocks);
        at_least(&mut rows.halves, blocks);
        at_least(&mut rows.less_offsets, blocks);
        rows.unsigned.resize(if unsigned { values } else { 0 }, 0);
        let mut unsigned_rows = rows.unsigned.chunks_mut(k);
        let parts: Vec<(RowParts<'_>, &mut [u8])> = rows.q[..values]
            .chunks_mut(k)
            .zip(rows.scales[..blocks].chunks_mut(row_blocks))
            .zip(rows.sums[..blocks].chunks_mut(row_blocks))
            .zip(rows.halves[..blocks].chunks_mut(row_blocks))
            .zip(rows.less_offsets[..blocks].chunks_mut(row_blocks))
            .map(|((((q, scales), sums), halves), less_offsets)| {
                let unsigned = unsigned_rows.next().unwrap_or_default();
                let row = RowParts {
                    q,
                    scales,
                    sums,
                    halves,
                    less_offsets,
                };
                (row, unsigned)
            })
            .collect();
        parts
            .into_par_iter()
            .zip(x.par_chunks(k))
            .with_min_len(ROUND_VALUES.div_ceil(k))
            .for_each(|((mut row, unsigned), x)| {
                round(row.reborrow(), x);
                for (u, &q) in unsigned.iter_mut().zip(row.q.iter()) {
                    *u = q as u8 ^ 0x80;
                }
            });
        rows
    }

    /// Keeps these buffers for this thread's next product, if they are a decoding step's size
    /// (a prompt's, kept, would hold its memory through the rest of the job).
    fn recycle(self) {
        if self.q.len() <= SPARE_VALUES {
            SPARE_ROWS.with(|spare| {
                let mut spare = spare.borrow_mut();
                if spare.len() < 2 {
                    spare.push(self);
                }
            });
        }
    }

    fn row(&self, t: usize) -> ActivationRow<'_> {
        let blocks = self.k / BLOCK;
        ActivationRow {
            q: &self.q[t * self.k..][..self.k],
            scales: &self.scales[t * blocks..][..blocks],
        }
    }
}

/// Values a rounding task takes at least (a few rows): fewer left the task's overhead beside
/// its work.
const ROUND_VALUES: usize = 4096;

/// The most values a spare [`QuantRows`] holds: 64 rows of 4,096 (~0.5 MiB with their sums).
const SPARE_VALUES: usize = 1 << 18;

thread_local! {
    /// Each thread's buffers from its last products' roundings (one per 32, one per 256).
    static SPARE_ROWS: std::cell::RefCell<Vec<QuantRows>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `v` at least `len` long: a spare's values past its new rows are left as they are.
fn at_least<T: Copy + Default>(v: &mut Vec<T>, len: usize) {
    if v.len() < len {
        v.resize(len, T::default());
    }
}

/// One row's share of a [`QuantRows`], written by one task.
struct RowParts<'a> {
    q: &'a mut [i8],
    scales: &'a mut [[f32; 2]],
    sums: &'a mut [i32],
    halves: &'a mut [i32],
    less_offsets: &'a mut [[i32; 5]],
}

impl RowParts<'_> {
    /// The same parts, borrowed again (the rounding writes them, then their unsigned bytes are
    /// taken from `q`).
    fn reborrow(&mut self) -> RowParts<'_> {
        RowParts {
            q: self.q,
            scales: self.scales,
            sums: self.sums,
            halves: self.halves,
            less_offsets: self.less_offsets,
        }
    }

    /// Block `b`'s integer sums from its rounded values; returns the whole block's.
    fn put_sums(&mut self, b: usize) -> i32 {
        let (first, second) = half_sums(&self.q[b * BLOCK..][..BLOCK]);
        let sum = first + second;
        (self.sums[b], self.halves[b]) = (sum, first);
        let less = |format| -columns::offset(format);
        let mut offsets = [0; 5];
        for format in [BlockFormat::Q4_0, BlockFormat::Q5_0, BlockFormat::Q8_0] {
            offsets[columns::less_offset(format)] = less(format) * sum;
        }
        let q6k = columns::less_offset(BlockFormat::Q6K);
        offsets[q6k] = less(BlockFormat::Q6K) * first;
        offsets[q6k + 1] = less(BlockFormat::Q6K) * (sum - first);
        self.less_offsets[b] = offsets;
        sum
    }
}

/// The integer sums of a block's two halves of 16 rounded values. Compiled for AVX2 too: the
/// baseline build added them one at a time (1.3–2.5% of a step's samples on the Qwen shape at 32
/// rows, Zen 4); integer sums, so the same in any order.
#[multiversion(targets("x86_64+avx2+fma"))]
fn half_sums(q: &[i8]) -> (i32, i32) {
    let sum = |half: &[i8]| half.iter().map(|&q| i32::from(q)).sum::<i32>();
    (sum(&q[..16]), sum(&q[16..32]))
}

/// One block of 32 activations rounded as llama.cpp's AVX2 `quantize_row_q8_1` (and `_q8_0`)
/// rounds them, into `q`; returns the scale `max / 127` (kept as f16 by the caller): the values
/// rounded half to even from `x · 127 / max`. Compiled for AVX2 too (`multiversion`): the
/// baseline build converted the rounded values to bytes one at a time; the same bits either way.
#[multiversion(targets("x86_64+avx2+fma"))]
fn round_32(block: &[f32], q: &mut [i8]) -> f32 {
    let amax = largest_magnitude(block);
    let inverse = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    for (q, v) in q.iter_mut().zip(block) {
        // Half to even by adding and taking away 1.5 · 2^23 (exact for |x| ≤ 127): what
        // `round_ties_even` computes, without its call into libm on x86-64.
        *q = to_i8((v * inverse + ROUNDER) - ROUNDER);
    }
    amax / 127.0
}

/// One block of 256 activations rounded as llama.cpp's `quantize_row_q8_K_ref` rounds them,
/// into `q`; returns the scale `1 / iscale` ([`QuantRows::per_256`]). Compiled for AVX2 too, as
/// [`round_32`].
#[multiversion(targets("x86_64+avx2+fma"))]
fn round_256(block: &[f32], q: &mut [i8]) -> f32 {
    // The first value of the largest magnitude, its sign kept (found in two passes: the
    // magnitude's fold vectorises, a fold keeping the signed value did not).
    let amax = largest_magnitude(block);
    let max = block
        .iter()
        .copied()
        .find(|v| v.abs() == amax)
        .unwrap_or(0.0);
    let (iscale, d) = match max {
        0.0 => (0.0, 0.0),
        max => (-127.0 / max, 1.0 / (-127.0 / max)),
    };
    for (q, v) in q.iter_mut().zip(block) {
        *q = to_i8(((v * iscale + ROUNDER) - ROUNDER).min(127.0));
    }
    d
}

/// `r as i8` (saturating, NaN to 0) in a form the compiler vectorises: `as i8` itself became
/// one comparison and insertion at a time, which left rounding a step's activations per 256
/// at 2.7–2.9% of the cycles of the Qwen shape at 32 on a Zen 4.
#[inline(always)]
fn to_i8(r: f32) -> i8 {
    let r = if r.is_nan() { 0.0 } else { r }.clamp(-128.0, 127.0);
    // SAFETY: `r` is finite and within i32's range (just above).
    unsafe { r.to_int_unchecked::<i32>() as i8 }
}

/// The largest magnitude in `block` (a whole number of 8s), NaNs passed over: eight running
/// maxima side by side, then theirs. The maximum of a set is the same whatever the order it is
/// taken in, and eight independent chains run where one chain of dependent maxima waited on
/// each other (the rounding of a step's activations took about 2 ns a value that way).
#[inline(always)]
fn largest_magnitude(block: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    for eight in block.chunks_exact(8) {
        for (m, v) in lanes.iter_mut().zip(eight) {
            *m = m.max(v.abs());
        }
    }
    lanes.into_iter().fold(0f32, f32::max)
}

/// One row of [`QuantRows`].
#[derive(Clone, Copy)]
pub(crate) struct ActivationRow<'a> {
    pub q: &'a [i8],
    /// Per block: the scale and the scaled sum.
    pub scales: &'a [[f32; 2]],
}

/// One weight row unpacked to what the row layout's kernel multiplies: per 32-weight sub-block,
/// the signed values, 16 integer scales (one per pair of values: a Q6_K sub-block has two), and
/// the float scale beside the minimum's coefficient (multiplied by an activation block's scale
/// and scaled sum at once).
#[derive(Default)]
pub(crate) struct Unpacked {
    pub w: Vec<i8>,
    pub scales: Vec<i16>,
    pub factor_minimum: Vec<[f32; 2]>,
    /// Whether any sub-block has a minimum (else its term is skipped).
    pub has_minimum: bool,
}

/// Which kernel multiplies, picked once per process from the CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kernel {
    /// AMX-INT8's `tdpbssd` on row tiles of 16 rows, [`Kernel::Avx512VnniWide`] on the rows
    /// left: the same sums ([`columns_amx`]).
    #[cfg(target_arch = "x86_64")]
    Amx,
    /// AVX-512 VNNI's `vpdpbusd` on 512-bit registers, two groups at a time: an Intel core's
    /// ([`columns_zmm`]).
    #[cfg(target_arch = "x86_64")]
    Avx512VnniWide,
    /// AVX-512 VNNI's `vpdpbusd` (256-bit; BW's byte masks for Q5's fifth bits) in columns.
    #[cfg(target_arch = "x86_64")]
    Avx512Vnni,
    /// AVX2's `vpmaddubsw`/`vpmaddwd` with FMA and F16C, in columns.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// NEON's dotprod `sdot` (Armv8.2+), in columns.
    #[cfg(target_arch = "aarch64")]
    Sdot,
    /// Portable Rust (every other CPU), in the row layout.
    Portable,
}

impl Kernel {
    /// Every kernel, whether this CPU runs it or not.
    #[cfg(test)]
    pub(crate) const ALL: &'static [Self] = &[
        #[cfg(target_arch = "x86_64")]
        Self::Amx,
        #[cfg(target_arch = "x86_64")]
        Self::Avx512VnniWide,
        #[cfg(target_arch = "x86_64")]
        Self::Avx512Vnni,
        #[cfg(target_arch = "x86_64")]
        Self::Avx2,
        #[cfg(target_arch = "aarch64")]
        Self::Sdot,
        Self::Portable,
    ];

    /// The fastest kernel this CPU runs.
    pub(crate) fn best() -> Self {
        #[cfg(target_arch = "x86_64")]
        for kernel in [
            Self::Amx,
            Self::Avx512VnniWide,
            Self::Avx512Vnni,
            Self::Avx2,
        ] {
            if kernel.supported() {
                return kernel;
            }
        }
        #[cfg(target_arch = "aarch64")]
        if Self::Sdot.supported() {
            return Self::Sdot;
        }
        Self::Portable
    }

    /// [`Kernel::best`] within `widest` (the same bits whichever runs), to compare CPU classes
    /// on one machine: without AMX, VNNI's kernel; within AVX2 (what AMD's Zen 2 and 3 run),
    /// AVX2's.
    pub(crate) fn within(widest: Widest) -> Self {
        match (Self::best(), widest) {
            #[cfg(target_arch = "x86_64")]
            (Self::Amx | Self::Avx512VnniWide | Self::Avx512Vnni, Widest::Avx2) => Self::Avx2,
            #[cfg(target_arch = "x86_64")]
            (Self::Amx, Widest::NoAmx) => Self::Avx512VnniWide,
            // Elsewhere there is nothing wider than AVX2 to leave out.
            (best, _) => best,
        }
    }

    /// Whether this CPU has its instructions, checked at run time.
    pub(crate) fn supported(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            let avx2 = has!("avx2") && has!("fma") && has!("f16c");
            match self {
                Self::Amx => Self::Avx512Vnni.supported() && crate::packed::amx::int8_supported(),
                Self::Avx512VnniWide => Self::Avx512Vnni.supported(),
                Self::Avx512Vnni => {
                    avx2 && has!("avx512f")
                        && has!("avx512bw")
                        && has!("avx512vl")
                        && has!("avx512vnni")
                }
                Self::Avx2 => avx2,
                Self::Portable => true,
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            match self {
                Self::Sdot => std::arch::is_aarch64_feature_detected!("dotprod"),
                Self::Portable => true,
            }
        }
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        {
            let _ = self;
            true
        }
    }

    /// Whether matrices are laid out in columns for it.
    pub(crate) fn has_columns(self) -> bool {
        self != Self::Portable
    }

    /// The instructions, for logs and benchmarks.
    pub(crate) fn name(self) -> &'static str {
        match self {
            #[cfg(target_arch = "x86_64")]
            Self::Amx => {
                "GGUF blocks in columns × int8 (AMX-INT8 tdpbssd by 16 rows, AVX-512 VNNI 512-bit below)"
            }
            #[cfg(target_arch = "x86_64")]
            Self::Avx512VnniWide if crate::packed::amd() => {
                "GGUF blocks in columns × int8 (AVX-512 VNNI vpdpbusd, 512-bit from 8 rows, Q5_0 a block at a time above 8)"
            }
            #[cfg(target_arch = "x86_64")]
            Self::Avx512VnniWide => "GGUF blocks in columns × int8 (AVX-512 VNNI vpdpbusd, 512-bit)",
            #[cfg(target_arch = "x86_64")]
            Self::Avx512Vnni => "GGUF blocks in columns × int8 (AVX-512 VNNI vpdpbusd)",
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => "GGUF blocks in columns × int8 (AVX2 vpmaddubsw)",
            #[cfg(target_arch = "aarch64")]
            Self::Sdot => "GGUF blocks in columns × int8 (NEON dotprod sdot)",
            Self::Portable => "GGUF blocks by rows × int8 (portable)",
        }
    }

    /// One column-layout group times the tile's `rows` rows.
    ///
    /// # Safety
    /// As [`columns::group`], and the CPU supports this kernel.
    unsafe fn group(self, format: BlockFormat, t: &columns::GroupTile, rows: usize) {
        match self {
            // Rows one 512-bit call takes, straight to it: one answer's steps call this once
            // per pair of groups (3,072 times for SmolLM2's output layer), where a call's own
            // work is a few hundred instructions (with the detour, one answer ran ~10% slower).
            #[cfg(target_arch = "x86_64")]
            Self::Amx if rows <= columns_zmm::tile_rows(format) => {
                columns_zmm::group(format, t, rows)
            }
            #[cfg(target_arch = "x86_64")]
            Self::Amx => columns_amx::group(format, t, rows),
            #[cfg(target_arch = "x86_64")]
            Self::Avx512VnniWide => columns_zmm::group(format, t, rows),
            #[cfg(target_arch = "x86_64")]
            Self::Avx512Vnni => columns_x86::group(format, t, rows, true),
            // Two groups a call where the activations were rounded for it (`group_width`).
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 if !t.unsigned.is_null() => columns_x86::group_pair(format, t, rows),
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => columns_x86::group(format, t, rows, false),
            #[cfg(target_arch = "aarch64")]
            Self::Sdot => columns_arm::group(format, t, rows),
            Self::Portable => columns::group(format, t, rows),
        }
    }

    /// The kernel for a product of `m` rows. On AMD the 512-bit kernel ([`columns_zmm`]) only
    /// from a whole tile of rows: one answer at a time it streamed the weights slower than the
    /// 256-bit kernel (on a Zen 4, the Qwen2.5-0.5B shape at 0.73× the tokens/s, SmolLM2 0.76×),
    /// where from eight rows up it computes faster. The same bits either way.
    fn for_rows(self, m: usize) -> Self {
        let _ = m;
        match self {
            #[cfg(target_arch = "x86_64")]
            Self::Avx512VnniWide if m < columns_zmm::WHOLE_TILE && crate::packed::amd() => {
                Self::Avx512Vnni
            }
            kernel => kernel,
        }
    }

    /// Whether a product of `m` rows reads the activations as unsigned bytes too
    /// ([`QuantRows::new`]): AVX2's many-rows kernels.
    fn reads_unsigned(self, m: usize) -> bool {
        let _ = m;
        match self {
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => columns_x86::reads_unsigned(m),
            _ => false,
        }
    }

    /// Outputs one column kernel call takes in a product of `m` rows: one group, or two side by
    /// side on AMX's tiles and in AVX2's many-rows kernels (one answer at a time, two groups a
    /// call, each then run alone, took AVX2 0.84–0.94× the tokens/s of one group a call).
    fn group_width(self, m: usize) -> usize {
        let _ = m;
        match self {
            #[cfg(target_arch = "x86_64")]
            Self::Amx | Self::Avx512VnniWide => columns::PAIR,
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 if self.reads_unsigned(m) => columns::PAIR,
            _ => columns::COLUMNS,
        }
    }

    /// Rows one column kernel call takes for `format`.
    fn group_rows(self, format: BlockFormat) -> usize {
        let _ = format;
        match self {
            #[cfg(target_arch = "x86_64")]
            Self::Amx => columns_amx::ROWS,
            #[cfg(target_arch = "x86_64")]
            Self::Avx512VnniWide => columns_zmm::tile_rows(format),
            #[cfg(target_arch = "x86_64")]
            Self::Avx512Vnni => columns_x86::tile_rows(format, true),
            #[cfg(target_arch = "x86_64")]
            Self::Avx2 => columns_x86::tile_rows(format, false),
            #[cfg(target_arch = "aarch64")]
            Self::Sdot => columns_arm::ROWS,
            Self::Portable => 4,
        }
    }
}

thread_local! {
    static UNPACKED: std::cell::RefCell<Unpacked> = std::cell::RefCell::new(Unpacked::default());
}

/// `out = x · wᵀ (+ b)` for `x` rows of `k` and a matrix stacked from `parts` (each part's
/// outputs after the previous part's), split by outputs between the threads. The shapes are
/// the caller's to get right (the decoder checks them at load), as for the packed kernels.
pub(crate) fn linear(
    kernel: Kernel,
    x: &[f32],
    parts: &[Arc<BlockMatrix>],
    b: Option<&[f32]>,
    out: &mut [f32],
) {
    let (m, k, n) = shape(kernel, x, parts);
    let kernel = kernel.for_rows(m);
    assert!(
        out.len() == m * n && b.is_none_or(|b| b.len() == n),
        "block product: output of {m} × {n}"
    );
    let rounded = Rounded::new(x, k, kernel.reads_unsigned(m));
    // The outputs in chunks of whole column groups, a few per thread; each task writes its own
    // outputs in place.
    let threads = rayon::current_num_threads().max(1);
    let chunk = n
        .div_ceil(threads * 4)
        .max(16)
        .next_multiple_of(columns::PAIR);
    let base = out.as_mut_ptr();
    let shares: Vec<Share<'_>> = split(parts, &rounded, chunk)
        .map(|(part, rows, outputs, first)| Share {
            part,
            rows,
            outputs,
            bias: b.map(|b| &b[first..][..part.rows]),
            out: OutPtr(base.wrapping_add(first)),
            n,
            column0: 0,
        })
        .collect();
    // SAFETY: each share's outputs are its own (no other task writes them), below `n`, in rows
    // below `m`; the CPU runs the kernel (checked in `shape`).
    shares
        .into_par_iter()
        .for_each(|share| unsafe { run(kernel, &share) });
}

thread_local! {
    /// Each thread's outputs of its [`linear_choosing`] share (allocated and zeroed per share,
    /// 64 KiB each, 297 a step for Qwen2's vocabulary at 32 rows, they took ~1% of a step).
    static SHARE_OUTPUTS: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Outputs one share of [`linear_choosing`] computes at a time: 32 rows of them are 64 KiB.
const CHOOSING_OUTPUTS: usize = 512;
const _: () = assert!(CHOOSING_OUTPUTS.is_multiple_of(columns::PAIR));

/// As [`linear`] without a bias, but each row `t` either keeps its outputs (`keep[t]`: written
/// in row order into `kept`, `n` each) or gets only the index of its largest output (`Some`,
/// see [`first_largest`]). The outputs of a row that is not kept exist only in one share's
/// scratch at a time: a decoding step of 32 greedy rows over Qwen2's 151,936-token vocabulary
/// holds two threads' 64 KiB instead of 18.5 MiB of logits, and no pass over them follows.
/// Every output is the same sum as [`linear`]'s (the same kernel over the same column groups),
/// so the index is the one a scan of [`linear`]'s outputs finds.
pub(crate) fn linear_choosing(
    kernel: Kernel,
    x: &[f32],
    parts: &[Arc<BlockMatrix>],
    keep: &[bool],
    kept: &mut [f32],
) -> Vec<Option<u32>> {
    let (m, k, n) = shape(kernel, x, parts);
    let kernel = kernel.for_rows(m);
    let slots: Vec<Option<usize>> = keep
        .iter()
        .scan(0, |next, &keep| {
            *next += usize::from(keep);
            Some(keep.then(|| *next - 1))
        })
        .collect();
    assert!(
        keep.len() == m && kept.len() == keep.iter().filter(|&&k| k).count() * n,
        "block product: {} rows chosen of {m}, {} outputs kept",
        keep.len(),
        kept.len()
    );
    let rounded = Rounded::new(x, k, kernel.reads_unsigned(m));
    let base = OutPtr(kept.as_mut_ptr());
    let shares: Vec<_> = split(parts, &rounded, CHOOSING_OUTPUTS).collect();
    // Per share (in the order of the outputs), per row, its largest output there.
    let largest: Vec<Vec<Option<(u32, f32)>>> = shares
        .into_par_iter()
        .map(|(part, rows, outputs, first)| {
            let (w, start) = (outputs.len(), first + outputs.start);
            // This thread's outputs from the share before, overwritten whole by this one.
            let mut scratch = SHARE_OUTPUTS.take();
            scratch.resize(m * w, 0.0);
            let share = Share {
                part,
                rows,
                column0: outputs.start,
                outputs,
                bias: None,
                out: OutPtr(scratch.as_mut_ptr()),
                n: w,
            };
            // SAFETY: the share writes its `w` outputs of each of the `m` rows of `scratch`;
            // the CPU runs the kernel (checked in `shape`).
            unsafe { run(kernel, &share) };
            let scan = |(row, slot): (&[f32], &Option<usize>)| match slot {
                Some(s) => {
                    // SAFETY: kept row `s`'s outputs `start..start + w`, within `kept` (checked
                    // above) and this share's alone.
                    unsafe {
                        let to = base.get().add(s * n + start);
                        std::ptr::copy_nonoverlapping(row.as_ptr(), to, w);
                    }
                    None
                }
                None => first_largest(row, start),
            };
            let largest = scratch.chunks_exact(w).zip(&slots).map(scan).collect();
            SHARE_OUTPUTS.set(scratch);
            largest
        })
        .collect();
    (0..m)
        .map(|t| (!keep[t]).then(|| first_of(largest.iter().filter_map(|share| share[t]))))
        .collect()
}

/// The index of the first largest value of `row`, as a scan keeping the first strictly larger
/// value finds it (a NaN is never larger; a NaN first value gives 0): a greedy choice.
pub fn argmax(row: &[f32]) -> u32 {
    first_of(first_largest(row, 0).into_iter())
}

/// The index of the largest of a row from its shares' [`first_largest`], in output order: a
/// later share's where strictly larger (0 where every value is a NaN).
pub(crate) fn first_of(found: impl Iterator<Item = (u32, f32)>) -> u32 {
    found
        .reduce(|best, next| if next.1 > best.1 { next } else { best })
        .map_or(0, |(i, _)| i)
}

/// The first of the largest values of `row`, whose first value is output `start`, and its
/// index; `None` if every value is a NaN. Output 0 is taken first even when it is a NaN, which
/// nothing is larger than: so the shares' results, taken in order while a later one is
/// strictly larger, give what one scan of a whole row keeping the first strictly larger value
/// gives (the decoder's greedy choice, `Sampling::choose` at temperature 0).
pub(crate) fn first_largest(row: &[f32], start: usize) -> Option<(u32, f32)> {
    if start == 0 && row.first().is_some_and(|v| v.is_nan()) {
        return Some((0, f32::NAN));
    }
    // The largest value that is not a NaN (NaN only if every value is), then its first place:
    // two passes over a share's few hundred values in cache, both vectorised.
    let max = row.iter().copied().fold(f32::NAN, f32::max);
    let i = first_place(row, max)?;
    Some(((start + i) as u32, row[i]))
}

/// Where `value` first occurs in `row`: 16 values at a time without an early exit, so it
/// vectorises (`position` compared one value at a time: ~0.7% of a step's samples at 32 rows
/// on the Qwen shape's 151,936 outputs, Zen 4), then the first place in that 16.
#[multiversion(targets("x86_64+avx2+fma"))]
fn first_place(row: &[f32], value: f32) -> Option<usize> {
    const RUN: usize = 16;
    let run = row
        .chunks(RUN)
        .position(|run| run.iter().fold(false, |hit, &v| hit | (v == value)))?;
    let at = run * RUN;
    row[at..].iter().position(|&v| v == value).map(|i| at + i)
}

/// Checks a block product's shapes and kernel; its rows, inner size and outputs.
fn shape(kernel: Kernel, x: &[f32], parts: &[Arc<BlockMatrix>]) -> (usize, usize, usize) {
    let k = parts.first().map_or(0, |p| p.k);
    let n: usize = parts.iter().map(|p| p.rows).sum();
    assert!(
        k > 0 && parts.iter().all(|p| p.k == k) && x.len().is_multiple_of(k),
        "block product: inner size {k}"
    );
    assert!(
        kernel.supported(),
        "block product: no {kernel:?} on this CPU"
    );
    (x.len() / k, k, n)
}

/// Activations as each part's kernel reads them: per 32, and per 256 for K formats in columns,
/// each rounding done once and only where some part needs it.
struct Rounded<'x> {
    x: &'x [f32],
    k: usize,
    by_32: std::cell::OnceCell<QuantRows>,
    by_256: std::cell::OnceCell<QuantRows>,
    /// Whether the kernel reads the values as unsigned bytes too (both roundings).
    unsigned: bool,
}

impl Drop for Rounded<'_> {
    fn drop(&mut self) {
        for rows in [self.by_32.take(), self.by_256.take()]
            .into_iter()
            .flatten()
        {
            rows.recycle();
        }
    }
}

impl<'x> Rounded<'x> {
    fn new(x: &'x [f32], k: usize, unsigned: bool) -> Self {
        Self {
            x,
            k,
            by_32: std::cell::OnceCell::new(),
            by_256: std::cell::OnceCell::new(),
            unsigned,
        }
    }

    /// The rounding `part`'s kernel reads.
    fn for_part(&self, part: &BlockMatrix) -> &QuantRows {
        if part.columns && part.format.is_k() {
            self.by_256
                .get_or_init(|| QuantRows::per_256(self.x, self.k, self.unsigned))
        } else {
            self.by_32
                .get_or_init(|| QuantRows::new(self.x, self.k, self.unsigned))
        }
    }
}

/// `parts`' outputs in shares of at most `chunk` (a multiple of the column groups' width; none
/// across two parts): each share's part, the activations its kernel reads, its outputs within
/// the part, and where the part's outputs start in the stack.
fn split<'a>(
    parts: &'a [Arc<BlockMatrix>],
    rounded: &'a Rounded<'_>,
    chunk: usize,
) -> impl Iterator<
    Item = (
        &'a BlockMatrix,
        &'a QuantRows,
        std::ops::Range<usize>,
        usize,
    ),
> {
    let firsts = parts.iter().scan(0, |first, p| {
        *first += p.rows;
        Some(*first - p.rows)
    });
    parts.iter().zip(firsts).flat_map(move |(part, first)| {
        let rows = rounded.for_part(part);
        (0..part.rows)
            .step_by(chunk)
            .map(move |lo| (&**part, rows, lo..(lo + chunk).min(part.rows), first))
    })
}

/// Runs one share by its part's layout.
///
/// # Safety
/// As [`by_columns`].
unsafe fn run(kernel: Kernel, share: &Share<'_>) {
    if share.part.columns {
        by_columns(kernel, share);
    } else {
        by_rows(share);
    }
}

/// Activation rows multiplied together while a part's groups pass over them, so their bytes
/// stay in the core's first-level cache.
const ROW_BLOCK: usize = 64;

/// One thread's share of [`linear`]: outputs `outputs` of `part` (its bias, if any, from the
/// part's first output) times every row of `rows`, output `c` of row `t` written at `out + t · n
/// + c - column0` (`out` the part's first output in the stack, or a scratch from `column0`).
struct Share<'a> {
    part: &'a BlockMatrix,
    rows: &'a QuantRows,
    outputs: std::ops::Range<usize>,
    bias: Option<&'a [f32]>,
    out: OutPtr,
    n: usize,
    column0: usize,
}

/// A column-layout part's share (its outputs whole groups).
///
/// # Safety
/// The share's `out`, `n` and `column0` place each of its outputs of each row within one
/// buffer, written by no other task; the kernel runs here.
unsafe fn by_columns(kernel: Kernel, share: &Share<'_>) {
    let (part, rows, bias, out, n) = (share.part, share.rows, share.bias, share.out.get(), share.n);
    let m = rows.m;
    let group_bytes =
        part.k / part.format.block_weights() * columns::group_block_bytes(part.format);
    let (tall, wide) = (kernel.group_rows(part.format), kernel.group_width(m));
    for lo in (0..m).step_by(ROW_BLOCK) {
        for c in share.outputs.clone().step_by(wide) {
            let weights = part.data[c / columns::COLUMNS * group_bytes..].as_ptr();
            let mut t = lo;
            while t < (lo + ROW_BLOCK).min(m) {
                let height = tall.min(m - t).min(lo + ROW_BLOCK - t);
                let mut tile =
                    columns::GroupTile::new(rows, t, weights, out.add(t * n + c - share.column0));
                tile.n = n;
                tile.cols = wide.min(part.rows - c);
                tile.bias = bias.map(|b| b[c..].as_ptr());
                kernel.group(part.format, &tile, height);
                t += height;
            }
        }
    }
}

/// A row-layout part's share, one output at a time, by the portable kernel: the row layout is
/// kept only where no column kernel runs.
///
/// # Safety
/// As [`by_columns`].
unsafe fn by_rows(share: &Share<'_>) {
    let (part, rows, bias, out, n) = (share.part, share.rows, share.bias, share.out.get(), share.n);
    let (m, k) = (rows.m, rows.k);
    UNPACKED.with(|unpacked| {
        let mut unpacked = unpacked.borrow_mut();
        for r in share.outputs.clone() {
            unpack::unpack(part.format, part.row(r), k, &mut unpacked);
            for t in 0..m {
                // Each sum is written once, straight into its place (plus its bias).
                let v = unpack::dot(&unpacked, rows.row(t));
                *out.add(t * n + r - share.column0) = bias.map_or(v, |b| v + b[r]);
            }
        }
    })
}

#[cfg(test)]
mod tests;
