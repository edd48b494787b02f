//! The column layout's product ([`super::columns`]) on x86-64: AVX-512 VNNI's `vpdpbusd` on
//! 256-bit registers (four unsigned weights by four signed activations added into each output's
//! 32-bit sum, one instruction: products of fewer rows than [`super::columns_zmm`]'s whole tile
//! on AMD's Zen 4 and 5, which run a 512-bit instruction as two halves), or AVX2's
//! `vpmaddubsw`/`vpmaddwd` where there is no VNNI: here its register kernels (up to four rows),
//! [`super::columns_avx2_pair`] its products of more. Both compute each sub-block's integer sums
//! exactly and then the portable definition's f32 operations in its order.

use super::columns::{
    group_block_bytes, group_bytes, high_bits, less_offset, offset, per_format, prefetch,
    sub_bytes, values_bytes, GroupTile, COLUMNS, K_SCALES, MINIMUMS, Q6K_SCALES,
};
use super::{BlockFormat, BLOCK};
use std::arch::x86_64::*;

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

/// Rows one call multiplies: on AVX2 up to [`MANY_ROWS`] (more than [`register_rows`] go to
/// [`super::columns_avx2_pair`]), else [`register_rows`]. Not more on VNNI: the 256-bit VNNI
/// kernel runs only products of fewer rows than the 512-bit kernel's whole tile
/// (`super::Kernel::for_rows`).
pub(super) fn tile_rows(format: BlockFormat, vnni: bool) -> usize {
    if vnni {
        register_rows(format, vnni)
    } else {
        MANY_ROWS
    }
}

/// Rows one many-rows call takes: a decoding step's batch, or a prompt step's row block
/// (`super::ROW_BLOCK`), whose rows all share each block's unpacking.
pub(super) const MANY_ROWS: usize = 64;

/// Runs the register kernel for `format` on the tile's `rows` rows (1..=[`register_rows`]).
///
/// # Safety
/// As [`super::columns::group`]; with `vnni`, the CPU has AVX-512 VNNI, BW and VL, else AVX2;
/// both need FMA and F16C.
pub(super) unsafe fn group(format: BlockFormat, t: &GroupTile, rows: usize, vnni: bool) {
    per_format!(format, F => match (rows, vnni) {
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

/// Whether AVX2 multiplies `m` rows' activations as unsigned bytes, two groups a call
/// ([`group_pair`]): where a tile can hold more rows than the register kernels take.
pub(super) fn reads_unsigned(m: usize) -> bool {
    m > register_rows(BlockFormat::Q5_0, false)
}

/// AVX2's kernel for a tile of two groups (`super::Kernel::group_width`) and its `rows` rows
/// (1..=[`MANY_ROWS`]): more rows than the register kernels take both groups at once
/// ([`super::columns_avx2_pair`]), a remainder of fewer each group by [`group`].
///
/// # Safety
/// As [`super::columns::group`], with two groups' weights (the second after the first) and the
/// activations as unsigned bytes (`GroupTile::unsigned` not null); the CPU has AVX2, FMA and
/// F16C.
pub(super) unsafe fn group_pair(format: BlockFormat, t: &GroupTile, rows: usize) {
    if rows > register_rows(format, false) {
        return per_format!(format, F => super::columns_avx2_pair::group::<F>(t, rows));
    }
    for half in halves(format, t).into_iter().flatten() {
        group(format, &half, rows, false);
    }
}

/// A tile of two groups as one tile per group: the first, and the second if any of its
/// outputs exist.
pub(super) unsafe fn halves(format: BlockFormat, t: &GroupTile) -> [Option<GroupTile>; 2] {
    let first = GroupTile {
        cols: t.cols.min(COLUMNS),
        ..*t
    };
    let second = (t.cols > COLUMNS).then(|| GroupTile {
        weights: t.weights.add(group_bytes(format, t)),
        out: t.out.add(COLUMNS),
        cols: t.cols - COLUMNS,
        bias: t.bias.map(|b| b.add(COLUMNS)),
        ..*t
    });
    [Some(first), second]
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn group_avx2<const F: usize, const R: usize>(t: &GroupTile) {
    body::<F, R, false>(t)
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn group_vnni<const F: usize, const R: usize>(t: &GroupTile) {
    body::<F, R, true>(t)
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
pub(super) struct Block {
    first: *const i8,
    stride: usize,
}

impl Block {
    /// Activation block `ab` of the tile's rows.
    #[inline(always)]
    pub(super) unsafe fn of(t: &GroupTile, ab: usize) -> Self {
        Self {
            first: t.q.add(ab * BLOCK),
            stride: t.blocks * BLOCK,
        }
    }

    /// The same of the activations as unsigned bytes (`GroupTile::unsigned`).
    #[inline(always)]
    pub(super) unsafe fn of_unsigned(t: &GroupTile, ab: usize) -> Self {
        Self {
            first: t.unsigned.add(ab * BLOCK).cast(),
            stride: t.blocks * BLOCK,
        }
    }

    /// Four activations of row `r` from input `i` of the block, in every 32-bit lane.
    #[inline(always)]
    pub(super) unsafe fn four(self, r: usize, i: usize) -> __m256i {
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
pub(super) struct BlockScales {
    d: __m256,
    m: __m256,
}

impl BlockScales {
    /// The scales of the group block whose header is at `head`.
    #[inline(always)]
    pub(super) unsafe fn of(format: BlockFormat, head: *const u8) -> Self {
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
    pub(super) unsafe fn add(
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

/// A K block's eight f16 scales `d` and minimums' scales `dmin` (Q6_K: none) as f32, and its
/// header (the minimums).
#[derive(Clone, Copy)]
pub(super) struct KScales {
    d: __m256,
    dmin: __m256,
    head: *const u8,
}

impl KScales {
    /// The scales of the group block whose header is at `head`.
    #[inline(always)]
    pub(super) unsafe fn of(format: BlockFormat, head: *const u8) -> Self {
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
    pub(super) unsafe fn add(
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
pub(super) unsafe fn run_values<const VNNI: bool, const HIGH: u32>(
    v: *const u8,
    h: usize,
) -> [__m256i; 2] {
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
