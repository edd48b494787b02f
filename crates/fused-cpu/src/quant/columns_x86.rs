//! The column layout's product ([`super::columns`]) on x86-64: AVX-512 VNNI's `vpdpbusd` on
//! 256-bit registers (four unsigned weights by four signed activations added into each output's
//! 32-bit sum, one instruction: products of fewer rows than [`super::columns_zmm`]'s whole tile
//! on AMD's Zen 4 and 5, which run a 512-bit instruction as two halves), or AVX2's
//! `vpmaddubsw`/`vpmaddwd` where there is no VNNI. Both compute each sub-block's integer sums exactly and then the portable definition's
//! f32 operations in its order.

use super::columns::{
    first_rows, group_block_bytes, group_bytes, high_bits, less_offset, offset, per_format,
    prefetch, sub_bytes, values_bytes, GroupTile, COLUMNS, K_SCALES, MINIMUMS, Q6K_SCALES,
};
use super::{BlockFormat, BLOCK};
use std::arch::x86_64::*;
use std::mem::MaybeUninit;

/// Rows the register kernels ([`body_32`], [`body_k`]) take a call: each row keeps an i32 and
/// an f32 register, so AVX2's sixteen registers hold four rows and AVX-512's thirty-two hold
/// eight (each block's weights are then loaded and unpacked once per eight rows: on a Zen 4, a
/// batch-32 run took ~4% less CPU time than with four). Except Q6_K's, which also keeps a
/// sub-block's sums per row while it adds the other side's: at eight rows it ran out of
/// registers (on a Zen 4, one thread's product of 32 rows by 896 × 4,864 weights: 59 billion
/// multiply-adds a second at eight rows, 91 at four, 80–92 at five and six; the other formats
/// within ±5% at four, six or eight).
fn register_rows(format: BlockFormat, vnni: bool) -> usize {
    match format {
        BlockFormat::Q6K => 4,
        _ if vnni => 8,
        _ => 4,
    }
}

/// Rows one call multiplies: up to [`MANY_ROWS`] where [`many_rows`] (more than
/// [`register_rows`] go to [`body_32_many`], [`body_q8_many`] or [`body_k_many`]), else
/// [`register_rows`].
pub(super) fn tile_rows(format: BlockFormat, vnni: bool) -> usize {
    if many_rows(vnni) {
        MANY_ROWS
    } else {
        register_rows(format, vnni)
    }
}

/// Rows one call takes where [`many_rows`]: a decoding step's batch, or a prompt step's row
/// block (`super::ROW_BLOCK`), whose rows all share each block's unpacking.
pub(super) const MANY_ROWS: usize = 64;

/// Whether a call's rows are multiplied a block at a time, all of them together: on AVX2, every
/// format (Q8_0 by its nibbles: [`body_q8_many`]). Not on VNNI: the 256-bit VNNI kernel runs
/// only products of fewer rows than the 512-bit kernel's whole tile (`super::Kernel::for_rows`),
/// and the 512-bit kernel takes Q5_0 a block at a time itself (`super::columns_zmm`).
fn many_rows(vnni: bool) -> bool {
    !vnni
}

