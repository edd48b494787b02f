//! AVX2's products of more rows than its register kernels take (a decoding step's batch, a
//! prompt's row block): two groups (sixteen outputs) a block at a time, each block's values
//! turned signed once and the activations read as unsigned bytes (`GroupTile::unsigned`).
//!
//! Why: AVX2's `vpmaddubsw` multiplies unsigned bytes (its first operand, a register) by signed
//! ones (its second, a register or memory). The one-group kernels held each block's unsigned
//! values in registers and broadcast each row's four activations against them: on a Zen 4 held
//! to AVX2, Q5_0's loop ran 38 instructions a row and block for eight `vpmaddubsw`, about 9.4
//! cycles where the multiplying pipes needed 6, a third of them the row's broadcasts and the
//! offset's sums. Here the values are signed (less their format's offset) and wait in memory,
//! where `vpmaddubsw` reads them, so each broadcast activation multiplies both groups' weights
//! and no offset is taken per row: the activations plus 128 add `128 · Σ value` per output,
//! the same for every row, taken off once a block (once a sub-block, times its scale, for the
//! K formats). Each 16-bit pair sum is widened before it can pass 32,767 ([`widen_every`]).
//!
//! The integer sums are `super::columns`' definition's exactly and the f32 operations the same
//! in the same order, so the bits are those of every other kernel.

use super::columns::{
    first_rows, group_block_bytes, group_bytes, high_bits, offset, prefetch, sub_bytes,
    values_bytes, GroupTile, K_SCALES, Q6K_SCALES,
};
use super::columns_x86::{
    bytes_i32, halves, q6k_values, run_values, store, Block, BlockScales, KScales, MANY_ROWS,
};
use super::BlockFormat;
use std::arch::x86_64::*;
use std::mem::MaybeUninit;

/// Runs the kernel for `BlockFormat::ALL[F]` on the tile's `rows` rows (1..=[`MANY_ROWS`]) and
/// both its groups.
///
/// # Safety
/// As [`super::columns::group`], with two groups' weights (the second after the first) and the
/// activations as unsigned bytes (`GroupTile::unsigned` not null); the CPU has AVX2, FMA and
/// F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn group<const F: usize>(t: &GroupTile, rows: usize) {
    let format = BlockFormat::ALL[F];
    match (format, high_bits(format)) {
        (BlockFormat::Q8_0, _) => body_q8(t, rows),
        (_, 1) if format.is_k() => body_k::<F, 1>(t, rows),
        _ if format.is_k() => body_k::<F, 0>(t, rows),
        (_, 1) => body_32::<F, 1>(t, rows),
        _ => body_32::<F, 0>(t, rows),
    }
}

/// Block `b` of each of the tile's groups, the next pair's asked for meanwhile: two streams
/// side by side, which the hardware's prefetching alone did not follow (`prefetch`; on a Zen 4,
/// Q5_0 151,936 × 896 from memory 1.06–1.13× with it, in the caches unchanged).
#[inline(always)]
unsafe fn blocks(format: BlockFormat, t: &GroupTile, b: usize) -> [*const u8; 2] {
    let (group, second) = (group_block_bytes(format), group_bytes(format, t));
    let w = [t.weights.add(b * group), t.weights.add(second + b * group)];
    for w in w {
        prefetch(w, 2 * second, group);
    }
    w
}

/// The f32 scales of each group's block `w` (its header after its values).
#[inline(always)]
unsafe fn block_scales(format: BlockFormat, w: [*const u8; 2]) -> [BlockScales; 2] {
    let at = values_bytes(format);
    [
        BlockScales::of(format, w[0].add(at)),
        BlockScales::of(format, w[1].add(at)),
    ]
}

