//! A decoder-only transformer of the Llama family (Llama and SmolLM, Qwen2, Qwen3) on the CPU,
//! for batched generation: the sequences of a batch advance together, each with its own key and
//! value cache, one forward pass for all of their new tokens (a prompt's many, a decoding
//! sequence's one).
//!
//! Why not candle-transformers' Llama: its models keep one cache per layer for one sequence and
//! return the last position's logits only, so sequences of different lengths cannot share a
//! step, and its quantised CPU products ran about a ninth of llama.cpp's speed here.
//!
//! **A row's result does not depend on its neighbours.** The dense layers are this crate's packed
//! f32 kernels, which sum each output in input order whatever the tile or thread
//! (`packed::linear_wide`); normalisation, rotary embedding and attention are computed per row
//! in a fixed order. So a sequence computes the same logits alone or in any batch, and a prompt
//! processed in one pass gives the same logits, bit for bit, as the same tokens decoded one at a
//! time. That is what lets a generation interrupted by a shutdown resume from its tokens and
//! continue exactly as it would have. (It holds on x86-64 with AVX-512 or AVX2, where both
//! kernels sum the same way, and for bf16, whose kernels (AMX tiles, AVX-512 BF16) also sum each
//! row on its own; elsewhere the `gemm` crate's f32 products are used.)
//!
//! The loader hands over each tensor as f32 or, from a GGUF, in its block format (`Weights`),
//! named as transformers names them (`model.layers.0.self_attn.q_proj.weight`). In
//! [`Precision::F32`] the dense layers keep f32 (blocks widened as llama.cpp widens them); in
//! [`Precision::Bf16`] they are rounded to bf16 and multiplied on AMX tiles (or AVX-512 BF16),
//! with f32 sums: half the bytes a decoding step streams, many times the prompt's multiply-adds
//! per cycle, at the cost of tokens that may part from the model's own library's (so it is only
//! ever asked for, never chosen). In [`Precision::Gguf`] the dense layers and the token
//! embedding stay in the file's blocks (`crate::quant`): a 4-bit file stays 4-bit in memory, a
//! step streams a seventh of f32's bytes, and the activations are rounded to 8 bits per 32 as
//! llama.cpp rounds them; its sums are batch-invariant as f32's are, and the keys and values
//! are kept in f16, as llama.cpp keeps them (`kv`). Normalisation, rotary embedding and
//! attention compute in f32 in every precision.

mod attend;
mod kv;
mod load;

use crate::dense::Dense;
use crate::kernels::exp;
use crate::quant::BlockMatrix;
use crate::{FusedError, Precision};
use attend::attend_best;
pub use kv::KvCache;
use rayon::prelude::*;

/// The shape of a decoder, from its `config.json` (or a GGUF's metadata).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecoderDims {
    /// Transformer layers.
    pub layers: usize,
    /// Width of the residual stream.
    pub hidden: usize,
    /// Query heads.
    pub heads: usize,
    /// Key and value heads (grouped-query attention when fewer than `heads`).
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Width of the gated feed-forward layer.
    pub intermediate: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Most positions (the context window).
    pub max_positions: usize,
    /// Rotary embedding base.
    pub rope_theta: f32,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// Qwen3's RMSNorm of each query and key head before the rotary embedding.
    pub qk_norm: bool,
    /// The output projection is the token embedding (`tie_word_embeddings`).
    pub tied: bool,
}

impl DecoderDims {
    fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }

    fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

struct Layer {
    attn_norm: Vec<f32>,
    /// Query, key and value projections stacked: `(q_dim + 2 kv_dim, hidden)`.
    qkv: Dense,
    qkv_bias: Option<Vec<f32>>,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    out: Dense,
    out_bias: Option<Vec<f32>>,
    ffn_norm: Vec<f32>,
    /// Gate and up projections stacked: `(2 intermediate, hidden)`.
    gate_up: Dense,
    down: Dense,
}

/// One sequence's part of a forward pass: its cache, the tokens to append to it and what it
/// wants back.
pub struct Step<'a> {
    /// The sequence's cache, extended by the pass.
    pub cache: &'a mut KvCache,
    /// Its new tokens (at least one).
    pub tokens: &'a [u32],
    /// What the pass gives back for it.
    pub want: Want,
}

/// What a [`Step`] wants back from a forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Want {
    /// Nothing: a prompt still being read, a shared prefix cached for later.
    Nothing,
    /// The index of the largest logit after its last token (the first of equals): a greedy
    /// choice, made without a row of logits ever being held whole where the output layer is in
    /// GGUF blocks (at 32 sequences and Qwen2's 151,936 tokens, 18.5 MiB a step).
    Token,
    /// The logits after its last token (`vocab` values): for a sampler or a constraint.
    Logits,
    /// The logits after every one of its tokens (`tokens × vocab`): for teacher-forced checks.
    EveryLogits,
}

