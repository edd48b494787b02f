//! Building a [`CpuDecoder`] from the caller's tensor reader: shapes checked, the query, key
//! and value projections stacked (and the gate and up projections), each dense layer packed
//! for the precision or left in its GGUF blocks.

use super::{inv_freq, CpuDecoder, DecoderDims, Embedding, Layer};
use crate::dense::Dense;
use crate::packed::Format;
use crate::quant::{Kernel, Weights};
use crate::{FusedError, Precision, Widest};
use std::sync::Arc;

/// How the dense layers are built: packed in a format (or f32 as read), blocks kept (for a
/// kernel) or widened.
#[derive(Clone, Copy)]
struct Plan {
    format: Option<Format>,
    keep_blocks: bool,
    kernel: Kernel,
}

impl Plan {
    /// One dense layer from its stacked parts: blocks kept where every part came in blocks and
    /// the plan keeps them, else widened, concatenated and packed.
    fn dense(self, parts: Vec<Weights>, k: usize) -> Dense {
        if self.keep_blocks && parts.iter().all(|p| matches!(p, Weights::Blocks(_))) {
            let blocks = parts.into_iter().filter_map(|p| match p {
                Weights::Blocks(m) => Some(Arc::new(m.laid_out_for(self.kernel))),
                Weights::F32(_) => None,
            });
            return Dense::blocks(blocks.collect(), self.kernel);
        }
        let mut f32 = Vec::new();
        for p in parts {
            f32.extend(p.into_f32());
        }
        Dense::packed(f32, k, self.format)
    }
}

impl CpuDecoder {
    /// Builds the decoder from `read(name, shape)`, which returns a tensor transformers names
    /// `name`, of exactly `shape`, as f32 or a GGUF block matrix, or `None` when the file has no
    /// such tensor (an optional bias). Each dense layer is packed for `precision` as it is read:
    /// f32, bf16 where the CPU has AMX or AVX-512 BF16 (refused with the reason elsewhere), or
    /// kept in its blocks ([`Precision::Gguf`]; reported as f32 when no tensor came in blocks);
    /// int8 is refused. `widest`: the dense layers run what that CPU class runs, whatever this
    /// CPU has, to compare CPU classes on one machine (as `CpuBert::limit_to`).
    pub fn load(
        dims: DecoderDims,
        precision: Precision,
        widest: Widest,
        mut read: impl FnMut(&str, &[usize]) -> Result<Option<Weights>, FusedError>,
    ) -> Result<Self, FusedError> {
        let d = dims;
        if d.heads == 0
            || d.kv_heads == 0
            || !d.heads.is_multiple_of(d.kv_heads)
            || !d.head_dim.is_multiple_of(2)
        {
            return Err(FusedError::Unsupported(format!(
                "{} query heads over {} key/value heads of width {}",
                d.heads, d.kv_heads, d.head_dim
            )));
        }
        let kernel = Kernel::within(widest);
        let plan =
            match precision {
                Precision::Int8 => return Err(FusedError::Unsupported(
                    "the decoder computes in f32, bf16 or a GGUF's blocks; int8 is not offered \
                     for generation"
                        .into(),
                )),
                Precision::Gguf => Plan {
                    format: Precision::F32
                        .format(widest)
                        .map_err(FusedError::Unsupported)?,
                    keep_blocks: true,
                    kernel,
                },
                p => Plan {
                    format: p.format(widest).map_err(FusedError::Unsupported)?,
                    keep_blocks: false,
                    kernel,
                },
            };
        let embed = required(&mut read, "model.embed_tokens.weight", &[d.vocab, d.hidden])?;
        let embed = match embed {
            Weights::Blocks(m) if plan.keep_blocks => {
                Embedding::Blocks(Arc::new(m.laid_out_for(plan.kernel)))
            }
            other => Embedding::F32(other.into_f32()),
        };
        let mut layers = Vec::with_capacity(d.layers);
        for i in 0..d.layers {
            layers.push(load_layer(&d, i, plan, &mut read)?);
        }
        let norm = required(&mut read, "model.norm.weight", &[d.hidden])?.into_f32();
        let lm_head = match (d.tied, read("lm_head.weight", &[d.vocab, d.hidden])?) {
            (false, Some(w)) => plan.dense(vec![w], d.hidden),
            _ => match &embed {
                Embedding::Blocks(m) => Dense::blocks(vec![Arc::clone(m)], plan.kernel),
                Embedding::F32(rows) => Dense::packed(rows.clone(), d.hidden, plan.format),
            },
        };
        let in_blocks = layers
            .iter()
            .flat_map(|l| [&l.qkv, &l.out, &l.gate_up, &l.down])
            .chain([&lm_head])
            .any(|dense| !dense.blocks.is_empty());
        Ok(Self {
            dims,
            precision: match precision {
                Precision::Gguf if !in_blocks => Precision::F32,
                p => p,
            },
            inv_freq: inv_freq(&d),
            lm_head,
            embed,
            layers,
            norm,
        })
    }
}

