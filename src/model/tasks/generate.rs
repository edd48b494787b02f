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
//! The network and the decode loop are the engine's (`model::engines::decoder`).

use crate::model::engines::decoder::{
    Build, DecoderPrecision, Generated, Input, Interrupt, LanguageModel, Request, Sampling,
    Scheduler,
};
use crate::model::seam::{unfit, Checkpoint, Checkpoints, Infer, Settled, WindowRule};
use crate::model::spec::Task;
use crate::model::Output;
use crate::model::{
    default_model_name, weights_hash, Backend, DeviceChoice, LoadOptions, ModelError, ModelInfo,
    Precision, Predicted, Reads,
};
use crate::model::{Item, Joining, Predict};
use crate::record::{Record, RecordError};
use crate::shutdown::Shutdown;
use futures::future::BoxFuture;
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
    /// [`GenerateTask::open`] with an interrupt nobody sets: its batches always run to their
    /// end (`bench`, `models check`).
    pub fn open_uninterrupted(
        path: &Path,
        options: &LoadOptions,
        defaults: GenerationDefaults,
    ) -> Result<Self, ModelError> {
        Self::open(path, options, defaults, Interrupt::new())
    }

    /// Loads the generation model at `path` (a `.gguf` file, or a transformers folder) to run
    /// on the CPU decoder, in f32 unless `options` ask for a GGUF's blocks or bf16
    /// ([`decoder_precision`]);
    /// `interrupt` stops its batches (the seam sets it when the pipeline stops).
    pub fn open(
        path: &Path,
        options: &LoadOptions,
        defaults: GenerationDefaults,
        interrupt: Interrupt,
    ) -> Result<Self, ModelError> {
        let precision =
            decoder_precision(options.precision).map_err(|message| ModelError::Unsupported {
                path: path.to_path_buf(),
                message,
            })?;
        let build = decoder_build(options, precision, &defaults).map_err(|message| {
            ModelError::Unsupported {
                path: path.to_path_buf(),
                message,
            }
        })?;
        let model = LanguageModel::open_as(path, &build)?;
        let files: Vec<&Path> = model.weight_files.iter().map(PathBuf::as_path).collect();
        // The hash names what decides the tokens, so each result row says what it was made
        // under: the weights; the engine when it is not the CPU decoder in f32 (bf16 and the
        // paged decoder round differently: `+bf16`, `+paged-…`); and after `~` the worker's
        // defaults, tokenizer and template (`settings_digest`). A checkpoint is kept under the
        // hash without the engine's mark (`resume_key`): a rollout that changes the weights or
        // settings starts interrupted answers over, one that changes the engine continues them.
        let engine = match (&build, model.precision()) {
            (Build::Paged { dtype, .. }, _) => format!("+paged-{dtype:?}").to_lowercase(),
            (_, DecoderPrecision::Bf16) => "+bf16".into(),
            (_, DecoderPrecision::Gguf) => "+gguf".into(),
            _ => String::new(),
        };
        let weights = format!("{}{engine}", weights_hash(&files)?);
        let hash = format!("{weights}~{}", settings_digest(path, &defaults));
        let info = ModelInfo {
            name: options
                .name
                .clone()
                .unwrap_or_else(|| default_model_name(path)),
            hash,
            dim: 0,
            max_seq_len: model.context(),
            device: match build {
                Build::Paged { .. } => format!("{} from {}", model.kernels(), model.format),
                Build::Cpu(..) => format!(
                    "Cpu (decoder, {} from {}, {})",
                    match model.precision() {
                        DecoderPrecision::Bf16 => "bf16",
                        DecoderPrecision::Gguf => "GGUF blocks",
                        _ => "f32",
                    },
                    model.format,
                    model.kernels()
                ),
            },
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

/// What decides a generation's tokens beside the weights and the record, in 8 hex digits: the
/// worker's defaults a record may leave out, and a transformers folder's config, tokenizer,
/// chat template and generation config (a GGUF file holds its own in the weights' hash).
fn settings_digest(path: &Path, d: &GenerationDefaults) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    let defaults = (
        d.max_new_tokens,
        d.temperature,
        d.top_p,
        d.top_k,
        d.truncate_prompt,
    );
    h.update(format!("{defaults:?}"));
    if path.is_dir() {
        for file in [
            "config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "chat_template.jinja",
            "generation_config.json",
        ] {
            h.update(file);
            match std::fs::read(path.join(file)) {
                Ok(bytes) => {
                    h.update((bytes.len() as u64).to_le_bytes());
                    h.update(bytes);
                }
                Err(_) => h.update(b"absent"),
            }
        }
    }
    hex::encode(&h.finalize()[..4])
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
            constraint: input.constraint.clone(),
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

/// How long the infer stage waits, after the shutdown began, for a generation batch to come
/// back interrupted (its running step finishes first: a long prompt's prefill on a small CPU
/// can take a second or two). Reading the checkpoints is given as long.
pub const INTERRUPT_GRACE: Duration = Duration::from_secs(5);

/// A generation model on its thread, serving its task ([`Infer`]), with resumption:
///
/// * before a batch goes to the model ([`Infer::ready`]), the checkpoint of each record is
///   read: a record an earlier worker was interrupted on continues from the tokens it wrote;
/// * when the batch comes back ([`Infer::settle`]), a record the model refused becomes a
///   failure with the reason; one the shutdown interrupted keeps its tokens on the record and
///   goes back; a finished one keeps its tokens too, in case the shutdown hands it back before
///   the sink commits it (its next delivery then finishes without generating);
/// * at shutdown ([`Infer::hand_back`]), the tokens the handed-back records carry are saved,
///   keyed by record id, model and the hash of the record's prompt and options, and marked
///   with the weights and settings that wrote them (only they resume from them) and the
///   engine (any engine resumes them; one that did not write them says so). A record on its last
///   delivery attempt goes to the dead-letter topic: its checkpoint is deleted instead. A
///   committed result or a failure row deletes its checkpoint in the commit's transaction
///   (`Infer::checkpointed`).
pub struct Generations {
    handle: crate::model::ModelHandle,
    checkpoints: Option<std::sync::Arc<dyn Checkpoints>>,
    /// The interrupt the task on `handle`'s thread was opened with: set when the pipeline's
    /// run stops ([`Infer::start`]).
    interrupt: Interrupt,
    /// `--max-generation-seconds`: a record's time limit, which bounds a batch's.
    max_seconds: Option<Duration>,
}

impl Generations {
    /// Serves the generation model on `handle`'s thread (opened with `interrupt` and a time
    /// limit of `max_seconds` a record), resuming from and saving to `checkpoints` (none: every
    /// generation starts over).
    pub fn new(
        handle: crate::model::ModelHandle,
        checkpoints: Option<std::sync::Arc<dyn Checkpoints>>,
        interrupt: Interrupt,
        max_seconds: Option<Duration>,
    ) -> Self {
        Self {
            handle,
            checkpoints,
            interrupt,
            max_seconds,
        }
    }

    /// Puts each generation record's checkpointed tokens on it. A store that cannot be read (or
    /// not within [`INTERRUPT_GRACE`]) costs only the resumption: the records start over.
    async fn resume(&self, records: &mut [&mut Record]) {
        let Some(store) = &self.checkpoints else {
            return;
        };
        let keys: Vec<(String, String)> = records
            .iter()
            .filter_map(|r| Some((r.id.clone(), r.generation.as_ref()?.sha256())))
            .collect();
        if keys.is_empty() {
            return;
        }
        let info = self.handle.info();
        let key = resume_key(&info.hash);
        let read = store.read(&info.name, &key, &keys);
        let found = match tokio::time::timeout(INTERRUPT_GRACE, read).await {
            Ok(Ok(found)) => found,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "cannot read the generation checkpoints; these records start over");
                return;
            }
            Err(_) => {
                tracing::warn!(
                    "reading the generation checkpoints timed out; these records start over"
                );
                return;
            }
        };
        let with_prompt = records.iter_mut().filter(|r| r.generation.is_some());
        let (mut resumed, mut elsewhere) = (0, std::collections::BTreeSet::new());
        for (r, key) in with_prompt.zip(keys) {
            if let Some(saved) = found.get(&key) {
                r.checkpoint = saved.tokens.clone();
                resumed += 1;
                if saved.engine.as_deref() != Some(info.device.as_str()) {
                    elsewhere.insert(saved.engine.as_deref().unwrap_or("not recorded"));
                }
            }
        }
        if resumed > 0 {
            tracing::info!(
                records = resumed,
                "resuming generations from their checkpoints"
            );
        }
        if !elsewhere.is_empty() {
            // Another engine rounds differently: what follows is a valid continuation of the
            // saved tokens, which the uninterrupted run could have left after a near-tie.
            tracing::warn!(
                written_by = ?elsewhere,
                engine = %info.device,
                "continuing generations another engine began: each continues its saved tokens, \
                 and may part from the text an uninterrupted run on either engine writes"
            );
        }
    }

    /// Saves `keep`'s checkpoints and deletes `dead`'s by `deadline`; how many it saved.
    async fn save(
        &self,
        store: &dyn Checkpoints,
        keep: Vec<Checkpoint>,
        dead: Vec<String>,
        deadline: tokio::time::Instant,
    ) -> usize {
        let name = &self.handle.info().name;
        if !dead.is_empty() {
            let forget = store.forget(name, &dead);
            if let Ok(Err(e)) = tokio::time::timeout_at(deadline, forget).await {
                tracing::warn!(error = %e, "cannot delete the checkpoints of dead-lettered generations");
            }
        }
        if keep.is_empty() {
            return 0;
        }
        match tokio::time::timeout_at(deadline, store.save(&keep)).await {
            Ok(Ok(())) => {
                let tokens: usize = keep.iter().map(|c| c.tokens.len()).sum();
                tracing::info!(
                    records = keep.len(),
                    tokens,
                    "saved the generation checkpoints"
                );
                keep.len()
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "cannot save the generation checkpoints; these records will start over");
                0
            }
            Err(_) => {
                tracing::warn!(
                    "the shutdown budget ran out before the generation checkpoints were saved"
                );
                0
            }
        }
    }
}

