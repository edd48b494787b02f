//! The fused CPU encoder (`crates/bert-cpu`) as the model layer sees it: its shape from the
//! model's spec, and its errors in the model layer's terms.

use super::spec::EncoderSpec;
use super::ModelError;
use spotinfer_bert_cpu::{self as bert_cpu, BertError};

impl From<BertError> for ModelError {
    fn from(e: BertError) -> Self {
        match e {
            BertError::File { path, source } => Self::File { path, source },
            BertError::Weights { path, message } => Self::Config { path, message },
            BertError::Input(m) => Self::Input(m),
        }
    }
}

/// The fused encoder's dimensions (the spec has already refused what no encoder implements).
pub(super) fn dims(e: &EncoderSpec) -> bert_cpu::Dims {
    bert_cpu::Dims {
        hidden: e.hidden,
        heads: e.heads,
        intermediate: e.intermediate,
        layers: e.layers,
        vocab: e.vocab,
        max_positions: e.max_positions,
        type_vocab: e.type_vocab,
        eps: e.eps as f32,
        position_offset: e.position_offset,
    }
}
