//! The image towers of CLIP and ViT on the same kernels as the text encoder: a pre-norm vision
//! transformer (patches as one product, a class token, position embeddings, then layers of
//! `x + attention(norm(x))` and `x + mlp(norm(x))`), with one fused QKV product per layer,
//! attention per (image, head) straight out of it, and no allocation per layer.
//!
//! What it returns per image is the class token's row after the final layer norm: CLIP's
//! `pooler_output` (before `visual_projection`) and the row ViT's classifier reads. The heads are
//! the caller's, a product too small to matter.

use crate::attention::{attention, AttentionProducts};
use crate::dense::Dense;
use crate::kernels::{grow, layer_norm};
use crate::weights::WeightsFile;
use crate::{FusedError, Precision, Widest};
use rayon::prelude::*;
use std::path::Path;
use std::sync::{Mutex, PoisonError};

/// Which checkpoint's names and functions: they differ in a layer norm before the encoder
/// (CLIP's `pre_layrnorm`), the activation, and the tensor names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VisionLayout {
    /// `CLIPModel`'s `vision_model.*`: no patch bias, a layer norm before the encoder, quick GELU.
    Clip,
    /// `ViTForImageClassification`'s `vit.*`: exact (erf) GELU.
    Vit,
}

/// The shape of a vision tower, from its config.
#[derive(Debug, Clone, Copy)]
pub struct VisionDims {
    /// Hidden size.
    pub hidden: usize,
    /// Attention heads.
    pub heads: usize,
    /// Feed-forward size.
    pub intermediate: usize,
    /// Encoder layers.
    pub layers: usize,
    /// Input side in pixels (square).
    pub image_size: usize,
    /// Patch side in pixels.
    pub patch: usize,
    /// Layer norm epsilon.
    pub eps: f32,
    /// Names and functions.
    pub layout: VisionLayout,
}

impl VisionDims {
    /// Patches per side.
    fn grid(&self) -> usize {
        self.image_size / self.patch
    }

    /// Rows per image: the class token and the patches.
    fn tokens(&self) -> usize {
        1 + self.grid() * self.grid()
    }
}

/// A dense layer and its bias.
type Biased = (Dense, Vec<f32>);

/// `out = x · wᵀ + b`.
fn apply((w, b): &Biased, x: &[f32], out: &mut [f32]) {
    w.apply(x, Some(b), out);
}

/// One pre-norm layer.
struct VisionLayer {
    norm1: (Vec<f32>, Vec<f32>),
    qkv: Biased,
    out: Biased,
    norm2: (Vec<f32>, Vec<f32>),
    fc1: Biased,
    fc2: Biased,
}

#[derive(Default)]
struct Scratch {
    x: Vec<f32>,
    normed: Vec<f32>,
    qkv: Vec<f32>,
    ctx: Vec<f32>,
    tmp: Vec<f32>,
    inter: Vec<f32>,
    patches: Vec<f32>,
}

/// A CLIP or ViT image tower for the CPU.
pub struct CpuVision {
    dims: VisionDims,
    patch: Biased,
    class: Vec<f32>,
    position: Vec<f32>,
    pre_norm: Option<(Vec<f32>, Vec<f32>)>,
    layers: Vec<VisionLayer>,
    post_norm: (Vec<f32>, Vec<f32>),
    precision: Precision,
    scratch: Mutex<Scratch>,
}

