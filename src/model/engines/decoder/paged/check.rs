//! The paged cache's operations on a device against their CPU references, and their batch
//! invariance on the device itself: what `spotinfer models kernels --paged` prints and the GPU
//! check runs on a GPU (on the CPU the two sides are the same code, which is how CI runs it).

use super::attention::{PagedAttention, RowLayout, WriteCache};
use super::blocks::BlockPool;
use crate::model::engines::unpadded::check::{compare, uniform, KernelCheck};
use candle_core::{DType, Device, Result, Tensor};

/// Slots a block in the checks and tests.
pub const BLOCK: usize = 16;
/// Blocks in the checks' and tests' pool.
const BLOCKS: usize = 64;

/// A paged cache on a device and the steps run on it, as a decoder runs them: each step's new
/// rows written to their slots, then attended.
pub struct Harness {
    layout: RowLayout,
    /// The host's bookkeeping of the cache's blocks.
    pub pool: BlockPool,
    kv: Tensor,
}

impl Harness {
    /// An empty cache of `layout`'s heads in `dtype` on `device`.
    pub fn new(layout: RowLayout, dtype: DType, device: &Device) -> Result<Self> {
        let shape = (2, BLOCKS * BLOCK, layout.kv_heads, layout.head_dim);
        Ok(Self {
            layout,
            pool: BlockPool::new(BLOCKS, BLOCK),
            kv: Tensor::zeros(shape, dtype, device)?,
        })
    }

    /// One step over `feeds` (an admitted sequence, its new rows on the host): the rows'
    /// attention outputs in order, on the host.
    pub fn step(&mut self, feeds: &[(u64, Tensor)]) -> Result<Tensor> {
        let device = self.kv.device().clone();
        let (mut slots, mut plan) = (vec![], vec![]);
        for (row, (seq, rows)) in feeds.iter().enumerate() {
            let first = self.pool.len(*seq).unwrap_or(0);
            let n = rows.dims2()?.0;
            let taken = self
                .pool
                .append(*seq, n)
                .map_err(candle_core::Error::wrap)?;
            slots.extend(taken);
            plan.extend((0..n).flat_map(|i| [row as u32, (first + i) as u32]));
        }
        let seqs: Vec<u64> = feeds.iter().map(|f| f.0).collect();
        let rows: Vec<&Tensor> = feeds.iter().map(|f| &f.1).collect();
        let rows = Tensor::cat(&rows, 0)?.to_device(&device)?;
        let slots = Tensor::new(slots, &device)?;
        self.kv
            .inplace_op3(&rows, &slots, &WriteCache(self.layout))?;
        let (tables, width) = self
            .pool
            .table_matrix(&seqs)
            .map_err(candle_core::Error::wrap)?;
        plan.extend(tables);
        let op = PagedAttention {
            layout: self.layout,
            block_size: BLOCK,
            width,
        };
        rows.apply_op3(&self.kv, &Tensor::new(plan, &device)?, op)?
            .to_device(&Device::Cpu)
    }

