//! The image models' networks on candle: CLIP's and SigLIP's image and text towers with their
//! projections (an image and a text land in one space), and ViT's classifier. This is the
//! engine side of images; what a record's result is (a vector, labels) is the task's.
//!
//! Each is candle-transformers' implementation, loaded from the folder's `config.json` and
//! safetensors. Where candle computes differently from transformers for some configurations,
//! those are refused at load (see [`ImageModel::load`]).

use super::fused_images::FusedImages;
use super::unpadded::vision::{UnpaddedVision, VisionAct};
use crate::model::image::Processor;
use crate::model::spec::read_json;
use crate::model::ModelError;
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::{clip, siglip, vit};
use serde_json::Value;
use spotinfer_fused_cpu::Precision;
use spotinfer_fused_cpu::VisionLayout;
use std::path::{Path, PathBuf};

/// The network of an image model folder.
enum Towers {
    Clip(clip::ClipModel),
    /// CLIP's text tower and projection alone: its image tower is an [`ImageTower`].
    ClipText(clip::text_model::ClipTextTransformer, candle_nn::Linear),
    Siglip(siglip::Model),
    Vit(vit::Model),
    /// No candle network: ViT's image tower is an [`ImageTower`].
    ImageOnly,
}

/// Which code computes CLIP's and ViT's image towers (SigLIP's and the text towers are always
/// candle-transformers').
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TowerChoice {
    /// candle-transformers' implementations.
    Candle,
    /// The CPU encoder's kernels (`super::fused_images`), in this precision.
    Fused(Precision),
    /// The unpadded encoder's operations (`super::unpadded::vision`: fused kernels on CUDA;
    /// opt-in, as the text encoder's).
    Unpadded,
}

/// An image tower computed outside candle-transformers' implementation.
enum ImageTower {
    Fused(Box<FusedImages>),
    Unpadded(UnpaddedVision),
}

/// An image model: its processor and its network, on one device.
pub struct ImageModel {
    towers: Towers,
    /// The folder's image processor.
    pub processor: Processor,
    /// ViT's labels in id order (empty for CLIP and SigLIP).
    pub labels: Vec<String>,
    /// Values per result: the projection's width (CLIP, SigLIP), the labels (ViT).
    pub dim: usize,
    /// Most tokens the text tower reads (its position embeddings; 0 without one).
    pub max_text_tokens: usize,
    /// (height, width) the network takes.
    input: (usize, usize),
    /// SigLIP's text tower reads a fixed-length sequence (its pooled output is the last
    /// position's), so texts are padded to this with the pad id; CLIP's is causal and pools at
    /// its end-of-text token, so padding is never seen.
    text_length: Option<(usize, u32)>,
    device: Device,
    /// CLIP's or ViT's image tower outside candle-transformers, when chosen ([`TowerChoice`]):
    /// images go through it rather than candle's.
    image_tower: Option<ImageTower>,
}

impl ImageModel {
    /// Loads `dir` (`config.json`, `preprocessor_config.json`, `model.safetensors`) for
    /// `CLIPModel`, `SiglipModel` or `ViTForImageClassification` in f32, refusing anything else.
    pub fn load(dir: &Path, device: &Device) -> Result<Self, ModelError> {
        Self::load_as(dir, device, DType::F32)
    }

    /// [`ImageModel::load`] with the weights in `dtype` (f16 on CUDA).
    pub fn load_as(dir: &Path, device: &Device, dtype: DType) -> Result<Self, ModelError> {
        Self::load_parts(dir, device, dtype, TowerChoice::Candle)
    }

    /// [`ImageModel::load`] on the CPU with CLIP's or ViT's image tower on the CPU encoder's
    /// kernels (`super::fused`) in `precision`, where the architecture has one; candle keeps
    /// what else the model needs (CLIP's text tower, SigLIP), so no tower is held twice.
    pub fn load_with_cpu_tower(dir: &Path, precision: Precision) -> Result<Self, ModelError> {
        Self::load_parts(dir, &Device::Cpu, DType::F32, TowerChoice::Fused(precision))
    }

    /// [`ImageModel::load_as`] with CLIP's or ViT's image tower on the unpadded encoder's
    /// operations; SigLIP is refused (its tower ends in an attention-pooling head they do not
    /// compute).
    pub fn load_unpadded(dir: &Path, device: &Device, dtype: DType) -> Result<Self, ModelError> {
        Self::load_parts(dir, device, dtype, TowerChoice::Unpadded)
    }

