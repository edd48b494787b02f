//! What a sentence-transformers model folder says to compute, read and checked before a weight
//! is loaded.
//!
//! The model's own files decide everything: `modules.json` (Transformer → Pooling → Dense… →
//! Normalize), `config.json` (the encoder), `1_Pooling/config.json` (either form),
//! `sentence_bert_config.json` (`max_seq_length`, `do_lower_case`),
//! `config_sentence_transformers.json` (prompts), `tokenizer_config.json` (`model_max_length`,
//! `truncation_side`) and `tokenizer.json`. What spotinfer cannot compute exactly is refused here
//! with the reason, so a model either gives sentence-transformers' vectors or never starts.

mod encoder;
mod modules;
mod task;

pub use encoder::{Architecture, EncoderSpec};
pub use modules::{Activation, DenseSpec, PoolingSpec};
pub(crate) use task::{classification_function, labels};
pub use task::{ScoreFunction, Task, TaskSpec};

use super::ModelError;
use modules::Module;
use serde_json::Value;
use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

/// Everything spotinfer computes for a model, from its files.
#[derive(Debug, Clone)]
pub struct ModelSpec {
    /// The model folder.
    pub dir: PathBuf,
    /// What the model computes for a record (embed, classify, score pairs, tag tokens).
    pub task: TaskSpec,
    /// The encoder's folder (the Transformer module's path, usually the model folder itself).
    pub encoder_dir: PathBuf,
    /// The encoder.
    pub encoder: EncoderSpec,
    /// The encoder's weights file.
    pub weights: PathBuf,
    /// Tensor dtypes in the encoder's weights file (`F32`, `F16`, `BF16`).
    pub weight_dtypes: Vec<String>,
    /// Tokens kept per text (prompt and special tokens included).
    pub max_seq_len: usize,
    /// Whether texts are lowercased before tokenizing (`do_lower_case` in an older
    /// `sentence_bert_config.json`; newer sentence-transformers writes a `Lowercase` normalizer
    /// into `tokenizer.json` instead).
    pub do_lower_case: bool,
    /// Whether the tokenizer cuts from the left (`truncation_side: left`).
    pub truncate_left: bool,
    /// Pooling.
    pub pooling: PoolingSpec,
    /// Dense layers, in order.
    pub dense: Vec<DenseSpec>,
    /// Whether vectors are L2-normalised last.
    pub normalize: bool,
    /// Named prompts (`config_sentence_transformers.json`).
    pub prompts: BTreeMap<String, String>,
    /// The prompt applied when none is asked for.
    pub default_prompt_name: Option<String>,
    /// What the folder left to defaults, said by `models check`.
    pub notes: Vec<String>,
}

