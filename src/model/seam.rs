//! The one seam between the pipeline and the models: [`Served`], a model thread and its task
//! ([`Infer`]). The pipeline's infer stage (`crate::pipeline::infer`) has the task ready batches
//! of records, the thread compute them, and the task settle each result or refusal; the worker
//! asks the task what it decides around them (start, window, last chance, checkpoints). None of
//! them asks which task or engine is behind it.
//!
//! Each task implements it in its own file (`tasks::texts`, `tasks::image`, `tasks::generate`):
//! what its records must hold, how they are readied off the model thread (texts as they are,
//! tokenized by the model thread's preparer; pictures decoded; generations resumed from their
//! checkpoints), and what becomes of each result (kept, refused, or handed back interrupted).
//! `load::serve` picks the implementation for a loaded model.

use super::{Item, ModelHandle, ModelInfo, Output};
use crate::record::{Record, RecordError};
use crate::shutdown::Shutdown;
use futures::future::BoxFuture;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// A loaded model's task, as the pipeline sees it: records in, one result or one refusal per
/// record out, and the task's say in what the pipeline does around them. The computing itself
/// is the model thread's ([`Served::handle`]), which knows no task.
pub trait Infer: Send + Sync {
    /// Called as the pipeline starts (and again when it runs after an early drain) with the
    /// run's shutdown: a generation model clears its interrupt, arranges for it to be set when
    /// `shutdown` begins (its batch then stops, so what it wrote is checkpointed), and purges
    /// the checkpoints no delivery can resume from.
    fn start<'a>(&'a self, _shutdown: &'a Shutdown) -> BoxFuture<'a, ()> {
        Box::pin(std::future::ready(()))
    }
    /// Readies `records` for the model, off its thread: per record, in order, the item the
    /// model computes or why the record cannot be computed (a final failure, never a batch
    /// failure). `None`: the shutdown began first.
    fn ready<'a>(
        &'a self,
        records: Vec<&'a mut Record>,
        shutdown: &'a Shutdown,
    ) -> BoxFuture<'a, Option<Vec<Result<Item, RecordError>>>>;
    /// How long after the shutdown began a batch's results are still waited for: a decoder's
    /// come back interrupted, holding what they wrote. Zero: not waited for.
    fn grace(&self) -> Duration {
        Duration::ZERO
    }
    /// What becomes of one computed result; by default it is kept for the sink.
    fn settle(&self, _record: &mut Record, output: Output) -> Settled {
        Settled::Keep(output)
    }
    /// Whether a record's progress is kept between deliveries (a generation's checkpoint):
    /// then the transaction that commits its result or its failure row deletes it too.
    fn checkpointed(&self) -> bool {
        false
    }
    /// Whether `record`, on its last delivery attempt at shutdown, may be computed and committed
    /// within the shutdown budget rather than handed back (a generation may not: it can need
    /// far longer, and its checkpoint keeps what it wrote).
    fn finishes_at_shutdown(&self, _record: &Record) -> bool {
        true
    }
    /// What the model is timed on at start-up ([`WindowRule::Measured`]): an input like the
    /// task's records, made from `text` (a cross-encoder's the text paired with itself).
    fn probe(&self, info: &ModelInfo, text: String) -> Item {
        Item::Text(super::Text {
            text_pair: info.task.needs_pairs().then(|| text.clone()),
            ..super::Text::from(text)
        })
    }
    /// How many records the worker holds for this task: as many as the model computes in the
    /// window's seconds at its measured rate, capped or fixed in batches by the task.
    fn window(&self) -> WindowRule {
        WindowRule::Measured
    }
    /// The longest a batch of `batch_size` records may take when the task bounds it (a
    /// generation's time limit); `None`: as the measured rate says.
    fn longest_batch(&self, _batch_size: usize) -> Option<Duration> {
        None
    }
    /// Called at shutdown with the records about to go back to Pub/Sub (each with whether it is
    /// on its last delivery attempt) before `deadline`: keeps what they carry for their next
    /// delivery (a generation's tokens). Returns how many it kept.
    fn hand_back<'a>(
        &'a self,
        _records: Vec<(&'a Record, bool)>,
        _deadline: tokio::time::Instant,
    ) -> BoxFuture<'a, usize> {
        Box::pin(std::future::ready(0))
    }
}

/// How many records a worker holds for a task ([`Infer::window`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WindowRule {
    /// As many as the measured rate computes in the window's seconds.
    Measured,
    /// As measured, but at most this many batches (an image's rate is timed on pixel values
    /// alone, and each held picture is large).
    MeasuredAtMost(usize),
    /// This many batches, unmeasured (a generation's speed depends on what it writes).
    Batches(usize),
}

/// The model as the pipeline holds it: its thread, which computes items whatever the task, and
/// its task ([`Infer`]), which readies records and settles results. Cheap to clone.
#[derive(Clone)]
pub struct Served {
    /// The model thread.
    pub handle: ModelHandle,
    /// The task.
    pub task: Arc<dyn Infer>,
}

