//! Attention's two products for one (text, head) on AMX tiles, in bf16 with f32 sums: the
//! scores `Q·Kᵀ`, and the context `P·V` from the softmax's probabilities `P`. As in the dense
//! layers, only the products' inputs are rounded to bf16 (Q, K, V and P); the sums, the scale and
//! the softmax stay f32, as in the f32 path (`crate::attention`), which this replaces when the
//! dense layers run on AMX.
//!
//! The tiles take their operands in the dense weights' layout: a row tile is 16 rows of 32 bf16
//! inputs, a weight tile 16 *steps* (input pairs) of 16 columns' pairs. So Q's rows and P's rows
//! are rounded as they are (row tiles), while K and V are rearranged into weight tiles: for the
//! scores the columns are keys and a step a pair of a key's dimensions; for the context the
//! columns are dimensions and a step a pair of keys. Every size is padded to whole tiles
//! (queries to 16, keys to 32, dimensions to 32). The padding a real result reads is zero (the
//! dimensions past the head's, V's keys past the text, the probabilities of padded keys); the
//! rest (padded queries, K's padded keys) only reaches sums that are never read.

use super::{configure, DEPTH, TILE_ROWS};
use crate::kernels::exp;
use crate::packed::PANEL;

/// One thread's buffers for a head's products, reused from head to head.
#[derive(Default)]
pub(crate) struct Buffers {
    /// Q's rows in bf16 pairs: `queries × q_lanes`.
    q: Vec<u32>,
    /// Kᵀ as weight tiles: per block of 16 keys, `q_lanes` steps of 16 keys' pairs.
    k: Vec<u32>,
    /// V as weight tiles: per block of 16 dimensions, `keys / 2` steps of 16 dimensions' pairs.
    v: Vec<u32>,
    /// The scores, then the probabilities, in f32 (`queries × keys`); then the context's
    /// padded sums (`queries × cols`).
    scores: Vec<f32>,
    /// The probabilities in bf16 pairs: `queries × keys / 2`.
    p: Vec<u32>,
}

/// One head of one text: where its Q, K and V are and how its scores are scaled.
pub(crate) struct Head<'a> {
    /// The text's rows of the fused projection, `stride` apart, from its first.
    pub(crate) qkv: &'a [f32],
    pub(crate) stride: usize,
    /// The text's tokens.
    pub(crate) len: usize,
    /// The first column of the head's Q, K and V within a row; each is `dh` wide.
    pub(crate) q: usize,
    pub(crate) k: usize,
    pub(crate) v: usize,
    pub(crate) dh: usize,
    /// What the scores are multiplied by before the softmax: 1/√dh.
    pub(crate) scale: f32,
}

impl Head<'_> {
    /// Row `i`'s `dh` values from column `col`.
    fn row(&self, i: usize, col: usize) -> &[f32] {
        &self.qkv[i * self.stride + col..][..self.dh]
    }
}

/// The head's context: `len` rows of `dh` values written `out_stride` apart from `out`.
///
/// The tiles read and write only the buffers, sized here; Q, K and V are read through
/// slices, so a head outside `qkv` panics.
///
/// # Safety
/// [`super::supported`]; `out` addresses `len` rows of `dh` values `out_stride` apart, which
/// nothing else reads or writes meanwhile.
pub(crate) unsafe fn head(h: &Head<'_>, out: *mut f32, out_stride: usize, buf: &mut Buffers) {
    let s = Sizes::of(h.len, h.dh);
    pack(h, &s, buf);
    configure();
    scores(&s, buf);
    probabilities(h, &s, buf);
    context(h, &s, buf, out, out_stride);
}

/// A head's sizes padded to whole tiles.
struct Sizes {
    /// Query rows: a multiple of a row tile's 16.
    queries: usize,
    /// Keys: a multiple of 32, the probabilities' depth per row tile.
    keys: usize,
    /// Q's (and K's) lanes of two dimensions per row: a multiple of a tile's 16 steps.
    q_lanes: usize,
    /// Context columns: a multiple of a tile's 16.
    cols: usize,
}

