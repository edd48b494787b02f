//! The paged decoder's dense layers, `x · Wᵀ (+ b)`, with each output row computed from its own
//! input row alone, its sums in one order whatever the batch: on candle's CPU backend a plain
//! custom op ([`RowLinear`]), since candle's CPU product (the `gemm` crate) picks its blocking by
//! the row count and so sums a row differently in a batch of 1 and of 40 (measured: a fixture
//! prompt's logits differed in their last bits read whole and in chunks of 17). On CUDA it is
//! the product pinned to one cuBLASLt configuration per weight shape (`super::pinned`, issue
//! 52), since cuBLAS's own heuristic may also change its algorithm with the row count; candle's
//! product stays reachable as [`default_linear`], which `super::products` times it against.

use crate::model::engines::host::{f32s, storage, tensor_f32};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

/// `x · wᵀ (+ b)` for `x` `(tokens, inputs)`, `w` `(outputs, inputs)`, `b` `(outputs)`, each
/// output row summed in one order whatever the batch: [`RowLinear`] on the CPU, the pinned
/// cuBLASLt product on CUDA (the bias added after, elementwise), candle's product elsewhere.
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return add_bias(super::pinned::pinned_product(x, w)?, b);
    }
    if !x.device().is_cpu() {
        return default_linear(x, w, b);
    }
    x.contiguous()?.apply_op1(RowLinear {
        weight: w.clone(),
        bias: b.cloned(),
    })
}

/// [`linear`] through candle's own product (cuBLAS on CUDA, `gemm` on the CPU), whose algorithm
/// may change with the row count: kept so that a check can time the pinned product against it.
pub fn default_linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    add_bias(x.matmul(&w.t()?)?, b)
}

/// `y + b`, `b` broadcast over the rows (elementwise: each row alone).
fn add_bias(y: Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    match b {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}

/// The CPU side of [`linear`]: each output element a sum over the inputs in order, in f32, the
/// bias added last, rounded once to the dtype.
struct RowLinear {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl CustomOp1 for RowLinear {
    fn name(&self) -> &'static str {
        "row-linear"
    }

    fn cpu_fwd(&self, x: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let (tokens, inputs) = layout.shape().dims2()?;
        let (outputs, k) = self.weight.dims2()?;
        if k != inputs {
            candle_core::bail!("row-linear: rows of {inputs} against weights of {k}");
        }
        let w = tensor_f32(&self.weight)?;
        let b = self.bias.as_ref().map(tensor_f32).transpose()?;
        let x_values = f32s(x, layout)?;
        let mut out = vec![0f32; tokens * outputs];
        for (row, y) in x_values.chunks(inputs).zip(out.chunks_mut(outputs)) {
            for (j, o) in y.iter_mut().enumerate() {
                let mut s = 0f32;
                for (a, c) in row.iter().zip(&w[j * inputs..(j + 1) * inputs]) {
                    s += a * c;
                }
                *o = s + b.as_ref().map_or(0.0, |b| b[j]);
            }
        }
        Ok((storage(out, x.dtype())?, Shape::from((tokens, outputs))))
    }
}