/// Batches a generation model's worker holds: one decoding and one queued. Its rate is not
/// measured (a completion's length decides it), and every message held at a SIGTERM goes back
/// (its tokens checkpointed), a delivery attempt each.
pub const GENERATION_WINDOW_BATCHES: usize = 2;

impl Infer for Generations {
    fn start<'a>(&'a self, shutdown: &'a Shutdown) -> BoxFuture<'a, ()> {
        self.interrupt.clear();
        let (interrupt, run) = (self.interrupt.clone(), shutdown.clone());
        tokio::spawn(async move {
            run.cancelled().await;
            interrupt.set();
        });
        Box::pin(async move {
            let Some(store) = &self.checkpoints else {
                return;
            };
            match store.purge().await {
                Ok(0) => {}
                Ok(n) => tracing::info!(
                    checkpoints = n,
                    "purged generation checkpoints no delivery can resume from"
                ),
                Err(e) => tracing::warn!(error = %e, "cannot purge old generation checkpoints"),
            }
        })
    }

    fn ready<'a>(
        &'a self,
        mut records: Vec<&'a mut Record>,
        _shutdown: &'a Shutdown,
    ) -> BoxFuture<'a, Option<Vec<Result<Item, RecordError>>>> {
        Box::pin(async move {
            self.resume(&mut records).await;
            let info = self.handle.info();
            let items = records
                .iter()
                .map(|r| match (unfit(info, r), &r.generation) {
                    (Some(why), _) => Err(why),
                    (None, Some(g)) => Ok(Item::Generate(g.clone(), r.checkpoint.clone())),
                    (None, None) => Err(RecordError::Missing("prompt")),
                })
                .collect();
            Some(items)
        })
    }

    fn grace(&self) -> Duration {
        INTERRUPT_GRACE
    }

    fn checkpointed(&self) -> bool {
        true
    }

    fn finishes_at_shutdown(&self, record: &Record) -> bool {
        record.generation.is_none()
    }

    fn window(&self) -> WindowRule {
        WindowRule::Batches(GENERATION_WINDOW_BATCHES)
    }

    fn longest_batch(&self, batch_size: usize) -> Option<Duration> {
        // One after another at worst.
        let batch = u32::try_from(batch_size).unwrap_or(u32::MAX);
        self.max_seconds.map(|limit| limit.saturating_mul(batch))
    }

    fn settle(&self, record: &mut Record, output: Output) -> Settled {
        match output {
            Output::Refused(why) => Settled::Refuse(RecordError::Generation(why)),
            Output::Interrupted(tokens) => {
                record.checkpoint = tokens;
                Settled::Interrupted
            }
            Output::Generated(c) => {
                record.checkpoint = c.tokens.clone();
                Settled::Keep(Output::Generated(c))
            }
            other => Settled::Keep(other),
        }
    }

    fn hand_back<'a>(
        &'a self,
        records: Vec<(&'a Record, bool)>,
        deadline: tokio::time::Instant,
    ) -> BoxFuture<'a, usize> {
        Box::pin(async move {
            let Some(store) = &self.checkpoints else {
                return 0;
            };
            let info = self.handle.info();
            let model_hash = resume_key(&info.hash);
            let (mut keep, mut dead) = (Vec::new(), Vec::new());
            for (r, last_attempt) in records {
                let Some(g) = &r.generation else { continue };
                if last_attempt {
                    dead.push(r.id.clone());
                } else if !r.checkpoint.is_empty() {
                    keep.push(Checkpoint {
                        record_id: r.id.clone(),
                        model: info.name.clone(),
                        model_hash: model_hash.clone(),
                        input_sha256: g.sha256(),
                        tokens: r.checkpoint.clone(),
                        engine: info.device.clone(),
                    });
                }
            }
            self.save(store.as_ref(), keep, dead, deadline).await
        })
    }
}

