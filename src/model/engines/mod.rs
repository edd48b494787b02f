//! The engines: how a network is computed, each a network and nothing else; what goes in and
//! comes out of a model is its task's (`super::tasks`), not theirs.
//!
//! * text encoders, picked here ([`Engine`]) once the text is tokens: the fused CPU encoder of
//!   `crates/fused-cpu` (`fused`: no padding, its own pooling, its precision settled at load)
//!   and candle (`candle_bert`: padded batches on any candle device, pooled here in f32). Both
//!   give pooled vectors for embeddings and token rows for the task heads;
//! * image towers: candle's CLIP, SigLIP and ViT (`towers`), and CLIP's and ViT's image towers
//!   on the fused CPU kernels (`fused_images`);
//! * decoder LLMs (`decoder`): a GGUF file or a transformers folder on the fused CPU decoder,
//!   with its tokenizer, chat template, sampler and continuous-batching loop.

pub mod candle_bert;
#[cfg(feature = "cuda")]
mod cuda_device;
pub mod decoder;
pub mod fused;
pub mod fused_images;
mod host;
#[cfg(feature = "cuda")]
mod nvrtc;
pub mod towers;
pub mod unpadded;

use crate::model::spec::ModelSpec;
use crate::model::{CpuKernels, DeviceChoice, LoadOptions, ModelError, Precision, TokenIds};
use candle_bert::CandleBert;
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use spotinfer_fused_cpu::{self as fused_cpu, CpuBert, Pooling};
use std::sync::Mutex;
use std::time::Instant;
use unpadded::UnpaddedBert;

/// The code that runs the encoder and pools.
pub(super) enum Engine {
    /// The fused CPU encoder (it pools itself).
    Fused(Box<CpuBert>),
    /// The candle encoder, on any candle device, its pooling, and where its batches' time goes
    /// when that is measured ([`DeviceStages`]).
    Candle(CandleBert, Pooling, Option<Mutex<DeviceStages>>),
    /// The candle encoder on packed batches (`unpadded`: fused kernels on CUDA; opt-in).
    Unpadded(UnpaddedBert, Pooling, Option<Mutex<DeviceStages>>),
}

/// Where the candle encoder's batches spend their time, summed over batches: each stage ends
/// with a device synchronisation, so on CUDA (whose kernels run asynchronously) a stage's
/// seconds are its own and not the next one's. Measured only when asked (`spotinfer bench
/// --profile-device`): the synchronisations keep the host from queueing the next stage's
/// kernels while the device works, so a profiled run is a little slower than a plain one.
#[derive(Debug, Default, Clone, Copy, PartialEq, serde::Serialize)]
pub struct DeviceStages {
    /// Encoder batches profiled.
    pub batches: u64,
    /// Seconds padding the batch's tokens on the host and copying them to the device.
    pub inputs_s: f64,
    /// Seconds the encoder's layers computed.
    pub encoder_s: f64,
    /// Seconds pooling (or cutting out the token rows) and copying the results back.
    pub outputs_s: f64,
}

impl DeviceStages {
    /// What was measured since `earlier` (a run's figures without its warm-up's).
    pub fn since(&self, earlier: &Self) -> Self {
        Self {
            batches: self.batches - earlier.batches,
            inputs_s: self.inputs_s - earlier.inputs_s,
            encoder_s: self.encoder_s - earlier.encoder_s,
            outputs_s: self.outputs_s - earlier.outputs_s,
        }
    }
}

/// Times one batch's stages into a [`DeviceStages`], or nothing when none is kept.
struct StageClock<'a> {
    stages: Option<(&'a Mutex<DeviceStages>, &'a Device)>,
    lap: Instant,
}

impl<'a> StageClock<'a> {
    fn start(stages: &'a Option<Mutex<DeviceStages>>, device: &'a Device) -> Self {
        Self {
            stages: stages.as_ref().map(|s| (s, device)),
            lap: Instant::now(),
        }
    }

    /// Ends a stage: waits for the device, then adds the time since the last lap to `field`.
    fn lap(&mut self, field: fn(&mut DeviceStages) -> &mut f64) -> Result<(), ModelError> {
        let Some((stages, device)) = self.stages else {
            return Ok(());
        };
        device.synchronize()?;
        let seconds = self.lap.elapsed().as_secs_f64();
        if let Ok(mut s) = stages.lock() {
            *field(&mut s) += seconds;
        }
        self.lap = Instant::now();
        Ok(())
    }

    /// Counts the batch.
    fn done(self) {
        if let Some(Ok(mut s)) = self.stages.map(|(s, _)| s.lock()) {
            s.batches += 1;
        }
    }
}

impl Engine {
    /// Starts measuring where the candle encoder's batches spend their time (see
    /// [`DeviceStages`]); the fused encoder has no device stages to measure.
    pub(super) fn profile_stages(&mut self) {
        if let Self::Candle(_, _, stages) | Self::Unpadded(_, _, stages) = self {
            *stages = Some(Mutex::new(DeviceStages::default()));
        }
    }