impl ModelSpec {
    /// Reads and checks every file of the model in `dir`.
    pub fn read(dir: &Path) -> Result<Self, ModelError> {
        let task = TaskSpec::read(dir)?;
        // A task model is its encoder and its head: no Pooling, Dense or Normalize modules.
        let (modules, note) = match task.task {
            Task::Embed => modules::read_modules(dir)?,
            _ => (vec![modules::lone_transformer(dir)?], None),
        };
        let mut notes: Vec<String> = note.into_iter().collect();
        let folder = |p: &str| dir.join(p);
        let encoder_dir = match &modules[0] {
            Module::Transformer(p) => folder(p),
            _ => dir.to_path_buf(),
        };
        let encoder = EncoderSpec::read(&encoder_dir.join("config.json"))?;
        let weights = weights_file(&encoder_dir)?;
        let weight_dtypes = safetensors_dtypes(&weights)?;
        let mut pooling = PoolingSpec::MEAN;
        let (mut dense, mut normalize) = (Vec::new(), false);
        for m in &modules[1..] {
            match m {
                Module::Pooling(p) => {
                    pooling = PoolingSpec::read(&folder(p).join("config.json"), encoder.hidden)?
                }
                Module::Dense(p) => dense.push(DenseSpec::read(&folder(p))?),
                Module::Normalize => normalize = true,
                Module::Transformer(_) => {}
            }
        }
        check_dense_widths(&dense, encoder.hidden, dir)?;
        let st_path = encoder_dir.join("sentence_bert_config.json");
        let st = read_optional(&st_path)?;
        let expected = match task.task {
            Task::Embed => "feature-extraction",
            _ => "sequence-classification",
        };
        if let Some(found) = st.get("transformer_task").and_then(Value::as_str) {
            if found != expected {
                return Err(ModelError::Unsupported {
                    path: st_path,
                    message: format!(
                        "transformer_task {found:?}: spotinfer runs a {} model's Transformer as \"{expected}\"",
                        task.task.name()
                    ),
                });
            }
        }
        let tok = read_optional(&encoder_dir.join("tokenizer_config.json"))?;
        let max_seq_len = max_seq_len(&st, &tok, &encoder, &mut notes);
        let (prompts, default_prompt_name) = prompts(dir)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            task,
            encoder_dir,
            weights,
            weight_dtypes,
            max_seq_len,
            do_lower_case: st.get("do_lower_case").and_then(Value::as_bool) == Some(true),
            truncate_left: tok.get("truncation_side").and_then(Value::as_str) == Some("left"),
            pooling,
            dense,
            normalize,
            prompts,
            default_prompt_name,
            notes,
            encoder,
        })
    }

    /// The width of the vectors the model produces (0 for a task that produces none).
    pub fn dim(&self) -> usize {
        if self.task.task != Task::Embed {
            return 0;
        }
        self.dense
            .last()
            .map_or(self.encoder.hidden, |d| d.out_features)
    }

    /// Every weights file, in module order: what the model's content hash covers.
    pub fn weight_files(&self) -> Vec<&Path> {
        let dense = self.dense.iter().map(|d| d.weights.as_path());
        std::iter::once(self.weights.as_path())
            .chain(dense)
            .collect()
    }
}

impl fmt::Display for ModelSpec {
    /// What `spotinfer models check` prints.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let e = &self.encoder;
        writeln!(f, "model:          {}", self.dir.display())?;
        writeln!(
            f,
            "task:           {} ({})",
            self.task.task.name(),
            self.task.source
        )?;
        if !self.task.labels.is_empty() {
            writeln!(f, "labels:         {}", self.task.labels.join(", "))?;
            if self.task.task != Task::Tag {
                writeln!(f, "scores:         {:?} of the logits", self.task.function)?;
            }
        }
        writeln!(
            f,
            "architecture:   {} ({} layers, hidden {}, {} heads, feed-forward {}, vocabulary {})",
            e.architecture.name(),
            e.layers,
            e.hidden,
            e.heads,
            e.intermediate,
            e.vocab
        )?;
        writeln!(f, "weights:        {}", self.weight_dtypes.join(", "))?;
        writeln!(
            f,
            "max tokens:     {} (positions {}, first position {})",
            self.max_seq_len, e.max_positions, e.position_offset
        )?;
        writeln!(f, "lowercase:      {}", self.do_lower_case)?;
        if self.task.task != Task::Embed {
            return self
                .notes
                .iter()
                .try_for_each(|n| writeln!(f, "note:           {n}"));
        }
        let prompt = if self.pooling.include_prompt {
            "prompt pooled"
        } else {
            "prompt left out"
        };
        writeln!(f, "pooling:        {} ({prompt})", self.pooling.mode_name())?;
        for d in &self.dense {
            writeln!(
                f,
                "dense:          {} -> {}, bias {}, {:?}",
                d.in_features, d.out_features, d.bias, d.activation
            )?;
        }
        writeln!(f, "normalize:      {}", self.normalize)?;
        writeln!(f, "dimension:      {}", self.dim())?;
        for (name, text) in &self.prompts {
            let default = if self.default_prompt_name.as_deref() == Some(name) {
                " (default)"
            } else {
                ""
            };
            writeln!(f, "prompt:         {name} = {text:?}{default}")?;
        }
        for note in &self.notes {
            writeln!(f, "note:           {note}")?;
        }
        Ok(())
    }
}

