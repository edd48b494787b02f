//! A decoder LLM of the Llama family (Llama, SmolLM, Qwen2, Qwen3) on candle's devices over the
//! paged KV cache (issue 52): the network a GPU worker will generate with, built from the same
//! weights reader as the CPU decoder, so what either computes differently from transformers is
//! refused at one place (`super::super::load`).
//!
//! A step takes some new tokens of some sequences (whole prompts, parts of prompts, or one token
//! each while decoding) and gives each sequence's next-token logits. Every operation computes a
//! token's row from that row alone (RMSNorm, the products, the rotary embedding, the activation)
//! or from its own sequence's cache (`PagedAttention`), which is what makes a sequence's logits
//! independent of its neighbours, of how its prompt was cut, and of a resumption. On candle's
//! CPU backend that holds bit for bit (the tests); on CUDA too, the dense layers being the
//! products pinned to one cuBLASLt algorithm per weight shape (`linear.rs`, `pinned.rs`), which
//! the GPU check holds to it on the device.

use super::argmax::ArgmaxRows;
use super::attention::{PagedAttention, RowLayout, WriteCache};
use super::blocks::{BlockPool, PoolError, SeqId};
use super::linear::linear;
use super::mask::{MaskRows, Masks};
use super::rotary::RotaryRows;
use super::sample::SampleRows;
use crate::model::engines::decoder::Sampling;
use candle_core::{DType, Device, Result, Tensor, D};
use spotinfer_fused_cpu::{DecoderDims, FusedError};
use std::sync::Mutex;

/// Token slots a block of the cache.
pub const BLOCK_SIZE: usize = 16;

/// How [`PagedDecoder::forward_choosing`] chooses a feed's next token, on the device.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Choice {
    /// The greedy token (also what a feed still reading its prompt gets: a choice not used, the
    /// cheapest to make).
    Greedy,
    /// The request's seeded draw at the position (greedy at temperature 0).
    Draw(Sampling, usize),
    /// As [`Choice::Draw`], among the ids the feed's mask allows (a constrained record's; the
    /// masks are computed on the host while the device runs the step, and applied there).
    Masked(Sampling, usize),
}

impl Choice {
    /// The draw, if the choice is one at a temperature above 0 (else greedy).
    fn sampled(&self) -> Option<(Sampling, usize)> {
        match *self {
            Self::Draw(s, position) | Self::Masked(s, position) if s.temperature > 0.0 => {
                Some((s, position))
            }
            _ => None,
        }
    }
}

/// The choices of the feeds of `rows` (each a row of `logits` and the feed it is for), queued on
/// the device: the greedy rows' argmax and the sampled rows' draws, each with the feeds its ids
/// are for.
fn queue_choices(
    logits: &Tensor,
    rows: impl Iterator<Item = (u32, u32)>,
    choices: &[Choice],
) -> Result<Vec<(Vec<u32>, Tensor)>> {
    let device = logits.device();
    let (mut greedy, mut sampled) = ((vec![], vec![]), (vec![], vec![]));
    for (row, feed) in rows {
        match choices[feed as usize].sampled() {
            Some(draw) => (sampled.0.push(row), sampled.1.push((feed, draw))),
            None => (greedy.0.push(row), greedy.1.push(feed)),
        };
    }
    let pick = |rows: &[u32]| logits.index_select(&Tensor::new(rows, device)?, 0);
    let mut pending = Vec::new();
    if !greedy.0.is_empty() {
        pending.push((greedy.1, pick(&greedy.0)?.apply_op1(ArgmaxRows)?));
    }
    if !sampled.0.is_empty() {
        let (feeds, draws): (Vec<u32>, Vec<(Sampling, usize)>) = sampled.1.into_iter().unzip();
        let params = super::sample::params(&draws, device)?;
        pending.push((feeds, pick(&sampled.0)?.apply_op2(&params, SampleRows)?));
    }
    Ok(pending)
}

/// One layer's weights, in the decoder's dtype on its device.
struct Layer {
    attn_norm: Tensor,
    /// Query, key and value projections stacked, `(q + 2 kv, hidden)`, and their biases.
    qkv: Tensor,
    qkv_bias: Option<Tensor>,
    /// Qwen3's RMSNorm of each query and key head.
    qk_norm: Option<(Tensor, Tensor)>,
    out: Tensor,
    out_bias: Option<Tensor>,
    ffn_norm: Tensor,
    /// Gate and up projections stacked, `(2 intermediate, hidden)`.
    gate_up: Tensor,
    down: Tensor,
}

