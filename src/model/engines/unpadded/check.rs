//! Every operation of the unpadded encoder on a device against its CPU reference, on random
//! inputs of a model's shapes: what the GPU check (`bench/gpu-check.sh`, through `spotinfer
//! models kernels`) runs first on a GPU, so a kernel that computes something else than its
//! reference is named before any model-level figure is read. On the CPU the two sides are the
//! same code, which is how CI runs it.

use super::ops::{AddNorm, Dense, VarlenAttention};
use candle_core::{DType, Device, Result, Tensor};

/// One operation at one shape and dtype against its reference.
#[derive(Debug, Clone, serde::Serialize)]
pub struct KernelCheck {
    /// The operation (`dense`, `varlen-attention`, `add-layer-norm`,
    /// `add-layer-norm-keeping-sum`).
    pub op: String,
    /// Its shape, as `tokens x inputs -> outputs` or the like.
    pub shape: String,
    /// The dtype it ran in.
    pub dtype: String,
    /// The largest difference from the reference, relative to the reference's largest
    /// magnitude.
    pub largest_difference: f32,
    /// The difference allowed: one unit of the dtype's last place, plus what summing in another
    /// order may change in f32.
    pub bar: f32,
    /// Whether it is within the bar.
    pub passed: bool,
}

/// A model's shapes: width, heads, feed-forward width.
#[derive(Debug, Clone, Copy)]
pub struct Shapes {
    /// The hidden width.
    pub hidden: usize,
    /// Attention heads.
    pub heads: usize,
    /// The feed-forward's inner width.
    pub intermediate: usize,
}

/// Runs every operation at `shapes` over a packed batch of texts of `lengths` tokens, in
/// `dtype`, on `device` and on the CPU, and compares.
pub fn check_kernels(
    device: &Device,
    dtype: DType,
    shapes: Shapes,
    lengths: &[usize],
) -> Result<Vec<KernelCheck>> {
    let tokens: usize = lengths.iter().sum();
    let (d, i) = (shapes.hidden, shapes.intermediate);
    let mut seed = 0;
    let mut random = |rows: usize, cols: usize| {
        seed += 1;
        uniform(rows * cols, seed)
            .and_then(|v| Tensor::from_vec(v, (rows, cols), &Device::Cpu))
            .and_then(|t| t.to_dtype(dtype))
    };
    let mut checks = vec![];
    for (inputs, outputs) in [(d, 3 * d), (d, d), (d, i), (i, d)] {
        let x = random(tokens, inputs)?;
        let dense = |dev: &Device| -> Result<Dense> {
            Ok(Dense {
                weight: (random_on(outputs, inputs, 101, dtype)? * 0.1)?.to_device(dev)?,
                bias: random_on(1, outputs, 102, dtype)?
                    .squeeze(0)?
                    .to_device(dev)?,
            })
        };
        let reference = dense(&Device::Cpu)?.forward(&x)?;
        let got = dense(device)?.forward(&x.to_device(device)?)?;
        let shape = format!("{tokens}x{inputs} -> {outputs}");
        checks.push(compare("dense", shape, &reference, &got, dtype, inputs)?);
    }
    let mut starts = vec![0u32];
    for n in lengths {
        starts.push(starts[starts.len() - 1] + *n as u32);
    }
    let cu = Tensor::new(starts.as_slice(), &Device::Cpu)?;
    let attention = VarlenAttention {
        heads: shapes.heads,
        head_dim: d / shapes.heads,
        max_len: lengths.iter().copied().max().unwrap_or(0),
    };
    let qkv = random(tokens, 3 * d)?;
    let reference = qkv.apply_op2(&cu, attention)?;
    let got = qkv
        .to_device(device)?
        .apply_op2(&cu.to_device(device)?, attention)?;
    let shape = format!(
        "{} texts, {tokens} tokens, {} heads x {}",
        lengths.len(),
        shapes.heads,
        d / shapes.heads
    );
    checks.push(compare(
        "varlen-attention",
        shape,
        &reference,
        &got,
        dtype,
        32,
    )?);
    let (x, r) = (random(tokens, d)?, random(tokens, d)?);
    for keep_sum in [false, true] {
        let norm = |dev: &Device| -> Result<AddNorm> {
            Ok(AddNorm {
                gamma: random_on(1, d, 201, dtype)?.squeeze(0)?.to_device(dev)?,
                beta: random_on(1, d, 202, dtype)?.squeeze(0)?.to_device(dev)?,
                eps: 1e-12,
                keep_sum,
            })
        };
        let reference = x.apply_op2(&r, norm(&Device::Cpu)?)?;
        let got = x
            .to_device(device)?
            .apply_op2(&r.to_device(device)?, norm(device)?)?;
        let op = match keep_sum {
            false => "add-layer-norm",
            true => "add-layer-norm-keeping-sum",
        };
        checks.push(compare(
            op,
            format!("{tokens}x{d}"),
            &reference,
            &got,
            dtype,
            1,
        )?);
    }
    Ok(checks)
}

