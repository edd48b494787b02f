//! The decode loop ([`Scheduler`]): the running sequences advance together, one forward pass per
//! step for all of them (what fits of a newly admitted sequence's prompt, every other's last
//! token). A sequence that finishes leaves at once and a waiting one takes its place, as long as
//! the cache the running sequences may grow to (prompt plus `max_new_tokens` each) stays within
//! the token budget; a new batch can be admitted between any two steps and its sequences join
//! the running ones (continuous batching across the batches the worker holds), and each batch
//! is done when its last sequence is.
//!
//! On the CPU decoder, a prefix every prompt of a batch starts with (a long system prompt) is
//! read once and copied into each sequence that starts with it (`super::prefixes`).
//!
//! A resumed request reads its prompt and its checkpointed tokens in one pass and goes on; the
//! decoder computes every row alike whatever its neighbours (see `CpuDecoder` and
//! `paged::decoder`), and the sampler
//! draws by position, so the continuation is the one the uninterrupted run would have written.

use super::constrain::{self, Constrained};
use super::paged::blocks::{PoolError, SeqId};
use super::paged::decoder::{Choice, PagedDecoder};
use super::paged::mask::Masks;
use super::prefixes::Prefixes;
use super::{Completion, FinishReason, Generated, LanguageModel, Network, Request};
use llguidance::toktrie::SimpleVob;
use rayon::prelude::*;
use spotinfer_fused_cpu::{CpuDecoder, KvCache, Outputs, Step, Want};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Asks running generations to stop at their next step and hand back their tokens (set when the
/// worker's pipeline stops: SIGTERM, an early drain). Cheap to clone; every clone sees the same
/// flag.
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

    /// Clears it: a pipeline that stopped on an early drain runs again when the notice clears,
    /// and its generations must not stop at once.
    pub fn clear(&self) {
        self.0.store(false, Ordering::SeqCst);
    }

    /// Whether it is set.
    pub fn is_set(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// One request on its way.
struct Sequence {
    /// The batch it came in, and its place there.
    job: u64,
    index: usize,
    request: Request,
    prompt: Vec<u32>,
    generated: Vec<u32>,
    cache: SeqCache,
    /// Its constraint's state, when the request has one.
    constrained: Option<Constrained>,
    /// Why it cannot go on (its constraint failed), once it cannot.
    failed: Option<String>,
    /// Cache tokens it may grow to: its share of the budget.
    need: usize,
    started: Option<Instant>,
}

impl Sequence {
    /// Tokens of its prompt and completion not yet in its cache.
    fn unread_len(&self) -> usize {
        self.prompt.len() + self.generated.len() - self.cache.len()
    }

    /// The first `most` of those tokens.
    fn unread(&self, most: usize) -> Vec<u32> {
        let read = self.cache.len();
        let prompt = self.prompt.get(read..).unwrap_or_default();
        let generated = &self.generated[read.saturating_sub(self.prompt.len())..];
        prompt.iter().chain(generated).take(most).copied().collect()
    }
}

/// A sequence's keys and values: its own on the CPU decoder; on the paged decoder, its blocks of
/// the shared cache (the decoder's pool keeps its length), taken when it starts running and given
/// back when it is dropped, whichever way it leaves (finished, refused, interrupted, its batch
/// forgotten).
enum SeqCache {
    Cpu(KvCache),
    Paged {
        decoder: Arc<PagedDecoder>,
        id: SeqId,
    },
}

impl SeqCache {
    /// An empty cache for `model`'s network.
    fn new(model: &LanguageModel) -> Self {
        match model.network() {
            Network::Cpu(_) => Self::Cpu(KvCache::default()),
            Network::Paged(d) => Self::Paged {
                id: d.new_sequence(),
                decoder: d.clone(),
            },
        }
    }

    /// Tokens it holds.
    fn len(&self) -> usize {
        match self {
            Self::Cpu(c) => c.len(),
            Self::Paged { decoder, id } => decoder.len(*id).unwrap_or(0),
        }
    }

    /// Takes room for `tokens` tokens (the paged cache's blocks; the CPU decoder's grows).
    fn admit(&self, tokens: usize) -> Result<(), PoolError> {
        match self {
            Self::Cpu(_) => Ok(()),
            Self::Paged { decoder, id } => decoder.admit(*id, tokens),
        }
    }
}

impl Drop for SeqCache {
    fn drop(&mut self) {
        // Releasing a sequence the pool never admitted does nothing.
        if let Self::Paged { decoder, id } = self {
            decoder.release(*id);
        }
    }
}

/// A batch admitted and not yet done: its results so far, in request order.
struct Job {
    id: u64,
    results: Vec<Option<Generated>>,
    left: usize,
}

/// The decode loop's state, kept between steps so that batches can join while others run: the
/// batches admitted and not yet done, and their sequences, running or waiting for room in the
/// cache budget (oldest first).
pub struct Scheduler {
    budget: usize,
    max_seconds: Option<Duration>,
    jobs: Vec<Job>,
    waiting: VecDeque<Sequence>,
    active: Vec<Sequence>,
    reserved: usize,
    /// Shared prompt prefixes (the CPU decoder's), when on.
    prefixes: Option<Prefixes>,
}

impl Scheduler {
    /// A loop that runs at most `budget` cache tokens at a time (0: no limit), each sequence for
    /// at most `max_seconds` once it runs.
    pub fn new(budget: usize, max_seconds: Option<Duration>) -> Self {
        Self {
            budget,
            max_seconds,
            jobs: Vec::new(),
            waiting: VecDeque::new(),
            active: Vec::new(),
            reserved: 0,
            prefixes: Some(Prefixes::default()),
        }
    }

    /// The same loop with every prompt read whole, its shared prefixes too: to measure what
    /// sharing them saves, and to check that it changes no token.
    pub fn without_shared_prefixes(self) -> Self {
        Self {
            prefixes: None,
            ..self
        }
    }

    /// Prompt tokens not read again so far because a shared prefix held them.
    pub fn shared_tokens(&self) -> usize {
        self.prefixes.as_ref().map_or(0, |p| p.shared_tokens)
    }

    /// Whether no admitted batch is left to finish.
    pub fn is_idle(&self) -> bool {
        self.jobs.is_empty()
    }

    /// Drops the batch `job` and its sequences, running or waiting: nobody waits for them.
    pub fn forget(&mut self, job: u64) {
        self.jobs.retain(|j| j.id != job);
        self.waiting.retain(|s| s.job != job);
        let (gone, kept): (Vec<Sequence>, Vec<Sequence>) = std::mem::take(&mut self.active)
            .into_iter()
            .partition(|s| s.job == job);
        let freed: usize = gone.iter().map(|s| s.need).sum();
        self.reserved = self.reserved.saturating_sub(freed);
        self.active = kept;
    }

    /// Admits a batch as `job`: each request's prompt is tokenized and fitted now (a refusal is
    /// its result at once), and it runs as soon as the budget has room.
    pub fn admit(&mut self, model: &LanguageModel, job: u64, requests: Vec<Request>) {
        self.jobs.push(Job {
            id: job,
            results: vec![None; requests.len()],
            left: requests.len(),
        });
        for (index, request) in requests.into_iter().enumerate() {
            // A panic tokenizing or templating one prompt (a bug its text meets) refuses that
            // record alone.
            let prepared = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                prepare(model, job, index, request)
            }))
            .unwrap_or_else(|p| {
                Err(format!(
                    "the model panicked reading the prompt: {}",
                    crate::shutdown::panic_message(p.as_ref())
                ))
            });
            match prepared {
                Ok(seq) => match (seq.generated.is_empty(), finished(model, &seq)) {
                    // A checkpoint taken after the generation ended (a shutdown between its
                    // last step and its commit) needs no step.
                    (false, Some(done)) => self.record(job, index, Generated::Done(done)),
                    _ => self.waiting.push_back(seq),
                },
                Err(reason) => self.record(job, index, Generated::Refused(reason)),
            }
        }
        if let Some(prefixes) = &mut self.prefixes {
            let batch = self.waiting.iter().filter(|s| s.job == job);
            prefixes.note(batch.map(|s| s.prompt.as_slice()));
        }
    }

    /// One step: every running sequence advances (or, once `interrupt` is set, every sequence
    /// stops with the tokens it has). Returns the batches now done, each with its results in
    /// request order.
    pub fn step(
        &mut self,
        model: &LanguageModel,
        interrupt: &Interrupt,
    ) -> Vec<(u64, Vec<Generated>)> {
        if interrupt.is_set() {
            let stopped: Vec<Sequence> = self
                .active
                .drain(..)
                .chain(self.waiting.drain(..))
                .collect();
            self.reserved = 0;
            for seq in stopped {
                self.record(seq.job, seq.index, Generated::Interrupted(seq.generated));
            }
        } else {
            self.start_waiting(model);
            if !self.active.is_empty() {
                match step(model, &mut self.active) {
                    Ok(()) => self.retire_finished(model),
                    Err(e) => {
                        self.reserved = 0;
                        for seq in std::mem::take(&mut self.active) {
                            self.record(seq.job, seq.index, Generated::Refused(e.clone()));
                        }
                    }
                }
            }
        }
        let (done, running): (Vec<Job>, Vec<Job>) = std::mem::take(&mut self.jobs)
            .into_iter()
            .partition(|j| j.left == 0);
        self.jobs = running;
        done.into_iter()
            .map(|j| {
                let results = j.results.into_iter().flatten().collect();
                (j.id, results)
            })
            .collect()
    }

    /// Moves waiting sequences into the running ones while the budget has room (always one when
    /// none runs, however large).
    fn start_waiting(&mut self, model: &LanguageModel) {
        while let Some(next) = self.waiting.front() {
            let full = self.budget > 0 && self.reserved + next.need > self.budget;
            if !self.active.is_empty() && full {
                break;
            }
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            // The paged cache's blocks: when they run out, the sequence waits for others to end
            // (one that could never fit, or that does not fit an empty cache, is refused).
            match seq.cache.admit(seq.need) {
                Ok(()) => {}
                Err(PoolError::Full { .. }) if !self.active.is_empty() => {
                    self.waiting.push_front(seq);
                    break;
                }
                Err(e) => {
                    let why = format!("the paged KV cache cannot hold this sequence: {e}");
                    self.record(seq.job, seq.index, Generated::Refused(why));
                    continue;
                }
            }
            self.reserved += seq.need;
            seq.started = Some(Instant::now());
            if let (Some(prefixes), Network::Cpu(decoder), SeqCache::Cpu(cache)) =
                (&mut self.prefixes, model.network(), &mut seq.cache)
            {
                if cache.is_empty() {
                    *cache = prefixes.cache_for(decoder, &seq.prompt).unwrap_or_default();
                }
            }
            self.active.push(seq);
        }
    }

    /// Takes out of the running sequences those that ended, or ran past `max_seconds`.
    fn retire_finished(&mut self, model: &LanguageModel) {
        let mut i = 0;
        while i < self.active.len() {
            let seq = &self.active[i];
            let overdue = self
                .max_seconds
                .filter(|&m| seq.started.is_some_and(|s| s.elapsed() > m));
            let result = match (finished(model, seq), overdue) {
                _ if seq.failed.is_some() => seq.failed.clone().map(Generated::Refused),
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
                    let seq = self.active.swap_remove(i);
                    self.reserved -= seq.need;
                    self.record(seq.job, seq.index, r);
                }
                None => i += 1,
            }
        }
    }

    fn record(&mut self, job: u64, index: usize, result: Generated) {
        if let Some(j) = self.jobs.iter_mut().find(|j| j.id == job) {
            if j.results[index].replace(result).is_none() {
                j.left -= 1;
            }
        }
    }
}

