//! Choosing the next token from the logits: greedy (`temperature` 0), or sampled after
//! transformers' warpers in their order (temperature, then top-k, then top-p), from a random
//! number that depends only on the seed and the token's position in the completion. So the same
//! record, seed and model give the same text on any worker and on any redelivery, and a
//! generation resumed from its checkpointed tokens draws what it would have drawn.
//!
//! The draw is defined in integers so that any order of adding gives the same token, which is
//! what lets the paged decoder sample on a GPU (`paged/sample.rs`, one block of threads a row)
//! and choose exactly what this sampler chooses from the same logits:
//!
//! * each token's weight is `exp(z - max)` for `z = logit / temperature`, in 32-bit fixed point
//!   ([`weight`], an exponential of a fixed sequence of f64 operations, the same bits on the
//!   CPU and in the kernel), so every sum of weights is an exact integer;
//! * tokens rank by [`order_key`] (logit, then the lower id first); top-k keeps the first `k`,
//!   top-p keeps a token while the weight of those ranked before it is below `top_p` of what
//!   top-k kept (transformers' `TopPLogitsWarper`), and always the first;
//! * the kept tokens, in id order, partition `[0, total)`; the token whose part holds
//!   `⌊u·total⌋` for the position's `u` ([`draw_target`]) is drawn.

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
    /// Whether [`Sampling::choose`] takes the largest logit (the first of equals) and draws
    /// nothing, which a decoder may then choose without handing the logits over.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// The token to generate at `position` (0 for the completion's first) after `logits`.
    pub fn choose(&self, logits: &[f32], position: usize) -> u32 {
        if self.is_greedy() {
            return argmax(logits);
        }
        let z: Vec<f32> = logits.iter().map(|&l| l / self.temperature).collect();
        let Some(max) = largest(&z) else {
            return 0;
        };
        // Only tokens of a positive weight are ranked: weights fall with the rank, so those are
        // its first places, and a token of weight 0 (most of a vocabulary, every token a
        // constraint masks) adds nothing to any sum and owns no part of the draw. Sorting the
        // whole vocabulary cost ~5 ms a token.
        let mut ranked: Vec<(u64, u32, u64)> = z
            .iter()
            .enumerate()
            .filter_map(|(i, &z)| {
                let w = weight(z, max);
                (w > 0).then(|| (order_key(z, i as u32), i as u32, w))
            })
            .collect();
        ranked.sort_unstable_by_key(|r| std::cmp::Reverse(r.0));
        let k = match self.top_k {
            0 => ranked.len(),
            k => k.min(ranked.len()),
        };
        let mut keep = k;
        if self.top_p < 1.0 {
            let threshold = top_p_threshold(ranked[..k].iter().map(|r| r.2).sum(), self.top_p);
            let mut before = 0u64;
            keep = ranked[..k]
                .iter()
                .take_while(|r| {
                    let kept = before < threshold;
                    before += r.2;
                    kept
                })
                .count()
                .max(1);
        }
        let mut kept: Vec<(u32, u64)> = ranked[..keep].iter().map(|r| (r.1, r.2)).collect();
        kept.sort_unstable_by_key(|r| r.0);
        let total: u64 = kept.iter().map(|r| r.1).sum();
        let target = draw_target(self.seed, position as u64, total);
        let mut end = 0u64;
        for (id, w) in &kept {
            end += w;
            if target < end {
                return *id;
            }
        }
        ranked[0].1
    }
}

#[cfg(test)]
impl Sampling {
    /// These settings (the tests' shorthand).
    pub(crate) fn of(temperature: f32, top_p: f32, top_k: usize, seed: u64) -> Self {
        Self {
            temperature,
            top_p,
            top_k,
            seed,
        }
    }
}

/// The first largest logit's token (torch's `argmax` also returns the first; a NaN is never
/// larger, and a NaN first logit gives 0): the rule the CPU decoder applies inside its output
/// layer, stated once in its crate.
pub fn argmax(logits: &[f32]) -> u32 {
    spotinfer_fused_cpu::argmax(logits)
}

/// The largest value that is not a NaN, if any.
pub fn largest(z: &[f32]) -> Option<f32> {
    z.iter().copied().filter(|v| !v.is_nan()).reduce(f32::max)
}

/// A token's rank as one integer: larger for a larger `z`, then for a lower id (so equal logits
/// rank by id and every key is distinct); 0 for a NaN, below every number.
pub fn order_key(z: f32, id: u32) -> u64 {
    if z.is_nan() {
        return 0;
    }
    let bits = z.to_bits();
    let ordered = if bits >> 31 == 1 {
        !bits
    } else {
        bits | 0x8000_0000
    };
    (u64::from(ordered) << 32) | u64::from(u32::MAX - id)
}

/// The weight of one `exp(…)`: 2³².
const ONE: f64 = 4_294_967_296.0;

/// A token's weight, `⌊exp(z − max) · 2³²⌋`: 2³² for the largest, 0 for a NaN and below about
/// e⁻²², computed by [`exp_nonpositive`] (the same bits in `kernels/paged.cu`).
pub fn weight(z: f32, max: f32) -> u64 {
    if z.is_nan() {
        return 0;
    }
    let x = z - max;
    if x.is_nan() {
        // z and max both +∞.
        return ONE as u64;
    }
    (exp_nonpositive(f64::from(x)) * ONE) as u64
}