/// Q4_0, Q4_1, Q5_0 and Q5_1 (`HIGH` 1: a fifth bit): `super::columns::add_block`.
#[inline(always)]
unsafe fn body_32<const F: usize, const HIGH: u32>(t: &GroupTile, rows: usize) {
    let format = BlockFormat::ALL[F];
    let every = widen_every(largest(format));
    let less = _mm256_set1_epi8(offset(format) as i8);
    let mut acc = [MaybeUninit::uninit(); MANY_ROWS];
    let acc = first_rows(&mut acc, rows, [_mm256_setzero_ps(); 2]);
    for b in 0..t.blocks {
        let w = blocks(format, t, b);
        let mut runs = [[[_mm256_setzero_si256(); 2]; 4]; 2];
        for (runs, w) in runs.iter_mut().zip(w) {
            for (h, run) in runs.iter_mut().enumerate() {
                let [low, high] = run_values::<false, HIGH>(w, h);
                *run = [_mm256_sub_epi8(low, less), _mm256_sub_epi8(high, less)];
            }
        }
        let start = [
            less_flip(runs[0].as_flattened()),
            less_flip(runs[1].as_flattened()),
        ];
        let scales = block_scales(format, w);
        let a = Block::of_unsigned(t, b);
        for (r, acc) in acc.iter_mut().enumerate() {
            let sums = row_sums(&runs, start, a, r, every);
            for g in 0..2 {
                acc[g] = scales[g].add(format, acc[g], sums[g], t, r, b);
            }
        }
    }
    store_pair(format, t, acc);
}

/// Q8_0: each stored byte (the value plus 128) as its low nibble (0–15) and its high nibble
/// less 8 (−8–7), the value `16 · high + low`; each row's sums `Σ low · a + 16 · Σ high · a`.
/// A low pair sum is at most 2 · 255 · 15, so it is widened every four runs; a high one at
/// most 2 · 255 · 8 in magnitude, once a block.
#[inline(always)]
// The values are kept per group, then per run; the loops go by run, both groups inside.
#[allow(clippy::needless_range_loop)]
unsafe fn body_q8(t: &GroupTile, rows: usize) {
    let format = BlockFormat::Q8_0;
    let (nibble, eight) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(8));
    let (ones, sixteens) = (_mm256_set1_epi16(1), _mm256_set1_epi16(16));
    let mut acc = [MaybeUninit::uninit(); MANY_ROWS];
    let acc = first_rows(&mut acc, rows, [_mm256_setzero_ps(); 2]);
    for b in 0..t.blocks {
        let w = blocks(format, t, b);
        // Per group, per run: the low nibbles, then the high ones.
        let mut runs = [[[_mm256_setzero_si256(); 8]; 2]; 2];
        for (runs, w) in runs.iter_mut().zip(w) {
            for h in 0..8 {
                let bytes = _mm256_loadu_si256(w.add(32 * h).cast());
                let high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
                runs[0][h] = _mm256_and_si256(bytes, nibble);
                runs[1][h] = _mm256_sub_epi8(high, eight);
            }
        }
        let mut start = [_mm256_setzero_si256(); 2];
        for (start, [low, high]) in start.iter_mut().zip(&runs) {
            *start = _mm256_add_epi32(less_flip(low), _mm256_slli_epi32(less_flip(high), 4));
        }
        let scales = block_scales(format, w);
        let a = Block::of_unsigned(t, b);
        for (r, acc) in acc.iter_mut().enumerate() {
            let mut sums = start;
            let (mut low, mut high) = ([_mm256_setzero_si256(); 2], [_mm256_setzero_si256(); 2]);
            for h in 0..8 {
                let act = a.four(r, 4 * h);
                for g in 0..2 {
                    low[g] = _mm256_add_epi16(low[g], _mm256_maddubs_epi16(act, runs[g][0][h]));
                    high[g] = _mm256_add_epi16(high[g], _mm256_maddubs_epi16(act, runs[g][1][h]));
                }
                if h % 4 == 3 {
                    for g in 0..2 {
                        sums[g] = _mm256_add_epi32(sums[g], _mm256_madd_epi16(low[g], ones));
                        low[g] = _mm256_setzero_si256();
                    }
                }
            }
            for g in 0..2 {
                sums[g] = _mm256_add_epi32(sums[g], _mm256_madd_epi16(high[g], sixteens));
                acc[g] = scales[g].add(format, acc[g], sums[g], t, r, b);
            }
        }
    }
    store_pair(format, t, acc);
}

