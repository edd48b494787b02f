//! The fused CPU encoder (`crates/bert-cpu`) as the model layer sees it: its shape from the
//! model's spec, and its errors in the model layer's terms.

use super::spec::{Architecture, EncoderSpec};
use super::Precision;
use super::{Engine, Model, ModelError, Task};
use spotinfer_bert_cpu::{self as bert_cpu, BertError};

impl From<BertError> for ModelError {
    fn from(e: BertError) -> Self {
        match e {
            BertError::File { path, source } => Self::File { path, source },
            BertError::Weights { path, message } => Self::Config { path, message },
            BertError::Input(m) => Self::Input(m),
            BertError::Unsupported(m) => Self::Precision(m),
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
        layout: match e.architecture {
            Architecture::DistilBert => bert_cpu::Layout::DistilBert,
            _ => bert_cpu::Layout::Bert,
        },
    }
}

/// The least cosine between a probe's bf16 and f32 vectors for `--precision auto` to keep bf16
/// (bench/accuracy.py measures whole corpora against sentence-transformers: the bar there is
/// 0.999, so this leaves a margin).
const BF16_MIN_COSINE: f64 = 0.9995;

/// Texts embedded both ways at load under `--precision auto`: short and long, prose, code,
/// numbers, other scripts, repetition, so a model whose activations bf16 cannot hold shows it.
const PROBES: &[&str] = &[
    "hello",
    "The quick brown fox jumps over the lazy dog.",
    "How do I reset my password if I no longer have access to the email on my account?",
    "Spot VMs can be preempted at any time; the worker returns unfinished messages at once.",
    "fn main() { println!(\"{}\", (1..=10).map(|x| x * x).sum::<u64>()); }",
    "Order #48213 shipped 2026-11-23 14:05 UTC: 3 × 250 ml, €17.40, tracking 1Z999AA10123456784.",
    "Die Katze sitzt auf der Matte. Le chat est assis sur le tapis. 猫はマットの上に座っている。",
    "error error error error error error error error error error error error error error",
    "Photosynthesis converts light energy into chemical energy: in the chloroplasts, water is \
     split, oxygen is released, and the energy captured drives the Calvin cycle, which fixes \
     carbon dioxide into three-carbon sugars that the plant then uses to build glucose, starch \
     and cellulose. The rate depends on light intensity, temperature and the concentration of \
     carbon dioxide, each of which can become the limiting factor; farmers raise yields in \
     greenhouses by adding carbon dioxide and controlling heat, while in the open field the \
     supply of water and nitrogen usually limits growth long before light does.",
];

impl Model {
    /// Settles the fused encoder's precision: f32 or bf16 when asked for, and for `auto` bf16
    /// where the CPU has it and the model's probe vectors stay within [`BF16_MIN_COSINE`] of
    /// f32's, else f32 (with the reason logged). The weights the choice does not use are freed.
    pub(super) fn choose_cpu_precision(&mut self, asked: Precision) -> Result<(), ModelError> {
        let bf16 = match asked {
            Precision::F32 | Precision::F16 => false,
            Precision::Bf16 => true,
            Precision::Auto if !bert_cpu::bf16_supported() => {
                tracing::info!("fused encoder in f32: this CPU has no AVX-512 BF16");
                false
            }
            // A head turns a small drift of the encoder into a different label or entity span
            // for texts near a boundary, which no handful of probe texts can rule out: task
            // models use bf16 only when --precision bf16 asks for it.
            Precision::Auto if self.info.task != Task::Embed => {
                tracing::info!(
                    task = self.info.task.name(),
                    "fused encoder in f32: a task model computes in bf16 only with --precision bf16"
                );
                false
            }
            Precision::Auto => self.bf16_holds()?,
        };
        let Engine::Fused(bert) = &mut self.engine else {
            return Ok(());
        };
        let chosen = if bf16 {
            bert_cpu::Precision::Bf16
        } else {
            bert_cpu::Precision::F32
        };
        bert.set_precision(chosen)?;
        let freed = bert.release_unused();
        tracing::debug!(
            freed_mib = freed / (1 << 20),
            "freed the weights of the precision not chosen"
        );
        self.info.device = format!("Cpu (fused, {})", if bf16 { "bf16" } else { "f32" });
        Ok(())
    }

    /// Whether bf16 keeps every probe text's vector within [`BF16_MIN_COSINE`] of f32's.
    fn bf16_holds(&mut self) -> Result<bool, ModelError> {
        let exact = self.embed(PROBES)?.vectors;
        if let Engine::Fused(bert) = &mut self.engine {
            bert.set_precision(bert_cpu::Precision::Bf16)?;
        }
        let rounded = self.embed(PROBES)?.vectors;
        let worst = exact
            .iter()
            .zip(&rounded)
            .map(|(a, b)| f64::from(super::cosine(a, b)))
            .fold(f64::INFINITY, f64::min);
        if worst >= BF16_MIN_COSINE {
            tracing::info!(
                worst_cosine = worst,
                "fused encoder in bf16 (checked against f32 at load)"
            );
            Ok(true)
        } else {
            tracing::warn!(
                worst_cosine = worst,
                "fused encoder in f32: this model's bf16 vectors drift past cosine {BF16_MIN_COSINE}"
            );
            Ok(false)
        }
    }
}
