//! The paged cache's operations on a device against their CPU references, and their batch
//! invariance on the device itself: what `spotinfer models kernels --paged` prints and the GPU
//! check runs on a GPU (on the CPU the two sides are the same code, which is how CI runs it).

use super::attention::{PagedAttention, RowLayout, WriteCache};
use super::blocks::BlockPool;
use super::rows::{largest_difference, random_rows};
use crate::model::engines::unpadded::check::{compare, uniform, KernelCheck};
use candle_core::{DType, Device, Result, Tensor};

/// Slots a block in the checks and tests.
pub const BLOCK: usize = 16;
/// Blocks in the checks' and tests' pool.
const BLOCKS: usize = 64;

/// A paged cache on a device and the steps run on it, as a decoder runs them: each step's new
/// rows written to their slots, then attended.
pub struct Harness {
    layout: RowLayout,
    /// The host's bookkeeping of the cache's blocks.
    pub pool: BlockPool,
    kv: Tensor,
}

impl Harness {
    /// An empty cache of `layout`'s heads in `dtype` on `device`.
    pub fn new(layout: RowLayout, dtype: DType, device: &Device) -> Result<Self> {
        let shape = (2, BLOCKS * BLOCK, layout.kv_heads, layout.head_dim);
        Ok(Self {
            layout,
            pool: BlockPool::new(BLOCKS, BLOCK),
            kv: Tensor::zeros(shape, dtype, device)?,
        })
    }

    /// One step over `feeds` (an admitted sequence, its new rows on the host): the rows'
    /// attention outputs in order, on the host.
    pub fn step(&mut self, feeds: &[(u64, Tensor)]) -> Result<Tensor> {
        let device = self.kv.device().clone();
        let (mut slots, mut plan) = (vec![], vec![]);
        for (row, (seq, rows)) in feeds.iter().enumerate() {
            let first = self.pool.len(*seq).unwrap_or(0);
            let n = rows.dims2()?.0;
            let taken = self
                .pool
                .append(*seq, n)
                .map_err(candle_core::Error::wrap)?;
            slots.extend(taken);
            plan.extend((0..n).flat_map(|i| [row as u32, (first + i) as u32]));
        }
        let seqs: Vec<u64> = feeds.iter().map(|f| f.0).collect();
        let rows: Vec<&Tensor> = feeds.iter().map(|f| &f.1).collect();
        let rows = Tensor::cat(&rows, 0)?.to_device(&device)?;
        let slots = Tensor::new(slots, &device)?;
        self.kv
            .inplace_op3(&rows, &slots, &WriteCache(self.layout))?;
        let (tables, width) = self
            .pool
            .table_matrix(&seqs)
            .map_err(candle_core::Error::wrap)?;
        plan.extend(tables);
        let op = PagedAttention {
            layout: self.layout,
            block_size: BLOCK,
            width,
        };
        rows.apply_op3(&self.kv, &Tensor::new(plan, &device)?, op)?
            .to_device(&Device::Cpu)
    }

    /// The cache's contents, on the host.
    pub fn cache(&self) -> Result<Tensor> {
        self.kv.to_device(&Device::Cpu)
    }
}