/// `eˣ` for `x ≤ 0` from additions and multiplications alone, each rounded once in a fixed
/// order (no fused multiply-add; Rust does not contract, the kernel spells each operation), so
/// the CPU and the GPU give the same bits; relative error below 1e-14.
pub fn exp_nonpositive(x: f64) -> f64 {
    if x.is_nan() || x < -40.0 {
        return 0.0;
    }
    const LOG2E: f64 = std::f64::consts::LOG2_E;
    // ln 2 split so that n·LN2_HI is exact for |n| < 2¹¹ (Cody and Waite).
    const LN2_HI: f64 = 0.693_147_180_369_123_8;
    const LN2_LO: f64 = 1.908_214_929_270_587_7e-10;
    let n = (x * LOG2E + 0.5).floor();
    let r = (x - n * LN2_HI) - n * LN2_LO;
    // Taylor to r¹², |r| ≤ ln2/2: Horner from the highest term.
    let mut p = 1.0 / 479_001_600.0;
    for d in [
        39_916_800.0,
        3_628_800.0,
        362_880.0,
        40_320.0,
        5_040.0,
        720.0,
        120.0,
        24.0,
        6.0,
        2.0,
        1.0,
        1.0,
    ] {
        p = p * r + 1.0 / d;
    }
    p * f64::from_bits(((n as i64 + 1023) as u64) << 52)
}

/// The weight top-p keeps a token under: the weight ranked before it must be below this share
/// of `kept_by_top_k` (at most 2⁵³, so exact in an f64).
pub fn top_p_threshold(kept_by_top_k: u64, top_p: f32) -> u64 {
    (kept_by_top_k as f64 * f64::from(top_p)) as u64
}

/// `⌊u · total⌋` for the position's number `u` in [0, 1): the point of `[0, total)` whose token
/// is drawn. Exact: `u` is 53 random bits.
pub fn draw_target(seed: u64, position: u64, total: u64) -> u64 {
    ((u128::from(random_bits(seed, position)) * u128::from(total)) >> 53) as u64
}

/// 53 random bits from the seed and the position alone (SplitMix64 of both).
fn random_bits(seed: u64, position: u64) -> u64 {
    let mut z = seed ^ position.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    z >> 11
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_largest() {
        assert_eq!(
            Sampling::of(0.0, 1.0, 0, 1).choose(&[0.1, 3.0, 3.0, -1.0], 0),
            1
        );
    }

    #[test]
    fn the_same_seed_and_position_draw_the_same_token_and_others_differ() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let s = Sampling::of(1.0, 1.0, 0, 42);
        let a: Vec<u32> = (0..40).map(|p| s.choose(&logits, p)).collect();
        let b: Vec<u32> = (0..40).map(|p| s.choose(&logits, p)).collect();
        assert_eq!(a, b);
        let other: Vec<u32> = (0..40)
            .map(|p| Sampling::of(1.0, 1.0, 0, 43).choose(&logits, p))
            .collect();
        assert_ne!(a, other);
        assert!(a.iter().collect::<std::collections::HashSet<_>>().len() > 5);
    }

    /// Drawn over many positions, each token comes as often as its probability after the
    /// warpers: softmax of logits `ln 4, ln 2, 0` (4/7, 2/7, 1/7), and with top-p 0.6 the first
    /// two renormalised (2/3, 1/3; the second is kept since the first's 4/7 is below 0.6).
    #[test]
    fn tokens_come_as_often_as_their_probability() {
        let logits = [4f32.ln(), 2f32.ln(), 0.0];
        let n = 40_000;
        let share = |s: Sampling| -> Vec<f64> {
            let mut counts = [0usize; 3];
            (0..n).for_each(|p| counts[s.choose(&logits, p) as usize] += 1);
            counts.iter().map(|&c| c as f64 / n as f64).collect()
        };
        let close = |got: Vec<f64>, want: [f64; 3]| {
            for (g, w) in got.iter().zip(want) {
                assert!((g - w).abs() < 0.01, "{got:?} against {want:?}");
            }
        };
        close(
            share(Sampling::of(1.0, 1.0, 0, 9)),
            [4.0 / 7.0, 2.0 / 7.0, 1.0 / 7.0],
        );
        close(
            share(Sampling::of(1.0, 0.6, 0, 9)),
            [2.0 / 3.0, 1.0 / 3.0, 0.0],
        );
        // Temperature 2 flattens: weights 2, √2, 1.
        let (a, b) = (2f64, 2f64.sqrt());
        let sum = a + b + 1.0;
        close(
            share(Sampling::of(2.0, 1.0, 0, 9)),
            [a / sum, b / sum, 1.0 / sum],
        );
    }

    /// The exponential behind the weights is e^x to 1e-14 (so the draw is the softmax's).
    #[test]
    fn the_weights_exponential_is_exact_to_1e_14() {
        for i in 0..=4000 {
            let x = -(i as f64) * 0.01;
            let (got, want) = (exp_nonpositive(x), x.exp());
            assert!(
                ((got - want) / want).abs() < 1e-14,
                "e^{x}: {got} against {want}"
            );
        }
        assert_eq!(weight(3.0, 3.0), 1 << 32);
        assert_eq!(weight(-50.0, 0.0), 0);
        assert_eq!(weight(f32::NAN, 0.0), 0);
    }

    #[test]
    fn top_k_and_top_p_keep_only_the_likeliest() {
        let logits = [5.0, 4.0, 0.0, -2.0, 4.5];
        for p in 0..200 {
            let k = Sampling::of(1.0, 1.0, 2, 7).choose(&logits, p);
            assert!(k == 0 || k == 4, "top-k 2 drew {k}");
            // Token 0 alone holds ~0.5 of the mass, so top_p 0.4 keeps only it.
            assert_eq!(Sampling::of(1.0, 0.4, 0, 7).choose(&logits, p), 0);
        }
    }
}
