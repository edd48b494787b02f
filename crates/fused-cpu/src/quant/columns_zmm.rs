//! The column layout's product ([`super::columns`]) on AVX-512 VNNI's 512-bit registers: two
//! column groups (16 outputs) a call, each group's 32-byte run in one half of a register.
//!
//! Why: on an Intel Xeon a 512-bit `vpdpbusd` issues at nearly the rate of a 256-bit one (0.139
//! ns against 0.127 on the 2-vCPU Xeon measured: 459 against 252 billion multiply-adds a second,
//! `bench/vnni_peak.c`), so one instruction does twice the work; and each row's activation
//! broadcast and f32 scaling then serve 16 outputs. AMD's Zen 4 runs a 512-bit instruction as
//! two 256-bit halves (0.273 against 0.137 ns), yet this kernel still ran faster there than the
//! 256-bit one, with half the instructions to issue and track: one thread, 32 rows, both in one
//! process, Q8_0 1.23×, Q4_0 1.19×, Q4_K 1.15×, Q6_K 1.13×, Q5_K 1.08×, Q4_1 and Q5_1 1.05×; at
//! one row 1.00–1.15× (Q5_0 1.08–1.13×), weights in the caches. But one answer at a time, the
//! weights streamed from memory, it ran 0.73–0.76× in the decoder, so on AMD a product of fewer
//! rows than a whole tile runs 256-bit (`super::Kernel::for_rows`). Q5_0 beyond a whole tile
//! takes all of a call's rows a block at a time ([`many_rows`]).
//!
//! **The same numbers**: the integer sums are the 256-bit kernel's ([`super::columns_x86`]), lane
//! for lane, and each row takes its f32 operations in its order on 16 lanes instead of 8, so all
//! kernels agree bit for bit.

use super::columns::{
    first_rows, group_block_bytes, group_bytes, high_bits, less_offset, offset, per_format,
    prefetch, sub_bytes, values_bytes, GroupTile, COLUMNS, K_SCALES, MINIMUMS, Q6K_SCALES,
};
use super::columns_x86::{minimum_sums, q6k_values, MANY_ROWS};
use super::{BlockFormat, BLOCK};
use std::arch::x86_64::*;
use std::mem::MaybeUninit;

/// Rows one call multiplies: each keeps two 512-bit registers (its sums and its f32 total),
/// 16 of the 32 (Q6_K, which keeps a side's sums beside its total, four); where
/// [`many_rows`], up to `MANY_ROWS`.
pub(super) fn tile_rows(format: BlockFormat) -> usize {
    match format {
        BlockFormat::Q6K => 4,
        _ if many_rows(format) => MANY_ROWS,
        _ => WHOLE_TILE,
    }
}

/// The rows of a whole tile (but Q6_K's): on AMD, products of fewer rows run 256-bit
/// (`super::Kernel::for_rows`).
pub(super) const WHOLE_TILE: usize = 8;

/// Whether `format`'s tiles of more than [`WHOLE_TILE`] rows run [`body_32_many`], each block
/// unpacked once for all of them: Q5_0 on AMD, whose register kernel runs short of registers
/// (its fifth bits and offsets beside eight rows' sums). On a Zen 4, one thread, Q5_0 4,864 ×
/// 896 and 896 × 896, both kernels in one process, 12 alternated pairs, the same bits: 1.07–1.18×
/// the 256-bit many-rows kernel at 9 to 64 rows (1.14–1.18× at 32), and 0.95–0.96× this file's
/// register kernel at 8 (so not there); Q4_0 and Q4_1 0.95–0.99× the register kernel at 16 to
/// 64 rows, Q5_1 0.99–1.05× (not taken). Not on Intel, where it has not been measured.
fn many_rows(format: BlockFormat) -> bool {
    format == BlockFormat::Q5_0 && crate::packed::amd()
}

