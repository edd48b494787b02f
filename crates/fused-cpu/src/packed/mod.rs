//! The dense layers' matrix products on weights packed once at load, in the order this crate's
//! own kernels read them: f32 ([`f32`], AVX-512 and AVX2), bf16 ([`bf16`], AVX-512 BF16) and int8
//! ([`int8`]: AVX-512 VNNI; [`int8_x86`]: AVX-VNNI and AVX2; [`int8_arm`]: Arm's `sdot`).
//!
//! Why kernels of our own: the `gemm` crate keeps its AVX-512 kernels behind a nightly-only
//! feature, so on stable Rust it multiplies f32 with 256-bit FMAs: half the multiply-adds per
//! cycle of a core with two 512-bit FMA units (every Intel Xeon since Skylake-SP); on AVX2 its
//! f32 kernels ran at 0.9× of the same tile over these packed panels. And it has no bf16 or
//! int8 products at all.
//!
//! One layout for the three: the `n` output columns in panels of [`PANEL`] (one register of
//! 16 f32 or i32 sums; the last panel zero-padded), and within a panel, for each *step* of the
//! inner dimension (1 f32, 2 bf16 or 4 int8 inputs: one 32-bit lane), the 16 columns' lanes
//! side by side: one 64-byte register per step, loaded as is. The rows are converted to the
//! same lanes ([`MC`] rows at a time: copied, rounded to bf16 or quantised) and each row's lane
//! broadcast against the panel's register (narrower registers read a panel's step as two or
//! four). The driver below (blocks, threads, tiles) is shared; each format brings its row
//! conversion and its kernels.

#[cfg(target_arch = "x86_64")]
pub(crate) mod amx;
pub(crate) mod bf16;
pub(crate) mod f32;
pub(crate) mod int8;
#[cfg(target_arch = "aarch64")]
pub(crate) mod int8_arm;
#[cfg(target_arch = "x86_64")]
mod int8_x86;

pub(crate) use f32::Fma;
pub(crate) use int8::Dot;

use rayon::prelude::*;
use std::cell::RefCell;

/// Columns in a packed panel: one AVX-512 register of 32-bit sums.
pub(crate) const PANEL: usize = 16;
/// Rows of the product one kernel call computes (the broadcast side).
pub(crate) const MR: usize = 6;
/// Panels one float kernel call computes: MR × NR sums in registers, 24 of AVX-512's 32.
/// (int8's tiles are half as wide: each needs i32 sums for a group beside its f32 sums.)
pub(crate) const NR: usize = 4;
/// Rows converted and multiplied together, so their converted copy stays in the core's L2 while
/// every panel passes over them. A multiple of two AMX row tiles: the AMX kernel reads whole
/// tiles of converted rows (those past the last are read, not stored).
pub(crate) const MC: usize = 64;
/// An AMX row tile's rows, and a weight tile's depth in steps (see [`amx`]).
const AMX_TILE_ROWS: usize = 16;
const AMX_DEPTH: usize = 16;

/// The number format of a packed weight matrix and of the products computed on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Format {
    /// f32 products and sums: the exact encoder, on AVX-512 F or AVX2/FMA.
    F32(Fma),
    /// bf16 products, f32 sums, on AVX-512 BF16.
    Bf16,
    /// bf16 products, f32 sums, on AMX tiles: the same packing and row conversion as `Bf16`,
    /// its steps padded to a tile's depth.
    Bf16Amx,
    /// int8 products, i32 sums: weights per output column, rows per row, on the integer dot
    /// products named.
    Int8(Dot),
}

impl Format {
    /// Inputs per 32-bit lane.
    const fn per_lane(self) -> usize {
        match self {
            Self::F32(_) => 1,
            Self::Bf16 | Self::Bf16Amx => 2,
            Self::Int8(_) => 4,
        }
    }

    /// Panels in one kernel call's tile: as many as leave registers for the sums (int8 keeps
    /// a group's i32 sums beside its f32 sums; 256- and 128-bit registers hold a panel in two
    /// or four).
    const fn tile_panels(self) -> usize {
        match self {
            Self::F32(Fma::Avx512) | Self::Bf16 => NR,
            Self::Bf16Amx => 2,
            Self::Int8(Dot::Avx512Vnni) => NR / 2,
            Self::F32(Fma::Avx2) | Self::Int8(_) => 1,
        }
    }

