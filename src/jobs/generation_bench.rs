//! `spotinfer bench` on a generation model: prompt records in, run in batches as a worker admits
//! them (the same task, defaults and decode loop), timed. What a user sizing a fleet reads: prompt
//! and generated tokens per second at each batch size asked, the time a batch takes to write its
//! first token, and the process's peak memory, on the binary they deploy.

use super::offline::{rusage, OfflineError};
use crate::model::{Item, Output, Predict};
use crate::record::{generation::Input, Record};
use serde::Serialize;
use std::sync::Arc;
use std::time::Instant;

/// One batch size's figures.
#[derive(Debug, Clone, Serialize)]
pub struct GenerationBench {
    /// Records a batch holds (the last may hold fewer).
    pub batch_size: usize,
    /// Prompt records run.
    pub records: usize,
    /// Records the model refused (a prompt past the context, a template that refuses it).
    pub refused: usize,
    /// Tokens of the prompts as the model read them.
    pub prompt_tokens: usize,
    /// Tokens generated (end tokens included).
    pub generated_tokens: usize,
    /// Seconds the batches took, prompts and generation together.
    pub seconds: f64,
    /// Generated tokens per second over the run.
    pub generated_tokens_per_s: f64,
    /// Prompt tokens per second over the run (read beside the generation, not alone).
    pub prompt_tokens_per_s: f64,
    /// Median seconds for a batch to write one token for each record (its prompts read and one
    /// step), over up to three batches run with one new token each.
    pub first_token_s: f64,
    /// The process's peak resident memory so far, MiB (the model included).
    pub peak_rss_mib: f64,
}

/// The generation inputs among `records` (the others, texts or pictures, are not prompts).
pub fn prompts(records: &[Record]) -> Vec<Arc<Input>> {
    records
        .iter()
        .filter_map(|r| r.generation.clone())
        .collect()
}

/// Runs every prompt through `task` in batches of `batch_size`, timed, after a few batches with
/// one new token each for the time to a first token (which also warm the model up).
pub fn bench(
    task: &dyn Predict,
    prompts: &[Arc<Input>],
    batch_size: usize,
) -> Result<GenerationBench, OfflineError> {
    let batch_size = batch_size.max(1);
    let mut firsts = vec![];
    for chunk in prompts.chunks(batch_size).take(3) {
        let one = chunk
            .iter()
            .map(|p| {
                let input = Input {
                    max_new_tokens: Some(1),
                    ..(**p).clone()
                };
                Item::Generate(Arc::new(input), Vec::new())
            })
            .collect::<Vec<_>>();
        let started = Instant::now();
        task.predict_items(&one)?;
        firsts.push(started.elapsed().as_secs_f64());
    }
    firsts.sort_by(f64::total_cmp);
    let (mut refused, mut prompt_tokens, mut generated_tokens) = (0, 0, 0);
    let started = Instant::now();
    for chunk in prompts.chunks(batch_size) {
        let items: Vec<Item> = chunk
            .iter()
            .map(|p| Item::Generate(p.clone(), Vec::new()))
            .collect();
        for output in task.predict_items(&items)?.outputs {
            match output {
                Output::Generated(c) => {
                    prompt_tokens += c.prompt_tokens;
                    generated_tokens += c.completion_tokens;
                }
                Output::Refused(why) => {
                    // The first reason in full, as a worker would record it; then only counted.
                    if refused == 0 {
                        tracing::warn!(reason = %why, "a prompt record refused");
                    }
                    refused += 1;
                }
                _ => refused += 1,
            }
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    Ok(GenerationBench {
        batch_size,
        records: prompts.len(),
        refused,
        prompt_tokens,
        generated_tokens,
        seconds,
        generated_tokens_per_s: generated_tokens as f64 / seconds,
        prompt_tokens_per_s: prompt_tokens as f64 / seconds,
        first_token_s: firsts.get(firsts.len() / 2).copied().unwrap_or(0.0),
        peak_rss_mib: rusage().2 / 1024.0,
    })
}