/// The decoder's precision for `--precision`: `auto` and `gguf` keep a GGUF's weights in their
/// block formats and multiply them as llama.cpp does (a seventh of f32's memory, and faster
/// than f32 one answer at a time and in batches: docs/generate.md; its top-1 agreement with
/// llama.cpp is f32's); a folder, which has no blocks, is f32 either way. `f32` widens a GGUF's
/// blocks as llama.cpp widens them, whose greedy tokens are the model's own library's on those
/// weights (transformers'); `bf16` only when asked, since rounding the weights and activations
/// can part a generation from them; `f16` and `int8` are the encoders' and refused with the
/// reason.
pub fn decoder_precision(precision: Precision) -> Result<DecoderPrecision, String> {
    match precision {
        Precision::F32 => Ok(DecoderPrecision::F32),
        Precision::Auto | Precision::Gguf => Ok(DecoderPrecision::Gguf),
        Precision::Bf16 => Ok(DecoderPrecision::Bf16),
        Precision::F16 => Err(refused("f16")),
        Precision::Int8 => Err(refused("int8")),
    }
}

/// Token slots of the paged decoder's cache when the worker sets no `--max-batch-tokens`.
pub const PAGED_CACHE_TOKENS: usize = 65_536;

/// The network a generation model is built into. On a CUDA device (`--device cuda`, or `auto`
/// where one is found) the paged decoder, bf16 under `--precision auto`: its GPU check passed on
/// an H200 (docs/generate.md); `--backend fused` keeps the CPU decoder there, as does
/// `--precision gguf` (the quantised blocks are the CPU decoder's). `--backend paged` runs the
/// paged decoder on `--device` whatever it is (candle's CPU backend, for tests). Elsewhere the
/// CPU decoder in `precision`. The paged cache is as large as the worker's
/// `--max-batch-tokens` (else [`PAGED_CACHE_TOKENS`]). The choice is logged at start.
pub fn decoder_build(
    options: &LoadOptions,
    precision: DecoderPrecision,
    defaults: &GenerationDefaults,
) -> Result<Build, String> {
    let cpu = Build::Cpu(precision, options.cpu_kernels);
    let device = match (options.backend, options.device) {
        (Backend::Paged, choice) => select(choice)?,
        (Backend::Auto, DeviceChoice::Cuda | DeviceChoice::Auto) => match select(options.device)? {
            d if d.is_cpu() => return Ok(cpu),
            _ if options.precision == Precision::Gguf => {
                tracing::info!(
                    "generation runs on the CPU decoder: --precision gguf keeps a GGUF's blocks, \
                     which only the CPU decoder multiplies"
                );
                return Ok(cpu);
            }
            d => d,
        },
        (_, DeviceChoice::Cuda) => {
            tracing::info!("generation runs on the CPU decoder, as --backend asks");
            return Ok(cpu);
        }
        _ => return Ok(cpu),
    };
    let dtype = match (options.precision, device.is_cpu()) {
        (Precision::Auto, false) | (Precision::Bf16, _) => candle_core::DType::BF16,
        (Precision::Auto | Precision::F32, _) => candle_core::DType::F32,
        (other, _) => {
            return Err(format!(
                "the paged decoder computes in f32 or bf16, not {other:?}"
            ))
        }
    };
    let cache_tokens = match defaults.max_batch_tokens {
        0 => PAGED_CACHE_TOKENS,
        n => n,
    };
    tracing::info!(
        ?device,
        ?dtype,
        cache_tokens,
        "generation runs on the paged decoder"
    );
    Ok(Build::Paged {
        device,
        dtype,
        cache_tokens,
    })
}