/// Runs the kernel for `format` on the tile's `rows` rows (1..=[`tile_rows`]).
///
/// # Safety
/// As [`super::columns::group`]; with `vnni`, the CPU has AVX-512 VNNI, BW and VL, else AVX2;
/// both need FMA and F16C.
pub(super) unsafe fn group(format: BlockFormat, t: &GroupTile, rows: usize, vnni: bool) {
    let many = many_rows(vnni) && rows > register_rows(format, vnni);
    per_format!(format, F => match (rows, vnni) {
        _ if many => group_avx2_many::<F>(t, rows),
        (8, true) => group_vnni::<F, 8>(t),
        (7, true) => group_vnni::<F, 7>(t),
        (6, true) => group_vnni::<F, 6>(t),
        (5, true) => group_vnni::<F, 5>(t),
        (4, true) => group_vnni::<F, 4>(t),
        (3, true) => group_vnni::<F, 3>(t),
        (2, true) => group_vnni::<F, 2>(t),
        (_, true) => group_vnni::<F, 1>(t),
        (4, false) => group_avx2::<F, 4>(t),
        (3, false) => group_avx2::<F, 3>(t),
        (2, false) => group_avx2::<F, 2>(t),
        (_, false) => group_avx2::<F, 1>(t),
    })
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn group_avx2<const F: usize, const R: usize>(t: &GroupTile) {
    body::<F, R, false>(t)
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn group_vnni<const F: usize, const R: usize>(t: &GroupTile) {
    body::<F, R, true>(t)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn group_avx2_many<const F: usize>(t: &GroupTile, rows: usize) {
    many::<F>(t, rows)
}

/// The many-rows kernel for `BlockFormat::ALL[F]`, inlined into AVX2's wrapper.
#[inline(always)]
unsafe fn many<const F: usize>(t: &GroupTile, rows: usize) {
    let format = BlockFormat::ALL[F];
    match (format.is_k(), high_bits(format)) {
        _ if format == BlockFormat::Q8_0 => body_q8_many(t, rows),
        (true, 1) => body_k_many::<F, 1>(t, rows),
        (true, _) => body_k_many::<F, 0>(t, rows),
        (false, 1) => body_32_many::<F, 1>(t, rows),
        (false, _) => body_32_many::<F, 0>(t, rows),
    }
}

/// Eight f16 at `at` as f32.
#[inline(always)]
pub(super) unsafe fn f16s(at: *const u8) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(at.cast()))
}

/// Eight signed bytes at `at` as i32.
#[inline(always)]
pub(super) unsafe fn bytes_i32(at: *const u8) -> __m256i {
    _mm256_cvtepi8_epi32(_mm_loadl_epi64(at.cast()))
}

/// The kernel for `BlockFormat::ALL[F]` and `R` rows, inlined into each instruction set's
/// wrapper.
#[inline(always)]
unsafe fn body<const F: usize, const R: usize, const VNNI: bool>(t: &GroupTile) {
    if BlockFormat::ALL[F].is_k() {
        body_k::<F, R, VNNI>(t)
    } else {
        body_32::<F, R, VNNI>(t)
    }
}

/// One activation block of a tile's rows: the first row's part and the rows' distance.
#[derive(Clone, Copy)]
struct Block {
    first: *const i8,
    stride: usize,
}

impl Block {
    /// Activation block `ab` of the tile's rows.
    #[inline(always)]
    unsafe fn of(t: &GroupTile, ab: usize) -> Self {
        Self {
            first: t.q.add(ab * BLOCK),
            stride: t.blocks * BLOCK,
        }
    }

    /// Four activations of row `r` from input `i` of the block, in every 32-bit lane.
    #[inline(always)]
    unsafe fn four(self, r: usize, i: usize) -> __m256i {
        let at = self.first.add(r * self.stride + i);
        _mm256_set1_epi32(std::ptr::read_unaligned(at.cast::<i32>()))
    }
}

/// The 32-weight formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): [`super::columns::add_block`].
#[inline(always)]
unsafe fn body_32<const F: usize, const R: usize, const VNNI: bool>(t: &GroupTile) {
    let format = BlockFormat::ALL[F];
    let (group, values) = (group_block_bytes(format), values_bytes(format));
    // Here AVX2 multiplies Q8_0's values signed (`sums_q8`), so only VNNI's sums carry its offset.
    let offset = match format {
        BlockFormat::Q8_0 if !VNNI => 0,
        _ => offset(format),
    };
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..t.blocks {
        let (w, a) = (t.weights.add(b * group), Block::of(t, b));
        // Each sum starts from what the offset takes off it, loaded ready: the same integers as
        // subtracting it after, without a product, a broadcast and a subtraction per row.
        let mut sums: [__m256i; R] = std::array::from_fn(|r| first_sums(t, r, b, format, offset));
        match format {
            BlockFormat::Q8_0 => sums_q8::<R, VNNI>(w, a, &mut sums),
            _ if high_bits(format) == 1 => sums_nibbles::<R, VNNI, 1>(w, a, &mut sums),
            _ => sums_nibbles::<R, VNNI, 0>(w, a, &mut sums),
        };
        let scales = BlockScales::of(format, w.add(values));
        for (r, acc) in acc.iter_mut().enumerate() {
            *acc = scales.add(format, *acc, sums[r], t, r, b);
        }
    }
    store(t, &acc);
}

/// [`body_32`] for up to [`MANY_ROWS`] rows where [`many_rows`]: each block's values are
/// unpacked once for all the rows (`body_32` unpacks them once per four rows on AVX2, as many as
/// its sixteen registers hold sums for; AVX2 has no masked byte add, so Q5's fifth bits alone
/// took 32 of the Q5_0 loop's 137 vector operations per four rows), and each row's f32 sums wait
/// in memory between blocks (on an Intel Xeon, AVX2, one thread, 32 rows: Q5_0 1.4–1.6× faster,
/// Q4_0 unchanged). The same integers and f32 operations in the same order, so the same bits.
#[inline(always)]
unsafe fn body_32_many<const F: usize, const HIGH: u32>(t: &GroupTile, rows: usize) {
    let format = BlockFormat::ALL[F];
    let (group, values) = (group_block_bytes(format), values_bytes(format));
    let mut acc = [MaybeUninit::uninit(); MANY_ROWS];
    let acc = first_rows(&mut acc, rows, _mm256_setzero_ps());
    for b in 0..t.blocks {
        let (w, a) = (t.weights.add(b * group), Block::of(t, b));
        // No closure (`from_fn`): one would be compiled apart from this function, without AVX2.
        let mut unpacked = [[_mm256_setzero_si256(); 2]; 4];
        for (h, run) in unpacked.iter_mut().enumerate() {
            *run = run_values::<false, HIGH>(w, h);
        }
        let scales = BlockScales::of(format, w.add(values));
        for (r, acc) in acc.iter_mut().enumerate() {
            let sums =
                row_sums::<HIGH>(&unpacked, a, r, first_sums(t, r, b, format, offset(format)));
            *acc = scales.add(format, *acc, sums, t, r, b);
        }
    }
    store(t, acc);
}

/// Q8_0's [`body_32_many`] on AVX2: each block's stored bytes (the values plus 128) split once
/// into their low and high nibbles for all the rows, and each row's sums taken as `Σ low · a +
/// 16 · Σ high · a` from what the offset takes off them. Why: the register kernel's signed
/// product (`sums_q8`) takes a `vpsignb`, a `vpmaddubsw` and a `vpmaddwd` per row and 32
/// multiply-adds, three operations a Zen 4 runs on the same two pipes; nibbles take two
/// `vpmaddubsw` whose 16-bit pairs (at most 2 · 15 · 128 each, eight runs 30,720) add up over
/// the whole block before one `vpmaddwd` per side (`bench/vnni_peak.c` on a Zen 4: 0.47–0.52 ns
/// a row and 32 weights signed, 0.35–0.37 by nibbles).
/// Rows go two at a time, so each unpacked run loaded back (sixteen registers' worth, more than
/// AVX2 keeps beside the sums) serves two rows. The same integers and f32 operations in the
/// same order, so the same bits.
#[inline(always)]
unsafe fn body_q8_many(t: &GroupTile, rows: usize) {
    const TILE: usize = 2;
    let format = BlockFormat::Q8_0;
    let (group, values) = (group_block_bytes(format), values_bytes(format));
    let (ones, sixteens) = (_mm256_set1_epi16(1), _mm256_set1_epi16(16));
    let mut acc = [MaybeUninit::uninit(); MANY_ROWS];
    let acc = first_rows(&mut acc, rows, _mm256_setzero_ps());
    for b in 0..t.blocks {
        let (w, a) = (t.weights.add(b * group), Block::of(t, b));
        let mut unpacked = [[_mm256_setzero_si256(); 2]; 8];
        for (h, run) in unpacked.iter_mut().enumerate() {
            *run = run_values::<false, 0>(w, h);
        }
        let scales = BlockScales::of(format, w.add(values));
        let mut r = 0;
        while r < rows {
            let here = (rows - r).min(TILE);
            let mut pairs = [[_mm256_setzero_si256(); 2]; TILE];
            for (h, sides) in unpacked.iter().enumerate() {
                for (i, pairs) in pairs.iter_mut().enumerate().take(here) {
                    let act = a.four(r + i, 4 * h);
                    for (pairs, &side) in pairs.iter_mut().zip(sides) {
                        *pairs = _mm256_add_epi16(*pairs, _mm256_maddubs_epi16(side, act));
                    }
                }
            }
            for (i, pairs) in pairs.iter().enumerate().take(here) {
                let low = _mm256_madd_epi16(pairs[0], ones);
                let high = _mm256_madd_epi16(pairs[1], sixteens);
                let sums = first_sums(t, r + i, b, format, offset(format));
                let sums = _mm256_add_epi32(sums, _mm256_add_epi32(low, high));
                acc[r + i] = scales.add(format, acc[r + i], sums, t, r + i, b);
            }
            r += here;
        }
    }
    store(t, acc);
}

/// Where row `r`'s sums over activation block `b` start: what `format`'s `offset` (0: none)
/// takes off them, loaded ready.
#[inline(always)]
unsafe fn first_sums(
    t: &GroupTile,
    r: usize,
    b: usize,
    format: BlockFormat,
    offset: i32,
) -> __m256i {
    match offset {
        0 => _mm256_setzero_si256(),
        _ => _mm256_set1_epi32(t.less_offset(r, b, less_offset(format))),
    }
}

/// A 32-weight block's eight f16 scales and minimums as f32.
#[derive(Clone, Copy)]
struct BlockScales {
    d: __m256,
    m: __m256,
}

impl BlockScales {
    /// The scales of the group block whose header is at `head`.
    #[inline(always)]
    unsafe fn of(format: BlockFormat, head: *const u8) -> Self {
        let m = if format.has_minimum() {
            f16s(head.add(MINIMUMS))
        } else {
            _mm256_setzero_ps()
        };
        Self { d: f16s(head), m }
    }

    /// `acc` plus row `r`'s integer `sums` over activation block `b` times `d · row scale`,
    /// then the minimums times the row's scaled sum: [`super::columns::add_block`].
    #[inline(always)]
    unsafe fn add(
        self,
        format: BlockFormat,
        acc: __m256,
        sums: __m256i,
        t: &GroupTile,
        r: usize,
        b: usize,
    ) -> __m256 {
        let a = t.row_block(r, b);
        let both = _mm256_mul_ps(self.d, _mm256_set1_ps(a.scale));
        let acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), both, acc);
        if format.has_minimum() {
            _mm256_fmadd_ps(self.m, _mm256_set1_ps(a.scaled_sum), acc)
        } else {
            acc
        }
    }
}

