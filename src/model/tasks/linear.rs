//! One dense layer of a head (an embedding's Dense modules, a classifier's or tagger's layers),
//! in f32 on the CPU: a head reads one row per text (or per token) of a few hundred floats,
//! nothing beside the encoder's work.

use super::super::ModelError;
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device};
use std::path::Path;

/// What follows a layer's product.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    /// Nothing (an output layer, a Dense module's `Identity`).
    Identity,
    /// `tanh` (BERT's pooler, RoBERTa's classifier.dense, a Dense module's `Tanh`).
    Tanh,
    /// `max(0, x)` (DistilBERT's pre_classifier).
    Relu,
}

/// `y = act(W x (+ b))`, `W` as PyTorch stores it: `(out, in)` row-major.
#[derive(Debug, Clone)]
pub struct Linear {
    weight: Vec<f32>,
    bias: Option<Vec<f32>>,
    inputs: usize,
    act: Act,
}

impl Linear {
    /// `NAME.weight` `(out, in)` and, with `bias`, `NAME.bias` `(out)` from a weights file.
    pub fn read(
        file: &WeightsFile,
        name: &str,
        (inputs, outputs): (usize, usize),
        bias: bool,
        act: Act,
    ) -> Result<Self, ModelError> {
        let bias = bias.then(|| file.read(&format!("{name}.bias"), &[outputs]));
        Ok(Self {
            weight: file.read(&format!("{name}.weight"), &[outputs, inputs])?,
            bias: bias.transpose()?,
            inputs,
            act,
        })
    }

    /// Outputs.
    pub fn outputs(&self) -> usize {
        self.weight.len() / self.inputs
    }

    /// The layer on one input row.
    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        self.weight
            .chunks_exact(self.inputs)
            .enumerate()
            .map(|(o, row)| {
                let mut y = row.iter().zip(x).map(|(w, v)| w * v).sum::<f32>();
                if let Some(b) = &self.bias {
                    y += b[o];
                }
                match self.act {
                    Act::Identity => y,
                    Act::Tanh => y.tanh(),
                    Act::Relu => y.max(0.0),
                }
            })
            .collect()
    }
}

/// A weights file, mapped, for the few head tensors read from it.
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
            return Err(bad(format!("no tensor {name}")));
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
