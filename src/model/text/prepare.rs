//! Texts made ready for the engine before they reach the model thread: prompts put before them,
//! inputs checked against the task, tokenized (pairs through the pair template, a tagger's
//! offsets kept), so the thread that drives the device only computes.
//!
//! Why apart from the engine: an accelerator waits for whatever runs between its batches on the
//! thread that feeds it. Tokenizing a batch of short texts costs about what a GPU takes to
//! encode it, so a model thread that tokenized its own batches would leave the device idle for
//! half the run. [`ModelHandle`](super::ModelHandle) calls [`TextPrep`] on blocking threads as
//! each batch is queued, in slices across the cores, while the model computes the batch before;
//! the offline bench does the same on a thread of its own. What comes out is exactly what the
//! model thread would have made itself (the same code, the same order), and a batch whose texts
//! fail here is handed over untouched, so the model thread fails it with the same error and the
//! pipeline isolates the record to blame as it always has.

use super::prompt::Prompts;
use super::tokenize::TextTokenizer;
use crate::model::spec::Task;
use crate::model::{Input, ModelError};
use crate::model::{Item, Prepare, Tokenized};
use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;

/// Fewest texts worth a thread of their own: below this, starting the thread costs more than the
/// tokenizing it takes over.
const MIN_TEXTS_PER_THREAD: usize = 16;

/// What a text model does to its inputs before the engine: its tokenizer, its prompts and its
/// task. Shared (behind an `Arc`) by the model and whoever prepares batches for it.
pub struct TextPrep {
    pub(super) tokenizer: TextTokenizer,
    prompts: Prompts,
    /// Whether pooling leaves the prompt's tokens out (`include_prompt: false`).
    skip_prompt: bool,
    task: Task,
    max_seq_len: usize,
}

impl TextPrep {
    /// The preparation of a model with this tokenizer, prompts and task.
    pub(super) fn new(
        tokenizer: TextTokenizer,
        prompts: Prompts,
        skip_prompt: bool,
        task: Task,
        max_seq_len: usize,
    ) -> Self {
        Self {
            tokenizer,
            prompts,
            skip_prompt,
            task,
            max_seq_len,
        }
    }

