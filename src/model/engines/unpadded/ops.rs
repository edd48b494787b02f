//! The unpadded encoder's three fused operations, each a candle custom op: `cpu_fwd` is the
//! reference (the same algorithm, run by candle's CPU backend in the tests) and `cuda_fwd`
//! (`super::cuda`) the GPU kernel. Arithmetic is f32 whatever the tensors' dtype (f32, f16 or
//! bf16); each result is rounded once to the dtype, as the kernels round it.
//!
//! * [`Dense`]: `x·Wᵀ + b`, one cuBLASLt call with the bias as its epilogue ([`GemmCall`]);
//! * [`VarlenAttention`]: attention within each sequence of a packed batch, online softmax over
//!   tiles of 32 keys (`kernels/varlen_attention.cu`; the reference is `host::attend`, which the
//!   paged decoder's attention shares);
//! * [`AddNorm`]: `LayerNorm(x + residual)`, one block-wide reduction per row
//!   (`kernels/add_layer_norm.cu`); for a pre-LayerNorm tower (CLIP's and ViT's image towers) it
//!   also gives the sum, the residual stream the next layer adds to.

use super::gemm::GemmCall;
use crate::model::engines::host::{attend, f32s, storage, tensor_f32, u32s};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};

/// Threads per row of [`AddNorm`] (its kernel's block).
pub const NORM_THREADS: usize = 128;
/// The widest head [`VarlenAttention`]'s kernel holds (4 elements a lane).
pub const MAX_HEAD_DIM: usize = 128;
/// The widest row [`AddNorm`]'s kernel holds (16 elements a thread).
pub const MAX_NORM_WIDTH: usize = NORM_THREADS * 16;

/// `x·Wᵀ + b` for `x` `(tokens, inputs)` and a transformers `Linear`'s weight `(outputs,
/// inputs)` and bias `(outputs)`, all in one dtype.
#[derive(Clone)]
pub struct Dense {
    pub weight: Tensor,
    pub bias: Tensor,
}

impl Dense {
    /// The layer on `x` `(tokens, inputs)`. On CUDA in f32 it stays candle's product and a bias
    /// add: cudarc's f32 cuBLASLt computes in TF32, which would lower f32's exactness.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.device().is_cuda() && x.dtype() == DType::F32 {
            return x.matmul(&self.weight.t()?)?.broadcast_add(&self.bias);
        }
        x.apply_op1(self.clone())
    }

    /// The call the product is, for `tokens` rows.
    pub fn call(&self, tokens: usize) -> Result<GemmCall> {
        let (outputs, inputs) = self.weight.dims2()?;
        Ok(GemmCall::linear(tokens, inputs, outputs))
    }
}

impl CustomOp1 for Dense {
    fn name(&self) -> &'static str {
        "dense"
    }

    fn cpu_fwd(&self, x: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let (tokens, _) = layout.shape().dims2()?;
        let call = self.call(tokens)?;
        let (w, b) = (tensor_f32(&self.weight)?, tensor_f32(&self.bias)?);
        let mut y = vec![0f32; tokens * call.m];
        call.reference(&w, &f32s(x, layout)?, Some(&b), &mut y);
        Ok((storage(y, x.dtype())?, Shape::from((tokens, call.m))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::dense(self, x, layout)
    }
}

/// Attention within each sequence of a packed batch: `qkv` `(tokens, 3·heads·head_dim)` with each
/// row `[q | k | v]` and head `h` at `h·head_dim` in each third, and `cu_seqlens` (u32,
/// sequences + 1) the first row of each sequence and the total last. Gives `(tokens,
/// heads·head_dim)`. No mask: a sequence's rows see only each other.
#[derive(Clone, Copy)]
pub struct VarlenAttention {
    pub heads: usize,
    pub head_dim: usize,
    /// The longest sequence of the batch (the kernel's grid is sized by it).
    pub max_len: usize,
}

impl VarlenAttention {
    /// The softmax's scale, `1/√head_dim`.
    pub fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }
}