impl Sizes {
    fn of(len: usize, dh: usize) -> Self {
        Self {
            queries: len.next_multiple_of(TILE_ROWS),
            keys: len.next_multiple_of(2 * DEPTH),
            q_lanes: dh.next_multiple_of(2 * DEPTH) / 2,
            cols: dh.next_multiple_of(PANEL),
        }
    }
}

/// `v` at least `n` long (what it held before stays: every value a product reads is written
/// first, or lies in a padded row or column whose results are never read).
fn grow<T: Copy + Default>(v: &mut Vec<T>, n: usize) {
    if v.len() < n {
        v.resize(n, T::default());
    }
}

/// 16 values of `src` from `from`, zero past its end (masked, so nothing past it is read).
#[target_feature(enable = "avx512f")]
unsafe fn load16(src: &[f32], from: usize) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let left = src.len().saturating_sub(from).min(16);
    let mask = ((1u32 << left) - 1) as __mmask16;
    _mm512_maskz_loadu_ps(mask, src.as_ptr().wrapping_add(from))
}

/// 32 values of `src` from `from` (zero past its end) rounded to bf16 as the dense layers' rows
/// are: 16 lanes of two, the first value in the low half.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn pairs(src: &[f32], from: usize) -> std::arch::x86_64::__m512i {
    use std::arch::x86_64::*;
    let bf: __m512bh = _mm512_cvtne2ps_pbh(load16(src, from + 16), load16(src, from));
    std::mem::transmute(bf)
}

/// Q's rows as they are, Kᵀ and V rearranged into weight tiles (see the module's comment), all
/// rounded to bf16; the dimensions past `dh` and V's keys past `len` zero. K's padded keys and
/// Q's padded rows are left as they were: they only reach scores that are never read.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn pack(h: &Head<'_>, s: &Sizes, buf: &mut Buffers) {
    use std::arch::x86_64::*;
    let ql = s.q_lanes;
    grow(&mut buf.q, s.queries * ql);
    grow(&mut buf.k, s.keys * ql);
    // A key's lane `j` goes to step `j` of its block: 16 lanes apart.
    let steps_apart = _mm512_setr_epi32(
        0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240,
    );
    for i in 0..h.len {
        let (q, k) = (h.row(i, h.q), h.row(i, h.k));
        let key = buf.k.as_mut_ptr().add((i / PANEL) * PANEL * ql + i % PANEL);
        for c in (0..ql).step_by(PANEL) {
            _mm512_storeu_si512(buf.q.as_mut_ptr().add(i * ql + c).cast(), pairs(q, 2 * c));
            _mm512_i32scatter_epi32::<4>(key.add(c * PANEL).cast(), steps_apart, pairs(k, 2 * c));
        }
    }
    // V: per pair of keys and 16 dimensions, the two keys' values interleaved.
    let steps = s.keys / 2;
    grow(&mut buf.v, s.cols * steps);
    let order: [i16; 32] = std::array::from_fn(|i| (i / 2 + 16 * (i % 2)) as i16);
    let interleave = _mm512_loadu_si512(order.as_ptr().cast());
    let none: &[f32] = &[];
    for step in 0..steps {
        let row = |key: usize| if key < h.len { h.row(key, h.v) } else { none };
        let (even, odd) = (row(2 * step), row(2 * step + 1));
        for cb in (0..s.cols).step_by(PANEL) {
            let both: __m512i =
                std::mem::transmute(_mm512_cvtne2ps_pbh(load16(odd, cb), load16(even, cb)));
            let lanes = _mm512_permutexvar_epi16(interleave, both);
            _mm512_storeu_si512(
                buf.v.as_mut_ptr().add(cb * steps + step * PANEL).cast(),
                lanes,
            );
        }
    }
}

/// `scores = Q·Kᵀ`, over the dimensions.
///
/// # Safety
/// [`super::supported`], the tiles configured, and the buffers packed for `s`.
unsafe fn scores(s: &Sizes, buf: &mut Buffers) {
    grow(&mut buf.scores, s.queries * s.keys);
    let out = buf.scores.as_mut_ptr();
    let at = |row: usize, col: usize| out.add(row * s.keys + col);
    let (q, k) = (buf.q.as_ptr(), buf.k.as_ptr());
    multiply(q, k, s.queries, s.keys, s.q_lanes, at, s.keys * 4);
}