/// Runs the kernel for `format` on the tile's `rows` rows (1..=[`tile_rows`]) and its two
/// groups (`t.cols` outputs, 1..=16).
///
/// # Safety
/// As [`super::columns::group`], with two groups' weights (the second after the first); the
/// CPU has AVX-512 F, BW, VL and VNNI, FMA and F16C.
pub(super) unsafe fn group(format: BlockFormat, t: &GroupTile, rows: usize) {
    let many = rows > WHOLE_TILE && many_rows(format);
    per_format!(format, F => match rows {
        _ if many => body_32_many::<F>(t, rows),
        8 => pair::<F, 8>(t),
        7 => pair::<F, 7>(t),
        6 => pair::<F, 6>(t),
        5 => pair::<F, 5>(t),
        4 => pair::<F, 4>(t),
        3 => pair::<F, 3>(t),
        2 => pair::<F, 2>(t),
        _ => pair::<F, 1>(t),
    })
}

/// Where a call reads its two groups' blocks.
#[derive(Clone, Copy)]
struct Pair {
    first: *const u8,
    second: *const u8,
}

impl Pair {
    /// Block `b` (of the format's size) of each group.
    #[inline(always)]
    unsafe fn block(self, format: BlockFormat, b: usize) -> [*const u8; 2] {
        let at = b * group_block_bytes(format);
        [self.first.add(at), self.second.add(at)]
    }
}

/// Asks for the next pair's block (two groups on from each of `w`) in the second-level cache,
/// every format ([`prefetch`] says why); the AMX kernel's too.
#[inline(always)]
pub(super) fn prefetch_next(format: BlockFormat, t: &GroupTile, w: [*const u8; 2]) {
    let (ahead, bytes) = (2 * group_bytes(format, t), group_block_bytes(format));
    prefetch(w[0], ahead, bytes);
    prefetch(w[1], ahead, bytes);
}

/// 32 bytes of each group at `at` from its block `w`, side by side.
#[inline(always)]
unsafe fn runs(w: [*const u8; 2], at: usize) -> __m512i {
    let low = _mm512_castsi256_si512(_mm256_loadu_si256(w[0].add(at).cast()));
    _mm512_inserti64x4::<1>(low, _mm256_loadu_si256(w[1].add(at).cast()))
}

/// Eight f16 of each group, at `at` from each group's block `w`, as 16 f32.
#[inline(always)]
pub(super) unsafe fn f16s(w: [*const u8; 2], at: usize) -> __m512 {
    let both = _mm256_inserti128_si256::<1>(
        _mm256_castsi128_si256(_mm_loadu_si128(w[0].add(at).cast())),
        _mm_loadu_si128(w[1].add(at).cast()),
    );
    _mm512_cvtph_ps(both)
}

/// Eight bytes of each group, at `at` from each group's block `w`, side by side.
#[inline(always)]
pub(super) unsafe fn bytes(w: [*const u8; 2], at: usize) -> __m128i {
    _mm_unpacklo_epi64(
        _mm_loadl_epi64(w[0].add(at).cast()),
        _mm_loadl_epi64(w[1].add(at).cast()),
    )
}

/// A block's f32 scales for two groups: `d`, and the minimum's (the 32-weight formats with one)
/// or `dmin` (Q4_K, Q5_K); zero where the format has none.
#[derive(Clone, Copy)]
pub(super) struct Scales {
    d: __m512,
    m: __m512,
}

impl Scales {
    /// Those of each group's block `w`.
    #[inline(always)]
    pub(super) unsafe fn of(format: BlockFormat, w: [*const u8; 2]) -> Self {
        let values = values_bytes(format);
        Self {
            d: f16s(w, values),
            m: match format.has_minimum() {
                true => f16s(w, values + MINIMUMS),
                false => _mm512_setzero_ps(),
            },
        }
    }

