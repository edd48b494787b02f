//! The generation task: a record's prompt or conversation and options in, a completion out
//! (`text`, `finish_reason`, `prompt_tokens`, `completion_tokens`).
//!
//! The options a record leaves out take the worker's defaults ([`GenerationDefaults`], from its
//! flags). A record the model cannot compute (a prompt past its context, a template that refuses
//! the messages, a generation past `--max-generation-seconds`) comes out as
//! [`Output::Refused`] with the reason, so the pipeline records it alone and the rest of the
//! batch commits. At shutdown the worker sets the task's [`Interrupt`]: the batch stops at its
//! next step and each unfinished record comes out as [`Output::Interrupted`] with its tokens,
//! for the worker to checkpoint before it hands the message back.
//!
//! On the worker's model thread the task is [`Joining`]: each batch is admitted into one
//! decode loop ([`Scheduler`]) as it arrives, its sequences run beside those of the batches
//! before it, and it is answered when its last record is done.
//!
//! The network and the decode loop are the engine's (`model::generate`).

use super::Output;
use crate::model::generate::{
    Generated, Input, Interrupt, LanguageModel, Request, Sampling, Scheduler,
};
use crate::model::spec::Task;
use crate::model::thread::{Item, Joining, Predict};
use crate::model::{
    default_model_name, weights_hash, LoadOptions, ModelError, ModelInfo, Predicted, Reads,
};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The worker's generation settings: the options a record may leave out, and the limits.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationDefaults {
    /// Tokens to generate at most, when the record does not say.
    pub max_new_tokens: usize,
    /// 0: greedy.
    pub temperature: f32,
    /// Nucleus sampling's mass (1: off).
    pub top_p: f32,
    /// Likeliest tokens kept (0: all).
    pub top_k: usize,
    /// Cut a prompt's start to fit the context instead of refusing it.
    pub truncate_prompt: bool,
    /// Longest one record may generate for.
    pub max_seconds: Option<Duration>,
    /// Most cache tokens (prompts and the completions they may grow to) decoding at once; 0: no
    /// limit.
    pub max_batch_tokens: usize,
}

impl Default for GenerationDefaults {
    fn default() -> Self {
        Self {
            max_new_tokens: 256,
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            truncate_prompt: false,
            max_seconds: None,
            max_batch_tokens: 0,
        }
    }
}

/// A loaded generation model, the worker's defaults, and the decode loop the model thread
/// admits batches into.
pub struct GenerateTask {
    model: LanguageModel,
    defaults: GenerationDefaults,
    interrupt: Interrupt,
    info: ModelInfo,
    scheduler: Scheduler,
    /// Each admitted batch: when it came, and how many checkpointed tokens each record brought.
    admitted: std::collections::HashMap<u64, (std::time::Instant, Vec<usize>)>,
}

impl GenerateTask {
    /// Loads the generation model at `path` (a `.gguf` file, or a transformers folder) to run
    /// on the CPU decoder in f32; `interrupt` is the flag the worker sets at shutdown.
    pub fn open(
        path: &Path,
        options: &LoadOptions,
        defaults: GenerationDefaults,
        interrupt: Interrupt,
    ) -> Result<Self, ModelError> {
        let model = LanguageModel::open(path)?;
        let files: Vec<&Path> = model.weight_files.iter().map(PathBuf::as_path).collect();
        let info = ModelInfo {
            name: options
                .name
                .clone()
                .unwrap_or_else(|| default_model_name(path)),
            hash: weights_hash(&files)?,
            dim: 0,
            max_seq_len: model.context(),
            device: format!(
                "Cpu (decoder, f32 from {}, {})",
                model.format,
                model.kernels()
            ),
            prompts: Vec::new(),
            task: Task::Generate,
            labels: Vec::new(),
            reads: Reads::Prompts,
            processor: None,
        };
        Ok(Self {
            scheduler: Scheduler::new(defaults.max_batch_tokens, defaults.max_seconds),
            admitted: std::collections::HashMap::new(),
            model,
            defaults,
            interrupt,
            info,
        })
    }

