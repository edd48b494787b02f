//! Every block format laid out eight outputs side by side, so one instruction multiplies eight
//! outputs' weights by four activations at once and each activation row is multiplied by a
//! block of eight outputs' weights loaded once.
//!
//! Why: the row layout ([`super::unpack`]) costs per (row, output, block) an unpacking, two
//! integer products and a scaling of eight partial sums; on a prompt or a batch that scaling
//! work, not the products, was most of the time (1.8 ns per row and block on an AVX2 EPYC core,
//! which left a batch of 32 slower than f32 weights). Here one group's block is read once per
//! four or eight activation rows, each row's four activations are broadcast against the eight
//! outputs' lanes, each 32-weight sub-block's integer sums are kept per output, and they are
//! scaled once per eight outputs.
//!
//! **The layout** (GGUF's bytes rearranged when the model is loaded): the outputs in groups of
//! [`COLUMNS`] (zero rows after the last, up to an even number of groups: [`PAIR`]); a group's
//! blocks in order, each its sub-blocks' values, then its header (the eight outputs' f16 scales,
//! f16 minimums or minimums' scales, and the K formats' per-sub-block scales, a byte each). A
//! sub-block's values are unsigned (each format's offset added: Q4_0 8, Q5_0 16, Q6_K 32, Q8_0 128)
//! and sit in 32-byte runs, one per four inputs: byte `4c + j` of run `h` holds output `c`'s input
//! `4h + j`. Q8_0 has eight runs of bytes. The others keep four runs of two nibbles (inputs `4h…`
//! low, `16 + 4h…` high: GGUF's own pairing), then the bits above the nibble in planes: Q5's fifth
//! bits as eight 32-bit words (run `h`'s low side, then its high side; bit `p` for byte `p`),
//! Q6_K's two bits as two 32-byte runs (low side, high side; bits `2h…` for run `h`). The same
//! bytes as GGUF's but for Q4_K and Q5_K, whose packed 6-bit scales take a byte each here (2.8% and
//! 2.3% more).
//!
//! **The product**, exact in integers: per (row, output, sub-block) the sum of the stored values
//! times the row's 8-bit activations, less the offset times the activations' sum. The 32-weight
//! formats then add, per output and in block order, that sum times `scale · row scale` by one
//! fused multiply-add and, where they have a minimum, the minimum times the row's scaled sum
//! ([`add_block`]). The K formats, whose activations are rounded per 256 (llama.cpp's Q8_K), sum
//! each sub-block's integer sum times its integer scale (Q6_K: per 16 inputs, each half after
//! its offset) and each minimum times its sub-block's activation sum over the whole block, in
//! i32, and scale the two totals once per 256 ([`add_k_block`]), as llama.cpp's K products do.
//! The integer sums are llama.cpp's; the f32 sums are one per output, whatever the number of
//! rows or threads, so a row's result never depends on its batch. [`group`] is that definition in
//! portable Rust; the AVX2 (`vpmaddubsw`), AVX-512 VNNI (`vpdpbusd`), AMX-INT8 (`tdpbssd`) and
//! Arm dotprod (`sdot`) kernels compute the same integers and the same f32 operations in the
//! same order, so all five agree bit for bit.

use super::unpack::{self, Header};
use super::{BlockFormat, QuantRows, BLOCK};

/// `$body` once per block format, with `$F` the format's index in `BlockFormat::ALL` as a
/// constant: each kernel (and the rearrangement at load) is compiled once per format, so its
/// every `match format` is settled at compile time.
macro_rules! per_format {
    ($format:expr, $F:ident => $body:expr) => {
        match $format {
            $crate::quant::BlockFormat::Q4_0 => {
                const $F: usize = 0;
                $body
            }
            $crate::quant::BlockFormat::Q4_1 => {
                const $F: usize = 1;
                $body
            }
            $crate::quant::BlockFormat::Q5_0 => {
                const $F: usize = 2;
                $body
            }
            $crate::quant::BlockFormat::Q5_1 => {
                const $F: usize = 3;
                $body
            }
            $crate::quant::BlockFormat::Q8_0 => {
                const $F: usize = 4;
                $body
            }
            $crate::quant::BlockFormat::Q4K => {
                const $F: usize = 5;
                $body
            }
            $crate::quant::BlockFormat::Q5K => {
                const $F: usize = 6;
                $body
            }
            $crate::quant::BlockFormat::Q6K => {
                const $F: usize = 7;
                $body
            }
        }
    };
}
// The x86 kernels' dispatch (Arm's kernel takes the format at run time).
#[cfg(target_arch = "x86_64")]
pub(super) use per_format;

