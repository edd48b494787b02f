//! CLIP's and ViT's image towers on the unpadded encoder's operations (issue 51, step 6). An
//! image tower is a pre-LayerNorm transformer over a fixed number of tokens a picture (its
//! patches and a class token), so a batch packs with no padding to remove; what the operations
//! save here is the launches: per layer
//!
//! 1. the Q, K and V product with its bias (the three projections' weights stacked at load);
//! 2. attention within each picture (`VarlenAttention`, every sequence the same length);
//! 3. the output product with its bias;
//! 4. the residual add and the second LayerNorm, one pass giving both (`AddNorm::keeping_sum`);
//! 5. the feed-forward's first product with its bias;
//! 6. the activation (candle's: erf-GELU for ViT, one kernel; quick GELU for CLIP, three);
//! 7. the feed-forward's second product with its bias;
//! 8. the residual add and the next layer's first LayerNorm (the last layer: the tower's final
//!    one), again one pass for both.
//!
//! The patch embedding (a convolution), the class token and positions, and the head (CLIP's
//! projection, ViT's classifier on the class token) stay candle's: they run once a batch.
//! SigLIP's tower (an attention-pooling head) and the text towers (causal, one text at a time)
//! stay on candle's implementations.

use super::ops::{AddNorm, Dense, VarlenAttention};
use candle_core::{DType, IndexOp, Module, Result, Tensor};
use candle_nn::{Activation, VarBuilder};
use candle_transformers::models::clip::text_model::Activation::QuickGelu;
use spotinfer_fused_cpu::{VisionDims, VisionLayout};

/// A feed-forward's activation, computed by the same candle code as the model's candle
/// implementation computes it.
#[derive(Debug, Clone, Copy)]
pub enum VisionAct {
    /// CLIP's `x·sigmoid(1.702·x)` (candle-transformers' CLIP activation).
    QuickGelu,
    /// One of candle-nn's (ViT's `hidden_act`).
    Candle(Activation),
}

impl Module for VisionAct {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::QuickGelu => QuickGelu.forward(x),
            Self::Candle(act) => act.forward(x),
        }
    }
}

/// One pre-LayerNorm layer; its first LayerNorm is applied by the layer before it (or the
/// embeddings), fused with that layer's last residual add.
struct Layer {
    first_norm: AddNorm,
    qkv: Dense,
    out: Dense,
    second_norm: AddNorm,
    up: Dense,
    down: Dense,
}

/// An image tower and its head on packed batches.
pub struct UnpaddedVision {
    patch: candle_nn::Conv2d,
    class: Tensor,
    positions: Tensor,
    /// CLIP's `pre_layrnorm` (ViT has none).
    pre_norm: Option<AddNorm>,
    layers: Vec<Layer>,
    final_norm: AddNorm,
    head: Dense,
    act: VisionAct,
    attention: VarlenAttention,
    /// Tokens a picture: its patches and the class token.
    tokens: usize,
}

impl UnpaddedVision {
    /// The tower of `dims` (the shape the CPU tower reads too) with a head of `outputs` (CLIP's
    /// projection width, ViT's labels) and the feed-forward's `act`, from `vb` (the model file's
    /// root), in `vb`'s dtype and on its device.
    pub fn load(dims: VisionDims, outputs: usize, act: VisionAct, vb: VarBuilder) -> Result<Self> {
        let (w, heads) = (dims.hidden, dims.heads);
        if heads == 0 || w % heads != 0 || w / heads > super::ops::MAX_HEAD_DIM {
            candle_core::bail!(
                "{heads} heads over {w}: the attention kernel takes heads of 128 at most"
            );
        }
        if w > super::ops::MAX_NORM_WIDTH {
            candle_core::bail!("a width of {w}: the LayerNorm kernel takes rows of 2048 at most");
        }
        let norm = |vb: VarBuilder| {
            candle_nn::layer_norm(w, f64::from(dims.eps), vb).and_then(|n| AddNorm::new(&n))
        };
        let tokens = (dims.image_size / dims.patch).pow(2) + 1;
        let conv = candle_nn::Conv2dConfig {
            stride: dims.patch,
            ..Default::default()
        };
        let (root, layer_names) = match dims.layout {
            VisionLayout::Clip => (vb.pp("vision_model"), LayerNames::CLIP),
            VisionLayout::Vit => (vb.pp("vit"), LayerNames::VIT),
        };
        let emb = root.pp("embeddings");
        let (patch, class, positions, pre_norm) = match dims.layout {
            VisionLayout::Clip => (
                candle_nn::conv2d_no_bias(3, w, dims.patch, conv, emb.pp("patch_embedding"))?,
                emb.get(w, "class_embedding")?,
                emb.pp("position_embedding").get((tokens, w), "weight")?,
                Some(norm(root.pp("pre_layrnorm"))?),
            ),
            VisionLayout::Vit => (
                candle_nn::conv2d(
                    3,
                    w,
                    dims.patch,
                    conv,
                    emb.pp("patch_embeddings.projection"),
                )?,
                emb.get((1, 1, w), "cls_token")?.reshape(w)?,
                emb.get((1, tokens, w), "position_embeddings")?.squeeze(0)?,
                None,
            ),
        };
        let layers = (0..dims.layers)
            .map(|i| layer_names.load(&root, i, dims, &norm))
            .collect::<Result<Vec<_>>>()?;
        let (final_norm, head) = match dims.layout {
            VisionLayout::Clip => {
                let projection = vb.pp("visual_projection").get((outputs, w), "weight")?;
                let zeros = Tensor::zeros(outputs, projection.dtype(), projection.device())?;
                (
                    norm(root.pp("post_layernorm"))?,
                    Dense {
                        weight: projection,
                        bias: zeros,
                    },
                )
            }
            VisionLayout::Vit => {
                let classifier = vb.pp("classifier");
                let head = Dense {
                    weight: classifier.get((outputs, w), "weight")?,
                    bias: classifier.get(outputs, "bias")?,
                };
                (norm(root.pp("layernorm"))?, head)
            }
        };
        Ok(Self {
            patch,
            class,
            positions,
            pre_norm,
            layers,
            final_norm,
            head,
            act,
            attention: VarlenAttention {
                heads,
                head_dim: w / heads,
                max_len: tokens,
            },
            tokens,
        })
    }

