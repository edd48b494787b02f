//! The model layer: text in, unit vectors out, exactly as sentence-transformers computes them.
//!
//! [`Embedder`] tokenizes (truncating at the model's `max_seq_length`: 256 for all-MiniLM-L6-v2,
//! not the 128 baked into the package's tokenizer.json), runs an encoder, mean-pools over the
//! attention mask and L2-normalises. Two encoders sit behind it:
//!
//! * `fused`: the CPU encoder of `crates/bert-cpu`, written for throughput (no padding, fused
//!   passes, reused buffers), the CPU default;
//! * `candle_bert`: candle on CUDA (f16 by default) and on the CPU as the reference the fused
//!   one is measured against.
//!
//! [`ModelHandle`] (in `thread`) runs an `Embedder` on its own OS thread; [`offline`] embeds and
//! benchmarks whole files without the pipeline.

mod budget;
mod candle_bert;
mod fused;
pub mod offline;
mod prefix;
mod thread;

pub use thread::{ModelHandle, Reply};

use crate::config::{Backend, DeviceChoice, Precision};
use candle_bert::CandleBert;
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::bert::Config as BertConfig;
use spotinfer_bert_cpu::{self as bert_cpu, CpuBert};
use std::path::{Path, PathBuf};
use tokenizers::Tokenizer;

/// Errors loading or running the model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A model file is missing or unreadable.
    #[error("cannot read model file {path}: {source} (fetch the model with scripts/fetch-model.sh, or set SPOTINFER_MODEL)")]
    File {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A model config file is not what this backend understands.
    #[error("invalid model config {path}: {message}")]
    Config {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The tokenizer failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// candle failed (weights, device or compute).
    #[error("model: {0}")]
    Candle(#[from] candle_core::Error),
    /// CUDA was requested but this build or machine has none.
    #[error("CUDA requested but unavailable: {0}")]
    NoCuda(String),
    /// The model thread is gone (it panicked or was shut down).
    #[error("the model thread is not running")]
    Stopped,
    /// A batch the model cannot take (it never reaches the model from the tokenizer).
    #[error("invalid model input: {0}")]
    Input(String),
    /// The model panicked on a batch.
    #[error("the model panicked: {0}")]
    Panic(String),
    /// The model computed a vector with NaN or infinite values: refused, never written.
    #[error(
        "the model computed a non-finite vector (NaN or infinity) for input {index} of the batch"
    )]
    NonFinite {
        /// Which input of the batch.
        index: usize,
    },
}

/// What the loaded model is, for result rows and logs.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// Model name (the model directory's name).
    pub name: String,
    /// Embedding dimension.
    pub dim: usize,
    /// Token limit per text.
    pub max_seq_len: usize,
    /// Device in words.
    pub device: String,
}

/// The embeddings of one batch, in input order.
#[derive(Debug, Clone)]
pub struct Embedded {
    /// One unit-length vector per input text.
    pub vectors: Vec<Vec<f32>>,
    /// Real (unpadded) tokens embedded, for throughput figures.
    pub tokens: usize,
    /// Seconds the model computed (tokenizer included), without time queued.
    pub seconds: f64,
}

/// A loaded sentence-embedding model.
pub struct Embedder {
    backend: Engine,
    tokenizer: Tokenizer,
    info: ModelInfo,
    /// Most padded tokens in one encoder batch (0: no limit); see `budget`.
    max_batch_tokens: usize,
}

/// The code that runs the BERT encoder.
enum Engine {
    /// The fused CPU encoder.
    Fused(Box<CpuBert>),
    /// The candle encoder, on any candle device.
    Candle(CandleBert),
}

impl Embedder {
    /// Loads the model from a local directory, checking every file it needs up front so a
    /// missing or broken model is a clear error at startup.
    pub fn load(dir: &Path, device: DeviceChoice) -> Result<Self, ModelError> {
        Self::load_with(dir, device, Backend::Auto)
    }

    /// [`Embedder::load`] with a chosen backend: `auto` is the fused encoder on the CPU and
    /// candle on CUDA.
    pub fn load_with(
        dir: &Path,
        device: DeviceChoice,
        backend: Backend,
    ) -> Result<Self, ModelError> {
        Self::load_as(dir, device, backend, Precision::Auto)
    }