/// The check of `got` against `reference`, relative to the reference's largest magnitude: one
/// unit in the dtype's last place (a sum that lands near a rounding boundary may round either
/// way), plus what adding `terms` f32 values in another order may change.
pub(crate) fn compare(
    op: &str,
    shape: String,
    reference: &Tensor,
    got: &Tensor,
    dtype: DType,
    terms: usize,
) -> Result<KernelCheck> {
    let reference = reference.to_dtype(DType::F32)?;
    let got = got.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
    let scale = reference
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f32>()?
        .max(1e-30);
    let difference = (reference - got)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f32>()?;
    let ulp = match dtype {
        DType::F16 => 2f32.powi(-10),
        DType::BF16 => 2f32.powi(-7),
        _ => 2f32.powi(-23),
    };
    let bar = ulp + 4.0 * (terms as f32).sqrt() * 2f32.powi(-23);
    let largest_difference = difference / scale;
    Ok(KernelCheck {
        op: op.into(),
        shape,
        dtype: format!("{dtype:?}").to_lowercase(),
        largest_difference,
        bar,
        passed: largest_difference <= bar,
    })
}

/// A `(rows, cols)` tensor of values in [-1, 1) from `seed`, in `dtype`, on the CPU.
fn random_on(rows: usize, cols: usize, seed: u64, dtype: DType) -> Result<Tensor> {
    Tensor::from_vec(uniform(rows * cols, seed)?, (rows, cols), &Device::Cpu)?.to_dtype(dtype)
}

/// `n` values in [-1, 1) from a linear congruential generator (the same on every machine).
pub(crate) fn uniform(n: usize, seed: u64) -> Result<Vec<f32>> {
    let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    Ok((0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 23) as f32) - 1.0
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::{check_kernels, compare, Shapes};
    use candle_core::{DType, Device, Tensor};

    /// Every operation, every dtype, one line each; on the CPU the device side is the reference
    /// itself, so each is exact.
    #[test]
    fn every_operation_is_checked_in_every_dtype() {
        let shapes = Shapes {
            hidden: 32,
            heads: 2,
            intermediate: 64,
        };
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let checks = check_kernels(&Device::Cpu, dtype, shapes, &[1, 33, 7]).unwrap();
            let ops: Vec<&str> = checks.iter().map(|c| c.op.as_str()).collect();
            assert_eq!(
                ops,
                [
                    "dense",
                    "dense",
                    "dense",
                    "dense",
                    "varlen-attention",
                    "add-layer-norm",
                    "add-layer-norm-keeping-sum"
                ]
            );
            assert!(
                checks
                    .iter()
                    .all(|c| c.passed && c.largest_difference == 0.0),
                "{checks:?}"
            );
        }
    }

    /// A result two units off in the dtype's last place fails the check; one unit passes.
    #[test]
    fn a_result_past_one_unit_of_the_last_place_fails() {
        let reference = Tensor::new(&[1.0f32, -0.5, 0.25], &Device::Cpu).unwrap();
        for (dtype, ulp) in [(DType::F16, 2f32.powi(-10)), (DType::BF16, 2f32.powi(-7))] {
            let off = |units: f32| (reference.clone() + f64::from(units * ulp)).unwrap();
            let check =
                |units| compare("x", String::new(), &reference, &off(units), dtype, 64).unwrap();
            assert!(check(1.0).passed, "{dtype:?}");
            assert!(!check(2.0).passed, "{dtype:?}");
        }
    }
}