/// Runs `requests` as one batch to the end (see [`LanguageModel::generate`]).
pub(super) fn run(
    model: &LanguageModel,
    requests: &[Request],
    budget: usize,
    interrupt: &Interrupt,
    max_seconds: Option<Duration>,
) -> Vec<Generated> {
    let mut scheduler = Scheduler::new(budget, max_seconds);
    scheduler.admit(model, 0, requests.to_vec());
    loop {
        if let Some((_, results)) = scheduler.step(model, interrupt).pop() {
            return results;
        }
    }
}

/// The request's prompt tokenized and fitted to the context, or why it cannot run.
fn prepare(
    model: &LanguageModel,
    job: u64,
    index: usize,
    request: Request,
) -> Result<Sequence, String> {
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
    let mut generated = resumable(model, &request);
    let constrained = match &request.constraint {
        None => None,
        Some(c) => Some(constrained(model, c, &mut generated)?),
    };
    Ok(Sequence {
        job,
        index,
        need: prompt.len() + max_new,
        prompt,
        generated,
        cache: SeqCache::new(model),
        constrained,
        failed: None,
        request,
        started: None,
    })
}

/// `constraint`'s state after the checkpointed tokens `generated` (their end token aside, which
/// ends the text): the state the uninterrupted run had there. Tokens the constraint refuses
/// cannot be its continuation: they are dropped and the record starts over.
fn constrained(
    model: &LanguageModel,
    constraint: &constrain::Constraint,
    generated: &mut Vec<u32>,
) -> Result<Constrained, String> {
    let mut state = model.constrained(constraint)?;
    let text = match generated.split_last() {
        Some((last, before)) if model.stop_ids.contains(last) => before,
        _ => generated.as_slice(),
    };
    if let Err(e) = state.advance(text) {
        tracing::warn!(tokens = generated.len(), error = %e,
            "a checkpoint its constraint refuses; the record starts over");
        generated.clear();
        state = model.constrained(constraint)?;
    }
    Ok(state)
}