    /// [`Embedder::load_with`] with a chosen precision for the encoder's matrix products:
    /// `auto` is f16 on CUDA and f32 on the CPU; pooling and normalisation are always f32.
    pub fn load_as(
        dir: &Path,
        device: DeviceChoice,
        backend: Backend,
        precision: Precision,
    ) -> Result<Self, ModelError> {
        let device = select_device(device)?;
        let config_path = dir.join("config.json");
        let config: BertConfig = read_json(&config_path)?;
        let max_seq_len = max_seq_len(dir, &config)?;
        check_pooling(dir)?;
        let tokenizer = load_tokenizer(dir, max_seq_len)?;
        let dtype = match precision {
            Precision::F32 => DType::F32,
            Precision::F16 => DType::F16,
            Precision::Auto if device.is_cpu() => DType::F32,
            Precision::Auto => DType::F16,
        };
        let fused = match backend {
            Backend::Fused => true,
            Backend::Candle => false,
            Backend::Auto => device.is_cpu(),
        };
        let backend = if fused {
            load_fused(dir, &config, &device, dtype)?
        } else {
            load_candle(dir, &config, &device, dtype)?
        };
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into());
        let info = ModelInfo {
            name,
            dim: config.hidden_size,
            max_seq_len,
            device: match backend {
                Engine::Fused(_) => "Cpu (fused)".into(),
                Engine::Candle(_) => format!("{device:?} (candle, {dtype:?})"),
            },
        };
        Ok(Self {
            backend,
            tokenizer,
            info,
            max_batch_tokens: 0,
        })
    }

    /// Splits every batch into encoder batches of at most `tokens` padded tokens (0: no limit).
    pub fn with_max_batch_tokens(mut self, tokens: usize) -> Self {
        self.max_batch_tokens = tokens;
        self
    }

    /// What the model is.
    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// Counts the tokens each text becomes (after truncation), without running the model.
    pub fn token_counts(&self, texts: &[&str]) -> Result<Vec<usize>, ModelError> {
        Ok(self.tokenize(texts)?.iter().map(|e| e.len()).collect())
    }

    /// The texts as the model sees them: special tokens added, truncated, not padded.
    ///
    /// A long text is tokenized by its prefix (see [`prefix`]): the model keeps only its first
    /// `max_seq_len` tokens, so a 1 MiB text costs what a few KiB cost, with the same tokens.
    pub fn tokenize(&self, texts: &[&str]) -> Result<Vec<tokenizers::Encoding>, ModelError> {
        let encode_error = |e: tokenizers::Error| ModelError::Tokenizer(e.to_string());
        let max_len = self.info.max_seq_len;
        let first = prefix::initial_bytes(max_len);
        let cuts: Vec<prefix::Cut<'_>> = texts.iter().map(|t| prefix::cut(t, first)).collect();
        let mut encodings = self
            .tokenizer
            .encode_batch(cuts.iter().map(|c| c.text).collect::<Vec<_>>(), true)
            .map_err(encode_error)?;
        for (i, mut cut) in cuts.into_iter().enumerate() {
            // Grow the prefix until it yields the model's full window at a word boundary (then
            // the rest of the text cannot change the kept tokens), or is the whole text.
            let mut limit = first;
            while !cut.settles(encodings[i].len(), max_len) {
                limit = limit.saturating_mul(2);
                cut = prefix::cut(texts[i], limit);
                encodings[i] = self
                    .tokenizer
                    .encode(cut.text, true)
                    .map_err(encode_error)?;
            }
        }
        Ok(encodings)
    }

    /// Embeds a batch: tokenize, BERT, mean pooling, L2 normalisation.
    pub fn embed(&self, texts: &[&str]) -> Result<Embedded, ModelError> {
        if texts.is_empty() {
            return Ok(Embedded {
                vectors: Vec::new(),
                tokens: 0,
                seconds: 0.0,
            });
        }
        let started = std::time::Instant::now();
        let encodings = self.tokenize(texts)?;
        let lens: Vec<usize> = encodings.iter().map(|e| e.len()).collect();
        let mut vectors = vec![Vec::new(); encodings.len()];
        for chunk in budget::token_budget_chunks(&lens, self.max_batch_tokens) {
            let part: Vec<&tokenizers::Encoding> = chunk.iter().map(|&i| &encodings[i]).collect();
            for (i, v) in chunk.into_iter().zip(self.encode(&part)?) {
                vectors[i] = v;
            }
        }
        if let Some(index) = vectors
            .iter()
            .position(|v| v.iter().any(|x| !x.is_finite()))
        {
            return Err(ModelError::NonFinite { index });
        }
        let tokens = lens.iter().sum();
        Ok(Embedded {
            vectors,
            tokens,
            seconds: started.elapsed().as_secs_f64(),
        })
    }

    /// One encoder batch through whichever encoder is loaded.
    fn encode(&self, encodings: &[&tokenizers::Encoding]) -> Result<Vec<Vec<f32>>, ModelError> {
        match &self.backend {
            Engine::Fused(bert) => {
                let batch: Vec<bert_cpu::Tokens<'_>> = encodings
                    .iter()
                    .map(|e| bert_cpu::Tokens {
                        ids: e.get_ids(),
                        type_ids: e.get_type_ids(),
                    })
                    .collect();
                Ok(bert.embed(&batch)?)
            }
            Engine::Candle(model) => candle_embed(model, encodings),
        }
    }
}

