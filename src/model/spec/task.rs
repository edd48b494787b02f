//! Which task a model folder is for, decided from its own files the way transformers and
//! sentence-transformers decide it, and the constants of its head (labels, the function that
//! turns logits into scores). What the head computes is `model::task`'s business.
//!
//! * a sentence-transformers CrossEncoder (its `config_sentence_transformers.json` says
//!   `"model_type": "CrossEncoder"`, or, as releases before 6 saved it, no `modules.json` and an
//!   activation in `config.json`) scores pairs, as `CrossEncoder.predict` does;
//! * any other folder with a `modules.json` is a sentence-transformers embedding model;
//! * a transformers folder whose `config.json` names `…ForSequenceClassification` classifies, as
//!   `pipeline("text-classification")` does; `…ForTokenClassification` tags tokens, as
//!   `pipeline("token-classification", aggregation_strategy="simple")` does;
//! * any other folder is embedded with mean pooling, as sentence-transformers builds a plain
//!   encoder folder.

use super::super::ModelError;
use super::read_optional;
use serde_json::Value;
use std::path::Path;

/// What a model computes for a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Task {
    /// A sentence embedding (sentence-transformers).
    Embed,
    /// Labels with probabilities for a text or a pair (`…ForSequenceClassification`).
    Classify,
    /// One score per (query, passage) pair (a sentence-transformers CrossEncoder).
    Score,
    /// Entities found in a text (`…ForTokenClassification`).
    Tag,
    /// A completion written for a prompt (a decoder LLM: `…ForCausalLM`, or a GGUF file).
    Generate,
}

impl Task {
    /// The name result rows, exports and `models check` use.
    pub fn name(self) -> &'static str {
        match self {
            Self::Embed => "embed",
            Self::Classify => "classify",
            Self::Score => "score",
            Self::Tag => "tag",
            Self::Generate => "generate",
        }
    }

    /// Whether a record may carry a `text_pair`: the sequence heads read a pair as their
    /// tokenizer's pair template encodes it; an embedding or a tagger has no meaning for one.
    pub fn takes_pairs(self) -> bool {
        matches!(self, Self::Classify | Self::Score)
    }

    /// Whether a record must carry a `text_pair` (a cross-encoder scores pairs only).
    pub fn needs_pairs(self) -> bool {
        self == Self::Score
    }
}

/// How a head's logits become the scores it reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScoreFunction {
    /// Probabilities over the labels (single-label classification).
    Softmax,
    /// A probability per label (multi-label, one-logit models, a CrossEncoder's `Sigmoid`).
    Sigmoid,
    /// The logits themselves (regression, a CrossEncoder's `Identity`).
    Identity,
    /// `tanh` of the logits (a CrossEncoder's `Tanh`).
    Tanh,
}

impl ScoreFunction {
    /// The scores of one row of logits, computed as numpy computes them in transformers'
    /// pipelines (softmax shifted by the row's maximum).
    pub fn apply(self, logits: &[f32]) -> Vec<f32> {
        match self {
            Self::Identity => logits.to_vec(),
            Self::Tanh => logits.iter().map(|x| x.tanh()).collect(),
            Self::Sigmoid => logits.iter().map(|x| 1.0 / (1.0 + (-x).exp())).collect(),
            Self::Softmax => {
                let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let exp: Vec<f32> = logits.iter().map(|x| (x - max).exp()).collect();
                let sum: f32 = exp.iter().sum();
                exp.iter().map(|e| e / sum).collect()
            }
        }
    }
}

/// A folder's task and its head's constants.
#[derive(Debug, Clone)]
pub struct TaskSpec {
    /// The task.
    pub task: Task,
    /// The head's labels in id order (`id2label`, else `LABEL_i` as transformers names them);
    /// empty for embeddings.
    pub labels: Vec<String>,
    /// How logits become scores (unused for embeddings and taggers, which always softmax).
    pub function: ScoreFunction,
    /// Where the task came from, for `models check`.
    pub source: String,
}

