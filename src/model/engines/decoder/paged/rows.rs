//! What the paged decoder's device checks share: rows of random values, the same on every
//! machine, and the largest difference between two results.

use crate::model::engines::unpadded::check::uniform;
use candle_core::{DType, Device, Result, Tensor};

/// The largest difference between two tensors' elements, in f32.
pub fn largest_difference(a: &Tensor, b: &Tensor) -> Result<f32> {
    let d = (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?;
    d.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
}

/// Random rows `(tokens, stride)` in `dtype` on the host, the same on every machine.
pub fn random_rows(tokens: usize, stride: usize, seed: u64, dtype: DType) -> Result<Tensor> {
    Tensor::from_vec(
        uniform(tokens * stride, seed)?,
        (tokens, stride),
        &Device::Cpu,
    )?
    .to_dtype(dtype)
}
