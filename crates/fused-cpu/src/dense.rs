//! One dense layer's weight matrix, PyTorch's `(out, in)`, for every network of this crate (the
//! text encoder, the decoder, the image towers): packed for this crate's kernel of the chosen
//! precision where this CPU has one, the f32 weights as read where not, or (the decoder's GGUF
//! weights) left in the file's block formats.

use crate::kernels::{gemm_instructions, linear};
use crate::packed::{self, Format, PackedWeights};
use crate::quant::{self, BlockMatrix, Kernel};
use std::sync::Arc;
use std::sync::{Mutex, PoisonError};

/// A weight matrix in the forms the precisions use.
pub(crate) struct Dense {
    /// Inputs per output.
    pub k: usize,
    /// f32 weights, as read; empty once released for packed weights.
    pub f32: Vec<f32>,
    /// The weights packed for the chosen precision's kernel, if it has one on this CPU.
    pub packed: Option<PackedWeights>,
    /// The weights in GGUF block formats, stacked (the outputs of each after the previous'),
    /// and the kernel that multiplies them; empty for f32 and packed weights.
    pub blocks: Vec<Arc<BlockMatrix>>,
    kernel: Kernel,
    /// Each input's largest magnitude over what [`Dense::record`] saw (the text encoder's
    /// calibration; empty elsewhere), from which int8 smooths its inputs.
    pub ranges: Mutex<Vec<f32>>,
}

impl Dense {
    /// The f32 weights as read, not packed yet.
    pub fn new(f32: Vec<f32>, k: usize) -> Self {
        Self {
            k,
            f32,
            packed: None,
            blocks: Vec::new(),
            kernel: Kernel::best(),
            ranges: Mutex::new(Vec::new()),
        }
    }

    /// The matrix stacked from `parts`, kept in their block formats (laid out for `kernel`),
    /// multiplied by `kernel`.
    pub fn blocks(parts: Vec<Arc<BlockMatrix>>, kernel: Kernel) -> Self {
        let k = parts.first().map_or(0, |p| p.k());
        Self {
            blocks: parts,
            kernel,
            ..Self::new(Vec::new(), k)
        }
    }

    /// The weights packed for `format` and the f32 copy dropped, so a network is never held
    /// twice; as read where `format` is `None`.
    pub fn packed(f32: Vec<f32>, k: usize, format: Option<Format>) -> Self {
        let mut dense = Self::new(f32, k);
        if let Some(format) = format {
            dense.packed = Some(PackedWeights::pack(format, &dense.f32, k, &[]));
            dense.f32 = Vec::new();
        }
        dense
    }

    /// Widens [`Dense::ranges`] to the inputs `x`.
    pub fn record(&self, x: &[f32]) {
        let mut ranges = self.ranges.lock().unwrap_or_else(PoisonError::into_inner);
        ranges.resize(self.k, 0.0);
        for row in x.chunks_exact(self.k) {
            for (r, v) in ranges.iter_mut().zip(row) {
                *r = r.max(v.abs());
            }
        }
    }

    /// `out = x · wᵀ (+ b)`, blocked by rows: many rows at once.
    pub fn apply(&self, x: &[f32], b: Option<&[f32]>, out: &mut [f32]) {
        if !self.blocks.is_empty() {
            return quant::linear(self.kernel, x, &self.blocks, b, out);
        }
        match &self.packed {
            Some(w) => packed::linear(x, w, b, out),
            None => linear(x, self.k, &self.f32, b, out),
        }
    }

    /// As [`Dense::apply`], split by columns where there are few rows (a decode step's).
    pub fn apply_wide(&self, x: &[f32], b: Option<&[f32]>, out: &mut [f32]) {
        if !self.blocks.is_empty() {
            return quant::linear(self.kernel, x, &self.blocks, b, out);
        }
        match &self.packed {
            Some(w) => packed::linear_wide(x, w, b, out),
            None => linear(x, self.k, &self.f32, b, out),
        }
    }

