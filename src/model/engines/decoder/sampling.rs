//! Choosing the next token from the logits: greedy (`temperature` 0), or sampled after
//! transformers' warpers in their order (temperature, then top-k, then top-p), from a random
//! number that depends only on the seed and the token's position in the completion. So the same
//! record, seed and model give the same text on any worker and on any redelivery, and a
//! generation resumed from its checkpointed tokens draws what it would have drawn.

/// How one record's tokens are chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// 0: greedy; otherwise the logits are divided by it.
    pub temperature: f32,
    /// Keep the smallest set of tokens whose probability reaches this (1: all).
    pub top_p: f32,
    /// Keep this many of the likeliest tokens (0: all).
    pub top_k: usize,
    /// The random stream's seed.
    pub seed: u64,
}

impl Sampling {
    /// The token to generate at `position` (0 for the completion's first) after `logits`.
    pub fn choose(&self, logits: &[f32], position: usize) -> u32 {
        if self.temperature == 0.0 {
            return argmax(logits);
        }
        let mut candidates: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l / self.temperature))
            .collect();
        // Likeliest first; equal logits by id, so the order (and the draw) is deterministic.
        candidates.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if self.top_k > 0 {
            candidates.truncate(self.top_k);
        }
        let max = candidates[0].1;
        let mut probs: Vec<f64> = candidates
            .iter()
            .map(|&(_, l)| f64::from(l - max).exp())
            .collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
        if self.top_p < 1.0 {
            // transformers' TopPLogitsWarper keeps a token while the probability of the tokens
            // likelier than it is below top_p (and always the likeliest).
            let mut before = 0.0;
            let keep = probs
                .iter()
                .take_while(|&&p| {
                    let keep = before < f64::from(self.top_p);
                    before += p;
                    keep
                })
                .count()
                .max(1);
            probs.truncate(keep);
            let total: f64 = probs.iter().sum();
            probs.iter_mut().for_each(|p| *p /= total);
        }
        let mut u = uniform(self.seed, position as u64);
        for (i, p) in probs.iter().enumerate() {
            if u < *p {
                return candidates[i].0;
            }
            u -= p;
        }
        candidates[probs.len() - 1].0
    }
}

/// The first largest logit's token (torch's `argmax` also returns the first).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// A number in [0, 1) from the seed and the position alone (SplitMix64 of both).
fn uniform(seed: u64, position: u64) -> f64 {
    let mut z = seed ^ position.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampling(temperature: f32, top_p: f32, top_k: usize, seed: u64) -> Sampling {
        Sampling {
            temperature,
            top_p,
            top_k,
            seed,
        }
    }

    #[test]
    fn greedy_takes_the_first_largest() {
        assert_eq!(
            sampling(0.0, 1.0, 0, 1).choose(&[0.1, 3.0, 3.0, -1.0], 0),
            1
        );
    }

    #[test]
    fn the_same_seed_and_position_draw_the_same_token_and_others_differ() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let s = sampling(1.0, 1.0, 0, 42);
        let a: Vec<u32> = (0..40).map(|p| s.choose(&logits, p)).collect();
        let b: Vec<u32> = (0..40).map(|p| s.choose(&logits, p)).collect();
        assert_eq!(a, b);
        let other: Vec<u32> = (0..40)
            .map(|p| sampling(1.0, 1.0, 0, 43).choose(&logits, p))
            .collect();
        assert_ne!(a, other);
        assert!(a.iter().collect::<std::collections::HashSet<_>>().len() > 5);
    }

    #[test]
    fn top_k_and_top_p_keep_only_the_likeliest() {
        let logits = [5.0, 4.0, 0.0, -2.0, 4.5];
        for p in 0..200 {
            let k = sampling(1.0, 1.0, 2, 7).choose(&logits, p);
            assert!(k == 0 || k == 4, "top-k 2 drew {k}");
            // Token 0 alone holds ~0.5 of the mass, so top_p 0.4 keeps only it.
            assert_eq!(sampling(1.0, 0.4, 0, 7).choose(&logits, p), 0);
        }
    }
}
