//! Reading GGUF's block layouts (as llama.cpp's `ggml-quants.c` defines them): each format's
//! 32-weight sub-blocks unpacked to signed bytes and scales for the row layout's kernel, widened
//! to f32 for the f32 path, and split into values and scales (and written back) for the column
//! layout; and the row layout's portable kernel.

use super::{ActivationRow, BlockFormat, Unpacked, BLOCK};

fn f16_at(bytes: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

/// A K-format's 6-bit scale and minimum of sub-block `j` (llama.cpp's `get_scale_min_k4`).
pub(super) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// What scales a 32-weight sub-block's integer values: two integer scales (weights 0–15 and
/// 16–31), a float scale and the minimum's coefficient.
pub(super) struct Meta {
    pub scales: [i16; 2],
    pub factor: f32,
    pub minimum: f32,
}

/// The block holding sub-block `s` of `row`, and the sub-block's index within it.
pub(super) fn block_of(format: BlockFormat, row: &[u8], s: usize) -> (&[u8], usize) {
    let per = format.block_weights() / BLOCK;
    let bytes = format.block_bytes();
    (&row[s / per * bytes..][..bytes], s % per)
}

/// Sub-block `s` (within its block) of `block`: its scales.
pub(super) fn meta(format: BlockFormat, block: &[u8], s: usize) -> Meta {
    match format {
        BlockFormat::Q4_0 | BlockFormat::Q8_0 => Meta {
            scales: [1, 1],
            factor: f16_at(block, 0),
            minimum: 0.0,
        },
        BlockFormat::Q5_0 => Meta {
            scales: [1, 1],
            factor: f16_at(block, 0),
            minimum: 0.0,
        },
        BlockFormat::Q4_1 | BlockFormat::Q5_1 => Meta {
            scales: [1, 1],
            factor: f16_at(block, 0),
            minimum: f16_at(block, 2),
        },
        BlockFormat::Q4K | BlockFormat::Q5K => {
            let (sc, m) = scale_min_k4(s, &block[4..16]);
            Meta {
                scales: [i16::from(sc); 2],
                factor: f16_at(block, 0),
                minimum: -(f16_at(block, 2) * f32::from(m)),
            }
        }
        BlockFormat::Q6K => {
            let sc = &block[192 + 8 * (s / 4)..][..8];
            let run = s % 4;
            Meta {
                scales: [
                    i16::from(sc[2 * run] as i8),
                    i16::from(sc[2 * run + 1] as i8),
                ],
                factor: f16_at(block, 208),
                minimum: 0.0,
            }
        }
    }
}

/// Sub-block `s` (within its block) of `block`: its signed integer values.
#[inline(always)]
pub(super) fn values(format: BlockFormat, block: &[u8], s: usize) -> [i8; BLOCK] {
    let mut w = [0i8; BLOCK];
    match format {
        BlockFormat::Q4_0 | BlockFormat::Q4_1 => {
            let (qs, zero) = match format {
                BlockFormat::Q4_0 => (&block[2..18], 8),
                _ => (&block[4..20], 0),
            };
            for j in 0..16 {
                w[j] = (qs[j] & 0xF) as i8 - zero;
                w[j + 16] = (qs[j] >> 4) as i8 - zero;
            }
        }
        BlockFormat::Q5_0 | BlockFormat::Q5_1 => {
            // d (and m), the fifth bits (bit e for weight e), then the nibbles as in Q4.
            let (at, zero) = match format {
                BlockFormat::Q5_0 => (2, 16),
                _ => (4, 0),
            };
            let high = u32::from_le_bytes([block[at], block[at + 1], block[at + 2], block[at + 3]]);
            let qs = &block[at + 4..at + 20];
            for j in 0..16 {
                let (h0, h1) = ((high >> j) & 1, (high >> (j + 16)) & 1);
                w[j] = ((qs[j] & 0xF) | (h0 as u8) << 4) as i8 - zero;
                w[j + 16] = ((qs[j] >> 4) | (h1 as u8) << 4) as i8 - zero;
            }
        }
        BlockFormat::Q8_0 => {
            for (w, &q) in w.iter_mut().zip(&block[2..34]) {
                *w = q as i8;
            }
        }
        BlockFormat::Q4K | BlockFormat::Q5K => {
            let (chunk, shift) = (s / 2, 4 * (s % 2));
            let qs_at = if format == BlockFormat::Q4K { 16 } else { 48 };
            let qs = &block[qs_at + 32 * chunk..][..32];
            for (l, w) in w.iter_mut().enumerate() {
                let mut v = (qs[l] >> shift) & 0xF;
                if format == BlockFormat::Q5K {
                    v |= ((block[16 + l] >> s) & 1) << 4;
                }
                *w = v as i8;
            }
        }
        BlockFormat::Q6K => {
            // ql[128], qh[64], scales[16], d; halves of 128 weights, each four runs of 32.
            let (half, run) = (s / 4, s % 4);
            let ql = &block[64 * half..][..64];
            let qh = &block[128 + 32 * half..][..32];
            for (l, w) in w.iter_mut().enumerate() {
                let low = match run {
                    0 => ql[l] & 0xF,
                    1 => ql[l + 32] & 0xF,
                    2 => ql[l] >> 4,
                    _ => ql[l + 32] >> 4,
                };
                let high = (qh[l] >> (2 * run)) & 3;
                *w = (low | (high << 4)) as i8 - 32;
            }
        }
    }
    w
}

/// Sizes `out` for `k` weights of `format`.
fn prepare(format: BlockFormat, k: usize, out: &mut Unpacked) {
    let subs = k / BLOCK;
    out.w.resize(k, 0);
    out.scales.resize(subs * 16, 0);
    out.factor_minimum.resize(subs, [0.0; 2]);
    out.has_minimum = format.has_minimum();
}

/// Sub-block `s`'s scales into `out`.
fn put_meta(out: &mut Unpacked, s: usize, m: &Meta) {
    let scales = &mut out.scales[s * 16..][..16];
    scales[..8].fill(m.scales[0]);
    scales[8..].fill(m.scales[1]);
    out.factor_minimum[s] = [m.factor, m.minimum];
}

/// `row` (`k` weights in `format`) into `out`, sub-block by sub-block.
pub(super) fn unpack(format: BlockFormat, row: &[u8], k: usize, out: &mut Unpacked) {
    prepare(format, k, out);
    for s in 0..k / BLOCK {
        let (block, within) = block_of(format, row, s);
        let w = values(format, block, within);
        out.w[s * BLOCK..][..BLOCK].copy_from_slice(&w);
        put_meta(out, s, &meta(format, block, within));
    }
}

/// One row's sum of products (the row layout's kernel): per sub-block,
/// eight 32-bit lanes of four products each (lane `j` holds weights `4j…4j+3`, scaled by their
/// half's integer scale), added into eight f32 lanes by fused multiply-adds with the block's
/// two scales' product; the lanes summed as `((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))`; then the
/// minimums' term, summed in block order.
pub(super) fn dot(w: &Unpacked, a: ActivationRow<'_>) -> f32 {
    let mut lanes = [0f32; 8];
    let mut minimums = 0f32;
    for (s, ((q, ws), scales)) in
        a.q.chunks_exact(BLOCK)
            .zip(w.w.chunks_exact(BLOCK))
            .zip(w.scales.chunks_exact(16))
            .enumerate()
    {
        let ([factor, minimum], [scale, scaled_sum]) = (w.factor_minimum[s], a.scales[s]);
        let (both, minimum) = (factor * scale, minimum * scaled_sum);
        for (j, lane) in lanes.iter_mut().enumerate() {
            let mut sum = 0i32;
            for pair in [2 * j, 2 * j + 1] {
                let e = 2 * pair;
                let products =
                    i32::from(ws[e]) * i32::from(q[e]) + i32::from(ws[e + 1]) * i32::from(q[e + 1]);
                sum += products * i32::from(scales[pair]);
            }
            *lane = (sum as f32).mul_add(both, *lane);
        }
        if w.has_minimum {
            minimums += minimum;
        }
    }
    let half: [f32; 4] = std::array::from_fn(|j| lanes[j] + lanes[j + 4]);
    ((half[0] + half[2]) + (half[1] + half[3])) + minimums
}

/// `row` widened to f32, with llama.cpp's reference arithmetic (`dequantize_row_*`).
pub(super) fn dequantize(format: BlockFormat, row: &[u8], out: &mut [f32]) {
    for (s, y) in out.chunks_exact_mut(BLOCK).enumerate() {
        let (block, within) = block_of(format, row, s);
        let w = values(format, block, within);
        let m = meta(format, block, within);
        for (l, (y, &w)) in y.iter_mut().zip(&w).enumerate() {
            let w = f32::from(w);
            *y = match format {
                BlockFormat::Q4_0 | BlockFormat::Q5_0 | BlockFormat::Q8_0 => w * m.factor,
                BlockFormat::Q4_1 | BlockFormat::Q5_1 => w * m.factor + m.minimum,
                // d · scale, then the minimum (dmin · m) subtracted, as llama.cpp groups them.
                BlockFormat::Q4K | BlockFormat::Q5K => {
                    m.factor * f32::from(m.scales[0]) * w + m.minimum
                }
                BlockFormat::Q6K => m.factor * f32::from(m.scales[l / 16]) * w,
            };
        }
    }
}

/// One output's scales in one GGUF block, as the column layout keeps them apart from the
/// values: the f16 scale, the f16 minimum (Q4_1, Q5_1) or minimums' scale (Q4_K, Q5_K), and per
/// 32-weight sub-block two bytes: Q4_K's and Q5_K's 6-bit scale and minimum, or Q6_K's two 8-bit
/// scales (one per 16 weights).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Header {
    pub d: [u8; 2],
    pub m: [u8; 2],
    pub sub: [[u8; 2]; 8],
}