    /// The stages measured so far, if they are measured.
    pub(super) fn stages(&self) -> Option<DeviceStages> {
        match self {
            Self::Candle(_, _, Some(stages)) | Self::Unpadded(_, _, Some(stages)) => {
                stages.lock().ok().map(|s| *s)
            }
            _ => None,
        }
    }

    /// One encoder batch through whichever encoder is loaded: pooled vectors.
    pub(super) fn encode(&self, batch: &[(&TokenIds, usize)]) -> Result<Vec<Vec<f32>>, ModelError> {
        match self {
            Self::Fused(bert) => {
                let batch: Vec<fused_cpu::Tokens<'_>> = batch
                    .iter()
                    .map(|(e, skip)| fused_cpu::Tokens {
                        ids: &e.ids,
                        type_ids: &e.type_ids,
                        skip: *skip,
                    })
                    .collect();
                Ok(bert.embed(&batch)?)
            }
            Self::Candle(model, pooling, stages) => candle_embed(model, *pooling, batch, stages),
            Self::Unpadded(model, pooling, stages) => {
                let mut clock = StageClock::start(stages, model.device());
                let packed = unpadded::Packed::new(batch.iter().map(|(e, _)| *e), model)?;
                let starts = packed.starts.clone();
                clock.lap(|s| &mut s.inputs_s)?;
                let hidden = model.run(packed)?;
                clock.lap(|s| &mut s.encoder_s)?;
                let skips: Vec<usize> = batch.iter().map(|(_, skip)| *skip).collect();
                let vectors = unpadded::pool(&hidden, &starts, *pooling, &skips)?;
                let vectors = vectors.to_vec2::<f32>()?;
                clock.lap(|s| &mut s.outputs_s)?;
                clock.done();
                Ok(vectors)
            }
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
                let batch: Vec<fused_cpu::Tokens<'_>> = batch
                    .iter()
                    .map(|e| fused_cpu::Tokens {
                        ids: &e.ids,
                        type_ids: &e.type_ids,
                        skip: 0,
                    })
                    .collect();
                Ok(bert.token_rows(&batch, first_only)?)
            }
            Self::Candle(model, _, stages) => {
                let mut clock = StageClock::start(stages, model.device());
                let (ids, types, mask, _) = padded(batch.iter().map(|e| (*e, 0)), model.device())?;
                clock.lap(|s| &mut s.inputs_s)?;
                let hidden = model.forward(&ids, &types, &mask)?;
                clock.lap(|s| &mut s.encoder_s)?;
                let mut hidden = hidden.to_dtype(DType::F32)?;
                if first_only {
                    hidden = hidden.narrow(1, 0, 1)?;
                }
                // One copy off the device for the whole batch, then each text's real rows.
                let hidden = hidden.to_vec3::<f32>()?;
                clock.lap(|s| &mut s.outputs_s)?;
                clock.done();
                Ok(batch
                    .iter()
                    .zip(hidden)
                    .map(|(e, rows)| {
                        let keep = if first_only { 1 } else { e.len() };
                        rows.into_iter().take(keep).flatten().collect()
                    })
                    .collect())
            }
            Self::Unpadded(model, _, stages) => {
                let mut clock = StageClock::start(stages, model.device());
                let packed = unpadded::Packed::new(batch.iter().copied(), model)?;
                let starts = packed.starts.clone();
                clock.lap(|s| &mut s.inputs_s)?;
                let hidden = model.run(packed)?;
                clock.lap(|s| &mut s.encoder_s)?;
                let rows = unpadded::token_rows(&hidden, &starts, first_only)?;
                clock.lap(|s| &mut s.outputs_s)?;
                clock.done();
                Ok(rows)
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
    stages: &Option<Mutex<DeviceStages>>,
) -> Result<Vec<Vec<f32>>, ModelError> {
    let mut clock = StageClock::start(stages, model.device());
    let (ids, types, mask, pooled) = padded(batch.iter().copied(), model.device())?;
    clock.lap(|s| &mut s.inputs_s)?;
    let hidden = model.forward(&ids, &types, &mask)?; // (n, len, dim)
    clock.lap(|s| &mut s.encoder_s)?;
    let firsts: Vec<usize> = batch
        .iter()
        .map(|(e, skip)| if *skip < e.len() { *skip } else { 0 })
        .collect();
    let vectors = candle_bert::pool(&hidden, &pooled, pooling, &firsts)?.to_vec2::<f32>()?;
    clock.lap(|s| &mut s.outputs_s)?;
    clock.done();
    Ok(vectors)
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
    let mut bert = CpuBert::load(&spec.weights, fused::dims(&spec.encoder), spec.pooling.mode)?;
    if options.cpu_kernels != CpuKernels::Auto {
        bert.limit_to(options.cpu_kernels.widest())?;
    }
    Ok(Engine::Fused(Box::new(bert)))
}

/// Why an encoder refuses `--precision gguf`.
pub(crate) const GGUF_ONLY: &str =
    "--precision gguf is a GGUF generation model's; an encoder computes in f32, f16, bf16 or int8";

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
        Precision::Gguf => Err(ModelError::Precision(GGUF_ONLY.into())),
    }
}

