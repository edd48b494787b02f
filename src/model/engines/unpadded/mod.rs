//! The BERT encoder on unpadded batches, for the GPU: a batch's tokens packed end to end (no
//! padding computed, none masked), each layer eight operations where the padded candle encoder
//! (`super::candle_bert`) issues about twenty:
//!
//! 1. the Q, K and V product with its bias (`ops::Dense`: one cuBLASLt call, the bias its
//!    epilogue);
//! 2. attention within each sequence (`ops::VarlenAttention`, an NVRTC kernel);
//! 3. the attention's output product with its bias;
//! 4. the residual add and LayerNorm (`ops::AddNorm`, an NVRTC kernel);
//! 5. the feed-forward's first product with its bias;
//! 6. erf-GELU (candle's kernel: cuBLASLt's GELU epilogue is the tanh form, which BERT does not
//!    compute);
//! 7. the feed-forward's second product with its bias;
//! 8. the residual add and LayerNorm.
//!
//! CLIP's and ViT's image towers run on the same operations (`vision`); with `--backend
//! unpadded-graphs` a batch is packed to a size bucket and each bucket's launches are captured
//! once in a CUDA graph and replayed (`graphs`).
//!
//! Every operation runs on candle's CPU backend too, through its reference (`ops.rs`), so the
//! whole graph is tested on machines without a GPU against the padded encoder. It is opt-in
//! (`--backend unpadded`) until the GPU check (`bench/gpu-check.sh`) has passed on a GPU.

pub mod check;
#[cfg(feature = "cuda")]
mod cuda;
mod gemm;
pub mod graphs;
mod ops;
pub mod vision;

use super::candle_bert::CandleBert;
use crate::model::TokenIds;
use candle_core::{DType, Device, Result, Tensor};
use ops::{AddNorm, Dense, VarlenAttention};
use spotinfer_fused_cpu::Pooling;

/// A loaded encoder that runs on packed batches.
pub struct UnpaddedBert {
    words: Tensor,
    positions: Tensor,
    types: Option<Tensor>,
    /// The embeddings' LayerNorm, with the position rows as its residual.
    norm: AddNorm,
    layers: Vec<Layer>,
    attention: VarlenAttention,
    position_offset: u32,
    /// CUDA graphs per bucket (`graphs`), when asked for: batches are then packed to buckets.
    graphs: Option<graphs::Graphs>,
}

struct Layer {
    qkv: Dense,
    attention_out: Dense,
    attention_norm: AddNorm,
    intermediate: Dense,
    output: Dense,
    output_norm: AddNorm,
}

/// A batch's texts packed end to end, as the unpadded encoder reads them: ids, token types and
/// positions `(tokens)` u32 on the device, and `cu_seqlens` (sequences + 1: each one's first row,
/// then the total) on the device; the texts' bounds on the host.
pub struct Packed {
    ids: Tensor,
    types: Tensor,
    positions: Tensor,
    cu_seqlens: Tensor,
    /// Each text's first row, then the texts' total (the bucket's padding left out).
    pub starts: Vec<u32>,
    max_len: usize,
    /// The bucket it was padded to, and its arrays on the host (for a CUDA graph's inputs).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    bucket: Option<graphs::Bucket>,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    host: Option<HostBatch>,
}

/// A packed batch's arrays on the host, before they go to the device.
pub struct HostBatch {
    /// Token ids, end to end.
    pub ids: Vec<u32>,
    /// Token types.
    pub types: Vec<u32>,
    /// Positions.
    pub positions: Vec<u32>,
    /// `cu_seqlens`.
    pub bounds: Vec<u32>,
}