/// The K formats (Q4_K, Q5_K, Q6_K), activations rounded per 256:
/// [`super::columns::add_k_block`]. Each row's integer total over a block is kept in one i32
/// register and scaled once per 256 inputs.
#[inline(always)]
unsafe fn body_k<const F: usize, const R: usize, const VNNI: bool>(t: &GroupTile) {
    let format = BlockFormat::ALL[F];
    let (group, values) = (group_block_bytes(format), values_bytes(format));
    let q6k = format == BlockFormat::Q6K;
    let mut acc = [_mm256_setzero_ps(); R];
    // The group after next's block asked for meanwhile (the K formats only: `prefetch` says why).
    let ahead = 2 * group_bytes(format, t);
    for b in 0..t.blocks / 8 {
        let w = t.weights.add(b * group);
        prefetch(w, ahead, group);
        let head = w.add(values);
        let mut total = [_mm256_setzero_si256(); R];
        for s in 0..8 {
            let (ab, v) = (b * 8 + s, w.add(s * sub_bytes(format)));
            if q6k {
                for side in 0..2 {
                    // Each side's sums start from what the offset takes off them.
                    let at = less_offset(format) + side;
                    let mut sums: [__m256i; R] =
                        std::array::from_fn(|r| _mm256_set1_epi32(t.less_offset(r, ab, at)));
                    sums_q6k_side::<R, VNNI>(v, Block::of(t, ab), side, &mut sums);
                    let scales = bytes_i32(head.add(Q6K_SCALES + 16 * s + 8 * side));
                    for (total, &sum) in total.iter_mut().zip(&sums) {
                        *total = _mm256_add_epi32(*total, _mm256_mullo_epi32(sum, scales));
                    }
                }
            } else {
                let mut sums = [_mm256_setzero_si256(); R];
                if high_bits(format) == 1 {
                    sums_nibbles::<R, VNNI, 1>(v, Block::of(t, ab), &mut sums)
                } else {
                    sums_nibbles::<R, VNNI, 0>(v, Block::of(t, ab), &mut sums)
                };
                let scales =
                    _mm256_cvtepu8_epi32(_mm_loadl_epi64(head.add(K_SCALES + 8 * s).cast()));
                for (total, &sum) in total.iter_mut().zip(&sums) {
                    *total = _mm256_add_epi32(*total, _mm256_mullo_epi32(sum, scales));
                }
            }
        }
        let scales = KScales::of(format, head);
        for (r, acc) in acc.iter_mut().enumerate() {
            *acc = scales.add(format, *acc, total[r], t, r, b);
        }
    }
    store(t, &acc);
}

