//! Q4_0, Q4_1 and Q8_0 weights laid out eight outputs side by side, so one instruction
//! multiplies eight outputs' weights by four activations at once and each activation row is
//! multiplied by a block of eight outputs' weights loaded once.
//!
//! Why: the row layout ([`super::unpack`]) costs per (row, output, block) an unpacking, two
//! integer products and a scaling of eight partial sums; on a prompt or a batch that scaling
//! work, not the products, was most of the time (1.8 ns per row and block on an AVX2 EPYC core,
//! which left a batch of 32 slower than f32 weights). Here one group's block is read once per
//! four or eight activation rows, each row's four activations are broadcast against the eight
//! outputs' lanes, the block's integer sums are kept per output, and the block is scaled once
//! per eight outputs.
//!
//! **The layout** (the same bytes as GGUF's, rearranged when the model is loaded): the outputs
//! in groups of [`COLUMNS`] (the last padded with zero rows); a group's blocks in order, each
//! its values, then the eight outputs' f16 scales, then (Q4_1) their f16 minimums. The values
//! in 32-byte runs, one per four inputs: byte `4c + j` of run `h` holds output `c`'s input
//! `4h + j`. Q4's runs hold two such runs a byte (inputs `4h…` in the low nibble, `16 + 4h…` in
//! the high: GGUF's own pairing within a block); Q8_0's values are kept offset by 128
//! (unsigned), which `vpdpbusd` takes as they are.
//!
//! **The product**, exact in integers: per (row, output, block) the sum of the weights' integer
//! values (Q4_0 less 8, Q8_0 signed) times the row's 8-bit activations; then, per output, in
//! block order, `sum · (d · row scale)` added by one fused multiply-add and, for Q4_1, `m ·
//! row scaled sum` by another. Each block's integer sum is llama.cpp's; the f32 sums are one
//! per output, whatever the number of rows or threads, so a row's result never depends on its
//! batch. [`group`] is that definition in portable Rust; the AVX2 (`vpmaddubsw`) and AVX-512
//! VNNI (`vpdpbusd`) kernels compute the same integers and the same f32 operations in the same
//! order, so all three agree bit for bit.

use super::{BlockFormat, QuantRows, BLOCK};

/// Outputs side by side: one 256-bit register of f32 or i32 sums.
pub(super) const COLUMNS: usize = 8;

/// Whether `format` is laid out in columns for its products.
pub(super) fn interleaves(format: BlockFormat) -> bool {
    matches!(
        format,
        BlockFormat::Q4_0 | BlockFormat::Q4_1 | BlockFormat::Q8_0
    )
}

/// Bytes of a group's values in one block.
pub(super) fn values_bytes(format: BlockFormat) -> usize {
    match format {
        BlockFormat::Q8_0 => 256,
        _ => 128,
    }
}

/// Bytes of a group's block: its values, scales and minimums (eight GGUF blocks' worth).
pub(super) fn group_block_bytes(format: BlockFormat) -> usize {
    format.block_bytes() * COLUMNS
}

/// A GGUF block's unsigned values as the layout stores them (Q4: 0–15; Q8_0: offset by 128).
fn stored_values(format: BlockFormat, block: &[u8]) -> [u8; BLOCK] {
    let mut v = [0u8; BLOCK];
    match format {
        BlockFormat::Q8_0 => {
            for (v, q) in v.iter_mut().zip(&block[2..34]) {
                *v = q ^ 0x80;
            }
        }
        _ => {
            let qs = &block[block.len() - 16..];
            for j in 0..16 {
                v[j] = qs[j] & 0xF;
                v[j + 16] = qs[j] >> 4;
            }
        }
    }
    v
}

/// Where input `i`'s value of output `c` sits in a group's block: byte, and whether it is the
/// high nibble (Q4).
fn value_at(format: BlockFormat, c: usize, i: usize) -> (usize, bool) {
    match format {
        BlockFormat::Q8_0 => ((i / 4) * 32 + 4 * c + i % 4, false),
        _ => (((i % 16) / 4) * 32 + 4 * c + i % 4, i >= 16),
    }
}

/// The stored value of output `c`'s input `i` in a group's block `src` (as [`stored_values`]
/// gives it).
fn stored_value(format: BlockFormat, src: &[u8], c: usize, i: usize) -> u8 {
    let (at, high) = value_at(format, c, i);
    match (format, high) {
        (BlockFormat::Q8_0, _) => src[at],
        (_, true) => src[at] >> 4,
        (_, false) => src[at] & 0xF,
    }
}

/// What a block's stored values are offset by (Q4_0's `q - 8`; Q8_0's signed values plus 128):
/// a block's integer sum loses the offset times the activations' sum.
pub(super) fn offset(format: BlockFormat) -> i32 {
    match format {
        BlockFormat::Q4_0 => 8,
        BlockFormat::Q8_0 => 128,
        _ => 0,
    }
}

