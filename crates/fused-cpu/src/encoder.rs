//! spotinfer's BERT encoder on the CPU, written for throughput.
//!
//! candle's general-purpose BERT spends much of its CPU time outside the matrix products: it
//! pads every text to the batch's longest, allocates (and the kernel zero-fills) a fresh tensor
//! for every intermediate of every layer, runs softmax, GELU, bias and residual additions as
//! separate single-threaded passes, and copies Q, K and V into head-major layouts. This encoder
//! computes the same function (a BERT or RoBERTa encoder with exact erf GELU, then the pooling
//! sentence-transformers configures) with:
//!
//! - **no padding**: the batch is one `(tokens, hidden)` matrix holding only real tokens, so the
//!   dense layers, which are about 95% of the work, never multiply padding;
//! - **one fused QKV product** per layer, and attention per (text, head) straight out of that
//!   product with strided matrix products: no transposes, no copies, no mask;
//! - **fused passes**: bias folded into each product, softmax in one pass over a row, residual
//!   add + layer norm in one pass, GELU in place, all parallel over rows;
//! - **no allocation per layer**: five scratch buffers, grown to the largest batch seen and
//!   reused, so the allocator never maps and unmaps tens of megabytes per layer.
//!
//! The matrix products are this crate's own kernels on weights packed at load (`packed`: f32
//! on AVX-512 or AVX2; bf16 on AVX-512 BF16; int8 on AVX-512 VNNI, AVX-VNNI, AVX2 or Arm's
//! dotprod), or, for f32 on CPUs with neither AVX-512 nor AVX2 (Arm's NEON among them), candle's
//! CPU engine (the `gemm` crate) called directly on the f32 weights. Weights are read from a memory-mapped

use crate::attention::{attention, AttentionProducts};
use crate::dense::Dense;
use crate::kernels::{self, add_layer_norm, bias_gelu, grow, layer_norm};
use crate::packed::{self, Dot, Fma, Format, PackedWeights};
use crate::weights::WeightsFile;
use crate::{Dims, FusedError, Layout, Pooling, Precision, Tokens, Widest};
use rayon::prelude::*;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

/// `out = x · wᵀ (+ b)`; while calibrating (`record`), `w`'s input ranges widened to `x`'s first.
fn product(w: &Dense, x: &[f32], b: Option<&[f32]>, out: &mut [f32], record: bool) {
    if record {
        w.record(x);
    }
    w.apply(x, b, out);
}

struct Layer {
    /// Query, key and value weights stacked: `(3 * hidden, hidden)`.
    qkv_w: Dense,
    qkv_b: Vec<f32>,
    attn_out_w: Dense,
    attn_out_b: Vec<f32>,
    attn_ln_w: Vec<f32>,
    attn_ln_b: Vec<f32>,
    inter_w: Dense,
    inter_b: Vec<f32>,
    out_w: Dense,
    out_b: Vec<f32>,
    out_ln_w: Vec<f32>,
    out_ln_b: Vec<f32>,
}

impl Layer {
    /// The format each of [`Layer::dense`]'s matrices computes in when the model computes in
    /// `format`: the same for all four, but for AVX2's int8, whose 7-bit activations resolve
    /// the feed-forward output's inputs (GELU's, with their long tail) worst: that product,
    /// a third of the multiply-adds, stays f32 on the same CPU's FMA kernel. All-int8 on AVX2
    /// put 25 of 3,000 real texts below cosine 0.999; with this, none.
    fn formats(format: Option<Format>, avx2_only: bool) -> [Option<Format>; 4] {
        match format {
            Some(Format::Int8(Dot::Avx2)) => {
                let f32 = Fma::best(avx2_only).map(Format::F32);
                [format, format, format, f32]
            }
            _ => [format; 4],
        }
    }

    /// The layer's four weight matrices: the attention's fused Q/K/V projection and output
    /// projection, then the feed-forward's input and output.
    fn dense(&mut self) -> [&mut Dense; 4] {
        [
            &mut self.qkv_w,
            &mut self.attn_out_w,
            &mut self.inter_w,
            &mut self.out_w,
        ]
    }
}

/// Intermediate buffers, kept between batches.
#[derive(Default)]
struct Scratch {
    x: Vec<f32>,
    qkv: Vec<f32>,
    ctx: Vec<f32>,
    tmp: Vec<f32>,
    inter: Vec<f32>,
}