/// The K formats (Q4_K, Q5_K with `HIGH` 1, Q6_K): each row's integer total over a block of
/// 256, then `super::columns::add_k_block`'s f32 operations.
#[inline(always)]
unsafe fn body_k<const F: usize, const HIGH: u32>(t: &GroupTile, rows: usize) {
    let format = BlockFormat::ALL[F];
    let mut acc = [MaybeUninit::uninit(); MANY_ROWS];
    let acc = first_rows(&mut acc, rows, [_mm256_setzero_ps(); 2]);
    let mut total = [MaybeUninit::uninit(); MANY_ROWS];
    let total = first_rows(&mut total, rows, [_mm256_setzero_si256(); 2]);
    for b in 0..t.blocks / 8 {
        let w = blocks(format, t, b);
        let head = [
            w[0].add(values_bytes(format)),
            w[1].add(values_bytes(format)),
        ];
        total.fill([_mm256_setzero_si256(); 2]);
        for s in 0..8 {
            let v = [
                w[0].add(s * sub_bytes(format)),
                w[1].add(s * sub_bytes(format)),
            ];
            let a = Block::of_unsigned(t, b * 8 + s);
            if format == BlockFormat::Q6K {
                for side in 0..2 {
                    let at = Q6K_SCALES + 16 * s + 8 * side;
                    let scales = [bytes_i32(head[0].add(at)), bytes_i32(head[1].add(at))];
                    q6k_side(v, a, side, scales, total);
                }
            } else {
                let mut scales = [_mm256_setzero_si256(); 2];
                for (scales, head) in scales.iter_mut().zip(head) {
                    let bytes = _mm_loadl_epi64(head.add(K_SCALES + 8 * s).cast());
                    *scales = _mm256_cvtepu8_epi32(bytes);
                }
                k_sub::<HIGH>(format, v, a, scales, total);
            }
        }
        let scales = [KScales::of(format, head[0]), KScales::of(format, head[1])];
        for (r, (acc, total)) in acc.iter_mut().zip(total.iter()).enumerate() {
            for g in 0..2 {
                acc[g] = scales[g].add(format, acc[g], total[g], t, r, b);
            }
        }
    }
    store_pair(format, t, acc);
}

/// A Q4_K or Q5_K sub-block of both groups (values at `v`, no offset) times its `scales`,
/// added to each row's `totals`.
#[inline(always)]
unsafe fn k_sub<const HIGH: u32>(
    format: BlockFormat,
    v: [*const u8; 2],
    a: Block,
    scales: [__m256i; 2],
    totals: &mut [[__m256i; 2]],
) {
    let every = widen_every(largest(format));
    let mut runs = [[[_mm256_setzero_si256(); 2]; 4]; 2];
    for (runs, v) in runs.iter_mut().zip(v) {
        for (h, run) in runs.iter_mut().enumerate() {
            *run = run_values::<false, HIGH>(v, h);
        }
    }
    let start = [
        less_flip(runs[0].as_flattened()),
        less_flip(runs[1].as_flattened()),
    ];
    for (r, total) in totals.iter_mut().enumerate() {
        add_scaled(total, row_sums(&runs, start, a, r, every), scales);
    }
}

/// One side of a Q6_K sub-block of both groups (16 inputs, values at `v`) as signed values
/// (less 32) times the side's `scales`, added to each row's `totals`. A pair sum of one run is
/// at most 2 · 255 · 32 in magnitude: widened every two runs.
#[inline(always)]
// The values are kept per group, then per run; the loops go by run, both groups inside.
#[allow(clippy::needless_range_loop)]
unsafe fn q6k_side(
    v: [*const u8; 2],
    a: Block,
    side: usize,
    scales: [__m256i; 2],
    totals: &mut [[__m256i; 2]],
) {
    let (thirty_two, ones) = (_mm256_set1_epi8(32), _mm256_set1_epi16(1));
    let mut runs = [[_mm256_setzero_si256(); 4]; 2];
    for (runs, v) in runs.iter_mut().zip(v) {
        let plane = _mm256_loadu_si256(v.add(128 + 32 * side).cast());
        for (h, run) in runs.iter_mut().enumerate() {
            *run = _mm256_sub_epi8(q6k_values(v, plane, side, h), thirty_two);
        }
    }
    let start = [less_flip(&runs[0]), less_flip(&runs[1])];
    for (r, total) in totals.iter_mut().enumerate() {
        let mut sums = start;
        let mut pairs = [_mm256_setzero_si256(); 2];
        for h in 0..4 {
            let act = a.four(r, 16 * side + 4 * h);
            for g in 0..2 {
                let products = _mm256_maddubs_epi16(act, runs[g][h]);
                pairs[g] = _mm256_add_epi16(pairs[g], products);
            }
            if h % 2 == 1 {
                for g in 0..2 {
                    sums[g] = _mm256_add_epi32(sums[g], _mm256_madd_epi16(pairs[g], ones));
                    pairs[g] = _mm256_setzero_si256();
                }
            }
        }
        add_scaled(total, sums, scales);
    }
}

