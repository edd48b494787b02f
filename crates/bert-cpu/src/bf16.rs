//! The dense layers in bf16 with f32 accumulation, for CPUs with AVX-512 BF16.
//!
//! `vdpbf16ps` multiplies 32 pairs of bf16 numbers and adds each pair's two products into 16 f32
//! sums: twice the multiply-adds per instruction of an f32 FMA, on the same registers. The
//! weights are rounded to bf16 once, at load, and packed in the order the kernel reads them;
//! the activations are rounded per product. Everything else (sums, bias, softmax, layer norm,
//! GELU, pooling, the residual stream) stays f32, which is what keeps the vectors within a
//! cosine of 0.999 of the f32 encoder's.
//!
//! Packed layout: the `n` output columns in panels of 16 (the last one zero-padded), and within a
//! panel, for each pair of inputs `(2p, 2p + 1)`, the 16 columns' two weights side by side: one
//! 64-byte register per pair, loaded as is. `k` is padded to even with a zero weight.

use rayon::prelude::*;
use std::cell::RefCell;

/// Columns in a packed panel: one AVX-512 register of f32 sums.
const PANEL: usize = 16;
/// Rows of the product one kernel call computes (the broadcast side).
const MR: usize = 6;
/// Panels one kernel call computes: MR × NR sums in registers, 24 of AVX-512's 32.
const NR: usize = 4;
/// Rows converted and multiplied together, so their bf16 copy stays in the core's L2 while
/// every panel passes over them.
const MC: usize = 64;

/// Whether this CPU runs the bf16 kernels (AVX-512 F, BW and BF16), checked at run time.
pub fn supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// A weight matrix (PyTorch's `(n, k)`) rounded to bf16 and packed for the kernel.
pub(crate) struct PackedWeights {
    /// Output columns.
    n: usize,
    /// Inputs.
    k: usize,
    /// Input pairs: `k` rounded up to even, halved.
    pairs: usize,
    /// Pairs of bf16 as `u32` (low half the even input), panel after panel.
    data: Vec<u32>,
}

impl PackedWeights {
    /// Rounds `w` (`(n, k)`, row-major) to bf16, nearest-even, and packs it.
    pub(crate) fn pack(w: &[f32], k: usize) -> Self {
        assert!(
            k > 0 && w.len().is_multiple_of(k),
            "pack: inner size {k} of {}",
            w.len()
        );
        let n = w.len() / k;
        let pairs = k.div_ceil(2);
        let panels = n.div_ceil(PANEL);
        let mut data = vec![0u32; panels * pairs * PANEL];
        let at = |col: usize, i: usize| -> u32 {
            if col < n && i < k {
                u32::from(half::bf16::from_f32(w[col * k + i]).to_bits())
            } else {
                0
            }
        };
        for (panel, chunk) in data.chunks_exact_mut(pairs * PANEL).enumerate() {
            for (p, lanes) in chunk.chunks_exact_mut(PANEL).enumerate() {
                for (lane, v) in lanes.iter_mut().enumerate() {
                    let col = panel * PANEL + lane;
                    *v = at(col, 2 * p) | at(col, 2 * p + 1) << 16;
                }
            }
        }
        Self { n, k, pairs, data }
    }

    /// Bytes held.
    pub(crate) fn bytes(&self) -> usize {
        self.data.len() * 4
    }
}

thread_local! {
    /// Each thread's bf16 copy of the rows it multiplies, reused between calls.
    static ROWS: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}

