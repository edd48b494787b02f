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
