//! The rotary embedding of a step's attention rows in one op (issue 52): the stacked Q, K, V
//! product's rows in, the same rows out with each query and key head rotated by its token's
//! angles (transformers' `rotate_half` form: a head's first half paired with its second) and the
//! values copied. One launch on a GPU where candle's operations took seven (two copies of the
//! strided query and key columns, a rotation each, three copies to stack them again), for every
//! layer of every step.
//!
//! Each output element is `x₁·cos − x₂·sin` or `x₁·sin + x₂·cos` in f32 from the row's values,
//! rounded once to the rows' dtype: in f32 the very values candle's `rope_thd` gives (the tests),
//! and on a GPU the kernel `rotary_rows` of `kernels/paged.cu` computes the same (no contracted
//! multiply-adds), so the device check asks for equality.

use crate::model::engines::host::{f32s, storage};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape};

/// The rotation of rows `(tokens, (heads + 2 kv_heads) · head_dim)` by the tokens' cosines and
/// sines `(tokens, head_dim / 2)`: queries at column 0, keys after them, values last.
#[derive(Clone, Copy, Debug)]
pub struct RotaryRows {
    /// Query heads.
    pub heads: usize,
    /// Key and value heads.
    pub kv_heads: usize,
    /// Width of a head (even).
    pub head_dim: usize,
}

impl RotaryRows {
    /// Columns of a row.
    pub fn width(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }

    /// The rows' token count, checked against the operands' shapes.
    fn tokens(&self, rows: &Layout, cos: &Layout, sin: &Layout) -> Result<usize> {
        let (tokens, width) = rows.shape().dims2()?;
        let half = self.head_dim / 2;
        if width != self.width()
            || cos.shape().dims2()? != (tokens, half)
            || sin.shape() != cos.shape()
        {
            candle_core::bail!(
                "rotary rows: rows {:?}, angles {:?} and {:?} for {} + 2 × {} heads of {}",
                rows.shape(),
                cos.shape(),
                sin.shape(),
                self.heads,
                self.kv_heads,
                self.head_dim
            );
        }
        Ok(tokens)
    }
}

impl CustomOp3 for RotaryRows {
    fn name(&self) -> &'static str {
        "rotary-rows"
    }

    fn cpu_fwd(
        &self,
        rows: &CpuStorage,
        rows_layout: &Layout,
        cos: &CpuStorage,
        cos_layout: &Layout,
        sin: &CpuStorage,
        sin_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let tokens = self.tokens(rows_layout, cos_layout, sin_layout)?;
        let (width, d, half) = (self.width(), self.head_dim, self.head_dim / 2);
        let dtype = rows.dtype();
        let mut out = f32s(rows, rows_layout)?;
        let (cos, sin) = (f32s(cos, cos_layout)?, f32s(sin, sin_layout)?);
        for (t, row) in out.chunks_mut(width).enumerate() {
            let (c, s) = (&cos[t * half..][..half], &sin[t * half..][..half]);
            for head in row[..(self.heads + self.kv_heads) * d].chunks_mut(d) {
                let (first, second) = head.split_at_mut(half);
                for i in 0..half {
                    let (x1, x2) = (first[i], second[i]);
                    first[i] = x1 * c[i] - x2 * s[i];
                    second[i] = x1 * s[i] + x2 * c[i];
                }
            }
        }
        Ok((storage(out, dtype)?, Shape::from((tokens, width))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        rows: &candle_core::CudaStorage,
        rows_layout: &Layout,
        cos: &candle_core::CudaStorage,
        cos_layout: &Layout,
        sin: &candle_core::CudaStorage,
        sin_layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let tokens = self.tokens(rows_layout, cos_layout, sin_layout)?;
        let out = super::cuda::rotary_rows(
            self,
            (rows, rows_layout),
            (cos, cos_layout),
            (sin, sin_layout),
            tokens,
        )?;
        Ok((out, Shape::from((tokens, self.width()))))
    }
}

#[cfg(test)]
mod tests {
    use super::RotaryRows;
    use crate::model::engines::decoder::paged::rows::random_rows;
    use candle_core::{DType, Tensor};

    /// In f32 the op gives, bit for bit, what candle's `rope_thd` gives on the query and key
    /// heads cut out of the rows, and copies the values.
    #[test]
    fn equals_candle_rope_in_f32() {
        let (heads, kv_heads, d, tokens) = (6, 2, 16, 5);
        let width = (heads + 2 * kv_heads) * d;
        let rows = random_rows(tokens, width, 7, DType::F32).unwrap();
        let angles = random_rows(tokens, d / 2, 8, DType::F32).unwrap();
        let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
        let op = RotaryRows {
            heads,
            kv_heads,
            head_dim: d,
        };
        let got = rows.apply_op3(&cos, &sin, op).unwrap();
        let rope = |at: usize, n: usize| {
            let part = rows
                .narrow(1, at, n * d)
                .unwrap()
                .reshape((1, tokens, n, d))
                .unwrap();
            candle_nn::rotary_emb::rope_thd(&part.contiguous().unwrap(), &cos, &sin)
                .unwrap()
                .reshape((tokens, n * d))
                .unwrap()
        };
        let values = rows
            .narrow(1, (heads + kv_heads) * d, kv_heads * d)
            .unwrap();
        let want = Tensor::cat(&[rope(0, heads), rope(heads * d, kv_heads), values], 1).unwrap();
        let (got, want) = (
            got.to_vec2::<f32>().unwrap(),
            want.to_vec2::<f32>().unwrap(),
        );
        for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
            assert_eq!(g.to_bits(), w.to_bits());
        }
        assert_eq!(got.len(), tokens);
        assert_ne!(got, rows.to_vec2::<f32>().unwrap(), "the rows were rotated");
    }
}
