//! The embedding task's head, after pooling: the model's Dense layers and its Normalize, in f32
//! on the CPU for both encoders (a pooled batch is a few kilobytes; the work is nothing beside
//! the encoder's).

use crate::model::spec::{Activation, DenseSpec, ModelSpec};
use crate::model::ModelError;
use candle_core::{DType, Device};
use std::path::Path;

/// The modules after pooling.
pub struct Head {
    dense: Vec<Dense>,
    normalize: bool,
}

/// One Dense layer's weights, `(out, in)` row-major as PyTorch stores them.
struct Dense {
    weight: Vec<f32>,
    bias: Option<Vec<f32>>,
    inputs: usize,
    activation: Activation,
}

impl Head {
    /// Loads the Dense layers' weights.
    pub fn load(spec: &ModelSpec) -> Result<Self, ModelError> {
        let dense = spec
            .dense
            .iter()
            .map(Dense::load)
            .collect::<Result<_, _>>()?;
        Ok(Self {
            dense,
            normalize: spec.normalize,
        })
    }

    /// A pooled vector through the Dense layers, then normalised if the model normalises (as
    /// torch's `F.normalize`: divided by its norm, at least 1e-12).
    pub fn apply(&self, mut v: Vec<f32>) -> Vec<f32> {
        for d in &self.dense {
            v = d.forward(&v);
        }
        if self.normalize {
            let norm = v.iter().map(|a| a * a).sum::<f32>().sqrt().max(1e-12);
            v.iter_mut().for_each(|a| *a /= norm);
        }
        v
    }
}

impl Dense {
    fn load(spec: &DenseSpec) -> Result<Self, ModelError> {
        let tensors = candle_core::safetensors::load(&spec.weights, &Device::Cpu)?;
        let read = |name: &str, shape: &[usize]| -> Result<Vec<f32>, ModelError> {
            let t = tensors
                .get(name)
                .ok_or_else(|| config(&spec.weights, name))?;
            if t.dims() != shape {
                return Err(ModelError::Config {
                    path: spec.weights.clone(),
                    message: format!("{name}: shape {:?}, expected {shape:?}", t.dims()),
                });
            }
            Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?)
        };
        let (out, inputs) = (spec.out_features, spec.in_features);
        let weight = read("linear.weight", &[out, inputs])?;
        let bias = spec.bias.then(|| read("linear.bias", &[out])).transpose()?;
        Ok(Self {
            weight,
            bias,
            inputs,
            activation: spec.activation,
        })
    }

    fn forward(&self, x: &[f32]) -> Vec<f32> {
        self.weight
            .chunks_exact(self.inputs)
            .enumerate()
            .map(|(o, row)| {
                let mut y: f32 = row.iter().zip(x).map(|(w, v)| w * v).sum();
                if let Some(b) = &self.bias {
                    y += b[o];
                }
                match self.activation {
                    Activation::Identity => y,
                    Activation::Tanh => y.tanh(),
                }
            })
            .collect()
    }
}

fn config(path: &Path, name: &str) -> ModelError {
    ModelError::Config {
        path: path.to_path_buf(),
        message: format!("no tensor {name}"),
    }
}
