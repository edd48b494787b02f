//! The fused encoder's precision under `--precision auto`, settled once at load: int8 or bf16
//! only where every probe text (26 languages, short and long, the model's prompts) stays within
//! [`MIN_PROBE_COSINE`] of f32, else f32. The one statement of the accuracy promise is
//! docs/performance.md, "The accuracy promise"; this is where it is kept.

use super::TextModel;
use crate::model::engines::fused::{precision_name, reduced_candidates};
use crate::model::engines::Engine;
use crate::model::{cosine, Input, ModelError, Precision, Task};
use spotinfer_fused_cpu as fused_cpu;

/// The least cosine between a probe's vector in a reduced precision (int8, bf16) and in f32 for
/// `--precision auto` to keep the reduced one. The promise is 0.999 on any real text
/// (docs/performance.md, "The accuracy promise"), and a few dozen probes only sample it: over
/// 10,300 real texts in 27 languages, the worst text's drift (1 − cosine) in int8 reached 5.1
/// times the worst probe's (ten models, two calibrations, AVX-512 VNNI), so the probes must stay
/// within 0.00015 of drift (6.7 times under the promised 0.001).
pub const MIN_PROBE_COSINE: f64 = 0.99985;

/// Texts embedded both ways at load under `--precision auto`, one a line: short and long, prose,
/// code, numbers, repetition, and real text in 26 languages and their scripts (Latin, Cyrillic,
/// Greek, Arabic, Hebrew, Devanagari, Bengali, Tamil, Thai, Georgian, Armenian, Hangul, Kana,
/// Han): excerpts of Debian's fortunes, translated man pages and GLib/GTK/PackageKit message
/// catalogs (`bench/real_corpus.py --languages`), since a precision that holds on English can
/// drift past the promise on other scripts.
const PROBES: &str = include_str!("../probes/check.txt");

/// Texts whose activations int8 is calibrated on at load (each dense layer's largest input per
/// channel, from which it smooths outliers), one a line: varied, but not the probes, so that the
/// check on the probes is not a check on what was fitted. Nine texts, mostly English: calibrating
/// on 26 languages as well widened the ranges and made all-MiniLM-L6-v2's int8 tail worse on real
/// multilingual text (worst cosine 0.99844 and 43 of 10,300 texts below 0.999, against 0.99875
/// and 19), so the languages are checked, not fitted.
const CALIBRATION: &str = include_str!("../probes/calibration.txt");

/// The lines of a probe file.
fn lines(texts: &str) -> Vec<&str> {
    texts.lines().filter(|l| !l.trim().is_empty()).collect()
}

/// How the fused encoder's precision was settled, for `models check`, `bench` and the start-up
/// log to say which precision runs and how close to f32 it was checked to be.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PrecisionCheck {
    /// The precision the dense layers compute in: `f32`, `bf16` or `int8`.
    pub precision: &'static str,
    /// The least cosine between a probe's vector in this precision and in f32, over every probe
    /// (each under the default prompt and one named prompt); none when nothing was checked (f32,
    /// or a precision `--precision` asked for).
    pub worst_probe_cosine: Option<f64>,
    /// Probe vectors compared.
    pub probes: usize,
    /// The bar a reduced precision had to clear on every probe ([`MIN_PROBE_COSINE`]).
    pub bar: f64,
    /// Faster precisions tried first and refused, with their worst probe cosine.
    pub refused: Vec<(&'static str, f64)>,
}

impl std::fmt::Display for PrecisionCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.precision, self.worst_probe_cosine) {
            ("f32", None) => write!(f, "f32, the reference (no drift to check)")?,
            (p, None) => write!(f, "{p} as --precision asked (not checked at load)")?,
            (p, Some(worst)) => write!(
                f,
                "{p}, checked at load: worst cosine {worst:.5} against f32 over {} probe vectors \
                 (bar {}, for >= 0.999 on any text)",
                self.probes, self.bar
            )?,
        }
        for (p, worst) in &self.refused {
            write!(f, "; {p} refused: worst probe cosine {worst:.5}")?;
        }
        Ok(())
    }
}

impl TextModel {
    /// Settles the fused encoder's precision: the one asked for, or for `auto` the first of
    /// [`reduced_candidates`] whose probe vectors stay within [`MIN_COSINE`] of f32's, else f32
    /// (with the reason logged). The f32 weights are freed once a packed copy replaces them.
    pub(super) fn choose_cpu_precision(&mut self, asked: Precision) -> Result<(), ModelError> {
        let chosen = match asked {
            Precision::F32 | Precision::F16 => fused_cpu::Precision::F32,
            Precision::Bf16 => fused_cpu::Precision::Bf16,
            Precision::Gguf => {
                return Err(ModelError::Precision(
                    crate::model::engines::GGUF_ONLY.into(),
                ))
            }
            Precision::Int8 => {
                self.calibrate(&lines(CALIBRATION))?;
                fused_cpu::Precision::Int8
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
                fused_cpu::Precision::F32
            }
            Precision::Auto => return self.first_that_holds(),
        };
        self.set_cpu_precision(chosen, None, Vec::new())
    }

