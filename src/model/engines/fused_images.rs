//! The image towers of CLIP and ViT on the CPU encoder's kernels (`crates/fused-cpu`'s
//! [`CpuVision`]), with their heads: CLIP's `visual_projection`, ViT's classifier. candle's
//! vision transformer on the CPU spends much of its time outside the matrix products (a tensor
//! allocated per intermediate, separate passes for bias, activation and residual, Q, K and V
//! copied head-major); the packed kernels and fused passes compute the same function without
//! that. SigLIP (its attention-pooling head) stays on candle.

use crate::model::image::resample::Rgb8;
use crate::model::image::Processor;
use crate::model::tasks::linear::{Act, Linear, WeightsFile};
use crate::model::ModelError;
use serde_json::Value;
use spotinfer_fused_cpu::{CpuVision, Precision, VisionDims, VisionLayout};
use std::path::Path;

/// A vision tower and its head on the CPU.
pub struct FusedImages {
    tower: CpuVision,
    head: Linear,
}

impl FusedImages {
    /// The tower of `CLIPModel` or `ViTForImageClassification` in `dir`, from its parsed
    /// `config.json`, to compute in `precision` (f32, or bf16 on AVX-512 BF16); `None` for an
    /// architecture it does not compute (SigLIP).
    pub fn load(
        dir: &Path,
        config: &Value,
        precision: Precision,
    ) -> Result<Option<Self>, ModelError> {
        let Some(dims) = vision_dims(dir, config)? else {
            return Ok(None);
        };
        let layout = dims.layout;
        let path = dir.join("config.json");
        if layout == VisionLayout::Vit {
            let act = config["hidden_act"].as_str().unwrap_or("gelu");
            if act != "gelu" || config["qkv_bias"].as_bool() == Some(false) {
                return Err(ModelError::Unsupported {
                    path,
                    message: format!(
                        "ViT hidden_act {act:?} or qkv_bias false: the CPU tower computes exact GELU with biases"
                    ),
                });
            }
        }
        let weights = dir.join("model.safetensors");
        let tower = CpuVision::load(&weights, dims, precision).map_err(|e| match e {
            spotinfer_fused_cpu::FusedError::Unsupported(m) => ModelError::Precision(m),
            other => ModelError::Unsupported {
                path: weights.clone(),
                message: other.to_string(),
            },
        })?;
        let file = WeightsFile::open(&weights)?;
        let head = match layout {
            VisionLayout::Clip => {
                let projection = config["projection_dim"].as_u64().unwrap_or(512) as usize;
                Linear::read(
                    &file,
                    "visual_projection",
                    (dims.hidden, projection),
                    false,
                    Act::Identity,
                )?
            }
            VisionLayout::Vit => {
                let labels = crate::model::spec::labels(config, &path)?.len();
                Linear::read(
                    &file,
                    "classifier",
                    (dims.hidden, labels),
                    true,
                    Act::Identity,
                )?
            }
        };
        Ok(Some(Self { tower, head }))
    }

    /// Per image: CLIP's projected features, ViT's logits (as the candle towers give them).
    pub fn images(&self, pixel_values: &[&[f32]]) -> Result<Vec<Vec<f32>>, ModelError> {
        let rows = self
            .tower
            .forward(pixel_values)
            .map_err(|e| ModelError::Input(e.to_string()))?;
        Ok(rows.iter().map(|r| self.head.forward(r)).collect())
    }

    /// The lowest cosine between this tower's outputs and `reference`'s (the same model in f32)
    /// over [`probe_images`]: how far a reduced precision moved them.
    pub fn worst_cosine(&self, reference: &Self, processor: &Processor) -> Result<f32, ModelError> {
        let probes = probe_images(processor);
        let probes: Vec<&[f32]> = probes.iter().map(Vec::as_slice).collect();
        let (got, want) = (self.images(&probes)?, reference.images(&probes)?);
        Ok(got
            .iter()
            .zip(&want)
            .map(|(a, b)| crate::model::cosine(a, b))
            .fold(1.0, f32::min))
    }

