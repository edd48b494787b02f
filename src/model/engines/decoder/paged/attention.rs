//! Attention over the paged KV cache (issue 52), as two candle custom ops whose `cpu_fwd` is the
//! reference of the GPU kernel of the same name (`kernels/paged.cu`):
//!
//! * [`WriteCache`] writes a step's new keys and values into their slots of the cache, in place;
//! * [`PagedAttention`] gives each new token's attention over its sequence's cached keys up to
//!   and including its own position, reading them through the sequence's block table.
//!
//! One kernel serves prompts (many new tokens a sequence, read whole or in chunks) and decoding
//! (one a sequence): every query row is computed alone, over its keys in tiles of
//! [`KEY_TILE`] taken in order (the reference is `host::attend`, the unpadded encoder's too), so
//! a token's output does not depend on what else is in the batch,
//! on how its prompt was cut into chunks, or on whether the run was resumed from a checkpoint:
//! the batch invariance that keeps a resumed answer equal to the uninterrupted one.
//!
//! Layouts. A step's rows `(tokens, stride)` hold each new token's query at column `q_at` (heads
//! × head_dim) and its key and value at `k_at` and `v_at` (kv_heads × head_dim each), as a fused
//! QKV product gives them. The cache is `(2, slots, kv_heads, head_dim)`: keys then values, slot
//! `block × block_size + offset`. The plan is u32: per new token its sequence's row in the block
//! tables and its position, then the tables `(sequences, width)`.

use crate::model::engines::host::{attend, f32s, storage, u32s};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, InplaceOp3, Layout, Result, Shape};

/// Keys per tile (a warp's lanes on the GPU).
pub use crate::model::engines::host::KEY_TILE;
/// The widest head the kernel holds (4 elements a lane).
pub const MAX_HEAD_DIM: usize = 128;

/// Where a step's rows hold each part, and the heads' shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowLayout {
    /// Query heads.
    pub heads: usize,
    /// Key and value heads (grouped-query attention: `heads` a multiple of it).
    pub kv_heads: usize,
    /// Elements a head.
    pub head_dim: usize,
    /// Elements a row.
    pub stride: usize,
    /// The query's first column.
    pub q_at: usize,
    /// The key's first column.
    pub k_at: usize,
    /// The value's first column.
    pub v_at: usize,
}

impl RowLayout {
    /// A fused QKV product's rows: queries, keys, values end to end.
    pub fn qkv(heads: usize, kv_heads: usize, head_dim: usize) -> Self {
        Self {
            heads,
            kv_heads,
            head_dim,
            stride: (heads + 2 * kv_heads) * head_dim,
            q_at: 0,
            k_at: heads * head_dim,
            v_at: (heads + kv_heads) * head_dim,
        }
    }

    /// Elements of one slot's keys (or values).
    fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Checks the rows' and the cache's shapes against the layout: `(tokens, slots)`.
    fn check(&self, rows: &Layout, cache: &Layout) -> Result<(usize, usize)> {
        let (tokens, stride) = rows.shape().dims2()?;
        let (two, slots, kv_heads, head_dim) = cache.shape().dims4()?;
        let fits = stride == self.stride
            && two == 2
            && kv_heads == self.kv_heads
            && head_dim == self.head_dim
            && self.kv_heads > 0
            && self.heads.is_multiple_of(self.kv_heads)
            && self.head_dim <= MAX_HEAD_DIM
            && self.q_at + self.heads * self.head_dim <= stride
            && self.k_at.max(self.v_at) + self.kv_width() <= stride;
        if !fits {
            candle_core::bail!(
                "paged attention: rows {:?} and cache {:?} do not fit {self:?}",
                rows.shape(),
                cache.shape()
            );
        }
        Ok((tokens, slots))
    }
}

/// Writes each new token's key and value into its slot of the cache (in place): `cache.
/// inplace_op3(&rows, &slots, &WriteCache(layout))`, `slots` u32 one per row.
#[derive(Debug, Clone, Copy)]
pub struct WriteCache(pub RowLayout);