/// The cache: its bookkeeping and, per layer, its keys and values `(2, slots, kv_heads,
/// head_dim)`.
struct Cache {
    pool: BlockPool,
    kv: Vec<Tensor>,
}

/// The paged decoder.
pub struct PagedDecoder {
    dims: DecoderDims,
    embed: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Tensor,
    /// The rotary embedding's cosines and sines by position, `(positions, head_dim / 2)`.
    cos: Tensor,
    sin: Tensor,
    cache: Mutex<Cache>,
    /// The next sequence id handed out.
    next_id: std::sync::atomic::AtomicU64,
}

/// A step's host-side plan: token ids, positions and slots, the attention's plan, and where each
/// sequence's new rows end.
struct StepPlan {
    ids: Vec<u32>,
    positions: Vec<u32>,
    slots: Vec<u32>,
    plan: Vec<u32>,
    width: usize,
    ends: Vec<usize>,
}

impl PagedDecoder {
    /// Builds the decoder of shape `dims` in `dtype` on `device` from `read(name, shape)` (the
    /// CPU decoder's reader: transformers' names, f32 values, `None` for a missing optional
    /// tensor), with a cache of `cache_tokens` token slots for every layer.
    pub fn load(
        dims: DecoderDims,
        device: &Device,
        dtype: DType,
        cache_tokens: usize,
        mut read: impl FnMut(&str, &[usize]) -> std::result::Result<Option<Vec<f32>>, FusedError>,
    ) -> Result<Self> {
        let d = dims;
        if d.heads == 0 || d.kv_heads == 0 || !d.heads.is_multiple_of(d.kv_heads) {
            candle_core::bail!(
                "{} query heads over {} key/value heads",
                d.heads,
                d.kv_heads
            );
        }
        if d.head_dim > super::attention::MAX_HEAD_DIM || !d.head_dim.is_multiple_of(2) {
            candle_core::bail!(
                "heads of {}: the paged attention takes even widths up to 128",
                d.head_dim
            );
        }
        let mut tensor = |name: &str, shape: &[usize], required: bool| -> Result<Option<Tensor>> {
            match read(name, shape).map_err(candle_core::Error::wrap)? {
                Some(v) => Ok(Some(Tensor::from_vec(v, shape, device)?.to_dtype(dtype)?)),
                None if required => candle_core::bail!("no tensor {name}"),
                None => Ok(None),
            }
        };
        let embed = tensor("model.embed_tokens.weight", &[d.vocab, d.hidden], true)?
            .ok_or_else(|| candle_core::Error::Msg("no embeddings".into()))?;
        let mut layers = Vec::with_capacity(d.layers);
        for i in 0..d.layers {
            layers.push(load_layer(&d, i, &mut tensor)?);
        }
        let norm = tensor("model.norm.weight", &[d.hidden], true)?
            .ok_or_else(|| candle_core::Error::Msg("no final norm".into()))?;
        let lm_head = match d.tied {
            true => embed.clone(),
            false => {
                tensor("lm_head.weight", &[d.vocab, d.hidden], false)?.unwrap_or(embed.clone())
            }
        };
        let (cos, sin) = rope_tables(&d, device, dtype)?;
        let blocks = cache_tokens.div_ceil(BLOCK_SIZE);
        let shape = (2, blocks * BLOCK_SIZE, d.kv_heads, d.head_dim);
        let kv = (0..d.layers)
            .map(|_| Tensor::zeros(shape, dtype, device))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            dims,
            embed,
            layers,
            norm,
            lm_head,
            cos,
            sin,
            cache: Mutex::new(Cache {
                pool: BlockPool::new(blocks, BLOCK_SIZE),
                kv,
            }),
            next_id: Default::default(),
        })
    }

    /// The decoder's shape.
    pub fn dims(&self) -> &DecoderDims {
        &self.dims
    }

    /// A sequence id no other sequence of this decoder has.
    pub fn new_sequence(&self) -> SeqId {
        self.next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }

    /// Most new tokens a step reads (vLLM's `max_num_batched_tokens`): on a GPU 8,192, since
    /// at the CPU decoder's 512 a batch of 256 sequences reads only 256 prompt tokens a step
    /// beside its decoding ones (on an H200, about 220 steps for 128 new tokens of 256 prompts
    /// of ~135 tokens, each a pass over the weights; with 8,192, 137 in all); a step of 8,192
    /// prompt rows takes about 0.1 s there (the Qwen2-0.5B shape read 34,497 prompt tokens and
    /// chose a first token in 0.52 s), so a shutdown is still seen at once. On candle's CPU
    /// backend, the CPU decoder's 512.
    pub fn step_tokens(&self) -> usize {
        match self.embed.device().is_cpu() {
            true => super::super::decode::STEP_TOKENS,
            false => 8192,
        }
    }

    /// The dtype it computes in.
    pub fn dtype(&self) -> DType {
        self.embed.dtype()
    }

    /// Its device, dtype and cache, for the model's description.
    pub fn describe(&self) -> String {
        let slots = self.lock().map_or(0, |c| c.pool.total() * BLOCK_SIZE);
        format!(
            "paged decoder on {:?}, {:?}, {slots} cache slots",
            self.embed.device(),
            self.dtype()
        )
    }

    /// Admits sequence `seq` for at most `tokens` tokens (prompt and new), taking its blocks.
    pub fn admit(&self, seq: SeqId, tokens: usize) -> std::result::Result<(), PoolError> {
        self.lock()
            .map_err(|_| PoolError::Misuse(seq, "cache poisoned"))?
            .pool
            .admit(seq, tokens)
    }

    /// Tokens `seq` holds in the cache (`None` before it is admitted).
    pub fn len(&self, seq: SeqId) -> Option<usize> {
        self.lock().ok()?.pool.len(seq)
    }

    /// Gives `seq`'s blocks back (nothing when it holds none).
    pub fn release(&self, seq: SeqId) {
        if let Ok(mut cache) = self.lock() {
            cache.pool.release(seq);
        }
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Cache>> {
        self.cache
            .lock()
            .map_err(|_| candle_core::Error::Msg("the paged cache's lock is poisoned".into()))
    }

    /// One step, as [`PagedDecoder::forward`], giving each feed's next token chosen on the
    /// device as its [`Choice`] says (one id a feed copied back, not its logits). `masks` gives
    /// the [`Choice::Masked`] feeds' masks, in their order; the host computes them while it
    /// queues the step (and on a GPU, while the device runs it).
    pub fn forward_choosing(
        &self,
        feeds: &[(SeqId, &[u32])],
        choices: &[Choice],
        masks: impl FnOnce() -> Result<Masks> + Send,
    ) -> Result<Vec<u32>> {
        let started = std::time::Instant::now();
        let mut clock = StageClock::new(self.embed.device());
        let is_masked = |i: &u32| matches!(choices[*i as usize], Choice::Masked(..));
        let (masked, free): (Vec<u32>, Vec<u32>) = (0..choices.len() as u32).partition(is_masked);
        let (queued, masks) = rayon::join(
            || -> Result<_> {
                let logits = self.last_logits(feeds, &mut clock)?;
                let pending = queue_choices(&logits, free.iter().map(|&f| (f, f)), choices)?;
                Ok((logits, pending))
            },
            || (!masked.is_empty()).then(masks).transpose(),
        );
        let (logits, mut pending) = queued?;
        if let Some(masks) = masks? {
            let device = logits.device();
            let bits = Tensor::from_vec(masks.bits, (masked.len(), masks.words), device)?;
            let rows = logits.index_select(&Tensor::new(masked.as_slice(), device)?, 0)?;
            let allowed = masks.allowed;
            let rows = rows.apply_op2(&bits, MaskRows { allowed })?;
            let masked_rows = masked.iter().enumerate().map(|(r, &f)| (r as u32, f));
            pending.extend(queue_choices(&rows, masked_rows, choices)?);
        }
        // Everything is queued: what follows waits for the device. The two times tell a host
        // that cannot keep the GPU busy (waiting near 0) from a GPU that is the bound.
        let queued = started.elapsed();
        let mut chosen = vec![0; choices.len()];
        for (feeds, ids) in pending {
            for (&feed, id) in feeds.iter().zip(ids.to_vec1::<u32>()?) {
                chosen[feed as usize] = id;
            }
        }
        tracing::debug!(
            target: "spotinfer::paged::step",
            sequences = feeds.len(),
            tokens = feeds.iter().map(|f| f.1.len()).sum::<usize>(),
            masked_rows = masked.len(),
            queued_us = queued.as_micros() as u64,
            waited_us = (started.elapsed() - queued).as_micros() as u64,
            "paged step"
        );
        clock.lap(Stage::Choose);
        clock.report();
        Ok(chosen)
    }

    /// The logits after each feed's last token, `(feeds, vocab)` on the device.
    fn last_logits(&self, feeds: &[(SeqId, &[u32])], clock: &mut StageClock) -> Result<Tensor> {
        let (x, plan) = self.hidden(feeds, clock)?;
        let lasts: Vec<u32> = plan.ends.iter().map(|&end| end as u32 - 1).collect();
        let lasts = Tensor::new(lasts, x.device())?;
        let x = candle_nn::ops::rms_norm(&x.index_select(&lasts, 0)?, &self.norm, self.dims.eps)?;
        let logits = linear(&x, &self.lm_head, None)?;
        clock.lap(Stage::Head);
        Ok(logits)
    }

    /// One step: each feed's new tokens (an admitted sequence's next ones) through the network,
    /// written to the cache; per feed, the logits after its last token (`vocab` f32), or with
    /// `all_logits` after each of its tokens, row after row.
    pub fn forward(&self, feeds: &[(SeqId, &[u32])], all_logits: bool) -> Result<Vec<Vec<f32>>> {
        let mut clock = StageClock::new(self.embed.device());
        if !all_logits {
            let logits = self.last_logits(feeds, &mut clock)?;
            clock.report();
            return logits.to_dtype(DType::F32)?.to_vec2::<f32>();
        }
        let (x, plan) = self.hidden(feeds, &mut clock)?;
        let x = candle_nn::ops::rms_norm(&x, &self.norm, self.dims.eps)?;
        let logits = linear(&x, &self.lm_head, None)?;
        clock.lap(Stage::Head);
        clock.report();
        let mut rows = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?.into_iter();
        let mut start = 0;
        Ok(plan
            .ends
            .iter()
            .map(|&end| {
                let n = end - start;
                start = end;
                rows.by_ref().take(n).flatten().collect()
            })
            .collect())
    }

    /// The feeds' tokens through every layer (their keys and values written to the cache): the
    /// last hidden state of each new token, `(tokens, hidden)`, and the step's plan.
    fn hidden(
        &self,
        feeds: &[(SeqId, &[u32])],
        clock: &mut StageClock,
    ) -> Result<(Tensor, StepPlan)> {
        let mut cache = self.lock()?;
        let plan = plan_step(&mut cache.pool, feeds)?;
        let device = self.embed.device();
        let tensor = |v: &[u32]| Tensor::new(v, device);
        let (ids, positions) = (tensor(&plan.ids)?, tensor(&plan.positions)?);
        let (slots, attention_plan) = (tensor(&plan.slots)?, tensor(&plan.plan)?);
        let cos = self.cos.index_select(&positions, 0)?;
        let sin = self.sin.index_select(&positions, 0)?;
        let d = &self.dims;
        let attention = PagedAttention {
            layout: RowLayout::qkv(d.heads, d.kv_heads, d.head_dim),
            block_size: BLOCK_SIZE,
            width: plan.width,
        };
        let mut x = self.embed.index_select(&ids, 0)?;
        clock.lap(Stage::Plan);
        for (layer, kv) in self.layers.iter().zip(&cache.kv) {
            let rows = layer.attention_rows(&x, d, &cos, &sin)?;
            clock.lap(Stage::Rows);
            kv.inplace_op3(&rows, &slots, &WriteCache(attention.layout))?;
            let context = rows.apply_op3(kv, &attention_plan, attention)?;
            clock.lap(Stage::Attention);
            x = (x + linear(&context, &layer.out, layer.out_bias.as_ref())?)?;
            clock.lap(Stage::Out);
            x = (&x + layer.feed_forward(&x, d.eps)?)?;
            clock.lap(Stage::FeedForward);
        }
        Ok((x, plan))
    }
}

