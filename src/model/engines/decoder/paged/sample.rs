//! Sampling on the device (issue 52): each sampled sequence's next token drawn where its logits
//! are, so a step copies one id a sequence back instead of its vocabulary's logits. The draw is
//! the decode loop's own (`super::super::sampling`): integer weights and ranks, so the kernel's
//! order of adding cannot change the token. The kernel (`kernels/paged.cu`, `sample_rows`) runs
//! one block a row and finds the tokens top-k and top-p keep without sorting: it searches for
//! the lowest rank key they keep by bisection, counting and weighing the tokens above each
//! candidate key in one pass. [`SampleRows`]' `cpu_fwd` is that search, step for step; the
//! tests hold it to the sampler's sorted walk on rows with ties, NaNs and infinities.

use super::super::sampling::{draw_target, largest, order_key, top_p_threshold, weight, Sampling};
use crate::model::engines::host::{f32s, u32s};
use candle_core::{CpuStorage, CustomOp2, Device, Layout, Result, Shape, Tensor};

/// Words of one row's parameters: temperature and top-p bits, top-k, seed and position (two
/// words each), one unused.
pub const PARAMS: usize = 8;

/// The `(rows, PARAMS)` u32 parameters of `rows` (each sampled, temperature above 0, and the
/// position of the token it draws) on `device`.
pub fn params(rows: &[(Sampling, usize)], device: &Device) -> Result<Tensor> {
    let mut words = Vec::with_capacity(rows.len() * PARAMS);
    for (s, position) in rows {
        if s.temperature <= 0.0 || s.temperature.is_nan() {
            candle_core::bail!(
                "device sampling: temperature {} is not above 0",
                s.temperature
            );
        }
        let (seed, position) = (s.seed, *position as u64);
        words.extend([
            s.temperature.to_bits(),
            s.top_p.to_bits(),
            u32::try_from(s.top_k).unwrap_or(u32::MAX),
            seed as u32,
            (seed >> 32) as u32,
            position as u32,
            (position >> 32) as u32,
            0,
        ]);
    }
    Tensor::from_vec(words, (rows.len(), PARAMS), device)
}

/// `(rows, vocab)` logits and their [`params`] to each row's drawn id, `(rows)` u32.
#[derive(Debug, Clone, Copy)]
pub struct SampleRows;

/// Most tokens a vocabulary may have: every sum of weights (2³² each) stays below 2⁵³, exact in
/// the f64 the top-p threshold is taken in.
pub const MAX_VOCAB: usize = 1 << 21;