/// `out = x · wᵀ (+ b)` with bf16 products and f32 sums; `x` is `(rows, k)`, `out` `(rows, n)`.
///
/// Panics unless the shapes agree or the CPU lacks the instructions ([`supported`]): the kernel
/// writes through raw pointers, so these checks keep it inside the slices in every build.
pub(crate) fn linear(x: &[f32], w: &PackedWeights, b: Option<&[f32]>, out: &mut [f32]) {
    let (n, k) = (w.n, w.k);
    assert!(x.len().is_multiple_of(k), "linear_bf16: inner size {k}");
    let m = x.len() / k;
    assert_eq!(out.len(), m * n, "linear_bf16: output of {m}x{n}");
    assert!(b.is_none_or(|b| b.len() == n), "linear_bf16: bias of {n}");
    assert!(supported(), "linear_bf16: this CPU has no AVX-512 BF16");
    let block = crate::kernels::block_rows(m, n * k, MR, MC);
    out.par_chunks_mut(block * n)
        .zip(x.par_chunks(block * k))
        .for_each(|(out, x)| {
            ROWS.with(|buf| {
                let mut buf = buf.borrow_mut();
                // SAFETY: supported() is checked above; shapes were checked above and per
                // block: x holds `rows` rows of k, out `rows` rows of n.
                #[cfg(target_arch = "x86_64")]
                unsafe {
                    avx512::block(x, w, b, out, &mut buf)
                }
                #[cfg(not(target_arch = "x86_64"))]
                unreachable!("supported() is false off x86_64: {}", buf.len())
            })
        });
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{PackedWeights, MC, MR, NR, PANEL};
    use std::arch::x86_64::*;

    /// One thread's rows: converted to bf16 `MC` at a time, then every panel over them.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F, BW and BF16; `x` holds whole rows of `w.k`, `out` the same
    /// number of rows of `w.n`, and `b` is `None` or `w.n` long.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn block(
        x: &[f32],
        w: &PackedWeights,
        b: Option<&[f32]>,
        out: &mut [f32],
        buf: &mut Vec<u32>,
    ) {
        let (n, k, pairs) = (w.n, w.k, w.pairs);
        let rows = x.len() / k;
        let panels = n.div_ceil(PANEL);
        for first in (0..rows).step_by(MC) {
            let count = MC.min(rows - first);
            if buf.len() < count * pairs {
                buf.resize(count * pairs, 0);
            }
            for r in 0..count {
                let row = &x[(first + r) * k..][..k];
                to_bf16(row, &mut buf[r * pairs..][..pairs]);
            }
            let mut panel = 0;
            while panel < panels {
                let take = NR.min(panels - panel);
                let mut r = 0;
                while r < count {
                    let tile = Tile {
                        rows: buf.as_ptr().add(r * pairs),
                        pairs,
                        weights: w.data.as_ptr().add(panel * pairs * PANEL),
                        out: out.as_mut_ptr().add((first + r) * n + panel * PANEL),
                        n,
                        cols: n - panel * PANEL,
                        bias: b.map(|b| b.as_ptr().add(panel * PANEL)),
                    };
                    let height = MR.min(count - r);
                    match take {
                        4 => tile.run_rows::<4>(height),
                        3 => tile.run_rows::<3>(height),
                        2 => tile.run_rows::<2>(height),
                        _ => tile.run_rows::<1>(height),
                    }
                    r += MR;
                }
                panel += take;
            }
        }
    }

    /// `row` rounded to bf16 (nearest even, as the weights), two per `u32`, the odd tail padded
    /// with zero.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn to_bf16(row: &[f32], dst: &mut [u32]) {
        let mut chunks = row.chunks_exact(32);
        let mut at = 0;
        for c in &mut chunks {
            let lo = _mm512_loadu_ps(c.as_ptr());
            let hi = _mm512_loadu_ps(c.as_ptr().add(16));
            let v: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
            _mm512_storeu_si512(dst.as_mut_ptr().add(at).cast(), v);
            at += 16;
        }
        let rest = chunks.remainder();
        let bits = |i: usize| -> u32 {
            rest.get(i)
                .map_or(0, |v| u32::from(half::bf16::from_f32(*v).to_bits()))
        };
        for (j, d) in dst[at..].iter_mut().enumerate() {
            *d = bits(2 * j) | bits(2 * j + 1) << 16;
        }
    }

    /// Up to MR rows by up to NR panels of the product, and where they go.
    struct Tile {
        /// The first row's bf16 pairs; rows `pairs` apart.
        rows: *const u32,
        pairs: usize,
        /// The first panel's packed weights; panels `pairs * PANEL` apart.
        weights: *const u32,
        /// The first row's first column in the output; rows `n` apart.
        out: *mut f32,
        n: usize,
        /// Output columns left from this tile's first (the last panel may be partial).
        cols: usize,
        bias: Option<*const f32>,
    }

    impl Tile {
        /// Dispatches a tile of `height` rows (1..=MR) to the kernel compiled for it.
        #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
        unsafe fn run_rows<const P: usize>(&self, height: usize) {
            match height {
                8 => self.run::<8, P>(),
                7 => self.run::<7, P>(),
                6 => self.run::<6, P>(),
                5 => self.run::<5, P>(),
                4 => self.run::<4, P>(),
                3 => self.run::<3, P>(),
                2 => self.run::<2, P>(),
                _ => self.run::<1, P>(),
            }
        }

        /// The kernel: R × P registers of sums over every input pair, then bias and store.
        #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
        #[inline]
        unsafe fn run<const R: usize, const P: usize>(&self) {
            let mut acc = [[_mm512_setzero_ps(); P]; R];
            let stride = self.pairs * PANEL;
            for p in 0..self.pairs {
                let mut w = [_mm512_setzero_ps(); P];
                for (j, w) in w.iter_mut().enumerate() {
                    *w = _mm512_loadu_ps(self.weights.add(j * stride + p * PANEL).cast());
                }
                for (i, acc) in acc.iter_mut().enumerate() {
                    let a = _mm512_set1_epi32(*self.rows.add(i * self.pairs + p) as i32);
                    let a: __m512bh = std::mem::transmute(a);
                    for (acc, w) in acc.iter_mut().zip(&w) {
                        *acc =
                            _mm512_dpbf16_ps(*acc, a, std::mem::transmute::<__m512, __m512bh>(*w));
                    }
                }
            }
            for (i, acc) in acc.iter().enumerate() {
                for (j, &sum) in acc.iter().enumerate() {
                    let left = self.cols.saturating_sub(j * PANEL);
                    let mask: __mmask16 = if left >= PANEL {
                        0xffff
                    } else {
                        (1u16 << left) - 1
                    };
                    let sum = match self.bias {
                        Some(b) => {
                            _mm512_add_ps(sum, _mm512_maskz_loadu_ps(mask, b.add(j * PANEL)))
                        }
                        None => sum,
                    };
                    _mm512_mask_storeu_ps(self.out.add(i * self.n + j * PANEL), mask, sum);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every shape the tails can take (rows not a multiple of MR or MC, columns not a multiple
    /// of a panel or of NR panels, odd inputs) against the f32 product of the same bf16 values.
    #[test]
    fn the_bf16_product_is_the_f32_product_of_rounded_values() {
        if !supported() {
            eprintln!("skipped: this CPU has no AVX-512 BF16");
            return;
        }
        let round = |v: f32| half::bf16::from_f32(v).to_f32();
        let mut seed = 3u32;
        let mut next = move || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (seed >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        };
        for (m, k, n) in [
            (1, 1, 1),
            (3, 7, 5),
            (9, 33, 17),
            (70, 64, 49),
            (130, 40, 96),
            (701, 24, 20),
        ] {
            let x: Vec<f32> = (0..m * k).map(|_| next()).collect();
            let w: Vec<f32> = (0..n * k).map(|_| next()).collect();
            let bias: Vec<f32> = (0..n).map(|_| next()).collect();
            let packed = PackedWeights::pack(&w, k);
            let mut out = vec![f32::NAN; m * n];
            linear(&x, &packed, Some(&bias), &mut out);
            for r in 0..m {
                for c in 0..n {
                    let want: f64 = (0..k)
                        .map(|i| f64::from(round(x[r * k + i])) * f64::from(round(w[c * k + i])))
                        .sum::<f64>()
                        + f64::from(bias[c]);
                    let got = f64::from(out[r * n + c]);
                    assert!(
                        (got - want).abs() < 1e-4,
                        "{m}x{k}x{n} at ({r}, {c}): {got} want {want}"
                    );
                }
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
