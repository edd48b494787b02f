//! The BERT/RoBERTa encoder on candle: the CUDA backend, and on the CPU the reference the fused
//! encoder is measured against.
//!
//! Written here rather than taken from `candle_transformers::models::bert` because that model
//! cannot run in half precision: it builds the attention mask as `(1 - mask) * f32::MIN` in the
//! model's dtype, and `f32::MIN` is `-inf` in f16, so every unmasked position becomes
//! `0 * -inf = NaN`. Here the mask bias uses the dtype's own finite minimum, the matrix products
//! run in the chosen dtype (f16 on CUDA by default: tensor cores), layer norm and softmax
//! accumulate in f32 (candle's kernels do), and the caller pools in f32. Q, K and V are one
//! matrix product.

use crate::model::spec::{Architecture, EncoderSpec};
use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{Embedding, LayerNorm, Linear, VarBuilder};
use spotinfer_fused_cpu::{Layout, Pooling};

/// A loaded BERT encoder.
pub struct CandleBert {
    pub(super) words: Embedding,
    pub(super) positions: Embedding,
    pub(super) types: Embedding,
    pub(super) norm: LayerNorm,
    pub(super) layers: Vec<Layer>,
    pub(super) heads: usize,
    pub(super) position_offset: u32,
    /// False for DistilBERT, which has no token types (its one type row is zeros).
    pub(super) token_types: bool,
    pub(super) dtype: DType,
}

pub(super) struct Layer {
    pub(super) qkv: Linear,
    pub(super) attention_out: Linear,
    pub(super) attention_norm: LayerNorm,
    pub(super) intermediate: Linear,
    pub(super) output: Linear,
    pub(super) output_norm: LayerNorm,
}

impl CandleBert {
    /// Loads the weights (with or without the `bert.`/`roberta.`/`distilbert.` prefix some
    /// checkpoints carry), in the VarBuilder's dtype.
    pub fn load(vb: VarBuilder, config: &EncoderSpec) -> Result<Self> {
        let distil = config.architecture == Architecture::DistilBert;
        let prefixes: &[&str] = if distil {
            &["distilbert"]
        } else {
            &["bert", "roberta", "model"]
        };
        let vb = prefixes
            .iter()
            .map(|p| vb.pp(p))
            .find(|p| p.contains_tensor("embeddings.word_embeddings.weight"))
            .unwrap_or(vb);
        let (d, eps) = (config.hidden, config.eps);
        let emb = vb.pp("embeddings");
        let layout = if distil {
            Layout::DistilBert
        } else {
            Layout::Bert
        };
        let (stack, names) = (layout.layer_stack(), layout.layer_parts());
        let layers = (0..config.layers)
            .map(|i| Layer::load(vb.pp(format!("{stack}.{i}")), config, &names))
            .collect::<Result<Vec<_>>>()?;
        let types = if distil {
            Embedding::new(Tensor::zeros((1, d), vb.dtype(), vb.device())?, d)
        } else {
            candle_nn::embedding(config.type_vocab, d, emb.pp("token_type_embeddings"))?
        };
        Ok(Self {
            words: candle_nn::embedding(config.vocab, d, emb.pp("word_embeddings"))?,
            positions: candle_nn::embedding(
                config.max_positions,
                d,
                emb.pp("position_embeddings"),
            )?,
            types,
            norm: candle_nn::layer_norm(d, eps, emb.pp("LayerNorm"))?,
            layers,
            heads: config.heads,
            position_offset: config.position_offset as u32,
            token_types: !distil,
            dtype: vb.dtype(),
        })
    }

    /// The last hidden state `(n, len, dim)` in the model's dtype, for `ids` and `types` of shape
    /// `(n, len)` (u32) and `mask` `(n, len)` (u32, 1 for a real token, 0 for padding).
    pub fn forward(&self, ids: &Tensor, types: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let (_, len) = ids.dims2()?;
        // RoBERTa's real tokens sit at padding_idx + 1 onwards; padding's own positions do not
        // matter (padding is masked out of every real token's attention and of pooling).
        let first = self.position_offset;
        let positions = Tensor::arange(first, first + len as u32, ids.device())?.unsqueeze(0)?;
        let types = if self.token_types {
            types.clone()
        } else {
            types.zeros_like()?
        };
        let x = self
            .words
            .forward(ids)?
            .broadcast_add(&self.positions.forward(&positions)?)?
            .add(&self.types.forward(&types)?)?;
        let mut x = self.norm.forward(&x)?;
        let bias = mask_bias(mask, self.dtype)?;
        for layer in &self.layers {
            x = layer.forward(&x, &bias, self.heads)?;
        }
        Ok(x)
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        self.words.embeddings().device()
    }
}

