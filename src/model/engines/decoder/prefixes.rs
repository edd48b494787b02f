//! Prompt prefixes computed once. A batch job usually sends one long system prompt with every
//! record; without this, each sequence would read it again. When a batch is admitted, the
//! prefix its prompts share is noted; the first of its sequences to run has that prefix read
//! alone, once, and every sequence that starts with it (in this batch or a later one) begins
//! from a copy of its keys and values and reads only the rest of its prompt. (vLLM's automatic
//! prefix caching does this on GPUs, with the cache's blocks shared instead of copied.)
//!
//! **The tokens do not change.** The CPU decoder computes a position the same whether its
//! prompt is read in one pass or in parts (each row's sums are its own), so a sequence started
//! from a shared prefix writes exactly the tokens it writes reading its whole prompt; the tests
//! check it. Copies, not shared memory: each running sequence still owns its cache (what the
//! budget counts), and the prefixes kept cost their own keys and values beside them (at most
//! [`KEPT`] of at most [`MOST`] tokens).

use super::decode::STEP_TOKENS;
use spotinfer_fused_cpu::{CpuDecoder, KvCache, Step, Want};
use std::collections::VecDeque;

/// Fewest tokens worth sharing. Reading a noted prefix alone is one more pass over the weights
/// (no output layer), which the rows it saves repay from about this length even when only two
/// prompts share it (16 rows of a 0.5B model are ~5.7 billion multiply-adds, about twice what
/// streaming its weights once costs on two Zen 4 cores). A chat template's own system prompt
/// is about this long: SmolLM2's and Qwen2.5's are 24 tokens, so at 32 a job of chat turns with
/// no system prompt of its own shared nothing. Measured on the Zen 4 at 32 chat prompts
/// (2026-11-29): 16 instead of 32 gave +8% tokens/s on SmolLM2 Q4_1 and +12% on the
/// Qwen2.5-0.5B shape, the answers unchanged.
pub const MIN_SHARED: usize = 16;

/// Most prefixes kept (the oldest is dropped first).
pub const KEPT: usize = 4;

/// Most tokens of one prefix kept.
pub const MOST: usize = 8 * STEP_TOKENS;

/// The prefixes noted and those computed, for one scheduler.
#[derive(Default)]
pub(super) struct Prefixes {
    /// Computed: the tokens and the cache holding them, newest last.
    kept: VecDeque<(Vec<u32>, KvCache)>,
    /// Noted, not computed yet (computed when a sequence starting with one first runs).
    noted: VecDeque<Vec<u32>>,
    /// Prompt tokens not read again thanks to a kept prefix, for tests and logs.
    pub shared_tokens: usize,
}

/// How many tokens `a` and `b` start with in common.
fn common(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl Prefixes {
    /// Notes the prefix that every prompt of a batch starts with, when there are at least two
    /// and it is at least [`MIN_SHARED`] tokens long.
    pub(super) fn note<'a>(&mut self, prompts: impl Iterator<Item = &'a [u32]>) {
        let (mut shared, mut count): (Option<&[u32]>, usize) = (None, 0);
        for p in prompts {
            shared = Some(shared.map_or(p, |s| &s[..common(s, p)]));
            count += 1;
        }
        let Some(shared) = shared.filter(|s| count >= 2 && s.len() >= MIN_SHARED) else {
            return;
        };
        let shared = &shared[..shared.len().min(MOST)];
        let known = self.kept.iter().map(|(t, _)| t).chain(&self.noted);
        if known.into_iter().any(|t| t.as_slice() == shared) {
            return;
        }
        if self.noted.len() == KEPT {
            self.noted.pop_front();
        }
        self.noted.push_back(shared.to_vec());
    }

    /// A cache holding the longest known prefix of `prompt` (at least [`MIN_SHARED`] tokens and
    /// shorter than the prompt, which must still give its last position's logits), a noted one
    /// computed first if it is longer than any kept; `None` when none is known or the decoder
    /// refuses one (the sequence then reads its whole prompt, as without sharing).
    pub(super) fn cache_for(&mut self, decoder: &CpuDecoder, prompt: &[u32]) -> Option<KvCache> {
        let usable = |t: &[u32]| common(t, prompt).min(prompt.len().saturating_sub(1));
        let best_kept = self.kept.iter().map(|(t, _)| usable(t)).max().unwrap_or(0);
        let noted = (0..self.noted.len())
            .map(|i| (usable(&self.noted[i]), i))
            .filter(|&(n, _)| n >= MIN_SHARED && n > best_kept)
            .max()
            .map(|(_, i)| i);
        // The noted prefix is read whole, though this prompt may share only part of it: the
        // batch that noted it shares all of it.
        if let Some(i) = noted {
            let tokens = self.noted.remove(i)?;
            let mut cache = KvCache::default();
            for part in tokens.chunks(STEP_TOKENS) {
                let mut step = [Step {
                    cache: &mut cache,
                    tokens: part,
                    want: Want::Nothing,
                }];
                if let Err(e) = decoder.forward(&mut step) {
                    tracing::warn!(error = %e, "a shared prompt prefix could not be read once");
                    return None;
                }
            }
            if self.kept.len() == KEPT {
                self.kept.pop_front();
            }
            self.kept.push_back((tokens, cache));
        }
        let (n, cache) = self
            .kept
            .iter()
            .map(|(t, c)| (usable(t), c))
            .filter(|&(n, _)| n >= MIN_SHARED)
            .max_by_key(|&(n, _)| n)?;
        self.shared_tokens += n;
        Some(cache.prefix(n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_notes_what_all_its_prompts_start_with_once() {
        let system: Vec<u32> = (0..40).collect();
        let with = |tail: &[u32]| -> Vec<u32> { system.iter().chain(tail).copied().collect() };
        let (a, b) = (with(&[100, 101]), with(&[100, 102, 103]));
        let mut p = Prefixes::default();
        p.note([a.as_slice(), b.as_slice()].into_iter());
        assert_eq!(p.noted, [with(&[100])]);
        // Again: nothing new. One prompt alone, or a short common part: nothing.
        p.note([a.as_slice(), b.as_slice()].into_iter());
        p.note([a.as_slice()].into_iter());
        p.note([&a[..MIN_SHARED - 1], &b[..30]].into_iter());
        assert_eq!(p.noted.len(), 1);
    }
}
