//! The column layout's product ([`super::columns`]) on AMX tiles (Intel Sapphire Rapids and
//! later), 16 activation rows by two groups (16 outputs) at once; the rows left over (fewer than
//! 16) go to VNNI's 512-bit kernel ([`super::columns_zmm`]), which ran as fast as the tiles at 12
//! rows and faster below (one thread, Qwen2.5-0.5B-shape matrices: the tiles 0.76–1.09× it at
//! 12 rows, 0.93–1.39× at 16, 1.07–1.45× at 32).
//!
//! Why: at 16 rows the (256-bit) VNNI kernel spends, per row, 32-weight sub-block and group of eight
//! outputs, eight `vpdpbusd` and their broadcasts beside its scaling; one `tdpbsud` computes
//! the integer sums of 16 rows by 16 outputs (a 16 × 32 tile of the rows' signed bytes by an
//! 8 × 64 tile of the two groups' unsigned values), so what is left per row is the scaling.
//! A tile instruction costs about a cycle per row it loads, multiplies or stores whatever its
//! width, so the tiles are as wide as the 32 inputs a block's scale allows: on one Xeon thread,
//! one group (8 outputs) a tile ran no faster than VNNI.
//!
//! **The same numbers as every other kernel.** The tile's sums are each sub-block's exact
//! integer sums (for Q6_K each 16 inputs' side, from a 16-input tile), which do not depend on
//! the order they are added in; they are stored, and every row then takes exactly the VNNI
//! kernel's integer and f32 operations in its order ([`super::columns_x86`]: the offsets'
//! entries added, the K formats' integer scales, one fused multiply-add per sub-block or block),
//! on 16 lanes instead of 8. So AMX, VNNI, AVX2 and the portable definition agree bit for bit,
//! and which of AMX and VNNI a tile of rows runs on (by how many rows are left) never changes a
//! row's result.
//!
//! **The weight tile** is the layout's runs side by side: run `h`, byte `4c + j` holds output
//! `c`'s input `4h + j`, which is how a `tdpbssd` B tile's row `h` is laid out, so row `h` is
//! the first group's run then the second's, unpacked to whole signed bytes, each format's offset
//! taken off (the low nibbles as rows 0–3, the high as rows 4–7, with Q5's fifth bits and
//! Q6_K's top two; Q8_0's flipped): `Σ (v − offset) · a` is the same integer as the other
//! kernels' `Σ v · a − offset · Σ a`, with nothing left to add per row. A pair of groups is
//! unpacked once per call, for every row tile of the call's rows (up to 64: a decoding step at
//! batch 32 unpacks once where it multiplies twice). The row tile reads the rows' 8-bit
//! activations where they are. The layout pads every matrix to an even number of groups.
//!
//! **Pipelined:** a unit's tiles (a block's; a K format's 256's) are multiplied one unit ahead
//! of its scaling, so no vector load waits on the sums a tile just stored (such a load is not
//! forwarded: in step, the kernel was slower than VNNI's).

use super::columns::{
    group_block_bytes, group_bytes, high_bits, offset, per_format, sub_bytes, subs, values_bytes,
    GroupTile, K_SCALES, PAIR, Q6K_SCALES,
};
use super::columns_x86::{q6k_values, with_fifth_bits};
use super::columns_zmm::{self, bytes, store, Scales};
use super::{BlockFormat, BLOCK};
use crate::packed::amx::{configure_with, tile, Config};
use std::arch::x86_64::*;

/// Rows one call multiplies: a block of rows (`super::ROW_BLOCK`), in row tiles of [`TILE`].
pub(super) const ROWS: usize = 64;

/// Rows of one row tile.
const TILE: usize = 16;

/// Outputs one call multiplies: two column groups.
const WIDTH: usize = PAIR;

/// Bytes of one sub-block of two groups unpacked: eight rows of 16 outputs' four bytes.
const SUB: usize = 8 * 64;

/// tmm0–1 the sums (16 rows of 16 i32), tmm2 the rows' 32-input blocks, tmm3 a sub-block's
/// weights (8 rows of 16 outputs' 4 bytes); tmm4–5 the same for Q6_K's 16-input sides.
static INT8: Config = Config::new(&[(16, 64), (16, 64), (16, 32), (8, 64), (16, 16), (4, 64)]);

/// Runs the tile kernel for `format` on the tile's `rows` rows (1..=[`ROWS`]) and its two
/// groups (`t.cols` outputs, 1..=[`WIDTH`]): whole row tiles of 16, and VNNI's 512-bit kernel
/// for the rows left.
///
/// # Safety
/// As [`super::columns::group`], with two groups' weights (the second after the first); the
/// CPU has AMX-INT8 (the process granted the tile state), AVX-512 VNNI, BW and VL, FMA and
/// F16C.
pub(super) unsafe fn group(format: BlockFormat, t: &GroupTile, rows: usize) {
    let tiled = rows - rows % TILE;
    if tiled > 0 {
        per_format!(format, F => tiles::<F>(t, tiled))
    }
    // The rows left, on VNNI's 512-bit kernel (an Intel core's: every CPU with AMX is one).
    let tall = columns_zmm::tile_rows(format);
    for first in (tiled..rows).step_by(tall) {
        columns_zmm::group(format, &t.rows_from(first), tall.min(rows - first));
    }
}

