//! The image towers of CLIP and ViT on the CPU encoder's kernels (`crates/bert-cpu`'s
//! [`CpuVision`]), with their heads: CLIP's `visual_projection`, ViT's classifier. candle's
//! vision transformer on the CPU spends much of its time outside the matrix products (a tensor
//! allocated per intermediate, separate passes for bias, activation and residual, Q, K and V
//! copied head-major); the packed kernels and fused passes compute the same function without
//! that. SigLIP (its attention-pooling head) stays on candle.

use crate::model::task::linear::{Act, Linear, WeightsFile};
use crate::model::ModelError;
use serde_json::Value;
use spotinfer_bert_cpu::{CpuVision, Precision, VisionDims, VisionLayout};
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
        let architecture = config["architectures"][0].as_str().unwrap_or("");
        let (layout, c) = match architecture {
            "CLIPModel" => (VisionLayout::Clip, &config["vision_config"]),
            "ViTForImageClassification" => (VisionLayout::Vit, config),
            _ => return Ok(None),
        };
        let path = dir.join("config.json");
        let unsupported = |message: String| ModelError::Unsupported {
            path: path.clone(),
            message,
        };
        let n = |k: &str| -> Result<usize, ModelError> {
            c[k].as_u64()
                .map(|v| v as usize)
                .ok_or_else(|| unsupported(format!("{architecture}: no {k}")))
        };
        if layout == VisionLayout::Vit {
            let act = c["hidden_act"].as_str().unwrap_or("gelu");
            if act != "gelu" || c["qkv_bias"].as_bool() == Some(false) {
                return Err(unsupported(format!(
                    "ViT hidden_act {act:?} or qkv_bias false: the CPU tower computes exact GELU with biases"
                )));
            }
        }
        let dims = VisionDims {
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
        };
        let weights = dir.join("model.safetensors");
        let tower = CpuVision::load(&weights, dims, precision).map_err(|e| match e {
            spotinfer_bert_cpu::BertError::Unsupported(m) => ModelError::Precision(m),
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

    /// The tower's precision and kernels, for the model's description.
    pub fn describe(&self) -> String {
        format!("{:?} on {}", self.tower.precision(), self.tower.kernels())
    }
}