/// [`body_k`] for AVX2 and up to [`MANY_ROWS`] rows, as [`body_32_many`] for the 32-weight
/// formats: each sub-block's values unpacked once for all the rows, each row's block total and
/// f32 sums waiting in memory. The same integers and f32 operations in the same order.
#[inline(always)]
unsafe fn body_k_many<const F: usize, const HIGH: u32>(t: &GroupTile, rows: usize) {
    let format = BlockFormat::ALL[F];
    let (group, values) = (group_block_bytes(format), values_bytes(format));
    let mut acc = [MaybeUninit::uninit(); MANY_ROWS];
    let acc = first_rows(&mut acc, rows, _mm256_setzero_ps());
    let mut total = [MaybeUninit::uninit(); MANY_ROWS];
    let total = first_rows(&mut total, rows, _mm256_setzero_si256());
    let ahead = 2 * group_bytes(format, t);
    for b in 0..t.blocks / 8 {
        let w = t.weights.add(b * group);
        prefetch(w, ahead, group);
        let head = w.add(values);
        total.fill(_mm256_setzero_si256());
        for s in 0..8 {
            let (ab, v) = (b * 8 + s, w.add(s * sub_bytes(format)));
            if format == BlockFormat::Q6K {
                for side in 0..2 {
                    let scales = bytes_i32(head.add(Q6K_SCALES + 16 * s + 8 * side));
                    q6k_side_many(t, v, ab, side, scales, total);
                }
            } else {
                let mut unpacked = [[_mm256_setzero_si256(); 2]; 4];
                for (h, run) in unpacked.iter_mut().enumerate() {
                    *run = run_values::<false, HIGH>(v, h);
                }
                let scales =
                    _mm256_cvtepu8_epi32(_mm_loadl_epi64(head.add(K_SCALES + 8 * s).cast()));
                for (r, total) in total.iter_mut().enumerate() {
                    let sums =
                        row_sums::<HIGH>(&unpacked, Block::of(t, ab), r, _mm256_setzero_si256());
                    *total = _mm256_add_epi32(*total, _mm256_mullo_epi32(sums, scales));
                }
            }
        }
        let scales = KScales::of(format, head);
        for (r, acc) in acc.iter_mut().enumerate() {
            *acc = scales.add(format, *acc, total[r], t, r, b);
        }
    }
    store(t, acc);
}