/// What a forward pass gives back.
#[derive(Debug, Default)]
pub struct Outputs {
    /// The logits of each step that wants them, in step order.
    pub logits: Vec<f32>,
    /// Per step, its token where it wants one ([`Want::Token`]).
    pub tokens: Vec<Option<u32>>,
}

/// The token embedding: f32 rows, or a GGUF matrix whose rows are widened as they are looked up
/// (shared with the output projection when the model ties them).
enum Embedding {
    F32(Vec<f32>),
    Blocks(std::sync::Arc<BlockMatrix>),
}

impl Embedding {
    /// Appends row `t` (`h` values) to `x`.
    fn push_row(&self, t: usize, h: usize, x: &mut Vec<f32>) {
        match self {
            Self::F32(rows) => x.extend_from_slice(&rows[t * h..][..h]),
            Self::Blocks(m) => {
                let at = x.len();
                x.resize(at + h, 0.0);
                m.dequantize_row(t, &mut x[at..]);
            }
        }
    }
}

/// A loaded decoder.
pub struct CpuDecoder {
    dims: DecoderDims,
    precision: Precision,
    embed: Embedding,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    lm_head: Dense,
    /// The rotary embedding's inverse frequencies, `head_dim / 2` of them (each step takes the
    /// cosines and sines of its rows' positions from them: a table of every position was 8 MiB
    /// of a Qwen2.5's 32,768 positions, held for the few a step uses).
    inv_freq: Vec<f32>,
}

impl CpuDecoder {
    /// The decoder's shape.
    pub fn dims(&self) -> &DecoderDims {
        &self.dims
    }