/// The files of a model folder spotinfer reads: what to copy from a bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelFiles {
    /// Files a model cannot load without.
    pub required: Vec<String>,
    /// Files read when present.
    pub optional: Vec<String>,
}

/// The files the model in `dir` needs, from its `modules.json` if `dir` has one (without it, or
/// with one that cannot be read, the plain layout: loading then says what is wrong).
pub fn model_files(dir: &Path) -> ModelFiles {
    let modules = modules::read_modules(dir)
        .map(|(m, _)| m)
        .unwrap_or_else(|_| vec![Module::Transformer(String::new())]);
    let at = |folder: &str, file: &str| {
        if folder.is_empty() {
            file.to_string()
        } else {
            format!("{}/{file}", folder.trim_end_matches('/'))
        }
    };
    let mut files = ModelFiles {
        required: Vec::new(),
        optional: vec!["config_sentence_transformers.json".into()],
    };
    for m in &modules {
        match m {
            Module::Transformer(p) => {
                for f in ["config.json", "tokenizer.json", "model.safetensors"] {
                    files.required.push(at(p, f));
                }
                // What the other tasks' loaders read beside these, where the folder has them:
                // an image model's processor, a generator's defaults and chat template.
                for f in [
                    "sentence_bert_config.json",
                    "tokenizer_config.json",
                    "preprocessor_config.json",
                    "generation_config.json",
                    "chat_template.jinja",
                ] {
                    files.optional.push(at(p, f));
                }
            }
            Module::Pooling(p) => files.required.push(at(p, "config.json")),
            Module::Dense(p) => {
                files.required.push(at(p, "config.json"));
                files.required.push(at(p, "model.safetensors"));
            }
            Module::Normalize => {}
        }
    }
    files
}

/// Each Dense layer takes what the one before it gives.
fn check_dense_widths(dense: &[DenseSpec], hidden: usize, dir: &Path) -> Result<(), ModelError> {
    let mut width = hidden;
    for d in dense {
        if d.in_features != width {
            return Err(ModelError::Config {
                path: dir.to_path_buf(),
                message: format!(
                    "a Dense layer takes {} features but receives {width}",
                    d.in_features
                ),
            });
        }
        width = d.out_features;
    }
    Ok(())
}

/// `max_seq_length`, else the tokenizer's `model_max_length`, never past the encoder's positions.
fn max_seq_len(st: &Value, tok: &Value, e: &EncoderSpec, notes: &mut Vec<String>) -> usize {
    let configured = st
        .get("max_seq_length")
        .and_then(Value::as_u64)
        .or_else(|| tok.get("model_max_length").and_then(Value::as_u64))
        .map(|v| v as usize);
    match configured {
        Some(n) if n <= e.max_tokens() => n,
        Some(n) => {
            notes.push(format!(
                "max_seq_length {n} is past the encoder's {} positions: texts are cut at {}",
                e.max_tokens(),
                e.max_tokens()
            ));
            e.max_tokens()
        }
        None => e.max_tokens(),
    }
}

/// The named prompts and the default one.
fn prompts(dir: &Path) -> Result<(BTreeMap<String, String>, Option<String>), ModelError> {
    let path = dir.join("config_sentence_transformers.json");
    let config = read_optional(&path)?;
    let prompts: BTreeMap<String, String> = match config.get("prompts") {
        None | Some(Value::Null) => BTreeMap::new(),
        Some(v) => serde_json::from_value(v.clone()).map_err(|e| ModelError::Config {
            path: path.clone(),
            message: format!("prompts: {e}"),
        })?,
    };
    let default = config
        .get("default_prompt_name")
        .and_then(Value::as_str)
        .map(str::to_string);
    if let Some(name) = &default {
        if !prompts.contains_key(name) {
            return Err(ModelError::Config {
                path,
                message: format!("default_prompt_name {name:?} is not among the prompts"),
            });
        }
    }
    Ok((prompts, default))
}