    /// Loads the model with its image tower computed as `choice` says.
    fn load_parts(
        dir: &Path,
        device: &Device,
        dtype: DType,
        choice: TowerChoice,
    ) -> Result<Self, ModelError> {
        let config_path = dir.join("config.json");
        let unsupported = |message: String| ModelError::Unsupported {
            path: config_path.clone(),
            message,
        };
        let config: Value = read_json(&config_path)?;
        let processor = Processor::read(dir)?;
        // The CPU tower first: its reader maps the file and lets it go before candle maps it
        // for the rest, so the two mappings never add up in the worker's peak memory.
        let mut image_tower = match choice {
            TowerChoice::Fused(p) => {
                FusedImages::load(dir, &config, p)?.map(|t| ImageTower::Fused(Box::new(t)))
            }
            _ => None,
        };
        let weights = dir.join("model.safetensors");
        // SAFETY: the file is mapped read-only and not changed while the model lives.
        let vb = unsafe {
            VarBuilder::from_mmaped_safetensors(std::slice::from_ref(&weights), dtype, device)
        }?;
        let architecture = config["architectures"][0].as_str().unwrap_or("none");
        if choice == TowerChoice::Unpadded {
            let tower = unpadded_tower(architecture, &config, &config_path, vb.clone())
                .map_err(unsupported)?;
            image_tower = Some(ImageTower::Unpadded(tower));
        }
        let own_images = image_tower.is_some();
        let (towers, labels, input, text_length, dim) = match architecture {
            "CLIPModel" => {
                let c = clip_config(&config).map_err(unsupported)?;
                let input = (c.vision_config.image_size, c.vision_config.image_size);
                let dim = c.vision_config.projection_dim;
                let towers = match own_images {
                    true => Towers::ClipText(
                        clip::text_model::ClipTextTransformer::new(
                            vb.pp("text_model"),
                            &c.text_config,
                        )?,
                        candle_nn::linear_no_bias(
                            c.text_config.embed_dim,
                            c.text_config.projection_dim,
                            vb.pp("text_projection"),
                        )?,
                    ),
                    false => Towers::Clip(clip::ClipModel::new(vb, &c)?),
                };
                (towers, vec![], input, None, dim)
            }
            "SiglipModel" => {
                let c: siglip::Config =
                    candle_config(&config, architecture).map_err(unsupported)?;
                let input = (c.vision_config.image_size, c.vision_config.image_size);
                let text = Some((
                    c.text_config.max_position_embeddings,
                    c.text_config.pad_token_id,
                ));
                let dim = c.vision_config.hidden_size;
                (
                    Towers::Siglip(siglip::Model::new(&c, vb)?),
                    vec![],
                    input,
                    text,
                    dim,
                )
            }
            "ViTForImageClassification" => {
                let c: vit::Config = candle_config(&config, architecture).map_err(unsupported)?;
                let labels = crate::model::spec::labels(&config, &config_path)?;
                let input = (c.image_size, c.image_size);
                let towers = match own_images {
                    true => Towers::ImageOnly,
                    false => Towers::Vit(vit::Model::new(&c, labels.len(), vb)?),
                };
                let dim = labels.len();
                (towers, labels, input, None, dim)
            }
            other => {
                return Err(unsupported(format!(
                    "architecture {other} is not an image model spotinfer computes \
                     (CLIPModel, SiglipModel, ViTForImageClassification)"
                )))
            }
        };
        let max_text_tokens = match &towers {
            Towers::Clip(_) | Towers::ClipText(..) => config["text_config"]
                ["max_position_embeddings"]
                .as_u64()
                .unwrap_or(77) as usize,
            Towers::Siglip(_) => text_length.map_or(0, |(n, _)| n),
            Towers::Vit(_) | Towers::ImageOnly => 0,
        };
        let model = Self {
            max_text_tokens,
            towers,
            processor,
            labels,
            dim,
            input,
            text_length,
            device: device.clone(),
            image_tower,
        };
        model.check_input(dir)?;
        Ok(model)
    }

    /// The processor must give the network's input size: a folder whose processor crops to
    /// another size would fail on every image.
    fn check_input(&self, dir: &Path) -> Result<(), ModelError> {
        let got = self.processor.output_size();
        if got != Some(self.input) {
            return Err(ModelError::Unsupported {
                path: PathBuf::from(dir).join("preprocessor_config.json"),
                message: format!(
                    "the processor gives {got:?} images; the model takes {:?}",
                    self.input
                ),
            });
        }
        Ok(())
    }

    /// The CPU tower, if in use.
    pub fn cpu_tower(&self) -> Option<&FusedImages> {
        match &self.image_tower {
            Some(ImageTower::Fused(t)) => Some(t),
            _ => None,
        }
    }

    /// The unpadded image tower, if in use.
    pub fn unpadded(&self) -> Option<&UnpaddedVision> {
        match &self.image_tower {
            Some(ImageTower::Unpadded(t)) => Some(t),
            _ => None,
        }
    }