    /// The head's outputs for a batch of pictures `(n, 3, h, w)`: CLIP's projected image
    /// features, ViT's logits, `(n, outputs)` in f32.
    pub fn forward(&self, pixels: &Tensor) -> Result<Tensor> {
        let n = pixels.dim(0)?;
        let (x, mut normed) = self.embed(pixels)?;
        let mut x = x;
        let starts: Vec<u32> = (0..=n).map(|i| (i * self.tokens) as u32).collect();
        let cu_seqlens = Tensor::new(starts, pixels.device())?;
        for (i, layer) in self.layers.iter().enumerate() {
            let next = self
                .layers
                .get(i + 1)
                .map_or(&self.final_norm, |l| &l.first_norm);
            (x, normed) = self.layer(layer, &x, &normed, &cu_seqlens, next)?;
        }
        let firsts: Vec<u32> = (0..n).map(|i| (i * self.tokens) as u32).collect();
        let classes = normed.index_select(&Tensor::new(firsts, pixels.device())?, 0)?;
        self.head.forward(&classes)?.to_dtype(DType::F32)
    }

    /// The packed residual stream `(n·tokens, hidden)` entering the first layer and its first
    /// LayerNorm.
    fn embed(&self, pixels: &Tensor) -> Result<(Tensor, Tensor)> {
        let n = pixels.dim(0)?;
        let w = self.class.dim(0)?;
        let patches = self.patch.forward(&pixels.to_dtype(self.class.dtype())?)?;
        let patches = patches.flatten_from(2)?.transpose(1, 2)?;
        let class = self.class.reshape((1, 1, w))?.broadcast_as((n, 1, w))?;
        let x = Tensor::cat(&[&class, &patches], 1)?
            .broadcast_add(&self.positions)?
            .reshape((n * self.tokens, w))?;
        let zeros = x.zeros_like()?;
        let x = match &self.pre_norm {
            Some(norm) => x.apply_op2(&zeros, norm.clone())?,
            None => x,
        };
        let first = self
            .layers
            .first()
            .map_or(&self.final_norm, |l| &l.first_norm);
        let normed = x.apply_op2(&zeros, first.clone())?;
        Ok((x, normed))
    }

    /// One layer (the module comment's eight steps): the residual stream and its next
    /// LayerNorm (by `next`) after it.
    fn layer(
        &self,
        layer: &Layer,
        x: &Tensor,
        normed: &Tensor,
        cu_seqlens: &Tensor,
        next: &AddNorm,
    ) -> Result<(Tensor, Tensor)> {
        let context = layer
            .qkv
            .forward(normed)?
            .apply_op2(cu_seqlens, self.attention)?;
        let both = layer
            .out
            .forward(&context)?
            .apply_op2(x, layer.second_norm.keeping_sum())?;
        let (normed, x) = (both.i(0)?, both.i(1)?);
        let h = self.act.forward(&layer.up.forward(&normed)?)?;
        let both = layer.down.forward(&h)?.apply_op2(&x, next.keeping_sum())?;
        Ok((both.i(1)?, both.i(0)?))
    }

    /// The tower's shape, for reports: layers, width, tokens a picture.
    pub fn describe(&self) -> String {
        let width = self.class.dim(0).unwrap_or(0);
        format!(
            "{} layers x {width}, {} tokens a picture",
            self.layers.len(),
            self.tokens
        )
    }
}

