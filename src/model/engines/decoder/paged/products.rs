//! The paged decoder's dense products on a device, the proof of their batch invariance there:
//! `linear` (on CUDA the product pinned to one cuBLASLt configuration per weight shape, on the
//! CPU the row-by-row op) on a batch of rows and on its first rows alone must give those rows
//! bit for bit, or a sequence's logits would depend on what it was batched with and a resumed
//! generation would not repeat an uninterrupted one. On CUDA each row also reports the pinned
//! product's time against candle's own (cuBLAS's heuristic), the price of that invariance.

use super::linear::{default_linear, linear};
use super::rows::{largest_difference, random_rows};
use crate::model::engines::unpadded::check::KernelCheck;
use candle_core::{DType, Device, Result, Tensor};
use std::time::Instant;

/// Timed samples of each product, after one to warm up (the median is reported).
const SAMPLES: usize = 5;
/// Products in one timed sample, between two synchronisations of the device.
const CALLS: usize = 10;

/// For each weight shape `(outputs, inputs)` of `dims` in `dtype` on `device` (random weights
/// and bias): [`linear`] on a batch of `max(rows)` random rows and, for each count of `rows`, on
/// the first that many rows alone; one row a (shape, count), its largest difference between the
/// two (bar: none, the rows bit-identical). On CUDA the row's shape also reports the pinned
/// product's median time over that many rows against candle's (`default_linear`), their ratio,
/// and the cuBLASLt configuration pinned to the shape.
pub fn check_products(
    device: &Device,
    dims: &[(usize, usize)],
    rows: &[usize],
    dtype: DType,
) -> Result<Vec<KernelCheck>> {
    let batch = rows.iter().copied().max().unwrap_or(0);
    let mut checks = vec![];
    for (i, &(outputs, inputs)) in dims.iter().enumerate() {
        let seed = 500 + 3 * i as u64;
        let w = random_rows(outputs, inputs, seed, dtype)?.to_device(device)?;
        let b = random_rows(1, outputs, seed + 1, dtype)?
            .reshape(outputs)?
            .to_device(device)?;
        let x = random_rows(batch, inputs, seed + 2, dtype)?.to_device(device)?;
        let whole = linear(&x, &w, Some(&b))?;
        for &m in rows {
            let first = x.narrow(0, 0, m)?;
            let alone = linear(&first, &w, Some(&b))?;
            let d = largest_difference(&whole.narrow(0, 0, m)?, &alone)?;
            let timing = match device.is_cuda() {
                true => {
                    let pinned = median_ms(device, || linear(&first, &w, Some(&b)))?;
                    let candle = median_ms(device, || default_linear(&first, &w, Some(&b)))?;
                    #[cfg(feature = "cuda")]
                    let config = super::pinned::pinned_config(device, outputs, inputs, dtype)
                        .map(|c| format!("; {c}"))
                        .unwrap_or_default();
                    #[cfg(not(feature = "cuda"))]
                    let config = String::new();
                    format!(
                        "; pinned {pinned:.4} ms, candle's {candle:.4} ms (x{:.2}){config}",
                        pinned / candle
                    )
                }
                false => String::new(),
            };
            checks.push(KernelCheck {
                op: "paged-linear-invariance".into(),
                shape: format!(
                    "{inputs} -> {outputs}: {m} rows alone against the first {m} of {batch}{timing}"
                ),
                dtype: format!("{dtype:?}").to_lowercase(),
                largest_difference: d,
                bar: 0.0,
                passed: d == 0.0,
            });
        }
    }
    Ok(checks)
}

/// The median over [`SAMPLES`] of the milliseconds one `product` takes on `device`, each sample
/// [`CALLS`] of them between two synchronisations, after one sample to warm up.
fn median_ms(device: &Device, product: impl Fn() -> Result<Tensor>) -> Result<f64> {
    let mut times = vec![];
    for sample in 0..=SAMPLES {
        device.synchronize()?;
        let start = Instant::now();
        for _ in 0..CALLS {
            product()?;
        }
        device.synchronize()?;
        if sample > 0 {
            times.push(start.elapsed().as_secs_f64() * 1e3 / CALLS as f64);
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

#[cfg(test)]
mod tests {
    /// On the CPU the row-by-row op gives each row bit for bit alone and in a batch.
    #[test]
    fn products_are_batch_invariant_on_the_cpu() {
        let device = candle_core::Device::Cpu;
        for dtype in [candle_core::DType::F32, candle_core::DType::BF16] {
            let checks =
                super::check_products(&device, &[(48, 32), (40, 24)], &[1, 7, 16], dtype).unwrap();
            assert_eq!(checks.len(), 6);
            assert!(
                checks
                    .iter()
                    .all(|c| c.passed && c.largest_difference == 0.0),
                "{checks:?}"
            );
        }
    }
}
