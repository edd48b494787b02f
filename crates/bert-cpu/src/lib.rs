//! spotinfer's BERT encoder on the CPU, written for throughput.
//!
//! candle's general-purpose BERT spends much of its CPU time outside the matrix products: it
//! pads every text to the batch's longest, allocates (and the kernel zero-fills) a fresh tensor
//! for every intermediate of every layer, runs softmax, GELU, bias and residual additions as
//! separate single-threaded passes, and copies Q, K and V into head-major layouts. This encoder
//! computes the same function (BERT, exact erf GELU, mean pooling, L2 norm) with:
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
//! The matrix products are candle's own CPU engine (the `gemm` crate) called directly. Weights
//! are read from the safetensors file straight into their final buffers (one copy in memory).

use gemm::Parallelism;
use rayon::prelude::*;
use std::cell::RefCell;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;
use std::sync::Mutex;

/// Defines a kernel twice, the portable build and one compiled for AVX2 and FMA, and picks the
/// wide one at run time when the CPU has them. The kernels are plain loops written so the
/// compiler vectorises them; this gives them 8-wide registers without raising the binary's
/// minimum CPU. Helpers they call must be `#[inline(always)]` to be compiled wide too.
macro_rules! multiversion {
    ($(#[$m:meta])* fn $name:ident($($a:ident: $t:ty),*) $body:block) => {
        $(#[$m])*
        fn $name($($a: $t),*) {
            #[inline(always)]
            fn portable($($a: $t),*) $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn wide($($a: $t),*) {
                    portable($($a),*)
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: the CPU has the features `wide` was compiled for.
                    return unsafe { wide($($a),*) };
                }
            }
            portable($($a),*)
        }
    };
}

/// Errors loading weights or running the encoder.
#[derive(Debug, thiserror::Error)]
pub enum BertError {
    /// The weights file cannot be read.
    #[error("cannot read model file {path}: {source}")]
    File {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The weights file is not the model the config describes.
    #[error("invalid weights {path}: {message}")]
    Weights {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A batch the encoder cannot take (a tokenizer for another model, say).
    #[error("invalid model input: {0}")]
    Input(String),
}

/// The shape of a BERT model, from its config.json.
#[derive(Debug, Clone, Copy)]
pub struct Dims {
    /// Hidden size.
    pub hidden: usize,
    /// Attention heads.
    pub heads: usize,
    /// Feed-forward size.
    pub intermediate: usize,
    /// Encoder layers.
    pub layers: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Position embeddings (the longest text the model can take).
    pub max_positions: usize,
    /// Token type embeddings.
    pub type_vocab: usize,
    /// Layer norm epsilon.
    pub eps: f32,
}

/// One text, tokenized.
#[derive(Debug, Clone, Copy)]
pub struct Tokens<'a> {
    /// Token ids, without padding.
    pub ids: &'a [u32],
    /// Token type ids, one per token.
    pub type_ids: &'a [u32],
}

struct Layer {
    /// Query, key and value weights stacked: `(3 * hidden, hidden)`, PyTorch's `(out, in)`.
    qkv_w: Vec<f32>,
    qkv_b: Vec<f32>,
    attn_out_w: Vec<f32>,
    attn_out_b: Vec<f32>,
    attn_ln_w: Vec<f32>,
    attn_ln_b: Vec<f32>,
    inter_w: Vec<f32>,
    inter_b: Vec<f32>,
    out_w: Vec<f32>,
    out_b: Vec<f32>,
    out_ln_w: Vec<f32>,
    out_ln_b: Vec<f32>,
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

/// A BERT encoder with mean pooling and L2 normalisation, for the CPU.
pub struct CpuBert {
    dims: Dims,
    word: Vec<f32>,
    position: Vec<f32>,
    token_type: Vec<f32>,
    emb_ln_w: Vec<f32>,
    emb_ln_b: Vec<f32>,
    layers: Vec<Layer>,
    scratch: Mutex<Scratch>,
}

impl CpuBert {
    /// Loads the weights from a safetensors file (F32, PyTorch `BertModel` names, with or without
    /// a `bert.` prefix).
    pub fn load(path: &Path, dims: Dims) -> Result<Self, BertError> {
        let mut st = SafeTensorsFile::open(path)?;
        let h = dims.hidden;
        if dims.heads == 0 || !h.is_multiple_of(dims.heads) {
            return Err(st.error(format!(
                "hidden size {h} is not a multiple of {} heads",
                dims.heads
            )));
        }
        let prefix = if st.has("embeddings.word_embeddings.weight") {
            ""
        } else {
            "bert."
        };
        let mut get = |name: &str, shape: &[usize]| st.read(&format!("{prefix}{name}"), shape);
        let word = get("embeddings.word_embeddings.weight", &[dims.vocab, h])?;
        let position = get(
            "embeddings.position_embeddings.weight",
            &[dims.max_positions, h],
        )?;
        let token_type = get(
            "embeddings.token_type_embeddings.weight",
            &[dims.type_vocab, h],
        )?;
        let emb_ln_w = get("embeddings.LayerNorm.weight", &[h])?;
        let emb_ln_b = get("embeddings.LayerNorm.bias", &[h])?;
        let mut layers = Vec::with_capacity(dims.layers);
        for i in 0..dims.layers {
            let p = format!("encoder.layer.{i}.");
            let mut qkv_w = get(&format!("{p}attention.self.query.weight"), &[h, h])?;
            qkv_w.extend(get(&format!("{p}attention.self.key.weight"), &[h, h])?);
            qkv_w.extend(get(&format!("{p}attention.self.value.weight"), &[h, h])?);
            let mut qkv_b = get(&format!("{p}attention.self.query.bias"), &[h])?;
            qkv_b.extend(get(&format!("{p}attention.self.key.bias"), &[h])?);
            qkv_b.extend(get(&format!("{p}attention.self.value.bias"), &[h])?);
            layers.push(Layer {
                qkv_w,
                qkv_b,
                attn_out_w: get(&format!("{p}attention.output.dense.weight"), &[h, h])?,
                attn_out_b: get(&format!("{p}attention.output.dense.bias"), &[h])?,
                attn_ln_w: get(&format!("{p}attention.output.LayerNorm.weight"), &[h])?,
                attn_ln_b: get(&format!("{p}attention.output.LayerNorm.bias"), &[h])?,
                inter_w: get(
                    &format!("{p}intermediate.dense.weight"),
                    &[dims.intermediate, h],
                )?,
                inter_b: get(&format!("{p}intermediate.dense.bias"), &[dims.intermediate])?,
                out_w: get(&format!("{p}output.dense.weight"), &[h, dims.intermediate])?,
                out_b: get(&format!("{p}output.dense.bias"), &[h])?,
                out_ln_w: get(&format!("{p}output.LayerNorm.weight"), &[h])?,
                out_ln_b: get(&format!("{p}output.LayerNorm.bias"), &[h])?,
            });
        }
        Ok(Self {
            dims,
            word,
            position,
            token_type,
            emb_ln_w,
            emb_ln_b,
            layers,
            scratch: Mutex::new(Scratch::default()),
        })
    }

    /// Embeds a batch of tokenized texts: one unit-length, mean-pooled vector per text.
    pub fn embed(&self, texts: &[Tokens<'_>]) -> Result<Vec<Vec<f32>>, BertError> {
        let d = self.dims;
        let h = d.hidden;
        // Each text's (first row, length) in the batch matrix, and each row's (id, position, type).
        let mut spans = Vec::with_capacity(texts.len());
        let mut rows = Vec::new();
        for t in texts {
            if t.ids.is_empty() || t.ids.len() > d.max_positions || t.ids.len() != t.type_ids.len()
            {
                return Err(BertError::Input(format!(
                    "a text of {} tokens ({} type ids) does not fit a model of {} positions",
                    t.ids.len(),
                    t.type_ids.len(),
                    d.max_positions
                )));
            }
            spans.push((rows.len(), t.ids.len()));
            for (pos, (&id, &ty)) in t.ids.iter().zip(t.type_ids).enumerate() {
                if id as usize >= d.vocab || ty as usize >= d.type_vocab {
                    return Err(BertError::Input(format!(
                        "token id {id} or type {ty} outside the model's vocabulary"
                    )));
                }
                rows.push((id as usize, pos, ty as usize));
            }
        }
        let n = rows.len();
        let mut guard = self
            .scratch
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
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

        for layer in &self.layers {
            // Biases are added by the pass that next reads each product (attention needs its
            // bias in place first), saving a write and a read of the product.
            linear(x, h, &layer.qkv_w, Some(&layer.qkv_b), qkv);
            attention(qkv, ctx, &spans, h, d.heads);
            linear(ctx, h, &layer.attn_out_w, None, tmp);
            let (ln_w, ln_b) = (&layer.attn_ln_w, &layer.attn_ln_b);
            add_layer_norm(x, tmp, &layer.attn_out_b, ln_w, ln_b, d.eps);
            linear(x, h, &layer.inter_w, None, inter);
            bias_gelu(inter, &layer.inter_b);
            linear(inter, d.intermediate, &layer.out_w, None, tmp);
            let (ln_w, ln_b) = (&layer.out_ln_w, &layer.out_ln_b);
            add_layer_norm(x, tmp, &layer.out_b, ln_w, ln_b, d.eps);
        }

        // Mean pooling over each text's tokens, then L2 normalisation.
        let x = &*x;
        Ok(spans
            .par_iter()
            .map(|&(o, len)| {
                let mut v = vec![0f32; h];
                for row in x[o * h..(o + len) * h].chunks_exact(h) {
                    for (a, b) in v.iter_mut().zip(row) {
                        *a += b;
                    }
                }
                let inv = 1.0 / len as f32;
                v.iter_mut().for_each(|a| *a *= inv);
                let norm = v.iter().map(|a| a * a).sum::<f32>().sqrt().max(1e-12);
                v.iter_mut().for_each(|a| *a /= norm);
                v
            })
            .collect())
    }
}

/// The first `len` elements of `buf`, growing it if needed (never shrinking, so a buffer is
/// allocated once per high-water mark rather than once per layer).
fn grow(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if buf.len() < len {
        buf.resize(len, 0.0);
    }
    &mut buf[..len]
}

/// `out = x · wᵀ (+ b)`, with `x` of `(rows, k)`, `w` PyTorch's `(n, k)`, `out` of `(rows, n)`.
///
/// The rows are split into one block per thread, each a single-threaded product: on two cores
/// this beats the product's own threading, which synchronises its threads inside every call.
fn linear(x: &[f32], k: usize, w: &[f32], b: Option<&[f32]>, out: &mut [f32]) {
    let n = w.len() / k;
    let m = x.len() / k;
    debug_assert_eq!(out.len(), m * n);
    let threads = rayon::current_num_threads().max(1);
    let block = m.div_ceil(threads).max(16);
    out.par_chunks_mut(block * n)
        .zip(x.par_chunks(block * k))
        .for_each(|(out, x)| linear_block(x, k, w, b, out));
}

fn linear_block(x: &[f32], k: usize, w: &[f32], b: Option<&[f32]>, out: &mut [f32]) {
    let n = w.len() / k;
    let m = x.len() / k;
    if let Some(b) = b {
        out.chunks_exact_mut(n).for_each(|r| r.copy_from_slice(b));
    }
    // SAFETY: every pointer and stride describes a matrix inside its slice: x is (m, k)
    // row-major, w read as its transpose (k, n) with strides (1, k), out (m, n) row-major.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            b.is_some(),
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            1.0,
            1.0,
            false,
            false,
            false,
            Parallelism::None,
        );
    }
}

/// A raw pointer that rayon tasks may share because each writes a disjoint region.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: see `attention`: tasks write disjoint (rows, head columns) blocks.
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// The element `offset` places in. (A method, so closures capture the whole Sync wrapper
    /// rather than its raw pointer field.)
    fn at(self, offset: usize) -> *mut f32 {
        self.0.wrapping_add(offset)
    }
}

thread_local! {
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Self-attention for every text and head, reading Q, K and V in place from the fused
/// `(rows, 3 * hidden)` projection and writing each head's context into its columns of `ctx`.
fn attention(qkv: &[f32], ctx: &mut [f32], spans: &[(usize, usize)], h: usize, heads: usize) {
    let dh = h / heads;
    let scale = 1.0 / (dh as f32).sqrt();
    let out = SharedOut(ctx.as_mut_ptr());
    let stride = 3 * h;
    // Longest texts first: they are the biggest tasks, so the pool ends evenly.
    let mut tasks: Vec<(usize, usize)> = (0..spans.len())
        .flat_map(|s| (0..heads).map(move |hd| (s, hd)))
        .collect();
    tasks.sort_by_key(|&(s, _)| std::cmp::Reverse(spans[s].1));
    tasks.par_iter().for_each(|&(s, hd)| {
        let (o, len) = spans[s];
        SCORES.with(|buf| {
            let mut buf = buf.borrow_mut();
            if buf.len() < len * len {
                buf.resize(len * len, 0.0);
            }
            let scores = &mut buf[..len * len];
            let q = qkv[o * stride + hd * dh..].as_ptr();
            let k = qkv[o * stride + h + hd * dh..].as_ptr();
            let v = qkv[o * stride + 2 * h + hd * dh..].as_ptr();
            // SAFETY: q, k and v address `len` rows of `dh` columns with row stride 3h inside
            // qkv; scores is len × len; the context block (rows o..o+len, columns of head hd)
            // lies inside ctx and no other task writes it.
            unsafe {
                gemm::gemm(
                    len,
                    len,
                    dh,
                    scores.as_mut_ptr(),
                    1,
                    len as isize,
                    false,
                    q,
                    1,
                    stride as isize,
                    k,
                    stride as isize,
                    1,
                    0.0,
                    scale,
                    false,
                    false,
                    false,
                    Parallelism::None,
                );
            }
            for row in scores.chunks_exact_mut(len) {
                softmax(row);
            }
            unsafe {
                gemm::gemm(
                    len,
                    dh,
                    len,
                    out.at(o * h + hd * dh),
                    1,
                    h as isize,
                    false,
                    scores.as_ptr(),
                    1,
                    len as isize,
                    v,
                    1,
                    stride as isize,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    Parallelism::None,
                );
            }
        });
    });
}

/// `x = layer_norm(x + add + bias)`, row by row: the residual connection, the bias of the
/// product `add`, and the layer norm in one pass.
fn add_layer_norm(x: &mut [f32], add: &[f32], bias: &[f32], w: &[f32], b: &[f32], eps: f32) {
    let h = bias.len();
    x.par_chunks_mut(h)
        .zip(add.par_chunks(h))
        .for_each(|(row, a)| add_layer_norm_row(row, a, bias, w, b, eps));
}

multiversion! {
    /// `row = layer_norm(row + add + bias)`.
    fn add_layer_norm_row(
        row: &mut [f32],
        add: &[f32],
        bias: &[f32],
        w: &[f32],
        b: &[f32],
        eps: f32
    ) {
        for ((x, a), c) in row.iter_mut().zip(add).zip(bias) {
            *x += a + c;
        }
        layer_norm_row(row, w, b, eps);
    }
}

multiversion! {
    /// Layer norm of one row in place.
    fn layer_norm(row: &mut [f32], w: &[f32], b: &[f32], eps: f32) {
        layer_norm_row(row, w, b, eps)
    }
}

/// Layer norm of one row in place, as PyTorch computes it (biased variance, two passes).
#[inline(always)]
fn layer_norm_row(row: &mut [f32], w: &[f32], b: &[f32], eps: f32) {
    let n = row.len() as f32;
    let mean = lane_sum(row) / n;
    let mut acc = [0f32; 8];
    let chunks = row.chunks_exact(8);
    let mut tail = 0.0;
    for v in chunks.remainder() {
        tail += (v - mean) * (v - mean);
    }
    for c in chunks {
        for i in 0..8 {
            acc[i] += (c[i] - mean) * (c[i] - mean);
        }
    }
    let var = (acc.iter().sum::<f32>() + tail) / n;
    let inv = 1.0 / (var + eps).sqrt();
    for ((v, w), b) in row.iter_mut().zip(w).zip(b) {
        *v = (*v - mean) * inv * w + b;
    }
}

multiversion! {
    /// Softmax of one row in place.
    fn softmax(row: &mut [f32]) {
        softmax_row(row)
    }
}

#[inline(always)]
fn softmax_row(row: &mut [f32]) {
    let mut acc = [f32::NEG_INFINITY; 8];
    let chunks = row.chunks_exact(8);
    let mut max = chunks
        .remainder()
        .iter()
        .copied()
        .fold(f32::NEG_INFINITY, f32::max);
    for c in chunks {
        for i in 0..8 {
            acc[i] = if c[i] > acc[i] { c[i] } else { acc[i] };
        }
    }
    for a in acc {
        max = max.max(a);
    }
    for v in row.iter_mut() {
        *v = exp(*v - max);
    }
    let inv = 1.0 / lane_sum(row);
    row.iter_mut().for_each(|v| *v *= inv);
}

/// Sum with eight independent accumulators, which the compiler keeps in one vector register.
#[inline(always)]
fn lane_sum(xs: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = xs.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for i in 0..8 {
            acc[i] += c[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Bias, then exact (erf) GELU in place, as BERT's `"gelu"` activation: `x/2 · (1 + erf(x/√2))`.
fn bias_gelu(xs: &mut [f32], bias: &[f32]) {
    xs.par_chunks_mut(bias.len() * 4).for_each(|rows| {
        rows.chunks_exact_mut(bias.len())
            .for_each(|row| bias_gelu_row(row, bias))
    });
}

multiversion! {
    /// GELU of one row plus its bias, in place.
    fn bias_gelu_row(xs: &mut [f32], bias: &[f32]) {
        for (v, b) in xs.iter_mut().zip(bias) {
            let x = *v + b;
            *v = 0.5 * x * (1.0 + erf(x * std::f32::consts::FRAC_1_SQRT_2));
        }
    }
}

/// erf to within 1.5e-7 (Abramowitz & Stegun 7.1.26), branch-free so it vectorises.
#[inline(always)]
fn erf(x: f32) -> f32 {
    let a = x.abs();
    let t = 1.0 / (1.0 + 0.327_591_1 * a);
    let poly = ((((1.061_405_4 * t - 1.453_152_1) * t + 1.421_413_8) * t - 0.284_496_74) * t
        + 0.254_829_6)
        * t;
    let y = 1.0 - poly * exp(-a * a);
    y.copysign(x)
}

/// e^x to about 2 ulp for the range softmax and GELU use, branch-free so it vectorises
/// (Cephes' expf: range reduction by ln 2, degree-6 polynomial, exponent bits).
#[inline(always)]
fn exp(x: f32) -> f32 {
    let x = x.clamp(-87.0, 88.0);
    // floor() without a libm call (which would stop vectorisation): truncate, then step down
    // where truncation rounded up. The clamp keeps every value in i32 range, so the unchecked
    // conversions (one instruction for eight lanes, unlike `as`, which saturates) are sound.
    let y = x * std::f32::consts::LOG2_E + 0.5;
    // SAFETY: |y| < 128.
    let t = unsafe { y.to_int_unchecked::<i32>() } as f32;
    let n = if t > y { t - 1.0 } else { t };
    let r = x - n * 0.693_359_4 + n * 2.121_944_4e-4;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let e = p * r * r + r + 1.0;
    // SAFETY: n is a whole number in [-126, 127].
    let n = unsafe { n.to_int_unchecked::<i32>() };
    e * f32::from_bits(((n + 127) as u32) << 23)
}

/// Reads tensors from a safetensors file one at a time, straight into their final buffers.
struct SafeTensorsFile {
    path: std::path::PathBuf,
    file: std::fs::File,
    header: serde_json::Map<String, serde_json::Value>,
    data_start: u64,
}

impl SafeTensorsFile {
    fn open(path: &Path) -> Result<Self, BertError> {
        let io = |source| BertError::File {
            path: path.to_path_buf(),
            source,
        };
        let mut file = std::fs::File::open(path).map_err(io)?;
        let mut len = [0u8; 8];
        file.read_exact(&mut len).map_err(io)?;
        let len = u64::from_le_bytes(len);
        let bad = |message: String| BertError::Weights {
            path: path.to_path_buf(),
            message,
        };
        if len > 100 << 20 {
            return Err(bad(format!("safetensors header of {len} bytes")));
        }
        let mut header = vec![0u8; len as usize];
        file.read_exact(&mut header).map_err(io)?;
        let header =
            serde_json::from_slice(&header).map_err(|e| bad(format!("safetensors header: {e}")))?;
        Ok(Self {
            path: path.to_path_buf(),
            file,
            header,
            data_start: 8 + len,
        })
    }

    fn error(&self, message: String) -> BertError {
        BertError::Weights {
            path: self.path.clone(),
            message,
        }
    }

    fn has(&self, name: &str) -> bool {
        self.header.contains_key(name)
    }

    fn read(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>, BertError> {
        let info = self
            .header
            .get(name)
            .ok_or_else(|| self.error(format!("no tensor {name}")))?;
        let dtype = info.get("dtype").and_then(|v| v.as_str());
        let dims: Option<Vec<usize>> = info.get("shape").and_then(|v| {
            v.as_array()?
                .iter()
                .map(|d| d.as_u64().map(|d| d as usize))
                .collect()
        });
        let offsets: Option<Vec<u64>> = info
            .get("data_offsets")
            .and_then(|v| v.as_array()?.iter().map(|d| d.as_u64()).collect());
        let (Some("F32"), Some(dims), Some(&[begin, end])) = (dtype, dims, offsets.as_deref())
        else {
            return Err(self.error(format!("tensor {name}: expected F32 with a shape")));
        };
        if dims != shape {
            return Err(self.error(format!("tensor {name}: shape {dims:?}, expected {shape:?}")));
        }
        let count: usize = shape.iter().product();
        if end - begin != 4 * count as u64 {
            return Err(self.error(format!("tensor {name}: {} bytes", end - begin)));
        }
        let mut out = vec![0f32; count];
        let io = |source| BertError::File {
            path: self.path.clone(),
            source,
        };
        self.file
            .seek(SeekFrom::Start(self.data_start + begin))
            .map_err(io)?;
        self.file.read_exact(bytemuck_bytes(&mut out)).map_err(io)?;
        if cfg!(target_endian = "big") {
            out.iter_mut()
                .for_each(|v| *v = f32::from_bits(u32::from_le(v.to_bits())));
        }
        Ok(out)
    }
}

/// The bytes of an f32 buffer, to read a file into it without a second copy.
fn bytemuck_bytes(v: &mut [f32]) -> &mut [u8] {
    // SAFETY: any bit pattern is a valid f32; the byte slice covers exactly the buffer and
    // borrows it mutably for its whole life.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let mut header = serde_json::Map::new();
        let mut data = Vec::new();
        let mut seed = 7u32;
        for (name, shape) in tensors {
            let begin = data.len();
            for _ in 0..shape.iter().product::<usize>() {
                seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                let v = (seed >> 8) as f32 / (1u32 << 24) as f32 - 0.5;
                data.extend_from_slice(&v.to_le_bytes());
            }
            header.insert(
                name.clone(),
                serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [begin, data.len()]}),
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
            "bert-cpu-{}-{name}.safetensors",
            std::process::id()
        ))
    }

    #[test]
    fn a_text_embeds_the_same_alone_and_in_any_batch() {
        let path = temp_path("tiny");
        write_model(&path, &tensors(TINY));
        let bert = CpuBert::load(&path, TINY).unwrap();
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
            .map(|(ids, ty)| Tokens { ids, type_ids: ty })
            .collect();
        let together = bert.embed(&batch).unwrap();
        for (i, t) in batch.iter().enumerate() {
            let alone = &bert.embed(std::slice::from_ref(t)).unwrap()[0];
            let norm: f32 = alone.iter().map(|x| x * x).sum::<f32>().sqrt();
            assert!((norm - 1.0).abs() < 1e-5, "not unit length: {norm}");
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
        let err = CpuBert::load(&path, TINY).err().unwrap().to_string();
        assert!(
            err.contains("no tensor encoder.layer.1.output.dense.bias"),
            "{err}"
        );
        let wide = Dims {
            intermediate: 32,
            ..TINY
        };
        write_model(&path, &tensors(TINY));
        let err = CpuBert::load(&path, wide).err().unwrap().to_string();
        assert!(
            err.contains("intermediate.dense.weight") && err.contains("shape"),
            "{err}"
        );
        std::fs::write(&path, b"not a model").unwrap();
        assert!(CpuBert::load(&path, TINY).is_err());
        std::fs::remove_file(path).unwrap();
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
