//! The CPU side of the engines' custom ops: their operands read as f32 and their results rounded
//! back, as each op's reference (`cpu_fwd`) computes, whatever the tensors' dtype.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Layout, Result, Tensor};

/// A tensor's values as f32 on the host (weights, read by the reference ops).
pub fn tensor_f32(t: &Tensor) -> Result<Vec<f32>> {
    t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()
}

/// A contiguous CPU operand's values as f32.
pub fn f32s(s: &CpuStorage, layout: &Layout) -> Result<Vec<f32>> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle_core::bail!("custom ops take contiguous operands");
    };
    Ok(match s {
        CpuStorage::F32(v) => v[start..end].to_vec(),
        CpuStorage::F16(v) => v[start..end].iter().map(|x| x.to_f32()).collect(),
        CpuStorage::BF16(v) => v[start..end].iter().map(|x| x.to_f32()).collect(),
        other => candle_core::bail!(
            "custom ops run in f32, f16 or bf16, not {:?}",
            other.dtype()
        ),
    })
}

/// A contiguous u32 CPU operand's values.
pub fn u32s(s: &CpuStorage, layout: &Layout) -> Result<Vec<u32>> {
    let (CpuStorage::U32(v), Some((start, end))) = (s, layout.contiguous_offsets()) else {
        candle_core::bail!("a contiguous u32 operand");
    };
    Ok(v[start..end].to_vec())
}

/// f32 values rounded once to `dtype`.
pub fn storage(values: Vec<f32>, dtype: DType) -> Result<CpuStorage> {
    Ok(match dtype {
        DType::F32 => CpuStorage::F32(values),
        DType::F16 => CpuStorage::F16(values.into_iter().map(half::f16::from_f32).collect()),
        DType::BF16 => CpuStorage::BF16(values.into_iter().map(half::bf16::from_f32).collect()),
        other => candle_core::bail!("custom ops run in f32, f16 or bf16, not {other:?}"),
    })
}