impl CpuVision {
    /// Loads the tower from a safetensors file, named as `dims.layout` says, to compute in
    /// `precision`: f32, bf16 (AVX-512 BF16) or int8 (weights per output column, activations per
    /// token, without the text encoder's smoothing: how close it stays to f32 depends on the
    /// model, so the caller checks). Each weight is packed for its kernel as it is read and the
    /// f32 copy dropped, so loading never holds the tower twice.
    pub fn load(path: &Path, dims: VisionDims, precision: Precision) -> Result<Self, FusedError> {
        let format = precision
            .format(Widest::All)
            .map_err(FusedError::Unsupported)?;
        let file = WeightsFile::open(path)?;
        let st = file.tensors()?;
        let (h, p) = (dims.hidden, dims.patch);
        if dims.heads == 0
            || !h.is_multiple_of(dims.heads)
            || p == 0
            || !dims.image_size.is_multiple_of(p)
        {
            return Err(st.error(format!(
                "hidden {h} in {} heads, {}-pixel images in {p}-pixel patches",
                dims.heads, dims.image_size
            )));
        }
        let names = Names::of(dims.layout);
        let get = |name: &str, shape: &[usize]| st.read(name, shape);
        let norm = |name: &str| -> Result<(Vec<f32>, Vec<f32>), FusedError> {
            Ok((
                get(&format!("{name}.weight"), &[h])?,
                get(&format!("{name}.bias"), &[h])?,
            ))
        };
        // Read as f32 (the three of Q, K and V joined first), then packed for `format`.
        let read = |name: &str, n: usize, k: usize| -> Result<(Vec<f32>, Vec<f32>), FusedError> {
            Ok((
                get(&format!("{name}.weight"), &[n, k])?,
                get(&format!("{name}.bias"), &[n])?,
            ))
        };
        let packed = |(w, b): (Vec<f32>, Vec<f32>), k: usize| (Dense::packed(w, k, format), b);
        let patch_k = 3 * p * p;
        let patch = packed(
            (
                get(&format!("{}.weight", names.patch), &[h, 3, p, p])?,
                match names.patch_bias {
                    true => get(&format!("{}.bias", names.patch), &[h])?,
                    false => vec![0.0; h],
                },
            ),
            patch_k,
        );
        let mut layers = Vec::with_capacity(dims.layers);
        for i in 0..dims.layers {
            let at = |part: &str| format!("{}.{i}.{part}", names.layer);
            let [q, k, v] = names.qkv.map(at);
            let mut qkv = read(&q, h, h)?;
            for (w, b) in [read(&k, h, h)?, read(&v, h, h)?] {
                qkv.0.extend(w);
                qkv.1.extend(b);
            }
            layers.push(VisionLayer {
                norm1: norm(&at(names.norm1))?,
                qkv: packed(qkv, h),
                out: packed(read(&at(names.out), h, h)?, h),
                norm2: norm(&at(names.norm2))?,
                fc1: packed(read(&at(names.fc1), dims.intermediate, h)?, h),
                fc2: packed(
                    read(&at(names.fc2), h, dims.intermediate)?,
                    dims.intermediate,
                ),
            });
        }
        let tokens = dims.tokens();
        Ok(Self {
            dims,
            patch,
            class: get(names.class, &names.class_shape(h))?,
            position: get(names.position, &names.position_shape(tokens, h))?,
            pre_norm: names.pre_norm.map(norm).transpose()?,
            layers,
            post_norm: norm(names.post_norm)?,
            precision,
            scratch: Mutex::new(Scratch::default()),
        })
    }

    /// The precision the dense layers compute in.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// The instructions the dense layers run on, for logs and benchmarks.
    pub fn kernels(&self) -> &'static str {
        match self.precision.format(Widest::All) {
            Ok(Some(format)) => format.kernels(),
            _ => crate::kernels::gemm_instructions(),
        }
    }

    /// The class token's final row for each image, from its pixel values (3 × side × side,
    /// channels first, as the processor gives them).
    pub fn forward(&self, images: &[&[f32]]) -> Result<Vec<Vec<f32>>, FusedError> {
        let side = self.dims.image_size;
        if let Some(bad) = images.iter().find(|i| i.len() != 3 * side * side) {
            return Err(FusedError::Input(format!(
                "{} pixel values for a 3x{side}x{side} image",
                bad.len()
            )));
        }
        rayon::scope(|_| Ok(self.run(images)))
    }

    fn run(&self, images: &[&[f32]]) -> Vec<Vec<f32>> {
        let d = self.dims;
        let (h, t, n) = (d.hidden, d.tokens(), images.len());
        let rows = n * t;
        let mut guard = self.scratch.lock().unwrap_or_else(PoisonError::into_inner);
        let s = &mut *guard;
        let patch_k = 3 * d.patch * d.patch;
        let patches = grow(&mut s.patches, n * (t - 1) * patch_k);
        patches
            .par_chunks_mut((t - 1) * patch_k)
            .zip(images.par_iter())
            .for_each(|(out, image)| self.cut_patches(image, out));
        let x = grow(&mut s.x, rows * h);
        let tmp = grow(&mut s.tmp, n * (t - 1) * h);
        apply(&self.patch, patches, tmp);
        self.embed(x, tmp, n);
        let normed = grow(&mut s.normed, rows * h);
        let qkv = grow(&mut s.qkv, rows * 3 * h);
        let ctx = grow(&mut s.ctx, rows * h);
        let tmp = grow(&mut s.tmp, rows * h);
        let inter = grow(&mut s.inter, rows * d.intermediate);
        let spans: Vec<(usize, usize)> = (0..n).map(|i| (i * t, t)).collect();
        let products = AttentionProducts::beside(self.precision.format(Widest::All).ok().flatten());
        for layer in &self.layers {
            norm_into(x, normed, &layer.norm1, d.eps);
            apply(&layer.qkv, normed, qkv);
            attention(qkv, ctx, &spans, h, d.heads, products);
            apply(&layer.out, ctx, tmp);
            add(x, tmp);
            norm_into(x, normed, &layer.norm2, d.eps);
            apply(&layer.fc1, normed, inter);
            activate(inter, d.layout);
            apply(&layer.fc2, inter, tmp);
            add(x, tmp);
        }
        (0..n)
            .map(|i| {
                let mut row = x[i * t * h..][..h].to_vec();
                layer_norm(&mut row, &self.post_norm.0, &self.post_norm.1, d.eps);
                row
            })
            .collect()
    }

    /// An image's patches as rows of `3 × patch × patch` (channel, then row, then column: the
    /// patch convolution's weight order), row-major over the grid.
    fn cut_patches(&self, image: &[f32], out: &mut [f32]) {
        let (p, side, grid) = (self.dims.patch, self.dims.image_size, self.dims.grid());
        let mut o = 0;
        for gy in 0..grid {
            for gx in 0..grid {
                for c in 0..3 {
                    for ky in 0..p {
                        let start = c * side * side + (gy * p + ky) * side + gx * p;
                        out[o..o + p].copy_from_slice(&image[start..start + p]);
                        o += p;
                    }
                }
            }
        }
    }

    /// Each image's rows: the class token, then its patches' products, plus the position
    /// embeddings, then CLIP's layer norm before the encoder.
    fn embed(&self, x: &mut [f32], patches: &[f32], n: usize) {
        let (h, t) = (self.dims.hidden, self.dims.tokens());
        x.par_chunks_mut(t * h).enumerate().for_each(|(i, image)| {
            for (r, row) in image.chunks_exact_mut(h).enumerate() {
                let from = match r {
                    0 => &self.class[..],
                    _ => &patches[(i * (t - 1) + r - 1) * h..][..h],
                };
                let pos = &self.position[r * h..][..h];
                for ((v, a), p) in row.iter_mut().zip(from).zip(pos) {
                    *v = a + p;
                }
                if let Some((w, b)) = &self.pre_norm {
                    layer_norm(row, w, b, self.dims.eps);
                }
            }
        });
        debug_assert_eq!(x.len(), n * t * h);
    }
}