/// `A·B` into `rows` × `cols` f32 sums stored from `at(row, col)`, rows `stride` bytes apart,
/// 32 × 32 at a time in four tiles of sums (fewer at a lone last 16). A's rows are row tiles of
/// `depth` lanes; B is weight tiles, a block of 16 columns `depth` steps long after another.
/// `rows` and `cols` are multiples of 16, `depth` of a tile's 16 steps.
///
/// # Safety
/// [`super::supported`], the tiles configured; A and B cover those sizes, and `at` addresses
/// every row and column stored.
unsafe fn multiply(
    a: *const u32,
    b: *const u32,
    rows: usize,
    cols: usize,
    depth: usize,
    at: impl Fn(usize, usize) -> *mut f32,
    stride: usize,
) {
    let block = depth * PANEL;
    for r in (0..rows).step_by(2 * TILE_ROWS) {
        let two = r + TILE_ROWS < rows;
        for c in (0..cols).step_by(2 * PANEL) {
            let wide = c + PANEL < cols;
            tile!(zero 0);
            tile!(zero 1);
            tile!(zero 2);
            tile!(zero 3);
            for d in (0..depth).step_by(DEPTH) {
                tile!(load 4, a.add(r * depth + d), depth * 4);
                tile!(load 6, b.add(c / PANEL * block + d * PANEL), 64usize);
                tile!(dot 0, 4, 6);
                if wide {
                    tile!(load 7, b.add((c / PANEL + 1) * block + d * PANEL), 64usize);
                    tile!(dot 1, 4, 7);
                }
                if two {
                    tile!(load 5, a.add((r + TILE_ROWS) * depth + d), depth * 4);
                    tile!(dot 2, 5, 6);
                    if wide {
                        tile!(dot 3, 5, 7);
                    }
                }
            }
            tile!(store 0, at(r, c), stride);
            if wide {
                tile!(store 1, at(r, c + PANEL), stride);
            }
            if two {
                tile!(store 2, at(r + TILE_ROWS, c), stride);
                if wide {
                    tile!(store 3, at(r + TILE_ROWS, c + PANEL), stride);
                }
            }
        }
    }
}

/// Each real query's scores scaled and turned into probabilities over the real keys, in f32,
/// then rounded to bf16 into `p` (zero for the padded keys). The softmax is the f32 path's
/// (`kernels::softmax`: the same `exp`, the same max subtracted), over the padded row in
/// whole registers, the padded keys given zero.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn probabilities(h: &Head<'_>, s: &Sizes, buf: &mut Buffers) {
    use std::arch::x86_64::*;
    let lanes = s.keys / 2;
    grow(&mut buf.p, s.queries * lanes);
    let (len, scale) = (h.len, h.scale);
    for (row, p) in buf
        .scores
        .chunks_exact_mut(s.keys)
        .zip(buf.p.chunks_exact_mut(lanes))
        .take(len)
    {
        let mut max = [f32::NEG_INFINITY; PANEL];
        for (c, chunk) in row.chunks_exact_mut(PANEL).enumerate() {
            for (i, v) in chunk.iter_mut().enumerate() {
                *v = if c * PANEL + i < len {
                    *v * scale
                } else {
                    f32::NEG_INFINITY
                };
                max[i] = if *v > max[i] { *v } else { max[i] };
            }
        }
        let max = max.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let mut sum = [0f32; PANEL];
        for (c, chunk) in row.chunks_exact_mut(PANEL).enumerate() {
            for (i, v) in chunk.iter_mut().enumerate() {
                *v = if c * PANEL + i < len {
                    exp(*v - max)
                } else {
                    0.0
                };
                sum[i] += *v;
            }
        }
        let inv = _mm512_set1_ps(1.0 / sum.iter().sum::<f32>());
        for (c, pair) in row.chunks_exact(2 * PANEL).zip(p.chunks_exact_mut(PANEL)) {
            let lo = _mm512_mul_ps(_mm512_loadu_ps(c.as_ptr()), inv);
            let hi = _mm512_mul_ps(_mm512_loadu_ps(c.as_ptr().add(PANEL)), inv);
            let bf: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
            _mm512_storeu_si512(pair.as_mut_ptr().cast(), bf);
        }
    }
}

