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

/// Keys per tile of the attention kernels (a warp's lanes on the GPU).
pub const KEY_TILE: usize = 32;

/// One query row's attention over `n` keys and values (`kv(j)` gives key `j` and value `j`), as
/// the engines' attention kernels compute it (the unpadded encoder's `varlen_attention.cu`, the
/// paged decoder's `paged.cu`): keys in tiles of [`KEY_TILE`] in order, each score a sum over the
/// head in order times `scale`, a running maximum `m` and sum `l`, each tile's correction
/// `exp(m_old − m_new)` applied before its keys are added one by one. Written to `out`.
pub fn attend<'a>(
    q: &[f32],
    scale: f32,
    n: usize,
    kv: impl Fn(usize) -> (&'a [f32], &'a [f32]),
    out: &mut [f32],
) {
    let (mut m, mut l) = (f32::NEG_INFINITY, 0f32);
    out.fill(0.0);
    let mut p = [0f32; KEY_TILE];
    for tile in (0..n).step_by(KEY_TILE) {
        let keys = tile..(tile + KEY_TILE).min(n);
        let mut tile_max = f32::NEG_INFINITY;
        for (pj, j) in p.iter_mut().zip(keys.clone()) {
            let mut s = 0f32;
            for (a, b) in q.iter().zip(kv(j).0) {
                s += a * b;
            }
            *pj = s * scale;
            tile_max = tile_max.max(*pj);
        }
        let m_new = m.max(tile_max);
        let correction = (m - m_new).exp();
        l *= correction;
        out.iter_mut().for_each(|o| *o *= correction);
        for (pj, j) in p.iter_mut().zip(keys) {
            *pj = (*pj - m_new).exp();
            l += *pj;
            for (o, x) in out.iter_mut().zip(kv(j).1) {
                *o += *pj * x;
            }
        }
        m = m_new;
    }
    out.iter_mut().for_each(|o| *o /= l);
}