    /// `acc` plus row `r`'s 32-weight block `b` from its integer sums (offset taken off), as
    /// `columns_x86::body_32` adds it: `d · row scale`, then the minimum.
    #[inline(always)]
    pub(super) unsafe fn add_32(
        self,
        format: BlockFormat,
        t: &GroupTile,
        (r, b): (usize, usize),
        sums: __m512i,
        acc: __m512,
    ) -> __m512 {
        let a = t.row_block(r, b);
        let both = _mm512_mul_ps(self.d, _mm512_set1_ps(a.scale));
        let acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), both, acc);
        match format.has_minimum() {
            true => _mm512_fmadd_ps(self.m, _mm512_set1_ps(a.scaled_sum), acc),
            false => acc,
        }
    }

    /// `acc` plus row `r`'s K block `b` (of 256) from its scaled integer total, as
    /// `columns_x86::body_k` adds it: `T · (row scale · d)`, then for Q4_K and Q5_K the
    /// minimums' sum times `−(row scale · dmin)`.
    #[inline(always)]
    pub(super) unsafe fn add_k(
        self,
        format: BlockFormat,
        t: &GroupTile,
        (r, b): (usize, usize),
        w: [*const u8; 2],
        total: __m512i,
        acc: __m512,
    ) -> __m512 {
        let scale = _mm512_set1_ps(t.row_block(r, b * 8).scale);
        let acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(scale, self.d), acc);
        if !format.has_minimum() {
            return acc;
        }
        let (values, sums) = (values_bytes(format), t.sums.add(r * t.blocks + b * 8));
        let minimums = _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(minimum_sums(w[0].add(values), sums)),
            minimum_sums(w[1].add(values), sums),
        );
        let dmin = _mm512_mul_ps(scale, self.m);
        _mm512_fnmadd_ps(_mm512_cvtepi32_ps(minimums), dmin, acc)
    }
}