/// The candle encoder on `device`, its weights converted to `dtype`.
pub(super) fn load_candle(
    spec: &ModelSpec,
    device: &Device,
    dtype: DType,
) -> Result<Engine, ModelError> {
    let bert = candle_bert(spec, device, dtype)?;
    Ok(Engine::Candle(bert, spec.pooling.mode, None))
}

/// The padded candle encoder's weights, read once for either candle engine.
fn candle_bert(spec: &ModelSpec, device: &Device, dtype: DType) -> Result<CandleBert, ModelError> {
    let path = spec.weights.clone();
    let bytes = std::fs::read(&path).map_err(|source| ModelError::File { path, source })?;
    let vb = VarBuilder::from_buffered_safetensors(bytes, dtype, device)?;
    Ok(CandleBert::load(vb, &spec.encoder)?)
}

/// The unpadded encoder on `device`, its weights converted to `dtype` (the padded encoder's
/// loading, then the same tensors arranged for packed batches), with CUDA graphs per bucket
/// when `cuda_graphs`.
pub(super) fn load_unpadded(
    spec: &ModelSpec,
    device: &Device,
    dtype: DType,
    cuda_graphs: bool,
) -> Result<Engine, ModelError> {
    if cuda_graphs && device.is_cuda() {
        // Its one run on a GPU (an H200, 2026-11-27, bench/gpu-check.sh): `embed` of 4,000 texts
        // had not finished when the check's time ran out, where the same without graphs had.
        tracing::warn!(
            "--backend unpadded-graphs has not yet finished a GPU check: on an H200 it did not \
             finish 4,000 texts before the check's time ran out, where the plain unpadded path \
             had; --backend unpadded is the checked path"
        );
    }
    let bert = candle_bert(spec, device, dtype)?;
    let model = UnpaddedBert::new(&bert, cuda_graphs).map_err(|e| ModelError::Config {
        path: spec.dir.clone(),
        message: e.to_string(),
    })?;
    Ok(Engine::Unpadded(model, spec.pooling.mode, None))
}

/// Every operation of the unpadded encoder at the shapes of the model folder `dir`, on the device
/// `choice` names, in f32, f16 and bf16, against its CPU reference (`unpadded::check`); for a
/// CLIP or ViT folder, its unpadded image tower against candle's ([`towers::check_unpadded_tower`]).
pub fn check_unpadded_kernels(
    dir: &std::path::Path,
    choice: DeviceChoice,
    lengths: &[usize],
) -> Result<Vec<unpadded::check::KernelCheck>, ModelError> {
    let device = select_device(choice)?;
    let config = crate::model::spec::read_optional(&dir.join("config.json"))?;
    // The architectures with an image tower on the unpadded operations (CLIP, ViT).
    if fused_images::vision_dims(dir, &config)?.is_some() {
        return towers::check_unpadded_tower(dir, &device);
    }
    let spec = ModelSpec::read(dir)?;
    let shapes = unpadded::check::Shapes {
        hidden: spec.encoder.hidden,
        heads: spec.encoder.heads,
        intermediate: spec.encoder.intermediate,
    };
    let mut checks = vec![];
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        checks.extend(unpadded::check::check_kernels(
            &device, dtype, shapes, lengths,
        )?);
    }
    Ok(checks)
}

/// The paged KV cache's operations on the device `choice` names against their references, and
/// their batch invariance there (`decoder::paged::check`); with the LLM fixtures' folder
/// (`tests/fixtures/llm`) as `fixtures`, the paged decoder's greedy tokens against transformers'
/// and its logits' invariance on that device too.
pub fn check_paged_kernels(
    choice: DeviceChoice,
    fixtures: &std::path::Path,
) -> Result<Vec<unpadded::check::KernelCheck>, ModelError> {
    let device = select_device(choice)?;
    let mut checks = decoder::paged::check::check_paged(&device)?;
    if fixtures.join("models.json").is_file() {
        checks.extend(decoder::paged::check::check_decoders(&device, fixtures)?);
    }
    Ok(checks)
}

/// GPU 0, set up for the engines (`cuda_device`), or why there is none (a binary built without
/// the `cuda` feature, no driver, no device).
fn open_cuda() -> Result<Device, ModelError> {
    #[cfg(feature = "cuda")]
    return cuda_device::open(0).map_err(|e| ModelError::NoCuda(e.to_string()));
    #[cfg(not(feature = "cuda"))]
    Err(ModelError::NoCuda(
        "this binary was built without the `cuda` feature".into(),
    ))
}

/// The candle device `choice` names; an error when CUDA is asked for and cannot be had.
pub(super) fn select_device(choice: DeviceChoice) -> Result<Device, ModelError> {
    match choice {
        DeviceChoice::Cpu => Ok(Device::Cpu),
        DeviceChoice::Auto => Ok(open_cuda().unwrap_or(Device::Cpu)),
        DeviceChoice::Cuda => open_cuda(),
    }
}