    /// As [`Dense::apply_wide`] without a bias, but each row `t` either keeps its outputs
    /// (`keep[t]`: written in order into `kept`) or gets the index of its largest output only
    /// (`Some`: the first of the largest, as a scan keeping the first strictly larger value
    /// finds it). Block weights choose share by share without holding the rows' outputs whole
    /// (`quant::linear_choosing`); the other forms compute them whole and scan them. Where every
    /// row is kept, this is [`Dense::apply_wide`] into `kept`.
    pub fn apply_choosing(&self, x: &[f32], keep: &[bool], kept: &mut [f32]) -> Vec<Option<u32>> {
        if keep.is_empty() {
            return Vec::new();
        }
        if keep.iter().all(|&k| k) {
            self.apply_wide(x, None, kept);
            return vec![None; keep.len()];
        }
        if !self.blocks.is_empty() {
            return quant::linear_choosing(self.kernel, x, &self.blocks, keep, kept);
        }
        let n = self.outputs();
        let mut all = vec![0f32; keep.len() * n];
        self.apply_wide(x, None, &mut all);
        let mut kept_rows = kept.chunks_exact_mut(n);
        let choose = |(row, &keep): (&[f32], &bool)| {
            if !keep {
                return Some(quant::argmax(row));
            }
            if let Some(to) = kept_rows.next() {
                to.copy_from_slice(row);
            }
            None
        };
        all.chunks_exact(n).zip(keep).map(choose).collect()
    }

    /// Its number of outputs.
    fn outputs(&self) -> usize {
        match &self.packed {
            _ if !self.blocks.is_empty() => self.blocks.iter().map(|b| b.rows()).sum(),
            Some(w) => w.n,
            None => self.f32.len() / self.k.max(1),
        }
    }

    /// The instructions its products run on, for logs and benchmarks.
    pub fn kernels(&self) -> &'static str {
        if !self.blocks.is_empty() {
            return self.kernel.name();
        }
        match &self.packed {
            Some(w) => w.format.kernels(),
            None => gemm_instructions(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::BlockFormat;
    use crate::Precision;

    /// In every form a dense layer takes (f32 as read, packed, GGUF blocks in either layout),
    /// a kept row is the whole product's row bit for bit and a chosen row gets the first of its
    /// largest outputs.
    #[test]
    fn choosing_gives_the_whole_products_rows_and_their_first_largest_in_every_form() {
        let (n, k, m) = (1_100, 64, 6);
        let mut seed = 29u32;
        let mut next = move || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            seed >> 8
        };
        // The second half of the outputs repeats the first: every largest output is there twice,
        // in two shares of a block product's choice.
        let half: Vec<f32> = (0..n / 2 * k).map(|_| (next() % 5) as f32 - 2.0).collect();
        let w = [half.as_slice(), &half].concat();
        let x: Vec<f32> = (0..m * k).map(|_| (next() % 3) as f32).collect();
        // Q8_0 holds these weights exactly: per 32, an f16 scale of 1 and the values as bytes.
        let bytes: Vec<u8> = w
            .chunks_exact(32)
            .flat_map(|b| {
                let scale = half::f16::from_f32(1.0).to_le_bytes();
                scale.into_iter().chain(b.iter().map(|&v| v as i8 as u8))
            })
            .collect();
        let matrix = BlockMatrix::new(BlockFormat::Q8_0, n, k, bytes).expect("matrix");
        let packed = Precision::F32
            .format(crate::Widest::All)
            .expect("f32 packs everywhere");
        let forms = [
            Dense::new(w.clone(), k),
            Dense::packed(w.clone(), k, packed),
            Dense::blocks(vec![Arc::new(matrix.clone())], Kernel::Portable),
            Dense::blocks(
                vec![Arc::new(matrix.laid_out_for(Kernel::best()))],
                Kernel::best(),
            ),
        ];
        let keep = [true, false, false, true, false, true];
        for (f, dense) in forms.iter().enumerate() {
            let mut whole = vec![0f32; m * n];
            dense.apply_wide(&x, None, &mut whole);
            let mut kept = vec![0f32; 3 * n];
            let chosen = dense.apply_choosing(&x, &keep, &mut kept);
            let mut kept_rows = kept.chunks_exact(n);
            for (t, row) in whole.chunks_exact(n).enumerate() {
                let first_largest =
                    row.iter()
                        .enumerate()
                        .fold(0, |best, (i, &v)| if v > row[best] { i } else { best });
                match chosen[t] {
                    None => assert_eq!(kept_rows.next(), Some(row), "form {f}, row {t}"),
                    Some(i) => assert_eq!(i as usize, first_largest, "form {f}, row {t}"),
                }
                assert_eq!(chosen[t].is_none(), keep[t], "form {f}, row {t}");
            }
        }
    }
}
