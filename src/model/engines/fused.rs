//! The fused CPU encoder (`crates/fused-cpu`) as the model layer sees it: its shape from the
//! model's spec, its errors in the model layer's terms, and the reduced precisions this CPU
//! computes fast (which of them a model keeps is the text model's policy,
//! `crate::model::text::precision`).

use crate::model::spec::{Architecture, EncoderSpec};
use crate::model::ModelError;
use spotinfer_fused_cpu::{self as fused_cpu, FusedError};

impl From<FusedError> for ModelError {
    fn from(e: FusedError) -> Self {
        match e {
            FusedError::File { path, source } => Self::File { path, source },
            FusedError::Weights { path, message } => Self::Config { path, message },
            FusedError::Input(m) => Self::Input(m),
            FusedError::Unsupported(m) => Self::Precision(m),
        }
    }
}

/// The fused encoder's dimensions (the spec has already refused what no encoder implements).
pub(crate) fn dims(e: &EncoderSpec) -> fused_cpu::Dims {
    fused_cpu::Dims {
        hidden: e.hidden,
        heads: e.heads,
        intermediate: e.intermediate,
        layers: e.layers,
        vocab: e.vocab,
        max_positions: e.max_positions,
        type_vocab: e.type_vocab,
        eps: e.eps as f32,
        position_offset: e.position_offset,
        layout: match e.architecture {
            Architecture::DistilBert => fused_cpu::Layout::DistilBert,
            _ => fused_cpu::Layout::Bert,
        },
    }
}

/// The reduced precisions `auto` tries on this CPU, fastest first: bf16 on AMX tiles where the
/// CPU has them (2.6 times f32 and 1.2 times int8 on AVX-512 VNNI for all-MiniLM-L6-v2's shape
/// on a 2-vCPU Sapphire Rapids-class Xeon, closer to f32 than int8), then int8 where the CPU has
/// integer dot products (AVX-512 VNNI, AVX-VNNI, AVX2, Arm's dotprod: two to four times f32's
/// multiply-adds per instruction), then bf16 where it is faster than f32 without AMX
/// ([`fused_cpu::bf16_full_rate`]: AMD's Zen 4 and 5).
pub(crate) fn reduced_candidates() -> Vec<fused_cpu::Precision> {
    let mut candidates = Vec::new();
    let amx = fused_cpu::amx_supported();
    if amx {
        candidates.push(fused_cpu::Precision::Bf16);
    }
    if fused_cpu::int8_supported() {
        candidates.push(fused_cpu::Precision::Int8);
    }
    if !amx && fused_cpu::bf16_full_rate() {
        candidates.push(fused_cpu::Precision::Bf16);
    }
    candidates
}

/// A precision's name as the flag spells it.
pub(crate) fn precision_name(p: fused_cpu::Precision) -> &'static str {
    match p {
        fused_cpu::Precision::F32 => "f32",
        fused_cpu::Precision::Bf16 => "bf16",
        fused_cpu::Precision::Int8 => "int8",
        fused_cpu::Precision::Gguf => "gguf",
    }
}