    /// Each input as its task reads it, in order; an error names the input to blame (a prompt
    /// the model lacks, a pair for a model that reads single texts, a prompt that leaves no room
    /// for the text, a text the tokenizer refuses).
    pub fn tokenize(&self, inputs: &[Input<'_>]) -> Result<Vec<Tokenized>, ModelError> {
        self.check_inputs(inputs)?;
        match self.task {
            Task::Embed => self.embed_inputs(inputs),
            Task::Classify | Task::Score => {
                let pairs: Vec<(&str, Option<&str>)> =
                    inputs.iter().map(|i| (i.text, i.text_pair)).collect();
                let encoded = self.tokenizer.encode_pairs(&pairs)?;
                Ok(encoded.into_iter().map(Tokenized::Sequence).collect())
            }
            Task::Tag => {
                let texts: Vec<&str> = inputs.iter().map(|i| i.text).collect();
                let tagged = self.tokenizer.encode_tagged(&texts)?;
                Ok(tagged
                    .into_iter()
                    .zip(texts)
                    .map(|(tagged, text)| Tokenized::Tagged {
                        tagged,
                        text: text.to_string(),
                    })
                    .collect())
            }
            Task::Generate => Err(ModelError::Input(
                "a generation model's prompts are not tokenized here".into(),
            )),
        }
    }

    /// [`TextPrep::tokenize`] in slices of the batch across the machine's cores, each slice on
    /// a thread of its own; the same results in the same order (every input is tokenized on
    /// its own), and the same error where one fails.
    pub fn tokenize_parallel(&self, inputs: &[Input<'_>]) -> Result<Vec<Tokenized>, ModelError> {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = cores.min(inputs.len() / MIN_TEXTS_PER_THREAD).max(1);
        if threads == 1 {
            return self.tokenize(inputs);
        }
        let per_thread = inputs.len().div_ceil(threads);
        std::thread::scope(|scope| {
            let slices: Vec<_> = inputs
                .chunks(per_thread)
                .map(|slice| scope.spawn(move || self.tokenize(slice)))
                .collect();
            // Every slice joined before any result is looked at: one left unjoined would turn
            // its panic into the scope's.
            let joined: Vec<_> = slices.into_iter().map(|s| s.join()).collect();
            let mut out = Vec::with_capacity(inputs.len());
            for slice in joined {
                match slice {
                    Ok(Ok(done)) => out.extend(done),
                    Ok(Err(_)) => return None,
                    Err(p) => {
                        return Some(Err(ModelError::Panic(crate::shutdown::panic_message(
                            p.as_ref(),
                        ))))
                    }
                }
            }
            Some(Ok(out))
        })
        // A slice's error counts its inputs from the slice's start: the whole batch again, in
        // one piece, names the input as the batch numbers it.
        .unwrap_or_else(|| self.tokenize(inputs))
    }

    /// Refuses what this model's task cannot take: a `text_pair` for a model that reads single
    /// texts, a single text for a cross-encoder, a prompt for a task model (none has prompts).
    fn check_inputs(&self, inputs: &[Input<'_>]) -> Result<(), ModelError> {
        let task = self.task;
        for (i, input) in inputs.iter().enumerate() {
            if input.text_pair.is_some() && !task.takes_pairs() {
                return Err(ModelError::Input(format!(
                    "input {i}: a text_pair, but this {} model reads single texts",
                    task.name()
                )));
            }
            if input.text_pair.is_none() && task.needs_pairs() {
                return Err(ModelError::Input(format!(
                    "input {i}: no text_pair, but this cross-encoder scores (text, text_pair) pairs"
                )));
            }
            if let (Some(name), false) = (input.prompt_name, task == Task::Embed) {
                return Err(ModelError::Prompt(format!(
                    "input {i}: prompt {name:?}, but this {} model has no prompts",
                    task.name()
                )));
            }
        }
        Ok(())
    }

    /// Embedding inputs with their prompts before them, tokenized, with how many leading tokens
    /// pooling leaves out of each; refused where the prompt leaves nothing of the text to pool.
    pub(super) fn embed_inputs(&self, inputs: &[Input<'_>]) -> Result<Vec<Tokenized>, ModelError> {
        let mut prompt_tokens: HashMap<&str, usize> = HashMap::new();
        let mut texts: Vec<Cow<'_, str>> = Vec::with_capacity(inputs.len());
        let mut skips = Vec::with_capacity(inputs.len());
        for input in inputs {
            let prompt = self.prompts.resolve(input.prompt_name)?;
            let skip = match prompt {
                Some(p) if self.skip_prompt => match prompt_tokens.get(p) {
                    Some(&n) => n,
                    None => *prompt_tokens
                        .entry(p)
                        .or_insert(self.tokenizer.prompt_tokens(p)?),
                },
                _ => 0,
            };
            skips.push(skip);
            texts.push(match prompt {
                Some(p) => Cow::Owned(format!("{p}{}", input.text)),
                None => Cow::Borrowed(input.text),
            });
        }
        let refs: Vec<&str> = texts.iter().map(|t| t.as_ref()).collect();
        let encoded = self.tokenizer.encode(&refs)?;
        if let Some(i) = (0..encoded.len()).find(|&i| skips[i] > 0 && skips[i] >= encoded[i].len())
        {
            return Err(ModelError::Input(format!(
                "input {i}: its prompt fills the model's {} tokens, leaving nothing of the text to pool",
                self.max_seq_len
            )));
        }
        Ok(encoded
            .into_iter()
            .zip(skips)
            .map(|(ids, skip)| Tokenized::Embed { ids, skip })
            .collect())
    }
}

impl Prepare for TextPrep {
    /// The batch's texts as [`Item::Tokens`]; none when any fails (the model thread then
    /// tokenizes them itself and fails the batch with the error, as it would have).
    fn prepare(&self, items: &[Item]) -> Option<Vec<Item>> {
        let inputs: Vec<Input<'_>> = items
            .iter()
            .filter_map(|item| match item {
                Item::Text(t) => Some(t.input()),
                _ => None,
            })
            .collect();
        if inputs.is_empty() {
            return None;
        }
        let mut tokenized = self.tokenize_parallel(&inputs).ok()?.into_iter();
        items
            .iter()
            .map(|item| match item {
                Item::Text(_) => tokenized.next().map(|t| Item::Tokens(Arc::new(t))),
                other => Some(other.clone()),
            })
            .collect()
    }
}