/// One side of a Q6_K sub-block (`v`, activation block `ab`) times its `scales`, added to each
/// row's `totals` on AVX2: its four runs unpacked once, then each row's sums from what the
/// offset takes off them, the integers [`sums_q6k_side`] computes. Two runs' 16-bit pairs (each
/// at most 2 · 63 · 128) are added before they are widened: one `vpmaddwd` per two runs, not per
/// run.
#[inline(always)]
unsafe fn q6k_side_many(
    t: &GroupTile,
    v: *const u8,
    ab: usize,
    side: usize,
    scales: __m256i,
    totals: &mut [__m256i],
) {
    let (ones, a) = (_mm256_set1_epi16(1), Block::of(t, ab));
    let plane = _mm256_loadu_si256(v.add(128 + 32 * side).cast());
    let mut runs = [_mm256_setzero_si256(); 4];
    for (h, run) in runs.iter_mut().enumerate() {
        *run = q6k_values(v, plane, side, h);
    }
    let at = less_offset(BlockFormat::Q6K) + side;
    for (r, total) in totals.iter_mut().enumerate() {
        let mut sums = _mm256_set1_epi32(t.less_offset(r, ab, at));
        for (h, two) in runs.chunks_exact(2).enumerate() {
            let first = _mm256_maddubs_epi16(two[0], a.four(r, 16 * side + 8 * h));
            let second = _mm256_maddubs_epi16(two[1], a.four(r, 16 * side + 8 * h + 4));
            let pairs = _mm256_add_epi16(first, second);
            sums = _mm256_add_epi32(sums, _mm256_madd_epi16(pairs, ones));
        }
        *total = _mm256_add_epi32(*total, _mm256_mullo_epi32(sums, scales));
    }
}