impl TaskSpec {
    /// The task of the folder `dir` (see the module's doc).
    pub fn read(dir: &Path) -> Result<Self, ModelError> {
        let st_path = dir.join("config_sentence_transformers.json");
        let st = read_optional(&st_path)?;
        let has_modules = dir.join("modules.json").is_file();
        let config_path = dir.join("config.json");
        let config = read_optional(&config_path)?;
        match st.get("model_type").and_then(Value::as_str) {
            None | Some("SentenceTransformer") => {}
            Some("CrossEncoder") => {
                let activation = st.get("activation_fn").and_then(Value::as_str);
                return cross_encoder(&config, &config_path, activation, &st_path);
            }
            Some(other) => {
                return Err(ModelError::Unsupported {
                    path: st_path,
                    message: format!(
                        "a sentence-transformers {other}: spotinfer runs SentenceTransformer \
                         embedding models and CrossEncoders"
                    ),
                })
            }
        }
        if has_modules {
            return Ok(Self::embed("modules.json: a sentence-transformers model"));
        }
        let old_activation = config
            .get("sentence_transformers")
            .and_then(|s| s.get("activation_fn"))
            .or_else(|| config.get("sbert_ce_default_activation_function"))
            .and_then(Value::as_str);
        if let Some(activation) = old_activation {
            return cross_encoder(&config, &config_path, Some(activation), &config_path);
        }
        let architecture = config
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(Value::as_str)
            .unwrap_or("");
        if architecture.ends_with("ForSequenceClassification") {
            let labels = labels(&config, &config_path)?;
            let function = classification_function(&config, &config_path, labels.len())?;
            return Ok(Self {
                task: Task::Classify,
                labels,
                function,
                source: format!("config.json: {architecture}"),
            });
        }
        if architecture.ends_with("ForTokenClassification") {
            return Ok(Self {
                task: Task::Tag,
                labels: labels(&config, &config_path)?,
                function: ScoreFunction::Softmax,
                source: format!("config.json: {architecture}"),
            });
        }
        Ok(Self::embed(
            "no modules.json: a plain encoder, embedded with mean pooling",
        ))
    }

    fn embed(source: &str) -> Self {
        Self {
            task: Task::Embed,
            labels: Vec::new(),
            function: ScoreFunction::Identity,
            source: source.into(),
        }
    }
}

/// A CrossEncoder: its labels, and the activation `predict` applies (the saved one, else
/// `Sigmoid` for one logit and `Identity` for more, as sentence-transformers defaults it).
fn cross_encoder(
    config: &Value,
    config_path: &Path,
    activation: Option<&str>,
    activation_path: &Path,
) -> Result<TaskSpec, ModelError> {
    let labels = labels(config, config_path)?;
    let function = match activation {
        None if labels.len() == 1 => ScoreFunction::Sigmoid,
        None => ScoreFunction::Identity,
        Some(path) => match path.rsplit('.').next().unwrap_or("") {
            "Sigmoid" if path.starts_with("torch.") => ScoreFunction::Sigmoid,
            "Identity" if path.starts_with("torch.") => ScoreFunction::Identity,
            "Tanh" if path.starts_with("torch.") => ScoreFunction::Tanh,
            _ => {
                return Err(ModelError::Unsupported {
                    path: activation_path.to_path_buf(),
                    message: format!(
                        "CrossEncoder activation_fn {path:?}: spotinfer applies torch's \
                         Sigmoid, Identity or Tanh"
                    ),
                })
            }
        },
    };
    Ok(TaskSpec {
        task: Task::Score,
        labels,
        function,
        source: "a sentence-transformers CrossEncoder".into(),
    })
}

/// `pipeline("text-classification")`'s default function: none for regression; sigmoid for
/// multi-label and for one logit; softmax for single-label and for several logits. A
/// `problem_type` transformers does not define is refused.
pub(crate) fn classification_function(
    config: &Value,
    path: &Path,
    labels: usize,
) -> Result<ScoreFunction, ModelError> {
    match config.get("problem_type").and_then(Value::as_str) {
        Some("regression") => Ok(ScoreFunction::Identity),
        Some("multi_label_classification") => Ok(ScoreFunction::Sigmoid),
        _ if labels == 1 => Ok(ScoreFunction::Sigmoid),
        None | Some("single_label_classification") => Ok(ScoreFunction::Softmax),
        Some(other) => Err(ModelError::Unsupported {
            path: path.to_path_buf(),
            message: format!(
                "problem_type {other:?}: transformers defines regression, \
                 single_label_classification and multi_label_classification"
            ),
        }),
    }
}

/// The labels in id order: `id2label` where it names them, `LABEL_i` for the rest, as many as
/// `id2label` has, else `num_labels`, else transformers' default of 2.
pub(crate) fn labels(config: &Value, path: &Path) -> Result<Vec<String>, ModelError> {
    let bad = |message: String| ModelError::Config {
        path: path.to_path_buf(),
        message,
    };
    let named = config.get("id2label").and_then(Value::as_object);
    let count = match (named, config.get("num_labels").and_then(Value::as_u64)) {
        (Some(m), _) if !m.is_empty() => m.len(),
        (_, Some(n)) => usize::try_from(n).map_err(|_| bad("num_labels is too large".into()))?,
        _ => 2,
    };
    if count == 0 {
        return Err(bad("the head has no labels (num_labels 0)".into()));
    }
    let mut labels: Vec<String> = (0..count).map(|i| format!("LABEL_{i}")).collect();
    for (id, label) in named.into_iter().flatten() {
        let i: usize = id
            .parse()
            .ok()
            .filter(|&i| i < count)
            .ok_or_else(|| bad(format!("id2label has id {id:?}, not one of 0..{count}")))?;
        labels[i] = label
            .as_str()
            .ok_or_else(|| bad(format!("id2label[{id}] is not a string")))?
            .to_string();
    }
    Ok(labels)
}