/// `DIR/model.safetensors`, or the reason there is none spotinfer can read.
pub(super) fn weights_file(dir: &Path) -> Result<PathBuf, ModelError> {
    let path = dir.join("model.safetensors");
    if path.is_file() {
        return Ok(path);
    }
    let refuse = |message: &str| ModelError::Unsupported {
        path: dir.to_path_buf(),
        message: message.into(),
    };
    if dir.join("model.safetensors.index.json").is_file() {
        return Err(refuse(
            "sharded weights (model.safetensors.index.json): save the model as one model.safetensors",
        ));
    }
    if dir.join("pytorch_model.bin").is_file() {
        return Err(refuse(
            "pytorch_model.bin only: spotinfer reads safetensors (convert the weights to model.safetensors)",
        ));
    }
    Err(ModelError::File {
        path,
        source: std::io::ErrorKind::NotFound.into(),
    })
}

/// The distinct dtypes of a safetensors file's floating-point tensors, from its header alone
/// (integer buffers such as BERT's `position_ids` are not weights).
fn safetensors_dtypes(path: &Path) -> Result<Vec<String>, ModelError> {
    use std::io::Read;
    let io = |source| ModelError::File {
        path: path.to_path_buf(),
        source,
    };
    let bad = |message: String| ModelError::Config {
        path: path.to_path_buf(),
        message,
    };
    let mut file = std::fs::File::open(path).map_err(io)?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len).map_err(io)?;
    let len = u64::from_le_bytes(len);
    if len > 100 << 20 {
        return Err(bad(format!(
            "not a safetensors file (header of {len} bytes)"
        )));
    }
    let mut header = vec![0u8; len as usize];
    file.read_exact(&mut header).map_err(io)?;
    let header: BTreeMap<String, Value> =
        serde_json::from_slice(&header).map_err(|e| bad(format!("not a safetensors file: {e}")))?;
    let mut dtypes: Vec<String> = header
        .iter()
        .filter(|(name, _)| name.as_str() != "__metadata__")
        .filter_map(|(_, t)| t.get("dtype").and_then(Value::as_str).map(str::to_string))
        .filter(|d| !d.starts_with('I') && !d.starts_with('U') && d != "BOOL")
        .collect();
    dtypes.sort();
    dtypes.dedup();
    if let Some(other) = dtypes
        .iter()
        .find(|d| !matches!(d.as_str(), "F32" | "F16" | "BF16"))
    {
        return Err(ModelError::Unsupported {
            path: path.to_path_buf(),
            message: format!("weights stored as {other}: spotinfer reads F32, F16 and BF16"),
        });
    }
    Ok(dtypes)
}

/// A positive integer of a config file (`hidden_size`, `out_features`), or why there is none.
pub(super) fn positive(config: &Value, key: &str, path: &Path) -> Result<usize, ModelError> {
    config
        .get(key)
        .and_then(Value::as_u64)
        .filter(|&v| v > 0)
        .map(|v| v as usize)
        .ok_or_else(|| ModelError::Config {
            path: path.to_path_buf(),
            message: format!("{key} is missing or not a positive integer"),
        })
}

/// A JSON file, or `null` when it does not exist.
pub(super) fn read_optional(path: &Path) -> Result<Value, ModelError> {
    if path.is_file() {
        read_json(path)
    } else {
        Ok(Value::Null)
    }
}

/// A JSON file, parsed.
pub(super) fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, ModelError> {
    let bytes = std::fs::read(path).map_err(|source| ModelError::File {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_slice(&bytes).map_err(|e| ModelError::Config {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}