/// A K block's eight f16 scales `d` and minimums' scales `dmin` (Q6_K: none) as f32, and its
/// header (the minimums).
#[derive(Clone, Copy)]
struct KScales {
    d: __m256,
    dmin: __m256,
    head: *const u8,
}

impl KScales {
    /// The scales of the group block whose header is at `head`.
    #[inline(always)]
    unsafe fn of(format: BlockFormat, head: *const u8) -> Self {
        let dmin = match format {
            BlockFormat::Q6K => _mm256_setzero_ps(),
            _ => f16s(head.add(MINIMUMS)),
        };
        Self {
            d: f16s(head),
            dmin,
            head,
        }
    }

    /// `acc` plus row `r`'s integer `total` over K block `b` times `row scale · d`, less (Q4_K,
    /// Q5_K) its minimums' sum times `row scale · dmin`: [`super::columns::add_k_block`].
    #[inline(always)]
    unsafe fn add(
        self,
        format: BlockFormat,
        acc: __m256,
        total: __m256i,
        t: &GroupTile,
        r: usize,
        b: usize,
    ) -> __m256 {
        let scale = _mm256_set1_ps(t.row_block(r, b * 8).scale);
        let acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(scale, self.d), acc);
        if format == BlockFormat::Q6K {
            return acc;
        }
        let minimums = minimum_sums(self.head, t.sums.add(r * t.blocks + b * 8));
        let dmin = _mm256_mul_ps(scale, self.dmin);
        _mm256_fnmadd_ps(_mm256_cvtepi32_ps(minimums), dmin, acc)
    }
}

/// Q4_K's and Q5_K's `Σ minimum · activation sum` over a block's eight sub-blocks, per output:
/// pairs of sub-blocks' minimums (16-bit) by pairs of activation sums (each at most 32 · 127 in
/// magnitude), one `vpmaddwd` a pair.
#[inline(always)]
pub(super) unsafe fn minimum_sums(head: *const u8, sums: *const i32) -> __m256i {
    let mut total = _mm256_setzero_si256();
    for p in 0..4 {
        let rows = head.add(K_SCALES + 64 + 16 * p);
        let pairs = _mm_unpacklo_epi8(
            _mm_loadl_epi64(rows.cast()),
            _mm_loadl_epi64(rows.add(8).cast()),
        );
        let (low, high) = (*sums.add(2 * p), *sums.add(2 * p + 1));
        let both = (low as u16 as u32 | (high as u16 as u32) << 16) as i32;
        let products = _mm256_madd_epi16(_mm256_cvtepu8_epi16(pairs), _mm256_set1_epi32(both));
        total = _mm256_add_epi32(total, products);
    }
    total
}

/// `nibbles` with 16 added to byte `p` where bit `p` of `word` is set (Q5's fifth bits): a
/// masked add on AVX-512 BW, else [`fifth_bits`] or'd in.
#[inline(always)]
pub(super) unsafe fn with_fifth_bits<const VNNI: bool>(nibbles: __m256i, word: u32) -> __m256i {
    if VNNI {
        return _mm256_mask_add_epi8(nibbles, word, nibbles, _mm256_set1_epi8(0x10));
    }
    _mm256_or_si256(nibbles, fifth_bits(word))
}

