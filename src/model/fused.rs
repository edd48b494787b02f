//! The fused CPU encoder (`crates/bert-cpu`) as the model layer sees it: its configuration from
//! the model's `config.json`, and its errors in the model layer's terms.

use super::ModelError;
use candle_transformers::models::bert::{Config as BertConfig, HiddenAct};
use spotinfer_bert_cpu::{self as bert_cpu, BertError};
use std::path::Path;

impl From<BertError> for ModelError {
    fn from(e: BertError) -> Self {
        match e {
            BertError::File { path, source } => Self::File { path, source },
            BertError::Weights { path, message } => Self::Config { path, message },
            BertError::Input(m) => Self::Input(m),
        }
    }
}

/// The fused encoder's dimensions, refusing what it does not implement.
pub(super) fn bert_dims(c: &BertConfig, path: &Path) -> Result<bert_cpu::Dims, ModelError> {
    if c.hidden_act != HiddenAct::Gelu {
        return Err(ModelError::Config {
            path: path.to_path_buf(),
            message: format!(
                "hidden_act {:?}: the fused backend implements erf GELU only (use --backend candle)",
                c.hidden_act
            ),
        });
    }
    Ok(bert_cpu::Dims {
        hidden: c.hidden_size,
        heads: c.num_attention_heads,
        intermediate: c.intermediate_size,
        layers: c.num_hidden_layers,
        vocab: c.vocab_size,
        max_positions: c.max_position_embeddings,
        type_vocab: c.type_vocab_size,
        eps: c.layer_norm_eps as f32,
    })
}