/// The checkpointed tokens `request` resumes from, or none (it starts over) when they cannot be
/// this model's continuation: an id past its vocabulary or more tokens than the request may
/// write. Such a checkpoint fails no sequence, its own included: it is only not used.
fn resumable(model: &LanguageModel, request: &Request) -> Vec<u32> {
    let vocab = model.vocab();
    let resume = &request.resume;
    let bad_id = resume.iter().find(|&&t| t as usize >= vocab);
    if bad_id.is_none() && resume.len() <= request.max_new_tokens {
        return resume.clone();
    }
    tracing::warn!(
        tokens = resume.len(),
        max_new_tokens = request.max_new_tokens,
        bad_id = ?bad_id,
        vocab,
        "a checkpoint this model cannot continue from; the record starts over"
    );
    Vec::new()
}

/// Most new tokens one forward pass of the CPU decoder reads. A prompt longer than what is left
/// of it is read in parts over several steps (each row computes the same either way), so one
/// step stays short: the interrupt at a shutdown is seen within a fraction of a second even
/// while long prompts are read, and the activations of a step stay small. A GPU reads more a
/// step in the same time ([`Network::step_tokens`]).
pub const STEP_TOKENS: usize = 512;

/// One forward pass for the running sequences: each decoding one's last token first, then what
/// fits of the prompts being read; a sequence whose input is all read gets its next token.
fn step(model: &LanguageModel, active: &mut [Sequence]) -> Result<(), String> {
    let mut order: Vec<usize> = (0..active.len()).collect();
    // Decoding sequences (a cache, one token unread) first: false sorts before true.
    order.sort_by_key(|&i| active[i].cache.len() == 0 || active[i].unread_len() != 1);
    let mut left = model.network().step_tokens();
    let mut feeds: Vec<(usize, Vec<u32>, bool)> = Vec::new();
    for i in order {
        if left == 0 {
            break;
        }
        let whole = active[i].unread_len() <= left;
        let tokens = active[i].unread(left);
        left -= tokens.len();
        feeds.push((i, tokens, whole));
    }
    feeds.sort_by_key(|f| f.0);
    let chosen: Vec<Option<u32>> = match model.network() {
        Network::Cpu(decoder) => cpu_step(decoder, active, &feeds)?,
        Network::Paged(decoder) => paged_step(decoder, active, &feeds)?,
    };
    for ((i, _, _), token) in feeds.iter().zip(chosen) {
        let Some(token) = token else { continue };
        let seq = &mut active[*i];
        seq.generated.push(token);
        // An end token ends the text: the mask allowed it only where the text is complete.
        let ends = model.stop_ids.contains(&token);
        if let (Some(c), false) = (&mut seq.constrained, ends) {
            if let Err(why) = c.advance(&[token]) {
                seq.failed = Some(why);
            }
        }
    }
    Ok(())
}