    /// The tower's precision and kernels, for the model's description.
    pub fn describe(&self) -> String {
        format!("{:?} on {}", self.tower.precision(), self.tower.kernels())
    }
}

/// The image tower's shape of `CLIPModel` or `ViTForImageClassification` from its parsed
/// `config.json` in `dir`; `None` for another architecture (SigLIP). Shared by the CPU tower and
/// the unpadded one (`super::unpadded::vision`).
pub fn vision_dims(dir: &Path, config: &Value) -> Result<Option<VisionDims>, ModelError> {
    let architecture = config["architectures"][0].as_str().unwrap_or("");
    let (layout, c) = match architecture {
        "CLIPModel" => (VisionLayout::Clip, &config["vision_config"]),
        "ViTForImageClassification" => (VisionLayout::Vit, config),
        _ => return Ok(None),
    };
    let n = |k: &str| -> Result<usize, ModelError> {
        c[k].as_u64()
            .map(|v| v as usize)
            .ok_or_else(|| ModelError::Unsupported {
                path: dir.join("config.json"),
                message: format!("{architecture}: no {k}"),
            })
    };
    Ok(Some(VisionDims {
        hidden: n("hidden_size")?,
        heads: n("num_attention_heads")?,
        intermediate: n("intermediate_size")?,
        layers: n("num_hidden_layers")?,
        image_size: n("image_size")?,
        patch: n("patch_size")?,
        eps: c["layer_norm_eps"].as_f64().unwrap_or(match layout {
            VisionLayout::Clip => 1e-5,
            VisionLayout::Vit => 1e-12,
        }) as f32,
        layout,
    }))
}

/// Eight generated 320 × 240 pictures, through the model's processor: gradients, stripes,
/// checks, rings and noise in several colours, smooth and sharp. They stand in for photographs
/// (none ship with the binary) when a reduced precision is checked against f32 at load.
pub fn probe_images(processor: &Processor) -> Vec<Vec<f32>> {
    let (w, h) = (320usize, 240usize);
    let mut seed = 0x9e37_79b9_u32;
    let mut noise = move || {
        seed ^= seed << 13;
        seed ^= seed >> 17;
        seed ^= seed << 5;
        (seed >> 24) as f32
    };
    let patterns: [&dyn Fn(f32, f32, usize) -> f32; 8] = [
        &|x, y, c| (x * 255.0 * (c as f32 + 1.0) / 3.0 + y * 80.0) % 256.0,
        &|x, _, c| {
            if ((x * 24.0) as usize + c).is_multiple_of(2) {
                230.0
            } else {
                20.0
            }
        },
        &|x, y, c| (((x * 8.0) as usize + (y * 6.0) as usize + c) % 2) as f32 * 200.0 + 30.0,
        &|x, y, c| 128.0 + 120.0 * (((x - 0.5).hypot(y - 0.5) * 40.0) + c as f32).sin(),
        &|x, y, c| 128.0 + 60.0 * (x * 9.0 + c as f32).sin() + 60.0 * (y * 7.0).cos(),
        &|_, y, c| [250.0, 120.0, 10.0][c] * y,
        &|x, y, _| {
            if (x - 0.3).hypot(y - 0.6) < 0.2 {
                240.0
            } else {
                35.0
            }
        },
        &|x, y, c| [90.0, 160.0, 60.0][c] + 40.0 * (x * y * 30.0).sin(),
    ];
    patterns
        .iter()
        .enumerate()
        .filter_map(|(i, f)| {
            let mut data = Vec::with_capacity(w * h * 3);
            for py in 0..h {
                for px in 0..w {
                    let (x, y) = (px as f32 / w as f32, py as f32 / h as f32);
                    for c in 0..3 {
                        let grain = if i % 2 == 0 {
                            noise() / 16.0 - 8.0
                        } else {
                            0.0
                        };
                        data.push((f(x, y, c) + grain).clamp(0.0, 255.0) as u8);
                    }
                }
            }
            processor.pixel_values(&Rgb8 {
                width: w,
                height: h,
                data,
            })
        })
        .collect()
}