impl Served {
    /// What the model is (name, weights hash, task, what it reads): for rows, logs, metrics.
    pub fn info(&self) -> &ModelInfo {
        self.handle.info()
    }
}

/// What becomes of one computed result ([`Infer::settle`]).
#[derive(Debug)]
pub enum Settled {
    /// A result for the sink to commit.
    Keep(Output),
    /// The model refused the record: a failure row with the reason.
    Refuse(RecordError),
    /// The shutdown interrupted it: back to Pub/Sub, what it computed kept on the record.
    Interrupted,
}

/// Why a record does not fit the model at all, whatever the task: a generation record for an
/// encoder or the reverse, an image for a text model, a text for an image classifier, a prompt
/// name the model lacks, a pair for a single-text task or a single text for a cross-encoder.
pub fn unfit(info: &ModelInfo, r: &Record) -> Option<RecordError> {
    use super::Reads;
    let wrong = |why: String| Some(RecordError::WrongInput(why));
    match (r.generation.is_some(), info.reads == Reads::Prompts) {
        (true, false) => {
            return wrong(format!(
                "a \"prompt\" or \"messages\" to generate from, but the model {} is a {} model",
                info.name,
                info.task.name()
            ))
        }
        (false, true) => {
            return wrong(format!(
                "the model {} generates: send \"prompt\" or \"messages\", not a text or an image",
                info.name
            ))
        }
        (true, true) => return None,
        (false, false) => {}
    }
    match (r.image.is_some(), info.reads) {
        (true, Reads::Texts) => {
            return wrong(format!("an image, but the model {} reads texts", info.name))
        }
        (false, Reads::Images) => {
            return wrong(format!(
                "a text, but the model {} is an image classifier: it reads images (\"uri\" or \
                 \"image_base64\")",
                info.name
            ))
        }
        _ => {}
    }
    if let Some(name) = r.prompt_name.as_ref().filter(|n| !info.prompts.contains(n)) {
        let known = match info.prompts.is_empty() {
            true => "none".to_string(),
            false => info.prompts.join(", "),
        };
        return Some(RecordError::UnknownPrompt(format!(
            "the model has no prompt named {name:?} (its prompts: {known})"
        )));
    }
    match (
        &r.text_pair,
        info.task.takes_pairs(),
        info.task.needs_pairs(),
    ) {
        (Some(_), false, _) => Some(RecordError::Pair(format!(
            "the model {} is a {} model, which reads single texts",
            info.name,
            info.task.name()
        ))),
        (None, _, true) => Some(RecordError::Pair(format!(
            "missing: the model {} is a cross-encoder, which scores (text, text_pair) pairs",
            info.name
        ))),
        _ => None,
    }
}

/// A record's text as the model thread reads it.
pub fn text_item(r: &Record) -> Item {
    Item::Text(super::Text {
        text: r.text.clone(),
        text_pair: r.text_pair.clone(),
        prompt_name: r.prompt_name.clone(),
    })
}

/// One generation's progress, kept between deliveries ([`Checkpoints`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    /// The record.
    pub record_id: String,
    /// The model generating it, by name.
    pub model: String,
    /// Which weights and settings the tokens continue under (`ModelInfo::hash` without the
    /// engine's mark: any engine may resume them).
    pub model_hash: String,
    /// Hex SHA-256 of the record's prompt and options (`generation::Input::sha256`).
    pub input_sha256: String,
    /// The token ids generated so far.
    pub tokens: Vec<u32>,
    /// The engine that wrote them (`ModelInfo::device`: device, precision, kernels): a
    /// continuation on another engine is valid but may part from the uninterrupted text after a
    /// near-tie, so the resuming worker says so.
    pub engine: String,
}

/// Tokens a generation saved, and the engine that wrote them (none: saved before engines were
/// recorded).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SavedTokens {
    /// The token ids generated so far.
    pub tokens: Vec<u32>,
    /// [`Checkpoint::engine`].
    pub engine: Option<String>,
}

/// The tokens saved per (record id, prompt hash).
pub type Saved = HashMap<(String, String), SavedTokens>;

/// Where a generation model keeps its checkpoints between deliveries: the database, in the
/// worker (`crate::external::store`). A trait, so the model layer does not depend on the store.
pub trait Checkpoints: Send + Sync {
    /// The tokens saved for each (record id, prompt hash) of `keys` by these weights.
    fn read<'a>(
        &'a self,
        model: &'a str,
        model_hash: &'a str,
        keys: &'a [(String, String)],
    ) -> BoxFuture<'a, Result<Saved, String>>;
    /// Saves (or replaces) these checkpoints.
    fn save<'a>(&'a self, checkpoints: &'a [Checkpoint]) -> BoxFuture<'a, Result<(), String>>;
    /// Deletes the checkpoints saved so long ago that no delivery can resume from them.
    fn purge(&self) -> BoxFuture<'_, Result<u64, String>>;
    /// Deletes the checkpoints of these records: they will not be delivered again.
    fn forget<'a>(
        &'a self,
        model: &'a str,
        record_ids: &'a [String],
    ) -> BoxFuture<'a, Result<u64, String>>;
}