/// Four activations of row `r` from input `i` of activation block `ab`, in every lane.
#[inline(always)]
unsafe fn four(t: &GroupTile, r: usize, ab: usize, i: usize) -> __m512i {
    let at = t.q.add(r * t.blocks * BLOCK + ab * BLOCK + i);
    _mm512_set1_epi32(std::ptr::read_unaligned(at.cast::<i32>()))
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn pair<const F: usize, const R: usize>(t: &GroupTile) {
    let format = BlockFormat::ALL[F];
    let pair = Pair {
        first: t.weights,
        second: t.weights.add(group_bytes(format, t)),
    };
    let acc = if format.is_k() {
        body_k::<F, R>(t, pair)
    } else {
        body_32::<F, R>(t, pair)
    };
    store(t, &acc);
}

/// The 32-weight formats, as `columns_x86::body_32` on 16 lanes.
#[inline(always)]
unsafe fn body_32<const F: usize, const R: usize>(t: &GroupTile, pair: Pair) -> [__m512; R] {
    let format = BlockFormat::ALL[F];
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..t.blocks {
        let w = pair.block(format, b);
        prefetch_next(format, t, w);
        let mut sums: [__m512i; R] = std::array::from_fn(|r| match offset(format) {
            0 => _mm512_setzero_si512(),
            _ => _mm512_set1_epi32(t.less_offset(r, b, less_offset(format))),
        });
        if format == BlockFormat::Q8_0 {
            for h in 0..8 {
                let v = runs(w, 32 * h);
                for (r, sum) in sums.iter_mut().enumerate() {
                    *sum = _mm512_dpbusd_epi32(*sum, v, four(t, r, b, 4 * h));
                }
            }
        } else if high_bits(format) == 1 {
            sums_nibbles::<R, 1>(t, w, 0, b, &mut sums);
        } else {
            sums_nibbles::<R, 0>(t, w, 0, b, &mut sums);
        }
        let scales = Scales::of(format, w);
        for (r, acc) in acc.iter_mut().enumerate() {
            *acc = scales.add_32(format, t, (r, b), sums[r], *acc);
        }
    }
    acc
}

/// A Q4 or Q5 sub-block (at `at` in blocks `w`) of activation block `ab`, both sides, added to
/// `sums`: each group's four runs side by side ([`run_sides`]).
#[inline(always)]
unsafe fn sums_nibbles<const R: usize, const HIGH: u32>(
    t: &GroupTile,
    w: [*const u8; 2],
    at: usize,
    ab: usize,
    sums: &mut [__m512i; R],
) {
    for h in 0..4 {
        let side = run_sides::<HIGH>(w, at, h);
        for (r, sum) in sums.iter_mut().enumerate() {
            for (s, &side) in side.iter().enumerate() {
                *sum = _mm512_dpbusd_epi32(*sum, side, four(t, r, ab, 16 * s + 4 * h));
            }
        }
    }
}

/// The 32-weight nibble formats on many rows (up to `MANY_ROWS`; Q5_0 where [`many_rows`]):
/// each block's two groups unpacked once for all the call's rows, as
/// `columns_x86::body_32_many` on 16 lanes; each row's eight `vpdpbusd` in two chains, one per
/// side, and its f32 sums in memory between blocks.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn body_32_many<const F: usize>(t: &GroupTile, rows: usize) {
    let format = BlockFormat::ALL[F];
    debug_assert!(
        !format.is_k() && format != BlockFormat::Q8_0,
        "{format:?}: not nibbles"
    );
    let pair = Pair {
        first: t.weights,
        second: t.weights.add(group_bytes(format, t)),
    };
    let mut acc = [MaybeUninit::uninit(); MANY_ROWS];
    let acc = first_rows(&mut acc, rows, _mm512_setzero_ps());
    for b in 0..t.blocks {
        let w = pair.block(format, b);
        prefetch_next(format, t, w);
        // No closure (`from_fn`): one would be compiled apart from this function, without AVX-512.
        let mut unpacked = [[_mm512_setzero_si512(); 2]; 4];
        for (h, run) in unpacked.iter_mut().enumerate() {
            *run = match high_bits(format) {
                1 => run_sides::<1>(w, 0, h),
                _ => run_sides::<0>(w, 0, h),
            };
        }
        let scales = Scales::of(format, w);
        for (r, acc) in acc.iter_mut().enumerate() {
            let first = match offset(format) {
                0 => _mm512_setzero_si512(),
                _ => _mm512_set1_epi32(t.less_offset(r, b, less_offset(format))),
            };
            let mut sides = [first, _mm512_setzero_si512()];
            for (h, run) in unpacked.iter().enumerate() {
                for (s, &side) in run.iter().enumerate() {
                    sides[s] = _mm512_dpbusd_epi32(sides[s], side, four(t, r, b, 16 * s + 4 * h));
                }
            }
            let sums = _mm512_add_epi32(sides[0], sides[1]);
            *acc = scales.add_32(format, t, (r, b), sums, *acc);
        }
    }
    store(t, acc);
}

/// Run `h` of each group's Q4 or Q5 sub-block at `at` from blocks `w`, as its two sides'
/// values (inputs `4h…` and `16 + 4h…`), with Q5's fifth bits (`HIGH` 1) by a masked add (each
/// group's 32-bit word of them in its half of the mask).
#[inline(always)]
unsafe fn run_sides<const HIGH: u32>(w: [*const u8; 2], at: usize, h: usize) -> [__m512i; 2] {
    let (low, sixteen) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0x10));
    let bytes = runs(w, at + 32 * h);
    let mut side = [
        _mm512_and_si512(bytes, low),
        _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low),
    ];
    if HIGH == 1 {
        for (s, side) in side.iter_mut().enumerate() {
            let word = |g: usize| {
                let at = w[g].add(at + 128 + 4 * (2 * h + s));
                u64::from(std::ptr::read_unaligned(at.cast::<u32>()))
            };
            *side = _mm512_mask_add_epi8(*side, word(0) | word(1) << 32, *side, sixteen);
        }
    }
    side
}