impl Layer {
    /// One layer under `vb`, its tensors named as `names` ([`Layout::layer_parts`]).
    fn load(vb: VarBuilder, c: &EncoderSpec, names: &[&str; 8]) -> Result<Self> {
        let (d, eps) = (c.hidden, c.eps);
        let [q, k, v, ao, an, im, o, on] = names;
        let qkv = [q, k, v]
            .iter()
            .map(|n| candle_nn::linear(d, d, vb.pp(n)))
            .collect::<Result<Vec<_>>>()?;
        let weight = Tensor::cat(&qkv.iter().map(|l| l.weight()).collect::<Vec<_>>(), 0)?;
        let bias = qkv
            .iter()
            .map(|l| l.bias().cloned())
            .collect::<Option<Vec<_>>>();
        let bias = bias.map(|b| Tensor::cat(&b, 0)).transpose()?;
        Ok(Self {
            qkv: Linear::new(weight, bias),
            attention_out: candle_nn::linear(d, d, vb.pp(ao))?,
            attention_norm: candle_nn::layer_norm(d, eps, vb.pp(an))?,
            intermediate: candle_nn::linear(d, c.intermediate, vb.pp(im))?,
            output: candle_nn::linear(c.intermediate, d, vb.pp(o))?,
            output_norm: candle_nn::layer_norm(d, eps, vb.pp(on))?,
        })
    }

    fn forward(&self, x: &Tensor, bias: &Tensor, heads: usize) -> Result<Tensor> {
        let (n, len, d) = x.dims3()?;
        let head_dim = d / heads;
        // (n, len, 3d) -> (3, n, heads, len, head_dim)
        let qkv = self
            .qkv
            .forward(x)?
            .reshape((n, len, 3, heads, head_dim))?
            .permute((2, 0, 3, 1, 4))?;
        let scale = 1.0 / (head_dim as f64).sqrt();
        let q = (qkv.get(0)?.contiguous()? * scale)?;
        let k = qkv.get(1)?.contiguous()?;
        let v = qkv.get(2)?.contiguous()?;
        let scores = q.matmul(&k.t()?)?.broadcast_add(bias)?;
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        let context = probs.matmul(&v)?.transpose(1, 2)?.reshape((n, len, d))?;
        let x = self
            .attention_norm
            .forward(&(self.attention_out.forward(&context)? + x)?)?;
        let h = self.intermediate.forward(&x)?.gelu_erf()?;
        self.output_norm.forward(&(self.output.forward(&h)? + x)?)
    }
}

/// `(n, 1, 1, len)`: 0 where a token is real, the dtype's most negative finite value where it is
/// padding, so softmax gives padding zero weight without producing NaN.
fn mask_bias(mask: &Tensor, dtype: DType) -> Result<Tensor> {
    let floor = match dtype {
        DType::F16 => -65504.0,
        DType::BF16 => -3.38e38,
        _ => f32::MIN as f64,
    };
    let (n, len) = mask.dims2()?;
    let padding = (1.0 - mask.to_dtype(DType::F32)?)?;
    (padding * floor)?.to_dtype(dtype)?.reshape((n, 1, 1, len))
}

/// One vector per text of `hidden` `(n, len, dim)`, in f32, pooled as sentence-transformers
/// pools over `mask` `(n, len)` (1 for a token that is pooled: real and not a left-out prompt);
/// CLS takes each text's token at `firsts`.
pub fn pool(hidden: &Tensor, mask: &Tensor, mode: Pooling, firsts: &[usize]) -> Result<Tensor> {
    let hidden = hidden.to_dtype(DType::F32)?;
    if mode == Pooling::Cls {
        let rows = firsts
            .iter()
            .enumerate()
            .map(|(i, &t)| hidden.get(i)?.get(t))
            .collect::<Result<Vec<_>>>()?;
        return Tensor::stack(&rows, 0);
    }
    let mask = mask.to_dtype(DType::F32)?.unsqueeze(2)?; // (n, len, 1)
    if mode == Pooling::Max {
        // Left-out positions become -1e9, as sentence-transformers sets them, then the maximum.
        let floor = ((1.0 - &mask)? * -1e9)?;
        return hidden.broadcast_mul(&mask)?.broadcast_add(&floor)?.max(1);
    }
    let summed = hidden.broadcast_mul(&mask)?.sum(1)?; // (n, dim)
    let count = mask.sum(1)?.clamp(1e-9, f64::MAX)?; // (n, 1)
    match mode {
        Pooling::MeanSqrtLen => summed.broadcast_div(&count.sqrt()?),
        _ => summed.broadcast_div(&count),
    }
}
