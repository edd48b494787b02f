//! The engines: how a network is computed once the text is tokens. The fused CPU encoder of
//! `crates/bert-cpu` (no padding, its own pooling) and candle (padded batches on any candle
//! device, pooled here in f32); what goes in and comes out of the model is the task's
//! (`super::task`), not theirs. Both give pooled vectors for embeddings and token rows for the
//! task heads.

use super::candle_bert::{self, CandleBert};
use super::spec::ModelSpec;
use super::{CpuKernels, DeviceChoice, LoadOptions, ModelError, Precision, TokenIds};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use spotinfer_bert_cpu::{self as bert_cpu, CpuBert, Pooling};

/// The code that runs the encoder and pools.
pub(super) enum Engine {
    /// The fused CPU encoder (it pools itself).
    Fused(Box<CpuBert>),
    /// The candle encoder, on any candle device, and its pooling.
    Candle(CandleBert, Pooling),
}

impl Engine {
    /// One encoder batch through whichever encoder is loaded: pooled vectors.
    pub(super) fn encode(&self, batch: &[(&TokenIds, usize)]) -> Result<Vec<Vec<f32>>, ModelError> {
        match self {
            Self::Fused(bert) => {
                let batch: Vec<bert_cpu::Tokens<'_>> = batch
                    .iter()
                    .map(|(e, skip)| bert_cpu::Tokens {
                        ids: &e.ids,
                        type_ids: &e.type_ids,
                        skip: *skip,
                    })
                    .collect();
                Ok(bert.embed(&batch)?)
            }
            Self::Candle(model, pooling) => candle_embed(model, *pooling, batch),
        }
    }

    /// One encoder batch's last hidden state, per text `(tokens, hidden)` row-major in f32: every
    /// token's row, or with `first_only` the first token's, for the task heads.
    pub(super) fn token_rows(
        &self,
        batch: &[&TokenIds],
        first_only: bool,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        match self {
            Self::Fused(bert) => {
                let batch: Vec<bert_cpu::Tokens<'_>> = batch
                    .iter()
                    .map(|e| bert_cpu::Tokens {
                        ids: &e.ids,
                        type_ids: &e.type_ids,
                        skip: 0,
                    })
                    .collect();
                Ok(bert.token_rows(&batch, first_only)?)
            }
            Self::Candle(model, _) => {
                let (ids, types, mask, _) = padded(batch.iter().map(|e| (*e, 0)), model.device())?;
                let mut hidden = model.forward(&ids, &types, &mask)?.to_dtype(DType::F32)?;
                if first_only {
                    hidden = hidden.narrow(1, 0, 1)?;
                }
                // One copy off the device for the whole batch, then each text's real rows.
                let hidden = hidden.to_vec3::<f32>()?;
                Ok(batch
                    .iter()
                    .zip(hidden)
                    .map(|(e, rows)| {
                        let keep = if first_only { 1 } else { e.len() };
                        rows.into_iter().take(keep).flatten().collect()
                    })
                    .collect())
            }
        }
    }
}

/// A batch padded to its longest text as candle takes it: ids, type ids, the attention mask
/// (1 for a real token) and the pooling mask (1 for a token pooled: real and past its skip),
/// each `(n, len)` u32 on `device`.
fn padded<'a>(
    batch: impl ExactSizeIterator<Item = (&'a TokenIds, usize)> + Clone,
    device: &Device,
) -> Result<(Tensor, Tensor, Tensor, Tensor), ModelError> {
    let n = batch.len();
    let len = batch.clone().map(|(e, _)| e.len()).max().unwrap_or(0);
    let mut ids = vec![0u32; n * len];
    let mut types = vec![0u32; n * len];
    let mut mask = vec![0u32; n * len];
    let mut pooled = vec![0u32; n * len];
    for (i, (e, skip)) in batch.enumerate() {
        let row = i * len..i * len + e.len();
        ids[row.clone()].copy_from_slice(&e.ids);
        types[row.clone()].copy_from_slice(&e.type_ids);
        mask[row.clone()].fill(1);
        pooled[row.start + skip.min(e.len())..row.end].fill(1);
    }
    let tensor = |v: Vec<u32>| Tensor::from_vec(v, (n, len), device);
    Ok((tensor(ids)?, tensor(types)?, tensor(mask)?, tensor(pooled)?))
}