/// The paged operations on `device` at the SmolLM2-135M (9 heads, 3 KV heads of 64) and
/// Qwen2-0.5B (14 and 2 of 64) shapes in f32, f16 and bf16: the rotary embedding of the rows,
/// the cache's writes and the attention of a prefill of four sequences (1, 7, 64 and 130 tokens,
/// blocks scattered) against the CPU reference, and on the device itself one sequence's outputs
/// read whole beside others against the same read in chunks and decoded token by token (bar:
/// none of difference).
pub fn check_paged(device: &Device) -> Result<Vec<KernelCheck>> {
    let mut checks = vec![];
    for (name, heads, kv_heads) in [("smollm2-135m", 9, 3), ("qwen2-0.5b", 14, 2)] {
        let layout = RowLayout::qkv(heads, kv_heads, 64);
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let lengths = [1usize, 7, 64, 130];
            let feeds: Vec<(u64, Tensor)> = lengths
                .iter()
                .enumerate()
                .map(|(s, &n)| {
                    Ok((
                        s as u64,
                        random_rows(n, layout.stride, s as u64 + 1, dtype)?,
                    ))
                })
                .collect::<Result<_>>()?;
            let run = |device: &Device| -> Result<(Tensor, Tensor)> {
                let mut h = Harness::new(layout, dtype, device)?;
                for (s, &n) in lengths.iter().enumerate() {
                    h.pool
                        .admit(s as u64, n)
                        .map_err(candle_core::Error::wrap)?;
                    h.pool
                        .admit(100 + s as u64, 1)
                        .map_err(candle_core::Error::wrap)?;
                }
                Ok((h.step(&feeds)?, h.cache()?))
            };
            let ((want, want_cache), (got, got_cache)) = (run(&Device::Cpu)?, run(device)?);
            let shape = format!("{name}: {lengths:?} tokens");
            // A copy: exact, whatever the dtype.
            let mut write = compare(
                "paged-write-cache",
                shape.clone(),
                &want_cache,
                &got_cache,
                dtype,
                1,
            )?;
            (write.bar, write.passed) = (0.0, write.largest_difference == 0.0);
            checks.push(write);
            checks.push(compare("paged-attention", shape, &want, &got, dtype, 130)?);
            checks.push(invariance(device, layout, dtype, name)?);
            checks.push(rotary_check(device, (heads, kv_heads), dtype, name)?);
        }
    }
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        checks.push(argmax_check(device, dtype)?);
        checks.push(sample_check(device, dtype)?);
        checks.push(mask_check(device, dtype)?);
    }
    let (dims, rows): (&[(usize, usize)], &[usize]) = match device.is_cpu() {
        true => (&[(48, 32), (40, 24)], &[1, 7, 16]),
        // Qwen2-0.5B's: 896 -> 896 (q, o), 128 (k, v), 4,864 (gate, up), 4,864 -> 896 (down) and
        // 896 -> 151,936 (the logits).
        false => (
            &[
                (896, 896),
                (128, 896),
                (4864, 896),
                (896, 4864),
                (151_936, 896),
            ],
            &[1, 7, 64, 256],
        ),
    };
    checks.extend(super::products::check_products(
        device,
        dims,
        rows,
        DType::BF16,
    )?);
    Ok(checks)
}

/// The rotary embedding of 130 random rows of a shape's heads (64 wide) on `device` against its
/// CPU reference: the same f32 expressions rounded once, so the bar is equality.
fn rotary_check(
    device: &Device,
    (heads, kv_heads): (usize, usize),
    dtype: DType,
    name: &str,
) -> Result<KernelCheck> {
    let (tokens, head_dim) = (130, 64);
    let op = super::rotary::RotaryRows {
        heads,
        kv_heads,
        head_dim,
    };
    let rows = random_rows(tokens, op.width(), 11, dtype)?;
    let angles = (random_rows(tokens, head_dim / 2, 12, DType::F32)? * 100.0)?;
    let (cos, sin) = (
        angles.cos()?.to_dtype(dtype)?,
        angles.sin()?.to_dtype(dtype)?,
    );
    let want = rows.apply_op3(&cos, &sin, op)?;
    let on = |t: &Tensor| t.to_device(device);
    let got = on(&rows)?.apply_op3(&on(&cos)?, &on(&sin)?, op)?;
    let shape = format!("{name}: {tokens} tokens");
    let mut check = compare("paged-rotary-rows", shape, &want, &got, dtype, 1)?;
    (check.bar, check.passed) = (0.0, check.largest_difference == 0.0);
    Ok(check)
}

/// Greedy choice on `device` against the decode loop's argmax: 64 rows of a 49,152-token
/// vocabulary (SmolLM2's), every fourth row's maximum repeated at a later index, the last row
/// led by a NaN; the share of rows that differ (bar: none).
fn argmax_check(device: &Device, dtype: DType) -> Result<KernelCheck> {
    let (rows, vocab) = (64usize, 49_152usize);
    let mut values = uniform(rows * vocab, 91)?;
    for r in (0..rows).step_by(4) {
        let row = &mut values[r * vocab..(r + 1) * vocab];
        row[r * 7 + 3] = 9.0;
        row[vocab - 1 - r] = 9.0;
    }
    values[(rows - 1) * vocab] = f32::NAN;
    let logits = Tensor::from_vec(values, (rows, vocab), &Device::Cpu)?.to_dtype(dtype)?;
    let want = logits
        .apply_op1(super::argmax::ArgmaxRows)?
        .to_vec1::<u32>()?;
    let got = logits
        .to_device(device)?
        .apply_op1(super::argmax::ArgmaxRows)?
        .to_vec1::<u32>()?;
    let shape = format!("{rows} rows of {vocab}, ties and a NaN");
    Ok(same_ids("paged-argmax", shape, dtype, &want, &got))
}

