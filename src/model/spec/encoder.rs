//! The encoder a model's `config.json` describes, checked against what spotinfer computes.
//!
//! BERT, RoBERTa/XLM-RoBERTa and DistilBERT share one encoder (post-norm layers, exact GELU);
//! they differ in where positions start (RoBERTa keeps the first `padding_idx + 1` rows of its
//! position table for padding), in how many token types they have (DistilBERT: none) and in
//! their tensor names. Anything else (MPNet, NomicBert, ModernBERT, decoders, relative or
//! sinusoidal positions, another activation) is refused here, before a weight is read.

use super::super::ModelError;
use serde_json::Value;
use std::path::Path;

/// The encoder families spotinfer runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// BERT (`model_type: bert`), including multilingual BERTs with SentencePiece vocabularies.
    Bert,
    /// RoBERTa (`model_type: roberta`).
    Roberta,
    /// XLM-RoBERTa (`model_type: xlm-roberta`).
    XlmRoberta,
    /// DistilBERT (`model_type: distilbert`): BERT's layers under other names, no token types.
    DistilBert,
}

impl Architecture {
    /// The name `config.json` uses.
    pub fn name(self) -> &'static str {
        match self {
            Self::Bert => "bert",
            Self::Roberta => "roberta",
            Self::XlmRoberta => "xlm-roberta",
            Self::DistilBert => "distilbert",
        }
    }
}

/// The encoder's shape and constants, from `config.json`.
#[derive(Debug, Clone)]
pub struct EncoderSpec {
    /// The family.
    pub architecture: Architecture,
    /// Hidden size (the token vectors' width).
    pub hidden: usize,
    /// Attention heads.
    pub heads: usize,
    /// Feed-forward width.
    pub intermediate: usize,
    /// Encoder layers.
    pub layers: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Rows of the position table.
    pub max_positions: usize,
    /// Token types.
    pub type_vocab: usize,
    /// Layer norm epsilon.
    pub eps: f64,
    /// The padding token's id.
    pub pad_token_id: u32,
    /// The position id of a text's first token (0 for BERT, `pad_token_id + 1` for RoBERTa).
    pub position_offset: usize,
}

impl EncoderSpec {
    /// Reads and checks `config.json`.
    pub fn read(path: &Path) -> Result<Self, ModelError> {
        let config: Value = super::read_json(path)?;
        let refuse = |message: String| ModelError::Unsupported {
            path: path.to_path_buf(),
            message,
        };
        let text = |key: &str| config.get(key).and_then(Value::as_str);
        let architecture = match text("model_type") {
            Some("bert") => Architecture::Bert,
            Some("roberta") => Architecture::Roberta,
            Some("xlm-roberta") => Architecture::XlmRoberta,
            Some("distilbert") => return Self::read_distilbert(path, &config),
            other => {
                let arch = config.get("architectures").map(Value::to_string);
                return Err(refuse(format!(
                    "model_type {} ({}): spotinfer runs BERT, RoBERTa, XLM-RoBERTa and DistilBERT encoders",
                    other.map_or("missing".into(), |t| format!("{t:?}")),
                    arch.unwrap_or_else(|| "no architectures listed".into())
                )));
            }
        };
        for flag in ["is_decoder", "add_cross_attention"] {
            if config.get(flag) == Some(&Value::Bool(true)) {
                return Err(refuse(format!(
                    "{flag} is true: spotinfer runs encoders only"
                )));
            }
        }
        let act = text("hidden_act").unwrap_or("gelu");
        if act != "gelu" {
            return Err(refuse(format!(
                "hidden_act {act:?}: spotinfer implements the exact (erf) \"gelu\" only"
            )));
        }
        let positions = text("position_embedding_type").unwrap_or("absolute");
        if positions != "absolute" {
            return Err(refuse(format!(
                "position_embedding_type {positions:?}: spotinfer implements \"absolute\" only"
            )));
        }
        let size = |key: &str| super::positive(&config, key, path);
        let pad_token_id = pad_token_id(&config, path)?;
        let position_offset = match architecture {
            Architecture::Bert => 0,
            _ => pad_token_id as usize + 1,
        };
        let spec = Self {
            architecture,
            hidden: size("hidden_size")?,
            heads: size("num_attention_heads")?,
            intermediate: size("intermediate_size")?,
            layers: size("num_hidden_layers")?,
            vocab: size("vocab_size")?,
            max_positions: size("max_position_embeddings")?,
            type_vocab: size("type_vocab_size").unwrap_or(2),
            eps: config
                .get("layer_norm_eps")
                .and_then(Value::as_f64)
                .unwrap_or(1e-12),
            pad_token_id,
            position_offset,
        };
        spec.check(path)
    }

    /// The checks every family's shape must pass.
    fn check(self, path: &Path) -> Result<Self, ModelError> {
        let bad = |message: String| ModelError::Config {
            path: path.to_path_buf(),
            message,
        };
        if !self.hidden.is_multiple_of(self.heads) {
            return Err(bad(format!(
                "the hidden size {} is not a multiple of the {} attention heads",
                self.hidden, self.heads
            )));
        }
        if self.max_positions <= self.position_offset {
            return Err(bad(format!(
                "max_position_embeddings {} leaves no position after the {} kept for padding",
                self.max_positions, self.position_offset
            )));
        }
        Ok(self)
    }

    /// DistilBERT's `config.json`, whose keys differ from BERT's (`dim`, `n_layers`, `n_heads`,
    /// `hidden_dim`, `activation`) and whose layer norms always use epsilon 1e-12.
    fn read_distilbert(path: &Path, config: &Value) -> Result<Self, ModelError> {
        let refuse = |message: String| ModelError::Unsupported {
            path: path.to_path_buf(),
            message,
        };
        let act = config
            .get("activation")
            .and_then(Value::as_str)
            .unwrap_or("gelu");
        if act != "gelu" {
            return Err(refuse(format!(
                "activation {act:?}: spotinfer implements the exact (erf) \"gelu\" only"
            )));
        }
        if config.get("sinusoidal_pos_embds") == Some(&Value::Bool(true)) {
            return Err(refuse(
                "sinusoidal_pos_embds is true: spotinfer reads learned position embeddings only"
                    .into(),
            ));
        }
        let size = |key: &str| super::positive(config, key, path);
        let spec = Self {
            architecture: Architecture::DistilBert,
            hidden: size("dim")?,
            heads: size("n_heads")?,
            intermediate: size("hidden_dim")?,
            layers: size("n_layers")?,
            vocab: size("vocab_size")?,
            max_positions: size("max_position_embeddings")?,
            type_vocab: 1,
            eps: 1e-12,
            pad_token_id: pad_token_id(config, path)?,
            position_offset: 0,
        };
        spec.check(path)
    }

    /// The most tokens one text can have: the position table past the rows kept for padding.
    pub fn max_tokens(&self) -> usize {
        self.max_positions - self.position_offset
    }
}

/// `pad_token_id` (0 when absent, as transformers defaults it).
fn pad_token_id(config: &Value, path: &Path) -> Result<u32, ModelError> {
    match config.get("pad_token_id") {
        None | Some(Value::Null) => Ok(0),
        Some(v) => v
            .as_u64()
            .and_then(|v| u32::try_from(v).ok())
            .ok_or_else(|| ModelError::Config {
                path: path.to_path_buf(),
                message: "pad_token_id is not an integer".into(),
            }),
    }
}