impl Packed {
    /// Packs `batch` for `model`'s device: each text's positions count from the model's offset.
    /// With CUDA graphs on, the batch is padded to its bucket (`graphs::Bucket`).
    pub fn new<'a>(
        batch: impl Iterator<Item = &'a TokenIds>,
        model: &UnpaddedBert,
    ) -> Result<Self> {
        let mut host = HostBatch {
            ids: vec![],
            types: vec![],
            positions: vec![],
            bounds: vec![0u32],
        };
        let mut lengths = vec![];
        for text in batch {
            host.ids.extend_from_slice(&text.ids);
            host.types.extend_from_slice(&text.type_ids);
            let first = model.position_offset;
            host.positions.extend(first..first + text.len() as u32);
            host.bounds.push(host.ids.len() as u32);
            lengths.push(text.len());
        }
        let starts = host.bounds.clone();
        let mut max_len = lengths.iter().copied().max().unwrap_or(0);
        let bucket = model.graphs.as_ref().map(|_| graphs::Bucket::of(&lengths));
        if let Some(bucket) = bucket {
            bucket.pad(&mut host, model.position_offset);
            max_len = bucket.max_len;
        }
        let device = model.device();
        let tensor = |v: &[u32]| Tensor::from_slice(v, v.len(), device);
        Ok(Self {
            ids: tensor(&host.ids)?,
            types: tensor(&host.types)?,
            positions: tensor(&host.positions)?,
            cu_seqlens: tensor(&host.bounds)?,
            starts,
            max_len,
            bucket,
            host: bucket.map(|_| host),
        })
    }
}