impl InplaceOp3 for WriteCache {
    fn name(&self) -> &'static str {
        "paged-write-cache"
    }

    fn cpu_fwd(
        &self,
        cache: &mut CpuStorage,
        cache_layout: &Layout,
        rows: &CpuStorage,
        rows_layout: &Layout,
        slots: &CpuStorage,
        slots_layout: &Layout,
    ) -> Result<()> {
        let l = self.0;
        let (tokens, capacity) = l.check(rows_layout, cache_layout)?;
        let slots = u32s(slots, slots_layout)?;
        if slots.len() != tokens || slots.iter().any(|&s| s as usize >= capacity) {
            candle_core::bail!(
                "paged write: {} slots for {tokens} rows, past {capacity}",
                slots.len()
            );
        }
        let w = l.kv_width();
        let (Some((start, _)), Some((from, to))) = (
            cache_layout.contiguous_offsets(),
            rows_layout.contiguous_offsets(),
        ) else {
            candle_core::bail!("paged write: operands that are not contiguous");
        };
        macro_rules! write {
            ($cache:expr, $rows:expr) => {{
                let rows = &$rows[from..to];
                for (t, &slot) in slots.iter().enumerate() {
                    let row = &rows[t * l.stride..(t + 1) * l.stride];
                    for (half, at) in [(0, l.k_at), (1, l.v_at)] {
                        let to = start + (half * capacity + slot as usize) * w;
                        $cache[to..to + w].copy_from_slice(&row[at..at + w]);
                    }
                }
            }};
        }
        match (cache, rows) {
            (CpuStorage::F32(c), CpuStorage::F32(r)) => write!(c, r),
            (CpuStorage::F16(c), CpuStorage::F16(r)) => write!(c, r),
            (CpuStorage::BF16(c), CpuStorage::BF16(r)) => write!(c, r),
            (c, r) => candle_core::bail!(
                "paged write: a {:?} cache and {:?} rows",
                c.dtype(),
                r.dtype()
            ),
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        cache: &mut candle_core::CudaStorage,
        cache_layout: &Layout,
        rows: &candle_core::CudaStorage,
        rows_layout: &Layout,
        slots: &candle_core::CudaStorage,
        slots_layout: &Layout,
    ) -> Result<()> {
        let (tokens, _) = self.0.check(rows_layout, cache_layout)?;
        super::cuda::write_cache(
            self,
            (cache, cache_layout),
            (rows, rows_layout),
            (slots, slots_layout),
            tokens,
        )
    }
}

/// A new token's row in the block tables and its position.
type TokenPlan = (usize, usize);

/// Each new token's attention over its sequence's cached keys at positions 0 to its own,
/// `(tokens, heads × head_dim)` in the rows' dtype: `rows.apply_op3(&cache, &plan, &op)`.
#[derive(Debug, Clone, Copy)]
pub struct PagedAttention {
    /// Where the rows hold the queries.
    pub layout: RowLayout,
    /// Slots a block.
    pub block_size: usize,
    /// The block tables' width (the plan's second part is `(sequences, width)`).
    pub width: usize,
}

impl PagedAttention {
    /// The softmax's scale, `1/√head_dim`.
    pub fn scale(&self) -> f32 {
        1.0 / (self.layout.head_dim as f32).sqrt()
    }

    /// The plan's parts: per token (table row, position), and the tables.
    fn read_plan(&self, plan: &[u32], tokens: usize) -> Result<(Vec<TokenPlan>, Vec<u32>)> {
        if plan.len() < 2 * tokens || !(plan.len() - 2 * tokens).is_multiple_of(self.width.max(1)) {
            candle_core::bail!(
                "paged attention: a plan of {} for {tokens} tokens",
                plan.len()
            );
        }
        let rows = (plan.len() - 2 * tokens) / self.width.max(1);
        let per_token: Vec<TokenPlan> = plan[..2 * tokens]
            .chunks(2)
            .map(|p| (p[0] as usize, p[1] as usize))
            .collect();
        let fits = per_token
            .iter()
            .all(|&(row, pos)| row < rows && pos / self.block_size < self.width);
        if !fits {
            candle_core::bail!("paged attention: a token's table row or position past the tables");
        }
        Ok((per_token, plan[2 * tokens..].to_vec()))
    }
}