/// A BERT encoder with its pooling, for the CPU.
pub struct CpuBert {
    dims: Dims,
    pooling: Pooling,
    word: Vec<f32>,
    position: Vec<f32>,
    token_type: Vec<f32>,
    emb_ln_w: Vec<f32>,
    emb_ln_b: Vec<f32>,
    layers: Vec<Layer>,
    precision: Precision,
    /// Set by [`CpuBert::calibrate`] while its texts run: the dense layers record their inputs.
    recording: AtomicBool,
    /// Set by [`CpuBert::limit_to`]: the widest kernels the dense layers may run.
    widest: Widest,
    scratch: Mutex<Scratch>,
}

impl CpuBert {
    /// Loads the weights from a safetensors file (F32, F16 or BF16, widened to f32), named as
    /// `dims.layout` says.
    pub fn load(path: &Path, dims: Dims, pooling: Pooling) -> Result<Self, FusedError> {
        let file = WeightsFile::open(path)?;
        let st = file.tensors()?;
        let h = dims.hidden;
        if dims.heads == 0 || !h.is_multiple_of(dims.heads) {
            return Err(st.error(format!(
                "hidden size {h} is not a multiple of {} heads",
                dims.heads
            )));
        }
        let names = dims.layout.names();
        let prefix = names
            .prefixes
            .iter()
            .find(|p| st.has(&format!("{p}{}.weight", names.word)))
            .copied()
            .unwrap_or("");
        let get = |name: &str, shape: &[usize]| st.read(&format!("{prefix}{name}"), shape);
        let word = get(&format!("{}.weight", names.word), &[dims.vocab, h])?;
        let position = get(
            &format!("{}.weight", names.position),
            &[dims.max_positions, h],
        )?;
        let token_type = match names.token_type {
            Some(n) => get(&format!("{n}.weight"), &[dims.type_vocab, h])?,
            // One all-zero type row: every token adds nothing, as DistilBERT's embeddings do.
            None => vec![0.0; h],
        };
        let emb_ln_w = get(&format!("{}.weight", names.emb_norm), &[h])?;
        let emb_ln_b = get(&format!("{}.bias", names.emb_norm), &[h])?;
        let mut layers = Vec::with_capacity(dims.layers);
        for i in 0..dims.layers {
            let part = |name: &str, what: &str, shape: &[usize]| {
                get(&format!("{}.{i}.{name}.{what}", names.layer), shape)
            };
            let [q, k, v, ao, an, im, o, on] = names.parts;
            let inter = dims.intermediate;
            let mut qkv_w = part(q, "weight", &[h, h])?;
            qkv_w.extend(part(k, "weight", &[h, h])?);
            qkv_w.extend(part(v, "weight", &[h, h])?);
            let mut qkv_b = part(q, "bias", &[h])?;
            qkv_b.extend(part(k, "bias", &[h])?);
            qkv_b.extend(part(v, "bias", &[h])?);
            layers.push(Layer {
                qkv_w: Dense::new(qkv_w, h),
                qkv_b,
                attn_out_w: Dense::new(part(ao, "weight", &[h, h])?, h),
                attn_out_b: part(ao, "bias", &[h])?,
                attn_ln_w: part(an, "weight", &[h])?,
                attn_ln_b: part(an, "bias", &[h])?,
                inter_w: Dense::new(part(im, "weight", &[inter, h])?, h),
                inter_b: part(im, "bias", &[inter])?,
                out_w: Dense::new(part(o, "weight", &[h, inter])?, inter),
                out_b: part(o, "bias", &[h])?,
                out_ln_w: part(on, "weight", &[h])?,
                out_ln_b: part(on, "bias", &[h])?,
            });
        }
        let mut bert = Self {
            dims,
            pooling,
            word,
            position,
            token_type,
            emb_ln_w,
            emb_ln_b,
            layers,
            precision: Precision::F32,
            recording: AtomicBool::new(false),
            widest: Widest::All,
            scratch: Mutex::new(Scratch::default()),
        };
        bert.set_precision(Precision::F32)?;
        Ok(bert)
    }