    /// Rows in one kernel call's tile: fewer for AVX2's int8, whose two-instruction products
    /// need registers for their 16-bit sums and a vector of ones.
    const fn tile_rows(self) -> usize {
        match self {
            Self::Int8(Dot::Avx2) => 4,
            Self::Bf16Amx => 2 * AMX_TILE_ROWS,
            _ => MR,
        }
    }

    /// Whether this CPU runs this format's kernel, checked at run time.
    pub(crate) fn supported(self) -> bool {
        match self {
            Self::F32(fma) => fma.supported(),
            Self::Bf16 => bf16::supported(),
            #[cfg(target_arch = "x86_64")]
            Self::Bf16Amx => amx::supported(),
            #[cfg(not(target_arch = "x86_64"))]
            Self::Bf16Amx => false,
            Self::Int8(dot) => dot.supported(),
        }
    }

    /// The instructions this format's kernel runs on, for logs and benchmarks.
    pub(crate) fn kernels(self) -> &'static str {
        match self {
            Self::F32(Fma::Avx512) => "AVX-512",
            Self::F32(Fma::Avx2) => "AVX2/FMA",
            Self::Bf16 => "AVX-512 BF16",
            Self::Bf16Amx => "AMX-BF16",
            Self::Int8(dot) => dot.name(),
        }
    }
}

/// A weight matrix (PyTorch's `(n, k)`) in a [`Format`], packed for its kernel.
pub(crate) struct PackedWeights {
    pub(crate) format: Format,
    /// Output columns.
    pub(crate) n: usize,
    /// Inputs.
    k: usize,
    /// Lanes per column: `k` over the format's inputs per lane, rounded up (zero-padded).
    steps: usize,
    /// The lanes, panel after panel.
    data: Vec<u32>,
    /// int8: per column and group of inputs, its scale (quantised weight × scale ≈ weight),
    /// laid out `[panel][group][lane]`.
    scales: Vec<f32>,
    /// int8: per column and group, its scale × its quantised weights' sum: the share of each
    /// sum a row's zero point adds, taken off by the kernel; laid out as `scales`.
    sums: Vec<f32>,
    /// int8: what each input is multiplied by before a row is quantised (empty: 1), the inverse
    /// of the factor its weights were multiplied by before theirs (see [`int8::smoothing`]).
    input_scales: Vec<f32>,
}

impl PackedWeights {
    /// Packs `w` (`(n, k)`, row-major) in `format`: as is, rounded to bf16 (nearest even), or
    /// quantised to int8 per output column and group of inputs ([`int8::quantise_columns`]),
    /// its inputs smoothed by `factors` (one per input; empty for none): weight column `j`
    /// multiplied by `factors[j]` and input `j` divided by it when a row is quantised, which
    /// leaves the product unchanged and moves part of an input channel's outliers into its
    /// weights, where the weights' finer scales absorb them.
    pub(crate) fn pack(format: Format, w: &[f32], k: usize, factors: &[f32]) -> Self {
        assert!(
            k > 0 && w.len().is_multiple_of(k),
            "pack: inner size {k} of {}",
            w.len()
        );
        let n = w.len() / k;
        let per = format.per_lane();
        let steps = match format {
            // A weight tile is 16 steps deep: the tail is padded with zero weights.
            Format::Bf16Amx => k.div_ceil(per).next_multiple_of(AMX_DEPTH),
            _ => k.div_ceil(per),
        };
        let panels = n.div_ceil(PANEL);
        let smoothed: Vec<f32>;
        let (w, input_scales) = match format {
            Format::Int8(_) if !factors.is_empty() => {
                assert_eq!(
                    factors.len(),
                    k,
                    "pack: {} smoothing factors",
                    factors.len()
                );
                smoothed = w
                    .iter()
                    .enumerate()
                    .map(|(i, v)| v * factors[i % k])
                    .collect();
                (&smoothed[..], factors.iter().map(|f| 1.0 / f).collect())
            }
            _ => (w, Vec::new()),
        };
        let (quantised, scales, sums) = match format {
            Format::Int8(_) => int8::quantise_columns(w, k, panels * PANEL),
            _ => (Vec::new(), Vec::new(), Vec::new()),
        };
        let lane = |col: usize, step: usize| -> u32 {
            (0..per)
                .map(|j| (j, step * per + j))
                .filter(|&(_, i)| col < n && i < k)
                .map(|(j, i)| {
                    let v = w[col * k + i];
                    match format {
                        Format::F32(_) => v.to_bits(),
                        Format::Bf16 | Format::Bf16Amx => {
                            u32::from(half::bf16::from_f32(v).to_bits()) << (16 * j)
                        }
                        Format::Int8(_) => u32::from(quantised[col * k + i] as u8) << (8 * j),
                    }
                })
                .fold(0, |a, b| a | b)
        };
        let mut data = vec![0u32; panels * steps * PANEL];
        for (panel, chunk) in data.chunks_exact_mut(steps * PANEL).enumerate() {
            for (step, lanes) in chunk.chunks_exact_mut(PANEL).enumerate() {
                for (c, v) in lanes.iter_mut().enumerate() {
                    *v = lane(panel * PANEL + c, step);
                }
            }
        }
        Self {
            format,
            n,
            k,
            steps,
            data,
            scales,
            sums,
            input_scales,
        }
    }
}