/// A check of token ids chosen on the device against the host's (or of values' bits): the share
/// that differ (bar: none).
fn same_ids(op: &str, shape: String, dtype: DType, want: &[u32], got: &[u32]) -> KernelCheck {
    let differ = want.iter().zip(got).filter(|(a, b)| a != b).count();
    KernelCheck {
        op: op.into(),
        shape,
        dtype: format!("{dtype:?}").to_lowercase(),
        largest_difference: differ as f32 / want.len() as f32,
        bar: 0.0,
        passed: differ == 0 && want.len() == got.len(),
    }
}

/// Sampling on `device` against the decode loop's sampler (sorting on the host): 64 rows of
/// Qwen2's 151,936-token vocabulary (8 of 4,096 on the CPU, where the op is the kernel's
/// bisection step for step and slow), with ties, a NaN and an infinity, under temperatures,
/// top-k and top-p each row its own, at scattered positions; the share of rows whose token
/// differs (bar: none).
fn sample_check(device: &Device, dtype: DType) -> Result<KernelCheck> {
    use crate::model::engines::decoder::Sampling;
    let (rows, vocab) = match device.is_cpu() {
        true => (8usize, 4_096usize),
        false => (64, 151_936),
    };
    let mut values = uniform(rows * vocab, 93)?;
    values
        .iter_mut()
        .for_each(|v| *v = (*v * 64.0).round() / 4.0);
    values[5] = f32::NAN;
    values[vocab + 9] = f32::INFINITY;
    let logits = Tensor::from_vec(values, (rows, vocab), &Device::Cpu)?.to_dtype(dtype)?;
    let settings = [
        (1.0, 1.0, 0),
        (0.7, 0.95, 0),
        (1.2, 1.0, 50),
        (0.8, 0.9, 40),
    ];
    let cases: Vec<(Sampling, usize)> = (0..rows)
        .map(|r| {
            let (temperature, top_p, top_k) = settings[r % settings.len()];
            let s = Sampling {
                temperature,
                top_p,
                top_k,
                seed: 1_000 + r as u64,
            };
            (s, r * 37)
        })
        .collect();
    let rounded = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let want: Vec<u32> = cases
        .iter()
        .zip(&rounded)
        .map(|((s, position), row)| s.choose(row, *position))
        .collect();
    let params = super::sample::params(&cases, device)?;
    let got = logits
        .to_device(device)?
        .apply_op2(&params, super::sample::SampleRows)?
        .to_vec1::<u32>()?;
    let shape = format!("{rows} rows of {vocab}, temperature, top-k, top-p, ties, NaN, inf");
    Ok(same_ids("paged-sample", shape, dtype, &want, &got))
}

/// Constrained rows masked on `device` against the op's CPU reference (the host's masking): 64
/// rows of Qwen2's 151,936-token vocabulary (8 of 4,096 on the CPU), each allowing its own
/// scattered third of the first `vocab - 64` ids, with bits set past them; the share of values
/// whose bits differ (bar: none).
fn mask_check(device: &Device, dtype: DType) -> Result<KernelCheck> {
    let (rows, vocab) = match device.is_cpu() {
        true => (8usize, 4_096usize),
        false => (64, 151_936),
    };
    let (allowed, words) = (vocab - 64, vocab.div_ceil(32));
    let values = uniform(rows * vocab, 95)?;
    let logits = Tensor::from_vec(values, (rows, vocab), &Device::Cpu)?.to_dtype(dtype)?;
    let mut bits = vec![0u32; rows * words];
    for (i, word) in bits.iter_mut().enumerate() {
        *word = (i as u32).wrapping_mul(2_654_435_761) & 0x9249_2492;
    }
    let op = super::mask::MaskRows { allowed };
    let masks = Tensor::from_vec(bits, (rows, words), &Device::Cpu)?;
    let masked = |device: &Device| -> Result<Vec<u32>> {
        let out = logits
            .to_device(device)?
            .apply_op2(&masks.to_device(device)?, op)?;
        Ok(out
            .flatten_all()?
            .to_vec1::<f32>()?
            .iter()
            .map(|v| v.to_bits())
            .collect())
    };
    let shape = format!("{rows} rows of {vocab}, {allowed} ids masked");
    Ok(same_ids(
        "paged-mask",
        shape,
        dtype,
        &masked(&Device::Cpu)?,
        &masked(device)?,
    ))
}