/// Where a layer's weights are in the file, per architecture.
struct LayerNames {
    layers: &'static str,
    q: &'static str,
    k: &'static str,
    v: &'static str,
    out: &'static str,
    first_norm: &'static str,
    second_norm: &'static str,
    up: &'static str,
    down: &'static str,
}

impl LayerNames {
    const CLIP: Self = Self {
        layers: "encoder.layers",
        q: "self_attn.q_proj",
        k: "self_attn.k_proj",
        v: "self_attn.v_proj",
        out: "self_attn.out_proj",
        first_norm: "layer_norm1",
        second_norm: "layer_norm2",
        up: "mlp.fc1",
        down: "mlp.fc2",
    };
    const VIT: Self = Self {
        layers: "encoder.layer",
        q: "attention.attention.query",
        k: "attention.attention.key",
        v: "attention.attention.value",
        out: "attention.output.dense",
        first_norm: "layernorm_before",
        second_norm: "layernorm_after",
        up: "intermediate.dense",
        down: "output.dense",
    };

    /// Layer `i` under `root`, Q, K and V stacked into one product.
    fn load(
        &self,
        root: &VarBuilder,
        i: usize,
        dims: VisionDims,
        norm: &dyn Fn(VarBuilder) -> Result<AddNorm>,
    ) -> Result<Layer> {
        let vb = root.pp(self.layers).pp(i);
        let (w, inner) = (dims.hidden, dims.intermediate);
        let dense = |name: &str, inputs: usize, outputs: usize| -> Result<Dense> {
            let vb = vb.pp(name);
            Ok(Dense {
                weight: vb.get((outputs, inputs), "weight")?,
                bias: vb.get(outputs, "bias")?,
            })
        };
        let (q, k, v) = (
            dense(self.q, w, w)?,
            dense(self.k, w, w)?,
            dense(self.v, w, w)?,
        );
        Ok(Layer {
            first_norm: norm(vb.pp(self.first_norm))?,
            qkv: Dense {
                weight: Tensor::cat(&[&q.weight, &k.weight, &v.weight], 0)?,
                bias: Tensor::cat(&[&q.bias, &k.bias, &v.bias], 0)?,
            },
            out: dense(self.out, w, w)?,
            second_norm: norm(vb.pp(self.second_norm))?,
            up: dense(self.up, w, inner)?,
            down: dense(self.down, inner, w)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::model::engines::towers::ImageModel;
    use candle_core::{DType, Device, Tensor, Var};
    use std::path::Path;

    /// The operations between a layer's input and its outputs that compute (allocate) a
    /// tensor: a view shares its source's storage and launches nothing on a GPU.
    fn kernels(outputs: &[&Tensor], inputs: &[&Tensor]) -> usize {
        let storage = |t: &Tensor| &*t.storage_and_layout().0 as *const _ as usize;
        let mut seen: Vec<usize> = inputs.iter().map(|t| storage(t)).collect();
        let mut count = 0;
        for out in outputs {
            for node in out.sorted_nodes() {
                let s = storage(node);
                if !seen.contains(&s) {
                    seen.push(s);
                    count += 1;
                }
            }
        }
        count
    }

    /// One image-tower layer launches eight kernels with ViT's erf-GELU and ten with CLIP's
    /// quick GELU (candle computes it in three), the residual stream and the next LayerNorm
    /// coming out of one pass.
    #[test]
    fn one_tower_layer_launches_eight_kernels_and_ten_with_quick_gelu() {
        let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/images/models");
        for (name, want) in [("vit", 8), ("clip", 10)] {
            let dir = fixtures.join(name);
            let model = ImageModel::load_unpadded(&dir, &Device::Cpu, DType::F32).unwrap();
            let tower = model.unpadded().unwrap();
            let patch = tower.patch.weight().dim(2).unwrap();
            let side = ((tower.tokens - 1) as f64).sqrt() as usize * patch;
            let pixels = Tensor::randn(0f32, 1.0, (2, 3, side, side), &Device::Cpu).unwrap();
            let (x, normed) = tower.embed(&pixels).unwrap();
            let (x, normed) = (
                Var::from_tensor(&x).unwrap(),
                Var::from_tensor(&normed).unwrap(),
            );
            let starts: Vec<u32> = (0..=2).map(|i| (i * tower.tokens) as u32).collect();
            let cu = Tensor::new(starts, &Device::Cpu).unwrap();
            let layer = &tower.layers[0];
            let (next_x, next_normed) = tower
                .layer(
                    layer,
                    x.as_tensor(),
                    normed.as_tensor(),
                    &cu,
                    &tower.final_norm,
                )
                .unwrap();
            let n = kernels(
                &[&next_x, &next_normed],
                &[x.as_tensor(), normed.as_tensor(), &cu],
            );
            assert_eq!(n, want, "{name}");
        }
    }
}