/// [`step`]'s forward pass on the CPU decoder: each feed's tokens appended to its sequence's
/// cache, and the next token of each feed whose input is all read: a greedy unconstrained one's
/// chosen with the output layer (its logits never held whole), a sampled or constrained one's
/// from its logits, masked first (the masks computed while the pass runs). A feed still reading
/// its prompt gets no token, and no output layer is computed for it.
fn cpu_step(
    decoder: &CpuDecoder,
    active: &mut [Sequence],
    feeds: &[(usize, Vec<u32>, bool)],
) -> Result<Vec<Option<u32>>, String> {
    let mut feeding = feeds.iter().peekable();
    let mut steps: Vec<Step<'_>> = Vec::with_capacity(feeds.len());
    let mut constrained: Vec<(usize, &mut Constrained)> = Vec::new();
    for (i, s) in active.iter_mut().enumerate() {
        if let (Some((_, tokens, whole)), SeqCache::Cpu(cache)) =
            (feeding.next_if(|f| f.0 == i), &mut s.cache)
        {
            let want = match (whole, &mut s.constrained) {
                (false, _) => Want::Nothing,
                (true, Some(c)) => {
                    constrained.push((i, c));
                    Want::Logits
                }
                (true, None) if s.request.sampling.is_greedy() => Want::Token,
                (true, None) => Want::Logits,
            };
            steps.push(Step {
                cache,
                tokens,
                want,
            });
        }
    }
    let wants: Vec<Want> = steps.iter().map(|s| s.want).collect();
    // The constrained sequences' masks are computed while the forward pass runs (each on
    // whichever pool thread is free): they depend only on the tokens already chosen.
    let (outputs, masks) = rayon::join(|| decoder.forward(&mut steps), || masks(constrained));
    let Outputs { mut logits, tokens } = outputs.map_err(|e| e.to_string())?;
    let mut masks = masks.into_iter().peekable();
    let mut rows = logits.chunks_exact_mut(decoder.dims().vocab);
    // Each sampled row's draw is its own (a pass over the vocabulary): in parallel.
    let mut draws = Vec::new();
    for (((i, _, _), want), token) in feeds.iter().zip(wants).zip(tokens) {
        if want != Want::Logits {
            draws.push(token.map(Draw::Chosen));
            continue;
        }
        let l = rows.next().ok_or("a step without its logits")?;
        let mask = masks.next_if(|m| m.0 == *i).map(|m| m.1);
        let kept = masked(&mut active[*i], mask, l);
        draws.push(kept.then_some(Draw::From(*i, l)));
    }
    let active = &*active;
    Ok(draws
        .into_par_iter()
        .map(|draw| match draw? {
            Draw::Chosen(token) => Some(token),
            Draw::From(i, l) => {
                let seq = &active[i];
                Some(seq.request.sampling.choose(l, seq.generated.len()))
            }
        })
        .collect())
}