/// GGUF rows (`rows × k` weights of `format`) rearranged into the column layout in place: a
/// group's bytes take the place of its eight rows' (the same count), through a scratch copy of
/// one group, so the matrix is never held twice (rows past the last are zero).
pub(super) fn interleave(format: BlockFormat, rows: usize, k: usize, mut data: Vec<u8>) -> Vec<u8> {
    let (bytes, blocks) = (format.block_bytes(), k / BLOCK);
    let (values, group) = (values_bytes(format), group_block_bytes(format));
    let span = COLUMNS * blocks * bytes;
    data.resize(rows.div_ceil(COLUMNS) * span, 0);
    let mut scratch = vec![0u8; span];
    for dst in data.chunks_exact_mut(span) {
        scratch.copy_from_slice(dst);
        dst.fill(0);
        for (c, row) in scratch.chunks_exact(blocks * bytes).enumerate() {
            for (block, dst) in row.chunks_exact(bytes).zip(dst.chunks_exact_mut(group)) {
                for (i, v) in stored_values(format, block).into_iter().enumerate() {
                    let (at, high) = value_at(format, c, i);
                    dst[at] |= if high { v << 4 } else { v };
                }
                dst[values + 2 * c..][..2].copy_from_slice(&block[..2]);
                if format == BlockFormat::Q4_1 {
                    dst[values + 16 + 2 * c..][..2].copy_from_slice(&block[2..4]);
                }
            }
        }
    }
    data
}

/// Row `r`'s GGUF bytes, read back from the column layout into `out`.
pub(super) fn gguf_row(format: BlockFormat, k: usize, data: &[u8], r: usize, out: &mut Vec<u8>) {
    let (blocks, group) = (k / BLOCK, group_block_bytes(format));
    let (values, (g, c)) = (values_bytes(format), (r / COLUMNS, r % COLUMNS));
    out.clear();
    for b in 0..blocks {
        let src = &data[(g * blocks + b) * group..][..group];
        let value = |i: usize| stored_value(format, src, c, i);
        out.extend_from_slice(&src[values + 2 * c..][..2]);
        match format {
            BlockFormat::Q8_0 => out.extend((0..BLOCK).map(|i| value(i) ^ 0x80)),
            _ => {
                if format == BlockFormat::Q4_1 {
                    out.extend_from_slice(&src[values + 16 + 2 * c..][..2]);
                }
                out.extend((0..16).map(|j| value(j) | value(j + 16) << 4));
            }
        }
    }
}

/// One kernel call: `R` activation rows by one group of outputs, over every block.
pub(super) struct GroupTile {
    /// The group's first block.
    pub weights: *const u8,
    /// Blocks per row.
    pub blocks: usize,
    /// The first row's 8-bit activations; rows `blocks * BLOCK` apart.
    pub q: *const i8,
    /// The first row's per-block scale and scaled sum; rows `blocks` apart.
    pub scales: *const [f32; 2],
    /// The first row's per-block integer sums; rows `blocks` apart.
    pub sums: *const i32,
    /// The first row's first output of the group; rows `n` apart.
    pub out: *mut f32,
    pub n: usize,
    /// The group's outputs that exist (1..=8).
    pub cols: usize,
    /// The group's first bias, if any.
    pub bias: Option<*const f32>,
}

impl GroupTile {
    /// The tile for rows `first…` of `rows` and the group at `weights`, writing from `out`.
    pub(super) fn new(rows: &QuantRows, first: usize, weights: *const u8, out: *mut f32) -> Self {
        let blocks = rows.k / BLOCK;
        Self {
            weights,
            blocks,
            q: rows.q[first * rows.k..].as_ptr(),
            scales: rows.scales[first * blocks..].as_ptr(),
            sums: rows.sums[first * blocks..].as_ptr(),
            out,
            n: 0,
            cols: COLUMNS,
            bias: None,
        }
    }
}

/// The product's definition: each of the tile's rows and outputs summed as the module says.
///
/// # Safety
/// The tile's pointers cover `rows` rows of `blocks` blocks and the group's block data, and the
/// outputs `cols` of each row.
pub(super) unsafe fn group(format: BlockFormat, t: &GroupTile, rows: usize) {
    let (values, group) = (values_bytes(format), group_block_bytes(format));
    let data = std::slice::from_raw_parts(t.weights, t.blocks * group);
    for r in 0..rows {
        let q = std::slice::from_raw_parts(t.q.add(r * t.blocks * BLOCK), t.blocks * BLOCK);
        let scales = std::slice::from_raw_parts(t.scales.add(r * t.blocks), t.blocks);
        let sums = std::slice::from_raw_parts(t.sums.add(r * t.blocks), t.blocks);
        for c in 0..t.cols {
            let mut acc = 0f32;
            for b in 0..t.blocks {
                let src = &data[b * group..][..group];
                let a = &q[b * BLOCK..][..BLOCK];
                let mut sum = 0i32;
                for (i, &a) in a.iter().enumerate() {
                    sum += i32::from(stored_value(format, src, c, i)) * i32::from(a);
                }
                sum -= sums[b] * offset(format);
                let f16 = |at: usize| half::f16::from_le_bytes([src[at], src[at + 1]]).to_f32();
                let [scale, scaled_sum] = scales[b];
                acc = (sum as f32).mul_add(f16(values + 2 * c) * scale, acc);
                if format == BlockFormat::Q4_1 {
                    acc = f16(values + 16 + 2 * c).mul_add(scaled_sum, acc);
                }
            }
            *t.out.add(r * t.n + c) = t.bias.map_or(acc, |b| acc + *b.add(c));
        }
    }
}