impl CustomOp3 for PagedAttention {
    fn name(&self) -> &'static str {
        "paged-attention"
    }

    fn cpu_fwd(
        &self,
        rows: &CpuStorage,
        rows_layout: &Layout,
        cache: &CpuStorage,
        cache_layout: &Layout,
        plan: &CpuStorage,
        plan_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let l = self.layout;
        let (tokens, capacity) = l.check(rows_layout, cache_layout)?;
        let (per_token, tables) = self.read_plan(&u32s(plan, plan_layout)?, tokens)?;
        let (d, w) = (l.head_dim, l.kv_width());
        let dtype = rows.dtype();
        let rows = f32s(rows, rows_layout)?;
        let cache = f32s(cache, cache_layout)?;
        let group = l.heads / l.kv_heads;
        let mut out = vec![0f32; tokens * l.heads * d];
        for (t, &(row, position)) in per_token.iter().enumerate() {
            let table = &tables[row * self.width..(row + 1) * self.width];
            let slot = |p: usize| {
                table[p / self.block_size] as usize * self.block_size + p % self.block_size
            };
            if (0..=position).any(|p| slot(p) >= capacity) {
                candle_core::bail!("paged attention: a slot past the cache's {capacity}");
            }
            for h in 0..l.heads {
                let kv_head = h / group;
                let kv = |p: usize| {
                    let at = slot(p) * w + kv_head * d;
                    let v_at = (capacity + slot(p)) * w + kv_head * d;
                    (&cache[at..at + d], &cache[v_at..v_at + d])
                };
                let q = &rows[t * l.stride + l.q_at + h * d..][..d];
                let at = (t * l.heads + h) * d;
                attend(q, self.scale(), position + 1, kv, &mut out[at..at + d]);
            }
        }
        Ok((storage(out, dtype)?, Shape::from((tokens, l.heads * d))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        rows: &candle_core::CudaStorage,
        rows_layout: &Layout,
        cache: &candle_core::CudaStorage,
        cache_layout: &Layout,
        plan: &candle_core::CudaStorage,
        plan_layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (tokens, slots) = self.layout.check(rows_layout, cache_layout)?;
        let plan_len = plan_layout.shape().elem_count();
        if plan_len < 2 * tokens || !(plan_len - 2 * tokens).is_multiple_of(self.width.max(1)) {
            candle_core::bail!("paged attention: a plan of {plan_len} for {tokens} tokens");
        }
        super::cuda::paged_attention(
            self,
            (rows, rows_layout),
            (cache, cache_layout),
            (plan, plan_layout),
            (tokens, slots),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::super::check::Harness;
    use super::RowLayout;
    use candle_core::{DType, Device, Tensor, D};

    /// Rows of random values, `(tokens, stride)`, the same on every machine.
    fn random(tokens: usize, stride: usize, seed: u64) -> Tensor {
        let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
        let values: Vec<f32> = (0..tokens * stride)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 23) as f32) - 1.0
            })
            .collect();
        Tensor::from_vec(values, (tokens, stride), &Device::Cpu).unwrap()
    }

    /// Causal attention over one sequence's rows with grouped-query heads, as candle computes
    /// it: softmax of the scaled scores, masked past each row's own position, times V.
    fn causal(rows: &Tensor, l: RowLayout) -> Tensor {
        let n = rows.dims2().unwrap().0;
        let part = |at: usize, heads: usize| {
            rows.narrow(1, at, heads * l.head_dim)
                .unwrap()
                .reshape((n, heads, l.head_dim))
                .unwrap()
                .transpose(0, 1)
                .unwrap()
                .contiguous()
                .unwrap()
        };
        let group = l.heads / l.kv_heads;
        let repeat = |t: Tensor| {
            let parts: Vec<Tensor> = (0..l.heads)
                .map(|h| t.narrow(0, h / group, 1).unwrap())
                .collect();
            Tensor::cat(&parts, 0).unwrap()
        };
        let (q, k, v) = (
            part(l.q_at, l.heads),
            repeat(part(l.k_at, l.kv_heads)),
            repeat(part(l.v_at, l.kv_heads)),
        );
        let scale = 1.0 / (l.head_dim as f64).sqrt();
        let scores = (q.matmul(&k.t().unwrap()).unwrap() * scale).unwrap();
        let mask: Vec<f32> = (0..n * n)
            .map(|i| {
                if i % n > i / n {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let mask = Tensor::from_vec(mask, (n, n), &Device::Cpu).unwrap();
        let p = candle_nn::ops::softmax(&scores.broadcast_add(&mask).unwrap(), D::Minus1).unwrap();
        p.matmul(&v)
            .unwrap()
            .transpose(0, 1)
            .unwrap()
            .reshape((n, l.heads * l.head_dim))
            .unwrap()
    }

    fn largest_difference(a: &Tensor, b: &Tensor) -> f32 {
        super::super::rows::largest_difference(a, b).unwrap()
    }

    /// Sequences whose prompts land in scattered blocks (others' blocks taken between theirs):
    /// every token's output is causal attention over its own sequence, within 1e-5 of candle's,
    /// for lengths around the key tile and grouped-query heads.
    #[test]
    fn paged_attention_is_causal_attention_over_each_sequence() {
        let layout = RowLayout::qkv(6, 2, 8);
        let mut cache = Harness::new(layout, DType::F32, &Device::Cpu).unwrap();
        let lengths = [1usize, 31, 33, 70, 5];
        for (s, n) in lengths.iter().enumerate() {
            cache.pool.admit(s as u64, *n).unwrap();
            cache.pool.admit(100 + s as u64, 3).unwrap(); // a neighbour's block in between
        }
        let feeds: Vec<(u64, Tensor)> = lengths
            .iter()
            .enumerate()
            .map(|(s, &n)| (s as u64, random(n, layout.stride, s as u64)))
            .collect();
        let got = cache.step(&feeds).unwrap();
        let mut at = 0;
        for (s, rows) in &feeds {
            let n = rows.dims2().unwrap().0;
            let d = largest_difference(&got.narrow(0, at, n).unwrap(), &causal(rows, layout));
            assert!(d <= 1e-5, "sequence {s} of {n}: {d}");
            at += n;
        }
    }

    /// Batch invariance: a sequence's outputs are the same bits read whole in a batch of
    /// others, alone, in chunks of its prompt, and decoded token by token after a prefill; and
    /// its cache holds the same keys and values.
    #[test]
    fn a_sequences_outputs_do_not_depend_on_the_batch_or_the_chunks() {
        let layout = RowLayout::qkv(4, 2, 16);
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let rows = random(45, layout.stride, 9).to_dtype(dtype).unwrap();
            let others = random(37, layout.stride, 10).to_dtype(dtype).unwrap();
            let whole_in_batch = {
                let mut c = Harness::new(layout, dtype, &Device::Cpu).unwrap();
                c.pool.admit(7, 37).unwrap();
                c.pool.admit(1, 45).unwrap();
                c.step(&[(7, others.clone()), (1, rows.clone())])
                    .unwrap()
                    .narrow(0, 37, 45)
                    .unwrap()
            };
            let mut alone = Harness::new(layout, dtype, &Device::Cpu).unwrap();
            alone.pool.admit(1, 45).unwrap();
            let whole = alone.step(&[(1, rows.clone())]).unwrap();
            let mut chunked = Harness::new(layout, dtype, &Device::Cpu).unwrap();
            chunked.pool.admit(1, 45).unwrap();
            let mut parts = vec![];
            for (at, n) in [(0, 13), (13, 19), (32, 1), (33, 12)] {
                parts.push(
                    chunked
                        .step(&[(1, rows.narrow(0, at, n).unwrap())])
                        .unwrap(),
                );
            }
            let mut decoded = Harness::new(layout, dtype, &Device::Cpu).unwrap();
            decoded.pool.admit(1, 45).unwrap();
            decoded.pool.admit(2, 20).unwrap();
            let mut steps = vec![decoded
                .step(&[(1, rows.narrow(0, 0, 30).unwrap())])
                .unwrap()];
            for t in 30..45 {
                // A neighbour decodes beside it at every step.
                let other = others.narrow(0, t - 30, 1).unwrap();
                let out = decoded
                    .step(&[(2, other), (1, rows.narrow(0, t, 1).unwrap())])
                    .unwrap();
                steps.push(out.narrow(0, 1, 1).unwrap());
            }
            let chunked = Tensor::cat(&parts, 0).unwrap();
            let decoded_out = Tensor::cat(&steps, 0).unwrap();
            for (name, got) in [
                ("in a batch", &whole_in_batch),
                ("chunked", &chunked),
                ("decoded", &decoded_out),
            ] {
                assert_eq!(largest_difference(&whole, got), 0.0, "{dtype:?} {name}");
            }
            assert_eq!(whole.dtype(), dtype);
        }
    }
}