/// Outputs side by side: one 256-bit register of f32 or i32 sums.
pub(super) const COLUMNS: usize = 8;

/// The first `rows` of a many-rows kernel's per-row buffer `buf`, each set to `value`: only the
/// call's rows are written, where zeroing all of them cost ~1% of a step's samples at 32 rows
/// (the 512-bit kernel's 4 KiB a call, Qwen shape, Zen 4).
#[cfg(target_arch = "x86_64")]
pub(super) fn first_rows<T: Copy, const N: usize>(
    buf: &mut [std::mem::MaybeUninit<T>; N],
    rows: usize,
    value: T,
) -> &mut [T] {
    let rows = &mut buf[..rows.min(N)];
    for row in rows.iter_mut() {
        row.write(value);
    }
    // SAFETY: every element of `rows` was written just above, and `MaybeUninit<T>` has `T`'s
    // layout.
    unsafe { &mut *(rows as *mut [std::mem::MaybeUninit<T>] as *mut [T]) }
}

/// Bytes of one group's blocks: where the next group starts.
pub(super) fn group_bytes(format: BlockFormat, t: &GroupTile) -> usize {
    t.blocks / subs(format) * group_block_bytes(format)
}

/// Asks for `bytes` from `ahead` bytes past `w` (the same block of a group further along the
/// matrix) in the second-level cache, while this block is multiplied. Why: a decoding step
/// reads each matrix once, from memory (a model's weights are many times the caches), and the
/// hardware's own prefetching did not keep up where a kernel reads two groups side by side or
/// a K block's values and scales apart. On a Zen 4, one thread, matrices larger than the caches,
/// the same bits: the 512-bit kernels 1.11–1.21× at 32 rows and 1.31–1.76× at 8, every format;
/// the 256-bit kernels 1.39–1.85× on Q4_K and Q6_K at one row, but 0.71–0.88× on Q8_0 and Q5_0
/// (one group's single stream, which the hardware follows), so they ask for the K formats only.
/// Matrices in the caches: unchanged (0.96–1.09×).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn prefetch(w: *const u8, ahead: usize, bytes: usize) {
    for line in (0..bytes).step_by(64) {
        // SAFETY: a prefetch is a hint and never faults, past the matrix's end too; the address
        // is only computed (wrapping), never dereferenced.
        unsafe {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
            _mm_prefetch::<_MM_HINT_T1>(w.wrapping_add(ahead + line).cast());
        }
    }
}

/// Two groups: every matrix has an even number of groups (the last padded with a group of zero
/// rows where needed) and the products split outputs between threads in pairs of groups, so
/// the AMX kernel ([`super::columns_amx`]) always finds two side by side.
pub(super) const PAIR: usize = 2 * COLUMNS;

/// Bits each value keeps above its nibble (Q8_0: none; its values are whole bytes).
pub(super) fn high_bits(format: BlockFormat) -> u32 {
    match format {
        BlockFormat::Q5_0 | BlockFormat::Q5_1 | BlockFormat::Q5K => 1,
        BlockFormat::Q6K => 2,
        _ => 0,
    }
}

/// Bytes of a group's values in one 32-weight sub-block.
pub(super) fn sub_bytes(format: BlockFormat) -> usize {
    match format {
        BlockFormat::Q8_0 => 256,
        _ => 128 + 32 * high_bits(format) as usize,
    }
}

/// 32-weight sub-blocks per block.
pub(super) fn subs(format: BlockFormat) -> usize {
    format.block_weights() / BLOCK
}

/// Bytes of a group's values in one block: where its header starts.
pub(super) fn values_bytes(format: BlockFormat) -> usize {
    subs(format) * sub_bytes(format)
}

/// Where a header's parts start: the minimums (or minimums' scales), and the per-sub-block
/// bytes (Q4_K/Q5_K: scales, then minimums at +64; Q6_K: each sub-block's two scales' rows).
pub(super) const MINIMUMS: usize = 16;
pub(super) const K_SCALES: usize = 32;
pub(super) const Q6K_SCALES: usize = 16;