impl CustomOp2 for SampleRows {
    fn name(&self) -> &'static str {
        "sample-rows"
    }

    fn cpu_fwd(
        &self,
        logits: &CpuStorage,
        logits_layout: &Layout,
        params: &CpuStorage,
        params_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (rows, vocab) = checked_dims(logits_layout, params_layout)?;
        let values = f32s(logits, logits_layout)?;
        let words = u32s(params, params_layout)?;
        let ids = values
            .chunks(vocab)
            .zip(words.chunks(PARAMS))
            .map(|(row, p)| search_row(row, &Row::read(p)))
            .collect();
        Ok((CpuStorage::U32(ids), Shape::from(rows)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        logits: &candle_core::CudaStorage,
        logits_layout: &Layout,
        params: &candle_core::CudaStorage,
        params_layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        checked_dims(logits_layout, params_layout)?;
        super::cuda::sample_rows((logits, logits_layout), (params, params_layout))
    }
}

/// `(rows, vocab)`, once the parameters are one row of [`PARAMS`] a logits row and the
/// vocabulary is neither empty nor past [`MAX_VOCAB`].
fn checked_dims(logits: &Layout, params: &Layout) -> Result<(usize, usize)> {
    let (rows, vocab) = logits.shape().dims2()?;
    if params.shape().dims2()? != (rows, PARAMS) {
        candle_core::bail!(
            "device sampling: parameters {:?} for {rows} rows",
            params.shape()
        );
    }
    if vocab == 0 || vocab > MAX_VOCAB {
        candle_core::bail!("device sampling: a vocabulary of {vocab} (1 to {MAX_VOCAB})");
    }
    Ok((rows, vocab))
}

/// One row's parameters, as the kernel reads them.
struct Row {
    temperature: f32,
    top_p: f32,
    top_k: u32,
    seed: u64,
    position: u64,
}

impl Row {
    fn read(p: &[u32]) -> Self {
        Self {
            temperature: f32::from_bits(p[0]),
            top_p: f32::from_bits(p[1]),
            top_k: p[2],
            seed: u64::from(p[3]) | u64::from(p[4]) << 32,
            position: u64::from(p[5]) | u64::from(p[6]) << 32,
        }
    }
}

/// The kernel's algorithm for one row, in its order (its passes over the vocabulary are the
/// loops here; its block reductions are integer sums and maxima, whose order does not matter).
fn search_row(logits: &[f32], p: &Row) -> u32 {
    let z: Vec<f32> = logits.iter().map(|&l| l / p.temperature).collect();
    let Some(max) = largest(&z) else {
        return 0;
    };
    let keys: Vec<u64> = z
        .iter()
        .enumerate()
        .map(|(i, &v)| order_key(v, i as u32))
        .collect();
    let weights: Vec<u64> = z.iter().map(|&v| weight(v, max)).collect();
    let top = keys.iter().copied().max().unwrap_or(0);
    let vocab = z.len() as u64;
    let k = match u64::from(p.top_k) {
        0 => vocab,
        k => k.min(vocab),
    };
    // Tokens ranked above `key`, and their weight: one pass.
    let above = |key: u64| -> (u64, u64) {
        keys.iter()
            .zip(&weights)
            .filter(|(&k, _)| k > key)
            .fold((0, 0), |(n, m), (_, &w)| (n + 1, m + w))
    };
    let within_k = |key: u64| k >= vocab || above(key).0 < k;
    let from_k = match k < vocab {
        true => lowest_kept(0, top, within_k),
        false => 0,
    };
    let mut from = from_k;
    if p.top_p < 1.0 {
        let kept_by_k = mass_from(&keys, &weights, from_k);
        let threshold = top_p_threshold(kept_by_k, p.top_p);
        from = lowest_kept(from_k, top, |key| within_k(key) && above(key).1 < threshold);
    }
    let total = mass_from(&keys, &weights, from);
    let target = draw_target(p.seed, p.position, total);
    let mut end = 0u64;
    for (i, (&key, &w)) in keys.iter().zip(&weights).enumerate() {
        if key >= from {
            end += w;
            if target < end {
                return i as u32;
            }
        }
    }
    0
}

/// The lowest key in `[low, top]` that `keeps` (true at `top` by definition, and for every key
/// above one it is true for), by bisection: 64 passes at most.
fn lowest_kept(mut low: u64, top: u64, keeps: impl Fn(u64) -> bool) -> u64 {
    let mut high = top;
    while low < high {
        let mid = low + (high - low) / 2;
        if keeps(mid) {
            high = mid;
        } else {
            low = mid + 1;
        }
    }
    high
}

/// The weight of the tokens whose key is `from` or above.
fn mass_from(keys: &[u64], weights: &[u64], from: u64) -> u64 {
    keys.iter()
        .zip(weights)
        .filter(|(&k, _)| k >= from)
        .map(|(_, &w)| w)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

    /// Rows of logits with what can go wrong: ties, NaNs, infinities, one value, all equal.
    fn rows() -> Vec<Vec<f32>> {
        let mut rows: Vec<Vec<f32>> = (0..6u64)
            .map(|seed| {
                crate::model::engines::unpadded::check::uniform(300, 70 + seed)
                    .unwrap()
                    .into_iter()
                    .map(|v| (v * 8.0).round() / 2.0)
                    .collect()
            })
            .collect();
        rows[1][17] = f32::NAN;
        rows[2][3] = f32::INFINITY;
        rows[2][250] = f32::INFINITY;
        rows[3][0] = f32::NEG_INFINITY;
        rows.push(vec![f32::NAN; 40]);
        rows.push(vec![0.5; 64]);
        rows.push(vec![f32::NEG_INFINITY; 9]);
        rows.push(vec![2.0]);
        rows
    }

    /// The kernel's search draws, row for row, what the decode loop's sorted sampler draws from
    /// the same logits, for every combination of temperature, top-k and top-p, at many
    /// positions, in f32, f16 and bf16 (the logits rounded alike for both).
    #[test]
    fn the_kernels_search_draws_what_the_sampler_draws() {
        let settings = [
            Sampling::of(1.0, 1.0, 0, 1),
            Sampling::of(0.7, 0.9, 0, 2),
            Sampling::of(1.3, 1.0, 5, 3),
            Sampling::of(0.5, 0.5, 40, 4),
            Sampling::of(2.0, 0.01, 0, 5),
            Sampling::of(1.0, 1e-12, 3, 6),
            Sampling::of(1.0, 1.0, 100_000, 7),
        ];
        let mut drawn = 0;
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            for row in rows() {
                let t = Tensor::from_vec(row.clone(), (1, row.len()), &Device::Cpu)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
                let rounded: Vec<f32> = t
                    .to_dtype(DType::F32)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                for s in settings {
                    let cases: Vec<(Sampling, usize)> = (0..12).map(|p| (s, p * 7)).collect();
                    let logits = t.repeat((cases.len(), 1)).unwrap();
                    let params = params(&cases, &Device::Cpu).unwrap();
                    let got = logits
                        .apply_op2(&params, SampleRows)
                        .unwrap()
                        .to_vec1::<u32>()
                        .unwrap();
                    let want: Vec<u32> =
                        cases.iter().map(|(s, p)| s.choose(&rounded, *p)).collect();
                    assert_eq!(got, want, "{dtype:?} {s:?} on {row:?}");
                    drawn += got.len();
                }
            }
        }
        assert!(drawn > 2000);
    }

    /// A temperature of 0 (greedy) is not sampled here, and the parameters must fit the logits.
    #[test]
    fn greedy_rows_and_mismatched_parameters_are_refused() {
        assert!(params(&[(Sampling::of(0.0, 1.0, 0, 1), 0)], &Device::Cpu).is_err());
        let logits = Tensor::zeros((2, 5), DType::F32, &Device::Cpu).unwrap();
        let one = params(&[(Sampling::of(1.0, 1.0, 0, 1), 0)], &Device::Cpu).unwrap();
        assert!(logits.apply_op2(&one, SampleRows).is_err());
    }
}
