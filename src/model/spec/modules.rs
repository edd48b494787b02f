//! The modules after the encoder: `modules.json`'s list, the `Pooling` config in both of its
//! forms, `Dense` layers and `Normalize`.

use super::super::ModelError;
use serde_json::Value;
use spotinfer_fused_cpu::Pooling;
use std::path::{Path, PathBuf};

/// One entry of `modules.json`, by the last part of its type name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Module {
    /// The encoder, with its files in `path` (relative to the model folder; usually empty).
    Transformer(String),
    /// Pooling, configured by `path/config.json`.
    Pooling(String),
    /// A dense layer, configured and weighted in `path`.
    Dense(String),
    /// L2 normalisation.
    Normalize,
}

/// The modules a model folder lists, or, when it has no `modules.json`, what sentence-transformers
/// builds for a plain encoder folder: the encoder and mean pooling, no normalisation.
pub fn read_modules(dir: &Path) -> Result<(Vec<Module>, Option<String>), ModelError> {
    let path = dir.join("modules.json");
    if !path.is_file() {
        let note = "no modules.json: the encoder with mean pooling and no Normalize, as \
                    sentence-transformers builds for a plain encoder folder"
            .to_string();
        return Ok((vec![Module::Transformer(String::new())], Some(note)));
    }
    let list: Vec<Value> = super::read_json(&path)?;
    let refuse = |message: String| ModelError::Unsupported {
        path: path.clone(),
        message,
    };
    let mut modules = Vec::with_capacity(list.len());
    for entry in &list {
        let kind = entry.get("type").and_then(Value::as_str).unwrap_or("");
        let folder = entry
            .get("path")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        if folder.split(['/', '\\']).any(|part| part == "..") || folder.starts_with('/') {
            return Err(refuse(format!(
                "module path {folder:?} leaves the model folder"
            )));
        }
        modules.push(match kind.rsplit('.').next().unwrap_or("") {
            "Transformer" => Module::Transformer(folder),
            "Pooling" => Module::Pooling(folder),
            "Dense" => Module::Dense(folder),
            "Normalize" => Module::Normalize,
            _ => {
                return Err(refuse(format!(
                "module {kind:?}: spotinfer runs Transformer, Pooling, Dense and Normalize modules"
            )))
            }
        });
    }
    check_order(&modules).map_err(refuse)?;
    Ok((modules, None))
}

/// The one Transformer module of a task model's `modules.json` (a CrossEncoder's), or the
/// folder itself when there is no `modules.json`.
pub fn lone_transformer(dir: &Path) -> Result<Module, ModelError> {
    let path = dir.join("modules.json");
    if !path.is_file() {
        return Ok(Module::Transformer(String::new()));
    }
    let list: Vec<Value> = super::read_json(&path)?;
    let kinds: Vec<&str> = list
        .iter()
        .map(|e| e.get("type").and_then(Value::as_str).unwrap_or(""))
        .collect();
    match (list.as_slice(), kinds.as_slice()) {
        ([entry], [kind]) if kind.ends_with(".Transformer") => {
            let folder = entry.get("path").and_then(Value::as_str).unwrap_or("");
            if folder.split(['/', '\\']).any(|part| part == "..") || folder.starts_with('/') {
                return Err(ModelError::Unsupported {
                    path,
                    message: format!("module path {folder:?} leaves the model folder"),
                });
            }
            Ok(Module::Transformer(folder.to_string()))
        }
        _ => Err(ModelError::Unsupported {
            path,
            message: format!(
                "modules {kinds:?}: spotinfer runs a CrossEncoder made of one Transformer module"
            ),
        }),
    }
}

/// Transformer, then Pooling, then any Dense layers, then at most one Normalize.
fn check_order(modules: &[Module]) -> Result<(), String> {
    let rank = |m: &Module| match m {
        Module::Transformer(_) => 0,
        Module::Pooling(_) => 1,
        Module::Dense(_) => 2,
        Module::Normalize => 3,
    };
    let ranks: Vec<u8> = modules.iter().map(rank).collect();
    let ordered = ranks
        .windows(2)
        .all(|w| w[0] < w[1] || (w[0] == 2 && w[1] == 2));
    if ranks.first() != Some(&0) || ranks.get(1) != Some(&1) || !ordered {
        return Err(format!(
            "modules {ranks:?} (0 Transformer, 1 Pooling, 2 Dense, 3 Normalize): spotinfer runs \
             Transformer, Pooling, optional Dense layers and an optional Normalize, in that order"
        ));
    }
    Ok(())
}

/// What the Pooling module computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolingSpec {
    /// The mode.
    pub mode: Pooling,
    /// Whether a prompt's tokens are pooled with the text's (`include_prompt`).
    pub include_prompt: bool,
}

impl PoolingSpec {
    /// Mean pooling over every token: what sentence-transformers builds without a Pooling config.
    pub const MEAN: Self = Self {
        mode: Pooling::Mean,
        include_prompt: true,
    };

