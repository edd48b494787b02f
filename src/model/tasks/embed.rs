//! The embedding task's head, after pooling: the model's Dense layers and its Normalize, in f32
//! on the CPU for both encoders (a pooled batch is a few kilobytes; the work is nothing beside
//! the encoder's).

use super::linear::{Act, Linear, WeightsFile};
use crate::model::spec::{Activation, DenseSpec, ModelSpec};
use crate::model::ModelError;

/// The modules after pooling.
pub struct Head {
    dense: Vec<Linear>,
    normalize: bool,
}

impl Head {
    /// Loads the Dense layers' weights.
    pub fn load(spec: &ModelSpec) -> Result<Self, ModelError> {
        let dense = spec.dense.iter().map(dense).collect::<Result<_, _>>()?;
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

/// One Dense module: `linear.weight` `(out, in)` and, where it has one, `linear.bias`.
fn dense(spec: &DenseSpec) -> Result<Linear, ModelError> {
    let act = match spec.activation {
        Activation::Identity => Act::Identity,
        Activation::Tanh => Act::Tanh,
    };
    let file = WeightsFile::open(&spec.weights)?;
    let shape = (spec.in_features, spec.out_features);
    Linear::read(&file, "linear", shape, spec.bias, act)
}