/// One sequence of 100 tokens on `device`: read whole beside another, read in chunks (37, 1,
/// 62), and decoded token by token after a prefill of 40 beside another decoding sequence; the
/// largest difference of the chunked and decoded outputs from the whole ones (the bar is 0).
fn invariance(device: &Device, layout: RowLayout, dtype: DType, name: &str) -> Result<KernelCheck> {
    let rows = random_rows(100, layout.stride, 77, dtype)?;
    let other = random_rows(100, layout.stride, 78, dtype)?;
    let fresh = || -> Result<Harness> {
        let mut h = Harness::new(layout, dtype, device)?;
        h.pool.admit(9, 100).map_err(candle_core::Error::wrap)?;
        h.pool.admit(1, 100).map_err(candle_core::Error::wrap)?;
        Ok(h)
    };
    let whole = fresh()?
        .step(&[(9, other.narrow(0, 0, 50)?), (1, rows.clone())])?
        .narrow(0, 50, 100)?;
    let mut chunked = fresh()?;
    let mut parts = vec![];
    for (at, n) in [(0, 37), (37, 1), (38, 62)] {
        parts.push(chunked.step(&[(1, rows.narrow(0, at, n)?)])?);
    }
    let mut decoded = fresh()?;
    let mut steps = vec![decoded.step(&[(1, rows.narrow(0, 0, 40)?)])?];
    for t in 40..100 {
        let out = decoded.step(&[(9, other.narrow(0, t, 1)?), (1, rows.narrow(0, t, 1)?)])?;
        steps.push(out.narrow(0, 1, 1)?);
    }
    let mut worst = 0f32;
    for got in [Tensor::cat(&parts, 0)?, Tensor::cat(&steps, 0)?] {
        worst = worst.max(largest_difference(&whole, &got)?);
    }
    Ok(KernelCheck {
        op: "paged-attention-invariance".into(),
        shape: format!("{name}: 100 tokens whole, in 3 chunks, decoded after 40"),
        dtype: format!("{dtype:?}").to_lowercase(),
        largest_difference: worst,
        bar: 0.0,
        passed: worst == 0.0,
    })
}

/// The paged decoder on `device` over the fixture families of `fixtures` (tests/fixtures/llm:
/// random-weight Llama, Qwen2 and Qwen3 folders and transformers' greedy tokens for twelve
/// prompts each in `models.json`), in f32: its greedy tokens against transformers' (the share
/// that differ; bar: none), and [`decoder_invariance`]: 64 prompts' logits, and the next
/// step's, read alone against the same read in one batch and in chunks (bar: none of
/// difference).
pub fn check_decoders(device: &Device, fixtures: &std::path::Path) -> Result<Vec<KernelCheck>> {
    use super::super::load::FolderWeights;
    use super::decoder::PagedDecoder;
    let text = std::fs::read_to_string(fixtures.join("models.json"))?;
    let refs: serde_json::Value = serde_json::from_str(&text).map_err(candle_core::Error::wrap)?;
    let mut checks = vec![];
    for name in ["llama", "qwen2", "qwen3"] {
        let dir = fixtures.join("models").join(name);
        let (_, dims, mut weights) = FolderWeights::open(&dir).map_err(candle_core::Error::wrap)?;
        let model =
            PagedDecoder::load(dims, device, DType::F32, 16_384, |n, s| weights.read(n, s))?;
        let cases = refs["models"][name].as_array().cloned().unwrap_or_default();
        let prompts: Vec<Vec<u32>> = cases.iter().map(|c| token_ids(&c["prompt_ids"])).collect();
        if prompts.is_empty() || prompts.iter().any(|p| p.is_empty()) {
            candle_core::bail!(
                "{}: {name} has no prompts or an empty one",
                fixtures.display()
            );
        }
        let (differ, total) = greedy_against(&model, &cases, &prompts)?;
        let worst = decoder_invariance(&model, &prompts)?;
        let share = differ as f32 / total.max(1) as f32;
        checks.push(KernelCheck {
            op: "paged-decoder-greedy".into(),
            shape: format!(
                "{name}: {} prompts, {total} tokens against transformers f32",
                prompts.len()
            ),
            dtype: "f32".into(),
            largest_difference: share,
            bar: 0.0,
            passed: differ == 0,
        });
        checks.push(KernelCheck {
            op: "paged-decoder-invariance".into(),
            shape: format!(
                "{name}: {INVARIANCE_BATCH} prompts' logits alone, batched, in chunks of 17, and \
                 after a decode step"
            ),
            dtype: "f32".into(),
            largest_difference: worst,
            bar: 0.0,
            passed: worst == 0.0,
        });
    }
    Ok(checks)
}

/// How many sequences the decoder invariance check reads at once: the issue's "a sequence alone
/// against the same in a batch of 64".
const INVARIANCE_BATCH: usize = 64;