impl Layer {
    /// The layer's attention input rows: RMSNorm, the stacked Q, K, V product, Qwen3's head
    /// norms, the rotary embedding on Q and K; `(tokens, (heads + 2 kv_heads) · head_dim)`.
    fn attention_rows(
        &self,
        x: &Tensor,
        d: &DecoderDims,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<Tensor> {
        let t = x.dim(0)?;
        let (q, kv) = (d.heads * d.head_dim, d.kv_heads * d.head_dim);
        let h = candle_nn::ops::rms_norm(x, &self.attn_norm, d.eps)?;
        let mut qkv = linear(&h, &self.qkv, self.qkv_bias.as_ref())?;
        if let Some((q_norm, k_norm)) = &self.qk_norm {
            let norm = |at: usize, heads: usize, weight: &Tensor| -> Result<Tensor> {
                let part = qkv.narrow(1, at, heads * d.head_dim)?;
                let part = part.reshape((t, heads, d.head_dim))?.contiguous()?;
                candle_nn::ops::rms_norm(&part, weight, d.eps)?.reshape((t, heads * d.head_dim))
            };
            qkv = Tensor::cat(
                &[
                    norm(0, d.heads, q_norm)?,
                    norm(q, d.kv_heads, k_norm)?,
                    qkv.narrow(1, q + kv, kv)?,
                ],
                1,
            )?;
        }
        let rotary = RotaryRows {
            heads: d.heads,
            kv_heads: d.kv_heads,
            head_dim: d.head_dim,
        };
        qkv.contiguous()?.apply_op3(cos, sin, rotary)
    }

    /// The gated feed-forward of the residual stream `x` (its RMSNorm first).
    fn feed_forward(&self, x: &Tensor, eps: f32) -> Result<Tensor> {
        let h = candle_nn::ops::rms_norm(x, &self.ffn_norm, eps)?;
        let gate_up = linear(&h, &self.gate_up, None)?;
        let inner = gate_up.dim(D::Minus1)? / 2;
        let act = (gate_up.narrow(1, 0, inner)?.silu()? * gate_up.narrow(1, inner, inner)?)?;
        linear(&act, &self.down, None)
    }
}

/// The parts of a step [`StageClock`] times.
#[derive(Clone, Copy)]
enum Stage {
    /// Planning on the host, the plan's copy to the device, the embeddings.
    Plan,
    /// Each layer's attention rows: RMSNorm, the Q, K, V product, the rotary embedding.
    Rows,
    /// The cache's writes and the attention over it.
    Attention,
    /// The output projection and the residual.
    Out,
    /// The feed-forward and the residual.
    FeedForward,
    /// The final norm and the logits.
    Head,
    /// The choice of the next tokens and their copy back.
    Choose,
}

/// Where a step's time goes, on request: when `RUST_LOG` enables `spotinfer::paged::stages` at
/// trace level, the device is synchronised at the end of each stage and a step's seconds per
/// stage are logged. A profile only: the synchronisations keep the host from queueing ahead, so
/// such a step is slower than a plain one. Otherwise it does nothing.
struct StageClock {
    device: Option<Device>,
    lap: std::time::Instant,
    seconds: [f64; 7],
}

impl StageClock {
    fn new(device: &Device) -> Self {
        let on = tracing::enabled!(target: "spotinfer::paged::stages", tracing::Level::TRACE);
        Self {
            device: on.then(|| device.clone()),
            lap: std::time::Instant::now(),
            seconds: [0.0; 7],
        }
    }