/// One thread's buffers, reused between calls: converted rows, (int8) their quantisation
/// parameters and one smoothed row.
#[derive(Default)]
struct Buffers {
    rows: Vec<u32>,
    params: Vec<f32>,
    smoothed: Vec<f32>,
}

thread_local! {
    static BUFFERS: RefCell<Buffers> = RefCell::new(Buffers::default());
}

/// `out = x · wᵀ (+ b)` in `w`'s format; `x` is `(rows, k)`, `out` `(rows, n)`. The rows are
/// split between the pool's threads.
///
/// Panics unless the shapes agree and the CPU has the format's instructions
/// ([`Format::supported`]): the kernels write through raw pointers, so these checks keep them
/// inside the slices in every build.
pub(crate) fn linear(x: &[f32], w: &PackedWeights, b: Option<&[f32]>, out: &mut [f32]) {
    let m = check_shapes(x, w, b, out);
    let (n, k) = (w.n, w.k);
    let block = crate::kernels::block_rows(m, n * k, MR, MC);
    let panels = n.div_ceil(PANEL);
    out.par_chunks_mut(block * n)
        .zip(x.par_chunks(block * k))
        .for_each(|(out, x)| {
            BUFFERS.with(|buf| {
                // SAFETY: the format is supported and the shapes agree (checked above); each
                // block holds whole rows of x and out.
                unsafe { run_block(x, w, b, out.as_mut_ptr(), 0..panels, &mut buf.borrow_mut()) }
            })
        });
}

/// [`linear`] for a few rows and many columns (a decoder's step: one row per sequence): the
/// columns are split between the threads instead of the rows, so every core streams its share
/// of the weights. Each sum is computed exactly as [`linear`] computes it (the same kernel over
/// the same inputs in the same order), so a row's result does not depend on the split, nor on
/// the other rows beside it.
pub(crate) fn linear_wide(x: &[f32], w: &PackedWeights, b: Option<&[f32]>, out: &mut [f32]) {
    let m = check_shapes(x, w, b, out);
    let panels = w.n.div_ceil(PANEL);
    let threads = rayon::current_num_threads().max(1);
    if m > MC || threads == 1 || m * w.n * w.k < crate::kernels::MIN_BLOCK_MACS {
        return linear(x, w, b, out);
    }
    // Whole tiles of panels, a few per thread so an uneven core still finishes with the rest.
    let tile = w.format.tile_panels();
    let per = panels.div_ceil(threads * 2).div_ceil(tile).max(1) * tile;
    let base = OutPtr(out.as_mut_ptr());
    (0..panels.div_ceil(per)).into_par_iter().for_each(|i| {
        let range = i * per..((i + 1) * per).min(panels);
        BUFFERS.with(|buf| {
            // SAFETY: as in `linear`; each task writes only its own panels' columns of out's
            // rows, which no other task touches.
            unsafe { run_block(x, w, b, base.get(), range, &mut buf.borrow_mut()) }
        })
    });
}

