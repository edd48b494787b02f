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

/// The reduced precisions `auto` tries on this CPU within `widest` (`--cpu-kernels`), fastest
/// first: bf16 on AMX tiles where the CPU has them and they are not left out (2.6 times f32 and 1.2 times int8 on AVX-512 VNNI for all-MiniLM-L6-v2's shape
/// on a 2-vCPU Sapphire Rapids-class Xeon, closer to f32 than int8), then int8 where the CPU has
/// integer dot products (AVX-512 VNNI, AVX-VNNI, AVX2, Arm's dotprod: two to four times f32's
/// multiply-adds per instruction), then bf16 where it is faster than f32 without AMX
/// ([`fused_cpu::bf16_full_rate`]: AMD's Zen 4 and 5).
pub(crate) fn reduced_candidates(widest: fused_cpu::Widest) -> Vec<fused_cpu::Precision> {
    let mut candidates = Vec::new();
    let amx = fused_cpu::amx_supported() && widest == fused_cpu::Widest::All;
    if amx {
        candidates.push(fused_cpu::Precision::Bf16);
    }
    if fused_cpu::int8_supported() {
        candidates.push(fused_cpu::Precision::Int8);
    }
    // AVX-512 BF16 at full rate: not an Intel core's (half rate), also when AMX is left out.
    if !amx && fused_cpu::bf16_full_rate() && !fused_cpu::amx_supported() {
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

#[cfg(test)]
mod tests {
    use super::*;
    use fused_cpu::{Precision, Widest};

    #[test]
    fn auto_tries_bf16_on_amx_only_where_the_kernels_may_use_it() {
        let all = reduced_candidates(Widest::All);
        let no_amx = reduced_candidates(Widest::NoAmx);
        if fused_cpu::amx_supported() {
            // A Xeon with AMX: bf16 first on the tiles; held below them, bf16 would run on
            // AVX-512 BF16 at half an Intel core's f32 rate, so it is not tried.
            assert_eq!(all.first(), Some(&Precision::Bf16));
            assert!(!no_amx.contains(&Precision::Bf16), "{no_amx:?}");
        } else {
            // Nothing to leave out: the same candidates.
            assert_eq!(all, no_amx);
        }
    }
}