/// `block`'s [`Header`].
#[inline(always)]
pub(super) fn header(format: BlockFormat, block: &[u8]) -> Header {
    let mut h = Header::default();
    let at = if format == BlockFormat::Q6K { 208 } else { 0 };
    h.d.copy_from_slice(&block[at..at + 2]);
    if format.has_minimum() {
        h.m.copy_from_slice(&block[2..4]);
    }
    match format {
        BlockFormat::Q4K | BlockFormat::Q5K => {
            for (s, sub) in h.sub.iter_mut().enumerate() {
                let (scale, minimum) = scale_min_k4(s, &block[4..16]);
                *sub = [scale, minimum];
            }
        }
        BlockFormat::Q6K => {
            for (s, sub) in h.sub.iter_mut().enumerate() {
                sub.copy_from_slice(&block[192 + 2 * s..][..2]);
            }
        }
        _ => {}
    }
    h
}

/// A GGUF block written back from its values as the column layout stores them (unsigned: each
/// of [`values`] plus its format's offset) and its header, appended to `out`: the inverse of
/// [`values`] and [`header`].
pub(super) fn pack(format: BlockFormat, v: &[u8], h: &Header, out: &mut Vec<u8>) {
    let start = out.len();
    out.resize(start + format.block_bytes(), 0);
    let block = &mut out[start..];
    let nibbles = |v: &[u8], qs: &mut [u8]| {
        for j in 0..16 {
            qs[j] = (v[j] & 0xF) | (v[j + 16] & 0xF) << 4;
        }
    };
    let fifth = |v: &[u8]| (0..32).fold(0u32, |w, e| w | u32::from(v[e] >> 4 & 1) << e);
    match format {
        BlockFormat::Q6K => block[208..].copy_from_slice(&h.d),
        _ => block[..2].copy_from_slice(&h.d),
    }
    match format {
        BlockFormat::Q4_0 => nibbles(v, &mut block[2..]),
        BlockFormat::Q4_1 => {
            block[2..4].copy_from_slice(&h.m);
            nibbles(v, &mut block[4..]);
        }
        BlockFormat::Q5_0 => {
            block[2..6].copy_from_slice(&fifth(v).to_le_bytes());
            nibbles(v, &mut block[6..]);
        }
        BlockFormat::Q5_1 => {
            block[2..4].copy_from_slice(&h.m);
            block[4..8].copy_from_slice(&fifth(v).to_le_bytes());
            nibbles(v, &mut block[8..]);
        }
        BlockFormat::Q8_0 => {
            for (q, v) in block[2..].iter_mut().zip(v) {
                *q = v ^ 0x80;
            }
        }
        BlockFormat::Q4K | BlockFormat::Q5K => pack_k(format, v, h, block),
        BlockFormat::Q6K => {
            for s in 0..8 {
                let (half, run) = (s / 4, s % 4);
                for l in 0..32 {
                    let v = v[32 * s + l];
                    let low = &mut block[64 * half + l + 32 * (run % 2)];
                    *low |= (v & 0xF) << (4 * (run / 2));
                    block[128 + 32 * half + l] |= (v >> 4) << (2 * run);
                }
                block[192 + 2 * s..][..2].copy_from_slice(&h.sub[s]);
            }
        }
    }
}

/// Q4_K's and Q5_K's body: the minimums' scale, the 6-bit scales and minimums packed as
/// [`scale_min_k4`] reads them, the fifth bits (Q5_K) and the nibbles.
fn pack_k(format: BlockFormat, v: &[u8], h: &Header, block: &mut [u8]) {
    block[2..4].copy_from_slice(&h.m);
    let q = &mut block[4..16];
    for j in 0..4 {
        let ([scale, minimum], [scale_high, minimum_high]) = (h.sub[j], h.sub[j + 4]);
        q[j] = scale | (scale_high >> 4) << 6;
        q[j + 4] = minimum | (minimum_high >> 4) << 6;
        q[j + 8] = (scale_high & 0xF) | (minimum_high & 0xF) << 4;
    }
    let qs_at = if format == BlockFormat::Q4K { 16 } else { 48 };
    for s in 0..8 {
        for l in 0..32 {
            let v = v[32 * s + l];
            block[qs_at + 32 * (s / 2) + l] |= (v & 0xF) << (4 * (s % 2));
            if format == BlockFormat::Q5K {
                block[16 + l] |= (v >> 4 & 1) << s;
            }
        }
    }
}