/// `sums` times `scales`, per group, added to a row's block `total`.
#[inline(always)]
unsafe fn add_scaled(total: &mut [__m256i; 2], sums: [__m256i; 2], scales: [__m256i; 2]) {
    for g in 0..2 {
        total[g] = _mm256_add_epi32(total[g], _mm256_mullo_epi32(sums[g], scales[g]));
    }
}

/// Row `r`'s integer sums over a Q4 or Q5 sub-block of both groups (`runs`: per group, run and
/// side), from `start`; the pair sums widened after every `every` runs.
#[inline(always)]
// The values are kept per group, then per run; the loops go by run, both groups inside.
#[allow(clippy::needless_range_loop)]
unsafe fn row_sums(
    runs: &[[[__m256i; 2]; 4]; 2],
    start: [__m256i; 2],
    a: Block,
    r: usize,
    every: usize,
) -> [__m256i; 2] {
    let ones = _mm256_set1_epi16(1);
    let mut sums = start;
    let mut pairs = [_mm256_setzero_si256(); 2];
    for h in 0..4 {
        for s in 0..2 {
            let act = a.four(r, 16 * s + 4 * h);
            for g in 0..2 {
                let products = _mm256_maddubs_epi16(act, runs[g][h][s]);
                pairs[g] = _mm256_add_epi16(pairs[g], products);
            }
        }
        if (h + 1) % every == 0 {
            for g in 0..2 {
                sums[g] = _mm256_add_epi32(sums[g], _mm256_madd_epi16(pairs[g], ones));
                pairs[g] = _mm256_setzero_si256();
            }
        }
    }
    sums
}

/// `−128 · Σ value` per output over `runs` of values (each pair sum at most 2 · 32 in
/// magnitude, a block's few runs far within 16 bits): what the activations' 128 adds to each
/// row's sums.
#[inline(always)]
unsafe fn less_flip(runs: &[__m256i]) -> __m256i {
    let (ones, less) = (_mm256_set1_epi8(1), _mm256_set1_epi16(-128));
    let mut pairs = _mm256_setzero_si256();
    for &run in runs {
        pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(ones, run));
    }
    _mm256_madd_epi16(pairs, less)
}

/// Runs of four inputs (both sides of a Q4/Q5 sub-block) a 16-bit pair sum takes before it is
/// widened: each unsigned activation (at most 255) times a signed value (at most `largest` in
/// magnitude) adds at most `2 · 2 · 255 · largest` to a lane per run, which must stay within
/// 32,767: Q4_0 four runs, Q4_1, Q5_0 and Q4_K two, Q5_1 and Q5_K one.
const fn widen_every(largest: i32) -> usize {
    match 32_767 / (2 * 2 * 255 * largest) {
        0 | 1 => 1,
        2 | 3 => 2,
        _ => 4,
    }
}

/// The largest magnitude of `format`'s values less its offset.
fn largest(format: BlockFormat) -> i32 {
    let top = (1 << (4 + high_bits(format))) - 1;
    (top - offset(format)).max(offset(format))
}

/// Each row's sums of both groups written out (the second group's outputs that exist).
#[inline(always)]
unsafe fn store_pair(format: BlockFormat, t: &GroupTile, acc: &[[__m256; 2]]) {
    let mut one = [MaybeUninit::uninit(); MANY_ROWS];
    let one = first_rows(&mut one, acc.len(), _mm256_setzero_ps());
    for (g, half) in halves(format, t).iter().enumerate() {
        if let Some(half) = half {
            for (one, acc) in one.iter_mut().zip(acc) {
                *one = acc[g];
            }
            store(half, one);
        }
    }
}