    /// Whether the model has a text tower (CLIP, SigLIP).
    pub fn has_text(&self) -> bool {
        !matches!(self.towers, Towers::Vit(_) | Towers::ImageOnly)
    }

    /// Per image (its pixel values from [`Processor::pixel_values`]): CLIP's and SigLIP's
    /// projected image features (`get_image_features`, not normalised), ViT's logits.
    pub fn images<P: AsRef<[f32]>>(&self, pixel_values: &[P]) -> Result<Vec<Vec<f32>>, ModelError> {
        if pixel_values.is_empty() {
            return Ok(vec![]);
        }
        if let Some(ImageTower::Fused(tower)) = &self.image_tower {
            let images: Vec<&[f32]> = pixel_values.iter().map(|p| p.as_ref()).collect();
            return tower.images(&images);
        }
        let (h, w) = self.input;
        let flat: Vec<f32> = pixel_values
            .iter()
            .flat_map(|p| p.as_ref())
            .copied()
            .collect();
        if flat.len() != pixel_values.len() * 3 * h * w {
            return Err(ModelError::Input(format!(
                "pixel values for {} images of 3x{h}x{w}",
                pixel_values.len()
            )));
        }
        let x = Tensor::from_vec(flat, (pixel_values.len(), 3, h, w), &self.device)?;
        let out = match (&self.towers, &self.image_tower) {
            (_, Some(ImageTower::Unpadded(tower))) => tower.forward(&x)?,
            (Towers::Clip(m), _) => m.get_image_features(&x)?,
            (Towers::Siglip(m), _) => m.get_image_features(&x)?,
            (Towers::Vit(m), _) => m.forward(&x)?,
            (Towers::ClipText(..) | Towers::ImageOnly, _) => {
                return Err(ModelError::Input("no image tower on candle".into()))
            }
        };
        Ok(out.to_dtype(DType::F32)?.to_vec2()?)
    }

    /// Per text (its token ids, as the folder's tokenizer gives them): CLIP's and SigLIP's
    /// projected text features (`get_text_features`). One text at a time, so CLIP's pooling at
    /// the highest id (its end-of-text token: checked at load) never sees padding.
    pub fn texts(&self, ids: &[Vec<u32>]) -> Result<Vec<Vec<f32>>, ModelError> {
        let mut out = Vec::with_capacity(ids.len());
        for ids in ids {
            let mut ids = ids.clone();
            if let Some((length, pad)) = self.text_length {
                if ids.len() > length {
                    return Err(ModelError::Input(format!(
                        "{} tokens; the text tower reads {length}",
                        ids.len()
                    )));
                }
                ids.resize(length, pad);
            }
            let x = Tensor::new(ids.as_slice(), &self.device)?.unsqueeze(0)?;
            let v = match &self.towers {
                Towers::Clip(m) => m.get_text_features(&x)?,
                Towers::ClipText(m, projection) => x.apply(m)?.apply(projection)?,
                Towers::Siglip(m) => m.get_text_features(&x)?,
                Towers::Vit(_) | Towers::ImageOnly => {
                    return Err(ModelError::Input(
                        "a text record to an image classifier, which has no text tower".into(),
                    ))
                }
            };
            out.push(v.to_dtype(DType::F32)?.squeeze(0)?.to_vec1()?);
        }
        Ok(out)
    }
}

/// CLIP's or ViT's unpadded image tower in `dir` on `device`, in f32 and f16, against candle's
/// tower in f32 on the CPU over the probe pictures: the largest difference of an output,
/// relative to the largest output, within 1e-5 (f32) or 1e-2 (f16). The GPU check's image step
/// (`spotinfer models kernels` on an image model folder); on the CPU it proves the packed graph.
pub fn check_unpadded_tower(
    dir: &Path,
    device: &Device,
) -> Result<Vec<super::unpadded::check::KernelCheck>, ModelError> {
    let reference = ImageModel::load(dir, &Device::Cpu)?;
    let probes = super::fused_images::probe_images(&reference.processor);
    let want = reference.images(&probes)?;
    let scale = want.iter().flatten().fold(1e-30f32, |m, x| m.max(x.abs()));
    let mut checks = vec![];
    for (dtype, bar) in [(DType::F32, 1e-5), (DType::F16, 1e-2)] {
        let model = ImageModel::load_unpadded(dir, device, dtype)?;
        let Some(tower) = model.unpadded() else {
            return Err(ModelError::Input("no unpadded tower".into()));
        };
        let got = model.images(&probes)?;
        let largest_difference = got
            .iter()
            .flatten()
            .zip(want.iter().flatten())
            .map(|(a, b)| (a - b).abs() / scale)
            .fold(0f32, f32::max);
        let name = if model.has_text() { "clip" } else { "vit" };
        checks.push(super::unpadded::check::KernelCheck {
            op: format!("{name}-image-tower"),
            shape: format!("{} probe pictures, {}", probes.len(), tower.describe()),
            dtype: format!("{dtype:?}").to_lowercase(),
            largest_difference,
            bar,
            passed: largest_difference <= bar,
        });
    }
    Ok(checks)
}