    /// The precision [`CpuBert::embed`] computes in (f32 until set).
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// Computes the dense layers as a narrower CPU class does from now on, whatever this CPU
    /// has: [`Widest::Avx2`] as a CPU with AVX2 but neither AVX-512 nor AVX-VNNI (AMD's Zen 2
    /// and 3: f32 on this crate's AVX2/FMA kernel, int8 on AVX2's `vpmaddubsw` with the
    /// feed-forward output in f32, bf16 refused), [`Widest::NoAmx`] without AMX's tiles; to
    /// compare CPU classes on one machine, and to test their paths on a wider CPU. Fails if the
    /// current precision needs what is left out or its f32 weights were released.
    pub fn limit_to(&mut self, widest: Widest) -> Result<(), FusedError> {
        self.widest = widest;
        self.set_precision(self.precision)
    }

    /// The widest kernels the dense layers may run ([`CpuBert::limit_to`]).
    pub fn widest(&self) -> Widest {
        self.widest
    }

    /// Whether [`CpuBert::set_precision`] can choose `precision` on this CPU and within
    /// [`CpuBert::limit_to`].
    pub fn runs(&self, precision: Precision) -> bool {
        precision.format(self.widest).is_ok()
    }

    /// The instructions the dense layers run on in the current precision, for logs and
    /// benchmarks (a figure means little without them).
    pub fn kernels(&self) -> &'static str {
        match self.precision.format(self.widest) {
            Ok(Some(format)) => format.kernels(),
            _ => kernels::gemm_instructions(),
        }
    }

    /// Computes in `precision` from now on, packing every dense weight for its kernel (the f32
    /// weights as read are kept until [`CpuBert::release_unused`], so precisions can be
    /// compared). bf16 needs AVX-512 BF16 ([`bf16_supported`](crate::bf16_supported)), int8
    /// integer dot products ([`int8_supported`](crate::int8_supported));
    /// [`CpuBert::limit_to`] narrows both.
    pub fn set_precision(&mut self, precision: Precision) -> Result<(), FusedError> {
        let format = precision
            .format(self.widest)
            .map_err(FusedError::Unsupported)?;
        let formats = Layer::formats(format, self.widest.avx2_only());
        for (d, format) in self
            .layers
            .iter_mut()
            .flat_map(|layer| layer.dense().into_iter().zip(formats))
        {
            if d.packed.as_ref().map(|p| p.format) == format {
                continue;
            }
            if d.f32.is_empty() {
                return Err(FusedError::Unsupported(format!(
                    "the f32 weights were released after choosing {:?}",
                    self.precision
                )));
            }
            let ranges = d.ranges.get_mut().unwrap_or_else(PoisonError::into_inner);
            let factors = match format {
                Some(Format::Int8(_)) if !ranges.is_empty() => {
                    packed::int8::smoothing(&d.f32, d.k, ranges)
                }
                _ => Vec::new(),
            };
            d.packed = format.map(|f| PackedWeights::pack(f, &d.f32, d.k, &factors));
        }
        self.precision = precision;
        Ok(())
    }

    /// Frees the f32 weights as read once the chosen precision's kernel has its own packed
    /// copy, the choice being final. Returns the bytes freed.
    pub fn release_unused(&mut self) -> usize {
        let mut freed = 0;
        for d in self.layers.iter_mut().flat_map(Layer::dense) {
            if d.packed.is_some() {
                freed += std::mem::take(&mut d.f32).len() * 4;
            }
        }
        freed
    }

    /// Records, over `texts` computed in the current precision, each dense layer's largest
    /// input per channel, from which int8 ([`Precision::Int8`], set after this) smooths the
    /// channels whose outliers would otherwise take a token's whole int8 range. Call it in f32
    /// on texts like the ones to come.
    pub fn calibrate(&self, texts: &[Tokens<'_>]) -> Result<(), FusedError> {
        self.recording.store(true, Ordering::Relaxed);
        let done = self.run(texts, |_, _| ());
        self.recording.store(false, Ordering::Relaxed);
        done.map(|_| ())
    }

    /// Embeds a batch of tokenized texts: one pooled vector per text (not normalised: that is
    /// the model's `Normalize` module, applied by the caller when the model has one).
    ///
    /// The batch runs on a thread of rayon's pool, so its dozens of parallel passes are issued
    /// from inside the pool rather than each handed over from the caller's thread; a batch of
    /// less than [`SMALL_BATCH_MACS`] multiply-adds (a tiny model, a few short texts) runs on one
    /// thread, where waking a second for each pass would cost more than it saves.
    pub fn embed(&self, texts: &[Tokens<'_>]) -> Result<Vec<Vec<f32>>, FusedError> {
        self.run(texts, |rows, skip| {
            pool(self.pooling, rows, self.dims.hidden, skip)
        })
    }

    /// The last hidden state of each text, row-major `(tokens, hidden)`: every token's row, or
    /// with `first_only` the first token's (`[CLS]`/`<s>`), which is all a sequence
    /// classifier's head reads. For the task heads that read tokens rather than a pooled vector.
    pub fn token_rows(
        &self,
        texts: &[Tokens<'_>],
        first_only: bool,
    ) -> Result<Vec<Vec<f32>>, FusedError> {
        let h = self.dims.hidden;
        self.run(texts, |rows, _| {
            if first_only {
                rows[..h].to_vec()
            } else {
                rows.to_vec()
            }
        })
    }

    /// The encoder over `texts`, then `read` on each text's rows (`len × hidden`) and its skip.
    fn run<R: Send>(
        &self,
        texts: &[Tokens<'_>],
        read: impl Fn(&[f32], usize) -> R + Sync,
    ) -> Result<Vec<R>, FusedError> {
        let d = self.dims;
        let tokens: usize = texts.iter().map(|t| t.ids.len()).sum();
        let per_token = d.layers * (4 * d.hidden * d.hidden + 2 * d.hidden * d.intermediate);
        let attention: usize =
            texts.iter().map(|t| t.ids.len().pow(2)).sum::<usize>() * 2 * d.hidden;
        let macs = tokens.saturating_mul(per_token) + attention.saturating_mul(d.layers);
        match single_thread_pool() {
            Some(pool) if macs < SMALL_BATCH_MACS => pool.install(|| self.run_here(texts, &read)),
            _ => rayon::scope(|_| self.run_here(texts, &read)),
        }
    }

    fn run_here<R: Send>(
        &self,
        texts: &[Tokens<'_>],
        read: &(impl Fn(&[f32], usize) -> R + Sync),
    ) -> Result<Vec<R>, FusedError> {
        let d = self.dims;
        let h = d.hidden;
        // Each text's (first row, length) in the batch matrix, and each row's (id, position, type).
        let mut spans = Vec::with_capacity(texts.len());
        let mut skips = Vec::with_capacity(texts.len());
        let mut rows = Vec::new();
        for t in texts {
            if t.ids.is_empty()
                || t.ids.len() + d.position_offset > d.max_positions
                || t.ids.len() != t.type_ids.len()
            {
                return Err(FusedError::Input(format!(
                    "a text of {} tokens ({} type ids) does not fit a model of {} positions",
                    t.ids.len(),
                    t.type_ids.len(),
                    d.max_positions - d.position_offset
                )));
            }
            spans.push((rows.len(), t.ids.len()));
            skips.push(t.skip);
            for (pos, (&id, &ty)) in t.ids.iter().zip(t.type_ids).enumerate() {
                let pos = pos + d.position_offset;
                // DistilBERT has no token types: its one all-zero row serves every token.
                let ty = if d.layout == Layout::DistilBert {
                    0
                } else {
                    ty
                };
                if id as usize >= d.vocab || ty as usize >= d.type_vocab {
                    return Err(FusedError::Input(format!(
                        "token id {id} or type {ty} outside the model's vocabulary"
                    )));
                }
                rows.push((id as usize, pos, ty as usize));
            }
        }
        let n = rows.len();
        let mut guard = self.scratch.lock().unwrap_or_else(PoisonError::into_inner);
        let s = &mut *guard;
        let x = grow(&mut s.x, n * h);
        let qkv = grow(&mut s.qkv, n * 3 * h);
        let ctx = grow(&mut s.ctx, n * h);
        let tmp = grow(&mut s.tmp, n * h);
        let inter = grow(&mut s.inter, n * d.intermediate);

        // Embeddings: word + position + type, then layer norm.
        x.par_chunks_mut(h)
            .zip(rows.par_iter())
            .for_each(|(row, &(id, pos, ty))| {
                let w = &self.word[id * h..][..h];
                let p = &self.position[pos * h..][..h];
                let t = &self.token_type[ty * h..][..h];
                for c in 0..h {
                    row[c] = w[c] + p[c] + t[c];
                }
                layer_norm(row, &self.emb_ln_w, &self.emb_ln_b, d.eps);
            });

        let products = AttentionProducts::beside(self.precision.format(self.widest).ok().flatten());
        for layer in &self.layers {
            // Biases are added by the pass that next reads each product (attention needs its
            // bias in place first), saving a write and a read of the product.
            let record = self.recording.load(Ordering::Relaxed);
            product(&layer.qkv_w, x, Some(&layer.qkv_b), qkv, record);
            attention(qkv, ctx, &spans, h, d.heads, products);
            product(&layer.attn_out_w, ctx, None, tmp, record);
            let (ln_w, ln_b) = (&layer.attn_ln_w, &layer.attn_ln_b);
            add_layer_norm(x, tmp, &layer.attn_out_b, ln_w, ln_b, d.eps);
            product(&layer.inter_w, x, None, inter, record);
            bias_gelu(inter, &layer.inter_b);
            product(&layer.out_w, inter, None, tmp, record);
            let (ln_w, ln_b) = (&layer.out_ln_w, &layer.out_ln_b);
            add_layer_norm(x, tmp, &layer.out_b, ln_w, ln_b, d.eps);
        }

        let x = &*x;
        Ok(spans
            .par_iter()
            .zip(skips.par_iter())
            .map(|(&(o, len), &skip)| read(&x[o * h..(o + len) * h], skip))
            .collect())
    }
}

/// Below this many multiply-adds a batch runs on one thread (a few milliseconds of work).
pub const SMALL_BATCH_MACS: usize = 8_000_000;

/// A pool of one thread for small batches (none if the thread cannot be started: the shared
/// pool then takes them).
fn single_thread_pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: std::sync::OnceLock<Option<rayon::ThreadPool>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .thread_name(|_| "encoder-small".into())
            .build()
            .ok()
    })
    .as_ref()
}

/// One text's vector from its token rows (`len × h`), as sentence-transformers pools over the
/// rows after the first `skip` (a prompt left out): the first of them for CLS (the first row when
/// none is left), otherwise their mean, maximum or sum over the square root of their count,
/// where no row at all leaves zeros (mean) or -inf (max), as its clamp and fill do.
fn pool(mode: Pooling, rows: &[f32], h: usize, skip: usize) -> Vec<f32> {
    if mode == Pooling::Cls {
        let first = if skip * h < rows.len() { skip } else { 0 };
        return rows[first * h..][..h].to_vec();
    }
    let kept = rows.get(skip * h..).unwrap_or_default();
    let count = (kept.len() / h) as f32;
    if mode == Pooling::Max {
        if kept.is_empty() {
            return vec![f32::NEG_INFINITY; h];
        }
        let mut v = kept[..h].to_vec();
        for row in kept.chunks_exact(h).skip(1) {
            for (a, b) in v.iter_mut().zip(row) {
                *a = a.max(*b);
            }
        }
        return v;
    }
    let mut v = vec![0f32; h];
    for row in kept.chunks_exact(h) {
        for (a, b) in v.iter_mut().zip(row) {
            *a += b;
        }
    }
    let count = count.max(1e-9);
    let div = if mode == Pooling::Mean {
        count
    } else {
        count.sqrt()
    };
    v.iter_mut().for_each(|a| *a /= div);
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::{attention, AttentionProducts};
    use crate::kernels::{erf, exp, linear, softmax};

    /// The products write through raw pointers: shapes that disagree must stop them in every
    /// build, not only where debug assertions are on.
    #[test]
    fn kernels_refuse_shapes_that_would_leave_their_slices() {
        let caught = |f: fn()| std::panic::catch_unwind(f).is_err();
        // x (2, 4) times w (3, 4)ᵀ fills a (2, 3) output: one too short, one bias too short.
        assert!(caught(|| linear(
            &[1.0; 8],
            4,
            &[1.0; 12],
            None,
            &mut [0.0; 5]
        )));
        assert!(caught(|| linear(
            &[1.0; 8],
            4,
            &[1.0; 12],
            Some(&[0.0; 2]),
            &mut [0.0; 6]
        )));
        assert!(caught(|| linear(
            &[1.0; 9],
            4,
            &[1.0; 12],
            None,
            &mut [0.0; 6]
        )));
        let mut out = [0.0; 6];
        linear(&[1.0; 8], 4, &[1.0; 12], Some(&[1.0; 3]), &mut out);
        assert_eq!(out, [5.0; 6]);
        // Two rows of width 4 (2 heads): a span reaching a third row is refused.
        assert!(caught(|| attention(
            &[0.0; 24],
            &mut [0.0; 8],
            &[(1, 2)],
            4,
            2,
            AttentionProducts::F32
        )));
        assert!(caught(|| attention(
            &[0.0; 24],
            &mut [0.0; 8],
            &[(0, 2)],
            4,
            3,
            AttentionProducts::F32
        )));
        let mut ctx = [0.0; 8];
        attention(
            &[1.0; 24],
            &mut ctx,
            &[(0, 2)],
            4,
            2,
            AttentionProducts::F32,
        );
        assert_eq!(ctx, [1.0; 8]);
    }

    /// A product splits into several whole-tile blocks per thread, so a preempted thread's share
    /// can be taken by the others; never past the cap, never less than a tile, and a cheap
    /// product (a tiny model's) into few blocks.
    #[test]
    fn products_split_into_whole_tiles_several_per_thread() {
        let threads = rayon::current_num_threads().max(1);
        let minilm_qkv = 384 * 1152;
        for m in [1, 5, 6, 7, 100, 1600, 100_000] {
            let rows = crate::kernels::block_rows(m, minilm_qkv, 6, 64);
            assert!(rows.is_multiple_of(6), "{m} rows: blocks of {rows}");
            assert!((6..=60).contains(&rows), "{m} rows: blocks of {rows}");
            if m >= threads * 4 * 60 {
                assert_eq!(rows, 60, "{m} rows: blocks of {rows}");
            } else if m >= 7 * threads * 4 {
                assert!(
                    m.div_ceil(rows) >= 2 * threads,
                    "{m} rows: blocks of {rows}"
                );
            }
        }
        assert_eq!(
            crate::kernels::block_rows(1600, minilm_qkv, 16, 256) % 16,
            0
        );
        // A 32-wide model's 32 × 96 product: a block holds at least 2^20 multiply-adds.
        let tiny = crate::kernels::block_rows(1600, 32 * 96, 6, 1 << 20);
        assert!(
            tiny * 32 * 96 >= 1 << 20 && tiny.is_multiple_of(6),
            "blocks of {tiny}"
        );
    }

    /// NaN stays NaN (a silently finite value would hide a broken model), infinities saturate.
    #[test]
    fn exp_of_nan_and_infinities_is_defined() {
        assert!(exp(f32::NAN).is_nan());
        assert!(exp(f32::INFINITY) > 1e38);
        assert!(exp(f32::NEG_INFINITY) < 1e-37);
    }

    #[test]
    fn exp_and_erf_match_the_standard_library() {
        for i in -2000..=2000 {
            let x = i as f32 / 100.0;
            let (want, got) = (x.exp(), exp(x));
            assert!(
                ((got - want) / want).abs() < 1e-6,
                "exp({x}) = {got}, want {want}"
            );
        }
        // erf(x) against its Taylor series where that converges fast, and known values.
        for (x, want) in [
            (0.0f32, 0.0f32),
            (0.5, 0.520_499_9),
            (1.0, 0.842_700_8),
            (-1.0, -0.842_700_8),
            (2.0, 0.995_322_3),
            (-3.0, -0.999_977_9),
        ] {
            assert!((erf(x) - want).abs() < 3e-7, "erf({x}) = {}", erf(x));
        }
    }

    const TINY: Dims = Dims {
        hidden: 8,
        heads: 2,
        intermediate: 16,
        layers: 2,
        vocab: 12,
        max_positions: 10,
        type_vocab: 2,
        eps: 1e-12,
        position_offset: 0,
        layout: Layout::Bert,
    };

    /// The tensors of a BERT of `d`'s shape, as (name, shape), in PyTorch's names.
    fn tensors(d: Dims) -> Vec<(String, Vec<usize>)> {
        let h = d.hidden;
        let mut t = vec![
            (
                "embeddings.word_embeddings.weight".to_string(),
                vec![d.vocab, h],
            ),
            (
                "embeddings.position_embeddings.weight".into(),
                vec![d.max_positions, h],
            ),
            (
                "embeddings.token_type_embeddings.weight".into(),
                vec![d.type_vocab, h],
            ),
            ("embeddings.LayerNorm.weight".into(), vec![h]),
            ("embeddings.LayerNorm.bias".into(), vec![h]),
        ];
        for i in 0..d.layers {
            let p = format!("encoder.layer.{i}.");
            for (n, shape) in [
                ("attention.self.query.weight", vec![h, h]),
                ("attention.self.query.bias", vec![h]),
                ("attention.self.key.weight", vec![h, h]),
                ("attention.self.key.bias", vec![h]),
                ("attention.self.value.weight", vec![h, h]),
                ("attention.self.value.bias", vec![h]),
                ("attention.output.dense.weight", vec![h, h]),
                ("attention.output.dense.bias", vec![h]),
                ("attention.output.LayerNorm.weight", vec![h]),
                ("attention.output.LayerNorm.bias", vec![h]),
                ("intermediate.dense.weight", vec![d.intermediate, h]),
                ("intermediate.dense.bias", vec![d.intermediate]),
                ("output.dense.weight", vec![h, d.intermediate]),
                ("output.dense.bias", vec![h]),
                ("output.LayerNorm.weight", vec![h]),
                ("output.LayerNorm.bias", vec![h]),
            ] {
                t.push((format!("{p}{n}"), shape));
            }
        }
        t
    }

    /// Writes a safetensors file of pseudo-random F32 tensors.
    fn write_model(path: &Path, tensors: &[(String, Vec<usize>)]) {
        write_model_as(path, tensors, "F32");
    }

    /// A random model stored as `dtype` (F32, F16 or BF16); the values are the same in every
    /// dtype (rounded to bf16 first, which f16 and f32 hold exactly at this range).
    fn write_model_as(path: &Path, tensors: &[(String, Vec<usize>)], dtype: &str) {
        let mut header = serde_json::Map::new();
        let mut data = Vec::new();
        let mut seed = 7u32;
        for (name, shape) in tensors {
            let begin = data.len();
            for _ in 0..shape.iter().product::<usize>() {
                seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                let v = (seed >> 8) as f32 / (1u32 << 24) as f32 - 0.5;
                let v = half::bf16::from_f32(v);
                match dtype {
                    "F16" => data.extend_from_slice(&half::f16::from_f32(v.to_f32()).to_le_bytes()),
                    "BF16" => data.extend_from_slice(&v.to_le_bytes()),
                    _ => data.extend_from_slice(&v.to_f32().to_le_bytes()),
                }
            }
            header.insert(
                name.clone(),
                serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [begin, data.len()]}),
            );
        }
        let header = serde_json::to_vec(&header).unwrap();
        let mut file = (header.len() as u64).to_le_bytes().to_vec();
        file.extend(header);
        file.extend(data);
        std::fs::write(path, file).unwrap();
    }

    fn temp_path(name: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!(
            "fused-cpu-{}-{name}.safetensors",
            std::process::id()
        ))
    }

    /// Half-precision weight files load to the same f32 weights, so the same vectors.
    #[test]
    fn f16_and_bf16_weight_files_give_the_f32_vectors() {
        let tokens = Tokens {
            ids: &[1, 3, 4, 9, 2],
            type_ids: &[0; 5],
            skip: 0,
        };
        let embed = |dtype: &str| {
            let path = temp_path(&format!("tiny-{dtype}"));
            write_model_as(&path, &tensors(TINY), dtype);
            let v = CpuBert::load(&path, TINY, Pooling::Mean)
                .unwrap()
                .embed(&[tokens])
                .unwrap();
            let _ = std::fs::remove_file(&path);
            v
        };
        let f32s = embed("F32");
        assert_eq!(embed("F16"), f32s);
        assert_eq!(embed("BF16"), f32s);
    }

    #[test]
    fn a_text_embeds_the_same_alone_and_in_any_batch() {
        let path = temp_path("tiny");
        write_model(&path, &tensors(TINY));
        let bert = CpuBert::load(&path, TINY, Pooling::Mean).unwrap();
        let texts: [&[u32]; 4] = [
            &[1, 5, 2],
            &[1, 3, 4, 9, 7, 8, 11, 2],
            &[1, 2],
            &[1, 6, 6, 6, 2],
        ];
        let types: Vec<Vec<u32>> = texts.iter().map(|t| vec![0; t.len()]).collect();
        let batch: Vec<Tokens<'_>> = texts
            .iter()
            .zip(&types)
            .map(|(ids, ty)| Tokens {
                ids,
                type_ids: ty,
                skip: 0,
            })
            .collect();
        let together = bert.embed(&batch).unwrap();
        for (i, t) in batch.iter().enumerate() {
            let alone = &bert.embed(std::slice::from_ref(t)).unwrap()[0];
            for (a, b) in alone.iter().zip(&together[i]) {
                assert!(
                    (a - b).abs() < 1e-5,
                    "text {i}: {a} alone, {b} in the batch"
                );
            }
        }
        // Different texts, different vectors.
        assert!(together[0]
            .iter()
            .zip(&together[1])
            .any(|(a, b)| (a - b).abs() > 1e-3));
        let err = bert
            .embed(&[Tokens {
                ids: &[1, 99],
                type_ids: &[0, 0],
                skip: 0,
            }])
            .unwrap_err();
        assert!(err.to_string().contains("token id 99"), "{err}");
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn weights_that_do_not_fit_the_config_are_clear_errors() {
        let path = temp_path("bad");
        let mut t = tensors(TINY);
        t.retain(|(n, _)| n != "encoder.layer.1.output.dense.bias");
        write_model(&path, &t);
        let err = CpuBert::load(&path, TINY, Pooling::Mean)
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("no tensor encoder.layer.1.output.dense.bias"),
            "{err}"
        );
        let wide = Dims {
            intermediate: 32,
            ..TINY
        };
        write_model(&path, &tensors(TINY));
        let err = CpuBert::load(&path, wide, Pooling::Mean)
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("intermediate.dense.weight") && err.contains("shape"),
            "{err}"
        );
        std::fs::write(&path, b"not a model").unwrap();
        assert!(CpuBert::load(&path, TINY, Pooling::Mean).is_err());
        std::fs::remove_file(path).unwrap();
    }

    /// Each pooling mode over three rows of width 2, with and without a skipped prompt row.
    #[test]
    fn pooling_modes_compute_what_sentence_transformers_does() {
        let rows = [1.0, -2.0, 3.0, 4.0, -1.0, 0.0];
        assert_eq!(pool(Pooling::Cls, &rows, 2, 0), [1.0, -2.0]);
        assert_eq!(pool(Pooling::Cls, &rows, 2, 2), [-1.0, 0.0]);
        assert_eq!(pool(Pooling::Cls, &rows, 2, 3), [1.0, -2.0]);
        assert_eq!(pool(Pooling::Mean, &rows, 2, 0), [1.0, 2.0 / 3.0]);
        assert_eq!(pool(Pooling::Mean, &rows, 2, 1), [1.0, 2.0]);
        assert_eq!(pool(Pooling::Max, &rows, 2, 0), [3.0, 4.0]);
        assert_eq!(pool(Pooling::Max, &rows, 2, 2), [-1.0, 0.0]);
        let s = 3f32.sqrt();
        assert_eq!(pool(Pooling::MeanSqrtLen, &rows, 2, 0), [3.0 / s, 2.0 / s]);
        // A prompt covering every token leaves nothing to pool: zeros, as the clamp gives.
        assert_eq!(pool(Pooling::Mean, &rows, 2, 3), [0.0, 0.0]);
    }

    #[test]
    fn softmax_and_layer_norm_are_normalised() {
        let mut row: Vec<f32> = (0..37).map(|i| (i as f32 * 0.7).sin() * 5.0).collect();
        softmax(&mut row);
        assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-5);
        assert!(row.iter().all(|v| *v > 0.0));
        let mut row: Vec<f32> = (0..384).map(|i| i as f32 * 0.01 - 1.0).collect();
        let ones = vec![1.0; 384];
        let zeros = vec![0.0; 384];
        layer_norm(&mut row, &ones, &zeros, 1e-12);
        let mean = row.iter().sum::<f32>() / 384.0;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / 384.0;
        assert!(
            mean.abs() < 1e-5 && (var - 1.0).abs() < 1e-4,
            "{mean} {var}"
        );
    }
}