/// Bytes of a group's header in one block.
fn header_bytes(format: BlockFormat) -> usize {
    match format {
        BlockFormat::Q4K | BlockFormat::Q5K => K_SCALES + 2 * 8 * COLUMNS,
        BlockFormat::Q6K => Q6K_SCALES + 16 * COLUMNS,
        f if f.has_minimum() => 2 * MINIMUMS,
        _ => MINIMUMS,
    }
}

/// Bytes of a group's block: its values and header.
pub(super) fn group_block_bytes(format: BlockFormat) -> usize {
    values_bytes(format) + header_bytes(format)
}

/// What a format's stored values are offset by: a sub-block's integer sum loses the offset
/// times the activations' sum.
pub(super) fn offset(format: BlockFormat) -> i32 {
    match format {
        BlockFormat::Q4_0 => 8,
        BlockFormat::Q5_0 => 16,
        BlockFormat::Q6K => 32,
        BlockFormat::Q8_0 => 128,
        _ => 0,
    }
}

/// Which of a block's `QuantRows::less_offsets` a format's sums start from (Q6_K: its first
/// side's, the second side's next); formats without an offset read none.
pub(super) fn less_offset(format: BlockFormat) -> usize {
    match format {
        BlockFormat::Q4_0 => 0,
        BlockFormat::Q5_0 => 1,
        BlockFormat::Q8_0 => 2,
        BlockFormat::Q6K => 3,
        _ => 0,
    }
}

/// Output `c`'s input `i` (0..32) of a group's sub-block: where its stored value goes.
#[inline(always)]
fn place(format: BlockFormat, sub: &mut [u8], c: usize, i: usize, v: u8) {
    if format == BlockFormat::Q8_0 {
        sub[(i / 4) * 32 + 4 * c + i % 4] = v;
        return;
    }
    let (side, h, p) = (i / 16, (i % 16) / 4, 4 * c + i % 4);
    sub[32 * h + p] |= (v & 0xF) << (4 * side);
    match high_bits(format) {
        1 => sub[128 + 4 * (2 * h + side) + p / 8] |= (v >> 4 & 1) << (p % 8),
        2 => sub[128 + 32 * side + p] |= (v >> 4 & 3) << (2 * h),
        _ => {}
    }
}

/// Output `c`'s stored value of input `i` in a group's sub-block (the inverse of [`place`]).
fn fetch(format: BlockFormat, sub: &[u8], c: usize, i: usize) -> u8 {
    if format == BlockFormat::Q8_0 {
        return sub[(i / 4) * 32 + 4 * c + i % 4];
    }
    let (side, h, p) = (i / 16, (i % 16) / 4, 4 * c + i % 4);
    let v = sub[32 * h + p] >> (4 * side) & 0xF;
    match high_bits(format) {
        1 => v | (sub[128 + 4 * (2 * h + side) + p / 8] >> (p % 8) & 1) << 4,
        2 => v | (sub[128 + 32 * side + p] >> (2 * h) & 3) << 4,
        _ => v,
    }
}

/// Output `c`'s header written into a group's block header.
#[inline(always)]
fn place_header(format: BlockFormat, head: &mut [u8], c: usize, h: &Header) {
    head[2 * c..][..2].copy_from_slice(&h.d);
    if format.has_minimum() {
        head[MINIMUMS + 2 * c..][..2].copy_from_slice(&h.m);
    }
    for (s, sub) in h.sub.iter().enumerate() {
        match format {
            BlockFormat::Q4K | BlockFormat::Q5K => {
                head[K_SCALES + 8 * s + c] = sub[0];
                head[K_SCALES + 64 + 8 * s + c] = sub[1];
            }
            BlockFormat::Q6K => {
                head[Q6K_SCALES + 16 * s + c] = sub[0];
                head[Q6K_SCALES + 16 * s + 8 + c] = sub[1];
            }
            _ => {}
        }
    }
}