/// CLIP's or ViT's image tower on the unpadded encoder's operations, sized from `config`.
fn unpadded_tower(
    architecture: &str,
    config: &Value,
    path: &Path,
    vb: VarBuilder,
) -> Result<UnpaddedVision, String> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let refused = format!(
        "{architecture}: the unpadded backend computes CLIP's and ViT's image towers (SigLIP's \
         ends in an attention-pooling head; use --backend candle)"
    );
    let dims = super::fused_images::vision_dims(dir, config)
        .map_err(|e| e.to_string())?
        .ok_or(refused)?;
    let (outputs, act) = match dims.layout {
        VisionLayout::Clip => {
            let c = clip_config(config)?.vision_config;
            (c.projection_dim, VisionAct::QuickGelu)
        }
        VisionLayout::Vit => {
            let c: vit::Config = candle_config(config, architecture)?;
            if !c.qkv_bias {
                return Err("ViT qkv_bias false: the unpadded tower's products have biases".into());
            }
            let labels = crate::model::spec::labels(config, path).map_err(|e| e.to_string())?;
            (labels.len(), VisionAct::Candle(c.hidden_act))
        }
    };
    UnpaddedVision::load(dims, outputs, act, vb)
        .map_err(|e| format!("the unpadded image tower: {e}"))
}

/// candle's `ClipConfig` from transformers' `config.json`, refusing what candle's CLIP computes
/// differently: its text tower always applies quick GELU and pools at the highest token id
/// (transformers pools at `eos_token_id`, the same position only where that is the highest id),
/// and both towers' layer norms use 1e-5.
fn clip_config(v: &Value) -> Result<clip::ClipConfig, String> {
    let (t, vi) = (&v["text_config"], &v["vision_config"]);
    let n = |c: &Value, k: &str| -> Result<usize, String> {
        c[k].as_u64()
            .map(|x| x as usize)
            .ok_or_else(|| format!("CLIP config: no {k}"))
    };
    for (tower, c) in [("text", t), ("vision", vi)] {
        let act = c["hidden_act"].as_str().unwrap_or("quick_gelu");
        if act != "quick_gelu" {
            return Err(format!(
                "CLIP {tower} hidden_act {act} (quick_gelu is computed)"
            ));
        }
        let eps = c["layer_norm_eps"].as_f64().unwrap_or(1e-5);
        if eps != 1e-5 {
            return Err(format!(
                "CLIP {tower} layer_norm_eps {eps} (1e-5 is computed)"
            ));
        }
    }
    let vocab = n(t, "vocab_size")?;
    let eos = t["eos_token_id"].as_u64().unwrap_or(2) as usize;
    if eos != 2 && eos + 1 != vocab {
        return Err(format!(
            "CLIP text eos_token_id {eos} is not the highest id ({}), where candle pools",
            vocab - 1
        ));
    }
    let projection = v["projection_dim"].as_u64().unwrap_or(512) as usize;
    let image_size = n(vi, "image_size")?;
    Ok(clip::ClipConfig {
        text_config: clip::text_model::ClipTextConfig {
            vocab_size: vocab,
            embed_dim: n(t, "hidden_size")?,
            activation: clip::text_model::Activation::QuickGelu,
            intermediate_size: n(t, "intermediate_size")?,
            max_position_embeddings: n(t, "max_position_embeddings")?,
            pad_with: None,
            num_hidden_layers: n(t, "num_hidden_layers")?,
            num_attention_heads: n(t, "num_attention_heads")?,
            projection_dim: projection,
        },
        vision_config: clip::vision_model::ClipVisionConfig {
            embed_dim: n(vi, "hidden_size")?,
            activation: clip::text_model::Activation::QuickGelu,
            intermediate_size: n(vi, "intermediate_size")?,
            num_hidden_layers: n(vi, "num_hidden_layers")?,
            num_attention_heads: n(vi, "num_attention_heads")?,
            projection_dim: projection,
            num_channels: vi["num_channels"].as_u64().unwrap_or(3) as usize,
            image_size,
            patch_size: n(vi, "patch_size")?,
        },
        logit_scale_init_value: 2.6592,
        image_size,
    })
}

/// A candle-transformers config read from `config.json` as is (SigLIP's and ViT's take
/// transformers' keys).
fn candle_config<T: serde::de::DeserializeOwned>(
    config: &Value,
    architecture: &str,
) -> Result<T, String> {
    T::deserialize(config).map_err(|e| format!("{architecture} config: {e}"))
}