    /// The batch's requests, or why the batch cannot be taken (an item that is not a prompt).
    fn requests(&self, items: &[Item]) -> Result<Vec<Request>, ModelError> {
        items
            .iter()
            .enumerate()
            .map(|(i, item)| match item {
                Item::Generate(input, resume) => Ok(self.defaults.request(input, resume)),
                _ => Err(ModelError::Input(format!(
                    "input {i}: a text or an image, but this model generates from a \"prompt\" or \"messages\""
                ))),
            })
            .collect()
    }
}

impl GenerationDefaults {
    /// A record's input with these defaults filled in, to continue from `resume`.
    pub fn request(&self, input: &Input, resume: &[u32]) -> Request {
        Request {
            prompt: input.prompt.clone(),
            max_new_tokens: input.max_new_tokens.unwrap_or(self.max_new_tokens),
            sampling: Sampling {
                temperature: input.temperature.unwrap_or(self.temperature),
                top_p: input.top_p.unwrap_or(self.top_p),
                top_k: input.top_k.unwrap_or(self.top_k),
                seed: input.seed,
            },
            stop: input.stop.clone(),
            resume: resume.to_vec(),
            truncate_prompt: self.truncate_prompt,
        }
    }
}

/// A batch's results as the pipeline takes them; the tokens counted are those generated here
/// (a resumed record's checkpointed ones are not).
fn outputs(
    generated: Vec<Generated>,
    resumed: &[usize],
    started: std::time::Instant,
) -> Result<Predicted, ModelError> {
    let mut tokens = 0;
    let outputs = generated
        .into_iter()
        .zip(resumed)
        .map(|(g, &resumed)| match g {
            Generated::Done(c) => {
                tokens += c.completion_tokens.saturating_sub(resumed);
                Output::Generated(c)
            }
            Generated::Interrupted(t) => {
                tokens += t.len().saturating_sub(resumed);
                Output::Interrupted(t)
            }
            Generated::Refused(why) => Output::Refused(why),
        })
        .collect();
    Predicted::checked(outputs, tokens, started)
}

impl Predict for GenerateTask {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// One batch alone, to the end (`models check`; the worker's model thread uses
    /// [`Joining`]).
    fn predict_items(&self, items: &[Item]) -> Result<Predicted, ModelError> {
        let started = std::time::Instant::now();
        let requests = self.requests(items)?;
        let resumed: Vec<usize> = requests.iter().map(|r| r.resume.len()).collect();
        let d = &self.defaults;
        let generated = self.model.generate(
            &requests,
            d.max_batch_tokens,
            &self.interrupt,
            d.max_seconds,
        );
        outputs(generated, &resumed, started)
    }

    fn joining(&mut self) -> Option<&mut dyn Joining> {
        Some(self)
    }
}

impl Joining for GenerateTask {
    fn admit(&mut self, job: u64, items: &[Item]) -> Result<(), ModelError> {
        let requests = self.requests(items)?;
        let resumed = requests.iter().map(|r| r.resume.len()).collect();
        self.admitted
            .insert(job, (std::time::Instant::now(), resumed));
        self.scheduler.admit(&self.model, job, requests);
        Ok(())
    }

    fn step(&mut self) -> Vec<(u64, Result<Predicted, ModelError>)> {
        let done = self.scheduler.step(&self.model, &self.interrupt);
        done.into_iter()
            .map(|(job, generated)| {
                let (started, resumed) = self
                    .admitted
                    .remove(&job)
                    .unwrap_or_else(|| (std::time::Instant::now(), Vec::new()));
                (job, outputs(generated, &resumed, started))
            })
            .collect()
    }

    fn idle(&self) -> bool {
        self.scheduler.is_idle()
    }

    fn forget(&mut self, job: u64) {
        self.scheduler.forget(job);
        self.admitted.remove(&job);
    }

    fn reset(&mut self) {
        let d = &self.defaults;
        self.scheduler = Scheduler::new(d.max_batch_tokens, d.max_seconds);
        self.admitted.clear();
    }
}