/// A row's next token in [`cpu_step`]: chosen by the forward pass, or to draw from its
/// sequence's (masked) logits.
enum Draw<'a> {
    Chosen(u32),
    From(usize, &'a mut [f32]),
}

/// [`step`]'s forward pass on the paged decoder: each feed's tokens appended to its sequence's
/// blocks, and the next token of each feed whose input is all read, chosen on the device:
/// greedy, or drawn by the request's sampler at its position, a constrained sequence's among
/// what its mask allows (the masks computed while the device runs the step, applied there). A
/// feed still reading its prompt gets no token.
fn paged_step(
    decoder: &PagedDecoder,
    active: &mut [Sequence],
    feeds: &[(usize, Vec<u32>, bool)],
) -> Result<Vec<Option<u32>>, String> {
    let mut inputs: Vec<(SeqId, &[u32])> = Vec::with_capacity(feeds.len());
    let mut choices = Vec::with_capacity(feeds.len());
    let mut constrained: Vec<(usize, &mut Constrained)> = Vec::new();
    let mut feeding = feeds.iter().peekable();
    for (i, s) in active.iter_mut().enumerate() {
        let Some((_, tokens, whole)) = feeding.next_if(|f| f.0 == i) else {
            continue;
        };
        let SeqCache::Paged { id, .. } = s.cache else {
            return Err("a CPU cache on the paged decoder".into());
        };
        inputs.push((id, tokens.as_slice()));
        let (sampling, at) = (s.request.sampling, s.generated.len());
        choices.push(match (whole, &mut s.constrained) {
            (false, _) => Choice::Greedy,
            (true, Some(c)) => {
                constrained.push((i, c));
                Choice::Masked(sampling, at)
            }
            (true, None) => Choice::Draw(sampling, at),
        });
    }
    let vocab = decoder.dims().vocab;
    let mut computed = Vec::new();
    let chosen = decoder
        .forward_choosing(&inputs, &choices, || {
            computed = masks(constrained);
            let rows: Vec<Option<&SimpleVob>> =
                computed.iter().map(|m| m.1.as_ref().ok()).collect();
            Masks::new(&rows, vocab)
        })
        .map_err(|e| e.to_string())?;
    // A sequence whose constraint could not give a mask fails with the reason; its row was
    // chosen among every id, and is not used.
    for (i, mask) in computed {
        if let Err(why) = mask {
            active[i].failed = Some(why);
        }
    }
    Ok(feeds
        .iter()
        .zip(chosen)
        .map(|((i, _, whole), token)| (*whole && active[*i].failed.is_none()).then_some(token))
        .collect())
}

/// Each constrained sequence's mask for its next token (each a pass of its matcher, in
/// parallel), in the order given.
fn masks(constrained: Vec<(usize, &mut Constrained)>) -> Vec<(usize, Result<SimpleVob, String>)> {
    constrained
        .into_par_iter()
        .map(|(i, c)| (i, c.mask()))
        .collect()
}

/// `logits` masked by `seq`'s constraint where it has a mask this step (`mask`); `false`, the
/// sequence failed with the reason, when its constraint could not give one.
fn masked(seq: &mut Sequence, mask: Option<Result<SimpleVob, String>>, logits: &mut [f32]) -> bool {
    match mask {
        Some(Ok(mask)) => constrain::apply(&mask, logits),
        Some(Err(why)) => {
            seq.failed = Some(why);
            return false;
        }
        None => {}
    }
    true
}

/// The completion, if the sequence's last token ended it.
fn finished(model: &LanguageModel, seq: &Sequence) -> Option<Completion> {
    let json = seq.request.constraint.as_ref().is_some_and(|c| c.is_json());
    let done = |text: String, finish_reason| Completion {
        json: json.then(|| serde_json::from_str(&text).ok()).flatten(),
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