fn select(choice: DeviceChoice) -> Result<candle_core::Device, String> {
    crate::model::engines::select_device(choice).map_err(|e| e.to_string())
}

/// The hash a generation's checkpoints are kept under: the model's hash without the engine's
/// mark (`weights+engine~settings` → `weights~settings`), so any engine resumes them.
fn resume_key(hash: &str) -> String {
    let (weights, settings) = hash.split_once('~').unwrap_or((hash, ""));
    let weights = weights.split_once('+').map_or(weights, |(w, _)| w);
    format!("{weights}~{settings}")
}

fn refused(asked: &str) -> String {
    format!(
        "a generation model computes in a GGUF's own blocks (auto, gguf), f32 or bf16 on the \
         CPU, not {asked}"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelHandle;
    use crate::pipeline::testkit::{execute, sqlite};
    use std::sync::Arc;

    /// A generation model's thread that is never asked to compute: what the checkpoint hooks
    /// need of it is its name and its weights' hash.
    struct Named(ModelInfo);

    impl Predict for Named {
        fn info(&self) -> &ModelInfo {
            &self.0
        }
        fn predict_items(&self, _: &[Item]) -> Result<Predicted, ModelError> {
            Err(ModelError::Input("not computed in these tests".into()))
        }
    }

    /// The generation model `llm` with weights `hash`, keeping checkpoints in `store`.
    fn served(store: &crate::external::store::Store, hash: &str) -> Generations {
        served_on(store, hash, "cpu")
    }

    /// [`served`] on the engine `device`.
    fn served_on(store: &crate::external::store::Store, hash: &str, device: &str) -> Generations {
        let info = ModelInfo {
            name: "llm".into(),
            hash: hash.into(),
            dim: 0,
            max_seq_len: 64,
            device: device.into(),
            prompts: Vec::new(),
            task: Task::Generate,
            labels: Vec::new(),
            reads: Reads::Prompts,
            processor: None,
        };
        let handle = ModelHandle::spawn(Named(info)).unwrap();
        Generations::new(
            handle,
            Some(Arc::new(store.clone())),
            Interrupt::new(),
            None,
        )
    }

    /// Generation record `id` holding `tokens` as its progress.
    fn interrupted(id: &str, tokens: &[u32]) -> Record {
        let data = serde_json::json!({"id": id, "prompt": "Once upon a time"}).to_string();
        let mut r = crate::record::parse(data.as_bytes(), 1 << 20).unwrap();
        r.checkpoint = tokens.to_vec();
        r
    }

    fn far() -> tokio::time::Instant {
        tokio::time::Instant::now() + Duration::from_secs(10)
    }

    /// Hands `records` (id, tokens, on its last attempt) back through the seam.
    async fn hand_back(g: &Generations, records: &[(&str, &[u32], bool)]) -> usize {
        let held: Vec<Record> = records
            .iter()
            .map(|(id, t, _)| interrupted(id, t))
            .collect();
        let back = held.iter().zip(records).map(|(r, (_, _, last))| (r, *last));
        g.hand_back(back.collect(), far()).await
    }

    /// The checkpointed tokens `g` readies record `id` with (what its next delivery resumes).
    async fn resumed(g: &Generations, id: &str) -> Vec<u32> {
        let mut r = interrupted(id, &[]);
        let items = g.ready(vec![&mut r], &Shutdown::new()).await.unwrap();
        match &items[0] {
            Ok(Item::Generate(_, tokens)) => tokens.clone(),
            other => panic!("{other:?}"),
        }
    }

    /// `--precision`: a transformers folder computes in f32 unless bf16 is asked for (its device
    /// says which, with the kernels, and bf16's hash is marked so that its checkpoints are its
    /// own), and the encoders' f16 and int8 are refused at load; `auto` and `gguf` on a folder
    /// (no blocks) are f32. (A GGUF's blocks: tests/llm_gguf.rs.)
    #[test]
    fn a_generation_model_computes_in_f32_unless_bf16_is_asked() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/llm/models/qwen3");
        let open = |precision| open_in(&path, precision);
        let f32 = open(Precision::F32).unwrap().info;
        assert!(f32.device.starts_with("Cpu (decoder, f32 from "));
        for no_blocks in [Precision::Auto, Precision::Gguf] {
            let no_blocks = open(no_blocks).unwrap().info;
            assert_eq!(
                (no_blocks.device, no_blocks.hash),
                (f32.device.clone(), f32.hash.clone())
            );
        }
        for refused in [Precision::F16, Precision::Int8] {
            let e = open(refused).err().unwrap().to_string();
            assert!(
                e.contains("a GGUF's own blocks (auto, gguf), f32 or bf16"),
                "{e}"
            );
        }
        match open(Precision::Bf16) {
            Ok(t) => {
                assert!(t.info.device.starts_with("Cpu (decoder, bf16 from "));
                // Its checkpoints are its own: f32's weights hash, marked.
                let (weights, settings) = f32.hash.split_once('~').unwrap();
                assert_eq!(t.info.hash, format!("{weights}+bf16~{settings}"));
            }
            Err(e) => assert!(!spotinfer_fused_cpu::bf16_supported(), "{e}"),
        }
    }

    /// The generation model at `path` on the CPU in `precision`, with the default settings.
    fn open_in(path: &std::path::Path, precision: Precision) -> Result<GenerateTask, ModelError> {
        let options = LoadOptions::new(crate::model::DeviceChoice::Cpu).precision(precision);
        GenerateTask::open(
            path,
            &options,
            GenerationDefaults::default(),
            Interrupt::new(),
        )
    }

    /// `--precision auto` (and `gguf`) on a quantised GGUF keeps its blocks: the device line says
    /// so, and the hash is marked so that its results and checkpoints name the engine; `f32`
    /// widens them.
    #[test]
    fn a_gguf_keeps_its_blocks_unless_f32_is_asked_and_says_so() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("models/SmolLM2-135M-Instruct/SmolLM2-135M-Instruct.Q4_1.gguf");
        let open = |precision| open_in(&path, precision).unwrap().info;
        let (f32, blocks, gguf) = (
            open(Precision::F32),
            open(Precision::Auto),
            open(Precision::Gguf),
        );
        assert_eq!((&blocks.device, &blocks.hash), (&gguf.device, &gguf.hash));
        assert!(
            f32.device.starts_with("Cpu (decoder, f32 from GGUF"),
            "{}",
            f32.device
        );
        assert!(
            blocks
                .device
                .starts_with("Cpu (decoder, GGUF blocks from GGUF")
                && blocks.device.contains("int8"),
            "{}",
            blocks.device
        );
        let (weights, settings) = f32.hash.split_once('~').unwrap();
        assert_eq!(blocks.hash, format!("{weights}+gguf~{settings}"));
    }

    /// Issue 53: what decides the tokens besides the weights is in the hash checkpoints are kept
    /// under: each generation default a record may leave out, and the folder's tokenizer and
    /// chat template; the same settings give the same hash.
    #[test]
    fn a_generation_models_hash_names_its_settings() {
        let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/llm/models/qwen3");
        let copy = tempfile::tempdir().unwrap();
        for f in std::fs::read_dir(&fixture).unwrap() {
            let f = f.unwrap().path();
            std::fs::copy(&f, copy.path().join(f.file_name().unwrap())).unwrap();
        }
        let hash = |defaults: GenerationDefaults| {
            let options = LoadOptions::new(crate::model::DeviceChoice::Cpu);
            let task = GenerateTask::open(copy.path(), &options, defaults, Interrupt::new());
            task.unwrap().info.hash
        };
        let base = hash(GenerationDefaults::default());
        assert_eq!(base, hash(GenerationDefaults::default()));
        let d = GenerationDefaults::default;
        let changed = [
            GenerationDefaults {
                max_new_tokens: 64,
                ..d()
            },
            GenerationDefaults {
                temperature: 0.7,
                ..d()
            },
            GenerationDefaults { top_p: 0.9, ..d() },
            GenerationDefaults { top_k: 40, ..d() },
            GenerationDefaults {
                truncate_prompt: true,
                ..d()
            },
        ];
        let mut seen = std::collections::HashSet::from([base.clone()]);
        for defaults in changed {
            let h = hash(defaults.clone());
            assert_eq!(
                h.split_once('~').unwrap().0,
                base.split_once('~').unwrap().0
            );
            assert!(seen.insert(h), "{defaults:?} keeps the hash");
        }
        // A limit that does not decide the tokens (how long a batch may run) keeps it.
        let timed = GenerationDefaults {
            max_seconds: Some(Duration::from_secs(9)),
            ..d()
        };
        assert_eq!(hash(timed), base);
        let template = copy.path().join("chat_template.jinja");
        let text = std::fs::read_to_string(&template).unwrap();
        std::fs::write(&template, format!("{text}\n")).unwrap();
        assert!(seen.insert(hash(d())), "the chat template keeps the hash");
        let config = copy.path().join("tokenizer_config.json");
        let mut json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&config).unwrap()).unwrap();
        json["clean_up_tokenization_spaces"] = serde_json::json!(true);
        std::fs::write(&config, json.to_string()).unwrap();
        assert!(
            seen.insert(hash(d())),
            "the tokenizer config keeps the hash"
        );
    }

    /// Issue 40: a model swapped under the same name does not resume another model's tokens.
    #[tokio::test]
    async fn a_checkpoint_resumes_only_on_the_weights_that_wrote_it() {
        let (_dir, store) = sqlite().await;
        let (a, b) = (served(&store, "aaaa"), served(&store, "bbbb"));
        assert_eq!(hand_back(&a, &[("r", &[7, 8], false)]).await, 1);
        assert_eq!(resumed(&b, "r").await, Vec::<u32>::new());
        assert_eq!(resumed(&a, "r").await, [7, 8]);
    }

    /// Issue 52: a checkpoint names the engine that wrote it and is kept under the weights and
    /// settings alone, so another engine (bf16, the paged decoder) continues it; other weights
    /// or other settings start over.
    #[tokio::test]
    async fn a_checkpoint_resumes_on_another_engine_and_names_the_one_that_wrote_it() {
        let (_dir, store) = sqlite().await;
        let cpu = served_on(&store, "w~s", "Cpu (decoder, f32)");
        assert_eq!(hand_back(&cpu, &[("r", &[7, 8], false)]).await, 1);
        let engine: String = sqlx_scalar(&store, "SELECT engine FROM generation_checkpoints").await;
        assert_eq!(engine, "Cpu (decoder, f32)");
        for (hash, device, want) in [
            ("w+paged-bf16~s", "Cuda(0) paged bf16", &[7u32, 8][..]),
            ("w+bf16~s", "Cpu (decoder, bf16)", &[7, 8]),
            ("w~s", "Cpu (decoder, f32)", &[7, 8]),
            ("v+paged-bf16~s", "Cuda(0) paged bf16", &[]),
            ("w+paged-bf16~t", "Cuda(0) paged bf16", &[]),
        ] {
            let other = served_on(&store, hash, device);
            assert_eq!(resumed(&other, "r").await, want, "{hash} on {device}");
        }
        let paged = served_on(&store, "w+paged-bf16~s", "Cuda(0) paged bf16");
        hand_back(&paged, &[("r", &[7, 8, 9], false)]).await;
        let engine: String = sqlx_scalar(&store, "SELECT engine FROM generation_checkpoints").await;
        assert_eq!(engine, "Cuda(0) paged bf16");
        assert_eq!(resumed(&cpu, "r").await, [7, 8, 9]);
    }

    /// The one text `sql` selects from the test's SQLite store.
    async fn sqlx_scalar(store: &crate::external::store::Store, sql: &str) -> String {
        let crate::external::store::Store::Sqlite(pool) = store else {
            panic!("the tests' store is SQLite");
        };
        sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
    }

    /// Issue 40: a record the hand-back dead-letters (its last delivery attempt) leaves no
    /// checkpoint behind, not even one an earlier delivery saved; the others are saved.
    #[tokio::test]
    async fn a_dead_lettered_generation_leaves_no_checkpoint() {
        let (_dir, store) = sqlite().await;
        let a = served(&store, "aaaa");
        hand_back(&a, &[("last", &[1], false)]).await;
        let back: [(&str, &[u32], bool); 2] = [("last", &[1, 2], true), ("early", &[3], false)];
        assert_eq!(hand_back(&a, &back).await, 1);
        assert_eq!(resumed(&a, "last").await, Vec::<u32>::new());
        assert_eq!(resumed(&a, "early").await, [3]);
        assert_eq!(store.checkpoint_count().await.unwrap(), 1);
    }

    /// Issue 40: checkpoints no delivery can come back for are purged; recent ones stay.
    #[tokio::test]
    async fn checkpoints_past_the_retention_are_purged() {
        let (_dir, store) = sqlite().await;
        let a = served(&store, "aaaa");
        hand_back(&a, &[("old", &[1], false), ("new", &[2], false)]).await;
        execute(
            &store,
            "UPDATE generation_checkpoints SET saved_at = '2020-01-01T00:00:00.000Z' \
             WHERE record_id = 'old'",
        )
        .await;
        assert_eq!(store.purge_checkpoints().await.unwrap(), 1);
        assert_eq!(resumed(&a, "new").await, [2]);
    }

    /// A result settles through the seam as the sink and the hand-back need it: a refusal is a
    /// failure with its reason, an interruption goes back holding its tokens.
    #[tokio::test]
    async fn results_settle_as_refusals_interruptions_or_completions() {
        let (_dir, store) = sqlite().await;
        let g = served(&store, "aaaa");
        let mut r = interrupted("r", &[]);
        assert!(matches!(
            g.settle(&mut r, Output::Refused("too long".into())),
            Settled::Refuse(RecordError::Generation(why)) if why == "too long"
        ));
        assert!(matches!(
            g.settle(&mut r, Output::Interrupted(vec![4, 5])),
            Settled::Interrupted
        ));
        assert_eq!(r.checkpoint, [4, 5]);
    }

    /// Which network a generation model is built into: the CPU decoder on the CPU (also when
    /// `auto` finds no CUDA device, as on this machine), the paged decoder where `--backend
    /// paged` asks on any device, and the CPU decoder where `--backend fused` asks on CUDA
    /// (without opening a device). A default CUDA build is checked on a GPU (bench/gpu-check.sh).
    #[test]
    fn a_generation_model_is_built_for_the_device_and_backend_asked() {
        let build = |backend, device, precision| {
            let options = LoadOptions {
                backend,
                precision,
                ..LoadOptions::new(device)
            };
            decoder_build(
                &options,
                DecoderPrecision::Gguf,
                &GenerationDefaults::default(),
            )
        };
        let cpu = |b: Result<Build, String>| matches!(b, Ok(Build::Cpu(DecoderPrecision::Gguf, _)));
        assert!(cpu(build(
            Backend::Auto,
            DeviceChoice::Cpu,
            Precision::Auto
        )));
        if !cfg!(feature = "cuda") {
            assert!(cpu(build(
                Backend::Auto,
                DeviceChoice::Auto,
                Precision::Auto
            )));
            assert!(build(Backend::Auto, DeviceChoice::Cuda, Precision::Auto).is_err());
        }
        assert!(cpu(build(
            Backend::Fused,
            DeviceChoice::Cuda,
            Precision::Auto
        )));
        match build(Backend::Paged, DeviceChoice::Cpu, Precision::Auto) {
            Ok(Build::Paged {
                device,
                dtype,
                cache_tokens,
            }) => {
                assert!(device.is_cpu());
                assert_eq!(dtype, candle_core::DType::F32);
                assert_eq!(cache_tokens, PAGED_CACHE_TOKENS);
            }
            other => panic!("{other:?}"),
        }
        assert!(build(Backend::Paged, DeviceChoice::Cpu, Precision::Gguf).is_err());
    }
}