    /// The mode's name in sentence-transformers' terms.
    pub fn mode_name(&self) -> &'static str {
        match self.mode {
            Pooling::Cls => "cls",
            Pooling::Mean => "mean",
            Pooling::Max => "max",
            Pooling::MeanSqrtLen => "mean_sqrt_len_tokens",
        }
    }

    /// Reads `1_Pooling/config.json` (or wherever modules.json points): the `pooling_mode` form
    /// written by recent sentence-transformers, or the older `pooling_mode_*_tokens` booleans.
    pub fn read(path: &Path, hidden: usize) -> Result<Self, ModelError> {
        let config: Value = super::read_json(path)?;
        let refuse = |message: String| ModelError::Unsupported {
            path: path.to_path_buf(),
            message,
        };
        let modes: Vec<String> = match config.get("pooling_mode") {
            Some(Value::String(mode)) => vec![mode.clone()],
            Some(Value::Array(list)) => list
                .iter()
                .map(|m| m.as_str().map(str::to_string))
                .collect::<Option<_>>()
                .ok_or_else(|| refuse("pooling_mode holds a non-string".into()))?,
            Some(other) => return Err(refuse(format!("pooling_mode {other} is not a string"))),
            // The older booleans; none set means mean, as sentence-transformers reads them.
            None => {
                let set: Vec<String> = OLD_KEYS
                    .iter()
                    .filter(|(key, _)| config.get(*key) == Some(&Value::Bool(true)))
                    .map(|(_, mode)| mode.to_string())
                    .collect();
                if set.is_empty() {
                    vec!["mean".into()]
                } else {
                    set
                }
            }
        };
        let mode = match modes.as_slice() {
            [one] => match one.as_str() {
                "cls" => Pooling::Cls,
                "mean" => Pooling::Mean,
                "max" => Pooling::Max,
                "mean_sqrt_len_tokens" => Pooling::MeanSqrtLen,
                other => {
                    return Err(refuse(format!(
                        "pooling mode {other:?}: spotinfer pools with cls, mean, max or mean_sqrt_len_tokens"
                    )))
                }
            },
            [] => return Err(refuse("no pooling mode is set".into())),
            many => {
                return Err(refuse(format!(
                    "pooling modes {many:?} together (concatenated): spotinfer pools with one mode"
                )))
            }
        };
        if let Some(dim) = config
            .get("word_embedding_dimension")
            .and_then(Value::as_u64)
        {
            if dim as usize != hidden {
                return Err(ModelError::Config {
                    path: path.to_path_buf(),
                    message: format!(
                        "word_embedding_dimension {dim} differs from the encoder's hidden size {hidden}"
                    ),
                });
            }
        }
        let include_prompt = config
            .get("include_prompt")
            .and_then(Value::as_bool)
            .unwrap_or(true);
        Ok(Self {
            mode,
            include_prompt,
        })
    }
}

/// The older boolean keys and the mode each turns on.
const OLD_KEYS: [(&str, &str); 6] = [
    ("pooling_mode_cls_token", "cls"),
    ("pooling_mode_max_tokens", "max"),
    ("pooling_mode_mean_tokens", "mean"),
    ("pooling_mode_mean_sqrt_len_tokens", "mean_sqrt_len_tokens"),
    ("pooling_mode_weightedmean_tokens", "weightedmean"),
    ("pooling_mode_lasttoken", "lasttoken"),
];

/// A Dense module's activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `torch.nn.Identity`.
    Identity,
    /// `torch.nn.Tanh` (sentence-transformers' default).
    Tanh,
}

/// A Dense module: `activation(W x + b)`.
#[derive(Debug, Clone)]
pub struct DenseSpec {
    /// Its weights file.
    pub weights: PathBuf,
    /// Input width.
    pub in_features: usize,
    /// Output width.
    pub out_features: usize,
    /// Whether it adds a bias.
    pub bias: bool,
    /// Its activation.
    pub activation: Activation,
}

impl DenseSpec {
    /// Reads `DIR/config.json` and finds `DIR/model.safetensors`.
    pub fn read(dir: &Path) -> Result<Self, ModelError> {
        let path = dir.join("config.json");
        let config: Value = super::read_json(&path)?;
        let refuse = |message: String| ModelError::Unsupported {
            path: path.clone(),
            message,
        };
        let size = |key: &str| super::positive(&config, key, &path);
        let activation = match config
            .get("activation_function")
            .and_then(Value::as_str)
            .unwrap_or("torch.nn.modules.activation.Tanh")
            .rsplit('.')
            .next()
            .unwrap_or_default()
        {
            "Tanh" => Activation::Tanh,
            "Identity" => Activation::Identity,
            other => {
                return Err(refuse(format!(
                    "Dense activation {other:?}: spotinfer implements Tanh and Identity"
                )))
            }
        };
        let weights = super::weights_file(dir)?;
        Ok(Self {
            weights,
            in_features: size("in_features")?,
            out_features: size("out_features")?,
            bias: config.get("bias").and_then(Value::as_bool).unwrap_or(true),
            activation,
        })
    }
}