    /// Packs the fused encoder's weights for `chosen` and records how it was settled.
    fn set_cpu_precision(
        &mut self,
        chosen: fused_cpu::Precision,
        check: Option<(f64, usize)>,
        refused: Vec<(&'static str, f64)>,
    ) -> Result<(), ModelError> {
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
        let settled = PrecisionCheck {
            precision: precision_name(chosen),
            worst_probe_cosine: check.map(|(worst, _)| worst),
            probes: check.map_or(0, |(_, n)| n),
            bar: MIN_PROBE_COSINE,
            refused,
        };
        tracing::info!("fused encoder precision: {settled}");
        self.precision = Some(settled);
        Ok(())
    }

    /// Settles `auto`: the first of [`reduced_candidates`] that keeps every probe's vector within
    /// [`MIN_PROBE_COSINE`] of f32's, else f32.
    fn first_that_holds(&mut self) -> Result<(), ModelError> {
        let candidates: Vec<_> = match &self.engine {
            Engine::Fused(bert) => reduced_candidates(bert.widest())
                .into_iter()
                .filter(|&p| bert.runs(p))
                .collect(),
            Engine::Candle(..) | Engine::Unpadded(..) => Vec::new(),
        };
        if candidates.is_empty() {
            tracing::info!(
                "fused encoder in f32: no int8 kernel (integer dot products) and no full-rate \
                 bf16 on this CPU"
            );
            return self.set_cpu_precision(fused_cpu::Precision::F32, None, Vec::new());
        }
        let texts = lines(PROBES);
        let named = self.info.prompts.clone();
        let probes = probe_inputs(&texts, &named);
        let exact = self.embed_inputs(&probes)?.vectors;
        self.calibrate(&lines(CALIBRATION))?;
        let mut refused = Vec::new();
        for candidate in candidates {
            if let Engine::Fused(bert) = &mut self.engine {
                bert.set_precision(candidate)?;
            }
            let reduced = self.embed_inputs(&probes)?.vectors;
            let worst = exact
                .iter()
                .zip(&reduced)
                .map(|(a, b)| f64::from(cosine(a, b)))
                .fold(f64::INFINITY, f64::min);
            if worst >= MIN_PROBE_COSINE {
                return self.set_cpu_precision(candidate, Some((worst, probes.len())), refused);
            }
            let name = precision_name(candidate);
            tracing::warn!(
                worst_cosine = worst,
                "fused encoder not in {name}: this model's {name} vectors drift past cosine \
                 {MIN_PROBE_COSINE} on a probe text"
            );
            refused.push((name, worst));
        }
        self.set_cpu_precision(fused_cpu::Precision::F32, None, refused)
    }
}

impl TextModel {
    /// Runs `texts` through the fused encoder (in f32) recording each dense layer's input
    /// ranges, from which int8 smooths its inputs.
    fn calibrate(&self, texts: &[&str]) -> Result<(), ModelError> {
        let Engine::Fused(bert) = &self.engine else {
            return Ok(());
        };
        let inputs: Vec<_> = texts.iter().map(|&t| super::plain(t)).collect();
        // Every task's encoder calibrates on the same plain texts, tokenized as embeddings are.
        let tokenized = self.prep.embed_inputs(&inputs)?;
        let tokens: Vec<fused_cpu::Tokens<'_>> = tokenized
            .iter()
            .map(|t| fused_cpu::Tokens {
                ids: &t.ids().ids,
                type_ids: &t.ids().type_ids,
                skip: t.skip(),
            })
            .collect();
        Ok(bert.calibrate(&tokens)?)
    }
}

/// Every probe as a record sends it: under the worker's default prompt, and again under one
/// of the model's named prompts (in turn, so each prompt meets several scripts and lengths
/// without multiplying the probes by the prompts).
fn probe_inputs<'a>(texts: &[&'a str], named: &'a [String]) -> Vec<Input<'a>> {
    let mut inputs: Vec<Input<'a>> = texts.iter().map(|&t| super::plain(t)).collect();
    if !named.is_empty() {
        inputs.extend(texts.iter().enumerate().map(|(i, &text)| Input {
            text,
            text_pair: None,
            prompt_name: Some(named[i % named.len()].as_str()),
        }));
    }
    inputs
}