fn load_layer(
    d: &DecoderDims,
    i: usize,
    plan: Plan,
    read: &mut impl FnMut(&str, &[usize]) -> Result<Option<Weights>, FusedError>,
) -> Result<Layer, FusedError> {
    let at = |part: &str| format!("model.layers.{i}.{part}");
    let (h, q, kv) = (d.hidden, d.q_dim(), d.kv_dim());
    let mut one = |part: &str, shape: &[usize]| required(read, &at(part), shape);
    let qkv = vec![
        one("self_attn.q_proj.weight", &[q, h])?,
        one("self_attn.k_proj.weight", &[kv, h])?,
        one("self_attn.v_proj.weight", &[kv, h])?,
    ];
    let gate_up = vec![
        one("mlp.gate_proj.weight", &[d.intermediate, h])?,
        one("mlp.up_proj.weight", &[d.intermediate, h])?,
    ];
    let out = one("self_attn.o_proj.weight", &[h, q])?;
    let down = one("mlp.down_proj.weight", &[h, d.intermediate])?;
    let attn_norm = one("input_layernorm.weight", &[h])?.into_f32();
    let ffn_norm = one("post_attention_layernorm.weight", &[h])?.into_f32();
    let (q_norm, k_norm) = match d.qk_norm {
        true => (
            Some(one("self_attn.q_norm.weight", &[d.head_dim])?.into_f32()),
            Some(one("self_attn.k_norm.weight", &[d.head_dim])?.into_f32()),
        ),
        false => (None, None),
    };
    let mut optional =
        |part: &str, n: usize| read(&at(part), &[n]).map(|w| w.map(Weights::into_f32));
    let out_bias = optional("self_attn.o_proj.bias", h)?;
    let biases = [("q", q), ("k", kv), ("v", kv)]
        .map(|(p, n)| optional(&format!("self_attn.{p}_proj.bias"), n));
    let [bq, bk, bv] = biases;
    let qkv_bias = match (bq?, bk?, bv?) {
        (Some(mut b), Some(k), Some(v)) => {
            b.extend(k);
            b.extend(v);
            Some(b)
        }
        (None, None, None) => None,
        _ => {
            return Err(FusedError::Unsupported(format!(
                "layer {i}: biases on some of the query, key and value projections only"
            )))
        }
    };
    Ok(Layer {
        attn_norm,
        qkv: plan.dense(qkv, h),
        qkv_bias,
        q_norm,
        k_norm,
        out: plan.dense(vec![out], q),
        out_bias,
        ffn_norm,
        gate_up: plan.dense(gate_up, h),
        down: plan.dense(vec![down], d.intermediate),
    })
}

/// The tensor `name`, which the decoder cannot do without, checked to hold `shape`'s values.
fn required(
    read: &mut impl FnMut(&str, &[usize]) -> Result<Option<Weights>, FusedError>,
    name: &str,
    shape: &[usize],
) -> Result<Weights, FusedError> {
    let w =
        read(name, shape)?.ok_or_else(|| FusedError::Unsupported(format!("no tensor {name}")))?;
    let want: usize = shape.iter().product();
    let rows_ok = match &w {
        Weights::Blocks(m) => shape.len() == 2 && m.rows() == shape[0] && m.k() == shape[1],
        Weights::F32(v) => v.len() == want,
    };
    if !rows_ok {
        return Err(FusedError::Unsupported(format!(
            "tensor {name}: {} values, expected {shape:?}",
            w.len()
        )));
    }
    Ok(w)
}