    /// Ends `stage`: waits for the device and adds the time since the last lap to it.
    fn lap(&mut self, stage: Stage) {
        let Some(device) = &self.device else { return };
        if let Err(e) = device.synchronize() {
            tracing::warn!(error = %e, "the stage profile could not synchronise the device");
        }
        self.seconds[stage as usize] += self.lap.elapsed().as_secs_f64();
        self.lap = std::time::Instant::now();
    }

    fn report(&self) {
        if self.device.is_none() {
            return;
        }
        let us = |stage: Stage| (self.seconds[stage as usize] * 1e6) as u64;
        tracing::trace!(
            target: "spotinfer::paged::stages",
            plan_us = us(Stage::Plan),
            rows_us = us(Stage::Rows),
            attention_us = us(Stage::Attention),
            out_us = us(Stage::Out),
            feed_forward_us = us(Stage::FeedForward),
            head_us = us(Stage::Head),
            choose_us = us(Stage::Choose),
            "paged step stages"
        );
    }
}

/// Appends each feed's tokens to its sequence in the pool and plans the step.
fn plan_step(pool: &mut BlockPool, feeds: &[(SeqId, &[u32])]) -> Result<StepPlan> {
    let mut p = StepPlan {
        ids: vec![],
        positions: vec![],
        slots: vec![],
        plan: vec![],
        width: 0,
        ends: vec![],
    };
    for (row, (seq, tokens)) in feeds.iter().enumerate() {
        if tokens.is_empty() {
            candle_core::bail!("sequence {seq}: a step with no token");
        }
        let first = pool
            .len(*seq)
            .ok_or_else(|| candle_core::Error::Msg(format!("sequence {seq} not admitted")))?;
        p.slots.extend(
            pool.append(*seq, tokens.len())
                .map_err(candle_core::Error::wrap)?,
        );
        p.ids.extend_from_slice(tokens);
        for i in 0..tokens.len() {
            let position = (first + i) as u32;
            p.positions.push(position);
            p.plan.extend([row as u32, position]);
        }
        p.ends.push(p.ids.len());
    }
    let seqs: Vec<SeqId> = feeds.iter().map(|f| f.0).collect();
    let (tables, width) = pool.table_matrix(&seqs).map_err(candle_core::Error::wrap)?;
    p.plan.extend(tables);
    p.width = width;
    Ok(p)
}

/// Layer `i`'s weights through `tensor(name, shape, required)`.
fn load_layer(
    d: &DecoderDims,
    i: usize,
    tensor: &mut impl FnMut(&str, &[usize], bool) -> Result<Option<Tensor>>,
) -> Result<Layer> {
    let at = |part: &str| format!("model.layers.{i}.{part}");
    let (h, q, kv) = (d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim);
    let mut need = |name: &str, shape: &[usize]| -> Result<Tensor> {
        tensor(&at(name), shape, true)?.ok_or_else(|| candle_core::Error::Msg(format!("no {name}")))
    };
    let qkv = Tensor::cat(
        &[
            need("self_attn.q_proj.weight", &[q, h])?,
            need("self_attn.k_proj.weight", &[kv, h])?,
            need("self_attn.v_proj.weight", &[kv, h])?,
        ],
        0,
    )?;
    let gate_up = Tensor::cat(
        &[
            need("mlp.gate_proj.weight", &[d.intermediate, h])?,
            need("mlp.up_proj.weight", &[d.intermediate, h])?,
        ],
        0,
    )?;
    let (attn_norm, ffn_norm) = (
        need("input_layernorm.weight", &[h])?,
        need("post_attention_layernorm.weight", &[h])?,
    );
    let out = need("self_attn.o_proj.weight", &[h, q])?;
    let down = need("mlp.down_proj.weight", &[h, d.intermediate])?;
    let qk_norm = match d.qk_norm {
        true => Some((
            need("self_attn.q_norm.weight", &[d.head_dim])?,
            need("self_attn.k_norm.weight", &[d.head_dim])?,
        )),
        false => None,
    };
    let mut optional = |name: &str, n: usize| tensor(&at(name), &[n], false);
    let biases = (
        optional("self_attn.q_proj.bias", q)?,
        optional("self_attn.k_proj.bias", kv)?,
        optional("self_attn.v_proj.bias", kv)?,
    );
    let qkv_bias = match biases {
        (Some(bq), Some(bk), Some(bv)) => Some(Tensor::cat(&[bq, bk, bv], 0)?),
        (None, None, None) => None,
        _ => candle_core::bail!("layer {i}: biases on some of the Q, K and V projections only"),
    };
    Ok(Layer {
        attn_norm,
        qkv,
        qkv_bias,
        qk_norm,
        out,
        out_bias: optional("self_attn.o_proj.bias", h)?,
        ffn_norm,
        gate_up,
        down,
    })
}

/// The rotary embedding's tables, computed in f32 as transformers computes them (inverse
/// frequencies `1/θ^(2i/d)`, angles position × frequency), then rounded to `dtype`.
fn rope_tables(d: &DecoderDims, device: &Device, dtype: DType) -> Result<(Tensor, Tensor)> {
    let half = d.head_dim / 2;
    let inv: Vec<f32> = (0..half)
        .map(|i| 1.0 / d.rope_theta.powf((2 * i) as f32 / d.head_dim as f32))
        .collect();
    let angles: Vec<f32> = (0..d.max_positions)
        .flat_map(|p| inv.iter().map(move |f| p as f32 * f))
        .collect();
    let cos: Vec<f32> = angles.iter().map(|a| a.cos()).collect();
    let sin: Vec<f32> = angles.iter().map(|a| a.sin()).collect();
    let table = |v: Vec<f32>| Tensor::from_vec(v, (d.max_positions, half), device)?.to_dtype(dtype);
    Ok((table(cos)?, table(sin)?))
}

#[cfg(test)]
mod tests {
    use super::{Choice, Masks, PagedDecoder, Sampling};
    use crate::model::engines::decoder::load::FolderWeights;
    use crate::model::engines::decoder::{argmax, constrain};
    use candle_core::{DType, Device};
    use llguidance::toktrie::SimpleVob;
    use std::path::{Path, PathBuf};