/// Byte `p` of the result is 16 where bit `p` of `word` is set, else 0, on AVX2: each byte takes
/// the word's byte holding its bit, then tests that bit.
#[inline(always)]
unsafe fn fifth_bits(word: u32) -> __m256i {
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(word as i32),
        _mm256_setr_epi64x(
            0,
            0x0101_0101_0101_0101,
            0x0202_0202_0202_0202,
            0x0303_0303_0303_0303,
        ),
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201_u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    _mm256_and_si256(set, _mm256_set1_epi8(0x10))
}

/// A Q4 or Q5 sub-block's integer sums (both sides together) added to `sums`: four 32-byte
/// runs, each two runs of nibbles, with Q5's fifth bits (`HIGH` 1) from their plane.
#[inline(always)]
unsafe fn sums_nibbles<const R: usize, const VNNI: bool, const HIGH: u32>(
    v: *const u8,
    a: Block,
    sums: &mut [__m256i; R],
) {
    let ones = _mm256_set1_epi16(1);
    // AVX2: 16-bit pair sums of at most 2 · 127 · (2^(4 + HIGH) - 1) each, widened before they
    // can pass 32,767: Q4 after eight (30,480), Q5 after four (31,496).
    let mut pairs = [_mm256_setzero_si256(); R];
    for h in 0..4 {
        let side = run_values::<VNNI, HIGH>(v, h);
        for r in 0..R {
            for (s, &side) in side.iter().enumerate() {
                let act = a.four(r, 16 * s + 4 * h);
                if VNNI {
                    sums[r] = _mm256_dpbusd_epi32(sums[r], side, act);
                } else {
                    pairs[r] = _mm256_add_epi16(pairs[r], _mm256_maddubs_epi16(side, act));
                }
            }
        }
        if !VNNI && widen_after::<HIGH>(h) {
            for r in 0..R {
                sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(pairs[r], ones));
                pairs[r] = _mm256_setzero_si256();
            }
        }
    }
}

/// Run `h` of a Q4 or Q5 sub-block at `v` as its two sides' values (inputs `4h…` and
/// `16 + 4h…`), with Q5's fifth bits (`HIGH` 1) from their plane.
#[inline(always)]
unsafe fn run_values<const VNNI: bool, const HIGH: u32>(v: *const u8, h: usize) -> [__m256i; 2] {
    let low = _mm256_set1_epi8(0x0F);
    let bytes = _mm256_loadu_si256(v.add(32 * h).cast());
    let mut side = [
        _mm256_and_si256(bytes, low),
        _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low),
    ];
    if HIGH == 1 {
        for (s, side) in side.iter_mut().enumerate() {
            let word = std::ptr::read_unaligned(v.add(128 + 4 * (2 * h + s)).cast::<u32>());
            *side = with_fifth_bits::<VNNI>(*side, word);
        }
    }
    side
}

/// Whether AVX2's 16-bit pair sums are widened after run `h` (`sums_nibbles`' bound).
#[inline(always)]
fn widen_after<const HIGH: u32>(h: usize) -> bool {
    if HIGH == 1 {
        h % 2 == 1
    } else {
        h == 3
    }
}

/// Row `r`'s integer sums over a Q4 or Q5 sub-block already unpacked by runs
/// ([`run_values`]), from `sums`, on AVX2: the same products and widenings as
/// [`sums_nibbles`].
#[inline(always)]
unsafe fn row_sums<const HIGH: u32>(
    unpacked: &[[__m256i; 2]; 4],
    a: Block,
    r: usize,
    mut sums: __m256i,
) -> __m256i {
    let ones = _mm256_set1_epi16(1);
    let mut pairs = _mm256_setzero_si256();
    for (h, side) in unpacked.iter().enumerate() {
        for (s, &side) in side.iter().enumerate() {
            let products = _mm256_maddubs_epi16(side, a.four(r, 16 * s + 4 * h));
            pairs = _mm256_add_epi16(pairs, products);
        }
        if widen_after::<HIGH>(h) {
            sums = _mm256_add_epi32(sums, _mm256_madd_epi16(pairs, ones));
            pairs = _mm256_setzero_si256();
        }
    }
    sums
}

