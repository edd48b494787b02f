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

/// The least cosine between a probe's vector in a reduced precision (int8, bf16) and in f32 for
/// `--precision auto` to keep the reduced one (bench/accuracy.py measures whole corpora against
/// sentence-transformers: the bar there is 0.999, so this leaves a margin).
const MIN_COSINE: f64 = 0.9995;

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

/// Texts whose activations int8 is calibrated on at load (each dense layer's largest input per
/// channel, from which it smooths outliers): as varied as [`PROBES`] but not the same texts, so
/// that the check on the probes is not a check on what was fitted.
const CALIBRATION: &[&str] = &[
    "Thanks for the quick reply! I'll try that tomorrow and let you know if it works.",
    "SELECT id, name FROM users WHERE created_at > now() - interval '7 days' ORDER BY name;",
    "The committee approved the budget for 2027 by a vote of 7 to 2, with one abstention.",
    "Symptoms include fever, a dry cough and fatigue; most patients recover within two weeks.",
    "Das Wetter ist heute schön. El tiempo es agradable hoy. Сегодня хорошая погода.",
    "1. Preheat the oven to 200 °C. 2. Mix flour, sugar and eggs. 3. Bake for 25 minutes.",
    "WARNING: disk /dev/sda1 is 97% full (48.5 GiB of 50 GiB); rotate the logs or resize it.",
    "She looked out of the window at the rain, thinking of the summer they had spent by the \
     sea, the long evenings on the terrace, the boats coming in at dusk, and wondered whether \
     any of it had been as happy as she now remembered, or whether memory, as it does, had \
     quietly kept the light and let the rest of it go.",
    "ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok",
];

impl Model {
    /// Settles the fused encoder's precision: the one asked for, or for `auto` the first of
    /// [`reduced_candidates`] whose probe vectors stay within [`MIN_COSINE`] of f32's, else f32
    /// (with the reason logged). The f32 weights are freed once a packed copy replaces them.
    pub(super) fn choose_cpu_precision(&mut self, asked: Precision) -> Result<(), ModelError> {
        let chosen = match asked {
            Precision::F32 | Precision::F16 => bert_cpu::Precision::F32,
            Precision::Bf16 => bert_cpu::Precision::Bf16,
            Precision::Int8 => {
                self.calibrate(CALIBRATION)?;
                bert_cpu::Precision::Int8
            }
            // A head turns a small drift of the encoder into a different label or entity span
            // for texts near a boundary, which no handful of probe texts can rule out: task
            // models use a reduced precision only when --precision asks for it.
            Precision::Auto if self.info.task != Task::Embed => {
                tracing::info!(
                    task = self.info.task.name(),
                    "fused encoder in f32: a task model computes in int8 or bf16 only when \
                     --precision asks for it"
                );
                bert_cpu::Precision::F32
            }
            Precision::Auto => self.first_that_holds()?,
        };
        let Engine::Fused(bert) = &mut self.engine else {
            return Ok(());
        };
        bert.set_precision(chosen)?;
        let freed = bert.release_unused();
        tracing::debug!(
            freed_mib = freed / (1 << 20),
            "freed the f32 weights a packed copy replaced"
        );
        self.info.device = format!(
            "Cpu (fused, {} on {})",
            precision_name(chosen),
            bert.kernels()
        );
        Ok(())
    }

    /// The first of [`reduced_candidates`] that keeps every probe text's vector within
    /// [`MIN_COSINE`] of f32's, else f32.
    fn first_that_holds(&mut self) -> Result<bert_cpu::Precision, ModelError> {
        let candidates: Vec<_> = match &self.engine {
            Engine::Fused(bert) => reduced_candidates()
                .into_iter()
                .filter(|&p| bert.runs(p))
                .collect(),
            Engine::Candle(..) => Vec::new(),
        };
        if candidates.is_empty() {
            tracing::info!(
                "fused encoder in f32: no int8 kernel (integer dot products) and no full-rate \
                 bf16 on this CPU"
            );
            return Ok(bert_cpu::Precision::F32);
        }
        let exact = self.embed(PROBES)?.vectors;
        self.calibrate(CALIBRATION)?;
        for candidate in candidates {
            if let Engine::Fused(bert) = &mut self.engine {
                bert.set_precision(candidate)?;
            }
            let reduced = self.embed(PROBES)?.vectors;
            let worst = exact
                .iter()
                .zip(&reduced)
                .map(|(a, b)| f64::from(super::cosine(a, b)))
                .fold(f64::INFINITY, f64::min);
            let name = precision_name(candidate);
            if worst >= MIN_COSINE {
                tracing::info!(
                    worst_cosine = worst,
                    "fused encoder in {name} (checked against f32 at load)"
                );
                return Ok(candidate);
            }
            tracing::warn!(
                worst_cosine = worst,
                "fused encoder not in {name}: this model's {name} vectors drift past cosine {MIN_COSINE}"
            );
        }
        Ok(bert_cpu::Precision::F32)
    }
}

impl Model {
    /// Runs `texts` through the fused encoder (in f32) recording each dense layer's input
    /// ranges, from which int8 smooths its inputs.
    fn calibrate(&self, texts: &[&str]) -> Result<(), ModelError> {
        let Engine::Fused(bert) = &self.engine else {
            return Ok(());
        };
        let inputs: Vec<_> = texts.iter().map(|&t| super::plain(t)).collect();
        // Every task's encoder calibrates on the same plain texts, tokenized as embeddings are.
        let tokenized = self.prep.embed_inputs(&inputs)?;
        let tokens: Vec<bert_cpu::Tokens<'_>> = tokenized
            .iter()
            .map(|t| bert_cpu::Tokens {
                ids: &t.ids().ids,
                type_ids: &t.ids().type_ids,
                skip: t.skip(),
            })
            .collect();
        Ok(bert.calibrate(&tokens)?)
    }
}

/// The reduced precisions `auto` tries on this CPU, fastest first: int8 where the CPU has integer
/// dot products (AVX-512 VNNI, AVX-VNNI, AVX2, Arm's dotprod: two to four times f32's
/// multiply-adds per instruction), then bf16 where it is faster than f32
/// ([`bert_cpu::bf16_full_rate`]).
fn reduced_candidates() -> Vec<bert_cpu::Precision> {
    let mut candidates = Vec::new();
    if bert_cpu::int8_supported() {
        candidates.push(bert_cpu::Precision::Int8);
    }
    if bert_cpu::bf16_full_rate() {
        candidates.push(bert_cpu::Precision::Bf16);
    }
    candidates
}

/// A precision's name as the flag spells it.
pub(super) fn precision_name(p: bert_cpu::Precision) -> &'static str {
    match p {
        bert_cpu::Precision::F32 => "f32",
        bert_cpu::Precision::Bf16 => "bf16",
        bert_cpu::Precision::Int8 => "int8",
    }
}