/// The output of [`linear_wide`] (and of `quant::linear`), shared by tasks that write disjoint
/// columns.
#[derive(Clone, Copy)]
pub(crate) struct OutPtr(pub(crate) *mut f32);
// SAFETY: see `linear_wide`: each task writes its own columns.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// The pointer (a method, so closures capture the Sync wrapper, not its field).
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}

/// Checks what the kernels rely on and returns the number of rows.
fn check_shapes(x: &[f32], w: &PackedWeights, b: Option<&[f32]>, out: &[f32]) -> usize {
    let (n, k) = (w.n, w.k);
    assert!(x.len().is_multiple_of(k), "packed linear: inner size {k}");
    let m = x.len() / k;
    assert_eq!(out.len(), m * n, "packed linear: output of {m}x{n}");
    assert!(b.is_none_or(|b| b.len() == n), "packed linear: bias of {n}");
    assert!(
        w.format.supported(),
        "packed linear: no {:?} kernel on this CPU",
        w.format
    );
    m
}

/// One thread's rows: converted `MC` at a time, then the panels in `panels` over them, tile by
/// tile.
///
/// # Safety
/// The CPU has `w.format`'s instructions; `x` holds whole rows of `w.k`, `out` points at as many
/// rows of `w.n`, `panels` is within `w`'s, and `b` is `None` or `w.n` long.
unsafe fn run_block(
    x: &[f32],
    w: &PackedWeights,
    b: Option<&[f32]>,
    out: *mut f32,
    panels: std::ops::Range<usize>,
    buffers: &mut Buffers,
) {
    let Buffers {
        rows,
        params,
        smoothed,
    } = buffers;
    let (n, k, steps) = (w.n, w.k, w.steps);
    let count_all = x.len() / k;
    let per_row = match w.format {
        Format::Int8(_) => int8::row_params(k),
        _ => 0,
    };
    let groups = per_row / 2;
    rows.resize(rows.len().max(MC * steps), 0);
    params.resize(params.len().max(MC * per_row), 0.0);
    for first in (0..count_all).step_by(MC) {
        let count = MC.min(count_all - first);
        for r in 0..count {
            let mut row = &x[(first + r) * k..][..k];
            if !w.input_scales.is_empty() {
                smoothed.clear();
                smoothed.extend(row.iter().zip(&w.input_scales).map(|(v, s)| v * s));
                row = smoothed;
            }
            let dst = &mut rows[r * steps..][..steps];
            match w.format {
                Format::F32(_) => f32::convert(row, dst),
                Format::Bf16 | Format::Bf16Amx => bf16::convert(row, dst),
                Format::Int8(dot) => {
                    int8::convert(row, dst, &mut params[r * per_row..][..per_row], dot)
                }
            }
        }
        let mut panel = panels.start;
        while panel < panels.end {
            let take = w.format.tile_panels().min(panels.end - panel);
            let tall = w.format.tile_rows();
            for r in (0..count).step_by(tall) {
                let tile = Tile {
                    rows: rows.as_ptr().add(r * steps),
                    steps,
                    weights: w.data.as_ptr().add(panel * steps * PANEL),
                    out: out.add((first + r) * n + panel * PANEL),
                    n,
                    cols: n - panel * PANEL,
                    bias: b.map(|b| b.as_ptr().add(panel * PANEL)),
                    row_params: params.as_ptr().wrapping_add(r * per_row),
                    params_per_row: per_row,
                    col_scales: w.scales.as_ptr().wrapping_add(panel * groups * PANEL),
                    col_sums: w.sums.as_ptr().wrapping_add(panel * groups * PANEL),
                };
                multiply(w.format, &tile, tall.min(count - r), take);
            }
            panel += take;
        }
    }
}