impl CustomOp2 for VarlenAttention {
    fn name(&self) -> &'static str {
        "varlen-attention"
    }

    fn cpu_fwd(
        &self,
        qkv: &CpuStorage,
        qkv_layout: &Layout,
        cu_seqlens: &CpuStorage,
        cu_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (tokens, stride) = qkv_layout.shape().dims2()?;
        let (hd, width) = (self.head_dim, self.heads * self.head_dim);
        if stride != 3 * width {
            candle_core::bail!("varlen-attention: rows of {stride}, want 3 × {width}");
        }
        let cu = bounds(cu_seqlens, cu_layout, tokens)?;
        // The kernel's grid covers `max_len` queries a sequence: a longer one would lose rows.
        if let Some(n) = cu
            .windows(2)
            .map(|w| (w[1] - w[0]) as usize)
            .find(|&n| n > self.max_len)
        {
            candle_core::bail!(
                "varlen-attention: a sequence of {n} past max_len {}",
                self.max_len
            );
        }
        let dtype = qkv.dtype();
        let qkv = f32s(qkv, qkv_layout)?;
        let mut out = vec![0f32; tokens * width];
        for seq in cu.windows(2) {
            let rows = seq[0] as usize..seq[1] as usize;
            for h in 0..self.heads {
                let part = |row: usize, third: usize| {
                    let at = row * stride + third * width + h * hd;
                    &qkv[at..at + hd]
                };
                let first = rows.start;
                let kv = |j: usize| (part(first + j, 1), part(first + j, 2));
                for r in rows.clone() {
                    let at = r * width + h * hd;
                    attend(
                        part(r, 0),
                        self.scale(),
                        rows.len(),
                        kv,
                        &mut out[at..at + hd],
                    );
                }
            }
        }
        Ok((storage(out, dtype)?, Shape::from((tokens, width))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        qkv: &candle_core::CudaStorage,
        qkv_layout: &Layout,
        cu_seqlens: &candle_core::CudaStorage,
        cu_layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::varlen_attention(self, qkv, qkv_layout, cu_seqlens, cu_layout)
    }
}

/// `LayerNorm(x + residual)·gamma + beta` over each row of `(tokens, width)`, with the sums as the
/// kernel's block adds them ([`block_sum`]). With `keep_sum` the result is `(2, tokens, width)`:
/// the normalised rows, then `x + residual` rounded to the dtype (a pre-LayerNorm layer needs
/// both, and one pass writes both).
#[derive(Clone)]
pub struct AddNorm {
    pub gamma: Tensor,
    pub beta: Tensor,
    pub eps: f32,
    pub keep_sum: bool,
}

impl AddNorm {
    /// A LayerNorm's weights as the op, giving the normalised rows alone.
    pub fn new(norm: &candle_nn::LayerNorm) -> Result<Self> {
        let Some(beta) = norm.bias() else {
            candle_core::bail!("a LayerNorm without a bias");
        };
        Ok(Self {
            gamma: norm.weight().clone(),
            beta: beta.clone(),
            eps: norm.eps() as f32,
            keep_sum: false,
        })
    }

    /// The same norm, also giving the sum.
    pub fn keeping_sum(&self) -> Self {
        Self {
            keep_sum: true,
            ..self.clone()
        }
    }

    /// The output's shape for `(tokens, width)` operands.
    pub fn out_shape(&self, shape: &Shape) -> Result<Shape> {
        let (tokens, width) = shape.dims2()?;
        Ok(match self.keep_sum {
            true => Shape::from((2, tokens, width)),
            false => Shape::from((tokens, width)),
        })
    }
}

impl CustomOp2 for AddNorm {
    fn name(&self) -> &'static str {
        "add-layer-norm"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        x_layout: &Layout,
        residual: &CpuStorage,
        r_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (tokens, width) = x_layout.shape().dims2()?;
        if r_layout.shape() != x_layout.shape() {
            candle_core::bail!("add-layer-norm: residual {:?}", r_layout.shape());
        }
        let (g, b) = (tensor_f32(&self.gamma)?, tensor_f32(&self.beta)?);
        let (x_values, r_values) = (f32s(x, x_layout)?, f32s(residual, r_layout)?);
        let rows = tokens * width;
        let mut out = vec![0f32; if self.keep_sum { 2 * rows } else { rows }];
        for row in 0..tokens {
            let span = row * width..(row + 1) * width;
            let v: Vec<f32> = x_values[span.clone()]
                .iter()
                .zip(&r_values[span.clone()])
                .map(|(a, b)| a + b)
                .collect();
            let mean = block_sum(&v) / width as f32;
            let squares: Vec<f32> = v.iter().map(|x| (x - mean) * (x - mean)).collect();
            let inv = 1.0 / (block_sum(&squares) / width as f32 + self.eps).sqrt();
            for (i, o) in out[span.clone()].iter_mut().enumerate() {
                *o = (v[i] - mean) * inv * g[i] + b[i];
            }
            if self.keep_sum {
                out[rows + span.start..rows + span.end].copy_from_slice(&v);
            }
        }
        Ok((storage(out, x.dtype())?, self.out_shape(x_layout.shape())?))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        x_layout: &Layout,
        residual: &candle_core::CudaStorage,
        r_layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::add_norm(self, x, x_layout, residual, r_layout)
    }
}

/// A row's sum as [`AddNorm`]'s kernel adds it: thread `t` of [`NORM_THREADS`] sums elements
/// `t, t + NORM_THREADS, …` in turn; each warp of 32 folds its lanes by xor-shuffles of 16, 8,
/// 4, 2 and 1 (after which every lane holds the same value); the warps' sums are added in order.
pub fn block_sum(values: &[f32]) -> f32 {
    let mut lanes = [0f32; NORM_THREADS];
    for (i, v) in values.iter().enumerate() {
        lanes[i % NORM_THREADS] += v;
    }
    let mut total = 0f32;
    for warp in lanes.chunks_mut(32) {
        for offset in [16, 8, 4, 2, 1] {
            let before: [f32; 32] = warp.try_into().unwrap_or([0.0; 32]);
            for (lane, v) in warp.iter_mut().enumerate() {
                *v += before[lane ^ offset];
            }
        }
        total += warp[0];
    }
    total
}

/// A packed batch's sequence bounds, checked: starting at 0, never decreasing, ending at
/// `tokens`.
fn bounds(s: &CpuStorage, layout: &Layout, tokens: usize) -> Result<Vec<u32>> {
    let cu = u32s(s, layout)?;
    let ordered = cu.windows(2).all(|w| w[0] <= w[1]);
    if cu.first() != Some(&0) || cu.last() != Some(&(tokens as u32)) || !ordered {
        candle_core::bail!("cu_seqlens {cu:?} do not cover {tokens} tokens in order");
    }
    Ok(cu)
}

#[cfg(test)]
mod tests {
    use super::block_sum;

    /// The emulated block reduction adds every value once: its sum of small integers (exact
    /// in f32 in any order) is the plain sum, for lengths around the block's threads.
    #[test]
    fn the_block_sum_adds_each_value_once() {
        for n in [1, 31, 32, 127, 128, 129, 384, 1000, 2048] {
            let values: Vec<f32> = (0..n).map(|i| ((i * 7) % 13) as f32 - 6.0).collect();
            assert_eq!(block_sum(&values), values.iter().sum::<f32>(), "{n} values");
        }
    }
}