    fn fixtures() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llm")
    }

    fn reference() -> serde_json::Value {
        let text = std::fs::read_to_string(fixtures().join("models.json")).unwrap();
        serde_json::from_str(&text).unwrap()
    }

    fn ids(v: &serde_json::Value) -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    }

    fn open(name: &str) -> PagedDecoder {
        let (_, dims, mut weights) =
            FolderWeights::open(&fixtures().join("models").join(name)).unwrap();
        PagedDecoder::load(dims, &Device::Cpu, DType::F32, 8192, |n, s| {
            weights.read(n, s)
        })
        .unwrap()
    }

    /// `n` greedy tokens of sequence `seq` after `prompt` read in parts of `chunk` tokens, and
    /// the logits before each.
    fn greedy(
        model: &PagedDecoder,
        seq: u64,
        prompt: &[u32],
        chunk: usize,
        n: usize,
    ) -> (Vec<u32>, Vec<Vec<f32>>) {
        model.admit(seq, prompt.len() + n).unwrap();
        let mut logits = vec![];
        for part in prompt.chunks(chunk) {
            logits = model.forward(&[(seq, part)], false).unwrap();
        }
        let (mut tokens, mut seen) = (vec![], vec![]);
        let mut last = logits.swap_remove(0);
        while tokens.len() < n {
            let t = argmax(&last);
            tokens.push(t);
            seen.push(std::mem::take(&mut last));
            if tokens.len() < n {
                last = model.forward(&[(seq, &[t])], false).unwrap().swap_remove(0);
            }
        }
        model.release(seq);
        (tokens, seen)
    }

    /// Greedy tokens equal transformers' `generate(do_sample=False)` in f32 on the random-weight
    /// Llama, Qwen2 (biases) and Qwen3 (head norms) fixtures, twelve prompts each, and 64
    /// prompts' logits and the next step's are the same alone, in one batch and chunked: the
    /// GPU check's decoder rows (`check::check_decoders`), on candle's CPU backend.
    #[test]
    fn greedy_tokens_equal_transformers_for_every_family() {
        let checks = super::super::check::check_decoders(&Device::Cpu, &fixtures()).unwrap();
        assert_eq!(checks.len(), 6);
        for c in &checks {
            assert!(c.passed && c.largest_difference == 0.0, "{c:?}");
        }
    }

    /// A step choosing on the device gives, for a greedy feed, the decode loop's argmax of the
    /// logits the plain step gives, for a sampled one the decode loop's sampler's draw from
    /// them at its position, and for a masked one (greedy or sampled) the same from those
    /// logits masked on the host as the CPU decoder masks them.
    #[test]
    fn choosing_gives_the_greedy_the_sampled_or_the_masked_token() {
        let refs = reference();
        let model = open("qwen2");
        let prompts: Vec<Vec<u32>> = refs["models"]["qwen2"].as_array().unwrap()[..5]
            .iter()
            .map(|c| ids(&c["prompt_ids"]))
            .collect();
        let feeds = |base: u64| -> Vec<(u64, &[u32])> {
            prompts
                .iter()
                .enumerate()
                .map(|(i, p)| (base + i as u64, p.as_slice()))
                .collect()
        };
        for (i, p) in prompts.iter().enumerate() {
            model.admit(10 + i as u64, p.len()).unwrap();
            model.admit(20 + i as u64, p.len()).unwrap();
        }
        let logits = model.forward(&feeds(10), false).unwrap();
        let hot = |top_p, top_k, seed| Sampling {
            temperature: 1.5,
            top_p,
            top_k,
            seed,
        };
        let greedy = Sampling {
            temperature: 0.0,
            ..hot(1.0, 0, 1)
        };
        let choices = [
            Choice::Greedy,
            Choice::Draw(hot(1.0, 0, 3), 5),
            Choice::Masked(greedy, 0),
            Choice::Masked(hot(0.9, 0, 7), 2),
            Choice::Draw(hot(0.9, 20, 4), 11),
        ];
        // Masks that leave neither row's own choice: every third id, and ids from 1,000 on.
        let vocab = logits[0].len();
        let (first, third) = (argmax(&logits[2]), hot(0.9, 0, 7).choose(&logits[3], 2));
        let vobs: Vec<SimpleVob> = [|id: usize| id % 3 == 1, |id: usize| id >= 1_000]
            .iter()
            .zip([first as usize, third as usize])
            .map(|(allows, own)| {
                let mut vob = SimpleVob::alloc(vocab - 5);
                (0..vocab - 5)
                    .filter(|&id| allows(id) && id != own)
                    .for_each(|id| vob.allow_token(id as u32));
                vob
            })
            .collect();
        let masks = || Masks::new(&[Some(&vobs[0]), Some(&vobs[1])], vocab);
        let chosen = model.forward_choosing(&feeds(20), &choices, masks).unwrap();
        let mut vob = vobs.iter();
        for (i, (got, l)) in chosen.iter().zip(&logits).enumerate() {
            let want = match choices[i] {
                Choice::Draw(s, position) => s.choose(l, position),
                Choice::Greedy => argmax(l),
                Choice::Masked(s, position) => {
                    let mut l = l.clone();
                    constrain::apply(vob.next().unwrap(), &mut l);
                    s.choose(&l, position)
                }
            };
            assert_eq!(*got, want, "feed {i}");
        }
        assert_ne!(chosen[2], first, "the mask applied");
        assert_ne!(chosen[3], third, "the mask applied");
    }

    /// Batch invariance: every prompt's logits, step by step, are the same bits read alone,
    /// read in chunks of 17 tokens, read in one step with all the others and decoded beside
    /// them, and resumed from a checkpoint of its first ten tokens (the prompt and those tokens
    /// read again as a new sequence).
    #[test]
    fn logits_do_not_depend_on_the_batch_the_chunks_or_a_resumption() {
        let refs = reference();
        let bits = |v: &[Vec<f32>]| -> Vec<Vec<u32>> {
            v.iter()
                .map(|r| r.iter().map(|x| x.to_bits()).collect())
                .collect()
        };
        for name in ["llama", "qwen3"] {
            let model = open(name);
            let cases = refs["models"][name].as_array().unwrap();
            let prompts: Vec<Vec<u32>> = cases.iter().map(|c| ids(&c["prompt_ids"])).collect();
            let n = 16;
            let alone: Vec<(Vec<u32>, Vec<Vec<f32>>)> = prompts
                .iter()
                .enumerate()
                .map(|(i, p)| greedy(&model, i as u64, p, usize::MAX, n))
                .collect();
            for (i, p) in prompts.iter().enumerate() {
                let (tokens, logits) = greedy(&model, 100 + i as u64, p, 17, n);
                assert_eq!(
                    (&tokens, bits(&logits)),
                    (&alone[i].0, bits(&alone[i].1)),
                    "{name} {i} chunked"
                );
                let mut resumed = p.clone();
                resumed.extend(&alone[i].0[..10]);
                let (_, logits) = greedy(&model, 200 + i as u64, &resumed, usize::MAX, n - 10);
                assert_eq!(bits(&logits), bits(&alone[i].1[10..]), "{name} {i} resumed");
            }
            // All together: one step reads every prompt, then every sequence decodes together.
            for (i, p) in prompts.iter().enumerate() {
                model.admit(300 + i as u64, p.len() + n).unwrap();
            }
            let feeds: Vec<(u64, &[u32])> = prompts
                .iter()
                .enumerate()
                .map(|(i, p)| (300 + i as u64, p.as_slice()))
                .collect();
            let mut logits = model.forward(&feeds, false).unwrap();
            for step in 0..n {
                let next: Vec<u32> = logits.iter().map(|l| argmax(l)).collect();
                for (i, l) in logits.iter().enumerate() {
                    assert_eq!(
                        bits(std::slice::from_ref(l)),
                        bits(&alone[i].1[step..step + 1]),
                        "{name} {i} batched step {step}"
                    );
                }
                if step + 1 < n {
                    let feeds: Vec<(u64, [u32; 1])> = next
                        .iter()
                        .enumerate()
                        .map(|(i, &t)| (300 + i as u64, [t]))
                        .collect();
                    let feeds: Vec<(u64, &[u32])> =
                        feeds.iter().map(|(s, t)| (*s, t.as_slice())).collect();
                    logits = model.forward(&feeds, false).unwrap();
                }
            }
        }
    }
}
