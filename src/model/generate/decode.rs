//! The decode loop: the sequences of a batch advance together, one forward pass per step for all
//! of them (a newly admitted sequence's whole prompt, every other's last token). A sequence that
//! finishes leaves at once and a waiting one takes its place (continuous batching), as long as
//! the cache the running sequences may grow to (prompt plus `max_new_tokens` each) stays within
//! the token budget.
//!
//! A resumed request reads its prompt and its checkpointed tokens in one pass and goes on; the
//! decoder computes every row alike whatever its neighbours (see `CpuDecoder`), and the sampler
//! draws by position, so the continuation is the one the uninterrupted run would have written.

use super::{Completion, FinishReason, Generated, LanguageModel, Request};
use spotinfer_bert_cpu::{KvCache, Step};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Asks running generations to stop at their next step and hand back their tokens (set when the
/// worker shuts down). Cheap to clone; every clone sees the same flag.
#[derive(Debug, Clone, Default)]
pub struct Interrupt(Arc<AtomicBool>);

impl Interrupt {
    /// A flag not set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets it.
    pub fn set(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    /// Whether it is set.
    pub fn is_set(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// One request on its way.
struct Sequence<'a> {
    index: usize,
    request: &'a Request,
    prompt: Vec<u32>,
    generated: Vec<u32>,
    cache: KvCache,
    /// Cache tokens it may grow to: its share of the budget.
    need: usize,
    started: Option<Instant>,
}

/// Runs `requests` (see [`LanguageModel::generate`]); `max_seconds` bounds each one's time once
/// it runs.
pub(super) fn run(
    model: &LanguageModel,
    requests: &[Request],
    budget: usize,
    interrupt: &Interrupt,
    max_seconds: Option<Duration>,
) -> Vec<Generated> {
    let mut results: Vec<Option<Generated>> = vec![None; requests.len()];
    let mut waiting = VecDeque::new();
    for (index, request) in requests.iter().enumerate() {
        match prepare(model, index, request) {
            // A checkpoint taken after the generation ended (a shutdown between its last step
            // and its commit) needs no step.
            Ok(seq) if !seq.generated.is_empty() && finished(model, &seq).is_some() => {
                results[index] = finished(model, &seq).map(Generated::Done);
            }
            Ok(seq) => waiting.push_back(seq),
            Err(reason) => results[index] = Some(Generated::Refused(reason)),
        }
    }
    let mut active: Vec<Sequence<'_>> = Vec::new();
    let mut reserved = 0;
    loop {
        if interrupt.is_set() {
            for seq in active.drain(..).chain(waiting.drain(..)) {
                results[seq.index] = Some(Generated::Interrupted(seq.generated));
            }
            break;
        }
        while let Some(next) = waiting.front() {
            if !active.is_empty() && budget > 0 && reserved + next.need > budget {
                break;
            }
            let Some(mut seq) = waiting.pop_front() else {
                break;
            };
            reserved += seq.need;
            seq.started = Some(Instant::now());
            active.push(seq);
        }
        if active.is_empty() {
            break;
        }
        if let Err(e) = step(model, &mut active) {
            for seq in active.drain(..) {
                results[seq.index] = Some(Generated::Refused(e.clone()));
            }
            continue;
        }
        let mut i = 0;
        while i < active.len() {
            let seq = &active[i];
            let overdue = max_seconds.filter(|&m| seq.started.is_some_and(|s| s.elapsed() > m));
            let result = match (finished(model, seq), overdue) {
                (Some(done), _) => Some(Generated::Done(done)),
                (None, Some(m)) => Some(Generated::Refused(format!(
                    "the generation ran past --max-generation-seconds ({} s) after {} tokens",
                    m.as_secs_f64(),
                    seq.generated.len()
                ))),
                (None, None) => None,
            };
            match result {
                Some(r) => {
                    let seq = active.swap_remove(i);
                    reserved -= seq.need;
                    results[seq.index] = Some(r);
                }
                None => i += 1,
            }
        }
    }
    results
        .into_iter()
        .map(|r| r.unwrap_or_else(|| Generated::Refused("not run".into())))
        .collect()
}

/// The request's prompt tokenized and fitted to the context, or why it cannot run.
fn prepare<'a>(
    model: &LanguageModel,
    index: usize,
    request: &'a Request,
) -> Result<Sequence<'a>, String> {
    let context = model.context();
    let max_new = request.max_new_tokens;
    if max_new == 0 || max_new >= context {
        return Err(format!(
            "max_new_tokens {max_new} must be at least 1 and below the model's context of {context} tokens"
        ));
    }
    let mut prompt = model.prompt_ids(&request.prompt)?;
    if prompt.is_empty() {
        return Err("the prompt is empty once tokenized".into());
    }
    if prompt.len() + max_new > context {
        if !request.truncate_prompt {
            return Err(format!(
                "the prompt's {} tokens and max_new_tokens {max_new} exceed the model's context of \
                 {context} tokens (lower max_new_tokens, or let the worker cut the prompt's start \
                 with --truncate-prompt)",
                prompt.len()
            ));
        }
        prompt.drain(..prompt.len() + max_new - context);
    }
    Ok(Sequence {
        index,
        need: prompt.len() + max_new,
        prompt,
        generated: request.resume.clone(),
        cache: KvCache::default(),
        request,
        started: None,
    })
}

/// Most new tokens one forward pass reads. A prompt longer than what is left of it is read in
/// parts over several steps (each row computes the same either way), so one step stays short:
/// the interrupt at a shutdown is seen within a fraction of a second even while long prompts
/// are read, and the activations of a step stay small.
pub const STEP_TOKENS: usize = 512;

/// One forward pass for the running sequences: each decoding one's last token first, then what
/// fits of the prompts being read; a sequence whose input is all read gets its next token.
fn step(model: &LanguageModel, active: &mut [Sequence<'_>]) -> Result<(), String> {
    let unread = |s: &Sequence<'_>| -> Vec<u32> {
        let all = s.prompt.iter().chain(&s.generated).copied();
        all.skip(s.cache.len()).collect()
    };
    let mut order: Vec<usize> = (0..active.len()).collect();
    // Decoding sequences (a cache, one token unread) first: false sorts before true.
    order.sort_by_key(|&i| active[i].cache.is_empty() || unread(&active[i]).len() != 1);
    let mut left = STEP_TOKENS;
    let mut feeds: Vec<(usize, Vec<u32>, bool)> = Vec::new();
    for i in order {
        if left == 0 {
            break;
        }
        let mut tokens = unread(&active[i]);
        let whole = tokens.len() <= left;
        tokens.truncate(left);
        left -= tokens.len();
        feeds.push((i, tokens, whole));
    }
    feeds.sort_by_key(|f| f.0);
    let logits = {
        let mut feeding = feeds.iter().peekable();
        let mut steps: Vec<Step<'_>> = Vec::with_capacity(feeds.len());
        for (i, s) in active.iter_mut().enumerate() {
            if let Some((_, tokens, _)) = feeding.next_if(|f| f.0 == i) {
                steps.push(Step {
                    cache: &mut s.cache,
                    tokens,
                });
            }
        }
        model
            .decoder
            .forward(&mut steps, false)
            .map_err(|e| e.to_string())?
    };
    for ((i, _, whole), logits) in feeds.iter().zip(logits) {
        if *whole {
            let seq = &mut active[*i];
            let next = seq.request.sampling.choose(&logits, seq.generated.len());
            seq.generated.push(next);
        }
    }
    Ok(())
}

/// The completion, if the sequence's last token ended it.
fn finished(model: &LanguageModel, seq: &Sequence<'_>) -> Option<Completion> {
    let done = |text: String, finish_reason| Completion {
        text,
        finish_reason,
        prompt_tokens: seq.prompt.len(),
        completion_tokens: seq.generated.len(),
        tokens: seq.generated.clone(),
    };
    let last = *seq.generated.last()?;
    if model.stop_ids.contains(&last) {
        return Some(done(model.text(&seq.generated), FinishReason::Stop));
    }
    if !seq.request.stop.is_empty() {
        let text = model.text(&seq.generated);
        let cut = seq
            .request
            .stop
            .iter()
            .filter_map(|s| text.find(s.as_str()))
            .min();
        if let Some(at) = cut {
            return Some(done(text[..at].to_string(), FinishReason::Stop));
        }
    }
    let length = seq.generated.len() >= seq.request.max_new_tokens
        || seq.prompt.len() + seq.generated.len() >= model.context();
    length.then(|| done(model.text(&seq.generated), FinishReason::Length))
}