/// Output `c`'s header read from a group's block header (the inverse of [`place_header`]).
fn fetch_header(format: BlockFormat, head: &[u8], c: usize) -> Header {
    let mut h = Header::default();
    h.d.copy_from_slice(&head[2 * c..][..2]);
    if format.has_minimum() {
        h.m.copy_from_slice(&head[MINIMUMS + 2 * c..][..2]);
    }
    for (s, sub) in h.sub.iter_mut().enumerate() {
        *sub = match format {
            BlockFormat::Q4K | BlockFormat::Q5K => {
                [head[K_SCALES + 8 * s + c], head[K_SCALES + 64 + 8 * s + c]]
            }
            BlockFormat::Q6K => [
                head[Q6K_SCALES + 16 * s + c],
                head[Q6K_SCALES + 16 * s + 8 + c],
            ],
            _ => [0; 2],
        };
    }
    h
}

/// GGUF rows (`rows × k` weights of `format`) rearranged into the column layout in place: a
/// group's bytes take the place of its eight rows' (through a scratch copy of one group: last
/// group first where groups are larger than their rows, as Q4_K's and Q5_K's are, else all
/// groups side by side on the pool's threads), so the matrix is never held twice (rows past
/// the last are zero).
pub(super) fn interleave(format: BlockFormat, rows: usize, k: usize, data: Vec<u8>) -> Vec<u8> {
    // One copy per format. With the format a run-time value and one group at a time, a
    // Qwen2.5-0.5B-shape Q4_K_M file (396 MB) took 2.39–3.11 s to load on a Zen 4 with 2 vCPUs,
    // most of it here; 1.41–1.71 s now (3 alternated runs each; peak memory unchanged).
    per_format!(format, F => interleave_in::<F>(rows, k, data))
}

/// [`interleave`] for `BlockFormat::ALL[F]`.
fn interleave_in<const F: usize>(rows: usize, k: usize, mut data: Vec<u8>) -> Vec<u8> {
    let format = BlockFormat::ALL[F];
    let (bytes, blocks) = (format.block_bytes(), k / format.block_weights());
    let (from, to) = (COLUMNS * blocks * bytes, blocks * group_block_bytes(format));
    let groups = rows.div_ceil(PAIR) * 2;
    // Exactly: `resize` alone would double the capacity of a matrix that grows (Q4_K, Q5_K).
    data.reserve_exact((groups * to.max(from)).saturating_sub(data.len()));
    data.resize(groups * to.max(from), 0);
    if to == from {
        // Each group's bytes take exactly its rows' place: no group overwrites another's rows.
        use rayon::prelude::*;
        data.par_chunks_mut(from).for_each_init(
            || vec![0u8; from],
            |scratch, group| {
                scratch.copy_from_slice(group);
                place_group::<F>(scratch, blocks, group);
            },
        );
    } else {
        let mut scratch = vec![0u8; from];
        for g in (0..groups).rev() {
            scratch.copy_from_slice(&data[g * from..][..from]);
            place_group::<F>(&scratch, blocks, &mut data[g * to..][..to]);
        }
    }
    data.truncate(groups * to);
    data
}

/// One group's eight rows of GGUF blocks (`rows`, `blocks` blocks each) in the column layout,
/// into `dst` (the group's bytes).
#[inline(always)]
fn place_group<const F: usize>(rows: &[u8], blocks: usize, dst: &mut [u8]) {
    let format = BlockFormat::ALL[F];
    let (bytes, group, values) = (
        format.block_bytes(),
        group_block_bytes(format),
        values_bytes(format),
    );
    dst.fill(0);
    for (c, row) in rows.chunks_exact(blocks * bytes).enumerate() {
        for (block, dst) in row.chunks_exact(bytes).zip(dst.chunks_exact_mut(group)) {
            let (dst, head) = dst.split_at_mut(values);
            for (s, sub) in dst.chunks_exact_mut(sub_bytes(format)).enumerate() {
                for (i, w) in unpack::values(format, block, s).into_iter().enumerate() {
                    place(format, sub, c, i, (i32::from(w) + offset(format)) as u8);
                }
            }
            place_header(format, head, c, &unpack::header(format, block));
        }
    }
}

/// Row `r`'s GGUF bytes, read back from the column layout into `out`.
pub(super) fn gguf_row(format: BlockFormat, k: usize, data: &[u8], r: usize, out: &mut Vec<u8>) {
    let (blocks, group) = (k / format.block_weights(), group_block_bytes(format));
    let (g, c) = (r / COLUMNS, r % COLUMNS);
    out.clear();
    let mut v = Vec::with_capacity(format.block_weights());
    for b in 0..blocks {
        let (values, head) =
            data[(g * blocks + b) * group..][..group].split_at(values_bytes(format));
        v.clear();
        for sub in values.chunks_exact(sub_bytes(format)) {
            v.extend((0..BLOCK).map(|i| fetch(format, sub, c, i)));
        }
        unpack::pack(format, &v, &fetch_header(format, head, c), out);
    }
}