/// Each thread's unpacked weights (16 bytes an input: 14 KiB for 896 inputs) and two units'
/// tiles of sums (32 KiB: zeroed on the stack at each call they took as long as its products).
struct Scratch {
    stage: Vec<u8>,
    sums: [Unit; 2],
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Box<Scratch>> = std::cell::RefCell::new(Box::new(Scratch {
        stage: Vec::new(),
        sums: [Unit::EMPTY, Unit::EMPTY],
    }));
}

/// [`group`]'s row tiles for `BlockFormat::ALL[F]` (`rows` a whole number of them), with this
/// thread's scratch.
unsafe fn tiles<const F: usize>(t: &GroupTile, rows: usize) {
    SCRATCH.with(|scratch| {
        let scratch = &mut **scratch.borrow_mut();
        // Aligned to 64 bytes within the buffer, as a tile row is best loaded.
        scratch.stage.resize(t.blocks * SUB + 64, 0);
        let skip = scratch.stage.as_ptr().align_offset(64);
        let stage = &mut scratch.stage[skip..][..t.blocks * SUB];
        unpack::<F>(t, stage);
        for first in (0..rows).step_by(TILE) {
            let tile = t.rows_from(first);
            let ahead = first == 0;
            pipeline::<F>(&tile, stage, &mut scratch.sums, ahead);
        }
    })
}

/// The two groups' every sub-block unpacked into `stage` ([`SUB`] bytes each, in order).
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl")]
unsafe fn unpack<const F: usize>(t: &GroupTile, stage: &mut [u8]) {
    let format = BlockFormat::ALL[F];
    let second = t.weights.add(group_bytes(format, t));
    for (ab, to) in stage.chunks_exact_mut(SUB).enumerate() {
        let (u, s) = (ab / subs(format), ab % subs(format));
        let at = u * group_block_bytes(format) + s * sub_bytes(format);
        for (g, w) in [t.weights, second].into_iter().enumerate() {
            unpack_sub::<F>(w.add(at), to.as_mut_ptr().add(32 * g));
        }
    }
}

/// One row tile (16 rows) by the pair over every unit: each
/// unit's tiles of sums multiplied one unit ahead of its scaling, the next pair's weights
/// prefetched during the first row tile (`prefetch`); then the tile's rows stored.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn pipeline<const F: usize>(
    t: &GroupTile,
    stage: &[u8],
    sums: &mut [Unit; 2],
    prefetch: bool,
) {
    configure_with(&INT8);
    let format = BlockFormat::ALL[F];
    let second = t.weights.add(group_bytes(format, t));
    let units = t.blocks / subs(format);
    let mut acc = [_mm512_setzero_ps(); TILE];
    sums[0].multiply::<F>(t, 0, stage);
    for u in 0..units {
        let (now, next) = match sums {
            [a, b] if u % 2 == 0 => (&*a, b),
            [a, b] => (&*b, a),
        };
        if u + 1 < units {
            next.multiply::<F>(t, u + 1, stage);
        }
        let at = u * group_block_bytes(format);
        let w = [t.weights.add(at), second.add(at)];
        if prefetch {
            // The next pair of groups' unit `u` into the second-level cache, so its unpacking
            // does not wait on memory (past a matrix's last pair: a hint, never a fault).
            columns_zmm::prefetch_next(format, t, w);
        }
        if format.is_k() {
            scale_k::<F>(t, u, w, now, &mut acc);
        } else {
            scale_32::<F>(t, u, w, &now.0[0][0], &mut acc);
        }
    }
    store(t, &acc);
}

/// One tile's sums: 16 rows of the two groups' 16 outputs.
type Sums = [[i32; WIDTH]; TILE];

/// One unit's tiles of sums: per sub-block and side (side 1 only for Q6_K, whose scales apply
/// per 16 inputs; the others' side 0 holds the whole sub-block's).
#[repr(C, align(64))]
struct Unit([[Sums; 2]; 8]);

impl Unit {
    const EMPTY: Self = Self([[[[0; WIDTH]; TILE]; 2]; 8]);