/// Each fixture case's prompt decoded greedily alone, its tokens against transformers' (the
/// case's `greedy`): how many differ, of how many.
fn greedy_against(
    model: &super::decoder::PagedDecoder,
    cases: &[serde_json::Value],
    prompts: &[Vec<u32>],
) -> Result<(usize, usize)> {
    let (mut differ, mut total) = (0usize, 0usize);
    for (i, (case, prompt)) in cases.iter().zip(prompts).enumerate() {
        let want = token_ids(&case["greedy"]);
        let seq = 1 + i as u64;
        model
            .admit(seq, prompt.len() + want.len())
            .map_err(candle_core::Error::wrap)?;
        let mut logits = model
            .forward(&[(seq, prompt.as_slice())], false)?
            .swap_remove(0);
        for (i, &w) in want.iter().enumerate() {
            let t = super::super::argmax(&logits);
            differ += usize::from(t != w);
            total += 1;
            if i + 1 < want.len() {
                logits = model.forward(&[(seq, &[t])], false)?.swap_remove(0);
            }
        }
        model.release(seq);
    }
    Ok((differ, total))
}

/// [`INVARIANCE_BATCH`] prompts made from the fixture's (each one's first `i / n` tokens left
/// out, so that no two are the same), each read alone, all in one batch, and each in chunks of
/// 17; then each sequence's greedy token decoded, alone and all in one step. The largest
/// difference of any logit from the same read alone (the bar is none).
fn decoder_invariance(model: &super::decoder::PagedDecoder, prompts: &[Vec<u32>]) -> Result<f32> {
    let n = prompts.len().max(1);
    let many: Vec<&[u32]> = (0..INVARIANCE_BATCH)
        .map(|i| {
            let p = &prompts[i % n];
            &p[(i / n).min(p.len().saturating_sub(1))..]
        })
        .collect();
    let feeds: Vec<(u64, &[u32])> = many
        .iter()
        .enumerate()
        .map(|(i, p)| (1000 + i as u64, *p))
        .collect();
    let batched = read_twice(model, &feeds, usize::MAX)?;
    let chunked = read_twice(model, &feeds, 17)?;
    let mut worst = 0f32;
    for (i, p) in many.iter().enumerate() {
        let alone = read_twice(model, &[(5000 + i as u64, *p)], usize::MAX)?;
        for other in [&batched, &chunked] {
            let pairs = [
                (&alone.prompt[0], &other.prompt[i]),
                (&alone.decoded[0], &other.decoded[i]),
            ];
            for (a, b) in pairs {
                let d = a.iter().zip(b).map(|(a, b)| (a - b).abs());
                worst = worst.max(d.fold(0f32, f32::max));
            }
        }
    }
    Ok(worst)
}

/// Each sequence's logits after its prompt and after one more step (its greedy token decoded).
struct TwoSteps {
    prompt: Vec<Vec<f32>>,
    decoded: Vec<Vec<f32>>,
}

/// [`TwoSteps`] of `feeds`, their prompts read together (`chunk` MAX) or one after another in
/// chunks of `chunk`, and their decode step taken together.
fn read_twice(
    model: &super::decoder::PagedDecoder,
    feeds: &[(u64, &[u32])],
    chunk: usize,
) -> Result<TwoSteps> {
    for (seq, p) in feeds {
        model
            .admit(*seq, p.len() + 1)
            .map_err(candle_core::Error::wrap)?;
    }
    let mut prompt = vec![];
    if chunk == usize::MAX {
        prompt = model.forward(feeds, false)?;
    } else {
        for (seq, p) in feeds {
            let mut last = vec![];
            for part in p.chunks(chunk) {
                last = model.forward(&[(*seq, part)], false)?;
            }
            prompt.extend(last);
        }
    }
    let next: Vec<[u32; 1]> = prompt.iter().map(|l| [super::super::argmax(l)]).collect();
    let steps: Vec<(u64, &[u32])> = feeds
        .iter()
        .zip(&next)
        .map(|((s, _), t)| (*s, &t[..]))
        .collect();
    let decoded = model.forward(&steps, false)?;
    for (seq, _) in feeds {
        model.release(*seq);
    }
    Ok(TwoSteps { prompt, decoded })
}

/// A JSON array of token ids.
fn token_ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_u64())
                .map(|x| x as u32)
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    /// On the CPU every check passes and the device side equals the reference exactly.
    #[test]
    fn every_paged_check_passes_on_the_cpu() {
        let checks = super::check_paged(&candle_core::Device::Cpu).unwrap();
        assert_eq!(checks.len(), 39);
        assert!(
            checks
                .iter()
                .all(|c| c.passed && c.largest_difference == 0.0),
            "{checks:?}"
        );
    }
}