/// The K formats, as `columns_x86::body_k` on 16 lanes.
#[inline(always)]
unsafe fn body_k<const F: usize, const R: usize>(t: &GroupTile, pair: Pair) -> [__m512; R] {
    let format = BlockFormat::ALL[F];
    let values = values_bytes(format);
    let q6k = format == BlockFormat::Q6K;
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..t.blocks / 8 {
        let w = pair.block(format, b);
        prefetch_next(format, t, w);
        let mut total = [_mm512_setzero_si512(); R];
        for s in 0..8 {
            let (ab, at) = (b * 8 + s, s * sub_bytes(format));
            if q6k {
                for side in 0..2 {
                    let first = less_offset(format) + side;
                    let mut sums: [__m512i; R] =
                        std::array::from_fn(|r| _mm512_set1_epi32(t.less_offset(r, ab, first)));
                    sums_q6k_side::<R>(t, w, at, ab, side, &mut sums);
                    let scales = bytes(w, values + Q6K_SCALES + 16 * s + 8 * side);
                    let scales = _mm512_cvtepi8_epi32(scales);
                    for (total, &sum) in total.iter_mut().zip(&sums) {
                        *total = _mm512_add_epi32(*total, _mm512_mullo_epi32(sum, scales));
                    }
                }
            } else {
                let mut sums = [_mm512_setzero_si512(); R];
                if high_bits(format) == 1 {
                    sums_nibbles::<R, 1>(t, w, at, ab, &mut sums);
                } else {
                    sums_nibbles::<R, 0>(t, w, at, ab, &mut sums);
                }
                let scales = _mm512_cvtepu8_epi32(bytes(w, values + K_SCALES + 8 * s));
                for (total, &sum) in total.iter_mut().zip(&sums) {
                    *total = _mm512_add_epi32(*total, _mm512_mullo_epi32(sum, scales));
                }
            }
        }
        let scales = Scales::of(format, w);
        for (r, acc) in acc.iter_mut().enumerate() {
            *acc = scales.add_k(format, t, (r, b), w, total[r], *acc);
        }
    }
    acc
}

/// One side of a Q6_K sub-block (at `at` in blocks `w`) of activation block `ab` added to
/// `sums`, each group's values from its own plane.
#[inline(always)]
unsafe fn sums_q6k_side<const R: usize>(
    t: &GroupTile,
    w: [*const u8; 2],
    at: usize,
    ab: usize,
    side: usize,
    sums: &mut [__m512i; R],
) {
    let (v0, v1) = (w[0].add(at), w[1].add(at));
    let planes = [
        _mm256_loadu_si256(v0.add(128 + 32 * side).cast()),
        _mm256_loadu_si256(v1.add(128 + 32 * side).cast()),
    ];
    for h in 0..4 {
        let low = _mm512_castsi256_si512(q6k_values(v0, planes[0], side, h));
        let values = _mm512_inserti64x4::<1>(low, q6k_values(v1, planes[1], side, h));
        for (r, sum) in sums.iter_mut().enumerate() {
            *sum = _mm512_dpbusd_epi32(*sum, values, four(t, r, ab, 16 * side + 4 * h));
        }
    }
}

/// Adds the bias and stores the outputs that exist (`t.cols`) of `acc`'s rows.
#[inline(always)]
pub(super) unsafe fn store(t: &GroupTile, acc: &[__m512]) {
    let mask: __mmask16 = if t.cols >= 2 * COLUMNS {
        0xFFFF
    } else {
        (1u16 << t.cols) - 1
    };
    let bias = match t.bias {
        Some(b) => _mm512_maskz_loadu_ps(mask, b),
        None => _mm512_setzero_ps(),
    };
    for (r, &v) in acc.iter().enumerate() {
        let v = if t.bias.is_some() {
            _mm512_add_ps(v, bias)
        } else {
            v
        };
        _mm512_mask_storeu_ps(t.out.add(r * t.n), mask, v);
    }
}
