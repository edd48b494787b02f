//! Greedy choice on the device (issue 52): each row's first largest logit, so a greedy step
//! copies one id a sequence back instead of its whole vocabulary's logits. `cpu_fwd` is the
//! decode loop's own greedy rule (`super::super::argmax`, numpy's argmax: the first of equal
//! maxima; a NaN is never larger, and a NaN first logit gives id 0), which the kernel of
//! `kernels/paged.cu` (`argmax_rows`) reproduces with a reduction that keeps the lower index on
//! ties.

use crate::model::engines::host::f32s;
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape};

/// Each row of `(rows, vocab)` logits to its greedy id, `(rows)` u32.
#[derive(Debug, Clone, Copy)]
pub struct ArgmaxRows;

impl CustomOp1 for ArgmaxRows {
    fn name(&self) -> &'static str {
        "argmax-rows"
    }

    fn cpu_fwd(&self, logits: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let (rows, vocab) = layout.shape().dims2()?;
        if vocab == 0 {
            candle_core::bail!("argmax over an empty vocabulary");
        }
        let values = f32s(logits, layout)?;
        let ids = values.chunks(vocab).map(super::super::argmax).collect();
        Ok((CpuStorage::U32(ids), Shape::from(rows)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        logits: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::cuda::argmax_rows(logits, layout)
    }
}

#[cfg(test)]
mod tests {
    use super::ArgmaxRows;
    use candle_core::{DType, Device, Tensor};

    /// The first of equal maxima, a NaN never chosen past the first logit, in every dtype.
    #[test]
    fn each_row_gives_its_first_largest_logit() {
        let nan = f32::NAN;
        let rows = [
            vec![1.0, 3.0, 3.0, 2.0],
            vec![-1.0, nan, -0.5, -0.5],
            vec![nan, 5.0, 1.0, 0.0],
            vec![
                f32::NEG_INFINITY,
                f32::NEG_INFINITY,
                -7.0,
                f32::NEG_INFINITY,
            ],
        ];
        let want = [1u32, 2, 0, 2];
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let flat: Vec<f32> = rows.iter().flatten().copied().collect();
            let t = Tensor::from_vec(flat, (4, 4), &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let got = t.apply_op1(ArgmaxRows).unwrap().to_vec1::<u32>().unwrap();
            assert_eq!(got, want, "{dtype:?}");
        }
    }
}
