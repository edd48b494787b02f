//! One dense layer of a task head, in f32 on the CPU: a head reads one row per text (or per
//! token) of a few hundred floats, nothing beside the encoder's work.

use super::super::ModelError;
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device};
use std::path::Path;

/// What follows a head's hidden layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    /// Nothing (the output layer).
    Identity,
    /// `tanh` (BERT's pooler, RoBERTa's classifier.dense).
    Tanh,
    /// `max(0, x)` (DistilBERT's pre_classifier).
    Relu,
}

/// `y = act(W x + b)`, `W` as PyTorch stores it: `(out, in)` row-major.
#[derive(Debug, Clone)]
pub struct Linear {
    weight: Vec<f32>,
    bias: Vec<f32>,
    inputs: usize,
    act: Act,
}

impl Linear {
    /// `NAME.weight` `(out, in)` and `NAME.bias` `(out)` from the model's weights file.
    pub fn read(
        file: &WeightsFile,
        name: &str,
        inputs: usize,
        outputs: usize,
        act: Act,
    ) -> Result<Self, ModelError> {
        Ok(Self {
            weight: file.read(&format!("{name}.weight"), &[outputs, inputs])?,
            bias: file.read(&format!("{name}.bias"), &[outputs])?,
            inputs,
            act,
        })
    }

    /// Outputs.
    pub fn outputs(&self) -> usize {
        self.bias.len()
    }

    /// The layer on one input row.
    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        self.weight
            .chunks_exact(self.inputs)
            .zip(&self.bias)
            .map(|(row, b)| {
                let y = row.iter().zip(x).map(|(w, v)| w * v).sum::<f32>() + b;
                match self.act {
                    Act::Identity => y,
                    Act::Tanh => y.tanh(),
                    Act::Relu => y.max(0.0),
                }
            })
            .collect()
    }
}

/// The model's weights file, mapped, for the few head tensors read from it.
pub struct WeightsFile<'a> {
    path: &'a Path,
    tensors: MmapedSafetensors,
}

impl<'a> WeightsFile<'a> {
    /// Maps `path`.
    pub fn open(path: &'a Path) -> Result<Self, ModelError> {
        // SAFETY: as the encoder's own loader: the model files are not written while a worker
        // loads them (the Cloud Storage cache renames complete files into place).
        let tensors = unsafe { MmapedSafetensors::new(path) }?;
        Ok(Self { path, tensors })
    }

    /// Whether the file has a tensor of this name.
    pub fn has(&self, name: &str) -> bool {
        self.tensors.get(name).is_ok()
    }

    /// The tensor `name` in f32, checked to have `shape`.
    pub fn read(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        let bad = |message: String| ModelError::Config {
            path: self.path.to_path_buf(),
            message,
        };
        if !self.has(name) {
            return Err(bad(format!("no tensor {name} (the task's head)")));
        }
        let t = self.tensors.load(name, &Device::Cpu)?;
        if t.dims() != shape {
            return Err(bad(format!(
                "{name}: shape {:?}, expected {shape:?}",
                t.dims()
            )));
        }
        Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?)
    }
}