/// One kernel call: `R` activation rows by one group of outputs (AMX: two), over every block.
#[derive(Clone, Copy)]
pub(super) struct GroupTile {
    /// The group's first block.
    pub weights: *const u8,
    /// Activation blocks (32 inputs) per row.
    pub blocks: usize,
    /// The first row's 8-bit activations; rows `blocks * BLOCK` apart.
    pub q: *const i8,
    /// The same plus 128 as unsigned bytes, where the product rounded them so
    /// (`QuantRows::new`), else null. Only AVX2 reads them.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub unsigned: *const u8,
    /// The first row's per-block scale and scaled sum; rows `blocks` apart.
    pub scales: *const [f32; 2],
    /// The first row's per-block integer sums, and those of each block's first 16; rows
    /// `blocks` apart.
    pub sums: *const i32,
    pub halves: *const i32,
    /// The first row's per-block sums times the offsets (`QuantRows::less_offsets`); rows
    /// `blocks` apart.
    pub less_offsets: *const [i32; 5],
    /// The first row's first output of the group; rows `n` apart.
    pub out: *mut f32,
    pub n: usize,
    /// The group's outputs that exist (1..=8; AMX 1..=16, the second group's after the first).
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
            unsigned: match rows.unsigned.is_empty() {
                true => std::ptr::null(),
                false => rows.unsigned[first * rows.k..].as_ptr(),
            },
            scales: rows.scales[first * blocks..].as_ptr(),
            sums: rows.sums[first * blocks..].as_ptr(),
            halves: rows.halves[first * blocks..].as_ptr(),
            less_offsets: rows.less_offsets[first * blocks..].as_ptr(),
            out,
            n: 0,
            cols: COLUMNS,
            bias: None,
        }
    }

    /// The same tile from its row `r` on (its rows past `r`, the same outputs): the AMX
    /// kernel's row tiles.
    ///
    /// # Safety
    /// The tile has more than `r` rows.
    #[cfg(target_arch = "x86_64")]
    pub(super) unsafe fn rows_from(&self, r: usize) -> Self {
        let at = r * self.blocks;
        Self {
            q: self.q.add(at * BLOCK),
            unsigned: match self.unsigned.is_null() {
                true => self.unsigned,
                false => self.unsigned.add(at * BLOCK),
            },
            scales: self.scales.add(at),
            sums: self.sums.add(at),
            halves: self.halves.add(at),
            less_offsets: self.less_offsets.add(at),
            out: self.out.add(r * self.n),
            ..*self
        }
    }

    /// Row `r`'s activation block `ab`, as every kernel reads it.
    ///
    /// # Safety
    /// `r` is one of the tile's rows and `ab` below `blocks`.
    pub(super) unsafe fn row_block(&self, r: usize, ab: usize) -> RowBlock {
        let at = r * self.blocks + ab;
        let [scale, scaled_sum] = *self.scales.add(at);
        RowBlock {
            scale,
            scaled_sum,
            sum: *self.sums.add(at),
            first: *self.halves.add(at),
        }
    }

    /// What the offset takes off row `r`'s sums in activation block `ab`: its
    /// `QuantRows::less_offsets` entry `at` ([`less_offset`]).
    ///
    /// # Safety
    /// As [`GroupTile::row_block`].
    #[inline(always)]
    pub(super) unsafe fn less_offset(&self, r: usize, ab: usize, at: usize) -> i32 {
        (*self.less_offsets.add(r * self.blocks + ab))[at]
    }
}

/// One activation block's part of a row: its scale, scaled sum, integer sum and first half's.
#[derive(Clone, Copy)]
pub(super) struct RowBlock {
    pub scale: f32,
    pub scaled_sum: f32,
    pub sum: i32,
    pub first: i32,
}