/// One side (inputs 0–15 or 16–31) of a Q6_K sub-block added to `sums`: the nibbles of four
/// runs with their top two bits from the side's plane (bits `2h…` for run `h`), values 0–63.
/// AVX2 widens each run's pair sums (at most 2 · 63 · 127) at once.
#[inline(always)]
unsafe fn sums_q6k_side<const R: usize, const VNNI: bool>(
    v: *const u8,
    a: Block,
    side: usize,
    sums: &mut [__m256i; R],
) {
    let ones = _mm256_set1_epi16(1);
    let plane = _mm256_loadu_si256(v.add(128 + 32 * side).cast());
    for h in 0..4 {
        let values = q6k_values(v, plane, side, h);
        for (r, sum) in sums.iter_mut().enumerate() {
            let act = a.four(r, 16 * side + 4 * h);
            *sum = if VNNI {
                _mm256_dpbusd_epi32(*sum, values, act)
            } else {
                let products = _mm256_madd_epi16(_mm256_maddubs_epi16(values, act), ones);
                _mm256_add_epi32(*sum, products)
            };
        }
    }
}

/// Run `h` of a Q6_K sub-block at `v`, one side (inputs 0–15 or 16–31), as whole values 0–63:
/// the side's nibbles with their top two bits from the side's `plane` (bits `2h…`).
#[inline(always)]
pub(super) unsafe fn q6k_values(v: *const u8, plane: __m256i, side: usize, h: usize) -> __m256i {
    let (low, top) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30));
    let bytes = _mm256_loadu_si256(v.add(32 * h).cast());
    let nibbles = match side {
        0 => _mm256_and_si256(bytes, low),
        _ => _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low),
    };
    // Bits 2h… of each plane byte moved to bits 4–5.
    let moved = match h {
        0 => _mm256_slli_epi16(plane, 4),
        1 => _mm256_slli_epi16(plane, 2),
        2 => plane,
        _ => _mm256_srli_epi16(plane, 2),
    };
    _mm256_or_si256(nibbles, _mm256_and_si256(moved, top))
}

/// A Q8_0 block's integer sums added to `sums`: eight runs of offset bytes. AVX2 multiplies the
/// signed values (magnitudes by signed activations: each pair at most 2 × 128 × 127, no
/// saturation).
#[inline(always)]
unsafe fn sums_q8<const R: usize, const VNNI: bool>(
    w: *const u8,
    a: Block,
    sums: &mut [__m256i; R],
) {
    let (flip, ones) = (_mm256_set1_epi8(-128), _mm256_set1_epi16(1));
    for h in 0..8 {
        let v = _mm256_loadu_si256(w.add(32 * h).cast());
        if VNNI {
            for (r, sum) in sums.iter_mut().enumerate() {
                *sum = _mm256_dpbusd_epi32(*sum, v, a.four(r, 4 * h));
            }
        } else {
            let signed = _mm256_xor_si256(v, flip);
            let magnitude = _mm256_abs_epi8(signed);
            for (r, sum) in sums.iter_mut().enumerate() {
                let pairs =
                    _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(a.four(r, 4 * h), signed));
                *sum = _mm256_add_epi32(*sum, _mm256_madd_epi16(pairs, ones));
            }
        }
    }
}

/// Adds the bias and stores the group's outputs that exist, of `acc`'s rows.
#[inline(always)]
pub(super) unsafe fn store(t: &GroupTile, acc: &[__m256]) {
    for (r, &v) in acc.iter().enumerate() {
        let out = t.out.add(r * t.n);
        if t.cols == COLUMNS {
            let v = match t.bias {
                Some(b) => _mm256_add_ps(v, _mm256_loadu_ps(b)),
                None => v,
            };
            _mm256_storeu_ps(out, v);
        } else {
            let mut lanes = [0f32; COLUMNS];
            _mm256_storeu_ps(lanes.as_mut_ptr(), v);
            for (c, &v) in lanes.iter().enumerate().take(t.cols) {
                *out.add(c) = t.bias.map_or(v, |b| v + *b.add(c));
            }
        }
    }
}