/// Runs `format`'s kernel on a tile of `height` rows (1..=MR) and `panels` panels (1..=NR).
///
/// # Safety
/// As [`run_block`]: the CPU has the format's instructions and the tile's pointers cover it.
unsafe fn multiply(format: Format, tile: &Tile, height: usize, panels: usize) {
    match format {
        #[cfg(target_arch = "x86_64")]
        Format::F32(Fma::Avx512) => for_each_shape!(f32::kernel, tile, height, panels),
        #[cfg(target_arch = "x86_64")]
        Format::F32(Fma::Avx2) => for_each_shape!(@rows f32::kernel_avx2, tile, height, 1),
        #[cfg(target_arch = "x86_64")]
        Format::Bf16 => for_each_shape!(bf16::kernel, tile, height, panels),
        #[cfg(target_arch = "x86_64")]
        Format::Bf16Amx if panels == 2 => amx::kernel::<2>(tile, height),
        #[cfg(target_arch = "x86_64")]
        Format::Bf16Amx => amx::kernel::<1>(tile, height),
        #[cfg(target_arch = "x86_64")]
        Format::Int8(Dot::Avx512Vnni) => for_each_shape!(int8::kernel, tile, height, panels),
        #[cfg(target_arch = "x86_64")]
        Format::Int8(Dot::AvxVnni) => for_each_shape!(@rows int8_x86::kernel_vnni, tile, height, 1),
        #[cfg(target_arch = "x86_64")]
        Format::Int8(Dot::Avx2) => for_each_shape!(@rows int8_x86::kernel_avx2, tile, height, 1),
        #[cfg(target_arch = "aarch64")]
        Format::Int8(Dot::Sdot) => for_each_shape!(@rows int8_arm::kernel, tile, height, 1),
        #[allow(unreachable_patterns)]
        _ => unreachable!("{format:?} has no kernel on this architecture ({height}x{panels})"),
    }
}

/// Up to MR rows by up to NR panels of the product, and where they go.
pub(crate) struct Tile {
    /// The first row's converted lanes; rows `steps` apart.
    pub(crate) rows: *const u32,
    pub(crate) steps: usize,
    /// The first panel's packed weights; panels `steps * PANEL` apart.
    pub(crate) weights: *const u32,
    /// The first row's first column in the output; rows `n` apart.
    pub(crate) out: *mut f32,
    pub(crate) n: usize,
    /// Output columns left from this tile's first (the last panel may be partial).
    pub(crate) cols: usize,
    pub(crate) bias: Option<*const f32>,
    /// int8: the first row's quantisation parameters (rows `params_per_row` apart), and the
    /// first panel's column scales and sums (see [`PackedWeights`]); unused by the float
    /// formats.
    pub(crate) row_params: *const f32,
    pub(crate) params_per_row: usize,
    pub(crate) col_scales: *const f32,
    pub(crate) col_sums: *const f32,
}

/// Calls `$kernel::<R, P>(tile)` for a tile of `$height` rows (1..=MR) and `$panels` panels
/// (1..=NR): one kernel compiled per shape, so the sums live in registers.
macro_rules! for_each_shape {
    ($($kernel:ident)::+, $tile:expr, $height:expr, $panels:expr) => {
        match $panels {
            4 => $crate::packed::for_each_shape!(@rows $($kernel)::+, $tile, $height, 4),
            3 => $crate::packed::for_each_shape!(@rows $($kernel)::+, $tile, $height, 3),
            2 => $crate::packed::for_each_shape!(@rows $($kernel)::+, $tile, $height, 2),
            _ => $crate::packed::for_each_shape!(@rows $($kernel)::+, $tile, $height, 1),
        }
    };
    (@rows $($kernel:ident)::+, $tile:expr, $height:expr, $p:literal) => {
        match $height {
            6 => $($kernel)::+::<6, $p>($tile),
            5 => $($kernel)::+::<5, $p>($tile),
            4 => $($kernel)::+::<4, $p>($tile),
            3 => $($kernel)::+::<3, $p>($tile),
            2 => $($kernel)::+::<2, $p>($tile),
            _ => $($kernel)::+::<1, $p>($tile),
        }
    };
}
pub(crate) use for_each_shape;

pub(crate) mod store {
    use super::{Tile, PANEL};
    #[cfg(target_arch = "x86_64")]
    use std::arch::x86_64::*;

    /// Adds the bias to the tile's f32 sums, spilled to memory by a kernel on narrower
    /// registers, and stores the columns that exist.
    ///
    /// # Safety
    /// The tile's pointers cover `R` rows and `P` panels (the last up to `cols`).
    #[inline]
    pub(crate) unsafe fn lanes<const R: usize, const P: usize>(
        t: &Tile,
        sums: &[[[f32; PANEL]; P]; R],
    ) {
        let cols = t.cols.min(P * PANEL);
        for (i, row) in sums.iter().enumerate() {
            let out = std::slice::from_raw_parts_mut(t.out.add(i * t.n), cols);
            for (c, (o, v)) in out.iter_mut().zip(row.iter().flatten()).enumerate() {
                *o = v + t.bias.map_or(0.0, |b| *b.add(c));
            }
        }
    }