impl RowBlock {
    /// The integer sum of its inputs 0–15 (`side` 0) or 16–31 (1): what Q6_K's per-16 offset
    /// multiplies.
    pub(super) fn side(self, side: usize) -> i32 {
        if side == 0 {
            self.first
        } else {
            self.sum - self.first
        }
    }
}

/// `acc` plus one 32-weight block of one output (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): its integer
/// sums over the low and high 16 inputs of the stored values, less the offset times the
/// activations' sum, times `d · row scale`; then the minimum times the row's scaled sum.
pub(super) fn add_block(
    format: BlockFormat,
    acc: f32,
    sums: [i32; 2],
    h: &Header,
    a: RowBlock,
) -> f32 {
    let f16 = |b: [u8; 2]| half::f16::from_le_bytes(b).to_f32();
    let sum = sums[0] + sums[1] - offset(format) * a.sum;
    let acc = (sum as f32).mul_add(f16(h.d) * a.scale, acc);
    if format.has_minimum() {
        f16(h.m).mul_add(a.scaled_sum, acc)
    } else {
        acc
    }
}

/// `acc` plus one K-format block (256 inputs) of one output, with the activations rounded per
/// 256: each sub-block's integer sum times its integer scale (Q6_K: each half's, after its
/// offset), and each minimum times its sub-block's activation sum, summed exactly as llama.cpp
/// sums them; then `T · (row scale · d)` and, for Q4_K/Q5_K, `M · −(row scale · dmin)`.
pub(super) fn add_k_block(
    format: BlockFormat,
    acc: f32,
    sums: &[[i32; 2]; 8],
    h: &Header,
    a: &[RowBlock; 8],
) -> f32 {
    let f16 = |b: [u8; 2]| half::f16::from_le_bytes(b).to_f32();
    let (mut total, mut minimums) = (0i32, 0i32);
    for ((sums, a), sub) in sums.iter().zip(a).zip(h.sub) {
        if format == BlockFormat::Q6K {
            let [low, high] = sub.map(|v| i32::from(v as i8));
            total += (sums[0] - 32 * a.side(0)) * low + (sums[1] - 32 * a.side(1)) * high;
        } else {
            let [scale, minimum] = sub.map(i32::from);
            total += (sums[0] + sums[1]) * scale;
            minimums += minimum * a.sum;
        }
    }
    let scale = a[0].scale;
    let acc = (total as f32).mul_add(scale * f16(h.d), acc);
    if format == BlockFormat::Q6K {
        acc
    } else {
        (minimums as f32).mul_add(-(scale * f16(h.m)), acc)
    }
}

/// The product's definition: each of the tile's rows and outputs summed as the module says.
///
/// # Safety
/// The tile's pointers cover `rows` rows of `blocks` blocks and the group's block data, and the
/// outputs `cols` of each row.
pub(super) unsafe fn group(format: BlockFormat, t: &GroupTile, rows: usize) {
    let (subs, group) = (subs(format), group_block_bytes(format));
    let data = std::slice::from_raw_parts(t.weights, group_bytes(format, t));
    for r in 0..rows {
        let at = r * t.blocks;
        let q = std::slice::from_raw_parts(t.q.add(at * BLOCK), t.blocks * BLOCK);
        let row_block = |ab: usize| t.row_block(r, ab);
        for c in 0..t.cols {
            let mut acc = 0f32;
            for (b, block) in data.chunks_exact(group).enumerate() {
                let (values, head) = block.split_at(values_bytes(format));
                let h = fetch_header(format, head, c);
                // Output `c`'s products over sub-block `s`'s low or high 16 inputs.
                let half = |s: usize, side: usize| -> i32 {
                    let (sub, ab) = (&values[s * sub_bytes(format)..], b * subs + s);
                    (16 * side..16 * side + 16)
                        .map(|i| i32::from(fetch(format, sub, c, i)) * i32::from(q[ab * BLOCK + i]))
                        .sum()
                };
                acc = if format.is_k() {
                    let sums = std::array::from_fn(|s| [half(s, 0), half(s, 1)]);
                    let a = std::array::from_fn(|s| row_block(b * subs + s));
                    add_k_block(format, acc, &sums, &h, &a)
                } else {
                    add_block(format, acc, [half(0, 0), half(0, 1)], &h, row_block(b))
                };
            }
            *t.out.add(r * t.n + c) = t.bias.map_or(acc, |b| acc + *b.add(c));
        }
    }
}