    /// The instructions the dense layers run on, for logs and benchmarks.
    pub fn kernels(&self) -> &'static str {
        self.lm_head.kernels()
    }

    /// The precision the dense layers compute in.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// Whether the keys and values are kept in f16 (where the dense layers are a GGUF's blocks,
    /// as llama.cpp keeps them) rather than f32: for the device line, since it changes the
    /// numbers a continuation computes.
    pub fn caches_f16(&self) -> bool {
        self.precision == Precision::Gguf
    }

    /// Appends each step's tokens to its sequence and returns what each wants ([`Want`]): the
    /// logits in one buffer, not one per step (at 32 sequences and a 151,936-token vocabulary a
    /// second copy was 19 MiB of the peak).
    pub fn forward(&self, steps: &mut [Step<'_>]) -> Result<Outputs, FusedError> {
        // On one of the pool's threads: between its ~120 parallel products a step, the other
        // threads are then still looking for work, not asleep, and the caller's thread works too.
        rayon::join(|| self.forward_in_pool(steps), || ()).0
    }

    fn forward_in_pool(&self, steps: &mut [Step<'_>]) -> Result<Outputs, FusedError> {
        let d = self.dims;
        // Each row's (step, position), in step order.
        let mut rows = Vec::new();
        for (s, step) in steps.iter().enumerate() {
            let start = step.cache.len;
            if step.tokens.is_empty() || start + step.tokens.len() > d.max_positions {
                return Err(FusedError::Input(format!(
                    "{} new tokens after {start} do not fit a context of {}",
                    step.tokens.len(),
                    d.max_positions
                )));
            }
            if let Some(&bad) = step.tokens.iter().find(|&&t| t as usize >= d.vocab) {
                return Err(FusedError::Input(format!(
                    "token id {bad} outside the vocabulary of {}",
                    d.vocab
                )));
            }
            rows.extend((0..step.tokens.len()).map(|j| (s, start + j)));
        }
        for step in steps.iter_mut() {
            step.cache
                .prepare(d.layers, self.caches_f16())
                .map_err(FusedError::Input)?;
        }
        let h = d.hidden;
        let tokens: Vec<u32> = steps
            .iter()
            .flat_map(|s| s.tokens.iter().copied())
            .collect();
        let mut x: Vec<f32> = Vec::with_capacity(rows.len() * h);
        for &t in &tokens {
            self.embed.push_row(t as usize, h, &mut x);
        }
        let rope = self.rope_rows(&rows);
        let mut buffers = Buffers::new(&d, rows.len());
        for (l, layer) in self.layers.iter().enumerate() {
            self.layer(l, layer, &mut x, (&rows, &rope), steps, &mut buffers);
        }
        for step in steps.iter_mut() {
            step.cache.len += step.tokens.len();
        }
        Ok(self.outputs(steps, &x))
    }

    /// The output layer for the rows each step wants something of (normalised first): the
    /// logits kept for those that want them, only the largest's index for those that want a
    /// token.
    fn outputs(&self, steps: &[Step<'_>], x: &[f32]) -> Outputs {
        let d = self.dims;
        let h = d.hidden;
        // Per step, the rows it wants something of and whether their logits are kept.
        let spans: Vec<(std::ops::Range<usize>, bool)> = steps
            .iter()
            .scan(0, |first, step| {
                let (at, n) = (*first, step.tokens.len());
                *first += n;
                Some(match step.want {
                    Want::Nothing => (at..at, true),
                    Want::Token => (at + n - 1..at + n, false),
                    Want::Logits => (at + n - 1..at + n, true),
                    Want::EveryLogits => (at..at + n, true),
                })
            })
            .collect();
        let (mut picked, mut keep) = (Vec::new(), Vec::new());
        for (rows, kept) in &spans {
            for r in rows.clone() {
                let mut row = x[r * h..][..h].to_vec();
                rms_norm(&mut row, &self.norm, d.eps);
                picked.extend(row);
                keep.push(*kept);
            }
        }
        let mut logits = vec![0f32; keep.iter().filter(|&&k| k).count() * d.vocab];
        let mut chosen = self
            .lm_head
            .apply_choosing(&picked, &keep, &mut logits)
            .into_iter();
        let tokens = spans
            .iter()
            .map(|(rows, _)| chosen.by_ref().take(rows.len()).last().flatten())
            .collect();
        Outputs { logits, tokens }
    }

    /// One layer over every row: attention (appending the rows' keys and values to their
    /// sequences' caches), then the gated feed-forward, each added to the residual stream `x`.
    fn layer(
        &self,
        l: usize,
        layer: &Layer,
        x: &mut [f32],
        (rows, rope): (&[(usize, usize)], &[f32]),
        steps: &mut [Step<'_>],
        buffers: &mut Buffers,
    ) {
        let d = &self.dims;
        let (h, q_dim, kv_dim, hd) = (d.hidden, d.q_dim(), d.kv_dim(), d.head_dim);
        let Buffers {
            normed,
            qkv,
            ctx,
            projected,
            gate_up,
            act,
        } = buffers;
        normed.copy_from_slice(x);
        normed
            .par_chunks_mut(h)
            .for_each(|r| rms_norm(r, &layer.attn_norm, d.eps));
        let width = q_dim + 2 * kv_dim;
        layer.qkv.apply_wide(normed, layer.qkv_bias.as_deref(), qkv);
        qkv.par_chunks_mut(width)
            .zip(rope.par_chunks(hd))
            .for_each(|(row, angles)| {
                let (q, k) = row[..q_dim + kv_dim].split_at_mut(q_dim);
                for (head, norm) in [(q, &layer.q_norm), (k, &layer.k_norm)] {
                    for one in head.chunks_exact_mut(hd) {
                        if let Some(w) = norm {
                            rms_norm(one, w, d.eps);
                        }
                        rotate(one, angles);
                    }
                }
            });
        for (r, &(s, position)) in rows.iter().enumerate() {
            let row = &qkv[r * width..][..width];
            // This row's position and the step's later ones (the cache's length moves on after
            // the last layer).
            let coming = steps[s].cache.len + steps[s].tokens.len() - position;
            let (key, value) = row[q_dim..].split_at(kv_dim);
            steps[s].cache.push(l, key, value, coming);
        }
        let caches: Vec<&KvCache> = steps.iter().map(|s| &*s.cache).collect();
        let group = d.heads / d.kv_heads;
        let scale = 1.0 / (hd as f32).sqrt();
        // One task per row and key/value head: the query heads sharing that head (adjacent in
        // the row) read its keys and values in one pass.
        ctx.par_chunks_mut(group * hd)
            .enumerate()
            .for_each(|(i, out)| {
                let (r, kv_head) = (i / d.kv_heads, i % d.kv_heads);
                let (s, pos) = rows[r];
                let queries = &qkv[r * width + kv_head * group * hd..][..group * hd];
                let kv = caches[s].head(l, pos + 1, kv_dim, kv_head * hd);
                attend_best(queries, hd, kv, scale, out);
            });
        layer
            .out
            .apply_wide(ctx, layer.out_bias.as_deref(), projected);
        x.iter_mut().zip(&*projected).for_each(|(v, p)| *v += p);

        normed.copy_from_slice(x);
        normed
            .par_chunks_mut(h)
            .for_each(|r| rms_norm(r, &layer.ffn_norm, d.eps));
        let inter = d.intermediate;
        layer.gate_up.apply_wide(normed, None, gate_up);
        act.par_chunks_mut(inter)
            .zip(gate_up.par_chunks(2 * inter))
            .for_each(|(a, gu)| silu_mul(a, &gu[..inter], &gu[inter..]));
        layer.down.apply_wide(act, None, projected);
        x.iter_mut().zip(&*projected).for_each(|(v, p)| *v += p);
    }

    /// Per row of a step, the cosines then the sines (`head_dim / 2` each) of its position's
    /// angles, computed in f32 as transformers computes them: angle = position × inv_freq.
    fn rope_rows(&self, rows: &[(usize, usize)]) -> Vec<f32> {
        let mut table = Vec::with_capacity(rows.len() * 2 * self.inv_freq.len());
        for &(_, pos) in rows {
            let angles = self.inv_freq.iter().map(|f| pos as f32 * f);
            table.extend(angles.clone().map(f32::cos));
            table.extend(angles.map(f32::sin));
        }
        table
    }
}

/// A step's working rows between a layer's products, allocated once a step and written whole
/// by each layer (allocated and zeroed per layer they took ~2% of a step's samples, the Qwen
/// shape at 32 rows on a Zen 4, on one thread while the others waited).
struct Buffers {
    normed: Vec<f32>,
    qkv: Vec<f32>,
    ctx: Vec<f32>,
    projected: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
}

impl Buffers {
    /// Room for `n` rows of `d`'s layers.
    fn new(d: &DecoderDims, n: usize) -> Self {
        let rows = |width: usize| vec![0f32; n * width];
        Self {
            normed: rows(d.hidden),
            qkv: rows(d.q_dim() + 2 * d.kv_dim()),
            ctx: rows(d.q_dim()),
            projected: rows(d.hidden),
            gate_up: rows(2 * d.intermediate),
            act: rows(d.intermediate),
        }
    }
}

/// The rotary embedding's inverse frequencies as transformers computes them, in f32:
/// `1 / theta^(2i / dim)`.
fn inv_freq(d: &DecoderDims) -> Vec<f32> {
    (0..d.head_dim / 2)
        .map(|i| 1.0 / d.rope_theta.powf((2 * i) as f32 / d.head_dim as f32))
        .collect()
}

/// Rotary embedding of one head by its position's cosines and sines (`angles`, as
/// [`CpuDecoder::rope_rows`] gives them), transformers' layout: the first half of the head
/// rotated against the second (`rotate_half`).
fn rotate(head: &mut [f32], angles: &[f32]) {
    let half = head.len() / 2;
    let (cos, sin) = angles.split_at(half);
    let (a, b) = head.split_at_mut(half);
    for i in 0..half {
        let (x, y) = (a[i], b[i]);
        a[i] = x * cos[i] - y * sin[i];
        b[i] = y * cos[i] + x * sin[i];
    }
}

/// RMSNorm of one row in place: `w · x / sqrt(mean(x²) + eps)`.
fn rms_norm(row: &mut [f32], w: &[f32], eps: f32) {
    let inv = 1.0 / (sum_of_products(row, row) / row.len() as f32 + eps).sqrt();
    row.iter_mut().zip(w).for_each(|(v, w)| *v = w * (*v * inv));
}

/// `silu(gate) · up`, elementwise: compiled for AVX2 where the CPU has it, the same operations
/// in the same order either way, so the same bits (built for the crate's baseline the loop ran
/// one value at a time: 1.75 ns a value on a Zen 4, 3.9% of a Qwen2.5-0.5B-shape batch).
fn silu_mul(out: &mut [f32], gate: &[f32], up: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { silu_mul_avx2(out, gate, up) };
    }
    silu_mul_in(out, gate, up)
}

/// [`silu_mul`] compiled for AVX2.
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn silu_mul_avx2(out: &mut [f32], gate: &[f32], up: &[f32]) {
    silu_mul_in(out, gate, up)
}

#[inline(always)]
fn silu_mul_in(out: &mut [f32], gate: &[f32], up: &[f32]) {
    for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
        *o = g / (1.0 + exp(-g)) * u;
    }
}

/// Σ aᵢbᵢ with sixteen lane sums in a fixed order (so the same inputs give the same bits on any
/// x86-64 vector width).
#[inline(always)]
fn sum_of_products(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..16 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut half = [0f32; 8];
    for i in 0..8 {
        half[i] = acc[i] + acc[i + 8];
    }
    half.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The AVX2 build of `silu(gate) · up` gives the portable build's bits, across the range
    /// `exp`'s clamp cuts and at zeros and tiny values.
    #[test]
    fn silu_on_avx2_is_the_portable_silu_bit_for_bit() {
        let gate: Vec<f32> = (-3000..3000)
            .map(|i| i as f32 * 0.0611)
            .chain([0.0, -0.0, f32::MIN_POSITIVE, -1e-30, 88.5, -87.5])
            .collect();
        let up: Vec<f32> = gate.iter().map(|g| 1.0 - g * 0.37).collect();
        let (mut best, mut portable) = (vec![0f32; gate.len()], vec![0f32; gate.len()]);
        silu_mul(&mut best, &gate, &up);
        silu_mul_in(&mut portable, &gate, &up);
        let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&best), bits(&portable));
    }
}