    /// Unit `u`'s tiles of sums, from the weights `stage` holds.
    #[inline(always)]
    unsafe fn multiply<const F: usize>(&mut self, t: &GroupTile, u: usize, stage: &[u8]) {
        let format = BlockFormat::ALL[F];
        let stride = t.blocks * BLOCK;
        for s in 0..subs(format) {
            let ab = u * subs(format) + s;
            let (q, weights) = (t.q.add(ab * BLOCK), stage.as_ptr().add(ab * SUB));
            let sums = &mut self.0[s];
            if format == BlockFormat::Q6K {
                tile!(load 4, q, stride);
                tile!(load 5, weights, 64usize);
                tile!(zero 0);
                tile!(dot_ss 0, 4, 5);
                tile!(store 0, sums[0].as_mut_ptr());
                tile!(load 4, q.add(16), stride);
                tile!(load 5, weights.add(SUB / 2), 64usize);
                tile!(zero 1);
                tile!(dot_ss 1, 4, 5);
                tile!(store 1, sums[1].as_mut_ptr());
            } else {
                tile!(load 2, q, stride);
                tile!(load 3, weights, 64usize);
                tile!(zero 0);
                tile!(dot_ss 0, 2, 3);
                tile!(store 0, sums[0].as_mut_ptr());
            }
        }
    }
}

/// Block `b` of a 32-weight format added to each row's sums, as `columns_x86::body_32` adds
/// it (its offset already taken off): `d · row scale`, then the minimum.
#[inline(always)]
unsafe fn scale_32<const F: usize>(
    t: &GroupTile,
    b: usize,
    w: [*const u8; 2],
    sums: &Sums,
    acc: &mut [__m512; TILE],
) {
    let format = BlockFormat::ALL[F];
    let scales = Scales::of(format, w);
    for (r, acc) in acc.iter_mut().enumerate() {
        let sum = _mm512_load_si512(sums[r].as_ptr().cast());
        *acc = scales.add_32(format, t, (r, b), sum, *acc);
    }
}

/// Block `b` (of 256) of a K format added to each row's sums, as `columns_x86::body_k` adds
/// it: each sub-block's (Q6_K: side's) sums, offset taken off, by their integer scales, then
/// `d` and `dmin`.
#[inline(always)]
unsafe fn scale_k<const F: usize>(
    t: &GroupTile,
    b: usize,
    w: [*const u8; 2],
    unit: &Unit,
    acc: &mut [__m512; TILE],
) {
    let format = BlockFormat::ALL[F];
    let q6k = format == BlockFormat::Q6K;
    let values = values_bytes(format);
    let scales = Scales::of(format, w);
    for (r, acc) in acc.iter_mut().enumerate() {
        let mut total = _mm512_setzero_si512();
        for (s, sums) in unit.0.iter().enumerate() {
            let load = |side: usize| _mm512_load_si512(sums[side][r].as_ptr().cast());
            if q6k {
                for side in 0..2 {
                    let scales = bytes(w, values + Q6K_SCALES + 16 * s + 8 * side);
                    let scales = _mm512_cvtepi8_epi32(scales);
                    total = _mm512_add_epi32(total, _mm512_mullo_epi32(load(side), scales));
                }
            } else {
                let scales = _mm512_cvtepu8_epi32(bytes(w, values + K_SCALES + 8 * s));
                total = _mm512_add_epi32(total, _mm512_mullo_epi32(load(0), scales));
            }
        }
        *acc = scales.add_k(format, t, (r, b), w, total, *acc);
    }
}

/// One group's sub-block at `v` of `BlockFormat::ALL[F]` unpacked to whole signed bytes less
/// the format's offset, its rows at `to` 64 bytes apart (the other group's beside them).
#[inline(always)]
unsafe fn unpack_sub<const F: usize>(v: *const u8, to: *mut u8) {
    let format = BlockFormat::ALL[F];
    let row = |h: usize| to.add(64 * h).cast::<__m256i>();
    let less = _mm256_set1_epi8(offset(format) as i8);
    if format == BlockFormat::Q8_0 {
        // Less 128: the sign bit flipped.
        for h in 0..8 {
            let bytes = _mm256_loadu_si256(v.add(32 * h).cast());
            _mm256_store_si256(row(h), _mm256_xor_si256(bytes, less));
        }
        return;
    }
    if format == BlockFormat::Q6K {
        for side in 0..2 {
            let plane = _mm256_loadu_si256(v.add(128 + 32 * side).cast());
            for h in 0..4 {
                let values = q6k_values(v, plane, side, h);
                _mm256_store_si256(row(4 * side + h), _mm256_sub_epi8(values, less));
            }
        }
        return;
    }
    let low = _mm256_set1_epi8(0x0F);
    for h in 0..4 {
        let bytes = _mm256_loadu_si256(v.add(32 * h).cast());
        let mut side = [
            _mm256_and_si256(bytes, low),
            _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low),
        ];
        if high_bits(format) == 1 {
            for (s, side) in side.iter_mut().enumerate() {
                let word = std::ptr::read_unaligned(v.add(128 + 4 * (2 * h + s)).cast::<u32>());
                *side = with_fifth_bits::<true>(*side, word);
            }
        }
        for (s, side) in side.into_iter().enumerate() {
            let side = match offset(format) {
                0 => side,
                _ => _mm256_sub_epi8(side, less),
            };
            _mm256_store_si256(row(4 * s + h), side);
        }
    }
}