    /// Adds the bias to the tile's f32 sums and stores them, the last panel masked to the
    /// columns that exist.
    ///
    /// # Safety
    /// AVX-512 F; the tile's pointers cover `R` rows and `P` panels (the last up to `cols`).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(crate) unsafe fn sums<const R: usize, const P: usize>(t: &Tile, acc: &[[__m512; P]; R]) {
        for (i, acc) in acc.iter().enumerate() {
            for (j, &sum) in acc.iter().enumerate() {
                let left = t.cols.saturating_sub(j * PANEL);
                let mask: __mmask16 = if left >= PANEL {
                    0xffff
                } else {
                    (1u16 << left) - 1
                };
                let sum = match t.bias {
                    Some(b) => _mm512_add_ps(sum, _mm512_maskz_loadu_ps(mask, b.add(j * PANEL))),
                    None => sum,
                };
                _mm512_mask_storeu_ps(t.out.add(i * t.n + j * PANEL), mask, sum);
            }
        }
    }
}

/// Whether this is an AMD CPU ("AuthenticAMD"), whose cores run a 512-bit instruction as two
/// 256-bit halves; asked once (CPUID exits a virtual machine to its host).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn amd() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static AMD: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *AMD.get_or_init(|| {
            let vendor = std::arch::x86_64::__cpuid(0);
            (vendor.ebx, vendor.edx, vendor.ecx) == (0x6874_7541, 0x6974_6e65, 0x444d_4163)
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether bf16 is faster than f32 here: its products run on AMX tiles
/// ([`amx::supported`]: Sapphire Rapids and later), or the AVX-512 BF16 kernel runs
/// ([`bf16::supported`]) on a core that issues `vdpbf16ps` as fast as its FMAs. That is AMD's Zen 4
/// and 5; Intel's cores issue it at half the rate, where without AMX it gains nothing over the
/// f32 kernel and costs accuracy. Told apart by the CPU's vendor.
pub fn bf16_full_rate() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        amx::supported() || bf16::supported() && amd()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random(count: usize, seed: &mut u32) -> Vec<f32> {
        (0..count)
            .map(|_| {
                *seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (*seed >> 8) as f32 / (1u32 << 24) as f32 - 0.5
            })
            .collect()
    }

    /// What the format computes, in f64: the product of the values it multiplies (f32 as is,
    /// bf16 rounded, int8 quantised and scaled back).
    fn reference(format: Format, x: &[f32], w: &[f32], k: usize) -> (Vec<f64>, Vec<f64>) {
        let round = |v: f32| f64::from(half::bf16::from_f32(v).to_f32());
        let (m, n) = (x.len() / k, w.len() / k);
        let per_row = |v: &[f32], activations: bool| -> Vec<f64> {
            v.chunks(k)
                .flat_map(|r| match format {
                    Format::F32(_) => r.iter().map(|&v| f64::from(v)).collect::<Vec<_>>(),
                    Format::Bf16 | Format::Bf16Amx => r.iter().map(|&v| round(v)).collect(),
                    Format::Int8(dot) if activations => r
                        .chunks(int8::GROUP)
                        .flat_map(|g| {
                            let lo = g.iter().fold(0f32, |a, &v| a.min(v));
                            let hi = g.iter().fold(0f32, |a, &v| a.max(v));
                            let levels = dot.levels();
                            let scale = (hi - lo) / levels;
                            let (zero, inv) = ((-lo / scale).round_ties_even(), 1.0 / scale);
                            g.iter().map(move |&v| {
                                let q = ((v * inv).round_ties_even() + zero).clamp(0.0, levels);
                                f64::from(q - zero) * f64::from(scale)
                            })
                        })
                        .collect(),
                    Format::Int8(_) => r
                        .chunks(int8::GROUP)
                        .flat_map(|g| {
                            let amax = g.iter().fold(0f32, |a, v| a.max(v.abs()));
                            let (scale, inv) = (amax / 127.0, 127.0 / amax);
                            g.iter().map(move |&v| {
                                f64::from((v * inv).round_ties_even()) * f64::from(scale)
                            })
                        })
                        .collect(),
                })
                .collect()
        };
        let (xs, ws) = (per_row(x, true), per_row(w, false));
        let exact = (0..m * n)
            .map(|i| {
                (0..k)
                    .map(|j| f64::from(x[i / n * k + j]) * f64::from(w[i % n * k + j]))
                    .sum()
            })
            .collect();
        let modelled = (0..m * n)
            .map(|i| (0..k).map(|j| xs[i / n * k + j] * ws[i % n * k + j]).sum())
            .collect();
        (exact, modelled)
    }

    /// Every format and kernel, whether this CPU runs it or not (the test skips those it does
    /// not): on x86-64 with AVX-512 VNNI that is every int8 kernel but Arm's.
    fn every_format() -> Vec<Format> {
        let dots = [Dot::Avx512Vnni, Dot::AvxVnni, Dot::Avx2, Dot::Sdot];
        [
            Format::F32(Fma::Avx512),
            Format::F32(Fma::Avx2),
            Format::Bf16,
            Format::Bf16Amx,
        ]
        .into_iter()
        .chain(dots.into_iter().map(Format::Int8))
        .collect()
    }

    /// Every shape the tails can take (rows not a multiple of MR or MC, columns not a multiple
    /// of a panel or of NR panels, inputs not a multiple of a lane) in every format and kernel
    /// this CPU runs, against the f64 product of the values the format multiplies; int8 also
    /// within a percent (two for AVX2's coarser activations) of the exact product's scale.
    #[test]
    fn packed_products_compute_what_their_format_holds() {
        let mut seed = 3u32;
        for format in every_format() {
            if !format.supported() {
                eprintln!("skipped {format:?}: not on this CPU");
                continue;
            }
            for (m, k, n) in [
                (1, 1, 1),
                (3, 7, 5),
                (9, 33, 17),
                (70, 64, 49),
                (130, 40, 96),
                (701, 24, 20),
            ] {
                let x = random(m * k, &mut seed);
                let w = random(n * k, &mut seed);
                let bias = random(n, &mut seed);
                let packed = PackedWeights::pack(format, &w, k, &[]);
                let mut out = vec![f32::NAN; m * n];
                linear(&x, &packed, Some(&bias), &mut out);
                let (exact, modelled) = reference(format, &x, &w, k);
                for (i, &got) in out.iter().enumerate() {
                    let got = f64::from(got) - f64::from(bias[i % n]);
                    assert!(
                        (got - modelled[i]).abs() < 1e-4,
                        "{format:?} {m}x{k}x{n} at {i}: {got} want {}",
                        modelled[i]
                    );
                    let scale = (k as f64).sqrt() * 0.25;
                    let share = if format == Format::Int8(Dot::Avx2) {
                        0.02
                    } else {
                        0.01
                    };
                    assert!(
                        (got - exact[i]).abs() < share * scale,
                        "{format:?}: far from exact"
                    );
                }
                let mut plain = vec![0.0; m * n];
                linear(&x, &packed, None, &mut plain);
                assert!(plain
                    .iter()
                    .zip(&out)
                    .enumerate()
                    .all(|(i, (p, o))| (p + bias[i % n] - o).abs() < 1e-5));
            }
        }
    }

    /// A row of zeros gives the bias, and a row with a non-finite value gives non-finite sums
    /// in int8 too (quantising must not turn a NaN into a number the encoder's check misses).
    #[test]
    fn int8_keeps_zero_rows_exact_and_non_finite_rows_non_finite() {
        for format in every_format() {
            if !matches!(format, Format::Int8(_)) || !format.supported() {
                continue;
            }
            let k = 40;
            let mut seed = 9u32;
            let w = random(3 * k, &mut seed);
            let packed = PackedWeights::pack(format, &w, k, &[]);
            let mut x = vec![0.0f32; 3 * k];
            x[k + 5] = f32::NAN;
            x[2 * k + 7] = f32::INFINITY;
            let mut out = vec![0.0; 9];
            linear(&x, &packed, Some(&[1.0, 2.0, 3.0]), &mut out);
            assert_eq!(&out[..3], &[1.0, 2.0, 3.0], "{format:?}");
            assert!(
                out[3..].iter().all(|v| !v.is_finite()),
                "{format:?}: {out:?}"
            );
        }
    }
}