/// The candle encoder on a padded batch (to the longest text), mean-pooled over the attention
/// mask and normalised in f32.
fn candle_embed(
    model: &CandleBert,
    encodings: &[&tokenizers::Encoding],
) -> Result<Vec<Vec<f32>>, ModelError> {
    let n = encodings.len();
    let len = encodings.iter().map(|e| e.len()).max().unwrap_or(0);
    let mut ids = vec![0u32; n * len];
    let mut types = vec![0u32; n * len];
    let mut mask = vec![0u32; n * len];
    for (i, e) in encodings.iter().enumerate() {
        let row = i * len..i * len + e.len();
        ids[row.clone()].copy_from_slice(e.get_ids());
        types[row.clone()].copy_from_slice(e.get_type_ids());
        mask[row].fill(1);
    }
    let device = model.device();
    let ids = Tensor::from_vec(ids, (n, len), device)?;
    let types = Tensor::from_vec(types, (n, len), device)?;
    let mask = Tensor::from_vec(mask, (n, len), device)?;
    let hidden = model.forward(&ids, &types, &mask)?; // (n, len, dim)
    let pooled = candle_bert::mean_pool(&hidden, &mask)?;
    Ok(candle_bert::l2_normalize(&pooled)?.to_vec2::<f32>()?)
}

/// The token limit: `sentence_bert_config.json`'s `max_seq_length`, never past the positions the
/// model has.
fn max_seq_len(dir: &Path, config: &BertConfig) -> Result<usize, ModelError> {
    let st: serde_json::Value = read_json(&dir.join("sentence_bert_config.json"))?;
    Ok(st
        .get("max_seq_length")
        .and_then(|v| v.as_u64())
        .map(|v| v as usize)
        .unwrap_or(config.max_position_embeddings)
        .min(config.max_position_embeddings))
}

/// Refuses pooling this layer does not compute.
fn check_pooling(dir: &Path) -> Result<(), ModelError> {
    let path = dir.join("1_Pooling").join("config.json");
    let pooling: serde_json::Value = read_json(&path)?;
    if pooling.get("pooling_mode_mean_tokens") != Some(&serde_json::Value::Bool(true)) {
        return Err(ModelError::Config {
            path,
            message: "only mean-token pooling is supported".into(),
        });
    }
    Ok(())
}

/// The model's tokenizer, truncating at `max_seq_len` and not padding.
fn load_tokenizer(dir: &Path, max_seq_len: usize) -> Result<Tokenizer, ModelError> {
    let path = dir.join("tokenizer.json");
    if !path.is_file() {
        return Err(ModelError::File {
            path,
            source: std::io::ErrorKind::NotFound.into(),
        });
    }
    let mut tokenizer = Tokenizer::from_file(&path)
        .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", path.display())))?;
    // The package's tokenizer.json truncates at 128 and pads to a fixed 128;
    // sentence-transformers truncates at max_seq_length and pads to the batch's longest.
    // The fused encoder takes texts unpadded; the candle path pads them itself.
    let mut truncation = tokenizer.get_truncation().cloned().unwrap_or_default();
    truncation.max_length = max_seq_len;
    tokenizer
        .with_truncation(Some(truncation))
        .map_err(|e| ModelError::Tokenizer(e.to_string()))?
        .with_padding(None);
    Ok(tokenizer)
}

/// The fused CPU encoder, which computes in f32 on the CPU only.
fn load_fused(
    dir: &Path,
    config: &BertConfig,
    device: &Device,
    dtype: DType,
) -> Result<Engine, ModelError> {
    let refuse = |message: &str| ModelError::Config {
        path: dir.to_path_buf(),
        message: message.into(),
    };
    if !device.is_cpu() {
        return Err(refuse(
            "the fused backend runs on the CPU only (use --backend candle)",
        ));
    }
    if dtype != DType::F32 {
        return Err(refuse(
            "the fused backend computes in f32 only (use --precision f32, or --backend candle)",
        ));
    }
    let dims = fused::bert_dims(config, &dir.join("config.json"))?;
    let bert = CpuBert::load(&dir.join("model.safetensors"), dims)?;
    Ok(Engine::Fused(Box::new(bert)))
}

/// The candle encoder on `device`, its weights converted to `dtype`.
fn load_candle(
    dir: &Path,
    config: &BertConfig,
    device: &Device,
    dtype: DType,
) -> Result<Engine, ModelError> {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).map_err(|source| ModelError::File { path, source })?;
    let vb = VarBuilder::from_buffered_safetensors(bytes, dtype, device)?;
    Ok(Engine::Candle(CandleBert::load(vb, config)?))
}

fn select_device(choice: DeviceChoice) -> Result<Device, ModelError> {
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

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, ModelError> {
    let bytes = std::fs::read(path).map_err(|source| ModelError::File {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_slice(&bytes).map_err(|e| ModelError::Config {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

/// Cosine similarity of two vectors (1.0 for identical directions).
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let na: f32 = a.iter().map(|x| x * x).sum::<f32>().sqrt();
    let nb: f32 = b.iter().map(|x| x * x).sum::<f32>().sqrt();
    dot / (na * nb).max(f32::MIN_POSITIVE)
}