impl UnpaddedBert {
    /// The padded encoder's weights, arranged for packed batches (no copy: the same tensors);
    /// with `cuda_graphs`, batches are packed to buckets and, on CUDA, run by a graph per bucket.
    pub fn new(bert: &CandleBert, cuda_graphs: bool) -> Result<Self> {
        let norm = AddNorm::new;
        let dense = |l: &candle_nn::Linear| -> Result<Dense> {
            let Some(bias) = l.bias() else {
                candle_core::bail!("a dense layer without a bias");
            };
            Ok(Dense {
                weight: l.weight().clone(),
                bias: bias.clone(),
            })
        };
        let layers = bert
            .layers
            .iter()
            .map(|l| {
                Ok(Layer {
                    qkv: dense(&l.qkv)?,
                    attention_out: dense(&l.attention_out)?,
                    attention_norm: norm(&l.attention_norm)?,
                    intermediate: dense(&l.intermediate)?,
                    output: dense(&l.output)?,
                    output_norm: norm(&l.output_norm)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let width = bert.words.embeddings().dim(1)?;
        let head_dim = width / bert.heads;
        if head_dim > ops::MAX_HEAD_DIM || width > ops::MAX_NORM_WIDTH {
            candle_core::bail!(
                "the unpadded encoder's kernels take heads up to {} wide and rows up to {}; this \
                 model has {head_dim} and {width} (use --backend candle)",
                ops::MAX_HEAD_DIM,
                ops::MAX_NORM_WIDTH
            );
        }
        Ok(Self {
            words: bert.words.embeddings().clone(),
            positions: bert.positions.embeddings().clone(),
            types: bert.token_types.then(|| bert.types.embeddings().clone()),
            norm: norm(&bert.norm)?,
            layers,
            attention: VarlenAttention {
                heads: bert.heads,
                head_dim,
                max_len: 0,
            },
            position_offset: bert.position_offset,
            graphs: cuda_graphs.then(graphs::Graphs::default),
        })
    }

    /// The last hidden state of a batch's tokens, as [`UnpaddedBert::forward`] gives it: by the
    /// batch's bucket's CUDA graph when graphs are on (rows past the texts' are padding).
    pub fn run(&self, batch: Packed) -> Result<Tensor> {
        match &self.graphs {
            Some(graphs) => graphs.run(self, batch),
            None => self.forward(&batch),
        }
    }

    /// The last hidden state of every token of the batch, `(tokens, hidden)` in the model's
    /// dtype, rows in the batch's order.
    pub fn forward(&self, batch: &Packed) -> Result<Tensor> {
        let mut x = self.words.index_select(&batch.ids, 0)?;
        if let Some(types) = &self.types {
            x = x.add(&types.index_select(&batch.types, 0)?)?;
        }
        let positions = self.positions.index_select(&batch.positions, 0)?;
        let mut x = x.apply_op2(&positions, self.norm.clone())?;
        let attention = VarlenAttention {
            max_len: batch.max_len,
            ..self.attention
        };
        for layer in &self.layers {
            x = layer.forward(&x, &batch.cu_seqlens, attention)?;
        }
        Ok(x)
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        self.words.device()
    }
}

impl Layer {
    /// One layer: the eight operations of the module's comment, in order.
    fn forward(
        &self,
        x: &Tensor,
        cu_seqlens: &Tensor,
        attention: VarlenAttention,
    ) -> Result<Tensor> {
        let qkv = self.qkv.forward(x)?;
        let context = qkv.apply_op2(cu_seqlens, attention)?;
        let x = self
            .attention_out
            .forward(&context)?
            .apply_op2(x, self.attention_norm.clone())?;
        let h = self.intermediate.forward(&x)?.gelu_erf()?;
        self.output
            .forward(&h)?
            .apply_op2(&x, self.output_norm.clone())
    }
}

/// One vector per text of a packed batch's `hidden` `(tokens, dim)`, in f32, pooled as
/// sentence-transformers pools over each text's tokens from its `skips` entry on (the prompt's
/// tokens left out); CLS takes the first pooled token (the first token if none is).
pub fn pool(hidden: &Tensor, starts: &[u32], mode: Pooling, skips: &[usize]) -> Result<Tensor> {
    let hidden = hidden.to_dtype(DType::F32)?;
    let device = hidden.device();
    let (tokens, dim) = hidden.dims2()?;
    let texts = starts.len() - 1;
    // Each text's pooled rows.
    let pooled: Vec<std::ops::Range<usize>> = starts
        .windows(2)
        .zip(skips)
        .map(|(s, &skip)| (s[0] as usize + skip).min(s[1] as usize)..s[1] as usize)
        .collect();
    match mode {
        Pooling::Cls => {
            let rows: Vec<u32> = pooled
                .iter()
                .zip(starts)
                .map(|(r, &first)| if r.is_empty() { first } else { r.start as u32 })
                .collect();
            hidden.index_select(&Tensor::new(rows, device)?, 0)
        }
        Pooling::Max => {
            // Each text's rows gathered into (texts, longest, dim), the missing ones a row of
            // -1e9 (as sentence-transformers fills left-out positions), then the maximum.
            let longest = pooled.iter().map(|r| r.len()).max().unwrap_or(0).max(1);
            let floor = Tensor::full(-1e9f32, (1, dim), device)?;
            let rows = Tensor::cat(&[&hidden, &floor], 0)?;
            let index: Vec<u32> = pooled
                .iter()
                .flat_map(|r| (0..longest).map(move |i| r.clone().nth(i).unwrap_or(tokens) as u32))
                .collect();
            rows.index_select(&Tensor::new(index, device)?, 0)?
                .reshape((texts, longest, dim))?
                .max(1)
        }
        Pooling::Mean | Pooling::MeanSqrtLen => {
            // The sums as one product with a (texts, tokens) matrix of ones, then divided.
            let mut ones = vec![0f32; texts * tokens];
            for (t, r) in pooled.iter().enumerate() {
                ones[t * tokens + r.start..t * tokens + r.end].fill(1.0);
            }
            let counts: Vec<f32> = pooled.iter().map(|r| (r.len() as f32).max(1e-9)).collect();
            let summed = Tensor::from_vec(ones, (texts, tokens), device)?.matmul(&hidden)?;
            let mut counts = Tensor::from_vec(counts, (texts, 1), device)?;
            if mode == Pooling::MeanSqrtLen {
                counts = counts.sqrt()?;
            }
            summed.broadcast_div(&counts)
        }
    }
}

/// Each text's rows of a packed batch's `hidden`, in f32 on the host, row-major: every token's,
/// or with `first_only` the first token's.
pub fn token_rows(hidden: &Tensor, starts: &[u32], first_only: bool) -> Result<Vec<Vec<f32>>> {
    let hidden = hidden.to_dtype(DType::F32)?;
    if first_only {
        let firsts = Tensor::new(&starts[..starts.len() - 1], hidden.device())?;
        return hidden.index_select(&firsts, 0)?.to_vec2();
    }
    let (_, dim) = hidden.dims2()?;
    let all = hidden.flatten_all()?.to_vec1::<f32>()?;
    Ok(starts
        .windows(2)
        .map(|s| all[s[0] as usize * dim..s[1] as usize * dim].to_vec())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::ops::{AddNorm, VarlenAttention};
    use super::{Packed, UnpaddedBert};
    use crate::model::spec::ModelSpec;
    use crate::model::TokenIds;
    use candle_core::{DType, Device, Tensor, Var, D};
    use std::path::Path;

    fn fixture() -> UnpaddedBert {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/bert-mean-old");
        let spec = ModelSpec::read(&dir).unwrap();
        let bert = super::super::candle_bert(&spec, &Device::Cpu, DType::F32).unwrap();
        UnpaddedBert::new(&bert, false).unwrap()
    }

    fn texts(lengths: &[usize]) -> Vec<TokenIds> {
        lengths
            .iter()
            .enumerate()
            .map(|(t, &n)| TokenIds {
                ids: (0..n as u32)
                    .map(|i| (i * 37 + t as u32 * 11) % 700)
                    .collect(),
                type_ids: (0..n as u32)
                    .map(|i| u32::from(i >= n as u32 / 2))
                    .collect(),
            })
            .collect()
    }

    fn random(shape: (usize, usize), seed: u64) -> Tensor {
        let mut s = seed;
        let values: Vec<f32> = (0..shape.0 * shape.1)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0
            })
            .collect();
        Tensor::from_vec(values, shape, &Device::Cpu).unwrap()
    }

    fn largest_difference(a: &Tensor, b: &Tensor) -> f32 {
        let d = (a.to_dtype(DType::F32).unwrap() - b.to_dtype(DType::F32).unwrap()).unwrap();
        d.abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar()
            .unwrap()
    }

    /// One layer issues eight operations (the module comment's list) on the graph candle
    /// records: every tensor computed from the layer's input is counted, views and copies too,
    /// so a hidden `contiguous()` or an unfused add shows here as it would on the GPU.
    #[test]
    fn one_layer_issues_eight_operations() {
        let model = fixture();
        let batch = Packed::new(texts(&[5, 17, 1, 40]).iter(), &model).unwrap();
        let input = Var::from_tensor(&model.forward(&batch).unwrap()).unwrap();
        let attention = VarlenAttention {
            max_len: batch.max_len,
            ..model.attention
        };
        let out = model.layers[0]
            .forward(input.as_tensor(), &batch.cu_seqlens, attention)
            .unwrap();
        // The nodes between the layer's input and its output, the input itself excluded.
        let operations = out.sorted_nodes().len() - 1;
        assert_eq!(operations, 8);
    }

    /// Packed to its CUDA-graph bucket, a batch runs on padding rows and empty sequences past
    /// its texts, and its texts' rows are those of the plain packed batch, bit for bit (each
    /// padding sequence attends only to itself; every other operation is row by row).
    #[test]
    fn a_bucketed_batch_gives_the_plain_batchs_rows() {
        let plain = fixture();
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/bert-mean-old");
        let spec = ModelSpec::read(&dir).unwrap();
        let bert = super::super::candle_bert(&spec, &Device::Cpu, DType::F32).unwrap();
        let bucketed = UnpaddedBert::new(&bert, true).unwrap();
        let texts = texts(&[5, 17, 1, 40, 3]);
        let a = Packed::new(texts.iter(), &plain).unwrap();
        let b = Packed::new(texts.iter(), &bucketed).unwrap();
        let bucket = b.bucket.unwrap();
        assert_eq!(
            (bucket.tokens, bucket.sequences, bucket.max_len),
            (128, 8, 64)
        );
        assert_eq!(b.cu_seqlens.dims1().unwrap(), 9);
        assert_eq!(a.starts, b.starts);
        let (x, y) = (plain.run(a).unwrap(), bucketed.run(b).unwrap());
        assert_eq!(y.dims2().unwrap().0, 128);
        assert_eq!(largest_difference(&x, &y.narrow(0, 0, 66).unwrap()), 0.0);
    }

    /// The residual add and LayerNorm equals candle's LayerNorm of the sum (which sums in
    /// another order) within 1e-6, at widths below, at and past one block's threads.
    #[test]
    fn add_norm_is_layer_norm_of_the_sum() {
        for width in [32, 128, 384, 1000] {
            let (x, r) = (random((9, width), 1), random((9, width), 2));
            let (g, b) = (random((1, width), 3), random((1, width), 4));
            let (g, b) = (g.squeeze(0).unwrap(), b.squeeze(0).unwrap());
            let op = AddNorm {
                gamma: g.clone(),
                beta: b.clone(),
                eps: 1e-12,
                keep_sum: false,
            };
            let got = x.apply_op2(&r, op).unwrap();
            let norm = candle_nn::LayerNorm::new(g, b, 1e-12);
            let want = candle_core::Module::forward(&norm, &(&x + &r).unwrap()).unwrap();
            let d = largest_difference(&got, &want);
            assert!(d <= 1e-5, "width {width}: {d}");
        }
    }

    /// Attention over packed sequences equals attention over each sequence alone (softmax of
    /// the scaled scores times V, as candle computes it), for lengths around the key tile.
    #[test]
    fn varlen_attention_is_each_sequence_attending_to_itself() {
        let (heads, head_dim) = (3, 8);
        let width = heads * head_dim;
        let lengths = [1usize, 31, 32, 33, 70, 5];
        let tokens: usize = lengths.iter().sum();
        let qkv = random((tokens, 3 * width), 7);
        let mut starts = vec![0u32];
        for n in lengths {
            starts.push(starts.last().unwrap() + n as u32);
        }
        let cu = Tensor::new(starts.as_slice(), &Device::Cpu).unwrap();
        let op = VarlenAttention {
            heads,
            head_dim,
            max_len: 70,
        };
        let got = qkv.apply_op2(&cu, op).unwrap();
        for (s, n) in starts.windows(2).zip(lengths) {
            let rows = qkv.narrow(0, s[0] as usize, n).unwrap();
            let part = |third: usize| {
                rows.narrow(1, third * width, width)
                    .unwrap()
                    .reshape((n, heads, head_dim))
                    .unwrap()
                    .transpose(0, 1)
                    .unwrap()
                    .contiguous()
                    .unwrap()
            };
            let (q, k, v) = (part(0), part(1), part(2));
            let scores = (q.matmul(&k.t().unwrap()).unwrap() * op.scale() as f64).unwrap();
            let p = candle_nn::ops::softmax(&scores, D::Minus1).unwrap();
            let want = p
                .matmul(&v)
                .unwrap()
                .transpose(0, 1)
                .unwrap()
                .reshape((n, width))
                .unwrap();
            let d = largest_difference(&got.narrow(0, s[0] as usize, n).unwrap(), &want);
            assert!(d <= 1e-5, "length {n}: {d}");
        }
    }

    /// In f16 and bf16 the ops compute in f32 and round once: the same values as the f32 op on
    /// the rounded inputs, rounded.
    #[test]
    fn half_precision_ops_round_the_f32_result_once() {
        let width = 48;
        let (x, r) = (random((5, width), 1), random((5, width), 2));
        let (g, b) = (
            random((1, width), 3).squeeze(0).unwrap(),
            random((1, width), 4).squeeze(0).unwrap(),
        );
        for dtype in [DType::F16, DType::BF16] {
            let cast = |t: &Tensor| t.to_dtype(dtype).unwrap();
            let op = |cast: &dyn Fn(&Tensor) -> Tensor| AddNorm {
                gamma: cast(&g),
                beta: cast(&b),
                eps: 1e-5,
                keep_sum: false,
            };
            let got = cast(&x).apply_op2(&cast(&r), op(&cast)).unwrap();
            assert_eq!(got.dtype(), dtype);
            let up = |t: &Tensor| cast(t).to_dtype(DType::F32).unwrap();
            let want = up(&x)
                .apply_op2(&up(&r), op(&up))
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            assert_eq!(largest_difference(&got, &want), 0.0, "{dtype:?}");
        }
    }
}