/// The candle encoder on a padded batch (to the longest text), pooled over each text's pooled
/// tokens in f32.
fn candle_embed(
    model: &CandleBert,
    pooling: Pooling,
    batch: &[(&TokenIds, usize)],
) -> Result<Vec<Vec<f32>>, ModelError> {
    let (ids, types, mask, pooled) = padded(batch.iter().copied(), model.device())?;
    let hidden = model.forward(&ids, &types, &mask)?; // (n, len, dim)
    let firsts: Vec<usize> = batch
        .iter()
        .map(|(e, skip)| if *skip < e.len() { *skip } else { 0 })
        .collect();
    Ok(candle_bert::pool(&hidden, &pooled, pooling, &firsts)?.to_vec2::<f32>()?)
}

/// The fused CPU encoder, which computes in f32 on the CPU only.
pub(super) fn load_fused(
    spec: &ModelSpec,
    device: &Device,
    options: &LoadOptions,
) -> Result<Engine, ModelError> {
    let refuse = |message: &str| ModelError::Config {
        path: spec.dir.clone(),
        message: message.into(),
    };
    if !device.is_cpu() {
        return Err(refuse(
            "the fused backend runs on the CPU only (use --backend candle)",
        ));
    }
    if options.precision == Precision::F16 {
        return Err(ModelError::Precision(
            "the fused backend computes in f32, bf16 or int8, not f16 (use --backend candle for f16)"
                .into(),
        ));
    }
    let mut bert = CpuBert::load(
        &spec.weights,
        super::fused::dims(&spec.encoder),
        spec.pooling.mode,
    )?;
    if options.cpu_kernels == CpuKernels::Avx2 {
        bert.limit_to_avx2()?;
    }
    Ok(Engine::Fused(Box::new(bert)))
}

/// The candle encoder's dtype for `precision`: auto is f16 on CUDA and f32 on the CPU.
pub(super) fn candle_dtype(precision: Precision, device: &Device) -> Result<DType, ModelError> {
    match precision {
        Precision::F32 => Ok(DType::F32),
        Precision::F16 => Ok(DType::F16),
        Precision::Auto if device.is_cpu() => Ok(DType::F32),
        Precision::Auto => Ok(DType::F16),
        Precision::Bf16 | Precision::Int8 => Err(ModelError::Precision(
            "bf16 and int8 are the fused CPU encoder's (--backend fused); candle computes in f32 \
             or f16"
                .into(),
        )),
    }
}

/// The candle encoder on `device`, its weights converted to `dtype`.
pub(super) fn load_candle(
    spec: &ModelSpec,
    device: &Device,
    dtype: DType,
) -> Result<Engine, ModelError> {
    let path = spec.weights.clone();
    let bytes = std::fs::read(&path).map_err(|source| ModelError::File { path, source })?;
    let vb = VarBuilder::from_buffered_safetensors(bytes, dtype, device)?;
    Ok(Engine::Candle(
        CandleBert::load(vb, &spec.encoder)?,
        spec.pooling.mode,
    ))
}

/// The candle device `choice` names; an error when CUDA is asked for and cannot be had.
pub(super) fn select_device(choice: DeviceChoice) -> Result<Device, ModelError> {
    match choice {
        DeviceChoice::Cpu => Ok(Device::Cpu),
        DeviceChoice::Auto => Ok(Device::cuda_if_available(0).unwrap_or(Device::Cpu)),
        DeviceChoice::Cuda => {
            if !candle_core::utils::cuda_is_available() {
                return Err(ModelError::NoCuda(
                    "this binary was built without the `cuda` feature".into(),
                ));
            }
            Device::new_cuda(0).map_err(|e| ModelError::NoCuda(e.to_string()))
        }
    }
}