/// `out = layer_norm(x)` row by row.
fn norm_into(x: &[f32], out: &mut [f32], (w, b): &(Vec<f32>, Vec<f32>), eps: f32) {
    let h = w.len();
    out.par_chunks_mut(h)
        .zip(x.par_chunks(h))
        .for_each(|(o, x)| {
            o.copy_from_slice(x);
            layer_norm(o, w, b, eps);
        });
}

/// `x += y`: the residual connection.
fn add(x: &mut [f32], y: &[f32]) {
    x.par_chunks_mut(4096)
        .zip(y.par_chunks(4096))
        .for_each(|(x, y)| x.iter_mut().zip(y).for_each(|(a, b)| *a += b));
}

/// The feed-forward activation in place: CLIP's quick GELU (`x · sigmoid(1.702 x)`), ViT's exact
/// GELU.
fn activate(xs: &mut [f32], layout: VisionLayout) {
    xs.par_chunks_mut(4096).for_each(|c| match layout {
        VisionLayout::Clip => crate::kernels::quick_gelu(c),
        VisionLayout::Vit => crate::kernels::gelu(c),
    });
}

/// A layout's tensor names.
struct Names {
    patch: &'static str,
    patch_bias: bool,
    class: &'static str,
    position: &'static str,
    pre_norm: Option<&'static str>,
    layer: &'static str,
    qkv: [&'static str; 3],
    out: &'static str,
    norm1: &'static str,
    norm2: &'static str,
    fc1: &'static str,
    fc2: &'static str,
    post_norm: &'static str,
}

impl Names {
    fn of(layout: VisionLayout) -> Self {
        match layout {
            VisionLayout::Clip => Self {
                patch: "vision_model.embeddings.patch_embedding",
                patch_bias: false,
                class: "vision_model.embeddings.class_embedding",
                position: "vision_model.embeddings.position_embedding.weight",
                pre_norm: Some("vision_model.pre_layrnorm"),
                layer: "vision_model.encoder.layers",
                qkv: ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                out: "self_attn.out_proj",
                norm1: "layer_norm1",
                norm2: "layer_norm2",
                fc1: "mlp.fc1",
                fc2: "mlp.fc2",
                post_norm: "vision_model.post_layernorm",
            },
            VisionLayout::Vit => Self {
                patch: "vit.embeddings.patch_embeddings.projection",
                patch_bias: true,
                class: "vit.embeddings.cls_token",
                position: "vit.embeddings.position_embeddings",
                pre_norm: None,
                layer: "vit.encoder.layer",
                qkv: [
                    "attention.attention.query",
                    "attention.attention.key",
                    "attention.attention.value",
                ],
                out: "attention.output.dense",
                norm1: "layernorm_before",
                norm2: "layernorm_after",
                fc1: "intermediate.dense",
                fc2: "output.dense",
                post_norm: "vit.layernorm",
            },
        }
    }

    fn class_shape(&self, h: usize) -> Vec<usize> {
        match self.patch_bias {
            true => vec![1, 1, h],
            false => vec![h],
        }
    }

    fn position_shape(&self, tokens: usize, h: usize) -> Vec<usize> {
        match self.patch_bias {
            true => vec![1, tokens, h],
            false => vec![tokens, h],
        }
    }
}