    /// The cache's contents, on the host.
    pub fn cache(&self) -> Result<Tensor> {
        self.kv.to_device(&Device::Cpu)
    }
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

/// The paged operations on `device` at the SmolLM2-135M (9 heads, 3 KV heads of 64) and
/// Qwen2-0.5B (14 and 2 of 64) shapes in f32, f16 and bf16: the cache's writes and the
/// attention of a prefill of four sequences (1, 7, 64 and 130 tokens, blocks scattered) against
/// the CPU reference, and on the device itself one sequence's outputs read whole beside others
/// against the same read in chunks and decoded token by token (bar: none of difference).
pub fn check_paged(device: &Device) -> Result<Vec<KernelCheck>> {
    let mut checks = vec![];
    for (name, heads, kv_heads) in [("smollm2-135m", 9, 3), ("qwen2-0.5b", 14, 2)] {
        let layout = RowLayout::qkv(heads, kv_heads, 64);
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let lengths = [1usize, 7, 64, 130];
            let feeds: Vec<(u64, Tensor)> = lengths
                .iter()
                .enumerate()
                .map(|(s, &n)| {
                    Ok((
                        s as u64,
                        random_rows(n, layout.stride, s as u64 + 1, dtype)?,
                    ))
                })
                .collect::<Result<_>>()?;
            let run = |device: &Device| -> Result<(Tensor, Tensor)> {
                let mut h = Harness::new(layout, dtype, device)?;
                for (s, &n) in lengths.iter().enumerate() {
                    h.pool
                        .admit(s as u64, n)
                        .map_err(candle_core::Error::wrap)?;
                    h.pool
                        .admit(100 + s as u64, 1)
                        .map_err(candle_core::Error::wrap)?;
                }
                Ok((h.step(&feeds)?, h.cache()?))
            };
            let ((want, want_cache), (got, got_cache)) = (run(&Device::Cpu)?, run(device)?);
            let shape = format!("{name}: {lengths:?} tokens");
            // A copy: exact, whatever the dtype.
            let mut write = compare(
                "paged-write-cache",
                shape.clone(),
                &want_cache,
                &got_cache,
                dtype,
                1,
            )?;
            (write.bar, write.passed) = (0.0, write.largest_difference == 0.0);
            checks.push(write);
            checks.push(compare("paged-attention", shape, &want, &got, dtype, 130)?);
            checks.push(invariance(device, layout, dtype, name)?);
        }
    }
    Ok(checks)
}

/// One sequence of 100 tokens on `device`: read whole beside another, read in chunks (37, 1,
/// 62), and decoded token by token after a prefill of 40 beside another decoding sequence; the
/// largest difference of the chunked and decoded outputs from the whole ones (the bar is 0).
fn invariance(device: &Device, layout: RowLayout, dtype: DType, name: &str) -> Result<KernelCheck> {
    let rows = random_rows(100, layout.stride, 77, dtype)?;
    let other = random_rows(100, layout.stride, 78, dtype)?;
    let fresh = || -> Result<Harness> {
        let mut h = Harness::new(layout, dtype, device)?;
        h.pool.admit(9, 100).map_err(candle_core::Error::wrap)?;
        h.pool.admit(1, 100).map_err(candle_core::Error::wrap)?;
        Ok(h)
    };
    let whole = fresh()?
        .step(&[(9, other.narrow(0, 0, 50)?), (1, rows.clone())])?
        .narrow(0, 50, 100)?;
    let mut chunked = fresh()?;
    let mut parts = vec![];
    for (at, n) in [(0, 37), (37, 1), (38, 62)] {
        parts.push(chunked.step(&[(1, rows.narrow(0, at, n)?)])?);
    }
    let mut decoded = fresh()?;
    let mut steps = vec![decoded.step(&[(1, rows.narrow(0, 0, 40)?)])?];
    for t in 40..100 {
        let out = decoded.step(&[(9, other.narrow(0, t, 1)?), (1, rows.narrow(0, t, 1)?)])?;
        steps.push(out.narrow(0, 1, 1)?);
    }
    let mut worst = 0f32;
    for got in [Tensor::cat(&parts, 0)?, Tensor::cat(&steps, 0)?] {
        let d = (whole.to_dtype(DType::F32)? - got.to_dtype(DType::F32)?)?;
        worst = worst.max(d.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?);
    }
    Ok(KernelCheck {
        op: "paged-attention-invariance".into(),
        shape: format!("{name}: 100 tokens whole, in 3 chunks, decoded after 40"),
        dtype: format!("{dtype:?}").to_lowercase(),
        largest_difference: worst,
        bar: 0.0,
        passed: worst == 0.0,
    })
}

#[cfg(test)]
mod tests {
    /// On the CPU every check passes and the device side equals the reference exactly.
    #[test]
    fn every_paged_check_passes_on_the_cpu() {
        let checks = super::check_paged(&candle_core::Device::Cpu).unwrap();
        assert_eq!(checks.len(), 18);
        assert!(
            checks
                .iter()
                .all(|c| c.passed && c.largest_difference == 0.0),
            "{checks:?}"
        );
    }
}