/// `context = P·V`, over the keys, into `scores` (whose probabilities are in `p` by now), then
/// the real rows and columns copied to `out`.
///
/// # Safety
/// As [`head`]'s, with the buffers packed for `s`.
unsafe fn context(h: &Head<'_>, s: &Sizes, buf: &mut Buffers, out: *mut f32, out_stride: usize) {
    grow(&mut buf.scores, s.queries * s.cols);
    let sums = buf.scores.as_mut_ptr();
    let at = |row: usize, col: usize| sums.add(row * s.cols + col);
    let (p, v) = (buf.p.as_ptr(), buf.v.as_ptr());
    multiply(p, v, s.queries, s.cols, s.keys / 2, at, s.cols * 4);
    for (i, row) in buf.scores.chunks_exact(s.cols).take(h.len).enumerate() {
        std::ptr::copy_nonoverlapping(row.as_ptr(), out.add(i * out_stride), h.dh);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::softmax;

    /// x rounded to bf16 and back, as the kernel rounds its inputs.
    fn round(x: f32) -> f32 {
        half::bf16::from_f32(x).to_f32()
    }

    /// The head's context from bf16-rounded Q, K, V and probabilities, summed in f64: what the
    /// tiles compute, but for the order of their f32 sums.
    fn modelled(h: &Head<'_>) -> Vec<f32> {
        let mut out = vec![0f32; h.len * h.dh];
        for i in 0..h.len {
            let q = h.row(i, h.q);
            let mut scores: Vec<f32> = (0..h.len)
                .map(|j| {
                    let k = h.row(j, h.k);
                    let dot: f64 = q
                        .iter()
                        .zip(k)
                        .map(|(a, b)| f64::from(round(*a)) * f64::from(round(*b)))
                        .sum();
                    dot as f32 * h.scale
                })
                .collect();
            softmax(&mut scores);
            for c in 0..h.dh {
                let sum: f64 = (0..h.len)
                    .map(|j| f64::from(round(scores[j])) * f64::from(round(h.row(j, h.v)[c])))
                    .sum();
                out[i * h.dh + c] = sum as f32;
            }
        }
        out
    }

    #[test]
    fn every_padded_shape_matches_the_modelled_bf16_products() {
        if !super::super::supported() {
            eprintln!("no AMX here: skipped");
            return;
        }
        // Buffers left full of NaNs: no padding the products read may be left unwritten.
        let mut buf = Buffers {
            q: vec![u32::MAX; 1 << 16],
            k: vec![u32::MAX; 1 << 16],
            v: vec![u32::MAX; 1 << 16],
            scores: vec![f32::NAN; 1 << 16],
            p: vec![u32::MAX; 1 << 16],
        };
        let mut seed = 7u32;
        let mut next = move || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (seed >> 8) as f32 / (1 << 24) as f32 * 4.0 - 2.0
        };
        for dh in [8, 32, 40, 64] {
            for len in [1, 7, 16, 17, 32, 33, 70] {
                let stride = 3 * dh + 5;
                let qkv: Vec<f32> = (0..len * stride).map(|_| next()).collect();
                let h = Head {
                    qkv: &qkv,
                    stride,
                    len,
                    q: 1,
                    k: 1 + dh,
                    v: 2 + 2 * dh,
                    dh,
                    scale: 1.0 / (dh as f32).sqrt(),
                };
                // Written with a wider stride, so a store past a row's dh columns shows.
                let out_stride = dh + 3;
                let mut out = vec![f32::NAN; len * out_stride];
                // SAFETY: supported (checked); out holds len rows of out_stride ≥ dh.
                unsafe { head(&h, out.as_mut_ptr(), out_stride, &mut buf) };
                let want = modelled(&h);
                for i in 0..len {
                    for c in 0..out_stride {
                        let got = out[i * out_stride + c];
                        if c >= dh {
                            assert!(got.is_nan(), "len {len} dh {dh}: wrote column {c}");
                            continue;
                        }
                        let w = want[i * dh + c];
                        assert!(
                            (got - w).abs() <= 1e-4 * (1.0 + w.abs()),
                            "len {len} dh {dh} row {i} col {c}: {got} against {w}"
                        );
                    }
                }
            }
        }
    }
}
